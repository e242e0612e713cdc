"""Pending-queue admission for a prefill round: FIFO or lookahead packing under a token budget.

Generalises the seeds' ``_take_pending_for_prefill`` with a per-candidate gate (``accept``) so that
SLO checks (VBS gate, KV capacity) can hold, drop or stop candidates without reordering the queue.
"""
from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import Literal, TypeVar

T = TypeVar("T")

AdmissionPolicy = Literal["fifo", "pack"]


class Verdict(enum.Enum):
    """What the ``accept`` gate decides for one candidate that fits the token budget."""

    ADMIT = "admit"  # selected for this prefill round
    KEEP = "keep"  # not selected, stays in the queue in place (budget not consumed)
    DROP = "drop"  # removed from the queue; the caller has recorded a rejection
    STOP = "stop"  # not selected, stays, and no further candidate is considered this round


def _judge(accept: Callable[[T], Verdict] | None, req: T) -> Verdict:
    return Verdict.ADMIT if accept is None else accept(req)


def take_for_prefill(
    waiting: deque[T],
    *,
    cost: Callable[[T], int],
    max_reqs: int,
    max_tokens: int | None,
    policy: AdmissionPolicy,
    lookahead: int,
    force_fifo: bool,
    accept: Callable[[T], Verdict] | None = None,
    rank: Callable[[T], int] | None = None,
) -> list[T]:
    """Remove and return the requests to prefill this round, in queue order.

    ``cost(r)`` is the prompt-token cost (the caller applies ``min(prompt, max_context)``).
    FIFO (``policy == "fifo"``, ``force_fifo`` or no budget): take from the head until the next one
    does not fit; an oversize first candidate is admitted alone. Pack: over the first ``lookahead``
    requests, greedily pick by ``(cost, position)`` whatever fits; if nothing fits, the first
    oversize request is admitted alone. Everything not taken or dropped keeps its relative order.

    ``accept`` is asked, in the order candidates are considered, about each one that fits the budget
    (and about the oversize one admitted alone); see ``Verdict``. In FIFO mode a KEEP does not stop
    the scan: later requests are still considered, so a held request never blocks the queue.

    ``rank`` (priority scheduling: a request's priority, lower first; the queue is in its order): pack considers
    the lower ranks first, and no request of a higher rank than one left out for the budget.
    """
    if max_reqs <= 0:
        raise ValueError("max_reqs must be positive")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError("max_tokens must be positive")
    if lookahead <= 0:
        raise ValueError("lookahead must be positive")
    if policy not in ("fifo", "pack"):
        raise ValueError("policy must be fifo|pack")
    if force_fifo or policy == "fifo" or max_tokens is None:
        return _take_fifo(waiting, cost, max_reqs, max_tokens, accept)
    return _take_pack(waiting, cost, max_reqs, max_tokens, lookahead, accept, rank)


def _take_fifo(
    waiting: deque[T],
    cost: Callable[[T], int],
    max_reqs: int,
    max_tokens: int | None,
    accept: Callable[[T], Verdict] | None,
) -> list[T]:
    """FIFO under the budget. A KEEP verdict does not block the queue: the scan moves on to the
    next request (so a held request cannot starve the ones behind it), and the held one keeps its
    place. The scan stops at the first candidate that does not fit, at STOP, or at ``max_reqs``."""
    out: list[T] = []
    kept: list[T] = []
    used = 0
    while waiting and len(out) < max_reqs:
        req = waiting[0]
        c = cost(req)
        if max_tokens is not None and out and used + c > max_tokens:
            break
        verdict = _judge(accept, req)
        if verdict is Verdict.STOP:
            break
        waiting.popleft()
        if verdict is Verdict.KEEP:
            kept.append(req)
            continue
        if verdict is Verdict.DROP:
            continue
        out.append(req)
        used += c
        if max_tokens is not None and c > max_tokens:
            break  # oversize first candidate: admitted alone
    waiting.extendleft(reversed(kept))
    return out


def _take_pack(
    waiting: deque[T],
    cost: Callable[[T], int],
    max_reqs: int,
    max_tokens: int,
    lookahead: int,
    accept: Callable[[T], Verdict] | None,
    rank: Callable[[T], int] | None = None,
) -> list[T]:
    """Greedy smallest-first packing over a lookahead window (`rank`: lowest rank first, smallest first within
    it, none of a higher rank than one left out for the budget); output and leftovers in queue order."""
    window = [waiting.popleft() for _ in range(min(lookahead, len(waiting)))]
    costs = [cost(r) for r in window]
    ranks = [rank(r) for r in window] if rank is not None else [0] * len(window)
    blocked = None  # the lowest rank a request left out for the budget has: none above it goes ahead of it
    judged = [False] * len(window)
    selected = [False] * len(window)
    dropped = [False] * len(window)
    used = 0
    n_selected = 0
    stopped = False
    for idx in sorted(range(len(window)), key=lambda i: (ranks[i], costs[i], i)):
        if n_selected >= max_reqs:
            break
        if blocked is not None and ranks[idx] > blocked:
            break  # (in rank order: every one left is of a higher rank)
        if used + costs[idx] > max_tokens:  # also skips anything oversize on its own
            blocked = ranks[idx]  # (without `rank` all are 0: it blocks none)
            continue
        judged[idx] = True
        verdict = _judge(accept, window[idx])
        if verdict is Verdict.STOP:
            stopped = True
            break
        if verdict is Verdict.ADMIT:
            selected[idx] = True
            used += costs[idx]
            n_selected += 1
        dropped[idx] = verdict is Verdict.DROP
    if n_selected == 0 and not stopped:
        # Progress guarantee: nothing fits, so the first (oversize) request goes alone.
        for idx, req in enumerate(window):
            if judged[idx]:
                continue
            verdict = _judge(accept, req)
            if verdict is Verdict.STOP:
                break
            if verdict is Verdict.ADMIT:
                selected[idx] = True
                break
            dropped[idx] = verdict is Verdict.DROP
    out = [r for i, r in enumerate(window) if selected[i]]
    waiting.extendleft(reversed([r for i, r in enumerate(window) if not (selected[i] or dropped[i])]))
    return out
