"""The EBNF grammars of guided decoding (`core.ebnf_grammar`, vLLM's guided_grammar): a grammar written for a regular
language accepts what Python's `re` matches whole, a recursive one what its language holds, every prefix of a text
goes on, and what the checker cannot hold is refused with the reason."""
from __future__ import annotations

import itertools
import random
import re

import pytest

from core.ebnf_grammar import compile_grammar
from core.regex_grammar import matches, walk

# (grammar, the same language as a regex)
REGULAR = [
    ('root ::= [0-9]+', r"\d+"),
    ('root ::= ("ab" | "a")* "b"', r"(ab|a)*b"),
    ('root ::= [a-c]{2,3} "x"?', r"[a-c]{2,3}x?"),
    ('root ::= "-"? [0-9]+ ("." [0-9]+)?', r"-?\d+(\.\d+)?"),
    ("root ::= 'a'{2,} b\nb ::= \"b\" | \"\"", r"a{2,}b?"),
    ('root ::= item ("," " "? item)*\nitem ::= [a-z]+ | "9"', r"([a-z]+|9)(, ?([a-z]+|9))*"),
    ('root ::= [^a-c\\n] .', r"[^a-c\n][\s\S]"),
    ('root ::= "\\x41\\t" [\\]x-z]+ "\\u00e9"', "A\t[\\]x-z]+\u00e9"),
    ('root ::= \\\n  "a"  # a comment, "b"\n  | "c" [\\d]{0,2}', r"a|c\d{0,2}"),
    ('root ::= ("a"? | "b"?)* "x"', r"[ab]*x"),
    ('root ::= (ws | "x")*\nws ::= [ ]*', r"[ x]*"),
    ('root ::= "abc" | "abd" | "ab" | "b"{ 1 , 2 }', r"abc|abd|ab|bb?"),
]
ALPHABET = "abcxyz019.,- \n\tA]é"


def _texts(seed: int, n: int = 400) -> set[str]:
    rng = random.Random(seed)
    out = {"".join(p) for k in range(4) for p in itertools.product("ab9,", repeat=k)}
    out |= {"".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(n)}
    return out


@pytest.mark.parametrize("grammar,pattern", REGULAR)
def test_a_grammar_of_a_regular_language_accepts_what_re_matches(grammar, pattern):
    grammar = grammar.replace("\\\n", "\n")  # (a rule that spans lines)
    g = compile_grammar(grammar)
    for text in _texts(len(grammar)):
        st = walk(g, text)
        want = re.fullmatch(pattern, text) is not None
        assert (st is not None and g.accepts(st)) == want, (grammar, text)
        if want:  # every prefix of a text goes on
            assert all(walk(g, text[:k]) is not None for k in range(len(text)))


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += 1 if ch == "(" else -1
        if depth < 0:
            return False
    return depth == 0


def test_a_recursive_grammar_accepts_its_language():
    """Balanced parentheses (no regex holds them): nested as deep as the text goes, repetition keeping the parse as
    shallow as the nesting."""
    g = compile_grammar('root ::= ("(" root ")")*')
    for k in range(9):
        for text in ("".join(p) for p in itertools.product("()", repeat=k)):
            st = walk(g, text)
            assert (st is not None and g.accepts(st)) == _balanced(text), text
    deep = "(" * 300 + ")" * 300
    assert g.accepts(walk(g, deep)) and g.accepts(walk(g, "()" * 500))
    assert max(len(s) for s in walk(g, "()" * 500)) <= 2


# (left-recursive grammar, the same language as a regex): rewritten into right recursion (Paull's method)
LEFT_RECURSIVE = [
    ('root ::= root "a" | "b"', r"ba*"),
    ('root ::= root "," item | item\nitem ::= [a-z]+ | "9"', r"([a-z]+|9)(,([a-z]+|9))*"),
    ('root ::= x\nx ::= y "a"\ny ::= "" | root', r"a+"),  # indirect, through a rule that may be empty last
    ('root ::= root? "x"', r"x+"),  # through a quantifier's group
    ('root ::= root | root "a" | "" | "b" root', r"b*a*"),  # A ::= A dropped; an empty base
    ('root ::= a "z"\na ::= b "y" | "x"\nb ::= a "w" | c\nc ::= "c" | a', r"(x|cy)(wy|y)*z"),
]


