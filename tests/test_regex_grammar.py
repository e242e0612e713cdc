"""The regex automaton of guided decoding (`core.regex_grammar`): the texts it matches whole are those Python's `re`
matches (ASCII classes), every prefix of a match goes on, a search pattern (JSON Schema's) is found anywhere, and
what cannot be checked as a reply grows is refused."""
from __future__ import annotations

import itertools
import random
import re

import pytest

from core.regex_grammar import choice_pattern, compile_regex, walk

PATTERNS = [r"\d+", r"[a-c]{2,3}x?", r"(ab|a)*b", r"^\w+@\w+\.(com|org)$", r"(?:yes|no)", r"a{0}", r"a{,2}b",
            r"[^\d\s]+", r"-?\d+(\.\d+)?", r"[\w.-]+", r"x|", r"(a|b){3}", r"\u00e9+", r"[a\-z]+", r"a{2,}",
            r"(?P<n>ab)+c", r"[]a]+", r"a.b", r"[\\]+", r"\.\*", r"a{1,3}?b", r"(a*)*b", r"((a|)+)+c", r"[^]]",
            r"\x41\t", r"a{", r"(a$|b)c", r"[\s\S]{2}", r"\012+", r"[\0-\011]", r"\08", r"a{,}b", r"a{٣}"]
ALPHABET = "abcxyz019.-@ \né]\\*A\t{"


def _texts(seed: int) -> set[str]:
    rng = random.Random(seed)
    texts = {"".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 7))) for _ in range(1500)}
    return texts | {"".join(t) for n in range(5) for t in itertools.product("abc0@.x", repeat=n)}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_matches_whole_what_python_matches_and_every_prefix_of_a_match_goes_on(pattern: str) -> None:
    rx, ref = compile_regex(pattern), re.compile(pattern, re.ASCII)
    for text in _texts(len(pattern)):
        st = walk(rx, text)
        want = ref.fullmatch(text) is not None
        assert (st is not None and rx.accepts(st)) == want, text
        if want:
            assert all(walk(rx, text[:k]) is not None for k in range(len(text))), text
        if st is not None:  # a text it goes on from is a prefix of some match: no dead ends
            assert rx.accepts(st) or any(rx.step(st, ch) is not None for ch in ALPHABET + "abcdefghij0123456789_-\0\n")


def test_the_lengths_a_match_may_still_take_are_known() -> None:
    """`lengths`: the fewest and the most characters a match may still take (inf where it may loop), from the start
    and after some text: what a JSON string's minLength and maxLength are checked against."""
    cases = {r"abc": (3, 3), r"^(a|bbb)$": (1, 3), r"a*b{2,3}": (2, float("inf")), r"(a*)*b": (1, float("inf")),
             r"x{0,4}": (0, 4), r"": (0, 0)}
    for pattern, want in cases.items():
        rx = compile_regex(pattern)
        assert rx.lengths(rx.start) == want, pattern
    rx = compile_regex(r"^(a|bbb)$")
    assert rx.lengths(walk(rx, "b")) == (2, 2) and rx.lengths(walk(rx, "a")) == (0, 0)
    rx = compile_regex("abc", search=True)
    assert rx.lengths(rx.start) == (3, float("inf"))


def test_a_search_pattern_is_found_anywhere_unless_anchored() -> None:
    for pattern, texts in ((r"\d{3}", ["a123b", "12", "9999", "x", ""]), (r"^ab", ["abz", "zab", "ab"]),
                           (r"ab$", ["zab", "abz", "ab"]), (r"^$", ["", "a"])):
        rx = compile_regex(pattern, search=True)
        for text in texts:
            st = walk(rx, text)
            assert (st is not None and rx.accepts(st)) == (re.search(pattern, text) is not None), (pattern, text)


def test_a_choice_is_matched_only_by_one_of_its_texts_whole() -> None:
    rx = compile_regex(choice_pattern(["yes", "no, really!", "a|b", "日本", "(x)*"]))
    for text in ("yes", "no, really!", "a|b", "日本", "(x)*"):
        assert rx.accepts(walk(rx, text)), text
    for text in ("a", "ye", "yess", "b", "x", "(x)"):
        st = walk(rx, text)
        assert st is None or not rx.accepts(st), text


