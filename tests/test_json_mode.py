"""JSON mode's parts: the character-level JSON automaton (`core.json_grammar`) against Python's json, and the choice
of a fitting token (`engine.json_mode.choose`) on hand-made logits."""
import json
import math
import random

import pytest
import torch

from core.json_grammar import MAX_WHITESPACE, START, advance, complete, feed
from core.sampling import SamplingParams
from engine.json_mode import JsonStates, choose


def _value(rng: random.Random, depth: int):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([rng.randint(-10**6, 10**6), rng.uniform(-1e9, 1e9), 1e-7, True, False, None,
                           "plain", 'q"uo\\te', "tab\there", "\u00e9\u4e2d\U0001f600", ""])
    if r < 0.65:
        return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def test_every_json_object_is_accepted_whole_and_every_prefix_continues():
    rng = random.Random(0)
    for _ in range(400):
        obj = {f"k{i}": _value(rng, 1) for i in range(rng.randint(0, 4))}
        for indent in (None, 2):
            text = json.dumps(obj, indent=indent, ensure_ascii=rng.random() < 0.5)
            st = START
            for j, ch in enumerate(text):
                st = advance(st, ch)
                assert st is not None, (text, j)
                assert complete(st) == (j == len(text) - 1), (text, j)


@pytest.mark.parametrize("text", [
    "[]", '"s"', "1", '{"a" 1}', '{"a": 01}', '{"a": tru}', '{"a": "\n"}', '{a: 1}', '{"a": 1,}', '{"a": -}',
    '{"a": 1.}', '{"a": .5}', '{"a": 1}}', '{"a": [1 2]}', '{"a": "\\x"}', '{"a": "\\u12g4"}', "{,}", '{"a":1e}'])
def test_what_no_json_object_starts_with_is_refused(text):
    st = advance(START, text)
    assert st is None or not complete(st)
    if st is not None:  # a prefix the automaton takes: Python's json refuses it whole too
        with pytest.raises(ValueError):
            obj = json.loads(text)
            assert isinstance(obj, dict)


def test_random_texts_the_automaton_completes_are_json_objects():
    rng = random.Random(1)
    chars = '{}[]":,0123456789-.eE+tfalsenur \\ab'
    completed = 0
    for _ in range(100000):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(1, 10)))
        st = advance(START, text)
        if st is not None and complete(st):
            assert isinstance(json.loads(text), dict), text
            completed += 1
    assert completed > 0


def test_whitespace_outside_strings_is_capped_and_an_empty_text_never_fits():
    assert advance(START, " " * MAX_WHITESPACE + "{}") is not None
    assert advance(START, " " * (MAX_WHITESPACE + 1)) is None
    assert advance(advance(START, '{"a": "'), " " * 500) is not None  # inside a string: any length
    assert advance(START, "") is None


TEXTS = {0: "", 1: "{", 2: "}", 3: '"', 4: "a", 5: ":", 6: "1", 7: "]", 8: " ", 9: "x\n"}  # 0: the EOS


def _text(t: int) -> bytes:
    return TEXTS[t].encode()


def test_greedy_takes_the_likeliest_token_that_fits_and_a_stop_only_once_the_object_ended():
    x = torch.tensor([5.0, 1.0, 0.5, 0.0, 4.0, 0.0, 3.0, 6.0, -1.0, 7.0])
    p = SamplingParams(temperature=0.0)
    stops = frozenset({0})
    assert choose(x, p, None, (START, b""), stops, _text) == 1  # "x\n", "]", the EOS and "a" do not fit before "{"
    opened = advance(START, "{")
    assert choose(x, p, None, (opened, b""), stops, _text) == 2  # "}" (0.5) before a key's quote (0.0) and " " (-1)
    done = advance(START, "{}")
    assert choose(x, p, None, (done, b""), stops, _text) == 0  # the EOS, now
    x[0] = float("-inf")  # the EOS banned (min_tokens): only whitespace fits
    assert choose(x, p, None, (done, b""), stops, _text) == 8
    assert choose(torch.full((10,), float("-inf")), p, None, (done, b""), stops, _text) is None


def test_a_draw_keeps_the_rows_distribution_over_the_tokens_that_fit():
    x = torch.log(torch.tensor([0.05, 0.05, 0.05, 0.3, 0.2, 0.05, 0.05, 0.05, 0.1, 0.1]))
    p = SamplingParams(temperature=1.0)
    opened = advance(START, "{")  # fit: '"' (0.3), "}" (0.05), " " (0.1)
    g = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(4000):
        t = choose(x, p, float(torch.rand(1, generator=g)), (opened, b""), frozenset({0}), _text)
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) == {2, 3, 8}
    for t, want in ((3, 0.3 / 0.45), (2, 0.05 / 0.45), (8, 0.1 / 0.45)):
        assert abs(counts[t] / 4000 - want) < 0.03, counts