@pytest.mark.parametrize("grammar,pattern", LEFT_RECURSIVE)
def test_a_left_recursive_grammar_is_rewritten_and_accepts_its_language(grammar, pattern):
    """Left recursion through first calls, as Lark's and xgrammar's grammars write lists and operators, is held (the
    same language right-recursive): what Python's `re` matches, every prefix of a match going on."""
    g = compile_grammar(grammar)
    for text in _texts(len(grammar)) | {"ba", "xxx", "a,b,9", "bbaa", "cywyyz", "xywz", "xyz", "cz", "cyz"}:
        st = walk(g, text)
        want = re.fullmatch(pattern, text) is not None
        assert (st is not None and g.accepts(st)) == want, (grammar, text)
        if want:
            assert all(walk(g, text[:k]) is not None for k in range(len(text)))


def _expression(text: str) -> bool:
    """Whether `text` is a sum of products of numbers, negated atoms and bracketed sums (recursive descent)."""
    i = 0

    def atom() -> bool:
        nonlocal i
        if text[i:i + 1] == "-":
            i += 1
            return atom()
        if text[i:i + 1] == "(":
            i += 1
            if not chain(atom_chain, "+-") or text[i:i + 1] != ")":
                return False
            i += 1
            return True
        j = i
        while text[i:i + 1].isdigit():
            i += 1
        return i > j

    def chain(item, ops: str) -> bool:
        nonlocal i
        if not item():
            return False
        while text[i:i + 1] and text[i] in ops:
            i += 1
            if not item():
                return False
        return True

    def atom_chain() -> bool:
        return chain(atom, "*/")

    return chain(atom_chain, "+-") and i == len(text)


def test_operators_left_recursive_as_lark_writes_them():
    """An arithmetic grammar in Lark's notation, its operators left-recursive (as Lark's documentation writes them):
    it accepts the expressions a recursive descent parses, and nothing else; a long sum keeps its parses few."""
    g = compile_grammar('''
        ?start: sum
        ?sum: product | sum "+" product | sum "-" product
        ?product: atom | product "*" atom | product "/" atom
        ?atom: NUMBER | "-" atom | "(" sum ")"
        NUMBER: DIGIT+
        DIGIT: "0" | "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9"
    ''')
    rng = random.Random(0)
    texts = ["1+2*3", "-(1-2)/3", "((4))", "1+", "*1", "1(2)", "()", "--1", "1--2"]
    texts += ["".join(rng.choice("12+-*/()") for _ in range(rng.randint(1, 9))) for _ in range(400)]
    assert sum(map(_expression, texts)) >= 30  # (enough of each)
    for text in texts:
        st = walk(g, text)
        assert (st is not None and g.accepts(st)) == _expression(text), text
    long = "+".join(["(1*2-3)"] * 200)
    assert g.accepts(walk(g, long)) and len(walk(g, long)) <= 8


def test_json_as_a_grammar():
    g = compile_grammar(r'''
        root   ::= object
        value  ::= object | array | string | number | ("true" | "false" | "null") ws
        object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
        array  ::= "[" ws ( value ("," ws value)* )? "]" ws
        string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
        number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,3})? ws
        ws     ::= | " " | "\n" [ \t]{0,20}
    ''')
    good = ['{"a": [1, -2.5e3, {"b": "x\\u00e9\\n"}], "c": true}', "{}", '{"k": null}\n']
    bad = ['{"a": }', '{"a": [1, 2', "[]", '{"a" 1}', '{"a": tru}']
    assert all(g.accepts(walk(g, t)) for t in good)
    assert all((st := walk(g, t)) is None or not g.accepts(st) for t in bad)


