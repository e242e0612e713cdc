"""A chat reply's tool calls, read out of its text as it streams, as OpenAI's `tool_calls` (vLLM's tool-call parsers).

A `ToolCallReader` takes a reply's text piece by piece (`feed`, then `end`) and says, per piece, the text that is
the message's content and the tool calls it has read (`ReplyDelta`: OpenAI's streamed `tool_calls` entries, each
naming its call's `index`); `whole` reads a whole reply. Readers:
- the formats models write their own calls in, for tool_choice "auto" (`PARSERS`, vLLM's `--tool-call-parser`
  names), picked by the app's `tool_call_parser` or, by default, from the model's chat template (`detect`):
  - `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, after any text (Qwen2.5,
    Qwen3, Hermes);
  - `qwen3_coder`: the same marks around `<function=NAME><parameter=P>value</parameter>...</function>` (Qwen3-Coder),
    each value as its tool's schema types it (a string's text as it is, else its JSON);
  - `llama3_json`: a reply that is a JSON object `{"name": ..., "parameters": {...}}` (or several, separated by
    `;`), after an optional `<|python_tag|>` (Llama 3.1-3.3);
  - `mistral`: `[TOOL_CALLS]` and then a JSON list of `{"name", "arguments"}`, or `name[ARGS]{...}` (Mistral);
- a tool_choice naming a tool (`NamedToolReader`: the reply is its arguments, streamed as they come) or
  "required" (`RequiredToolReader`: the reply is a JSON list of calls).
Streamed (vLLM's and OpenAI's way), a call's entry is sent once its name is read and its arguments open, then
its arguments as they are written (`ObjectCall`, `FunctionCall`, `CallList`; mistral's calls whole at the end).
A reply read whole and the same reply streamed in pieces of any size give the same calls (the same arguments'
text) and content, but for a call sent before its text was whole that never became whole (its cap cut it, its
JSON broke off, or a `</tool_call>` came before its `</function>`): streamed, it stays a call, its arguments cut;
read whole, it stays text, as any call whose JSON does not parse (vLLM's parsers leave it so). Text between or
after calls that is only whitespace is dropped (streamed, whitespace before the first call has gone out already).
"""
from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "qwen3_coder", "llama3_json", "mistral")


def detect(template: Any) -> str | None:
    """The tool-call format a chat template teaches its model (`PARSERS`), from the tokens and words it writes a
    call with; None where it shows none. `template`: the tokenizer's chat_template (text, or a dict of named
    templates, as some tokenizers hold a `tool_use` one)."""
    if isinstance(template, dict):
        text = "\n".join(str(t) for t in template.values())
    elif isinstance(template, list):  # [{"name": ..., "template": ...}]
        text = "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in template)
    else:
        text = str(template or "")
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_coder"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return "llama3_json"
    return None


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A call's id as Mistral's chat templates take it back on the next turn: 9 letters and digits (vLLM's)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(slots=True)
class ReplyDelta:
    """What a piece of a reply's text says: the content's text, OpenAI's streamed `tool_calls` entries, and the
    reasoning's text (`deployments.reasoning`)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""

    def add(self, other: "ReplyDelta") -> "ReplyDelta":
        self.content += other.content
        self.calls.extend(other.calls)
        self.reasoning += other.reasoning
        return self

    def delta(self) -> dict[str, Any]:
        """As a chat chunk's `delta` (vLLM's `reasoning_content` for the reasoning)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = self.calls
        return out


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _dumps(value: Any) -> str:
    """`value`'s JSON text as json.dumps writes it (not ASCII only), a lone surrogate as its escape (no UTF-8 can
    carry one)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def _arguments(value: Any) -> str:
    """A call's arguments as OpenAI's JSON text (a model may write them as an object or as text)."""
    return value if isinstance(value, str) else _dumps(value)


def held_back(text: str, mark: str) -> int:
    """How many characters at the end of `text` could start `mark` (held back until the next piece says)."""
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-k:]):
            return k
    return 0


class ToolCallReader:
    """Reads one reply (`feed` each piece of its text, then `end`); `calls`: how many it has read so far.
    `as_calls`: a reply with calls ends with finish reason `tool_calls` (not for a named tool, as OpenAI's)."""

    as_calls = True
    new_id = staticmethod(call_id)  # each call's id

    def __init__(self) -> None:
        self.calls = 0
        self._ws = ""  # whitespace after a call, held until text that is not says whether it is content
        self._whole = False  # read whole (`whole`): no call is sent before its text is
        self._spoke = 0  # the calls content came after

    def feed(self, text: str) -> ReplyDelta:
        raise NotImplementedError

    def end(self) -> ReplyDelta:
        raise NotImplementedError

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole reply's content (None where it is only whitespace beside calls) and its calls (each whole: no
        `index`)."""
        self._whole = True
        d = self.feed(text).add(self.end())
        return (d.content if d.content.strip() or not d.calls else None), merge_calls(d.calls)

    def _call(self, name: str, arguments: Any) -> dict[str, Any]:
        entry = {"index": self.calls, "id": self.new_id(), "type": "function",
                 "function": {"name": name, "arguments": _arguments(arguments)}}
        self.calls += 1
        return entry

    def _content(self, text: str) -> str:
        """Text as content: after a call, whitespace alone is held until text follows it (dropped at the end);
        once text has followed the last call, all of it is content."""
        if not self.calls:
            return text
        text = self._ws + text
        if not text.strip() and self._spoke < self.calls:
            self._ws = text
            return ""
        self._ws, self._spoke = "", self.calls
        return text

    def _calls(self, found: list[Call] | None) -> ReplyDelta | None:
        """The calls found, as entries (numbered on from those read before), or None where none parsed."""
        return ReplyDelta(calls=[self._call(*c) for c in found]) if found else None


Call = tuple[str, Any]  # a call's name and arguments


def as_call(value: Any, keys: tuple[str, ...] = ("arguments", "parameters"), bare: bool = True) -> Call | None:
    """A call from its JSON value: an object with a `name` and its arguments (an object, or their JSON text) under one
    of `keys` (none: no arguments, where `bare`; else no call: a format with no marker around its calls, whose JSON
    answer with a "name" is no call, as vLLM's), else None. Text that is no JSON is itself the value: a JSON string (as
    vLLM writes it: `"hello"`), not text a client cannot read as JSON."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = next((value[k] for k in keys if k in value), {} if bare else None)
    if isinstance(args, str):
        try:
            _DECODER.decode(args)
        except (ValueError, RecursionError):
            args = _dumps(args)
    return (value["name"], args) if isinstance(args, (dict, str)) else None


