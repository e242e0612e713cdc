"""JSON as a reply grows: a character-level pushdown automaton over immutable states, for JSON mode (OpenAI's
`response_format` `json_object`, or `json_schema` with a schema: `compile_schema`). `advance(state, text)` is the
state after `text`, or None where `text` cannot continue a value the mode allows; `complete(state)` says whether the
value has ended (the reply may stop there).

A state is a tuple (stack, mode, sub, whitespace run): `stack` the open containers, each a frame (`("o", schema,
keys seen, its last key)` an object, `("a", schema, items begun)` an array, `("k", text)` an object's key being
read), `mode` what may come next, `sub` the mode's own (the schema of the value to come, a literal's rest, a
constrained string's length, bounds and pattern state, a \\u escape's hex digits left and read, a number's part
(and its text where the schema bounds it), an enum's candidates and what of them is written, a regex and its
state). A schema of None allows any value. Whitespace outside strings is capped at `MAX_WHITESPACE` characters in
a row, so that a reply cannot pad forever; inside strings control characters are refused, as JSON refuses them.

Schemas: `type` (one or a list), `properties`, `required`, `additionalProperties` (false, or left out beside
`properties` as vLLM's xgrammar takes it: no other key; true or a schema: other keys, their values of it), `items`
and `prefixItems` (a tuple's items; `items` false: no more), `minItems`, `maxItems`, a string's `minLength` and
`maxLength` (in characters, an escape one) and `pattern` (`core.regex_grammar`: found anywhere in the string's
text, as JSON Schema's, unless anchored), a number's `minimum`, `maximum`, `exclusiveMinimum` and
`exclusiveMaximum` (a bounded number is written without an exponent), `enum`, `const`, `anyOf` / `oneOf` (a value
follows every alternative it fits so far, a state of mode `FORK` holding one state each: `MAX_FORK` at most; a
`oneOf` only where no value the automaton writes matches two alternatives, `_disjoint`), and
`$ref` to `#/$defs/...` or `#/definitions/...`;
`title`, `description`, `default`, `examples`, `format` and the like are read and not enforced; any other keyword
(`multipleOf`, `uniqueItems`, ...) is refused by `compile_schema`, so that no reply breaks a rule it was asked to
keep. A reply held to a regular expression alone (`start_pattern`) is a state of mode `PATTERN`."""
from __future__ import annotations

import bisect
import functools
import json
import math
import re
import urllib.parse
from decimal import Decimal
from fractions import Fraction
from typing import Any, Iterator

from core.regex_grammar import _TOP, LENGTH_SET_CHECK_WORK, MAX_NODES, Regex, compile_regex

MAX_WHITESPACE = 16  # a newline and an indent of two spaces a level, seven levels deep

# modes
VALUE, KEY_OR_END, KEY, COLON, VALUE_OR_END, AFTER, STRING, ESCAPE, UNICODE, NUMBER, LITERAL, CHOICE, DONE, PATTERN, \
    THINK, FORK = range(16)
# the alternatives a value of an anyOf / oneOf follows at once (`FORK`): a union of more is refused (its values count
# as one, `_union_leaves`); where unions inside unions' alternatives add up past it, the first ones are kept
MAX_FORK = 64
# the automaton positions of a schema's patterns in all (each is within regex_grammar.MAX_NODES): what checking one
# schema may cost (each pattern is compiled as the request is read, on the HTTP front's event loop)
MAX_PATTERN_NODES = 2 * MAX_NODES
THINK_OPEN, THINK_END = "<think>", "</think>"  # a reasoning model's thinking, before its format (`thinking_first`)
_WS = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# a number's parts: after "-", after a leading 0, in the integer, after ".", in the fraction, after "e", after its
# sign, in the exponent; those a number may end in
_MINUS, _ZERO, _INT, _DOT, _FRAC, _E, _ESIGN, _EXP = range(8)
_NUMBER_ENDS = frozenset((_ZERO, _INT, _FRAC, _EXP))