@pytest.mark.parametrize("grammar,reason", [
    ('root ::= b root "x" | "y"\nb ::= "" | "z"', "left-recursive"),  # (through a rule that may be empty)
    ('root ::= x\nx ::= y root "a" | "b"\ny ::= "z"?', "left-recursive"),
    ('x ::= "a"', "no `root`"),
    ('root ::= y', "'y' is not defined"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('root ::= "a', "not closed"),
    ('root ::= [a-', "not closed"),
    ('root ::= ("a" | "b"', "not closed"),
    ('root ::= [z-a]', "backwards"),
    ('root ::= "a"{3,2}', "counts"),
    ('root ::= "a"{1,5000}', "counts"),
    ('root ::= (= "a") "a"', "lookahead"),
    ('root ::= "a" root', "derives no text"),
    ('start: /[a-z]+/', "regular expressions"),
    ('start: "a".."z"', "ranges"),
    ('| "a"', "before any rule"),
    ('start "a"', "not a rule"),
    ("", "non-empty"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "a" ; "b"', "unexpected"),
    ("root ::= " + " ".join(['"a"{1000}'] * 51), "elements"),
])
def test_what_the_checker_cannot_hold_is_refused_with_the_reason(grammar, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        compile_grammar(grammar)


def test_alternatives_that_begin_alike_keep_one_parse():
    """A list of words, and brackets closed either way: the text keeps one parse, not one per alternative (or
    per level), and an ambiguity as deep as the text costs nothing."""
    words = compile_grammar("root ::= " + " | ".join(f'"w{i:04d}"' for i in range(3000)))
    assert len(words.start) == 1 and all(words.accepts(walk(words, f"w{i:04d}")) for i in range(0, 3000, 7))
    assert walk(words, "w3000") is None
    g = compile_grammar('root ::= "(" root ")" | "(" root "]" | "x"')
    text = "(" * 40 + "x" + "])" * 20
    assert g.accepts(walk(g, text)) and max(len(walk(g, text[:k])) for k in range(1, 41)) == 2  # ( or x next
    slow = compile_grammar('root ::= ("a"?){0,300} ("a"?){0,300} ("a"?){0,300} "x"')  # (paths through what may be
    assert slow.accepts(walk(slow, "a" * 500 + "x"))  # empty meet again: compiled at once)


def test_steps_are_cached_and_states_shared():
    g = compile_grammar('root ::= [a-z]+ "." [a-z]+')
    a, b = walk(g, "abc.de"), walk(g, "xyz.qq")
    assert a is b and g.accepts(a) and not g.accepts(walk(g, "abc."))


def test_a_lark_grammar_is_read_as_vllm_reads_it():
    """No `::=`: vLLM takes the grammar as Lark's (`name: ...`, `|` lines going on with the last rule, `?` dropped,
    `start` the reply's rule, comments `//` and `#`), and so does this server."""

    g = compile_grammar('''
        // vLLM's documentation's SQL grammar, in Lark's notation
        ?start: select_statement
        select_statement: "SELECT " column " from " table " where " condition   # the query
        column: "col_1 " | 'col_2 '
        table: "table_1 "
             | "table_2 "
        condition: column "= " number
        number: "1 " | "2 " | "#"
    ''')
    assert matches(g, "SELECT col_2  from table_1  where col_1 = #") and not matches(g, "SELECT col_3 ")


def test_a_deep_chain_of_rules_is_checked_whole():
    """Rules that call the next, thousands deep (what derives text, what may be empty and what is left-recursive
    are found in one pass each): the chain's texts are held, a left recursion at its far end is rewritten, and one
    there through a rule that may be empty is refused."""
    n = 3000  # (each rule derives text, or may be empty, only through the next: found from the far end)
    chain = "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "z" | "y"'
    g = compile_grammar("root ::= r0\n" + chain)
    assert matches(g, "a" * n + "z") and matches(g, "a" * n + "y") and not matches(g, "a" * 5 + "z")
    empty = "\n".join(f"e{i} ::= e{i + 1}" for i in range(n)) + f'\ne{n} ::= "c"?'
    assert matches(compile_grammar('root ::= e0 "x"\n' + empty), "x")
    g = compile_grammar('root ::= e0 "x"\n' + empty.replace(f'e{n} ::= "c"?', f'e{n} ::= root "y" | "c"?'))
    assert all(matches(g, t) for t in ("x", "cx", "xyx", "cxyxyx")) and not any(matches(g, t) for t in ("xy", "cc"))
    with pytest.raises(ValueError, match="left-recursive"):
        compile_grammar('root ::= e0 "x"\n' + empty.replace(f'e{n} ::= "c"?', f'e{n} ::= "c"? root "y" | "c"'))


_DOUBLING = "root ::= r300\n" + "\n".join(f'r{i} ::= r{i - 1} r{i - 1} | "a"' for i in range(1, 301)) \
    + '\nr0 ::= "a" | ""'  # (a parse at every depth to 300: the search dives MAX_STACK deep for each, 16,384 of
# them were a second a step on the engine's thread)
_CHOICES = '\n'.join(['root ::= "x" r0'] + [f'r{i} ::= p{i} | q{i}\np{i} ::= r{i + 1} "a"\nq{i} ::= r{i + 1} "b"'
                                             for i in range(24)] + ['r24 ::= "c"'])  # (2**24 parses: all at depth 24)


def test_a_grammar_with_a_choice_at_every_level_steps_through_its_parses():
    """Every parse of `_CHOICES` after "x" lies 24 rules deep: a search that found none before it had expanded each
    level whole (breadth first) would take 2**24 expansions; a state keeps some and goes on to a text."""
    g = compile_grammar(_CHOICES)
    st = g.step(g.step(g.start, "x"), "c")
    for _ in range(24):  # (each parse kept fixes the letters to come: one of them is written)
        st = g.step(st, "a") or g.step(st, "b")
        assert st is not None
    assert g.accepts(st) and g.step(st, "a") is None and g.step(st, "b") is None


@pytest.mark.parametrize("grammar", ['root ::= "a" root root | ""', 'root ::= root root | "a"',
                                     'e ::= e "+" e | "(" e ")" | "1"\nroot ::= e',
                                     'root ::= root root | root " " root | [ -~]', _DOUBLING])
def test_an_ambiguous_grammar_keeps_its_shallowest_parses_within_a_bound(grammar):
    """A parse per depth the text could have reached (an ambiguous grammar, right- or left-recursive) would make a
    step of a long reply cost millions of copies: a state keeps its shallowest parses, MAX_KEPT of them and
    MAX_PLACES places in all, each still going on to a text of the grammar, so the reply goes on and may end."""
    from core.ebnf_grammar import MAX_KEPT, MAX_PLACES

    g = compile_grammar(grammar)
    text = "1+" * 1000 + "1" if grammar.startswith("e") else "a" * (60 if grammar == _DOUBLING else 2000)
    states = [g.start]
    for ch in text:
        states.append(g.step(states[-1], ch))
        assert states[-1] is not None and sum(map(len, states[-1])) <= MAX_PLACES and len(states[-1]) <= MAX_KEPT
    assert g.accepts(states[-1]) or grammar == _DOUBLING  # (its parses kept may all want more letters)


def test_a_lark_bracket_is_an_optional_item():
    """Lark's `[item]` is an optional item (Lark has no character classes): it was read as EBNF's class, which
    refused `a` for `start: "a" ["b"]` and took `a"`; a bracket inside a string is the string's."""
    from core.ebnf_grammar import compile_grammar, from_lark

    g = compile_grammar('start: "a" ["b"]\n    | "[" [c [d]] "]"\nc: "c"\nd: "d"')
    for text, ok in (("a", True), ("ab", True), ('a"', False), ("[]", True), ("[cd]", True), ("[d]", False)):
        state = g.start
        for ch in text:
            state = state if state is None else g.step(state, ch)
        assert (state is not None and g.accepts(state)) is ok, text
    with pytest.raises(ValueError, match="a `\\[` with no `\\]`"):
        from_lark('start: "a" ["b"')
    # a literal that ends in an escaped backslash ends there (it was read on, and `[b]` became a class)
    assert '"\\\\" (b)?' in from_lark('start: "\\\\" [b] # a comment\nb: "x"')


def test_a_lark_grammars_own_root_rule_is_not_the_reply():
    """Lark's reply is `start` (else its first rule): a rule of the grammar's own named `root` held the reply to it
    (`start: root "!"` gave `a`, not `a!`); it keeps its place under another name, literals that say root as they
    are."""
    from core.ebnf_grammar import compile_grammar

    g = compile_grammar('start: root "!" ["root"]\nroot: "a" | "b"')
    for text, ok in (("a!", True), ("b!root", True), ("a", False), ("b", False)):
        state = g.start
        for ch in text:
            state = state if state is None else g.step(state, ch)
        assert (state is not None and g.accepts(state)) is ok, text
    g = compile_grammar('root: "x" root | "y"')  # (the reply's rule named root: as it is)
    state = g.start
    for ch in "xxy":
        state = g.step(state, ch)
    assert state is not None and g.accepts(state)