def test_a_sampled_row_checks_the_tokens_its_draw_lands_on_and_a_greedy_row_the_likeliest():
    """A draw checks only the token it lands on while that one fits (a check steps the automaton in Python, and a
    row's 256 likeliest were each checked every step: a large schema's row slowed its batch's steps), the next draw
    going on from where it fell; a greedy row checks from the likeliest down. An enum of hundreds of values and a
    closed object of hundreds of keys are looked up in order, not scanned."""
    checked: list[int] = []

    def counted(t: int) -> bytes:
        checked.append(t)
        return TEXTS[t].encode()
    opened = (advance(START, "{"), b"")
    x = torch.log(torch.tensor([0.01, 0.01, 0.01, 0.9, 0.01, 0.01, 0.01, 0.02, 0.01, 0.01]))  # '"' likeliest
    assert choose(x, SamplingParams(temperature=1.0), 0.5, opened, frozenset({0}), counted) == 3 and checked == [3]
    checked.clear()
    x = torch.log(torch.tensor([0.01, 0.01, 0.01, 0.01, 0.9, 0.01, 0.01, 0.02, 0.01, 0.01]))  # "a" (no fit) likeliest
    t = choose(x, SamplingParams(temperature=1.0), 0.5, opened, frozenset({0}), counted)
    assert t in (2, 3, 8) and checked[0] == 4 and len(checked) == len(set(checked)) <= 10
    checked.clear()
    x = torch.tensor([0.0, 0.1, 0.4, 0.2, 0.9, 0.3, 0.15, 0.5, 0.05, 0.25])  # "a", "]", "}" ... ('"' below "}")
    assert choose(x, SamplingParams(temperature=0.0), None, opened, frozenset({0}), counted) == 2
    assert checked == [4, 7, 2]  # "a" and "]" do not fit, "}" does
    big = _schema_state({"type": "object", "additionalProperties": False,
                         "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(300)]} for i in range(300)}})
    assert complete(advance(big, '{"k7": "v123", "k299": "v9", "k0": "v0"}'))
    assert advance(big, '{"k7": "v123", "k7"') is None and advance(big, '{"k300"') is None
    assert advance(big, '{"k1": "v300"') is None and advance(big, '{"k1": "v30"') is not None


def test_a_fallback_draw_checks_a_bounded_part_of_the_vocabulary():
    """A sampled row none of whose likeliest tokens fit (a logit_bias of +100 on 300 tokens its own regex refuses)
    draws among the likeliest tokens that fit, found by checking a bounded number of tokens: it walked the whole
    vocabulary, a Python automaton step each, for every row of every step (a request of n=256 such rows stalled its
    replica's every step)."""
    from core.json_grammar import start_pattern
    from core.regex_grammar import compile_regex
    from engine.json_mode import CANDIDATES, FALLBACK_CHECKS

    V = 40_000
    texts = [("e" if t < 300 else "") + f"w{t} " for t in range(V)]  # the first 300 have an "e"
    checked = []

    def token_bytes(t: int) -> bytes:
        checked.append(t)
        return texts[t].encode()
    x = torch.randn(V, generator=torch.Generator().manual_seed(0))
    x[:300] += 100.0
    g = (start_pattern(compile_regex("[^e]*")), b"")
    for u in (0.1, 0.5, 0.9):
        checked.clear()
        t = choose(x, SamplingParams(temperature=1.0, regex="[^e]*"), u, g, frozenset({V - 1}), token_bytes)
        assert t is not None and t >= 300 and len(checked) <= CANDIDATES + FALLBACK_CHECKS, (t, len(checked))
    # where more tokens than the bound come before the first that fits, the draw is still among many that fit (the
    # bound counts from the first fit: counted from the start, the first alone was drawn, whatever the draw)
    texts = [("e" if t < 6000 else "") + f"w{t} " for t in range(V)]
    flat = torch.zeros(V)
    flat[:6000] += 100.0
    drawn = {choose(flat, SamplingParams(temperature=1.0, regex="[^e]*"), u / 50, g, frozenset({V - 1}), token_bytes)
             for u in range(50)}
    assert len(drawn) > 20 and all(t >= 6000 for t in drawn), drawn


def test_a_row_whose_likeliest_token_takes_all_its_probability_still_gets_one_that_fits():
    """At a low temperature, or under a large logit_bias, every token but the likeliest has probability 0.0 in a
    float: where that one does not fit, the draw is among those that do, weighed against the likeliest of them (it
    went unconstrained: QA's guided_choice at temperature 0.05, a regex with a quote biased by 100)."""
    opened = (advance(START, "{"), b"")  # fit: "}" (2), '"' (3), " " (8)
    x = torch.tensor([0.0, 0.0, 1.0, 3.0, 100.0, 0.0, 0.0, 0.0, 2.0, 0.0])  # "a" (4) far ahead, then '"', " ", "}"
    for temperature, u in ((0.01, 0.5), (0.05, 0.99), (0.7, 0.3), (1.0, 0.0)):
        t = choose(x, SamplingParams(temperature=temperature), u, opened, frozenset({0}), _text)
        assert t in (2, 3, 8), (temperature, t)
    assert choose(x, SamplingParams(temperature=0.01), 0.9, opened, frozenset({0}), _text) == 3  # (e^-100 for " ")
    g = torch.Generator().manual_seed(1)
    counts = {}
    for _ in range(3000):  # at temperature 1 the fitting ones keep their odds: '"' e^3, " " e^2, "}" e^1
        t = choose(x, SamplingParams(temperature=1.0), float(torch.rand(1, generator=g)), opened, frozenset({0}),
                   _text)
        counts[t] = counts.get(t, 0) + 1
    total = math.exp(3) + math.exp(2) + math.exp(1)
    for t, want in ((3, math.exp(3) / total), (8, math.exp(2) / total), (2, math.exp(1) / total)):
        assert abs(counts[t] / 3000 - want) < 0.03, counts


JS = SamplingParams(json_object=True)


def test_states_feed_only_the_new_tokens_and_start_over_for_a_shorter_reply():
    seen = []

    def text(t: int) -> bytes:
        seen.append(t)
        return TEXTS[t].encode()
    js = JsonStates()
    js.hold("r")
    assert js.state("r", JS, [1, 3, 4], text) == (advance(START, '{"a'), b"")
    assert js.state("r", JS, [1, 3, 4, 3], text) == (advance(START, '{"a"'), b"") and seen == [1, 3, 4, 3]
    assert js.state("r", JS, [1, 3], text) == (advance(START, '{"'), b"")  # a step re-run: from the start
    assert js.state("bad", JS, [4], text) is None  # a token that did not fit: no state
    js.release("r")
    # released: a late draw keeps nothing
    assert js.state("r", JS, [1], text) == (advance(START, "{"), b"") and not js._at


def _schema_state(schema: dict):
    from core.json_grammar import compile_schema, start
    return start(compile_schema(json.dumps(schema)))


def test_a_schemas_values_are_taken_and_what_breaks_it_is_refused():
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal, Optional

    class Addr(pydantic.BaseModel):
        city: str
        zip: int

    class Person(pydantic.BaseModel):
        name: str
        age: int
        tags: list[str]
        kind: Literal["a", "bb"]
        addr: Optional[Addr] = None
        score: float

    class Tree(pydantic.BaseModel):
        v: int
        kids: list["Tree"] = []

    st = _schema_state(Person.model_json_schema())  # $defs, $ref, anyOf (Optional), enum (Literal)
    for obj in (Person(name="x", age=3, tags=["a"], kind="bb", addr=Addr(city="c", zip=9), score=1.5),
                Person(name="", age=-2, tags=[], kind="a", score=2)):
        for indent in (None, 2):
            done = advance(st, obj.model_dump_json(indent=indent))
            assert done is not None and complete(done)
    for bad in ('{"name": 1', '{"age": 1.5', '{"kind": "c"', '{"kind": "b"}', '{"nam": ', '{"name": "x"}',
                '{"tags": [1]', '{"addr": {"city": "c"}}', '{"name": "x", "name"', "[]"):
        assert advance(st, bad) is None, bad  # a wrong type, enum value or key, a required key missing, a repeat
    tree = _schema_state(Tree.model_json_schema())  # a recursive $ref
    done = advance(tree, Tree(v=1, kids=[Tree(v=2, kids=[Tree(v=3)])]).model_dump_json())
    assert done is not None and complete(done)
    free = _schema_state({"type": "object", "additionalProperties": True, "properties": {"a": {"type": "null"}}})
    assert complete(advance(free, '{"zz": [1, {"q": true}], "a": null}'))
    assert advance(free, '{"a": 1') is None
    typed = _schema_state({"type": "object", "additionalProperties": {"type": "integer"}})
    assert complete(advance(typed, '{"x": 1, "y": -20}')) and advance(typed, '{"x": 1.5') is None
    const = _schema_state({"type": "object", "properties": {"v": {"const": 10}, "w": {"enum": [1, 12, "1"]}}})
    assert complete(advance(const, '{"v": 10, "w": 12}')) and complete(advance(const, '{"w": 1}'))
    assert advance(const, '{"v": 1}') is None and advance(const, '{"w": 2') is None
    named = _schema_state({"$defs": {"E": {"type": "boolean"}}, "properties": {"enum": {"$ref": "#/$defs/E"}},
                           "required": ["enum"]})  # a key named as a keyword, its schema a $ref
    assert complete(advance(named, '{"enum": true}')) and advance(named, '{"enum": 1') is None
    sized = _schema_state({"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer"}})
    assert advance(sized, "[]") is None and advance(sized, "[1, 2,") is None
    assert complete(advance(sized, "[1]")) and complete(advance(sized, "[1, 2]"))
    either = _schema_state({"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "string"}}]})
    assert complete(advance(either, '["a", "b"]')) and advance(either, '[1') is None
    assert complete(advance(either, "7")) and complete(advance(either, "7 "))  # a number at the top may end anywhere
    const_top = _schema_state({"enum": [1, 12]})
    assert complete(advance(const_top, "1")) and complete(advance(const_top, "12"))
    # alternatives that share schemas: 2**40 paths to the one string, each schema looked at once (compiling walked
    # every path, and so did each character's step: hours)
    shared = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(40)}
    chain = _schema_state({"$defs": {**shared, "d40": {"type": "string"}}, "$ref": "#/$defs/d0"})
    assert complete(advance(chain, '"abc"')) and advance(chain, "1") is None
    first = _schema_state({"anyOf": [{"anyOf": [{"type": "integer", "maximum": 5}, {"enum": [7]}]},
                                     {"type": "number"}]})
    assert complete(advance(first, "7")) and complete(advance(first, "9.5")) and complete(advance(first, "3"))
    # a value follows every alternative it fits so far, not the first its first character fits: an integer or a
    # number (1.5 was refused), a union of objects (each begins with "{": only the first was ever written)
    assert complete(advance(_schema_state({"anyOf": [{"type": "integer"}, {"type": "number"}]}), "1.5"))
    cat = {"type": "object", "properties": {"meow": {"type": "boolean"}}, "required": ["meow"]}
    dog = {"type": "object", "properties": {"bark": {"type": "integer"}}, "required": ["bark"]}
    pet = _schema_state({"oneOf": [cat, dog]})
    assert complete(advance(pet, '{"meow": true}')) and complete(advance(pet, '{"bark": 3}'))
    assert advance(pet, '{"bark": true') is None and advance(pet, '{"meow": true, "bark"') is None
    assert not complete(advance(pet, '{"meow": true'))
    # `$ref`s are JSON pointers from the root: "#" itself (OpenAI's recursive UI example), a property's schema, an
    # escaped name
    ui = _schema_state({"type": "object", "properties": {"label": {"type": "string"},
                                                         "children": {"type": "array", "items": {"$ref": "#"}}},
                        "required": ["label", "children"], "additionalProperties": False})
    assert complete(advance(ui, '{"label": "a", "children": [{"label": "b", "children": []}]}'))
    assert advance(ui, '{"label": "a", "children": [{"label": 1') is None
    props = {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}, "c": {"$ref": "#/$defs/x~1y"},
             "d": {"$ref": "#/$defs/x%25"}}
    pointed = _schema_state({"type": "object", "properties": props,
                             "$defs": {"x/y": {"type": "boolean"}, "x%": {"type": "null"}}})
    assert complete(advance(pointed, '{"a": 1, "b": 2, "c": true, "d": null}'))
    assert advance(pointed, '{"b": "2"') is None and advance(pointed, '{"c": 1') is None


def _fed(state, chunks):
    """(state, pending bytes) after feeding each chunk of bytes (`feed`), or None once one does not fit."""
    g = (state, b"")
    for c in chunks:
        g = feed(g[0], g[1], c) if g is not None else None
    return g


def test_a_character_split_between_tokens_is_written_a_token_at_a_time():
    """A byte-level vocabulary splits a CJK character or an emoji between tokens: every JSON object's UTF-8, cut at
    random bytes, is taken chunk by chunk; a stop fits only at its end (nothing begun and left); bytes that are no
    UTF-8 (a stray continuation, an overlong form, a surrogate's, a lead byte past U+10FFFF) are refused."""
    rng = random.Random(3)
    for _ in range(300):
        obj = {f"k{i}\u00e9": _value(rng, 1) for i in range(rng.randint(1, 4))}
        data = json.dumps(obj, ensure_ascii=False).encode()
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 12))))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        g = (START, b"")
        for j, c in enumerate(chunks):
            g = feed(g[0], g[1], c)
            assert g is not None, (data, cuts, j)
            assert (complete(g[0]) and not g[1]) == (j == len(chunks) - 1), (data, cuts, j)
    opened = advance(START, '{"a": "')
    for bad in (b"\x80", b"\xc0", b"\xc1\xbf", b"\xe0\x80", b"\xed\xa0", b"\xf4\x90", b"\xf5", b"\xff", b"\xe6x"):
        assert _fed(opened, [bad]) is None, bad
    assert _fed(START, ["日".encode()[:1]]) is None  # (no JSON value begins with a CJK character)
    assert _fed(START, [b""]) is None  # a token of no bytes never fits