@pytest.mark.parametrize("pattern,match", [
    (r"(a", "does not close"), (r"a)", "did not open"), (r"\1", "backreference"), (r"(?=a)", "lookaround"),
    (r"(?i)a", "flag"), (r"a**", "multiple repeat"), (r"\b", "boundary"), (r"[z-a]", "backwards"),
    (r"a{5,2}", "below"), (r"a{2000}", "more than"), (r"[a", "does not close"), (r"a$b", "matches no text"),
    (r"*a", "nothing"), ("(" * 300, "deep"), ("(a{1000}){1000}", "positions"), ("(?:.{0,9}){0,999}", "positions"),
    # a long class repeated: one position a copy, each copy parsed again (10M characters: seconds on the front)
    ("[" + "\u5b57" * 10_000 + "]{1000}", "characters of itself"),
    (("[" + "\u5b57" * 10_000 + "]{0}") * 10 + "[" + "\u5b57" * 10_000 + "]{25}", "characters of itself")])  # ({0}
# gave its part's characters back)
def test_what_a_reply_cannot_be_checked_against_is_refused(pattern: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compile_regex(pattern)


def test_the_step_caches_of_every_automaton_share_one_budget(monkeypatch) -> None:
    """Each automaton keeps the steps it took (the compilers keep the last 64 automata each): every cache in the
    process holds at most `BUDGET` units together, the least recently grown emptied first; an emptied cache steps on
    right; a freed automaton's cache leaves the budget."""
    import gc

    from core import step_cache
    from core.ebnf_grammar import Grammar
    from core.regex_grammar import Regex

    monkeypatch.setattr(step_cache, "BUDGET", 5_000)  # (earlier tests' automata, grown before, go first)
    first, second = Regex(r"[a-z]{0,60}"), Regex(r"[a-j]{0,60}!")  # 60 steps: 3,660 units each (61 + ... + 2)
    word = "".join(random.Random(0).choice("abcdefghij") for _ in range(60))
    assert first.accepts(walk(first, word))
    assert len(first._steps) == 60 and step_cache.held_total() <= step_cache.BUDGET
    for i in range(1, 61):  # the second's steps pass the budget: the first's (grown least recently) go
        assert walk(second, word[:i]) is not None and not second.accepts(walk(second, word[:i]))
        assert step_cache.held_total() <= step_cache.BUDGET
    assert second.accepts(walk(second, word + "!")) and walk(second, word + "!?") is None
    assert len(first._steps) == 0 and len(second._steps) == 62  # (the "?" that goes nowhere too)
    assert first.accepts(walk(first, word)) and walk(first, word + "b") is None  # (61 letters: no)
    assert step_cache.held_total() <= step_cache.BUDGET and len(second._steps) == 0  # (now the second's went)
    before = step_cache.held_total()
    held = first._steps._units
    del first
    gc.collect()
    assert held > 0 and step_cache.held_total() == before - held
    grammar = Grammar('root ::= ("ab" | "cd")* "!"')  # one cache past the budget by itself: it starts over
    monkeypatch.setattr(step_cache, "BUDGET", step_cache.held_total() + 5)
    assert grammar.accepts(walk(grammar, "abcd" * 20 + "!")) and walk(grammar, "abcd" * 20 + "x") is None
    assert step_cache.held_total() <= step_cache.BUDGET


def test_white_space_is_unicodes():
    """`\\s` is Unicode's white space (ECMA 262's, a JSON Schema pattern's, and Python's): a no-break space, the
    line separator, an ideographic space are white space and `\\S` refuses them (they were ASCII's only)."""
    from core.regex_grammar import compile_regex, matches

    for ch in ("\u00a0", "\u2028", "\u3000", "\ufeff", " ", "\t"):
        assert matches(compile_regex(r"\s"), ch) and not matches(compile_regex(r"\S"), ch), repr(ch)
    assert matches(compile_regex(r"\S+"), "ab") and not matches(compile_regex(r"\s"), "a")


def test_pythons_text_anchors_are_the_texts_start_and_end():
    """`\\A` and `\\Z` (Python's) are `^` and `$` (they were a 400 as an unknown escape)."""
    from core.regex_grammar import compile_regex, matches

    anchored = compile_regex(r"\Aab\Z", search=True)
    assert matches(anchored, "ab") and not matches(anchored, "xab") and not matches(anchored, "abx")
    assert matches(compile_regex(r"a\Z|b"), "b")


def test_no_position_waits_for_a_lone_surrogate():
    """A reply's text is UTF-8's: it holds no lone surrogate. A pattern of only those matches no text (a 400; it
    compiled, and no character fitted from the start), and a class or `.` takes the rest of its characters."""
    from core.regex_grammar import compile_regex, matches

    with pytest.raises(ValueError, match="matches no text"):
        compile_regex("\\ud800")
    assert matches(compile_regex("a|\\ud800"), "a") and matches(compile_regex("[\\ud800-\\udfffb]"), "b")
    assert matches(compile_regex("."), "\U0001f600")