def as_calls(values: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Call] | None:
    """Calls from a JSON list of them, else None (one that is not a call spoils the list)."""
    if not isinstance(values, list) or not values:
        return None
    calls = [as_call(v, keys) for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# JSON as the readers take it: control characters allowed in strings (a model writes code's tabs and line breaks as
# they are), NaN and Infinity refused (no JSON has them)
_DECODER = json.JSONDecoder(strict=False, parse_constant=_no_constant)


def _json(text: str) -> Any:
    """`text`'s JSON value (as `_DECODER` reads it), else None. An object or a list with Python's True, False and
    None where JSON has true, false and null (as a model may write a call's arguments), or with an escape JSON has
    not, reads as `JsonText` rewrites it (`_pythonic_head`)."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        value, end = _pythonic_head(text)
        return value if end is not None and not text[end:].strip() else None


_PY_WORD = re.compile(r"\b(?:True|False|None)\b")


def _pythonic_head(text: str) -> tuple[Any, int | None]:
    """The object or list `text` opens with (after whitespace) where only Python's True, False and None, or an
    escape JSON has not (`"\\d+"`, a regex a model wrote: its backslash is its own), kept it from being JSON, and
    where it ends in `text`, as `JsonText` rewrites it; (None, None) otherwise."""
    if _PY_WORD.search(text) is None and "\\" not in text:
        return None, None
    rewritten = JsonText()
    written = rewritten.feed(text)
    if rewritten.end is None:
        return None, None
    try:
        return _DECODER.decode(written), rewritten.end
    except (ValueError, RecursionError):
        return None, None


def merge_calls(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed `tool_calls` entries as whole calls, in order: each call's first entry (id, type, name) with every
    entry's arguments of its index joined, without the `index`."""
    calls: dict[int, dict[str, Any]] = {}
    for e in entries:
        c = calls.get(e["index"])
        if c is None:
            calls[e["index"]] = {"id": e.get("id") or call_id(), "type": "function",
                                 "function": {"name": e["function"].get("name", ""),
                                              "arguments": e["function"].get("arguments", "")}}
        else:
            c["function"]["arguments"] += e["function"].get("arguments", "")
    return list(calls.values())


class JsonText:
    """A JSON value's text as it streams in, rewritten as `json.dumps(value, ensure_ascii=False)` writes it: `, `
    and `: ` between items, no other whitespace, a string's escapes only where json.dumps writes one (numbers as
    written; a lone surrogate as its escape, which no UTF-8 can carry; Python's True, False and None, which a model
    may write, as JSON's true, false and null, each held until the character after it). `feed` gives the rewritten
    text of what it was given, up to where the value closes (`end`: that place in all it was given; None while the
    value is open) or where it stops being JSON (`broken`: a character no JSON value has outside a string, or a
    bracket that closes none it opened; `stop`: that place). It checks no more of JSON's grammar than that."""

    _PLAIN = re.compile(r'[^"\\\x00-\x1f\ud800-\udfff]+')
    _HEX4 = re.compile(r"[0-9a-fA-F]{4}")
    _HEX = frozenset("0123456789abcdefABCDEF")
    _ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
    _BETWEEN = {",": ", ", ":": ": ", " ": "", "\t": "", "\r": "", "\n": ""}
    _SCALAR = frozenset("-+.0123456789eEtrufalsn")  # a number's, true's, false's and null's characters
    _PAIRS = {"}": "{", "]": "["}
    _PYTHON = {"True": "true", "False": "false", "None": "null"}

    def __init__(self) -> None:
        self.end: int | None = None
        self.broken: int | None = None
        self.low = 0  # the fewest brackets open at any point of the last `feed` (its start too)
        self._fed = 0
        self._open: list[str] = []  # the brackets open
        self._in_string = False
        self._escape = ""  # an escape being read, from its backslash
        self._high = ""  # a high surrogate's escape, waiting for its low one
        self._word = ""  # a Python word being read (True, False or None so far), and where it began
        self._word_at = 0

    def feed(self, text: str) -> str:
        out: list[str] = []
        i, n = 0, len(text)
        self.low = len(self._open)
        while i < n and self.stop is None:
            ch = text[i]
            if not self._in_string:
                if self._word or ch in "TFN":
                    if ch.isalpha():
                        if not self._word:
                            self._word_at = self._fed + i
                        self._word += ch
                        if not any(w.startswith(self._word) for w in self._PYTHON):
                            self.broken = self._word_at
                            break
                        i += 1
                        continue
                    word, self._word = self._PYTHON.get(self._word), ""
                    if word is None:  # (cut short: "Tru,")
                        self.broken = self._word_at
                        break
                    out.append(word)
                if ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._open.append(ch)
                elif ch in "}]":
                    if not self._open or self._open.pop() != self._PAIRS[ch]:
                        self.broken = self._fed + i
                        break
                    self.low = min(self.low, len(self._open))
                    if not self._open:
                        self.end = self._fed + i + 1
                elif ch not in self._BETWEEN and ch not in self._SCALAR:
                    self.broken = self._fed + i
                    break
                i += 1
                out.append(self._BETWEEN.get(ch, ch))
            elif self._escape:
                if self._escape[1:2] == "u" and ch not in self._HEX:  # a `\u` cut short: a backslash of its own
                    out.append(self._unpaired() + "\\\\" + self._escape[1:])  # (then `ch` is read as it is)
                    self._escape = ""
                    continue
                self._escape += ch
                i += 1
                out.append(self._escaped())
            elif ch == "\\":
                self._escape = ch
                i += 1
            else:
                out.append(self._unpaired())
                m = self._PLAIN.match(text, i)
                if m is not None:
                    out.append(m.group())
                    i = m.end()
                    continue
                i += 1
                if ch == '"':
                    self._in_string = False
                    out.append(ch)
                else:  # a control character or a surrogate: its escape
                    out.append(self._char(ch))
        self._fed += i
        return "".join(out)

    @property
    def stop(self) -> int | None:
        """Where the value ended (`end`) or stopped being JSON (`broken`); None while it goes on."""
        return self.end if self.end is not None else self.broken

    def _escaped(self) -> str:
        """What an escape read so far is written as (nothing while it is unfinished)."""
        e = self._escape
        if e[1] != "u":
            self._escape = ""
            c = self._ESCAPES.get(e[1])  # (one JSON has not, `\d` in a regex: a backslash of its own, as meant)
            return self._unpaired() + (self._char(c) if c is not None else "\\\\" + self._char(e[1]))
        if len(e) < 6:
            return ""
        self._escape = ""
        if not self._HEX4.fullmatch(e[2:]):
            return self._unpaired() + e
        cp = int(e[2:], 16)
        if 0xD800 <= cp < 0xDC00:  # the first half of a pair: held for the second
            held, self._high = self._unpaired(), e
            return held
        if 0xDC00 <= cp < 0xE000 and self._high:
            high, self._high = int(self._high[2:], 16), ""
            return chr(0x10000 + ((high - 0xD800) << 10) + (cp - 0xDC00))
        return self._unpaired() + self._char(chr(cp))

    def _unpaired(self) -> str:
        """A held high surrogate that no low one followed, as its escape."""
        held, self._high = self._high, ""
        return held.lower()

    @staticmethod
    def _char(c: str) -> str:
        if 0xD800 <= ord(c) < 0xE000:  # a lone surrogate cannot be written as UTF-8: its escape
            return f"\\u{ord(c):04x}"
        return json.dumps(c, ensure_ascii=False)[1:-1]


_KEY = re.compile(r'\s*"((?:[^"\\]|\\.)*)"\s*:\s*', re.S)
_NAME_END = re.compile(r"[>\s]")
_MAY_END = re.compile(r'["{}\[\],:\s]')  # a character that may end a key or a value, or open the arguments' object
_SPACE = re.compile(r"\s*")


def _call_start(text: str, keys: tuple[str, ...]) -> tuple[str, int] | None:
    """Where a call's JSON object, as far as `text` has it, has its name read and its arguments' object opened:
    (its name, where in `text` the arguments start); None before (or where it is no such object)."""
    i = _SPACE.match(text).end()
    if text[i:i + 1] != "{":
        return None
    name, args, i = None, None, i + 1
    while True:
        i = _SPACE.match(text, i).end()
        if text[i:i + 1] == ",":
            i += 1
        m = _KEY.match(text, i)
        if m is None or m.end() == len(text):
            return None
        key, i = _json(f'"{m.group(1)}"'), m.end()
        if key in keys and args is None:
            if text[i] != "{":
                return None  # arguments as JSON text, or not a call's: read whole
            args = i
            if name is not None:
                return name, args
        try:
            value, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        if key == "name":
            if not isinstance(value, str) or not value:
                return None
            name = value
            if args is not None:
                return name, args


class ObjectCall:
    """One call written as a JSON object (`{"name": ..., <one of keys>: {...}}`), streamed as it is written: once
    its name is read and its arguments' object opened, its entry (id, name and the arguments so far), then the
    rest of its arguments as they come (as `JsonText` rewrites them). `feed` takes the call's text so far; a reader
    that reads whole (`ToolCallReader.whole`) sends a call only once its arguments are a whole JSON object."""

    def __init__(self, keys: tuple[str, ...] = ()) -> None:
        self.keys = keys
        self.args: JsonText | None = None  # once the entry is sent
        self._index = 0
        self._at = 0  # where in the call's text its arguments start
        self._seen = 0  # of the call's text, what the arguments were given
        self._object: JsonText | None = None  # the whole object as read (where it ends; where its strings are)
        self._lead = 0  # where in the call's text the object starts
        self._read = 0  # of the call's text, what the object was given
        self._looked = 0  # of the call's text, what `_call_start` read last

    @property
    def sent(self) -> bool:
        return self.args is not None

    @property
    def after(self) -> int | None:
        """Where in the call's text what follows it may start: past its object once that is over (0: the text is
        no object); None while the object goes on (a mark there is inside it)."""
        if self._object is None:
            return 0
        stop = self._object.stop
        return None if stop is None else self._lead + stop

    def feed(self, reader: "ToolCallReader", text: str) -> list[dict[str, Any]]:
        if self._object is None:
            i = _SPACE.match(text).end()
            if i == len(text) or text[i] != "{":
                return []
            self._object, self._lead, self._read = JsonText(), i, i
        obj = self._object
        if obj.stop is None and len(text) > self._read:
            obj.feed(text[self._read:])
            self._read = len(text)
        if self.args is None:
            if obj.low > 1 and obj.stop is None:  # all of it inside a value: no key of the object's own came
                return []
            # (no key or value can have ended since the last look without one of these: a long key or string is
            # not read again from the object's start at every piece)
            looked, self._looked = self._looked, len(text)
            if looked and obj.stop is None and not _MAY_END.search(text, looked):
                return []
            start = _call_start(text, self.keys)
            if start is None:
                return []
            args = JsonText()
            written = args.feed(text[start[1]:])
            if reader._whole and (args.end is None or not isinstance(_json(text[start[1]:start[1] + args.end]),
                                                                     dict)):
                return []  # (read whole, arguments that are no JSON object leave the call text)
            self.args, self._at, self._seen = args, start[1], len(text)
            entry = reader._call(start[0], written)
            self._index = entry["index"]
            return [entry]
        if self.args.stop is not None or len(text) <= self._seen:
            return []
        delta, self._seen = self.args.feed(text[self._seen:]), len(text)
        return [{"index": self._index, "function": {"arguments": delta}}] if delta else []


class _MarkedReader(ToolCallReader):
    """Calls that open with a mark (`START`): text before it is content, held back only while it could be the
    mark's start; each call's text is read once whole (`_close` says where one ends), or streamed as it comes where
    the format can be (`_partial`)."""

    START = ""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False
        self._early = ReplyDelta()  # what a call sent while its end was looked for (`_close`), for `_partial`

    def feed(self, text: str) -> ReplyDelta:
        self._buf += text
        out = ReplyDelta()
        while True:
            if not self._inside:
                i, mark = self._start(self._buf)
                if i < 0:
                    cut = len(self._buf) - self._held(self._buf)
                    out.content += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out.content += self._content(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(mark):], True
            else:
                got = self._close(self._buf, False)
                if got is None:
                    return out.add(self._partial(self._buf))
                out.add(got)

    def _start(self, buf: str) -> tuple[int, str]:
        """Where the first call in `buf` begins (-1: none yet), and its mark (what is read past)."""
        return buf.find(self.START), self.START

    def _held(self, buf: str) -> int:
        """How much of the end of `buf` (no call begun in it) may begin one's mark: held back."""
        return held_back(buf, self.START)

    def end(self) -> ReplyDelta:
        out = ReplyDelta()
        while self._inside:  # (more than one where a block holds more calls: `_next_in_block`)
            held = len(self._buf)
            got = self._close(self._buf, True)
            if got is not None:
                out.add(got)
            if self._inside and len(self._buf) >= held:
                break
        if self._buf:  # a mark's start the reply ended on, or a call that did not parse
            out.content += self._content(self._buf)
            self._buf = ""
        self._ws = ""
        return out

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        """The calls read from `buf` (the text after a mark) once one is whole (`last`: the reply has ended), the
        reader's state moved past them; None while it is not."""
        raise NotImplementedError

    def _partial(self, buf: str) -> ReplyDelta:
        """What a call not yet whole (`buf`: its text so far) says already: what a format that streams sent while
        `_close` looked for the call's end (kept in `_early`)."""
        early, self._early = self._early, ReplyDelta()
        return early


class HermesReader(_MarkedReader):
    """`<tool_call>` JSON `</tool_call>`: each call's entry sent once its name is read and its arguments' object
    opened, then its arguments as they come (`ObjectCall`; a `</tool_call>` inside them is theirs); one whose text
    never gets that far is read whole at its end, and stays text where it is no call. A call sent before its text
    ended stays a call (cut, its arguments are cut too, as vLLM's); read whole, it stays text."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._open: ObjectCall | FunctionCall | None = None  # the call being read
        self._lead = self.START  # the mark its text began after ("": a block's next call, `_next_in_block`)

    def _streamed(self) -> "ObjectCall | FunctionCall":
        return ObjectCall(("arguments", "parameters"))

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        if self._open is None:
            self._open = self._streamed()
        opened = self._open
        got = ReplyDelta(calls=opened.feed(self, buf if last else buf[:len(buf) - held_back(buf, self.END)]))
        nxt = self._next_in_block(opened, buf)
        if nxt is not None:  # another call in the same block: read on from it, still inside
            self._buf, self._open, self._lead = buf[nxt:], None, ""
            return got
        after = opened.after
        j = buf.find(self.END, after) if after is not None else -1
        if j < 0 and not last:
            self._early.add(got)
            return None
        body, rest = (buf[:j], buf[j + len(self.END):]) if j >= 0 else (buf, "")
        lead, self._lead = self._lead, self.START
        self._inside, self._buf, self._open = False, rest, None
        if opened.sent:
            return got
        call = self._call_of(body)
        if call is None:  # not a call: its text stays content
            return ReplyDelta(content=self._content(lead + body + (self.END if j >= 0 else "")))
        return self._calls([call])

    def _call_of(self, body: str) -> Call | None:
        """The call a `<tool_call>`'s body holds (JSON: its name and arguments), else None."""
        return as_call(_json(body))

    def _next_in_block(self, opened: "ObjectCall | FunctionCall", buf: str) -> int | None:
        """Where in `buf` another call of the same block begins, once `opened` has ended (None: none does)."""
        return None


class Qwen3CoderReader(HermesReader):
    """Qwen3-Coder's calls: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`;
    a value is its text (one newline either side dropped), typed by its tool's schema as vLLM's parser types it
    (`_value`). Read a parameter at a time (`FunctionCall`, whole too: a call whose function never closes stays
    text)."""

    BARE = "<function="  # a call the model began without `<tool_call>` (Qwen3-Coder may): read as vLLM's parser does

    def __init__(self, types: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.types = types or {}  # tool name -> parameter name -> its schema's type
        self._bare = False  # the call being read began with its function's mark

    def _streamed(self) -> "FunctionCall":
        return FunctionCall()

    def _start(self, buf: str) -> tuple[int, str]:
        i, j = buf.find(self.START), buf.find(self.BARE)
        self._bare = j >= 0 and not 0 <= i < j
        return (j, "") if self._bare else (i, self.START)

    def _held(self, buf: str) -> int:
        return max(held_back(buf, self.START), held_back(buf, self.BARE))

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        if not self._bare:
            return super()._close(buf, last)
        # a call begun by its function's mark: it ends with the function (a `</tool_call>` right after it, if the
        # model wrote one, is its end too); else as a call in the marks
        if self._open is None:
            self._open = self._streamed()
        opened = self._open
        got = ReplyDelta(calls=opened.feed(self, buf if last else buf[:len(buf) - held_back(buf, self.END)]))
        assert isinstance(opened, FunctionCall)
        if opened.closed:
            rest = buf[opened.after:]
            tail = rest.lstrip()
            if tail.startswith(self.END):
                rest = tail[len(self.END):]
            elif not last and self.END.startswith(tail):  # (whitespace, or that mark begun: the next text says)
                self._early.add(got)
                return None
            self._inside, self._buf, self._open = False, rest, None
            return got
        j = buf.find(self.END, opened.after) if opened.after is not None else -1
        if j < 0 and not last:
            self._early.add(got)
            return None
        self._inside, self._buf, self._open = False, buf[j + len(self.END):] if j >= 0 else "", None
        if opened.sent:  # cut: it stays a call, as one in the marks
            return got
        return ReplyDelta(content=self._content(buf[:j + len(self.END)] if j >= 0 else buf))

    def _call_of(self, body: str) -> Call | None:
        return None  # (`FunctionCall` read every call there is)

    def _next_in_block(self, opened: "ObjectCall | FunctionCall", buf: str) -> int | None:
        """A `<function=` after a closed function, before `</tool_call>`: the block's next call (vLLM's parser reads
        every function of a block; the second was dropped)."""
        if not isinstance(opened, FunctionCall) or not opened.closed or opened.after is None:
            return None
        rest = buf[opened.after:]
        head = rest.lstrip()
        at = opened.after + len(rest) - len(head)
        if head.startswith(self.BARE):
            return at
        # (a block the model left open before the next: `<tool_call>` again, then its function)
        return at + len(self.START) if head.startswith(self.START + self.BARE) or \
            head.startswith(self.START) and head[len(self.START):].lstrip().startswith(self.BARE) else None

    @staticmethod
    def _value(text: str, kind: Any) -> Any:
        """A parameter's value: `null` is None; a string's is its text; an integer's, a number's or a boolean's is
        its text read as one where it reads so (`007`, `1e3`, `True`: as vLLM's); an object's or an array's is its
        JSON, or its Python literal (`{'a': True}`). Where the schema names no type (or no tool or parameter of
        the request's), its JSON where the text is JSON; else its text."""
        text = text.removeprefix("\n").removesuffix("\n")
        if text.strip().lower() == "null":
            return None
        kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str) and k != "null"]
        if "string" in kinds:
            return text
        word = text.strip()
        for k in kinds:
            if k == "integer" and re.fullmatch(r"[+-]?\d+", word) and len(word) <= _MAX_INT_DIGITS:
                return int(word)
            if k == "number":
                try:
                    x = float(word)
                except ValueError:
                    continue
                if math.isfinite(x):
                    return int(x) if x.is_integer() and re.fullmatch(r"[+-]?\d+", word) else x
            if k == "boolean" and word.lower() in ("true", "false"):
                return word.lower() == "true"
        value = _json(text)
        if value is None and any(k in ("object", "array") for k in kinds):
            value = _literal(word)
        return text if value is None else value