def test_guided_texts_count_characters_not_tokens():
    """A regex or a choice of characters that take several bytes: a character begun in one token and finished in
    the next counts once, and its first bytes fit only where a character they begin may come."""
    from core.json_grammar import start_pattern
    from core.regex_grammar import choice_pattern, compile_regex

    two = start_pattern(compile_regex(".{2}"))
    ni = "你".encode()
    half = _fed(two, [ni[:2]])
    assert half is not None and half[1] == ni[:2] and not complete(half[0])
    assert not complete(_fed(two, [ni[:2], ni[2:]])[0]) and complete(_fed(two, ["你好".encode()])[0])
    choice = start_pattern(compile_regex(choice_pattern(["日本", "中国", "🎊 fiesta"])))
    for text in ("日本", "中国", "🎊 fiesta"):
        b = text.encode()
        g = _fed(choice, [b[k:k + 1] for k in range(len(b))])  # a byte at a time
        assert g is not None and complete(g[0]) and not g[1], text
    assert _fed(choice, ["国".encode()[:1]]) is None  # U+56FD's lead byte: no choice begins with such a character
    assert _fed(choice, ["😀".encode()[:3]]) is None  # 🎊's first two bytes, not its third
    enum = _schema_state({"enum": ["日本", "中国"]})
    assert complete(_fed(enum, [b'"', "中".encode()[:2], "中".encode()[2:] + "国".encode(), b'"'])[0])


