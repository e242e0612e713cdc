"""Context-free grammars as a reply grows, for guided decoding (vLLM's `guided_grammar` and `structured_outputs`
`grammar`): an EBNF grammar in the GBNF form that vLLM's xgrammar backend and llama.cpp read, checked character by
character. `Grammar.step(state, ch)` is the state after one more character, or None where no text of the grammar
goes on from there; `Grammar.accepts(state)` whether the text so far is one (the reply may end). The interface is
`core.regex_grammar.Regex`'s, so JSON mode's automaton (`core.json_grammar.start_pattern`) holds a grammar as it
holds a regex.

The syntax: rules `name ::= body`, one of them `root` (the whole reply); a body of alternatives split by `|`, each a
sequence of string literals (`"..."` or `'...'`, with the escapes `\\n`, `\\t`, `\\r`, `\\\\`, `\\"`, `\\'`,
`\\xhh`, `\\uhhhh`, `\\Uhhhhhhhh`), character classes (`[a-z_]`, `[^"\\\\]`, with those escapes, and `\\d`, `\\w`
as ASCII's, `\\s` as Unicode's white space), `.` (any character), rule names, groups `( ... )`, and the
quantifiers `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`; `#` starts a comment to the end of the line, and a rule may span
lines. A grammar with no `::=` is read as Lark's, as vLLM reads one (`from_lark`). Left recursion through first calls (`sum ::= sum "+" n | n`) is
rewritten into right recursion of the same language (`Grammar._unleft`). A grammar this checker cannot hold as
written is refused with a ValueError naming why: left recursion through a rule that may be empty (`a ::= b a "x"`,
b empty: a rule that can come back to itself before a character that way), an undefined rule,
lookahead assertions, Lark's regular expressions, a rule no text derives from `root`, or more than `MAX_ELEMENTS`
elements once its quantifiers are written out.

The state is the set of the parses that are still possible, each a stack of the places to go on from in the rules'
alternatives (a rule called last in its alternative leaves no place: repetition does not deepen the stack); a
rule's alternatives that begin alike are taken as one until they differ (a list of words is a tree of letters), so
that an ambiguity that ends keeps no parses apart; the steps taken are cached per grammar, as the regex automaton's
are. A repetition of what may be empty is held (its paths meet again and stop); left recursion is rewritten first.
An ambiguous grammar's state keeps its shallowest parses (MAX_KEPT, MAX_PLACES places in all): each goes on to a
text of it, though not every text of it may still follow (the reply stays one of its texts).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

from core.regex_grammar import (ANY, DIGIT, MAX_REPEAT, SPACE, WORD, Ranges, _complement, _has, _norm, cuts,
                                strong_components)
from core.step_cache import MISSING, StepCache

MAX_ELEMENTS = 50_000  # a grammar's elements once its quantifiers are written out
MAX_STACK = 1_000  # a parse's depth in places (a nested group of the text takes one or two): deeper is not followed
MAX_PARSES = 1_024  # the parses a closure finds, the shallowest of them kept: each may be a dive MAX_STACK deep
# the places a state's parses hold in all (what a step costs: each parse's stack is copied), the shallowest parses
# kept: an ambiguous grammar (`a ::= "x" a a | ""`) holds a parse per depth the text could have reached, and without
# a bound a step of a reply thousands of characters deep would cost millions of copies (the engine's thread, for every
# token a guided row checks); each parse kept still goes on to a text of the grammar
MAX_PLACES = 4_096
MAX_KEPT = 256  # and the parses it keeps (the guided rows' token checks step each one's stack)
_CACHE_PLACES = 2_000_000  # the places the states the steps kept hold in all, per grammar, before it starts over
_CACHE_STEPS = 1_000_000  # and the steps kept (every grammar's and regex's together: `core.step_cache.BUDGET`)

State = frozenset  # of stacks: tuples of (alternative, element) places; () a parse that has ended

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
            "^": "^", "/": "/", "b": "\b", "f": "\f", "v": "\v", "0": "\0"}
_CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # name, def, str, class, any, ( ) | * + ? rep, end
    value: object
    at: int


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def fail(self, what: str, at: int | None = None) -> ValueError:
        at = self.i if at is None else at
        line = self.text.count("\n", 0, at) + 1
        return ValueError(f"grammar, line {line}: {what}")

    def tokens(self) -> list[_Tok]:
        out, t = [], self.text
        while True:
            self._blank()
            if self.i >= len(t):
                out.append(_Tok("end", None, self.i))
                return out
            at, c = self.i, t[self.i]
            if t.startswith("::=", self.i):
                self.i += 3
                out.append(_Tok("def", None, at))
            elif c in "\"'":
                out.append(_Tok("str", self._string(c), at))
            elif c == "[":
                out.append(_Tok("class", self._class(), at))
            elif c == ".":
                self.i += 1
                out.append(_Tok("any", None, at))
            elif c == "(" and t.startswith("(=", self.i):
                raise self.fail("lookahead assertions `(= ...)` are not supported")
            elif c in "()|*+?":
                self.i += 1
                out.append(_Tok(c, None, at))
            elif c == "{":
                out.append(_Tok("rep", self._repeat(), at))
            elif c.isalnum() or c == "_":
                j = self.i
                while j < len(t) and (t[j].isalnum() or t[j] in "_-"):
                    j += 1
                out.append(_Tok("name", t[self.i:j], at))
                self.i = j
            else:
                raise self.fail(f"unexpected {c!r}")

    def _blank(self) -> None:
        t = self.text
        while self.i < len(t):
            if t[self.i].isspace():
                self.i += 1
            elif t[self.i] == "#":
                while self.i < len(t) and t[self.i] != "\n":
                    self.i += 1
            else:
                return

    def _escape(self) -> int:
        """The code point of the escape after a backslash (self.i at the backslash)."""
        t = self.text
        self.i += 1
        if self.i >= len(t):
            raise self.fail("an escape at the end")
        c = t[self.i]
        for lead, width in (("x", 2), ("u", 4), ("U", 8)):
            if c == lead:
                digits = t[self.i + 1:self.i + 1 + width]
                if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    raise self.fail(f"\\{lead} needs {width} hex digits")
                self.i += 1 + width
                code = int(digits, 16)
                if code > 0x10FFFF:
                    raise self.fail(f"\\{lead}{digits} is past the last code point")
                return code
        if c in _ESCAPES:
            self.i += 1
            return ord(_ESCAPES[c])
        raise self.fail(f"unknown escape \\{c}")

    def _string(self, quote: str) -> str:
        t, out = self.text, []
        start = self.i
        self.i += 1
        while True:
            if self.i >= len(t):
                raise self.fail("a string literal is not closed", start)
            c = t[self.i]
            if c == quote:
                self.i += 1
                return "".join(out)
            if c == "\\":
                out.append(chr(self._escape()))
            else:
                out.append(c)
                self.i += 1

    def _class(self) -> Ranges:
        t, start = self.text, self.i
        self.i += 1
        negate = self.i < len(t) and t[self.i] == "^"
        self.i += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(t):
                raise self.fail("a character class is not closed", start)
            c = t[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "\\" and self.i + 1 < len(t) and t[self.i + 1] in _CLASSES:
                ranges += _CLASSES[t[self.i + 1]]
                self.i += 2
                continue
            lo = self._escape() if c == "\\" else self._char()
            if self.i + 1 < len(t) and t[self.i] == "-" and t[self.i + 1] != "]":
                self.i += 1
                hi = self._escape() if t[self.i] == "\\" else self._char()
                if hi < lo:
                    raise self.fail(f"a range {chr(lo)!r}-{chr(hi)!r} runs backwards")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        got = _norm(ranges)
        return _complement(got) if negate else got

    def _char(self) -> int:
        c = self.text[self.i]
        self.i += 1
        return ord(c)

    def _repeat(self) -> tuple[int, int | None]:
        t, start = self.text, self.i
        end = t.find("}", self.i)
        if end < 0:
            raise self.fail("a {m,n} is not closed", start)
        body = "".join(t[self.i + 1:end].split())
        self.i = end + 1
        lo, sep, hi = body.partition(",")
        if not (re.fullmatch(r"[0-9]+", lo) and (not sep or re.fullmatch(r"[0-9]*", hi))):
            raise self.fail(f"{{{body}}} is not a count {{m}}, {{m,}} or {{m,n}}", start)
        m = int(lo)
        n = m if not sep else (None if hi == "" else int(hi))
        if n is not None and n < m or max(m, n or 0) > MAX_REPEAT:
            raise self.fail(f"{{{body}}}: counts from 0 to {MAX_REPEAT}, the second no less than the first", start)
        return m, n


class Grammar:
    """A compiled grammar: its rules' alternatives, each a tuple of elements (("c", ranges): one character of
    them; ("r", rule): the rule's text), and the steps taken so far (cached)."""

    def __init__(self, text: str) -> None:
        self.alts: list[tuple[tuple[str, object], ...]] = []
        self.rules: list[list[int]] = []  # each rule's alternatives (indices into alts)
        self._names: dict[str, int] = {}
        self._elements = 0
        self._parse(_Lexer(text))
        self._unleft()
        self._factor()
        self._prune()
        self._check_left_recursion()
        self._steps: StepCache[State] = StepCache(_CACHE_PLACES, _CACHE_STEPS)
        self.start = self._closure([((b, 0),) for b in self.rules[self._names["root"]]])

    # ------------------------------------------------------------------ compiling
    def _rule(self) -> int:
        self.rules.append([])
        return len(self.rules) - 1

    def _alt(self, rule: int, elems: list[tuple[str, object]]) -> None:
        self.rules[rule].append(self._new_alt(elems))

    def _new_alt(self, elems: list[tuple[str, object]]) -> int:
        self._elements += len(elems) + 1
        if self._elements > MAX_ELEMENTS:
            raise ValueError(f"grammar: more than {MAX_ELEMENTS} elements once its quantifiers are written out")
        self.alts.append(tuple(elems))
        return len(self.alts) - 1

    def _parse(self, lx: _Lexer) -> None:
        toks = lx.tokens()
        defs = [i for i, tk in enumerate(toks) if tk.kind == "def"]
        if not defs:
            raise ValueError("grammar: no rule (`name ::= ...`); the reply's rule is `root`")
        for i in defs:
            if i == 0 or toks[i - 1].kind != "name":
                raise lx.fail("`::=` needs a rule name before it", toks[i].at)
            name = toks[i - 1].value
            if name in self._names:
                raise lx.fail(f"rule {name!r} is defined twice", toks[i].at)
            self._names[name] = self._rule()
        if "root" not in self._names:
            raise ValueError("grammar: no `root` rule (the rule the whole reply is)")
        starts = [i - 1 for i in defs] + [len(toks) - 1]
        for k, i in enumerate(defs):
            body = toks[i + 1:starts[k + 1]]
            self._pos, self._toks, self._lx = 0, body + [_Tok("end", None, toks[starts[k + 1]].at)], lx
            rule = self._names[toks[i - 1].value]
            for seq in self._alternation():
                self._alt(rule, seq)
            if self._toks[self._pos].kind != "end":
                raise lx.fail(f"unexpected {self._toks[self._pos].kind!r}", self._toks[self._pos].at)

    def _peek(self) -> _Tok:
        return self._toks[self._pos]

    def _alternation(self) -> list[list[tuple[str, object]]]:
        seqs = [self._sequence()]
        while self._peek().kind == "|":
            self._pos += 1
            seqs.append(self._sequence())
        return seqs

    def _sequence(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        while self._peek().kind in ("name", "str", "class", "any", "("):
            atom = self._atom()
            while self._peek().kind in ("*", "+", "?", "rep"):
                atom = self._quantified(atom, self._peek())
                self._pos += 1
            out += atom
        return out

    def _atom(self) -> list[tuple[str, object]]:
        tk = self._peek()
        self._pos += 1
        if tk.kind == "name":
            rule = self._names.get(tk.value)
            if rule is None:
                raise self._lx.fail(f"rule {tk.value!r} is not defined", tk.at)
            return [("r", rule)]
        if tk.kind == "str":
            return [("c", ((ord(c), ord(c)),)) for c in tk.value]
        if tk.kind == "class":
            if not tk.value:
                raise self._lx.fail("a character class that holds no character", tk.at)
            return [("c", tk.value)]
        if tk.kind == "any":
            return [("c", ANY)]
        group = self._alternation()  # "("
        if self._peek().kind != ")":
            raise self._lx.fail("a group is not closed", tk.at)
        self._pos += 1
        if len(group) == 1:
            return group[0]
        rule = self._rule()
        for seq in group:
            self._alt(rule, seq)
        return [("r", rule)]

    def _unit(self, atom: list[tuple[str, object]]) -> tuple[str, object]:
        """One element for `atom`: itself, or a rule of its sequence."""
        if len(atom) == 1:
            return atom[0]
        rule = self._rule()
        self._alt(rule, atom)
        return ("r", rule)

    def _star(self, unit: tuple[str, object]) -> tuple[str, object]:
        rule = self._rule()  # R ::= unit R | (nothing): R last in its alternative, so the stack stays as deep
        self._alt(rule, [unit, ("r", rule)])
        self._alt(rule, [])
        return ("r", rule)

    def _quantified(self, atom: list[tuple[str, object]], q: _Tok) -> list[tuple[str, object]]:
        unit = self._unit(atom)
        m, n = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(q.kind) or q.value  # type: ignore[misc]
        out = [unit] * m
        if n is None:
            return out + [self._star(unit)]
        tail: tuple[str, object] | None = None
        for _ in range(n - m):  # O_k ::= unit O_(k-1) | (nothing)
            rule = self._rule()
            self._alt(rule, [unit] + ([tail] if tail is not None else []))
            self._alt(rule, [])
            tail = ("r", rule)
        return out + ([tail] if tail is not None else [])

    def _unleft(self) -> None:
        """Rewrite left recursion through first calls (`expr ::= expr "+" term | term`, as Lark's and xgrammar's
        grammars write lists and operators) into right recursion of the same language, by Paull's method: in each
        set of rules that reach one another through the first elements of their alternatives, ranked as defined,
        a rule's alternatives that begin with a rule ranked before it take that rule's alternatives in its place
        (until they begin with itself, a later rule, or anything else), and then `A ::= A a1 | ... | b1 | ...`
        becomes `A ::= b1 A' | ...` with `A' ::= a1 A' | ... | (nothing)` (`A ::= A` is dropped: it adds no text).
        A left recursion only through rules that may be empty (`A ::= B A "x"`, B empty) is left as written, for
        `_check_left_recursion` to refuse. The rewritten alternatives count against MAX_ELEMENTS."""
        def first(r: int) -> list[int]:  # the rules r's alternatives begin with
            return [alt[0][1] for alt in (self.alts[a] for a in self.rules[r])  # type: ignore[misc]
                    if alt and alt[0][0] == "r"]

        _, parts = strong_components(range(len(self.rules)), first)
        for part in parts:
            if len(part) == 1 and part[0] not in first(part[0]):
                continue
            rank = {r: k for k, r in enumerate(sorted(part))}
            grown = 0  # the elements the substitutions wrote (before they are kept: a guard on their growth)
            for r in sorted(part):
                done: list[tuple] = []
                todo = [self.alts[a] for a in self.rules[r]]
                while todo:
                    alt = todo.pop()
                    head = alt[0][1] if alt and alt[0][0] == "r" else None
                    if head is not None and rank.get(head, len(part)) < rank[r]:  # type: ignore[arg-type]
                        tail = alt[1:]
                        for b in self.rules[head]:  # type: ignore[index]
                            grown += len(self.alts[b]) + len(tail) + 1
                            if self._elements + grown > MAX_ELEMENTS:  # (before it is built: tails may be long)
                                raise ValueError(f"grammar: more than {MAX_ELEMENTS} elements once its left "
                                                 "recursion is rewritten")
                            todo.append(self.alts[b] + tail)
                    else:
                        done.append(alt)
                # the alternatives in their written order (for the parses kept first), each once (a substitution may
                # write one twice)
                done = list(dict.fromkeys(reversed(done)))
                own = [alt[1:] for alt in done if alt and alt[0] == ("r", r)]
                if not own:  # (those written as they were keep their place: no elements counted twice)
                    kept = {self.alts[a]: a for a in self.rules[r]}
                    self.rules[r] = [kept[alt] if alt in kept else self._new_alt(list(alt)) for alt in done]
                    continue
                rest = self._rule()  # A' ::= a1 A' | ... | (nothing): A' last in its alternative
                self.rules[rest] = [self._new_alt([*a, ("r", rest)]) for a in own if a] + [self._new_alt([])]
                self.rules[r] = [self._new_alt([*alt, ("r", rest)]) for alt in done
                                 if not (alt and alt[0] == ("r", r))]

    def _factor(self) -> None:
        """A rule's alternatives that begin alike as one, its tails a rule of their own (`"ab" | "ac"` as
        `"a" ("b" | "c")`), down to where they differ: a text then keeps one parse where the alternatives would keep
        one each (a list of words is a tree of their letters; `"(" s ")" | "(" s "]"` keeps one parse a level, not
        two)."""
        todo = list(range(len(self.rules)))
        budget = 4 * MAX_ELEMENTS  # the elements the tails may take in all (past it, the rest stays as written)
        while todo:
            r = todo.pop()
            groups: dict[tuple[str, object], list[int]] = {}
            for a in self.rules[r]:
                if self.alts[a]:
                    groups.setdefault(self.alts[a][0], []).append(a)
            if all(len(g) < 2 for g in groups.values()):
                continue
            budget -= sum(len(self.alts[a]) for g in groups.values() if len(g) > 1 for a in g)
            if budget < 0:
                break
            kept = [a for a in self.rules[r] if not self.alts[a]]
            for head, group in groups.items():
                if len(group) == 1:
                    kept.append(group[0])
                    continue
                tails = self._rule()
                for a in group:
                    self.alts.append(self.alts[a][1:])
                    self.rules[tails].append(len(self.alts) - 1)
                self.alts.append((head, ("r", tails)))
                kept.append(len(self.alts) - 1)
                todo.append(tails)
            self.rules[r] = kept

    def _prune(self) -> None:
        """Drop the alternatives that derive no text (a rule of them only calls itself for ever); a root left with
        none matches nothing."""
        productive = self._derives(through_characters=True)
        if self._names["root"] not in productive:
            raise ValueError("grammar: `root` derives no text (every way through it calls a rule for ever)")
        for r, alts in enumerate(self.rules):
            self.rules[r] = [a for a in alts if all(k == "c" or v in productive for k, v in self.alts[a])]

    def _derives(self, through_characters: bool) -> set[int]:
        """The rules with an alternative whose every element is a rule of the set or (`through_characters`) a
        character: the productive rules (those that derive some text), or, without characters, those that may
        derive the empty text. One pass over a worklist (each rule, once in the set, counts off the alternatives
        that call it), linear in the grammar's size however deep its chains of rules."""
        owners: dict[int, list[int]] = {}  # alternative -> the rules it is one of
        left: dict[int, int] = {}  # alternative -> its calls of rules not (yet) in the set
        callers: dict[int, list[int]] = {}  # rule -> the alternatives that call it (once a call)
        for r, alts in enumerate(self.rules):
            for a in alts:
                owners.setdefault(a, []).append(r)
                if a in left:
                    continue
                alt = self.alts[a]
                if not through_characters and any(k == "c" for k, _ in alt):
                    left[a] = -1  # (never met)
                    continue
                calls = [v for k, v in alt if k == "r"]
                left[a] = len(calls)
                for v in calls:
                    callers.setdefault(v, []).append(a)  # type: ignore[arg-type]
        todo = [r for a, n in left.items() if n == 0 for r in owners[a]]
        found: set[int] = set()
        while todo:
            r = todo.pop()
            if r in found:
                continue
            found.add(r)
            for a in callers.get(r, ()):
                left[a] -= 1
                if left[a] == 0:
                    todo.extend(owners[a])
        return found

    def _check_left_recursion(self) -> None:
        """Refuse a rule that can come back to itself before a character through a call that is not the last of
        its alternative (after `_unleft`: only through rules that may be empty): each time round, its parse would be
        one place deeper, for ever. (Back through last calls
        only, as a repetition of what may be empty comes back, a parse stays as deep: `_closure` meets it again and
        stops.)"""
        nullable = self._derives(through_characters=False)
        edges: dict[int, list[tuple[int, bool]]] = {}  # rule -> (a rule it may call first, as not its last call)
        for r, alts in enumerate(self.rules):
            for a in alts:
                alt = self.alts[a]
                for i, (k, v) in enumerate(alt):
                    if k == "c":
                        break
                    edges.setdefault(r, []).append((v, i + 1 < len(alt)))  # type: ignore[arg-type]
                    if v not in nullable:
                        break
        names = {r: n for n, r in self._names.items()}
        # a first call r -> s comes back to r where s reaches r: where the two are in one strongly connected part
        part, _ = strong_components(edges, lambda r: (s_ for s_, _ in edges.get(r, ())))
        for r, out in edges.items():
            for s_, deeper in out:
                if deeper and (s_ == r or part.get(s_) == part[r]):
                    what = f"rule {names[r]!r}" if r in names else "a group"
                    raise ValueError(f"grammar: {what} is left-recursive through a rule that may be empty (it can "
                                     "come back to itself before a character that way), which this server's checker "
                                     "cannot hold: write that rule first without its empty text, or with a "
                                     "repetition (x*)")

    # ------------------------------------------------------------------ checking
    def _closure(self, stacks: list[tuple]) -> State:
        """The parses from these stacks, each down to a character element (or ended: ()). Each stack is expanded
        once: paths through what may be empty that meet again (a repetition of something that may be empty) end
        there, and so does the work."""
        out: set[tuple] = set()
        todo = list(stacks)  # (depth first: each dive ends in a parse, so the work is about MAX_PARSES dives;
        seen: set[tuple] = set()  # breadth first, a grammar with a choice at every level expanded all of them)
        while todo and len(out) < MAX_PARSES:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            while True:
                if not stack:
                    out.add(())
                    break
                a, i = stack[-1]
                alt = self.alts[a]
                if i == len(alt):
                    stack = stack[:-1]
                    continue
                kind, v = alt[i]
                if kind == "c":
                    out.add(stack)
                    break
                rest = stack[:-1] if i + 1 == len(alt) else stack[:-1] + ((a, i + 1),)
                if len(rest) >= MAX_STACK:
                    break  # (a text nested this deep is not followed)
                todo += [rest + ((b, 0),) for b in self.rules[v]]  # type: ignore[index]
                break
        if len(out) > MAX_KEPT or sum(map(len, out)) > MAX_PLACES:  # (an ambiguous grammar's: the shallowest)
            kept, places = [], 0
            for stack in sorted(out, key=len):
                places += len(stack)
                if kept and (places > MAX_PLACES or len(kept) == MAX_KEPT):
                    break
                kept.append(stack)  # (the shallowest at least, however deep: a text nested MAX_STACK deep)
            return frozenset(kept)
        return frozenset(out)

    def step(self, state: State, ch: str) -> State | None:
        """The parses after `ch`, or None where none goes on."""
        c = ord(ch)
        got = self._steps.get(state, c)
        if got is not MISSING:
            return got  # type: ignore[return-value]
        moved = []
        for stack in state:
            if stack:
                a, i = stack[-1]
                if _has(self.alts[a][i][1], c):  # type: ignore[arg-type]
                    moved.append(stack[:-1] + ((a, i + 1),))
        res = self._closure(moved) if moved else None
        return self._steps.put(state, c, res, _places)

    def samples(self, state: State, lo: int, hi: int) -> list[int]:
        """Code points `lo`..`hi` that stand for all of them at `state` (`regex_grammar.cuts`), as `Regex.samples`."""
        return cuts((self.alts[s[-1][0]][s[-1][1]][1] for s in state if s), lo, hi)  # type: ignore[misc]

    def accepts(self, state: State) -> bool:
        return () in state


def _places(state: State) -> int:
    """The places a state holds (its stacks' places, and one for itself)."""
    return sum(len(s) for s in state) + 1


@functools.lru_cache(maxsize=64)
def compile_grammar(text: str) -> Grammar:
    """`Grammar(text)`, compiled once for the requests that send it (the last few kept); a ValueError (a client's
    400) naming what it refuses."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a grammar must be a non-empty string of rules (`root ::= ...`)")
    if "::=" not in text:  # (no EBNF rule: vLLM reads it as Lark's, and so does this server)
        text = from_lark(text)
    return Grammar(text)


_LARK_RULE = re.compile(r"[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?[0-9]+)?\s*:(.*)")


def _outside_strings(text: str) -> Iterator[tuple[int, str, bool]]:
    """Each character of a Lark line with its place, and whether it is outside its string literals (`"..."`,
    `'...'`; a quote opens one there)."""
    quote, escaped = None, False
    for i, c in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
            yield i, c, False
        else:
            if c in "\"'":
                quote = c
            yield i, c, quote is None


def _lark_line(line: str) -> str:
    """A Lark line without its comment (`//` or `#` outside a string literal)."""
    for i, c, outside in _outside_strings(line):
        if outside and (c == "#" or line.startswith("//", i)):
            return line[:i].strip()
    return line.strip()


def _lark_optionals(body: str, n: int) -> str:
    """A Lark body with its `[item]`s (optional items) written `(item)?`; a `[` or `]` inside a string literal is
    the literal's."""
    out: list[str] = []
    depth = 0
    for _, c, outside in _outside_strings(body):
        if outside and c == "[":
            depth, c = depth + 1, "("
        elif outside and c == "]":
            if not depth:
                raise ValueError(f"grammar (Lark), line {n}: a `]` with no `[` before it")
            depth, c = depth - 1, ")?"
        out.append(c)
    if depth:
        raise ValueError(f"grammar (Lark), line {n}: a `[` with no `]` after it")
    return "".join(out)


_LARK_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|\[(?:[^\]\\]|\\.)*\]|[\w-]+|.', re.S)


