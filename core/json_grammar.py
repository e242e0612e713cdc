"""JSON as a reply grows: a character-level pushdown automaton over immutable states, for JSON mode
(`response_format: {"type": "json_object"}`). `advance(state, text)` is the state after `text`, or None where `text`
cannot continue a JSON object; `complete(state)` says whether the object has ended (the reply may stop there).

A state is a tuple (stack, mode, sub, whitespace run): `stack` the open containers ("o" object, "a" array, "k" a
string that is an object's key), `mode` what may come next, `sub` the mode's progress (a literal's rest, a \\u
escape's hex digits left, a number's part). Whitespace outside strings is capped at `MAX_WHITESPACE` characters in a
row, so that a reply cannot pad forever; inside strings control characters are refused, as JSON refuses them."""
from __future__ import annotations

MAX_WHITESPACE = 64

# modes
TOP, VALUE, KEY_OR_END, KEY, COLON, VALUE_OR_END, AFTER, STRING, ESCAPE, UNICODE, NUMBER, LITERAL, DONE = range(13)
_WS = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# a number's parts: after "-", after a leading 0, in the integer, after ".", in the fraction, after "e", after its
# sign, in the exponent; those a number may end in
_MINUS, _ZERO, _INT, _DOT, _FRAC, _E, _ESIGN, _EXP = range(8)
_NUMBER_ENDS = frozenset((_ZERO, _INT, _FRAC, _EXP))

State = tuple[tuple[str, ...], int, object, int]
START: State = ((), TOP, None, 0)


def _after_value(stack: tuple[str, ...]) -> State:
    return (stack, AFTER if stack else DONE, None, 0)


def _value(stack: tuple[str, ...], ch: str) -> State | None:
    """A value starting with `ch`."""
    if ch == "{":
        return (stack + ("o",), KEY_OR_END, None, 0)
    if ch == "[":
        return (stack + ("a",), VALUE_OR_END, None, 0)
    if ch == '"':
        return (stack, STRING, None, 0)
    if ch == "-":
        return (stack, NUMBER, _MINUS, 0)
    if ch in _DIGITS:
        return (stack, NUMBER, _ZERO if ch == "0" else _INT, 0)
    if ch in _LITERALS:
        return (stack, LITERAL, _LITERALS[ch], 0)
    return None


def step(state: State, ch: str) -> State | None:
    """The state after one more character, or None where it cannot come next."""
    stack, mode, sub, ws = state
    if mode == STRING:
        if ch == '"':
            if stack and stack[-1] == "k":
                return (stack[:-1], COLON, None, 0)
            return _after_value(stack)
        if ch == "\\":
            return (stack, ESCAPE, None, 0)
        return state if ch >= " " else None  # (a control character must be escaped)
    if mode == ESCAPE:
        if ch == "u":
            return (stack, UNICODE, 4, 0)
        return (stack, STRING, None, 0) if ch in _ESCAPES else None
    if mode == UNICODE:
        if ch not in _HEX:
            return None
        return (stack, STRING, None, 0) if sub == 1 else (stack, UNICODE, sub - 1, 0)
    if mode == LITERAL:
        if ch != sub[0]:
            return None
        return _after_value(stack) if len(sub) == 1 else (stack, LITERAL, sub[1:], 0)
    if mode == NUMBER:
        nxt = _number(sub, ch)
        if nxt is not None:
            return (stack, NUMBER, nxt, 0)
        if sub not in _NUMBER_ENDS:
            return None
        return step(_after_value(stack), ch)  # the number ended: this character is what follows it
    if ch in _WS:
        return (stack, mode, sub, ws + 1) if ws < MAX_WHITESPACE else None
    if mode == TOP:
        return (("o",), KEY_OR_END, None, 0) if ch == "{" else None
    if mode == VALUE:
        return _value(stack, ch)
    if mode == VALUE_OR_END:
        if ch == "]":
            return _after_value(stack[:-1])
        return _value(stack, ch)
    if mode in (KEY_OR_END, KEY):
        if ch == '"':
            return (stack + ("k",), STRING, None, 0)
        if ch == "}" and mode == KEY_OR_END:
            return _after_value(stack[:-1])
        return None
    if mode == COLON:
        return (stack, VALUE, None, 0) if ch == ":" else None
    if mode == AFTER:
        top = stack[-1]
        if ch == ",":
            return (stack, KEY if top == "o" else VALUE, None, 0)
        if ch == ("}" if top == "o" else "]"):
            return _after_value(stack[:-1])
        return None
    return None  # DONE: only whitespace


def _number(part: int, ch: str) -> int | None:
    """A number's next part after `ch`, or None where `ch` does not continue it."""
    digit = ch in _DIGITS
    if part == _MINUS:
        return (_ZERO if ch == "0" else _INT) if digit else None
    if part in (_ZERO, _INT, _FRAC):
        if digit and part != _ZERO:
            return part
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


def complete(state: State) -> bool:
    """Whether the JSON object has ended (only whitespace may follow)."""
    return state[1] == DONE
