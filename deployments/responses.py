"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it) over the chat path: a request is read as the chat
completion it amounts to (`chat_request`), and the chat's answer is written back as a response (`response_object`)
or, streamed, as the Responses API's typed events (`ResponseEvents`).

What a request may hold: `input` (a text, or a list of items: messages, whose content is a text or a list of text
parts; an earlier turn's `function_call`s and their `function_call_output`s; `reasoning` items, the thinking of the
assistant turn they precede),
`instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, `stream`, function `tools`,
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object or json_schema), and the chat's own extras
(SLO fields, vLLM's sampling fields). Nothing is stored: `previous_response_id` and `background` are a 400, and
`store` is read as false. A response's output is its reasoning (a `reasoning` item, where the app reads it), its
text (a `message` item) and its tool calls (`function_call` items); a reply its cap cut is `incomplete`
(`max_output_tokens`), and so is the item the cap cut. Streamed, items go out one after another, each done before
the next is added (parallel tool calls too).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

# the request's own fields, read here; the rest goes to the chat request as it is (SLOs, vLLM's sampling fields)
_OWN = frozenset(("input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "store", "reasoning",
                  "truncation", "include", "metadata", "user", "previous_response_id", "background", "prompt",
                  "service_tier", "top_logprobs", "prompt_cache_key", "safety_identifier", "messages",
                  "max_tokens", "max_completion_tokens", "response_format", "n", "stream_options"))
# OpenAI's `include` values (only the text's logprobs, `LOGPROBS`, add anything here: the rest are of tools and inputs
# this server does not have)
_INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
               "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
               "web_search_call.action.sources", "web_search_call.results")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for the text's logprobs (with top_logprobs)


class ResponsesError(ValueError):
    """A request the Responses API cannot take here: its message names the field (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def chat_request(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses request (its parsed JSON body) as the chat completion request it amounts to, and what the
    response repeats of it (`echoed`); ResponsesError for what is not one this server takes."""
    if not isinstance(raw, dict):
        raise ResponsesError("input", "the request body must be a JSON object")
    for name in ("previous_response_id", "background", "conversation", "prompt"):
        if raw.get(name) not in (None, False):
            raise ResponsesError(name, "this server keeps no responses, conversations or prompts: send the whole "
                                 "conversation as `input`")
    messages: list[dict[str, Any]] = []
    if raw.get("instructions") is not None:
        if not isinstance(raw["instructions"], str):
            raise ResponsesError("instructions", "must be a string")
        messages.append({"role": "system", "content": raw["instructions"]})
    given = raw.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        messages.extend(_messages(given))
    else:
        raise ResponsesError("input", "must be a text or a non-empty list of input items")
    if len(messages) > 1 and messages[0]["role"] == messages[1]["role"] == "system" and raw.get("instructions"):
        # the instructions and the input's own system message: one, first (a template takes one system message)
        messages[:2] = [{"role": "system", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}]
    chat: dict[str, Any] = {k: v for k, v in raw.items() if k not in _OWN}
    chat["messages"] = messages
    if raw.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = raw["max_output_tokens"]
    tools = raw.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise ResponsesError("tools", "must be a list of function tools")
        chat["tools"] = [_tool(i, t) for i, t in enumerate(tools)]
    choice = raw.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif not isinstance(choice, str):
            raise ResponsesError("tool_choice", 'must be "auto", "none", "required" or {"type": "function", '
                                 '"name": ...}')
        chat["tool_choice"] = choice
    fmt = (raw.get("text") or {}).get("format") if isinstance(raw.get("text"), dict) else None
    if raw.get("text") is not None and not isinstance(raw["text"], dict):
        raise ResponsesError("text", 'must be an object, e.g. {"format": {"type": "json_object"}}')
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    include = raw.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise ResponsesError("include", "must be a list of strings")
    unknown = [x for x in include or () if x not in _INCLUDABLE]
    if unknown:
        raise ResponsesError("include", f"{json.dumps(unknown[0])[:60]} is not one of OpenAI's include values "
                             f"({', '.join(_INCLUDABLE)})")
    metadata = raw.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items())):
        raise ResponsesError("metadata", "must be an object of at most 16 string values (keys of at most 64 "
                             "characters, values of at most 512)")
    if raw.get("user") is not None and not isinstance(raw["user"], str):
        raise ResponsesError("user", "must be a string")
    if raw.get("truncation") not in (None, "auto", "disabled"):  # (auto: a prompt over the window is a 400 here)
        raise ResponsesError("truncation", f'must be "auto" or "disabled", got {json.dumps(raw["truncation"])[:40]}')
    top = raw.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise ResponsesError("top_logprobs", f"must be an integer in [0, 20], got {json.dumps(top)[:40]}")
    if LOGPROBS in (include or ()):  # the text's tokens' logprobs, each with its top_logprobs likeliest (vLLM's)
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # (the usage goes into the last event's response)
    reasoning = raw.get("reasoning")
    if reasoning is not None:  # (its effort, as the chat's reasoning_effort; its summary is not written here)
        if not isinstance(reasoning, dict):
            raise ResponsesError("reasoning", 'must be an object, e.g. {"effort": "low"}')
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    echoed = {"instructions": raw.get("instructions"), "max_output_tokens": raw.get("max_output_tokens"),
              "temperature": raw.get("temperature"), "top_p": raw.get("top_p"), "tools": tools or [],
              "tool_choice": raw.get("tool_choice", "auto"), "metadata": raw.get("metadata") or {},
              "parallel_tool_calls": raw.get("parallel_tool_calls", True), "user": raw.get("user"),
              "text": {"format": fmt or {"type": "text"}}, "reasoning": raw.get("reasoning"),
              "top_logprobs": top or 0, "truncation": raw.get("truncation") or "disabled"}
    return chat, echoed


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant message before it (one message per run of
    calls), its output is a tool message."""
    out: list[dict[str, Any]] = []
    thinking: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesError(where, "must be an input item (an object)")
        kind = item.get("type", "message")
        if kind == "reasoning":  # an earlier turn's thinking: its assistant turn's `reasoning_content` (vLLM's
            # reasoning), which a template shows where it shows thinking (e.g. within a tool-calling loop)
            thinking = _reasoning_text(item, where)
            continue
        given, thinking = thinking, None  # (a thinking a user's or a tool's turn follows is dropped)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesError(where, f"a message's role must be user, assistant, system or developer, got "
                                     f"{json.dumps(role)[:40]}")
            # (developer as it is: a template that does not name it reads it as the system's, merged with the
            # system messages first, `engine.inputs._as_template_reads`)
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            if role == "assistant" and given is not None:
                out[-1]["reasoning_content"] = given
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise ResponsesError(where, "a function_call needs its name and arguments (a JSON text)")
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex}"),
                    "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # (its text, then its calls: one assistant turn)
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if given is not None:
                out[-1].setdefault("reasoning_content", given)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise ResponsesError(where, "a function_call_output needs its call_id and output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise ResponsesError(where, f"input items of type {json.dumps(kind)[:40]} are not supported here (only "
                                 "message, function_call, function_call_output and reasoning)")
    if not out:
        raise ResponsesError("input", "holds no message")
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str | None:
    """A reasoning input item's text: its content's (reasoning_text parts), else its summary's; None if empty."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            text = _text(parts, f"{where}.{key}")
            if text:
                return text
    return None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a text, or its text parts joined (images and files are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(where, "must be a text or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise ResponsesError(f"{where}[{j}]", f"only text parts are supported here, got {json.dumps(kind)[:40]}")
        texts.append(part["text"])
    return "\n".join(texts)


# the chat's fields a Responses API request's own become (`chat_request`), as its errors name them back
_CHAT_FIELDS = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("reasoning_effort", "reasoning.effort"))
_TOOL_FIELD = re.compile(r"^tools\.(\d+)\.function\.")
_TOOL_IN_TEXT = re.compile(r"\btools\.(\d+)\.function\.")


def responses_param(param: str | None) -> str | None:
    """An error's `param` that names the chat's field as the Responses API request's field it came from."""
    if not param:
        return param
    if param == "messages" or param.startswith(("messages.", "messages[")):
        return "input"  # (its items are not the messages one for one: instructions come first)
    for chat, own in _CHAT_FIELDS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return own + param[len(chat):]
    return _TOOL_FIELD.sub(r"tools.\1.", param)


def responses_message(message: str) -> str:
    """An error's message with the chat's token cap named as the Responses API's."""
    message = message.replace("'max_tokens' or 'max_completion_tokens'", "'max_output_tokens'") \
        .replace("max_completion_tokens", "max_output_tokens").replace("reasoning_effort", "reasoning.effort")
    message = _TOOL_IN_TEXT.sub(r"tools.\1.", message)
    return message.replace("response_format.json_schema", "text.format").replace("response_format", "text.format") \
        .replace(" at json_schema.", " at text.format.")


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ResponsesError(f"tools[{i}]", f"only function tools are supported here, got {json.dumps(kind)[:40]}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _format(fmt: Any) -> dict[str, Any]:
    """`text.format` as the chat's response_format."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ResponsesError("text.format", 'must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         '"json_schema", "name": ..., "schema": {...}}')


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) token logprobs as the Responses API's (the same token, logprob, bytes and
    top_logprobs entries)."""
    return list(((choice.get("logprobs") or {}).get("content")) or ())


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(rid: str, model: str, echoed: dict[str, Any], output: list[dict[str, Any]], status: str,
                    usage: dict[str, Any] | None, created: int | None = None) -> dict[str, Any]:
    """A Response (OpenAI's object), `status` completed, incomplete (its cap: `max_output_tokens`), in_progress or
    failed."""
    u = usage or {}
    return {"id": rid, "object": "response", "created_at": created or int(time.time()), "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "previous_response_id": None, "store": False, "truncation": "disabled",
            **echoed,
            "usage": None if usage is None else {
                "input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
                "total_tokens": u.get("total_tokens", 0), "input_tokens_details": {
                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}}


def from_chat(rid: str, chat: dict[str, Any], echoed: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion (one choice) as a Response."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(message["content"], logprobs=_logprobs(choice)))
    for call in message.get("tool_calls") or ():
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    if status == "incomplete" and output:  # (the item its cap cut: a call's arguments may not even parse)
        output[-1]["status"] = "incomplete"
    return response_object(rid, chat.get("model", ""), echoed, output, status, chat.get("usage"), chat.get("created"))


class ResponseEvents:
    """A chat completion's SSE chunks (one choice) as the Responses API's stream: `response.created` and
    `response.in_progress`; per output item `response.output_item.added`, its deltas (`response.output_text.delta`
    in a content part, `response.reasoning_text.delta`, `response.function_call_arguments.delta`) and their
    `.done`s, `response.output_item.done`; then `response.completed` with the whole response (whose status says
    where its cap cut it: incomplete; vLLM's way, and the one the openai client's stream reader ends on). A failed
    chat stream ends with an `error` event and `response.failed`."""

    def __init__(self, rid: str, model: str, echoed: dict[str, Any]) -> None:
        self.rid, self.model, self.echoed = rid, model, echoed
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: dict[str, Any] | None = None  # the item being written: its kind, item and text so far
        self.calls: dict[int, dict[str, Any]] = {}  # the chat's call index -> its item (open ones)
        self.status = "completed"
        self.usage: dict[str, Any] | None = None
        self.started = False
        self.ended = False
        # logprobs of chunks with no text (held back while it might open a call, reasoning's): the next text's, as
        # the whole reply's message has every token's (`from_chat`)
        self.pending: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def _response(self, status: str) -> dict[str, Any]:
        return response_object(self.rid, self.model, self.echoed, list(self.output), status, self.usage,
                               self.created)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events a chat SSE chunk (one or more `data:` lines) makes."""
        out: list[bytes] = []
        for line in chunk.decode().split("\n"):
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.extend(self._finish())
                continue
            out.extend(self._chunk(json.loads(data)))
        return out

    def _start(self, c: dict[str, Any] | None = None) -> list[bytes]:
        self.started = True
        self.model = (c or {}).get("model") or self.model
        r = self._response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _chunk(self, c: dict[str, Any]) -> list[bytes]:
        out = [] if self.started else self._start(c)
        if "error" in c:
            out.extend(self._close("incomplete"))  # (what it wrote is cut)
            err = c["error"]
            self.ended = True
            out.append(self._event("error", code=err.get("code"), message=err.get("message"), param=err.get("param")))
            # (the response's error code is one of OpenAI's: the chat's own is in the `error` event)
            limited = "rate_limit" in f"{err.get('type')} {err.get('code')}"
            out.append(self._event("response.failed", response={**self._response("failed"), "error": {
                "code": "rate_limit_exceeded" if limited else "server_error", "message": err.get("message")}}))
            return out
        if c.get("usage") is not None:
            self.usage = c["usage"]
        for choice in c.get("choices") or ():
            delta = choice.get("delta") or {}
            # a chunk of merged deltas may end a call already open and go on with text after it (a stream whose
            # reader fell behind; a stop string held back): the open calls' rest first, so that the text does not
            # close them cut, and a call the chunk begins after its text
            entries = delta.get("tool_calls") or ()
            going_on = [e.get("index", 0) in self.calls for e in entries]
            for entry, on in zip(entries, going_on):
                if on:
                    out.extend(self._call(entry))
            if delta.get("reasoning_content"):
                out.extend(self._text("reasoning", delta["reasoning_content"]))
            lp = self.pending + (_logprobs(choice) or [])
            if delta.get("content"):  # (with its tokens' logprobs, where asked: the chunk's, and those held)
                self.pending = []
                out.extend(self._text("message", delta["content"], lp))
            else:
                self.pending = lp
            for entry, on in zip(entries, going_on):
                if not on:
                    out.extend(self._call(entry))
            if choice.get("finish_reason") is not None:
                if choice["finish_reason"] == "length":
                    self.status = "incomplete"
                out.extend(self._close(self.status))  # (incomplete: the item its cap cut)
        return out

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["kind"] != kind:
            out.extend(self._close())
            index = len(self.output)
            item = message_item("", "in_progress") if kind == "message" else reasoning_item("")
            if kind == "reasoning":
                item["status"] = "in_progress"
            else:  # (OpenAI's: the message's part comes with content_part.added, not with the item as well)
                item["content"] = []
            self.open = {"kind": kind, "item": item, "text": "", "index": index, "logprobs": []}
            out.append(self._event("response.output_item.added", output_index=index, item=item))
            if kind == "message":
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        o = self.open
        o["text"] += text
        o["logprobs"] += logprobs or []
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": logprobs or []} if kind == "message" else {}
        out.append(self._event(name, item_id=o["item"]["id"], output_index=o["index"], content_index=0, delta=text,
                               **extra))
        return out

    def _call(self, entry: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = entry.get("index", 0)
        fn = entry.get("function") or {}
        if index not in self.calls:  # a new call: what is open is done first (a call before it too)
            out.extend(self._close())
            item = call_item(entry.get("id") or _new_id("call"), fn.get("name", ""), "", "in_progress")
            self.calls[index] = {"item": item, "index": len(self.output) + len(self.calls)}
            out.append(self._event("response.output_item.added", output_index=self.calls[index]["index"],
                                   item=dict(item)))
        call = self.calls[index]
        if fn.get("arguments"):
            call["item"]["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=call["item"]["id"],
                                   output_index=call["index"], delta=fn["arguments"]))
        self.open = {"kind": "call"}
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        """The open item's (or calls') `.done` events, with `status` (incomplete: a failure cut it); it joins the
        output."""
        out: list[bytes] = []
        o, self.open = self.open, None
        if o is None:
            return out
        if o["kind"] == "call":
            for call in sorted(self.calls.values(), key=lambda c: c["index"]):
                item = {**call["item"], "status": status}
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=call["index"], arguments=item["arguments"]))
                out.append(self._event("response.output_item.done", output_index=call["index"], item=item))
                self.output.append(item)
            self.calls.clear()
            return out
        item_id, index, text = o["item"]["id"], o["index"], o["text"]
        if o["kind"] == "message":
            item = message_item(text, status, item_id=item_id, logprobs=o["logprobs"])
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item_id, output_index=index,
                                   content_index=0, text=text, logprobs=o["logprobs"]))
            out.append(self._event("response.content_part.done", item_id=item_id, output_index=index,
                                   content_index=0, part=part))
        else:
            item = {**reasoning_item(text, item_id=item_id), "status": status}
            out.append(self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                   content_index=0, text=text))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def _finish(self) -> list[bytes]:
        if self.ended:
            return []
        out = ([] if self.started else self._start()) + self._close()
        self.ended = True
        out.append(self._event("response.completed", response=self._response(self.status)))  # (incomplete: in it)
        return out