def test_escapes_in_keys_and_unicode_escapes_only_where_a_character_they_write_may_come():
    """A closed object's key that holds a quote or a backslash is written escaped (it was refused: the reply lost
    its schema there); a \\u escape's digits fit only while some character they may still write can come (a
    pattern's, a maxLength's, a closed key's), a surrogate pair's high half only where a character it pairs into can."""
    closed = _schema_state({"type": "object", "additionalProperties": False, "required": ['we"ird'],
                            "properties": {'we"ird': {"type": "integer"}, "a\\b": {"type": "integer"}}})
    assert complete(advance(closed, '{"a\\\\b": 2, "we\\"ird": 1}'))
    assert complete(advance(closed, '{"we\\u0022ird": 1}'))
    assert advance(closed, '{"w\\n') is None and advance(closed, '{"we\\u0023') is None
    assert advance(closed, '{"x') is None
    upper = _schema_state({"type": "string", "pattern": "^[A-Z]+$"})
    assert advance(upper, '"\\u2') is None and advance(upper, '"\\u005') is not None
    assert advance(upper, '"\\u005b') is None
    assert complete(advance(upper, '"\\u0041B"'))
    ended = _schema_state({"type": "string", "pattern": "^a$"})
    assert advance(ended, '"a\\') is None and complete(advance(ended, '"a"'))  # (no character may come after "a")
    smile = _schema_state({"type": "string", "pattern": "^[\U0001f600-\U0001f64f]$"})
    assert advance(smile, '"\\ud83c') is None and complete(advance(smile, '"\\ud83d\\ude00"'))
    assert complete(_fed(smile, ['"😀"'.encode()])[0]) and _fed(smile, ['"🎉'.encode()[:4]]) is None
    free = _schema_state({"type": "string", "maxLength": 2})  # a surrogate pair is one character; a lone half none
    assert complete(advance(free, '"\\ud83d\\ude00x"')) and advance(free, '"\\ud83d\\ude00xy') is None
    for lone in ('"\\ud83d"', '"\\ud83dx', '"\\ud83d\\u0041', '"\\ude00', '"\\ud83d\\ud83d', '"\\udc'):
        assert advance(free, lone) is None, lone
    keyed = _schema_state({"type": "object", "properties": {"😀": {"type": "integer"}}, "required": ["😀"]})
    assert complete(advance(keyed, '{"\\ud83d\\ude00": 1}')) and advance(keyed, '{"\\ud83c') is None


SCHEMAS_TO_WALK = [
    {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"}, {"type": "string", "pattern": "^a\\nb$"},
    {"type": "string", "pattern": "^é+$", "maxLength": 4},
    {"type": "string", "enum": ["日本", "中国", 'a"b', "x\\y"]},
    {"const": "🎉"}, {"type": "string", "minLength": 2, "maxLength": 3},
    {"type": "string", "pattern": "^[\\u4e00-\\u9fff]{2}$"}, {"type": "string", "pattern": "^[😀-🙏]$"},
    {"type": "object", "properties": {'we"ird': {"type": "integer", "minimum": 3, "maximum": 7},
                                      "a\\b": {"type": "string", "maxLength": 2}, "日本": {"type": "boolean"}},
     "required": ['we"ird'], "additionalProperties": False},
    {"type": "object", "properties": {"😀": {"type": "integer"}}, "required": ["😀"]},  # (no escape writes it)
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]}]


@pytest.mark.parametrize("schema", SCHEMAS_TO_WALK, ids=range(len(SCHEMAS_TO_WALK)))
def test_no_walk_of_single_bytes_reaches_a_state_nothing_can_follow(schema):
    """A byte-level vocabulary has a token for each byte: from any state a walk of them reaches, some byte goes on,
    or the value has ended (guided decoding never strands a reply where no token fits, which then went on free)."""
    st0 = _schema_state(schema)
    rng = random.Random(0)
    for _ in range(8):
        g = (st0, b"")
        for _ in range(30):
            nxt = [bytes([b]) for b in range(256) if feed(g[0], g[1], bytes([b])) is not None]
            if not nxt:
                assert complete(g[0]) and not g[1], (schema, g)
                break
            g = feed(g[0], g[1], rng.choice(nxt))


