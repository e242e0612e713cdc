"""Regular expressions as a reply grows, for guided decoding (vLLM's `guided_regex` and `guided_choice`, a JSON
schema's `pattern`): a character-level automaton (Thompson's construction; a state is the set of the NFA's positions,
and the steps taken are cached, a DFA built as it is used). `Regex.step(states, ch)` is the set after one more
character, or None where no match can go on; `Regex.accepts(states)` whether the text so far matches.

The syntax is Python's `re` (and JSON Schema's ECMA 262, where they agree): literals and escapes (`\\n`, `\\t`,
`\\xhh`, `\\uhhhh`, an escaped punctuation mark), `.` (any character but a newline), classes (`[a-z_]`, `[^...]`,
`\\d`, `\\w`, `\\s` and their negations, inside classes too), groups (`(...)`, `(?:...)`, `(?P<name>...)`,
`(?<name>...)`), `|`, the quantifiers `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` (lazy forms too: the same language),
and `^` / `$` (the text's start and end, as `\\A` / `\\Z`); `\\d` and `\\w` are ASCII's, as JSON Schema's (ECMA 262)
are, and `\\s` is Unicode's white space (ECMA's: U+00A0, U+FEFF, U+2028 and the space separators too; Python's
agrees but for a few control characters).
What a reply cannot be checked against as it grows (backreferences, lookarounds, word boundaries, inline flags) is
refused with a ValueError naming it, as is a pattern no text matches or whose automaton would exceed `MAX_NODES`
positions."""
from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from core.step_cache import MISSING, StepCache

MAX_NODES = 5_000  # an automaton's positions (a {m,n} repeats its group's): what one step may cost
MAX_REPARSED = 200_000  # the characters a pattern's {m,n}s parse again (a copy is its atom parsed again): what the
# compile may cost (a long class repeated, one position a copy, stayed under MAX_NODES and took seconds)
MAX_REPEAT = 1_000  # the largest count a {m,n} may name
MAX_DEPTH = 100  # groups within groups
# edge visits listing a pattern's lengths under a string's maxLength (`Regex.within`), once per pattern and bound as
# the reply is checked (on the engine's worker), and as a schema is checked (on the HTTP front's event loop: each
# pattern's, where the schema may hold dozens)
LENGTH_SET_WORK, LENGTH_SET_CHECK_WORK = 300_000, 20_000
_CACHE_POSITIONS = 2_000_000  # the positions the steps kept hold in all (each state once), per automaton
_CACHE_STEPS = 1_000_000  # and the steps kept (every automaton's together: `core.step_cache.BUDGET`)
_TOP = 0x10FFFF

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint code point ranges