_MAX_INT_DIGITS = 4000  # an integer's digits read as one (Python's int() refuses past 4300): longer stays text


def _literal(text: str) -> Any:
    """A Python literal's value where it is one JSON can carry (a dict with str keys, a list, text, a number, a
    boolean, None), else None: a model may write an object as Python's repr."""
    if len(text) > 100_000:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                return None
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                return None
        elif v is not None and not isinstance(v, (str, int, bool)):
            return None
    return value


class FunctionCall:
    """A Qwen3-Coder call streamed as it is written: its entry once `<function=NAME>` is read, then each parameter
    once whole (`{"P": value` for the first, `, "P": value` after), and the arguments' `}` once `</function>`
    closes the function (a `</tool_call>` before it ends the call without: cut). A parameter's value is its own
    (a mark in it is text). `feed` takes the call's text so far; a reader that reads whole sends a call only once
    its function has closed."""

    OPEN = re.compile(r"\s*<function=([^>\s]+)>")
    CLOSE, END = "</function>", "</tool_call>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"

    def __init__(self) -> None:
        self.sent = False
        self.after: int | None = 0  # as `ObjectCall.after`: where the call's end may be (None: in a parameter)
        self._name = ""
        self._index = 0
        self._pos = 0  # where the next parameter (or the function's end) is looked for
        self._param: tuple[int, int] | None = None  # a parameter not whole yet: where its name and value start
        self._scan = 0  # where its end is looked for
        self._count = 0  # parameters sent
        self._closed = False
        self._looked = 0  # of the call's text, what its mark was looked for in last

    @property
    def closed(self) -> bool:
        """Whether its function's end was read (`after`: where the text after it begins)."""
        return self._closed

    def feed(self, reader: Qwen3CoderReader, text: str) -> list[dict[str, Any]]:
        if self._closed:
            return []
        name, pos, param, scan = self._name, self._pos, self._param, self._scan
        if not self.sent:
            # (the mark's name goes on until a `>` or white space comes: not matched again at every piece)
            looked, self._looked = self._looked, len(text)
            if looked and not _NAME_END.search(text, looked):
                return []
            m = self.OPEN.match(text)
            if m is None:
                return []
            name, pos = m.group(1), m.end()
        types, args, count, closed, opened = reader.types.get(name, {}), "", self._count, False, False
        while True:
            if param is None:
                marks = [(k, what) for what in (self.CLOSE, self.END, self.PARAMETER)
                         if (k := text.find(what, pos)) >= 0]
                if not marks:
                    break
                k, what = min(marks)
                if what != self.PARAMETER:
                    closed, pos = what == self.CLOSE, k + len(what) if what == self.CLOSE else k
                    break
                head = text.find(">", k + len(self.PARAMETER))
                if head >= 0 and "<" in text[k + 1:head]:  # no parameter's name: skipped, as its text is
                    pos = k + len(self.PARAMETER)
                    continue
                if head < 0:  # its name is not whole yet: read again from its mark
                    pos, opened = k, True
                    break
                param, scan = (k, head + 1), head + 1
            key_at, value_at = param
            # its end, or where the model left that out, the next parameter's mark or the function's end, whichever
            # comes first (then read next: vLLM's parser reads a value so)
            end, what = min([(k, mark) for mark in (self.PARAMETER_END, self.PARAMETER, self.CLOSE)
                             if (k := text.find(mark, scan)) >= 0], default=(-1, ""))
            if end < 0:
                scan = max(value_at, len(text) - len(self.PARAMETER_END) + 1)
                break
            key = text[key_at + len(self.PARAMETER):value_at - 1].strip()
            value = reader._value(text[value_at:end], types.get(key))
            args += (", " if count else "{") + _dumps(key) + ": " + _dumps(value)
            count, pos, param = count + 1, end + len(self.PARAMETER_END) if what == self.PARAMETER_END else end, None
        if reader._whole and not closed:
            return []
        if closed:
            args += "}" if count else "{}"
        self.after = None if param is not None or opened else pos
        self._name, self._pos, self._param, self._scan, self._count, self._closed = name, pos, param, scan, count, \
            closed
        if not self.sent:
            entry = reader._call(name, args)
            self.sent, self._index = True, entry["index"]
            return [entry]
        return [{"index": self._index, "function": {"arguments": args}}] if args else []