def test_a_whole_scan_checks_only_the_tokens_whose_first_bytes_may_come():
    """`_may_fit`: every token that fits is among those the scan keeps (by their first two bytes, or their first
    where many may come), the stops only once the value has ended, and far fewer are kept where little may come."""
    from core.json_grammar import start_pattern
    from core.regex_grammar import compile_regex
    from engine.detokenizer import TokenBytes
    from engine.json_mode import _may_fit
    from engine.testing import build_tokenizer

    tok = build_tokenizer(512)
    tb = TokenBytes(tok)
    width, stops = len(tok), frozenset({0})
    states = [(START, b""), (advance(START, '{"a": "x'), b""), (advance(START, "{"), b""),
              _fed(_schema_state({"enum": ["日本", "中国"]}), [b'"', "中".encode()[:1]]),
              (advance(_schema_state({"type": "object", "additionalProperties": False,
                                      "properties": {"key one": {"type": "integer"}}}), '{"key'), b""),
              (start_pattern(compile_regex("[龍国]{2}|ab")), b""), (advance(START, "{}"), b"")]
    for g in states:
        done = complete(g[0]) and not g[1]
        mask = _may_fit(g, tb, width, stops, done)
        fit = [t for t in range(width) if (done if t in stops else feed(g[0], g[1], tb(t)) is not None)]
        assert all(mask[t] for t in fit), g
        assert bool(mask[0]) == done
    assert int(_may_fit(states[2], tb, width, stops, False).sum()) < width // 8  # '"', "}" or whitespace first