def _norm(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def strong_components(nodes: Iterable[int], successors: Callable[[int], Iterable[int]]
                      ) -> tuple[dict[int, int], list[list[int]]]:
    """The strongly connected components of the graph over `nodes` (`successors(node)`: where its edges go), by
    Tarjan's algorithm without recursion (a grammar's chains of rules may be thousands deep): node -> its part's
    number, and the parts' members, in Tarjan's order (a part's successors come before it)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    part: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    parts: list[list[int]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(successors(root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, succ = work[-1]
            for s in succ:
                if s not in index:
                    index[s] = low[s] = len(index)
                    stack.append(s)
                    on_stack.add(s)
                    work.append((s, iter(successors(s))))
                    break
                if s in on_stack:
                    low[node] = min(low[node], index[s])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        s = stack.pop()
                        on_stack.discard(s)
                        part[s] = len(parts)
                        members.append(s)
                        if s == node:
                            break
                    parts.append(members)
    return part, parts


def _complement(ranges: Ranges) -> Ranges:
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _TOP:
        out.append((at, _TOP))
    return tuple(out)


def _has(ranges: Ranges, c: int) -> bool:
    for lo, hi in ranges:
        if c < lo:
            return False
        if c <= hi:
            return True
    return False


DIGIT: Ranges = ((48, 57),)
WORD: Ranges = _norm([(48, 57), (65, 90), (95, 95), (97, 122)])
# ECMA 262's white space and line terminators (JSON Schema's `\s`)
SPACE: Ranges = _norm([(9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                       (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
DOT: Ranges = _complement(((10, 10),))
ANY: Ranges = ((0, _TOP),)
_CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": _complement(DIGIT), "W": _complement(WORD),
            "S": _complement(SPACE)}
_CONTROLS = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_ASCII_DIGITS = frozenset("0123456789")
_INF = float("inf")


def cuts(classes: Iterable[Ranges], lo: int, hi: int) -> list[int]:
    """Characters of code points `lo`..`hi` that stand for all of them before the character classes `classes`: the
    first of each run of that span that every class either holds whole or not at all (a step on one of them goes
    where a step on any other of its run goes). For a character begun in bytes, whose first bytes fix such a span."""
    out = {lo}
    for ranges in classes:
        for a, b in ranges:
            if b >= lo and a <= hi:
                out.add(max(a, lo))
                if b < hi:
                    out.add(b + 1)
    return sorted(out)


def _number(text: str) -> bool:
    return bool(text) and all(c in _ASCII_DIGITS for c in text)

# positions: what each does
_CHAR, _SPLIT, _JUMP, _BEGIN, _END, _MATCH = range(6)


@dataclass(slots=True)
class _Node:
    kind: int
    ranges: Ranges = ()
    out: int = -1
    alt: int = -1


class _Parser:
    """A pattern's text into the automaton's positions (`nodes`), fragments of (start, [dangling ends])."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0
        self.nodes: list[_Node] = []
        self.depth = 0  # groups open
        self.reparsed = 0  # characters parsed again for {m,n} copies

    def fail(self, what: str) -> ValueError:
        return ValueError(f"regex {self.p[:60]!r}: {what} (at {self.i})")

    def new(self, kind: int, ranges: Ranges = ()) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise self.fail(f"makes an automaton of more than {MAX_NODES} positions")
        if kind == _CHAR and any(lo <= 0xDFFF and hi >= 0xD800 for lo, hi in ranges):
            # (no reply holds a lone surrogate: its text is UTF-8's; a position of only those takes no character)
            ranges = _norm([r for lo, hi in ranges for r in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi))
                            if r[0] <= r[1]])
        self.nodes.append(_Node(kind, ranges))
        return len(self.nodes) - 1

    def patch(self, ends: list[tuple[int, str]], to: int) -> None:
        for n, field in ends:
            setattr(self.nodes[n], field, to)

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    # grammar: alt := seq ('|' seq)*; seq := rep*; rep := atom quantifier*
    def alt(self) -> tuple[int, list]:
        frag = self.seq()
        while self.peek() == "|":
            self.i += 1
            other = self.seq()
            s = self.new(_SPLIT)
            self.nodes[s].out, self.nodes[s].alt = frag[0], other[0]
            frag = (s, frag[1] + other[1])
        return frag

    def seq(self) -> tuple[int, list]:
        frag = None
        while self.peek() is not None and self.peek() not in "|)":
            nxt = self.rep()
            if frag is None:
                frag = nxt
            else:
                self.patch(frag[1], nxt[0])
                frag = (frag[0], nxt[1])
        if frag is None:  # an empty alternative: a jump that matches nothing
            j = self.new(_JUMP)
            return j, [(j, "out")]
        return frag

    def rep(self) -> tuple[int, list]:
        at = self.i
        atom = self.atom()
        ch = self.peek()
        if ch is None or ch not in "*+?{":
            return atom
        if ch == "{":
            counts = self.counts()
            if counts is None:
                return atom  # a literal "{" follows
            lo, hi = counts
        else:
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if self.peek() == "?":
            self.i += 1  # lazy: the same language
        elif self.peek() == "+":
            raise self.fail("uses a possessive quantifier")
        if self.peek() is not None and (self.peek() in "*+?" or self.peek() == "{" and self.counts(False)):
            raise self.fail("repeats a repeat (multiple repeat)")
        return self.repeat(atom, at, lo, hi)

    def counts(self, take: bool = True) -> tuple[int, int | None] | None:
        """A {m}, {m,}, {,n} or {m,n} at the cursor (taken, with `take`), else None (a literal "{")."""
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        lo_s, comma, hi_s = self.p[self.i + 1:j].partition(",")
        if not (_number(lo_s) or comma and not lo_s) or (hi_s and not _number(hi_s)):
            return None  # ({,} is {0,}, as Python's)
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.fail(f"repeats more than {MAX_REPEAT} times")
        if hi is not None and hi < lo:
            raise self.fail("has a {m,n} with n below m")
        if take:
            self.i = j + 1
        return lo, hi

    def repeat(self, first: tuple[int, list], at: int, lo: int, hi: int | None) -> tuple[int, list]:
        """`first` (the atom parsed from `at`) `lo` to `hi` times (None: no limit): each copy the atom parsed
        again; the mandatory copies in a row, then a loop, or the optional ones each skippable."""
        end = self.i
        copies = [first]
        again = lo + (1 if hi is None else hi - lo) - 1
        self.reparsed += (end - at) * max(again, 0)
        if self.reparsed > MAX_REPARSED:
            raise self.fail(f"repeats {MAX_REPARSED} or more characters of itself in all (a long part with a large "
                            "{m,n})")
        for _ in range(again):
            self.i = at
            copies.append(self.atom())
        self.i = end
        parts = copies[:lo]
        if hi is None:
            body = copies[lo]
            s = self.new(_SPLIT)
            self.nodes[s].out = body[0]
            self.patch(body[1], s)
            parts.append((s, [(s, "alt")]))
        else:
            for body in copies[lo:hi]:
                s = self.new(_SPLIT)
                self.nodes[s].out = body[0]
                parts.append((s, body[1] + [(s, "alt")]))
        if not parts:  # {0}: the empty text
            return self.single(_JUMP)
        out = parts[0]
        for nxt in parts[1:]:
            self.patch(out[1], nxt[0])
            out = (out[0], nxt[1])
        return out

    def atom(self) -> tuple[int, list]:
        ch = self.p[self.i]
        self.i += 1
        if ch == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise self.fail(f"nests groups more than {MAX_DEPTH} deep")
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith(("?P<", "?<"), self.i) and not self.p.startswith(("?<=", "?<!"), self.i):
                close = self.p.find(">", self.i)
                if close < 0:
                    raise self.fail("has a group name that does not end")
                self.i = close + 1
            elif self.peek() == "?":
                raise self.fail("uses a lookaround, a flag or a group kind a reply cannot be checked against as "
                                "it grows")
            frag = self.alt()
            if self.peek() != ")":
                raise self.fail("has a group that does not close")
            self.i += 1
            self.depth -= 1
            return frag
        if ch == ")":
            raise self.fail("closes a group it did not open")
        if ch in "*+?":
            raise self.fail(f"has nothing for {ch} to repeat")
        if ch == "^":
            return self.single(_BEGIN)
        if ch == "$":
            return self.single(_END)
        if ch == ".":
            return self.single(_CHAR, DOT)
        if ch == "[":
            return self.single(_CHAR, self.klass())
        if ch == "\\":
            if self.p[self.i:self.i + 1] in ("A", "Z"):  # Python's text start and end: `^` and `$` here
                self.i += 1
                return self.single(_BEGIN if self.p[self.i - 1] == "A" else _END)
            return self.single(_CHAR, self.escape(False))
        return self.single(_CHAR, ((ord(ch), ord(ch)),))

    def single(self, kind: int, ranges: Ranges = ()) -> tuple[int, list]:
        n = self.new(kind, ranges)
        return n, [(n, "out")]

    def escape(self, in_class: bool) -> Ranges:
        if self.i >= len(self.p):
            raise self.fail("ends with a lone backslash")
        ch = self.p[self.i]
        self.i += 1
        if ch in _CLASSES:
            return _CLASSES[ch]
        if ch in _CONTROLS:
            c = ord(_CONTROLS[ch])
            return ((c, c),)
        if ch == "0":  # an octal escape: \0 and up to two more octal digits (Python's)
            digits = "0"
            while len(digits) < 3 and self.p[self.i:self.i + 1] in tuple("01234567"):
                digits += self.p[self.i]
                self.i += 1
            c = int(digits, 8)
            return ((c, c),)
        if ch == "b" and in_class:
            return ((8, 8),)
        if ch in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits) \
                    or int(digits, 16) > _TOP:
                raise self.fail(f"has a \\{ch} escape without its {width} hex digits")
            self.i += width
            c = int(digits, 16)
            return ((c, c),)
        if ch.isalnum():
            raise self.fail(f"uses \\{ch} (a backreference, boundary or escape a reply cannot be checked against as "
                            "it grows)")
        return ((ord(ch), ord(ch)),)

    def klass(self) -> Ranges:
        neg = self.peek() == "^"
        if neg:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.fail("has a class [...] that does not close")
            if self.p[self.i] == "]" and not first:
                self.i += 1
                break
            first = False
            if self.p.startswith("\\", self.i) and self.p[self.i + 1:self.i + 2] in _CLASSES:
                ranges.extend(_CLASSES[self.p[self.i + 1]])
                self.i += 2
                continue
            lo = self.class_char()
            if self.p.startswith("-", self.i) and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                if self.p.startswith("\\", self.i) and self.p[self.i + 1:self.i + 2] in _CLASSES:
                    raise self.fail("has a class range that ends in a class")
                hi = self.class_char()
                if hi < lo:
                    raise self.fail("has a class range that runs backwards")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        got = _norm(ranges)
        return _complement(got) if neg else got

    def class_char(self) -> int:
        """One character of a class, its code point."""
        ch = self.p[self.i]
        self.i += 1
        return ord(ch) if ch != "\\" else self.escape(True)[0][0]