# keywords a schema may hold: those enforced, and those read as notes (not enforced)
ENFORCED = frozenset(("type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
                      "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
                      "exclusiveMaximum", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions"))
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
NOTES = frozenset(("title", "description", "default", "examples", "format", "$schema", "$id", "$comment", "strict",
                   "readOnly", "writeOnly", "deprecated",
                   "discriminator"))  # (OpenAPI's, pydantic's tagged unions: the members' consts already say it)
TYPES = frozenset(("object", "array", "string", "number", "integer", "boolean", "null"))

Schema = dict[str, Any] | None
State = tuple[tuple[tuple, ...], int, Any, int]
OBJECT: dict[str, Any] = {"type": "object"}  # json_object: any object


def start(schema: Schema = OBJECT) -> State:
    """The state before a reply: a value of `schema` to come (default: any JSON object, json_object's)."""
    return ((), VALUE, schema, 0)


def start_pattern(rx: Regex) -> State:
    """The state before a reply that must match `rx` whole (vLLM's guided_regex and guided_choice; or a text of a
    grammar, `core.ebnf_grammar.Grammar`, which steps alike: guided_grammar): no JSON."""
    return ((), PATTERN, (rx, rx.start), 0)


def thinking_first(then: State, opened: bool) -> State:
    """The state before a reasoning model's reply whose format (`then`) holds once its thinking has ended: at the
    first `</think>`. `opened`: the reply starts inside the thinking (the template opened it: vLLM's deepseek_r1
    parser); else it thinks only where it opens with `<think>` (after whitespace), and otherwise the format holds
    from its first character (qwen3's). The whitespace a model writes after `</think>` is allowed before the format
    (`MAX_WHITESPACE` of it). While it thinks, nothing is held, a stop token included (vLLM's way)."""
    return ((), THINK, ("in" if opened else "start", "", then), 0)


def _think(sub: tuple, ch: str) -> State | None:
    """A thinking reply's state after `ch`: before its thinking (`<think>` may come), in it (the text's last
    characters kept, to see `</think>`), in the whitespace after it, or the format's own state once the thinking
    has ended (or never began)."""
    stage, text, then = sub
    if stage == "after":
        if ch in _WS:  # the format's own where it takes it, else the thinking's last (MAX_WHITESPACE of it)
            got = step(then, ch)
            if got is not None:
                return got
            return ((), THINK, ("after", text + ch, then), 0) if len(text) < MAX_WHITESPACE else None
        return step(then, ch)
    text += ch
    if stage == "in":
        if text.endswith(THINK_END):
            return ((), THINK, ("after", "", then), 0)
        return ((), THINK, ("in", text[-(len(THINK_END) - 1):], then), 0)
    head = text.lstrip()
    if head == THINK_OPEN:
        return ((), THINK, ("in", "", then), 0)
    if not head:  # whitespace first: only as much as the format itself would take, were there no thinking
        return ((), THINK, ("start", text, then), 0) if advance(then, text) is not None else None
    if THINK_OPEN.startswith(head):
        return ((), THINK, ("start", text, then), 0)  # (`<think>` begun)
    return advance(then, text)  # no thinking: the text so far is the format's


START = start()


def _finite(value: Any) -> bool:
    """Whether a JSON value holds no NaN or infinity (at any depth)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _pointed(root: Any, ref: str) -> Any:
    """What a local `$ref` (a JSON pointer after "#", RFC 6901, its parts URI-escaped) names in `root`, or None."""
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


@functools.lru_cache(maxsize=64)
def compile_schema(text: str) -> dict[str, Any]:
    """A JSON schema (its text) made ready for `start` (once per text, the last few kept: shared, never to be
    changed): checked, and its local `$ref`s replaced by the schemas they name (shared: a recursive schema keeps its
    cycles). ValueError only (a client's 400, naming what it refuses):
    for a schema that is no object, a keyword not in `ENFORCED` or `NOTES`, a keyword's value of the wrong shape, a
    type not in `TYPES`, a `$ref` that names nothing here, an alternative that is itself (`anyOf` through `$ref`s
    back to it: no value could start), or what no value can meet (an empty `enum`, a required key a closed object
    does not have)."""
    try:
        root = json.loads(text)
    except ValueError as e:
        raise ValueError(f"json_schema is not JSON: {e}") from None
    except RecursionError:
        raise ValueError("json_schema: the schema is nested too deeply") from None
    if not isinstance(root, dict):
        raise ValueError("json_schema must be a JSON object")

    def fail(where: str, what: str) -> ValueError:
        return ValueError(f"json_schema: {where} {what}")

    defs: dict[str, Any] = {}
    positions = [0]  # the schema's patterns' automaton positions so far (MAX_PATTERN_NODES), each pattern once
    counted: set[int] = set()  # (a pattern written again is the same automaton: `compile_regex` keeps it)
    for name in ("$defs", "definitions"):
        got = root.get(name)
        if got is not None and not isinstance(got, dict):
            raise fail(f"#/{name}", "must be an object of schemas")
        for key, sub in (got or {}).items():
            defs[f"#/{name}/{key}"] = sub

    pristine: list[Any] = []  # the schema as sent, where a pointer is read (`check` rewrites `root` as it goes)

    def pointed(name: str) -> Any:
        if name == "#":  # the whole schema (OpenAI's recursive example's `"$ref": "#"`)
            return root
        if not pristine:
            pristine.append(json.loads(text))
        return _pointed(pristine[0], name)

    def ref(name: Any) -> dict[str, Any]:
        for _ in range(32):  # a $ref to a $ref: followed
            got = (defs[name] if name in defs else pointed(name)) if isinstance(name, str) else None
            if not isinstance(got, dict):
                raise fail(f"$ref {name!r}", "names no schema in this one (a JSON pointer from #)")
            if "$ref" not in got:
                return got
            name = got["$ref"]
        raise fail(f"$ref {name!r}", "refers to itself")

    checked: set[int] = set()
    schemas: list[dict[str, Any]] = []  # every schema checked (a pointer may name one neither root nor a def)

    def check(node: Any, where: str) -> dict[str, Any]:
        """`node` checked, its sub-schemas replaced by what they resolve to; the schema it stands for."""
        if not isinstance(node, dict):
            raise fail(where, f"must be a schema (an object), got {json.dumps(node)[:40]}")
        # every keyword of a schema applies; those beside a $ref, an anyOf or oneOf, or an enum or const, the automaton
        # does not hold a value to (it took the $ref's schema, an alternative, a value of the list): refused, not
        # dropped (a reply then broke them), but an enum's or const's type, which picks its values
        for key, free in (("$ref", _WITH_DEFS), ("anyOf", _WITH_DEFS), ("oneOf", _WITH_DEFS), ("enum", _WITH_VALUES),
                          ("const", _WITH_VALUES)):
            if key in node and (beside := sorted((set(node) & ENFORCED) - free - {key})):
                into = {"$ref": "the schema it names", "anyOf": "each alternative", "oneOf": "each alternative"}
                raise fail(where, f"has {', '.join(beside)} beside {key}, which this server does not enforce "
                                  f"together (put {'them' if len(beside) > 1 else 'it'} into "
                                  f"{into.get(key, 'the values')})")
        if "$ref" in node:
            node = ref(node["$ref"])
        if id(node) in checked:
            return node
        checked.add(id(node))
        schemas.append(node)
        bad = sorted(set(node) - ENFORCED - NOTES)
        if bad:
            raise fail(where, f"uses {', '.join(bad)}, which this server does not enforce")
        t = node.get("type")
        types = [t] if isinstance(t, str) else t
        if t is not None and (not isinstance(types, list) or not types
                              or any(not isinstance(x, str) or x not in TYPES for x in types)):
            raise fail(where, f"has a type that is none of {', '.join(sorted(TYPES))}: {json.dumps(t)[:40]}")
        props = node.get("properties")
        if props is not None:
            if not isinstance(props, dict):
                raise fail(f"{where}.properties", "must be an object of schemas")
            for key in list(props):
                props[key] = check(props[key], f"{where}.properties.{key}")
        required = node.get("required")
        if required is not None and (not isinstance(required, list) or any(not isinstance(k, str) for k in required)):
            raise fail(f"{where}.required", "must be a list of key names")
        extra = node.get("additionalProperties", not props)
        if extra is False and any(k not in (props or {}) for k in required or ()):
            raise fail(f"{where}.required", "names a key its object may not have (not in its properties)")
        if isinstance(extra, dict):
            node["additionalProperties"] = check(extra, f"{where}.additionalProperties")
        elif not isinstance(extra, bool):
            raise fail(f"{where}.additionalProperties", "must be true, false or a schema")
        if "items" in node and not isinstance(node["items"], bool):
            node["items"] = check(node["items"], f"{where}.items")
        if "prefixItems" in node:
            pre = node["prefixItems"]
            if not isinstance(pre, list):
                raise fail(f"{where}.prefixItems", "must be a list of schemas")
            node["prefixItems"] = [check(x, f"{where}.prefixItems[{k}]") for k, x in enumerate(pre)]
        for name in ("anyOf", "oneOf"):
            if name in node:
                alts = node[name]
                if not isinstance(alts, list) or not alts:
                    raise fail(f"{where}.{name}", "must be a list of schemas")
                node[name] = [check(alt, f"{where}.{name}[{k}]") for k, alt in enumerate(alts)]
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            raise fail(f"{where}.enum", "must be a list of values")
        for name in ("const", "enum"):
            if name in node and not _finite(node[name]):  # (Python's JSON reads them; no JSON text writes them)
                raise fail(f"{where}.{name}", "holds NaN or Infinity, which are not JSON values")
        if types is not None and ("enum" in node or "const" in node):  # its values of its type only
            values = [node["const"]] if "const" in node else node["enum"]
            kept = [v for v in values if _of_types(v, types)]
            if not kept:
                raise fail(where, f"has no {'const' if 'const' in node else 'enum'} value of its type")
            if "enum" in node:
                node["enum"] = kept
        for name in _COUNTS:
            if name in node and (isinstance(node[name], bool) or not isinstance(node[name], int) or node[name] < 0):
                raise fail(f"{where}.{name}", "must be a non-negative integer")
        for lo, hi in (("minItems", "maxItems"), ("minLength", "maxLength")):
            if node.get(lo, 0) > node.get(hi, node.get(lo, 0)):
                raise fail(f"{where}.{lo}", f"is above {hi}")
        if "pattern" in node and not isinstance(node["pattern"], Regex):
            if not isinstance(node["pattern"], str):
                raise fail(f"{where}.pattern", "must be a regular expression (a string)")
            try:
                node["pattern"] = compile_regex(node["pattern"], search=True)  # (JSON Schema's: found anywhere)
            except ValueError as e:
                raise fail(f"{where}.pattern", str(e)) from None
            if id(node["pattern"]) not in counted:
                counted.add(id(node["pattern"]))
                positions[0] += len(node["pattern"].nodes)
            if positions[0] > MAX_PATTERN_NODES:
                raise fail(f"{where}.pattern", f"takes the schema's patterns past {MAX_PATTERN_NODES} automaton "
                                               "positions in all")
        for name in _BOUNDS:
            v = node.get(name)
            if name in node and (isinstance(v, bool) or not isinstance(v, (int, float))
                                 or isinstance(v, float) and not math.isfinite(v)):
                raise fail(f"{where}.{name}", "must be a number")
        if any(name in node for name in _BOUNDS) and not _bounded_exists(node):
            raise fail(where, "has bounds no number meets")
        rx = node.get("pattern")
        if rx is not None and not rx.within(rx.start, node.get("minLength", 0), node.get("maxLength", math.inf),
                                            LENGTH_SET_CHECK_WORK):
            raise fail(where, "has a pattern no string of its minLength and maxLength matches")
        if node.get("items") is False and node.get("minItems", 0) > len(node.get("prefixItems") or ()):
            raise fail(where, "has a minItems its prefixItems cannot reach (items: false)")
        return node

    try:
        for name, sub in defs.items():
            check(sub, name)
        root = check(root, "the schema")
    except RecursionError:
        raise fail("the schema", "is nested too deeply") from None

    def alternatives(node: dict[str, Any]) -> list[dict[str, Any]]:
        return (node.get("anyOf") or []) + (node.get("oneOf") or [])
    # an alternative that leads back to itself: no value starts (a depth-first search of the alternatives, each
    # schema once: shared ones made a walk of every path exponential)
    state: dict[int, bool] = {}  # id -> finished (False: on the path now)
    for node in schemas:
        if id(node) in state:
            continue
        state[id(node)], path = False, [(node, iter(alternatives(node)))]
        while path:
            nxt = next(path[-1][1], None)
            if nxt is None:
                state[id(path.pop()[0])] = True
            elif id(nxt) not in state:
                state[id(nxt)] = False
                path.append((nxt, iter(alternatives(nxt))))
            elif not state[id(nxt)]:
                raise fail("the schema", "has an anyOf or oneOf whose alternatives lead back to it")
    for node in schemas:  # (a union's values are one list: `_union_leaves`; more alternatives would be dropped)
        if not (node.get("anyOf") or node.get("oneOf")):
            continue
        disc = node.get("discriminator")
        if node.get("oneOf") and isinstance(disc, dict) and isinstance(key := disc.get("propertyName"), str):
            # OpenAPI's and pydantic's tag: each alternative writes it (pydantic's of a default tag did not, a value
            # both of its members took; pydantic's parse needs it)
            node["oneOf"] = [dict(a, required=[*(a.get("required") or ()), key])
                             if key in (a.get("properties") or {}) and key not in (a.get("required") or ()) else a
                             for a in node["oneOf"]]
        leaves = node[_LEAVES] = _union_leaves(node)  # (kept: `_value` reads them)
        if len(leaves) > MAX_FORK:
            raise fail("the schema", f"has an anyOf or oneOf of {len(leaves)} alternatives (values aside, which "
                                     f"count as one), more than the {MAX_FORK} this server follows at once")
        if node.get("oneOf") and not node.get("anyOf"):  # (the automaton holds a value to any one of them)
            groups = [_leaves(alt) for alt in node["oneOf"]]
            if not all(_disjoint(x, y) for i, g in enumerate(groups) for h in groups[i + 1:] for x in g for y in h):
                raise fail("the schema", "has a oneOf whose alternatives may both match a value (which JSON Schema "
                                         "refuses and this server's automaton cannot tell): give anyOf, or "
                                         "alternatives of different types or values (a property of distinct consts "
                                         "in each, as pydantic's discriminated unions)")
    return root


def _values(node: dict[str, Any]) -> list[Any] | None:
    """A schema's values where it lists them (`const`, `enum`), else None."""
    return [node["const"]] if "const" in node else node.get("enum")


def _plain(value: Any) -> Any:
    """A JSON value with its integral numbers as integers, through its lists and objects (JSON Schema's equality)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_plain(x) for x in value]
    if isinstance(value, dict):
        return {k: _plain(x) for k, x in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether two JSON values are the same value (JSON Schema's equality: 1 and 1.0 are, true and 1 are not)."""
    return json.dumps(_plain(a), sort_keys=True) == json.dumps(_plain(b), sort_keys=True)


def _disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether no value is valid for both schemas, as far as their types, values and a property of distinct values
    they both require tell (False where that does not show it)."""
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
        return not any(_same(x, y) for x in va for y in vb)

    def declared(node: dict[str, Any]) -> frozenset[str] | None:  # (a schema with no type takes every value)
        t = node.get("type")
        return None if t is None else frozenset([t] if isinstance(t, str) else t)
    ta, tb = declared(a), declared(b)
    if va is not None or vb is not None:
        values, types = (va, tb) if va is not None else (vb, ta)
        return types is not None and not any(_of_types(v, sorted(types)) for v in values)
    numeric = {"number", "integer"}
    if ta is not None and tb is not None and not (ta & tb) and not (ta & numeric and tb & numeric):
        return True
    if _types(a) == _types(b) == frozenset(("object",)):  # both write objects alone (declared or not)
        pa, pb = a.get("properties") or {}, b.get("properties") or {}

        def fails(x: dict[str, Any], px: dict[str, Any], y: dict[str, Any], py: dict[str, Any]) -> bool:
            """Whether every object written for y fails x: x requires a key y writes none of (it writes its
            properties alone), or y requires one x refuses (its additionalProperties false: JSON Schema reads an
            object open where it is left out)."""
            return (y.get("additionalProperties", not py) is False and bool(set(x.get("required") or ()) - set(py))) \
                or (x.get("additionalProperties") is False and bool(set(y.get("required") or ()) - set(px)))
        if fails(a, pa, b, pb) and fails(b, pb, a, pa):
            return True
        for key in set(a.get("required") or ()) & set(b.get("required") or ()) & set(pa) & set(pb):
            if isinstance(pa[key], dict) and isinstance(pb[key], dict) and _values(pa[key]) is not None \
                    and _values(pb[key]) is not None and _disjoint(pa[key], pb[key]):
                return True
    return False


# the keywords a schema may hold beside a $ref, an anyOf / oneOf, an enum / const (`compile_schema`): the notes, and
# the definitions (a root's); beside an enum or const, its type too
_WITH_DEFS = frozenset(("$defs", "definitions"))
_WITH_VALUES = _WITH_DEFS | {"type", "enum", "const"}


def _of_types(value: Any, types: list[str]) -> bool:
    """Whether a JSON value is of one of `types` (an integer: a number with no fraction, as JSON Schema's)."""
    for t in types:
        if t == "null" and value is None or t == "boolean" and isinstance(value, bool) \
                or t == "string" and isinstance(value, str) or t == "array" and isinstance(value, list) \
                or t == "object" and isinstance(value, dict):
            return True
        if t in ("number", "integer") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and (t == "number" or float(value).is_integer()):
            return True
    return False


def _leaves(node: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The schemas of `node`'s alternatives (`anyOf`, else `oneOf`) that have none of their own, in the order a
    depth-first search meets them, each once: what the recursion over the alternatives would reach, without its
    cost (exponential where alternatives share schemas)."""
    out, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        alts = n.get("anyOf") or n.get("oneOf")
        if alts:
            todo.extend(reversed(alts))
        else:
            out.append(n)
    return tuple(out)


def _union_leaves(node: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """`_leaves`, those that are values (`enum`, `const`) as one `enum` of them all in the first one's place: a
    union of many values (pydantic's Literal, an anyOf of consts) is one list of texts, not a fork of one member
    each (`MAX_FORK`)."""
    leaves = _leaves(node)
    values = [n for n in leaves if "const" in n or "enum" in n]
    if len(values) < 2:
        return leaves
    merged = {"enum": [v for n in values for v in ([n["const"]] if "const" in n else n["enum"])]}
    first = values[0]
    return tuple(merged if n is first else n for n in leaves if n is first or not ("const" in n or "enum" in n))


def _types(node: dict[str, Any]) -> frozenset[str] | None:
    """The types a schema allows (None: any), `integer` within `number`."""
    t = node.get("type")
    if t is None:
        if "properties" in node or "additionalProperties" in node or "required" in node:
            return frozenset(("object",))
        if "items" in node or "prefixItems" in node:
            return frozenset(("array",))
        return None
    return frozenset([t] if isinstance(t, str) else t)


def _value(stack: tuple, ch: str, node: Schema) -> State | None:
    """A value of schema `node` starting with `ch`."""
    if node is not None:
        if node.get("anyOf") or node.get("oneOf"):  # (`compile_schema` refuses alternatives that lead back to
            leaves = node.get(_LEAVES)  # themselves)
            if leaves is None:
                leaves = node[_LEAVES] = _union_leaves(node)
            return _fork(_value(stack, ch, alt) for alt in leaves)  # (each alternative it fits, not only the first:
            # a union of objects all begin with "{", and tool_choice required's anyOf of tools called only the first)
        if "const" in node or "enum" in node:
            texts = node.get(_TEXTS)
            if texts is None:  # (in order: a prefix's candidates are a run of them, `_choices`)
                values = [node["const"]] if "const" in node else node["enum"]
                texts = node[_TEXTS] = tuple(sorted({_value_text(v) for v in values}))
            return step((stack, CHOICE, (texts, ""), 0), ch)
        types = _types(node)
    else:
        types = None

    def allows(t: str) -> bool:
        return types is None or t in types

    if ch == "{" and allows("object"):
        return (stack + (("o", node, frozenset(), None),), KEY_OR_END, None, 0)
    if ch == "[" and allows("array"):
        return (stack + (("a", node, 0),), VALUE_OR_END, None, 0)
    if ch == '"' and allows("string"):
        limits = None
        if node is not None and ("minLength" in node or "maxLength" in node or "pattern" in node):
            rx = node.get("pattern")
            lo, hi = node.get("minLength", 0), node.get("maxLength")
            at = rx.within(rx.start, lo, math.inf if hi is None else hi) if rx is not None else None
            limits = (0, lo, hi, rx, at)
        return (stack, STRING, limits, 0)
    if (ch == "-" or ch in _DIGITS) and (allows("number") or allows("integer")):
        integer = types is not None and "number" not in types
        part = _MINUS if ch == "-" else (_ZERO if ch == "0" else _INT)
        bounds = _bounds(node, integer) if node is not None else None
        if bounds is not None and not _reachable(ch, integer, bounds):
            return None
        return (stack, NUMBER, (part, integer, ch, bounds), 0)
    if (ch in "tf" and allows("boolean")) or (ch == "n" and allows("null")):
        return (stack, LITERAL, _LITERALS[ch], 0)
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _value_text(value: Any) -> str:
    """A value's JSON text as a reply writes it: compact, its characters as they are, but a lone surrogate, which no
    UTF-8 reply holds, as its escape."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATE.search(text) else text


_TEXTS = "\x00texts"  # an enum's or const's values as JSON texts, in order, kept in its schema once written
_LEAVES = "\x00leaves"  # an anyOf's or oneOf's schemas without alternatives (`_leaves`), kept in its schema once found


def _choices(texts: tuple[str, ...], prefix: str) -> tuple[bool, bool]:
    """Whether `prefix` is one of `texts` (in order), and whether one of them is longer and begins with it."""
    i = bisect.bisect_left(texts, prefix)
    whole = i < len(texts) and texts[i] == prefix
    i += whole
    return whole, i < len(texts) and texts[i].startswith(prefix)


def _after_value(stack: tuple) -> State:
    return (stack, AFTER if stack else DONE, None, 0)


_SHAPE = "\x00shape"  # an object schema's `_object`, kept in it once read (no schema keyword holds a NUL)
_FREE: tuple[dict, bool, frozenset[str], tuple[str, ...]] = ({}, False, frozenset(), ())


def _object(frame: tuple) -> tuple[dict, bool, frozenset[str], tuple[str, ...]]:
    """An object frame's properties, whether it is closed (no keys but its properties: `additionalProperties` false,
    or left out where it has properties, as vLLM's xgrammar takes a schema by default), its required keys, and its
    properties' names in order (a key's prefix looked up among hundreds: `_key_more`)."""
    node = frame[1]
    if node is None:
        return _FREE
    got = node.get(_SHAPE)
    if got is None:
        props = node.get("properties") or {}
        extra = node.get("additionalProperties", not props)
        got = node[_SHAPE] = (props, extra is False, frozenset(node.get("required") or ()), tuple(sorted(props)))
    return got


def _may_add_key(frame: tuple) -> bool:
    props, closed, _, _ = _object(frame)
    return not closed or len(frame[2]) < len(props)  # (a closed object's keys are all its properties')


def _may_close(frame: tuple) -> bool:
    return _object(frame)[2] <= frame[2]


def _items_ok(node: Schema, count: int) -> bool:
    """Whether an array of `count` items may close (`minItems`)."""
    return node is None or count >= node.get("minItems", 0)


def _room(node: Schema, count: int) -> bool:
    """Whether an array of `count` items may take one more (`maxItems`; `items` false: no more than its
    `prefixItems`)."""
    if node is None:
        return True
    if node.get("items") is False and count >= len(node.get("prefixItems") or ()):
        return False
    return "maxItems" not in node or count < node["maxItems"]


def _item(node: Schema, index: int) -> Schema:
    """The schema of an array's item `index` (its `prefixItems`', else its `items`'; None: any value)."""
    if node is None:
        return None
    pre = node.get("prefixItems") or ()
    if index < len(pre):
        return pre[index]
    items = node.get("items")
    return items if isinstance(items, dict) else None


def _one_more(limits: tuple | None, ch: str) -> tuple | None:
    """A constrained string's (length, minLength, maxLength, pattern, the pattern's state) after one more character
    `ch` (an escape's counts one, a surrogate pair's too), or None where no string of its schema goes on from there
    (the length past maxLength, a pattern that cannot take `ch`, or one whose matches from here are all too short or
    too long for the string's bounds), or where the string is unconstrained."""
    if limits is None:
        return None
    count, lo, hi, rx, at = limits
    count += 1
    if hi is not None and count > hi:
        return None
    if rx is not None:
        at = rx.step(at, ch)
        if at is None:
            return None
        if lo > count or hi is not None:  # (only positions whose matches may still meet the bounds go on)
            at = rx.within(at, lo - count, math.inf if hi is None else hi - count)
            if not at:
                return None
    return count, lo, hi, rx, at


def _string_may_end(limits: tuple) -> bool:
    """Whether a constrained string may end here."""
    return limits[0] >= limits[1] and (limits[3] is None or limits[3].accepts(limits[4]))


# a number's bounds: (lowest, whether it is allowed, highest, whether it is allowed), None where unbounded
Bounds = tuple[Fraction | None, bool, Fraction | None, bool]


def _bounds(node: dict[str, Any], integer: bool) -> Bounds | None:
    """A number schema's bounds (`minimum`, `exclusiveMinimum`, ...), the tighter of each side's two; for an
    integer, as the lowest and highest integer allowed. None where it has none."""
    if not any(name in node for name in _BOUNDS):
        return None
    lo, lo_in, hi, hi_in = None, True, None, True
    for name, inclusive in (("minimum", True), ("exclusiveMinimum", False)):
        if name in node:
            v = Fraction(Decimal(repr(node[name])))
            if lo is None or v > lo or (v == lo and not inclusive):
                lo, lo_in = v, inclusive
    for name, inclusive in (("maximum", True), ("exclusiveMaximum", False)):
        if name in node:
            v = Fraction(Decimal(repr(node[name])))
            if hi is None or v < hi or (v == hi and not inclusive):
                hi, hi_in = v, inclusive
    if integer:
        if lo is not None:
            lo = Fraction(math.floor(lo) + 1 if not lo_in and lo.denominator == 1 else math.ceil(lo))
        if hi is not None:
            hi = Fraction(math.ceil(hi) - 1 if not hi_in and hi.denominator == 1 else math.floor(hi))
        lo_in = hi_in = True
    return lo, lo_in, hi, hi_in


def _bounded_exists(node: dict[str, Any]) -> bool:
    """Whether some number (an integer, where the schema allows only those) meets the schema's bounds."""
    types = _types(node)
    if types is not None and not types & {"number", "integer"}:
        return True  # (bounds of a number, on a schema whose values are none: not read)
    integer = types is not None and "number" not in types
    lo, lo_in, hi, hi_in = _bounds(node, integer)  # type: ignore[misc]
    return lo is None or hi is None or lo < hi or (lo == hi and lo_in and hi_in)


def _meets(a: Fraction | None, a_in: bool, b: Fraction | None, b_in: bool, bounds: Bounds) -> bool:
    """Whether the interval from `a` to `b` (None: unbounded; `_in`: the end belongs to it) meets `bounds`."""
    lo, lo_in, hi, hi_in = bounds
    if a is None or (lo is not None and lo > a):
        a, a_in = lo, lo_in
    elif lo is not None and lo == a:
        a_in = a_in and lo_in
    if b is None or (hi is not None and hi < b):
        b, b_in = hi, hi_in
    elif hi is not None and hi == b:
        b_in = b_in and hi_in
    return a is None or b is None or a < b or (a == b and a_in and b_in)


def _reachable(text: str, integer: bool, bounds: Bounds) -> bool:
    """Whether a number written as `text` so far (no exponent) can still end within `bounds`: its values are those
    of each integer part it may grow to (with any fraction, for a number), or, once its fraction has begun, those
    its further digits may add."""
    neg = text.startswith("-")
    whole, dot, frac = (text[1:] if neg else text).partition(".")

    def meets(a: Fraction, a_in: bool, b: Fraction | None, b_in: bool) -> bool:  # a span of the value's magnitude
        return _meets(None if b is None else -b, b_in, -a, a_in, bounds) if neg else _meets(a, a_in, b, b_in, bounds)

    if not whole:  # "-" alone: any magnitude
        return meets(Fraction(0), True, None, False)
    if dot:
        low = Fraction(int(whole + frac), 10 ** len(frac))
        return meets(low, True, low + Fraction(1, 10 ** len(frac)), False)
    if whole == "0":
        return meets(Fraction(0), True, Fraction(0) if integer else Fraction(1), integer)
    d, far = int(whole), max((abs(x) for x in (bounds[0], bounds[2]) if x is not None), default=Fraction(0))
    scale = 1
    while True:  # d, then d followed by one digit, two, ...: [d x 10^k, (d + 1) x 10^k)
        if meets(Fraction(d * scale), True, Fraction((d + 1) * scale - (1 if integer else 0)), integer):
            return True
        if d * scale > far:  # (the spans after lie further out still)
            return False
        scale *= 10


def _within(text: str, bounds: Bounds | None) -> bool:
    """Whether the number written as `text` is within `bounds` (None: none)."""
    if bounds is None:
        return True
    v = Fraction(Decimal(text))
    lo, lo_in, hi, hi_in = bounds
    return (lo is None or v > lo or (v == lo and lo_in)) and (hi is None or v < hi or (v == hi and hi_in))


def _value_schema(frame: tuple) -> Schema:
    """The schema of the value of an object frame's last key."""
    node, key = frame[1], frame[3]
    if node is None:
        return None
    props = node.get("properties") or {}
    if key in props:
        return props[key]
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _key_char(stack: tuple, ch: str) -> State | None:
    """A character of an object's key (`stack` ends with its ("k", text) frame)."""
    (_, text), obj = stack[-1], stack[-2]
    props, closed, _, _ = _object(obj)
    if ch == '"':
        if text in obj[2] or (closed and text not in props):  # (a key twice, or one the object does not take)
            return None
        return (stack[:-2] + (("o", obj[1], obj[2] | {text}, text),), COLON, None, 0)
    if ch == "\\":  # (an escape may write any character: where some key goes on)
        return (stack, ESCAPE, None, 0) if _escaped(stack, None, 0, 0xFFFF, None) else None
    if ch < " ":
        return None
    return _key_more(stack, ch)


def _unwritten(obj: tuple, prefix: str) -> Iterator[str]:
    """A closed object frame's property names that begin with `prefix` and are not written yet, in order (from the
    first at or after it: a prefix's names are a run of them)."""
    names, seen = _object(obj)[3], obj[2]
    i = bisect.bisect_left(names, prefix)
    while i < len(names) and names[i].startswith(prefix):
        if names[i] not in seen:
            yield names[i]
        i += 1


def _key_more(stack: tuple, ch: str) -> State | None:
    """The key's text one character `ch` longer (written, or an escape's), where a key of its object begins so."""
    (_, text), obj = stack[-1], stack[-2]
    text += ch
    if _object(obj)[1] and next(_unwritten(obj, text), None) is None:
        return None
    return (stack[:-1] + (("k", text),), STRING, None, 0)


def _key_can_take(stack: tuple, lo: int, hi: int) -> bool:
    """Whether a character of code points `lo`..`hi` may come next in the key being read (a closed object's: the
    next character of a key of it not written yet)."""
    (_, text), obj = stack[-1], stack[-2]
    n = len(text)
    return not _object(obj)[1] or any(len(k) > n and lo <= ord(k[n]) <= hi for k in _unwritten(obj, text))


def _escaped(stack: tuple, limits: tuple | None, lo: int, hi: int, high: str | None) -> bool:
    """Whether a \\u escape whose digits may still write code points `lo`..`hi` can go on to a character that may come
    next in its string (a key's, or a value's of `limits`): a high surrogate to a character its pair may write, a low
    one only as the pair of `high` (a lone half is no character: strict parsers refuse it)."""
    key = bool(stack) and stack[-1][0] == "k"

    def may(a: int, b: int) -> bool:
        return a <= b and (_key_can_take(stack, a, b) if key else _string_may_take(limits, a, b))

    if high is not None:
        base = 0x10000 + ((ord(high) - 0xD800) << 10) - 0xDC00
        return may(base + max(lo, 0xDC00), base + min(hi, 0xDFFF))
    a, b = max(lo, 0xD800), min(hi, 0xDBFF)
    pairs = (0x10000 + ((a - 0xD800) << 10), 0x10000 + ((b - 0xD800) << 10) + 0x3FF) if a <= b else (1, 0)
    return may(lo, min(hi, 0xD7FF)) or may(max(lo, 0xE000), hi) or may(*pairs)


def _string_may_take(limits: tuple | None, lo: int, hi: int) -> bool:
    """Whether a character of code points `lo`..`hi` (no surrogate: written, or an escape's, `_escaped`) may come next
    in a string of `limits` (`_one_more`'s; None: any string): within its maxLength, where its pattern may go on with
    one of them."""
    if limits is None:
        return True
    count, _, most, rx, at = limits
    if most is not None and count >= most:
        return False
    return rx is None or any(_one_more(limits, chr(c)) is not None for c in rx.samples(at, lo, hi))


def _fork(states: Iterator[State | None]) -> State | None:
    """The states of a value's alternatives that go on (a fork's members flattened), as one: None for none, the one
    for one, else a state of mode `FORK` (its first `MAX_FORK`)."""
    alive: list[State] = []
    for s in states:
        if s is None:
            continue
        for member in (s[2] if s[1] == FORK else (s,)):
            if len(alive) < MAX_FORK and member not in alive:
                alive.append(member)
    if not alive:
        return None
    return alive[0] if len(alive) == 1 else ((), FORK, tuple(alive), 0)


def step(state: State, ch: str) -> State | None:
    """The state after one more character, or None where it cannot come next."""
    stack, mode, sub, ws = state
    if mode == FORK:  # every alternative that takes it
        return _fork(step(s, ch) for s in sub)
    if mode == THINK:
        return _think(sub, ch)
    if mode == PATTERN:
        rx, at = sub
        nxt = rx.step(at, ch)
        return None if nxt is None else (stack, PATTERN, (rx, nxt), 0)
    if mode == STRING:
        if stack and stack[-1][0] == "k":
            return _key_char(stack, ch)
        if ch == '"':  # (minLength, pattern)
            return _after_value(stack) if sub is None or _string_may_end(sub) else None
        if ch < " " or sub is not None and sub[2] is not None and sub[0] >= sub[2]:  # (maxLength)
            return None  # (a control character must be escaped)
        if ch == "\\":  # (an escape may write any character: where one may come)
            return (stack, ESCAPE, sub, 0) if _escaped(stack, sub, 0, 0xFFFF, None) else None
        if sub is None:
            return state
        more = _one_more(sub, ch)
        return None if more is None else (stack, STRING, more, 0)
    if mode == ESCAPE:
        if ch == "u":
            return (stack, UNICODE, (4, sub, "", None), 0)
        if ch not in _ESCAPES:
            return None
        if stack and stack[-1][0] == "k":
            return _key_more(stack, _ESCAPES[ch])
        more = _one_more(sub, _ESCAPES[ch])
        return None if more is None and sub is not None else (stack, STRING, more, 0)
    if mode == UNICODE:  # (left, the string's limits, the digits read, a high surrogate whose low half is to come)
        left, limits, digits, high = sub
        if left > 4:  # a high surrogate's pair: its "\u" first
            return (stack, UNICODE, (left - 1, limits, "", high), 0) if ch == ("\\" if left == 6 else "u") else None
        if ch not in _HEX:
            return None
        digits += ch
        if left > 1:  # the characters its digits may still write: one of them must be able to come
            lo, hi = int(digits + "0" * (left - 1), 16), int(digits + "f" * (left - 1), 16)
            return (stack, UNICODE, (left - 1, limits, digits, high), 0) if _escaped(stack, limits, lo, hi, high) \
                else None
        code = int(digits, 16)
        if high is not None:  # the pair's low half: the character they write together
            if not 0xDC00 <= code <= 0xDFFF:
                return None
            c = chr(0x10000 + ((ord(high) - 0xD800) << 10) + code - 0xDC00)
        elif 0xD800 <= code <= 0xDBFF:  # a high half: its low one must follow (a lone half is no character)
            return (stack, UNICODE, (6, limits, "", chr(code)), 0) if _escaped(stack, limits, code, code, None) \
                else None
        elif 0xDC00 <= code <= 0xDFFF:
            return None
        else:
            c = chr(code)
        if stack and stack[-1][0] == "k":
            return _key_more(stack, c)
        more = _one_more(limits, c)
        return None if more is None and limits is not None else (stack, STRING, more, 0)
    if mode == LITERAL:
        if ch != sub[0]:
            return None
        return _after_value(stack) if len(sub) == 1 else (stack, LITERAL, sub[1:], 0)
    if mode == CHOICE:
        texts, written = sub
        more = written + ch
        whole, longer = _choices(texts, more)
        if whole and not longer:
            return _after_value(stack)  # no other candidate goes on from here: the value has ended
        if whole or longer:
            return (stack, CHOICE, (texts, more), 0)
        return step(_after_value(stack), ch) if _choices(texts, written)[0] else None  # it ended: this follows it
    if mode == NUMBER:
        part, integer, text, bounds = sub
        nxt = _number(part, ch, integer or bounds is not None and ch in "eE")
        if nxt is not None:
            if bounds is None:
                return (stack, NUMBER, (nxt, integer, text, None), 0)
            text += ch
            return (stack, NUMBER, (nxt, integer, text, bounds), 0) if _reachable(text, integer, bounds) else None
        if part not in _NUMBER_ENDS or not _within(text, bounds):
            return None
        return step(_after_value(stack), ch)  # the number ended: this character is what follows it
    if ch in _WS:
        return (stack, mode, sub, ws + 1) if ws < MAX_WHITESPACE else None
    if mode == VALUE:
        return _value(stack, ch, sub)
    if mode == VALUE_OR_END:
        node = stack[-1][1]
        if ch == "]":
            return _after_value(stack[:-1]) if _items_ok(node, 0) else None
        if not _room(node, 0):
            return None
        return _value(stack[:-1] + (("a", node, 1),), ch, _item(node, 0))
    if mode in (KEY_OR_END, KEY):
        frame = stack[-1]
        if ch == '"' and _may_add_key(frame):
            return (stack + (("k", ""),), STRING, None, 0)
        if ch == "}" and mode == KEY_OR_END and _may_close(frame):
            return _after_value(stack[:-1])
        return None
    if mode == COLON:
        return (stack, VALUE, _value_schema(stack[-1]), 0) if ch == ":" else None
    if mode == AFTER:
        frame = stack[-1]
        if frame[0] == "o":
            if ch == "," and _may_add_key(frame):
                return (stack, KEY, None, 0)
            if ch == "}" and _may_close(frame):
                return _after_value(stack[:-1])
            return None
        node, count = frame[1], frame[2]
        if ch == "," and _room(node, count):
            return (stack[:-1] + (("a", node, count + 1),), VALUE, _item(node, count), 0)
        return _after_value(stack[:-1]) if ch == "]" and _items_ok(node, count) else None
    return None  # DONE: only whitespace


def _number(part: int, ch: str, integer: bool) -> int | None:
    """A number's next part after `ch`, or None where `ch` does not continue it (an integer's: no fraction or
    exponent)."""
    digit = ch in _DIGITS
    if part == _MINUS:
        return (_ZERO if ch == "0" else _INT) if digit else None
    if part in (_ZERO, _INT, _FRAC):
        if digit and part != _ZERO:
            return part
        if integer:
            return None
        if ch == "." and part != _FRAC:
            return _DOT
        if ch in "eE":
            return _E
        return None
    if part == _DOT:
        return _FRAC if digit else None
    if part == _E:
        return _ESIGN if ch in "+-" else (_EXP if digit else None)
    if part in (_ESIGN, _EXP):
        return _EXP if digit else None
    return None


def advance(state: State, text: str) -> State | None:
    """The state after `text`, or None where some character of it cannot come next. An empty text is None: a token
    that adds no text would let a reply go on without end."""
    if not text:
        return None
    for ch in text:
        state = step(state, ch)
        if state is None:
            return None
    return state


def can_take(state: State, lo: int, hi: int) -> bool:
    """Whether some character of code points `lo`..`hi` may come next: one whose first bytes a token wrote (its
    UTF-8 split between tokens: `feed`) can still be completed to fit."""
    if lo < 0x80:  # (ASCII: each tried)
        if any(step(state, chr(c)) is not None for c in range(lo, min(hi, 0x7F) + 1)):
            return True
        lo = 0x80
        if lo > hi:
            return False
    stack, mode, sub = state[0], state[1], state[2]
    if mode == FORK:
        return any(can_take(s, lo, hi) for s in sub)
    if mode == THINK:
        stage, text, then = sub
        if stage == "in":
            return True
        if stage == "start" and text:  # (what it wrote is the format's, once a character no `<think>` has follows)
            then = advance(then, text)
        return then is not None and can_take(then, lo, hi)
    if mode == PATTERN:
        rx, at = sub
        return any(rx.step(at, chr(c)) is not None for c in rx.samples(at, lo, hi))
    if mode == STRING:
        if stack and stack[-1][0] == "k":
            return _key_can_take(stack, lo, hi)
        return _string_may_take(sub, lo, hi)
    if mode == CHOICE:
        texts, written = sub
        n = len(written)
        return any(len(t) > n and t.startswith(written) and lo <= ord(t[n]) <= hi for t in texts)
    return False  # the rest of JSON takes ASCII alone


def utf8_span(head: bytes) -> tuple[int, int] | None:
    """The code points of the characters whose UTF-8 begins with `head` (one to three bytes, fewer than the
    character's), or None where no character's does (a stray continuation byte, an overlong form, a surrogate,
    beyond U+10FFFF, or a whole character)."""
    lead = head[0]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
    if not need or len(head) >= need or any(b >> 6 != 0b10 for b in head[1:]):
        return None
    bits = lead & (0x7F >> need)
    for b in head[1:]:
        bits = bits << 6 | (b & 0x3F)
    left = 6 * (need - len(head))
    lo, hi = max(bits << left, (0x80, 0x800, 0x10000)[need - 2]), min(bits << left | ((1 << left) - 1), _TOP)
    if lo <= 0xDFFF and hi >= 0xD800:  # (only U+D000..U+DFFF's lead reaches them, at its end)
        if lo >= 0xD800:
            return None
        hi = 0xD7FF
    return (lo, hi) if lo <= hi else None


def _whole(buf: bytes) -> int:
    """How many bytes of `buf` its whole characters take: all, or up to where a last character begins that its bytes
    do not yet finish (its UTF-8 not checked here)."""
    n, i = len(buf), len(buf) - 1
    while i >= 0 and n - i < 4 and buf[i] >> 6 == 0b10:
        i -= 1
    if i < 0:
        return n
    lead = buf[i]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    return i if n - i < need else n


def feed(state: State, pending: bytes, data: bytes) -> tuple[State, bytes] | None:
    """The state after a token's bytes `data`, with `pending` the first bytes of a character a token before began:
    (the state after the whole characters, the bytes of a last character they begin and do not finish), or None
    where they cannot come next (not UTF-8, a character that cannot, or the first bytes of none that can). A token
    of no bytes is None (`advance`'s empty text)."""
    if not data:
        return None
    buf = pending + data if pending else data
    end = _whole(buf)
    if end:
        try:
            text = buf[:end].decode("utf-8")
        except UnicodeDecodeError:
            return None
        state = advance(state, text)  # type: ignore[assignment]
        if state is None:
            return None
    rest = buf[end:]
    if rest:
        span = utf8_span(rest)
        if span is None or not can_take(state, *span):
            return None
    return state, rest


def complete(state: State) -> bool:
    """Whether the value has ended (only whitespace may follow): also a number, or an enum's value that another
    could go on from, at the top, where a reply may end (as a stop token ends it)."""
    stack, mode, sub = state[0], state[1], state[2]
    if mode == DONE:
        return True
    if mode == FORK:
        return any(complete(s) for s in sub)
    if mode == PATTERN:
        return sub[0].accepts(sub[1])
    if mode == THINK:  # thinking: a stop token may end it (vLLM's way: no format is held while it thinks); its
        # thinking ended, a format that may be empty; before any, what it wrote is the format's (a `<` may be both)
        stage, text, then = sub
        if stage == "start":
            then = advance(then, text) if text else then
            return then is not None and complete(then)
        return stage == "in" or stage == "after" and complete(then)
    if stack:
        return False
    return (mode == NUMBER and sub[0] in _NUMBER_ENDS and _within(sub[2], sub[3])) or \
        (mode == CHOICE and _choices(sub[0], sub[1])[0])