def test_token_bytes_of_byte_level_and_byte_fallback_vocabularies():
    """`TokenBytes`: a byte-level BPE piece as its bytes (a CJK character's first two bytes alone), a SentencePiece
    vocabulary's byte piece as its byte and a word piece as its text (its leading space put back), special tokens
    as none."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from engine.detokenizer import TokenBytes
    from engine.testing import build_tokenizer

    bl = build_tokenizer(512)
    tb = TokenBytes(bl)
    ids = bl.encode("龍 a", add_special_tokens=False)
    assert b"".join(tb(i) for i in ids) == "龍 a".encode() and len(ids) > 2
    assert all(tb(i) == b"" for i in bl.all_special_ids)
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "\u2581a": 258, "a": 259, "日": 260}
    sp = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tb = TokenBytes(PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", unk_token="<unk>"))
    assert [tb(i) for i in (0, 1, 2 + 0xE6, 258, 259, 260)] == [b"", b"", b"\xe6", b" a", b"a", "日".encode()]


def test_a_reasoning_models_format_holds_once_its_thinking_has_ended():
    """`thinking_first`: anything goes until `</think>` (seen across pieces), then the format; "open" (the template
    opened the thinking: deepseek_r1) thinks from the start, otherwise only a reply that opens with `<think>` does
    (qwen3), and one that does not is held to the format from its first character (whitespace before `<think>` as
    the format would take it); whitespace may follow the thinking; while it thinks a stop token may end it."""
    from core.json_grammar import start_pattern, thinking_first
    from core.regex_grammar import compile_regex

    opened = thinking_first(START, True)
    for text in ("Let me see. </think>{}", "<think>hm</think>\n{}", "a</th" + "ink>{}"):
        assert complete(advance(opened, text)), text
    for text in ("no end yet", "2 < 3 </thi"):  # still thinking: nothing held, a stop token either (vLLM's way)
        st = advance(opened, text)
        assert st is not None and complete(st), text
    assert advance(opened, "ok</think>x") is None  # the format holds after it
    tagged = thinking_first(start_pattern(compile_regex("yes|no")), False)
    assert complete(advance(tagged, "yes")) and complete(advance(tagged, "<think>maybe</think>no"))
    assert advance(tagged, "\n") is None  # whitespace first only as the format would take it (this one: none) ...
    json_tagged = thinking_first(START, False)
    assert advance(json_tagged, " " * 16 + "<think>x</think>{}") and advance(json_tagged, " " * 17) is None  # (JSON)
    assert not complete(advance(json_tagged, "<thi"))  # (not yet thinking: no stop)
    assert complete(advance(tagged, "<think>hm</think>\n\nyes"))  # the whitespace after the thinking, then the format
    assert advance(tagged, "<think>hm</think>" + " " * 17) is None  # (as much as JSON allows)
    assert not complete(advance(tagged, "<think>hm</think>"))  # "yes|no" is not empty
    assert advance(tagged, "x") is None and not complete(advance(tagged, "<thi"))


def test_string_lengths_tuples_and_number_bounds_are_kept():
    """pydantic's constrained fields: a string's min_length / max_length (an escape one character), a tuple's items
    (prefixItems), a number's ge / gt / le / lt: what keeps them is taken, what breaks them refused as soon as no
    value could meet them, and a bounded number ends only within its bounds."""
    from core.json_grammar import compile_schema

    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        code: str = pydantic.Field(min_length=2, max_length=3)
        qty: int = pydantic.Field(ge=1, le=120)
        share: float = pydantic.Field(gt=0, lt=1)
        pair: tuple[int, str]

    st = _schema_state(Item.model_json_schema())
    ok = Item(code="ab", qty=120, share=0.25, pair=(3, "x"))
    assert complete(advance(st, ok.model_dump_json())) and complete(advance(st, ok.model_dump_json(indent=2)))
    assert complete(advance(st, '{"code": "\\n\\u00e9c", "qty": 1, "share": 0.999, "pair": [-4, ""]}'))
    for bad in ('{"code": "a"', '{"code": "abcd', '{"code": "ab\\n\\t', '{"code": "ab", "qty": 0',
                '{"code": "ab", "qty": 121', '{"code": "ab", "qty": 1200', '{"code": "ab", "qty": -',
                '{"code": "ab", "qty": 12.', '{"code": "ab", "qty": 1, "share": 1',
                '{"code": "ab", "qty": 1, "share": 0,',
                '{"code": "ab", "qty": 1, "share": 0.0,', '{"code": "ab", "qty": 1, "share": -0.1',
                '{"code": "ab", "qty": 1, "share": 5e-1', '{"code": "ab", "qty": 1, "share": 0.5, "pair": ["',
                '{"code": "ab", "qty": 1, "share": 0.5, "pair": [1, "a", ',
                '{"code": "ab", "qty": 1, "share": 0.5, "pair": [1]'):
        assert advance(st, bad) is None, bad
    coded = _schema_state({"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
                                                          "note": {"type": "string", "pattern": "ok"}}})
    assert complete(advance(coded, '{"sku": "AB-12", "note": "is ok?"}'))  # (unanchored: found anywhere)
    assert complete(advance(coded, '{"sku": "\\u0041B-1", "note": "o\\u006b"}'))  # escapes are their characters
    for bad in ('{"sku": "ab', '{"sku": "AB1', '{"sku": "AB-"', '{"sku": "AB-1x', '{"note": "no"}', '{"note": "\\n'):
        assert advance(coded, bad) is None or not complete(advance(coded, bad + "}")), bad
    short = _schema_state({"type": "string", "pattern": "abc", "maxLength": 5})  # a match must still fit
    assert complete(advance(short, '"xxabc"')) and advance(short, '"xxx') is None and advance(short, '"xxxxx') is None
    either = _schema_state({"type": "string", "pattern": "^(a|bbb)$", "minLength": 2})
    assert advance(either, '"a') is None and complete(advance(either, '"bbb"'))
    emoji = _schema_state({"type": "string", "pattern": "^[^\\U0001F600]*$", "maxLength": 1})
    assert advance(emoji, '"\\ud83d\\ude00"') is None  # an escaped surrogate pair is its one character
    assert complete(advance(emoji, '"\\ud83d\\ude01"')) and advance(emoji, '"\\ud83d\\ude01a') is None
    assert compile_schema(json.dumps({"type": "string", "minimum": 0.5, "maximum": 0.7}))  # (a number's bounds)
    assert compile_schema(json.dumps({"type": "integer", "minimum": 10**400}))
    for lo, hi, integer in ((-15, 7, True), (3, 3, True), (-2.5, 0.75, False), (10, None, True), (None, -3, False)):
        schema = {"type": "integer" if integer else "number"}
        if lo is not None:
            schema["minimum"] = lo
        if hi is not None:
            schema["exclusiveMaximum" if not integer else "maximum"] = hi
        top = _schema_state(schema)
        for v in [x / 4 for x in range(-100, 101)] + [x for x in range(-200, 201)]:
            text = str(v) if not integer else str(int(v))
            if integer and v != int(v):
                continue
            inside = (lo is None or v >= lo) and (hi is None or (v <= hi if integer else v < hi))
            got = advance(top, text)
            assert (got is not None and complete(got)) == inside, (schema, text)
            if inside:  # every prefix of a value within its bounds goes on
                assert all(advance(top, text[:k]) is not None for k in range(1, len(text) + 1)), (schema, text)


@pytest.mark.parametrize("schema,match", [
    ([], "must be a JSON object"), ({"type": "string", "pattern": "(?=a)"}, "pattern"), ({"uniqueItems": True},
                                                                                       "uniqueItems"),
    ({"pattern": 3}, "pattern must be"), ({"pattern": "a$b"}, "matches no text"),
    ({"$ref": "#/$defs/Nope"}, "names no schema"), ({"$ref": "#/properties/a/type"}, "names no schema"),
    ({"$ref": "#"}, "refers to itself"), ({"enum": [1, float("nan")]}, "NaN or Infinity"),
    ({"properties": {"a": {"anyOf": [{"$ref": "#/properties/a"}]}}}, "lead back"),  # (through a pointer's schema)
    # a pointer reads the schema as sent, through no $ref (JSON Pointer's), whatever the order of the keys
    ({"properties": {"b": {"$ref": "#/properties/a/properties/x"}, "a": {"$ref": "#/$defs/A"}},
      "$defs": {"A": {"properties": {"x": {"type": "integer"}}}}}, "names no schema"),
    ({"properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#/properties/a/properties/x"}},
      "$defs": {"A": {"properties": {"x": {"type": "integer"}}}}}, "names no schema"),
    ({"properties": {"a": {"foo": 1}}}, "^json_schema: the schema.properties.a uses foo"),
    ({"properties": {"a": {"const": [float("-inf")]}}}, "NaN or Infinity"), ({"type": "strin"}, "type that is none of"),
    ({"type": 5}, "type that is none of"), ({"type": []}, "type that is none of"),
    ({"properties": {"a": {"multipleOf": 2}}}, "multipleOf"), ({"properties": {"a": 3}}, "must be a schema"),
    ({"properties": [1]}, "properties must be"), ({"items": [{"type": "string"}]}, "items must be a schema"),
    ({"prefixItems": {}}, "prefixItems must be"), ({"required": 5}, "required must be"), ({"enum": []}, "enum must"),
    ({"$defs": [1]}, "must be an object of schemas"), ({"anyOf": []}, "anyOf must be"),
    ({"properties": {"a": {}}, "required": ["b"]}, "may not have"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}, "$ref": "#/$defs/a"}, "lead back"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "refers to itself"),
    ({"additionalProperties": 3}, "true, false or a schema"), ({"minItems": -1}, "non-negative"),
    ({"minItems": 3, "maxItems": 2}, "above maxItems"), ({"minLength": 1.5}, "non-negative"),
    ({"minLength": 3, "maxLength": 2}, "above maxLength"), ({"minimum": "1"}, "must be a number"),
    ({"maximum": True}, "must be a number"), ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no number meets"),
    ({"exclusiveMinimum": 1, "maximum": 1}, "no number meets"), ({"type": "integer", "minimum": 10**400,
                                                                  "maximum": 10**399}, "no number meets"),
    ({"minimum": float("inf")}, "must be a number"), ({"pattern": "^a{5}$", "maxLength": 3}, "no string"),
    ({"prefixItems": [{}], "items": False, "minItems": 2}, "cannot reach"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no number meets"),
    # a oneOf whose alternatives may both match a value (it was held as anyOf: 4 is both, so valid for neither)
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf whose alternatives may both match"),
    ({"oneOf": [{"const": 1}, {"type": "number", "minimum": 0}]}, "oneOf whose alternatives may both match"),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": True},
                {"type": "object", "properties": {"b": {}}, "required": ["b"]}]}, "may both match"),
    # (a review's: an object left open where additionalProperties is left out, as JSON Schema reads it; a schema
    # with no type takes every value; numbers inside values; a discriminator's tag written by each)
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}, "may both match"),
    ({"oneOf": [{"type": "string"}, {"required": ["a"], "properties": {"a": {"type": "integer"}}}]}, "may both"),
    ({"oneOf": [{"const": "a"}, {"properties": {"x": {}}}]}, "may both match"),
    ({"oneOf": [{"const": [1]}, {"const": [1.0]}]}, "may both match"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}], "discriminator": {"propertyName": "x"}}, "may both")])
def test_a_schema_with_what_is_not_enforced_or_no_value_meets_is_refused(schema, match):
    from core.json_grammar import compile_schema

    with pytest.raises(ValueError, match=match):
        compile_schema(json.dumps(schema))
    with pytest.raises(ValueError, match=match):
        SamplingParams(json_schema=json.dumps(schema)).validate()


def test_a_schemas_patterns_have_one_compile_budget_in_all():
    """Each pattern is within the regex's own bounds, but a schema may hold any number of them, each compiled as the
    request is read (on the HTTP front's event loop, which many costly ones stalled): past
    MAX_PATTERN_NODES automaton positions in all, the schema is refused, naming the pattern; many small patterns
    (a schema of a hundred fields, each with one) are not."""
    from core.json_grammar import MAX_PATTERN_NODES, compile_schema

    costly = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": f"(a*b*c*){{{700 + i}}}"}
                                              for i in range(10)}}
    with pytest.raises(ValueError, match=f"past {MAX_PATTERN_NODES} automaton positions"):
        compile_schema(json.dumps(costly))
    small = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i + 1}}}-[0-9]+$"}
                                             for i in range(100)}}
    assert compile_schema(json.dumps(small))


def test_tool_choice_required_may_call_any_of_its_tools():
    """tool_choice required holds the reply to a list of calls, each an anyOf of one object per tool (vLLM's, which
    xgrammar reads as a real alternation): every tool may be called, not only the first."""
    from core.json_grammar import compile_schema, start
    from deployments.protocol import ChatCompletionRequest

    def tool(name: str, arg: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "time?"}],
                                                 "tools": [tool("get_weather", "city"), tool("get_time", "tz")],
                                                 "tool_choice": "required"})
    st = start(compile_schema(body.json_schema()))
    for calls in ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
                  '[{"name": "get_time", "parameters": {"tz": "UTC"}}]',
                  '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", '
                  '"parameters": {"city": "x"}}]'):
        assert complete(advance(st, calls)), calls
    assert advance(st, '[{"name": "get_time", "parameters": {"city"') is None


def test_tool_choice_required_reads_each_tools_refs_from_its_own_parameters():
    """A tool's `$ref`s point into its own parameters (vLLM's): `#` was the list of calls (a tree's children took
    calls, not nodes), and pydantic's `#/$defs/...` named nothing (a 400), in tool_choice required's schema."""
    from core.json_grammar import compile_schema, start
    from deployments.protocol import ChatCompletionRequest

    tree = {"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {
        "$ref": "#"}}}, "required": ["name", "children"]}
    items = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
             "required": ["items"], "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}},
                                                       "required": ["sku"]}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("tree", tree),
                                                                                         ("order", items))]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 "tool_choice": "required"})
    st = start(compile_schema(body.json_schema()))
    ok = ('[{"name": "tree", "parameters": {"name": "a", "children": [{"name": "b", "children": []}]}}]',
          '[{"name": "order", "parameters": {"items": [{"sku": "x1"}]}}]')
    for calls in ok:
        assert complete(advance(st, calls)), calls
    assert advance(st, '[{"name": "tree", "parameters": {"name": "a", "children": [[') is None
    assert advance(st, '[{"name": "order", "parameters": {"items": [{"name"') is None
    # a parameter named as a keyword of values (`default`) is a schema whose $ref is rewritten too; a pointer
    # %-escaped as JSON Pointer's URI form
    odd = {"type": "object", "properties": {"v": {"type": "integer"}, "default": {"$ref": "#"}},
           "required": ["v"]}
    pct = {"type": "object", "properties": {"i": {"$ref": "#/%24defs/I"}}, "required": ["i"],
           "$defs": {"I": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("odd", odd), ("pct", pct))]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 "tool_choice": "required"})
    st = start(compile_schema(body.json_schema()))
    assert complete(advance(st, '[{"name": "odd", "parameters": {"v": 1, "default": {"v": 2}}}]'))
    assert advance(st, '[{"name": "odd", "parameters": {"v": 1, "default": [') is None
    assert complete(advance(st, '[{"name": "pct", "parameters": {"i": 3}}]'))


@pytest.mark.parametrize("schema,beside", [
    ({"type": "string", "anyOf": [{"maxLength": 3}, {"pattern": "^x"}]}, "type beside anyOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "beside anyOf"),
    ({"anyOf": [{"type": "integer"}], "oneOf": [{"type": "string"}]}, "oneOf beside anyOf"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, r"maxLength beside \$ref"),
    ({"enum": ["a", "bb"], "maxLength": 1}, "maxLength beside enum")])
def test_a_keyword_beside_what_the_automaton_follows_instead_is_refused_not_dropped(schema, beside):
    """Every keyword of a schema applies. Beside a $ref, an anyOf / oneOf or an enum / const the automaton followed
    the $ref's schema, an alternative or a value of the list and dropped the rest: replies that finished broke them
    ("4" for a string of at most 3 characters). Refused with a 400 that says so; notes beside them are fine."""
    from core.json_grammar import compile_schema

    with pytest.raises(ValueError, match=beside):
        compile_schema(json.dumps(schema))
    optional = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Nick"}  # (Pydantic's)
    compile_schema(json.dumps({"$defs": {"o": optional}, "$ref": "#/$defs/o", "description": "a nickname"}))


def test_an_enums_type_picks_its_values():
    """{"type": "integer", "enum": [1, "a"]}: "a" was written (a reply that broke the type); the type keeps 1."""
    from core.json_grammar import compile_schema, start

    st = start(compile_schema(json.dumps({"type": "integer", "enum": [1, "a", 2.0, True]})))
    assert complete(advance(st, "1")) and complete(advance(st, "2.0")) and advance(st, '"a') is None
    assert advance(st, "t") is None
    with pytest.raises(ValueError, match="no enum value of its type"):
        compile_schema(json.dumps({"type": "string", "enum": [1, 2]}))


def _takes(schema: dict, text: str) -> bool:
    got = advance(_schema_state(schema), text)
    return got is not None and complete(got)


def test_a_union_of_many_values_is_one_list_and_a_wider_union_is_refused():
    """An anyOf of values (consts, enums: pydantic's Literal) is one list of texts: past the fork's MAX_FORK
    members every value after the 64th could never be written (the schema compiled); a union of more alternatives
    than that is refused rather than cut."""
    from core.json_grammar import MAX_FORK, compile_schema

    values = {"anyOf": [{"const": f"v{i:03d}"} for i in range(80)] + [{"enum": [1, 2]}]}
    assert _takes(values, '"v070"') and _takes(values, "2") and not _takes(values, '"v080"')
    wide = {"anyOf": [{"type": "string", "pattern": f"^{i}"} for i in range(MAX_FORK + 1)]}
    with pytest.raises(ValueError, match="anyOf or oneOf of 65 alternatives"):
        compile_schema(json.dumps(wide))


def test_a_patterns_lengths_are_each_positions_own_under_min_and_max_length():
    """A pattern whose alternatives' lengths straddle a string's bounds: each position's lengths decide (the fewest
    of one and the most of another let a prefix in that no string of the bounds finishes: a dead end, no character
    and no closing quote), gaps too (`(xx)*` takes only even lengths)."""
    from core.json_grammar import compile_schema

    zip_or_word = {"type": "string", "pattern": "^([0-9]{5}(-[0-9]{4})?|[A-Z]{7})$", "minLength": 6, "maxLength": 9}
    assert _takes(zip_or_word, '"ABCDEFG"') and advance(_schema_state(zip_or_word), '"12345') is None
    assert _takes({**zip_or_word, "maxLength": 10}, '"12345-6789"')
    with pytest.raises(ValueError, match="no string of its minLength and maxLength"):
        compile_schema(json.dumps({"type": "string", "pattern": "^(xx)*$", "minLength": 1, "maxLength": 1}))
    assert _takes({"type": "string", "pattern": "^(xx)*$", "minLength": 1, "maxLength": 3}, '"xx"')


def test_schema_notes_and_patterns_written_twice():
    """OpenAPI's discriminator (pydantic's tagged unions) is a note: the members' consts say it already (it was a
    400); a pattern written again counts once against the schema's pattern budget (250 UUID fields were refused)."""
    from core.json_grammar import compile_schema

    pet = {"type": "object", "properties": {"pet": {
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        "discriminator": {"propertyName": "kind", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}}}},
        "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}},
                  "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}}}}}
    assert _takes(pet, '{"pet": {"kind": "dog"}}') and not _takes(pet, '{"pet": {"kind": "cow"}}')
    uuid = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
    compile_schema(json.dumps({"type": "object", "properties": {
        f"id{i}": {"type": "string", "pattern": uuid} for i in range(250)}}))