class Regex:
    """A compiled pattern: its positions, and the steps taken so far (cached)."""

    def __init__(self, pattern: str, search: bool = False) -> None:
        """`search`: the pattern may match anywhere in the text (JSON Schema's `pattern`), not the whole of it
        (vLLM's guided_regex)."""
        self.pattern = pattern
        p = _Parser(pattern)
        frag = p.alt()
        if p.i < len(pattern):
            raise p.fail("closes a group it did not open")
        start, ends = frag
        if search:  # any text before and after it: [\s\S]* on each side
            pre, skip = p.new(_SPLIT), p.new(_CHAR, ANY)
            p.nodes[pre].out, p.nodes[pre].alt, p.nodes[skip].out = start, skip, pre
            post, tail = p.new(_SPLIT), p.new(_CHAR, ANY)
            p.nodes[tail].out, p.nodes[post].alt = post, tail
            p.patch(ends, post)
            start, ends = pre, [(post, "out")]
        p.patch(ends, p.new(_MATCH))
        self.nodes = p.nodes
        self._steps: StepCache[frozenset[int]] = StepCache(_CACHE_POSITIONS, _CACHE_STEPS)
        self._live = self._coreachable()
        self._dmin, self._dmax = self._distances()
        self._sets: tuple[int, dict[int, int]] | None = None  # (up to, per position its lengths): `_length_sets`
        self.start = self._closure([start], True)

    def _coreachable(self) -> frozenset[int]:
        """The positions (ended ones offset by the node count) from which a match can still be reached: a state keeps
        only these, so that a text no match can go on from is refused at once."""
        n = len(self.nodes)
        back: dict[int, list[int]] = {}
        for s, node in enumerate(self.nodes):
            for tag in (0, n):
                if node.kind in (_SPLIT, _JUMP):
                    nxt = [node.out + tag] + ([node.alt + tag] if node.kind == _SPLIT else [])
                elif node.kind == _END:
                    nxt = [node.out + n]
                elif node.kind == _CHAR and not tag and node.ranges:
                    nxt = [node.out]
                else:  # a match; `^`, passed only in the start's closure; a character after the end (or none)
                    nxt = []
                for t in nxt:
                    back.setdefault(t, []).append(s + tag)
        todo = [k for k in (s + tag for s, node in enumerate(self.nodes) if node.kind == _MATCH for tag in (0, n))]
        seen = set(todo)
        while todo:
            for k in back.get(todo.pop(), ()):
                if k not in seen:
                    seen.add(k)
                    todo.append(k)
        return frozenset(seen)

    def _edges(self) -> list[tuple[int, int, int]]:
        """(from, to, characters: 0 or 1) between live positions (ended ones offset by the node count)."""
        n, out = len(self.nodes), []
        for s, node in enumerate(self.nodes):
            for tag in (0, n):
                if node.kind in (_SPLIT, _JUMP):
                    nxt = [(node.out + tag, 0)] + ([(node.alt + tag, 0)] if node.kind == _SPLIT else [])
                elif node.kind == _END:
                    nxt = [(node.out + n, 0)]
                elif node.kind == _CHAR and not tag:
                    nxt = [(node.out, 1)]
                else:
                    nxt = []
                out.extend((s + tag, t, w) for t, w in nxt if s + tag in self._live and t in self._live)
        return out

    def _distances(self) -> tuple[dict[int, int], dict[int, float]]:
        """Per live position, the fewest and the most characters a match may still take from it (inf: a loop that
        takes characters can be run round)."""
        n, edges = len(self.nodes), self._edges()
        fwd: dict[int, list[tuple[int, int]]] = {}
        back: dict[int, list[tuple[int, int]]] = {}
        for a, b, w in edges:
            fwd.setdefault(a, []).append((b, w))
            back.setdefault(b, []).append((a, w))
        ends = [k for k in self._live if self.nodes[k % n].kind == _MATCH]
        dmin = {k: 0 for k in ends}
        todo = collections.deque(ends)
        while todo:  # 0-1 breadth first, backwards from the matches
            b = todo.popleft()
            for a, w in back.get(b, ()):
                d = dmin[b] + w
                if d < dmin.get(a, _INF):
                    dmin[a] = d
                    (todo.append if w else todo.appendleft)(a)
        # the most: strongly connected parts; a part with a character inside it loops
        part, parts = strong_components(self._live, lambda v: (w for w, _ in fwd.get(v, ())))
        loops = [any(w and part[b] == k for a in members for b, w in fwd.get(a, ())) for k, members in
                 enumerate(parts)]
        best: list[float] = [0.0] * len(parts)  # Tarjan's order: a part's successors come before it
        for k, members in enumerate(parts):
            if loops[k]:
                best[k] = _INF
                continue
            for a in members:
                for b, w in fwd.get(a, ()):
                    if part[b] != k:
                        best[k] = max(best[k], best[part[b]] + w)
        return dmin, {k: best[part[k]] for k in self._live}

    def lengths(self, states: frozenset[int]) -> tuple[float, float]:
        """The fewest and the most characters a match may still take from `states`."""
        return min(self._dmin[k] for k in states), max(self._dmax[k] for k in states)

    def within(self, states: frozenset[int], lo: float, hi: float, work: int = LENGTH_SET_WORK) -> frozenset[int]:
        """The positions of `states` from which a match may still take between `lo` and `hi` characters; `states`
        itself where all of them may. Each position's own lengths: one position's fewest and another's most may
        meet the bounds where no position's matches do, and one position's lengths may skip the bounds (`(ab)?`
        takes 0 or 2); with `hi` infinite, or lengths that take more than `work` edge visits to list, its fewest and
        most."""
        lo = max(lo, 0)
        sets = self._length_sets(int(hi), work) if hi != _INF and hi >= 0 else None
        if sets is not None:
            mask = (1 << (int(hi) + 1)) - (1 << int(lo)) if lo <= hi else 0
            keep = frozenset(k for k in states if sets.get(k, 0) & mask)
        else:
            keep = frozenset(k for k in states if self._dmin[k] <= hi and self._dmax[k] >= lo)
        return states if len(keep) == len(states) else keep

    def _length_sets(self, most: int, work: int) -> dict[int, int] | None:
        """Per live position, the numbers of characters up to `most` a match may still take from it (a bitset:
        bit L for L characters); None where listing them would take more than `work` edge visits."""
        if self._sets is not None and self._sets[0] >= most:
            return self._sets[1]
        edges = self._edges()
        if (most + 1) * (len(edges) + 1) > work:
            return None
        n = len(self.nodes)
        back: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})  # (without a character, with one)
        for a, b, w in edges:
            back[w].setdefault(b, []).append(a)

        def closed(front: Iterable[int]) -> set[int]:  # and the positions that reach them without a character
            seen = set(front)
            todo = list(seen)
            while todo:
                for a in back[0].get(todo.pop(), ()):
                    if a not in seen:
                        seen.add(a)
                        todo.append(a)
            return seen

        bits = dict.fromkeys(self._live, 0)
        layer = closed(k for k in self._live if self.nodes[k % n].kind == _MATCH)  # a match in 0 characters
        for length in range(most + 1):
            for k in layer:
                bits[k] |= 1 << length
            layer = closed({a for b in layer for a in back[1].get(b, ())})
            if not layer:
                break
        self._sets = (most, bits)
        return bits

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r})"

    def _closure(self, todo: list[int], at_start: bool, ended: bool = False) -> frozenset[int]:
        """The positions reached from `todo` without a character: through splits, `^` only at the text's start;
        through `$`, positions marked ended (offset by the node count), which take no more characters."""
        n = len(self.nodes)
        seen: set[int] = set()
        stack = [(t, ended) for t in todo]
        while stack:
            s, done = stack.pop()
            key = s + n if done else s
            if key in seen or s < 0:
                continue
            seen.add(key)
            node = self.nodes[s]
            if node.kind in (_SPLIT, _JUMP):
                stack.append((node.out, done))
                if node.kind == _SPLIT:
                    stack.append((node.alt, done))
            elif node.kind == _BEGIN:
                if at_start:
                    stack.append((node.out, done))
            elif node.kind == _END:
                stack.append((node.out, True))
        return frozenset(seen & self._live)

    def step(self, states: frozenset[int], ch: str) -> frozenset[int] | None:
        """The positions after `ch`, or None where no match goes on."""
        n, c = len(self.nodes), ord(ch)
        got = self._steps.get(states, c)
        if got is not MISSING:
            return got  # type: ignore[return-value]
        nxt = [self.nodes[s].out for s in states if s < n and self.nodes[s].kind == _CHAR
               and _has(self.nodes[s].ranges, c)]
        res = self._closure(nxt, False) if nxt else None
        return self._steps.put(states, c, res or None, len)

    def samples(self, states: frozenset[int], lo: int, hi: int) -> list[int]:
        """Code points `lo`..`hi` that stand for all of them at `states` (`cuts`): a step on each says whether some
        character of the span can come next, and where each can go."""
        n = len(self.nodes)
        return cuts((self.nodes[s].ranges for s in states if s < n and self.nodes[s].kind == _CHAR), lo, hi)

    def accepts(self, states: frozenset[int]) -> bool:
        n = len(self.nodes)
        return any(self.nodes[s % n].kind == _MATCH for s in states)

    def matches_some(self) -> bool:
        """Whether some text matches (the start keeps a position a match can be reached from)."""
        return bool(self.start)