def _renamed(body: str, old: str, new: str) -> str:
    """A rule's body with rule name `old` as `new`, its literals and classes as they are."""
    return "".join(new if t == old else t for t in _LARK_TOKEN.findall(body))


def from_lark(text: str) -> str:
    """A grammar in Lark's notation as vLLM's xgrammar backend takes it (`name: ...` rules, `|` lines that go on
    with the last rule's alternatives, `?`/`!` and priorities dropped, `start` the reply's rule, else the first), as
    EBNF. Its bodies are read as EBNF's (literals, groups, quantifiers), but for Lark's `[item]`, an optional
    item (`(item)?`: Lark has no character classes); Lark's regular expressions (`/.../`), ranges (`"a".."z"`) and
    `~` repeats are refused by `Grammar` as it meets them."""
    rules: list[tuple[str, list[str]]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = _lark_line(raw)
        if not line:
            continue
        if line.startswith("|"):
            if not rules:
                raise ValueError(f"grammar (Lark), line {n}: an alternative `|` before any rule")
            rules[-1][1].append(_lark_optionals(line[1:].strip(), n))
            continue
        m = _LARK_RULE.fullmatch(line)
        if m is None or m.group(2).lstrip().startswith("="):
            raise ValueError(f"grammar (Lark), line {n}: not a rule `name: ...` (EBNF's rules are `name ::= ...`)")
        if re.search(r"(^|\s)/[^/]", m.group(2)):
            raise ValueError(f"grammar (Lark), line {n}: Lark's regular expressions (/.../) are not supported here: "
                             "write the terminal as EBNF (literals, [classes], quantifiers)")
        if re.search(r"[\"']\s*\.\.\s*[\"']", m.group(2)):
            raise ValueError(f"grammar (Lark), line {n}: Lark's ranges (\"a\"..\"z\") are not supported here: write a "
                             "class ([a-z])")
        rules.append((m.group(1), [_lark_optionals(m.group(2).strip(), n)]))
    if not rules:
        raise ValueError("grammar: no rule (`name ::= ...`, or Lark's `name: ...`)")
    names = [name for name, _ in rules]
    first = "start" if "start" in names else names[0]  # (Lark's reply rule, whatever else is named root)
    if "root" in names and first != "root":  # a rule of its own named root: under another name, root the reply's
        free = next(n for n in (f"root_{k}" for k in range(len(names) + 1)) if n not in names)
        rules = [(free if name == "root" else name, [_renamed(a, "root", free) for a in alts]) for name, alts in rules]
        first = free if first == "root" else first
        names = [name for name, _ in rules]
    empty = '""'  # (an alternative left empty)
    out = [f"{name} ::= {' | '.join(a or empty for a in alts)}" for name, alts in rules]
    if "root" not in names:
        out.insert(0, f"root ::= {first}")
    return "\n".join(out)