def test_a_tagged_thinking_format_ends_on_text_that_begins_like_a_think_mark():
    """qwen3's thinking (`tagged`): a reply of the format's text that is a prefix of `<think>` (a guided choice of
    `<`) may end there, as it may without thinking (it could not: held until `<think>` or more came)."""
    from core.json_grammar import start_pattern, thinking_first
    from core.regex_grammar import choice_pattern, compile_regex

    rx = compile_regex(choice_pattern(["<", "<=", ">"]))
    assert complete(advance(thinking_first(start_pattern(rx), False), "<"))
    assert complete(thinking_first(start_pattern(compile_regex("a*")), False))
    assert not complete(advance(thinking_first(start_pattern(rx), False), "<think"))


def test_an_enums_lone_surrogate_is_written_as_its_escape():
    """An enum's string with a lone surrogate (which no UTF-8 reply holds) is written as its `\\u` escape, which
    JSON reads as that value (no character fitted after its opening quote)."""
    schema = {"enum": ["\ud800", "a"]}
    assert _takes(schema, '"\\ud800"') and _takes(schema, '"a"')


def test_a_seeded_draw_does_not_follow_rounding_noise_in_the_logits():
    """A draw whose tokens do not fit goes on with a uniform number of its own made from the draw's: it went on
    with where the draw fell within the token's share, which read the probabilities' last bits, so that logits a
    neighbour in the batch moved by a rounding drew another token for the same seed (most draws on a flat row where
    few tokens fit); the draw still follows the row's distribution over the tokens that fit."""
    texts = [f"w{i}" for i in range(300)]
    texts[5], texts[7], texts[11] = "{", " ", "\n"
    x = torch.randn(300, generator=torch.Generator().manual_seed(2))
    noisy = x + 1e-6 * torch.randn(300, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.8)
    g = torch.Generator().manual_seed(0)
    draws = [float(torch.rand(1, generator=g)) for _ in range(300)]
    picks = [choose(x, p, u, (START, b""), frozenset({0}), lambda t: texts[t].encode()) for u in draws]
    moved = sum(a != choose(noisy, p, u, (START, b""), frozenset({0}), lambda t: texts[t].encode())
                for u, a in zip(draws, picks))
    assert set(picks) == {5, 7, 11} and moved <= 3, moved
    weights = torch.softmax(x / 0.8, -1)[[5, 7, 11]]
    for t, w in zip((5, 7, 11), (weights / weights.sum()).tolist()):
        assert abs(picks.count(t) / 300 - w) < 0.1, (t, w)