def walk(automaton, text: str):
    """The state of a character automaton (a `Regex`, or a `core.ebnf_grammar.Grammar`: `start`, `step`) after
    `text` from its start; None where some character of it cannot come next."""
    st = automaton.start
    for ch in text:
        st = automaton.step(st, ch)
        if st is None:
            return None
    return st


def matches(automaton, text: str) -> bool:
    """Whether `text` is a whole match (a text of the grammar)."""
    st = walk(automaton, text)
    return st is not None and automaton.accepts(st)


@functools.lru_cache(maxsize=64)
def compile_regex(pattern: str, search: bool = False) -> Regex:
    """`Regex(pattern, search)`, compiled once for the requests that send it (the last few patterns kept); a
    ValueError (a client's 400) naming what it refuses, or for a pattern nothing matches."""
    if not isinstance(pattern, str):
        raise ValueError("a regex must be a string")
    rx = Regex(pattern, search)
    if not rx.matches_some():
        raise ValueError(f"regex {pattern[:60]!r}: matches no text")
    return rx


def choice_pattern(choices: list[str]) -> str:
    """A pattern that matches exactly one of `choices` (vLLM's guided_choice)."""
    return "|".join("".join(c if c.isalnum() or c == " " else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF
                            else f"\\U{ord(c):08x}" for c in choice) for choice in choices)