class MistralReader(_MarkedReader):
    """`[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` (also `name{...}`), each call after a mark of
    its own. Streamed, as vLLM's parser streams them: a list's calls each as it is written (`CallList`); a named
    call's entry once its name is read and its arguments' object opened, then its arguments as they come (as
    `JsonText` rewrites them). A call whose text never gets that far (arguments as a JSON string, a name that is no
    function's), and every call read whole, is read at the reply's end; a call sent before its text ended stays a
    call (cut), as Hermes's."""

    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    new_id = staticmethod(mistral_call_id)  # (Mistral's templates refuse any other id on the next turn)
    _NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # a function's name (OpenAI's: letters, digits, _ and -)

    def __init__(self) -> None:
        super().__init__()
        self._list: CallList | None = None  # the list form's calls, as they stream
        self._args: JsonText | None = None  # the named form's arguments, once its entry is sent
        self._at = 0  # where in the text after the mark the list's items, or the arguments, start
        self._seen = 0  # of that text, what the arguments were given
        self._index = 0  # the named call's index
        self._before = 0  # the calls read before the list
        self._later = False  # this mark's text streams no call: read at the reply's end

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        if not self._whole and not self._later:
            got = self._stream(buf, last)
            if got is not None or not last:
                return got
        if not last:
            return None
        self._later, self._inside, found = False, False, []
        text, after = buf, ""  # (after: text after calls, content as streamed)
        while True:  # each mark's calls, then the next mark after their JSON (a mark inside it is its text)
            calls, rest = self._read(text.strip())
            if calls is None:  # not calls: the text from this mark stays content (the calls before it stand)
                if not found:
                    self._buf = self.START + buf
                    return None
                after += self.START + text
                break
            found.extend(calls)
            k = rest.find(self.START)
            if k < 0:
                after += rest
                break
            after, text = after + rest[:k], rest[k + len(self.START):]
        self._buf = ""
        got = self._calls(found)
        if got is not None and after:
            got.content += self._content(after)
        return got

    def _stream(self, buf: str, last: bool) -> ReplyDelta | None:
        """Streamed: the calls of this mark's text so far, once it is over (the list's or the arguments' end, or the
        reply's, a call sent); None while it goes on (what it sent kept for `_partial`), or where it streams no call
        (`_later`)."""
        head = buf.lstrip()
        if self._list is None and self._args is None:
            if not head:
                return None
            if head[0] == "[":
                self._list, self._at, self._before = CallList(("arguments", "parameters"), ","), \
                    len(buf) - len(head) + 1, self.calls
            else:
                opened = self._open_named(buf)
                if opened is None:
                    self._later = "{" in buf  # (a name and what is no object: read at the end)
                    return None
                self._early.add(opened)
        if self._list is not None:
            return self._stream_list(buf, last)
        return self._stream_named(buf, last)

    def _open_named(self, buf: str) -> ReplyDelta | None:
        """`name[ARGS]{` or `name{` read: the call's entry, its arguments so far; None before, or where it is not."""
        brace = buf.find("{")
        if brace < 0:
            return None
        mark = buf.find(self.ARGS)
        if 0 <= mark < brace:
            name, at = buf[:mark], mark + len(self.ARGS)
            if buf[at:brace].strip():
                return None
        else:
            name = buf[:brace]
        name = name.strip()
        if not self._NAME.fullmatch(name):
            return None
        self._args, self._at, self._seen = JsonText(), brace, len(buf)
        entry = self._call(name, self._args.feed(buf[brace:]))
        self._index = entry["index"]
        return ReplyDelta(calls=[entry])

    def _stream_named(self, buf: str, last: bool) -> ReplyDelta | None:
        args = self._args
        assert args is not None
        got = self._partial(buf)
        if args.stop is None and len(buf) > self._seen:
            delta, self._seen = args.feed(buf[self._seen:]), len(buf)
            if delta:
                got.add(ReplyDelta(calls=[{"index": self._index, "function": {"arguments": delta}}]))
        if args.stop is None and not last:
            self._early = got
            return None
        rest = buf[self._at + args.stop:] if args.stop is not None else ""  # (what follows: content, or a mark)
        self._args, self._inside, self._buf = None, False, rest
        return got

    def _stream_list(self, buf: str, last: bool) -> ReplyDelta | None:
        lst = self._list
        assert lst is not None
        got = self._partial(buf).add(ReplyDelta(calls=lst.feed(self, buf[self._at:])))
        if not lst.stopped and not last:
            self._early = got
            return None
        if self.calls == self._before:  # no call in it (not a list of calls): read at the end
            self._list, self._later = None, True
            return None
        at = lst.text_from
        rest = buf[self._at:][at:] if at is not None else ""  # (else a call was cut)
        rest = rest.lstrip()
        self._list, self._inside, self._buf = None, False, rest[1:] if rest.startswith("]") else rest
        return got

    def _read(self, part: str) -> tuple[list[Call] | None, str]:
        """The calls the text after a mark opens with (None: it is no calls), and the text after their JSON."""
        if part.startswith("["):
            value, rest = _json_head(part)
            return as_calls(value), rest
        brace, mark = part.find("{"), part.find(self.ARGS)
        if mark >= 0 and (brace < 0 or mark < brace):
            name, args = part[:mark], part[mark + len(self.ARGS):]
        elif brace > 0:
            name, args = part[:brace], part[brace:]
        else:
            return None, ""
        value, rest = _json_head(args.strip())
        call = as_call({"name": name.strip(), "arguments": value}) if isinstance(value, (dict, str)) else None
        return ([call] if call is not None else None), rest