def test_a_oneof_of_alternatives_no_value_matches_twice_is_taken():
    """oneOf where its alternatives cannot both match a value the automaton writes: other types (an integer is a
    number), other values, an object tagged by a required property of other consts, one that requires a key the
    other's closed object may not have, or a discriminator (pydantic's tagged unions)."""
    from core.json_grammar import compile_schema, start

    tagged = [{"type": "object", "properties": {"k": {"const": c}, "x": {}}, "required": ["k"]} for c in "ab"]
    for alts in ([{"type": "string"}, {"type": "integer"}], [{"const": 1}, {"const": 2}, {"type": "string"}],
                 [{"enum": ["a", 1]}, {"type": "boolean"}], tagged,
                 [{"type": "object", "properties": {"meow": {}}, "required": ["meow"]},
                  {"type": "object", "properties": {"bark": {}}, "required": ["bark"]}]):
        compile_schema(json.dumps({"oneOf": alts}))
    # a discriminator's tag (pydantic's, of a default too): each alternative writes it
    tags = [{"type": "object", "properties": {"k": {"const": c, "default": c}, "x": {}}} for c in "ab"]
    st = start(compile_schema(json.dumps({"oneOf": tags, "discriminator": {"propertyName": "k"}})))
    assert complete(advance(st, '{"k": "a", "x": 1}')) and advance(st, "{}") is None
