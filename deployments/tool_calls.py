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
  "required" (`RequiredToolReader`: the reply is a JSON list of calls, read once whole).
A call whose JSON does not parse stays text, as vLLM's parsers leave it. Text between or after calls that is only
whitespace is dropped.
"""
from __future__ import annotations

import json
import re
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


def _arguments(value: Any) -> str:
    """A call's arguments as OpenAI's JSON text (a model may write them as an object or as text)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


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

    def __init__(self) -> None:
        self.calls = 0
        self._ws = ""  # whitespace after a call, held until text that is not says whether it is content

    def feed(self, text: str) -> ReplyDelta:
        raise NotImplementedError

    def end(self) -> ReplyDelta:
        raise NotImplementedError

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole reply's content (None where it is only whitespace beside calls) and its calls (each whole: no
        `index`)."""
        d = self.feed(text).add(self.end())
        return (d.content if d.content.strip() or not d.calls else None), merge_calls(d.calls)

    def _call(self, name: str, arguments: Any) -> dict[str, Any]:
        entry = {"index": self.calls, "id": call_id(), "type": "function",
                 "function": {"name": name, "arguments": _arguments(arguments)}}
        self.calls += 1
        return entry

    def _content(self, text: str) -> str:
        """Text as content: after a call, whitespace alone is held (and dropped at the end)."""
        if not self.calls:
            return text
        text = self._ws + text
        if not text.strip():
            self._ws = text
            return ""
        self._ws = ""
        return text

    def _calls(self, found: list[Call] | None) -> ReplyDelta | None:
        """The calls found, as entries (numbered on from those read before), or None where none parsed."""
        return ReplyDelta(calls=[self._call(*c) for c in found]) if found else None


Call = tuple[str, Any]  # a call's name and arguments


def as_call(value: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """A call from its JSON value: an object with a `name` and its arguments (an object, or their JSON text) under
    one of `keys` (none: no arguments), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = next((value[k] for k in keys if k in value), {})
    return (value["name"], args) if isinstance(args, (dict, str)) else None