def _json_head(text: str) -> tuple[Any, str]:
    """The JSON value `text` opens with (None where it does not; Python's True, False and None as `_json` reads
    them) and the text after it."""
    try:
        value, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        value, at = _pythonic_head(text)
        return (None, "") if at is None else (value, text[at:])
    return value, text[end:]


class CallList:
    """Calls written as JSON objects one after another, with only whitespace and `seps` between them, streamed
    (an `ObjectCall` each; one not sent before its text ended is read whole there); `stopped` where the text goes
    on with something else (the list's end, or text that is no call). `feed` takes all the text so far."""

    def __init__(self, keys: tuple[str, ...], seps: str, bare: bool = True) -> None:
        self.keys, self.seps, self.bare = keys, seps, bare  # (bare: `as_call`'s)
        self.pos = 0  # where the next object (or the open one) starts
        self.open: ObjectCall | None = None
        self.stopped = False

    def feed(self, reader: "ToolCallReader", text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while not self.stopped:
            if self.open is None:
                i = self.pos
                while i < len(text) and (text[i].isspace() or text[i] in self.seps):
                    i += 1
                self.pos = i
                if i == len(text):
                    break
                if text[i] != "{":
                    self.stopped = True
                    break
                self.open = ObjectCall(self.keys)
            out.extend(self.open.feed(reader, text[self.pos:]))  # (its arguments end where they close)
            if self.open.after is None:  # the object goes on
                break
            value, rest = _json_head(text[self.pos:])
            if value is None:  # it broke off: no more calls (one sent stays, cut)
                self.stopped = True
                break
            end = len(text) - len(rest)
            if not self.open.sent:
                call = as_call(value, self.keys, self.bare)
                if call is None:
                    self.stopped = True
                    break
                out.append(reader._call(*call))
            self.open, self.pos = None, end
        return out

    @property
    def rest_is_text(self) -> bool:
        """Whether the text from `pos` on is no call's (else it is a call's, sent and cut)."""
        return self.open is None or not self.open.sent

    @property
    def text_from(self) -> int | None:
        """Where the text after the calls starts: `pos` where it is no call's; where a sent call's JSON broke off
        (its text from there on is no call's: content, as a named call's); None where a call was cut by the text's
        end."""
        if self.rest_is_text:
            return self.pos
        assert self.open is not None
        return None if self.open.after is None else self.pos + self.open.after


class Llama3JsonReader(ToolCallReader):
    """A reply that opens (after whitespace, and an optional `<|python_tag|>`) with `{` is calls: JSON objects
    `{"name", "parameters"}` separated by `;`, each streamed as it is written (`CallList`), and any text after
    them content; any other reply is content, streamed at once. A reply whose first object is no call (one without
    its arguments too: a JSON answer with a "name", as vLLM reads it) is all content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # "text" or "calls", once the reply's start says
        self._body = 0  # where in the reply the calls start
        self._list = CallList(("arguments", "parameters"), ";", bare=False)  # (a JSON answer may have a "name")

    def feed(self, text: str) -> ReplyDelta:
        if self._mode == "text":
            return ReplyDelta(content=text)
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return ReplyDelta()
            if head.startswith((self.TAG, "{")):
                self._mode = "calls"
                self._body = len(self._buf) - len(head) + (len(self.TAG) if head.startswith(self.TAG) else 0)
            else:
                self._mode, out, self._buf = "text", self._buf, ""
                return ReplyDelta(content=out)
        return ReplyDelta(calls=self._list.feed(self, self._buf[self._body:]))

    def end(self) -> ReplyDelta:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return ReplyDelta(content=buf)
        if not self.calls:  # its first object is no call (or not whole)
            return ReplyDelta(content=buf)
        at = self._list.text_from
        rest = buf[self._body:][at:] if at is not None else ""  # (else a call was cut)
        out, self._ws = ReplyDelta(content=self._content(rest)), ""
        return out


class NamedToolReader(ToolCallReader):
    """tool_choice naming a tool: the reply is that call's arguments (a JSON value of its parameters), streamed as
    they come, without the whitespace around them (as read whole); read whole, a reply its cap cut (not JSON)
    stays text."""

    as_calls = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._space = ""  # whitespace held until text that is not says it is inside the arguments

    def feed(self, text: str) -> ReplyDelta:
        if not self.calls:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text if self.calls else ""
            return ReplyDelta()
        text, self._space = self._space + body, text[len(body):]
        if self.calls:
            return ReplyDelta(calls=[{"index": 0, "function": {"arguments": text}}])
        return ReplyDelta(calls=[self._call(self.name, text)])

    def end(self) -> ReplyDelta:
        return ReplyDelta()

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        try:
            _DECODER.decode(text)
        except (ValueError, RecursionError):
            return text, []
        return None, [merge_calls([self._call(self.name, text.strip())])[0]]


class RequiredToolReader(ToolCallReader):
    """tool_choice "required": the reply is a JSON list of calls (`{"name", "parameters"}`), each streamed as it is
    written (`CallList`); a reply with none (its cap cut the first) stays text."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._start: int | None = None  # where the list's items start (-1: the reply is no list)
        self._list = CallList(("parameters",), ",")

    def feed(self, text: str) -> ReplyDelta:
        self._buf += text
        if self._start is None:
            head = self._buf.lstrip()
            if not head:
                return ReplyDelta()
            self._start = len(self._buf) - len(head) + 1 if head[0] == "[" else -1
        if self._start < 0:
            return ReplyDelta()
        return ReplyDelta(calls=self._list.feed(self, self._buf[self._start:]))

    def end(self) -> ReplyDelta:
        buf, self._buf = self._buf, ""
        return ReplyDelta() if self.calls else ReplyDelta(content=buf)


_FORMATS: dict[str, type[ToolCallReader]] = {"hermes": HermesReader, "qwen3_coder": Qwen3CoderReader,
                                             "llama3_json": Llama3JsonReader, "mistral": MistralReader}
assert tuple(_FORMATS) == PARSERS
KEEPS_SPECIAL_TOKENS = frozenset({"hermes", "qwen3_coder", "mistral"})  # formats whose marks may be special tokens


def _property_types(parameters: Any) -> dict[str, Any]:
    """A function's parameters by name, with the JSON type each one's schema names (None where it names none: a
    boolean schema, a schema without `type`)."""
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict):
        return {}
    return {p: s.get("type") if isinstance(s, dict) else None for p, s in props.items()}


def model_format_reader(parser: str, tools: list[dict[str, Any]] | None = None) -> ToolCallReader:
    """A reader of the model's own tool-call format (`PARSERS`), for tool_choice "auto"; `tools`: the request's
    function definitions (name, parameters), which qwen3_coder's values are typed by."""
    if parser == "qwen3_coder":
        types = {t.get("name"): _property_types(t.get("parameters")) for t in tools or () if isinstance(t, dict)}
        return Qwen3CoderReader(types)
    return _FORMATS[parser]()
