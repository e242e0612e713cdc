"""The steps a character automaton (`core.regex_grammar.Regex`, `core.ebnf_grammar.Grammar`) has taken, kept: (state,
character) -> the state after, each state held once. Guided decoding steps the automaton of every guided row for each
token it checks, mostly on the same few states, so a step is computed once.

The caches of every automaton in the process share one budget (`BUDGET` units: a state's size in its automaton's
places, plus one per step kept), besides each cache's own bounds: the compilers keep the last 64 automata each, and a
cache of each at its own bound would hold gigabytes. A cache that would pass the budget empties the others first, the
one that grew least recently first, then itself. An emptied cache starts over: its automaton computes its steps again.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

BUDGET = 6_000_000  # units held by every cache in the process together

S = TypeVar("S", bound=Hashable)
MISSING = object()  # `StepCache.get`: no step kept
_lock = threading.Lock()
# the caches holding anything, least recently grown first: key -> (a weak reference, the units it holds)
_holders: OrderedDict[int, tuple[weakref.ref, int]] = OrderedDict()
_total = [0]
_keys = itertools.count()  # (a cache's key: an id() may be reused by a cache made after one freed is settled)


def held_total() -> int:
    """The units every cache in the process holds together."""
    with _lock:
        _settle()
        return _total[0]


_dead: list[int] = []  # the caches freed since (a finalizer may run anywhere, the lock held too: it only notes)


def _gone(key: int) -> None:
    _dead.append(key)


def _settle() -> None:
    """Forget the caches freed (the lock held)."""
    while _dead:
        got = _holders.pop(_dead.pop(), None)
        if got is not None:
            _total[0] -= got[1]


class StepCache(Generic[S]):
    """One automaton's steps. `max_places`: the places its states may hold, `max_steps`: the steps it may keep; past
    either it starts over."""

    def __init__(self, max_places: int, max_steps: int) -> None:
        self.max_places, self.max_steps = max_places, max_steps
        self._steps: dict[tuple[S, int], S | None] = {}
        self._states: dict[S, S] = {}
        self._places = 0  # the places its states hold
        self._units = 0  # what it holds of the shared budget (places + steps)
        self._key = next(_keys)
        self._ref = weakref.ref(self, lambda _, key=self._key: _gone(key))

    def get(self, state: S, ch: int) -> S | None | object:
        """The state after `ch` at `state` where kept, else `MISSING`."""
        return self._steps.get((state, ch), MISSING)

    def put(self, state: S, ch: int, res: S | None, size: Callable[[S], int]) -> S | None:
        """Keep the step; `res` is returned as the one copy of its state kept (`size(res)` its places)."""
        with _lock:
            _settle()
            if len(self._steps) >= self.max_steps:
                self._clear()
            add = 1
            if res is not None:
                held = self._states.get(res)
                if held is None:
                    n = size(res)
                    if self._places + n > self.max_places:
                        self._clear()
                    self._states[res] = res
                    self._places += n
                    add += n
                else:
                    res = held
            self._steps[(state, ch)] = res
            self._units += add
            _holders[self._key] = (self._ref, self._units)
            _holders.move_to_end(self._key)
            _total[0] += add
            while _total[0] > BUDGET and _holders:
                other_key, (ref, units) = next(iter(_holders.items()))
                other = ref()
                if other is None:  # (its finalizer is waiting on the lock)
                    del _holders[other_key]
                    _total[0] -= units
                else:
                    other._clear()  # the least recently grown first; this one last
        return res

    def _clear(self) -> None:
        """Empty it (the lock held)."""
        self._steps.clear()
        self._states.clear()
        self._places = 0
        got = _holders.pop(self._key, None)
        if got is not None:
            _total[0] -= got[1]
        self._units = 0

    def __len__(self) -> int:
        return len(self._steps)