def as_calls(values: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Call] | None:
    """Calls from a JSON list of them, else None (one that is not a call spoils the list)."""
    if not isinstance(values, list) or not values:
        return None
    calls = [as_call(v, keys) for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


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


class _MarkedReader(ToolCallReader):
    """Calls that open with a mark (`START`): text before it is content, held back only while it could be the
    mark's start; each call's text is read once whole (`_close` says where one ends)."""

    START = ""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> ReplyDelta:
        self._buf += text
        out = ReplyDelta()
        while True:
            if not self._inside:
                i = self._buf.find(self.START)
                if i < 0:
                    cut = len(self._buf) - held_back(self._buf, self.START)
                    out.content += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out.content += self._content(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(self.START):], True
            else:
                got = self._close(self._buf, False)
                if got is None:
                    return out
                out.add(got)

    def end(self) -> ReplyDelta:
        out = ReplyDelta()
        if self._inside:
            got = self._close(self._buf, True)
            if got is not None:
                out.add(got)
        if self._buf:  # a mark's start the reply ended on, or a call that did not parse
            out.content += self._content(self._buf)
            self._buf = ""
        self._ws = ""
        return out

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        """The calls read from `buf` (the text after a mark) once one is whole (`last`: the reply has ended), the
        reader's state moved past them; None while it is not."""
        raise NotImplementedError


class HermesReader(_MarkedReader):
    START, END = "<tool_call>", "</tool_call>"

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        j = buf.find(self.END)
        if j < 0 and not last:
            return None
        body, rest = (buf[:j], buf[j + len(self.END):]) if j >= 0 else (buf, "")
        self._inside, self._buf = False, rest
        call = self._call_of(body)
        if call is None:  # not a call: its text stays content
            return ReplyDelta(content=self._content(self.START + body + (self.END if j >= 0 else "")))
        return self._calls([call])

    def _call_of(self, body: str) -> Call | None:
        """The call a `<tool_call>`'s body holds (JSON: its name and arguments), else None."""
        return as_call(_json(body))


class Qwen3CoderReader(HermesReader):
    """Qwen3-Coder's calls: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`;
    a value is its text (one newline either side dropped) where its tool's schema makes it a string (or says
    nothing and it is no JSON), else its JSON value."""

    FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.S)
    PARAMETER = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.S)

    def __init__(self, types: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.types = types or {}  # tool name -> parameter name -> its schema's type

    def _call_of(self, body: str) -> Call | None:
        m = self.FUNCTION.match(body)
        if m is None:
            return None
        name, types = m.group(1), self.types.get(m.group(1), {})
        return name, {p.strip(): self._value(v, types.get(p.strip())) for p, v in self.PARAMETER.findall(m.group(2))}

    @staticmethod
    def _value(text: str, kind: Any) -> Any:
        text = text.removeprefix("\n").removesuffix("\n")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


class MistralReader(_MarkedReader):
    """`[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` (also `name{...}`), each call after a mark of
    its own; read at the reply's end."""

    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def _close(self, buf: str, last: bool) -> ReplyDelta | None:
        if not last:
            return None
        self._inside, found = False, []
        for part in buf.split(self.START):
            calls = self._read(part.strip())
            if calls is None:  # not calls: the text stays content
                self._buf = self.START + buf
                return None
            found.extend(calls)
        self._buf = ""
        return self._calls(found)

    def _read(self, part: str) -> list[Call] | None:
        if part.startswith("["):
            return as_calls(_json(part))
        name, sep, args = part.partition(self.ARGS)
        if not sep:
            i = part.find("{")
            name, args = (part[:i], part[i:]) if i > 0 else ("", "")
        value = _json(args)
        return [(name.strip(), value)] if name.strip() and isinstance(value, (dict, str)) else None


class Llama3JsonReader(ToolCallReader):
    """A reply that opens (after whitespace, and an optional `<|python_tag|>`) with `{` is calls, read at its end:
    JSON objects `{"name", "parameters"}` separated by `;`; any other reply is content, streamed at once."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # "text" or "calls", once the reply's start says

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
            else:
                self._mode, out, self._buf = "text", self._buf, ""
                return ReplyDelta(content=out)
        return ReplyDelta()

    def end(self) -> ReplyDelta:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return ReplyDelta(content=buf)
        body = buf.lstrip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        decoder, found, i = json.JSONDecoder(), [], 0
        while found is not None:
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
            if i == len(body):
                break
            try:
                value, i = decoder.raw_decode(body, i)
            except ValueError:
                found = None
                break
            call = as_call(value)
            found = None if call is None else found + [call]
        return self._calls(found) or ReplyDelta(content=buf)


class NamedToolReader(ToolCallReader):
    """tool_choice naming a tool: the reply is that call's arguments (a JSON value of its parameters), streamed as
    they come; read whole, a reply its cap cut (not JSON) stays text."""

    as_calls = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ReplyDelta:
        if not text:
            return ReplyDelta()
        if self.calls:
            return ReplyDelta(calls=[{"index": 0, "function": {"arguments": text}}])
        return ReplyDelta(calls=[self._call(self.name, text)])

    def end(self) -> ReplyDelta:
        return ReplyDelta()

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [merge_calls([self._call(self.name, text.strip())])[0]]


class RequiredToolReader(ToolCallReader):
    """tool_choice "required": the reply is a JSON list of calls (`{"name", "parameters"}`), read at its end; one
    that is not (its cap cut it) stays text."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""

    def feed(self, text: str) -> ReplyDelta:
        self._buf += text
        return ReplyDelta()

    def end(self) -> ReplyDelta:
        buf, self._buf = self._buf, ""
        return self._calls(as_calls(_json(buf), ("parameters",))) or ReplyDelta(content=buf)


_FORMATS: dict[str, type[ToolCallReader]] = {"hermes": HermesReader, "qwen3_coder": Qwen3CoderReader,
                                             "llama3_json": Llama3JsonReader, "mistral": MistralReader}
assert tuple(_FORMATS) == PARSERS
KEEPS_SPECIAL_TOKENS = frozenset({"hermes", "qwen3_coder", "mistral"})  # formats whose marks may be special tokens


def model_format_reader(parser: str, tools: list[dict[str, Any]] | None = None) -> ToolCallReader:
    """A reader of the model's own tool-call format (`PARSERS`), for tool_choice "auto"; `tools`: the request's
    function definitions (name, parameters), which qwen3_coder's values are typed by."""
    if parser == "qwen3_coder":
        types = {t.get("name"): {p: (s or {}).get("type") for p, s in
                                 ((t.get("parameters") or {}).get("properties") or {}).items()}
                 for t in tools or () if isinstance(t, dict)}
        return Qwen3CoderReader(types)
    return _FORMATS[parser]()
