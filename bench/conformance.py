"""Kairos against vLLM's OpenAI server, request by request: the same requests to both, and where they answer
differently (bench/README.md).

    python -m bench.conformance --kairos http://127.0.0.1:8000 --vllm http://127.0.0.1:8011 [--only NAME ...]

Both serve the same checkpoint under one name (`--model`, default kairos-default): `serve run deployments:app` and
`python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name kairos-default`. Each case is sent to
both; compared are the status, an error's `param` (its `type` and `message` are printed), a reply's shape (its keys,
recursively, and the types of their values) and, for greedy cases, its text. A stream's chunks are compared by the
shape of the first, the last with choices and the usage chunk, and the text they make. Differences are printed, a
line each; `--json FILE` writes them. Some differences are Kairos's on purpose (API.md says which): read each.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from bench.driver import SSE_DONE, sse_data

MODEL = "kairos-default"


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # a dict/list sent as JSON, bytes sent as they are, None: a GET
    headers: dict[str, str] = field(default_factory=dict)
    greedy: bool = False  # the text should match


@dataclass
class Answer:
    status: int
    body: Any  # parsed JSON, or a list of SSE data items, or the raw text
    stream: bool = False


def send(url: str, c: Case, timeout: float = 120.0) -> Answer:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"Content-Type": "application/json", **c.headers}
    if c.body is None:
        conn.request("GET", c.path, headers={k: v for k, v in headers.items() if k != "Content-Type"})
    else:
        raw = c.body if isinstance(c.body, bytes) else json.dumps(c.body).encode()
        conn.request("POST", c.path, body=raw, headers=headers)
    r = conn.getresponse()
    text = r.read().decode("utf-8", "replace")
    conn.close()
    if "text/event-stream" in (r.getheader("Content-Type") or ""):
        return Answer(r.status, [x for x in map(sse_data, text.splitlines()) if x is not None], stream=True)
    return Answer(r.status, _json(text))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


VOLATILE = {"id", "created", "system_fingerprint", "root", "parent", "owned_by", "permission", "max_model_len",
            "version", "service_tier", "kv_transfer_params"}


def shape(v: Any, depth: int = 0) -> Any:
    """The keys and value types of a JSON value (lists by their first item)."""
    if isinstance(v, dict):
        return {k: shape(x, depth + 1) for k, x in sorted(v.items()) if k not in VOLATILE or depth > 6}
    if isinstance(v, list):
        return [shape(v[0], depth + 1)] if v else []
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "num"
    return type(v).__name__


def shape_diff(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a and b[k] in ("NoneType", [], ["NoneType"]) or k not in b and a[k] == "NoneType":
                continue  # a null (or empty) field one side leaves out
            if k not in a:
                out.append(f"{where}.{k}: vLLM only ({json.dumps(b[k])[:60]})")
            elif k not in b:
                out.append(f"{where}.{k}: Kairos only ({json.dumps(a[k])[:60]})")
            else:
                out += shape_diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        return shape_diff(a[0], b[0], f"{where}[0]") if a and b else []
    return [f"{where}: Kairos {a}, vLLM {b}"] if a != b else []


def error_of(a: Answer) -> dict[str, Any]:
    if isinstance(a.body, dict):
        e = a.body.get("error", a.body)
        return e if isinstance(e, dict) else {"message": str(e)}
    return {"message": str(a.body)[:200]}


def texts(a: Answer) -> list[str]:
    if a.stream:
        acc: dict[int, str] = {}
        for it in a.body:
            if isinstance(it, dict):
                for ch in it.get("choices") or []:
                    d = ch.get("delta") or {}
                    acc[ch.get("index", 0)] = acc.get(ch.get("index", 0), "") + (ch.get("text") or d.get("content")
                                                                                 or "")
        return [acc[i] for i in sorted(acc)]
    if isinstance(a.body, dict):
        out = []
        for ch in a.body.get("choices") or []:
            out.append(ch.get("text") if "text" in ch else (ch.get("message") or {}).get("content"))
        return out
    return []


def calls(a: Answer) -> list[list[tuple[str, Any]]]:
    """Each choice's tool calls (name, arguments parsed where they are JSON), streamed ones put together."""
    def parsed(args: str) -> Any:
        try:
            return json.loads(args)
        except ValueError:
            return args
    got: dict[int, dict[int, list[str]]] = {}
    if a.stream:
        for it in a.body:
            for ch in (it.get("choices") or []) if isinstance(it, dict) else []:
                for tc in (ch.get("delta") or {}).get("tool_calls") or []:
                    one = got.setdefault(ch.get("index", 0), {}).setdefault(tc.get("index", 0), ["", ""])
                    fn = tc.get("function") or {}
                    one[0] += fn.get("name") or ""
                    one[1] += fn.get("arguments") or ""
    elif isinstance(a.body, dict):
        for ch in a.body.get("choices") or []:
            for j, tc in enumerate((ch.get("message") or {}).get("tool_calls") or []):
                fn = tc.get("function") or {}
                got.setdefault(ch.get("index", 0), {})[j] = [fn.get("name") or "", fn.get("arguments") or ""]
    return [[(n, parsed(x)) for _, (n, x) in sorted(got[i].items())] for i in sorted(got)]


def stream_parts(a: Answer) -> dict[str, Any]:
    items = [x for x in a.body if isinstance(x, dict)]
    with_choices = [x for x in items if x.get("choices")]
    usage = [x for x in items if x.get("usage")]
    return {"first": shape(with_choices[0]) if with_choices else None,
            "last": shape(with_choices[-1]) if with_choices else None,
            "usage": shape(usage[-1]) if usage else None,
            "done": bool(a.body) and a.body[-1] == SSE_DONE,
            "finish": [ch.get("finish_reason") for x in with_choices for ch in x["choices"] if ch.get("finish_reason")]}


def compare(c: Case, k: Answer, v: Answer) -> list[str]:
    out: list[str] = []
    if k.status != v.status:
        out.append(f"status: Kairos {k.status} ({error_of(k).get('message', '')[:140]!r}), vLLM {v.status} "
                   f"({error_of(v).get('message', '')[:140]!r})")
        return out
    if k.status >= 400:
        ek, ev = error_of(k), error_of(v)
        if ek.get("param") != ev.get("param"):
            out.append(f"error param: Kairos {ek.get('param')!r}, vLLM {ev.get('param')!r} "
                       f"(vLLM: {ev.get('message', '')[:120]!r})")
        return out
    if k.stream != v.stream:
        return [f"stream: Kairos {k.stream}, vLLM {v.stream}"]
    if k.stream:
        pk, pv = stream_parts(k), stream_parts(v)
        for part in ("first", "last", "usage"):
            if pk[part] is None or pv[part] is None:
                if (pk[part] is None) != (pv[part] is None):
                    out.append(f"stream {part}: Kairos {pk[part] is not None}, vLLM {pv[part] is not None}")
            else:
                out += [f"stream {part}{d}" for d in shape_diff(pk[part], pv[part])]
        if pk["done"] != pv["done"]:
            out.append(f"[DONE]: Kairos {pk['done']}, vLLM {pv['done']}")
        if pk["finish"] != pv["finish"]:
            out.append(f"finish reasons: Kairos {pk['finish']}, vLLM {pv['finish']}")
    else:
        out += shape_diff(shape(k.body), shape(v.body))
        if isinstance(k.body, dict) and isinstance(v.body, dict):
            fk = [ch.get("finish_reason") for ch in k.body.get("choices") or []]
            fv = [ch.get("finish_reason") for ch in v.body.get("choices") or []]
            if fk != fv:
                out.append(f"finish reasons: Kairos {fk}, vLLM {fv}")
    if calls(k) != calls(v):
        out.append(f"tool calls: Kairos {calls(k)}, vLLM {calls(v)}"[:400])
    if c.greedy and texts(k) != texts(v):
        cut = [[t[:50] if t else t for t in texts(a)] for a in (k, v)]
        out.append(f"text: Kairos {cut[0]}, vLLM {cut[1]}")
    return out


def cases(m: str) -> list[Case]:
    C, CH = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Name three colors."}]
    g = {"temperature": 0}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}
    return [
        # completions
        Case("cmpl greedy", C, {"model": m, "prompt": "The capital of France is", "max_tokens": 12, **g}, greedy=True),
        Case("cmpl token ids", C, {"model": m, "prompt": [504, 3575, 282, 4649, 314], "max_tokens": 8, **g},
             greedy=True),
        Case("cmpl batch", C, {"model": m, "prompt": ["One", "Two"], "max_tokens": 6, **g}, greedy=True),
        Case("cmpl batch of ids", C, {"model": m, "prompt": [[504, 3575], [282, 4649]], "max_tokens": 6, **g},
             greedy=True),
        Case("cmpl echo", C, {"model": m, "prompt": "Hello there", "max_tokens": 5, "echo": True, **g}, greedy=True),
        Case("cmpl logprobs", C, {"model": m, "prompt": "Hello", "max_tokens": 4, "logprobs": 2, **g}, greedy=True),
        Case("cmpl echo logprobs", C, {"model": m, "prompt": "Hello there", "max_tokens": 2, "logprobs": 1,
                                       "echo": True, **g}, greedy=True),
        Case("cmpl n=2 seed", C, {"model": m, "prompt": "Hi", "max_tokens": 5, "n": 2, "seed": 1}),
        Case("cmpl stop", C, {"model": m, "prompt": "1, 2, 3,", "max_tokens": 20, "stop": [","], **g}, greedy=True),
        Case("cmpl stop incl", C, {"model": m, "prompt": "1, 2, 3,", "max_tokens": 20, "stop": ",",
                                   "include_stop_str_in_output": True, **g}, greedy=True),
        Case("cmpl stream", C, {"model": m, "prompt": "Hello", "max_tokens": 6, "stream": True, **g}, greedy=True),
        Case("cmpl stream usage", C, {"model": m, "prompt": "Hello", "max_tokens": 6, "stream": True,
                                      "stream_options": {"include_usage": True}, **g}, greedy=True),
        Case("cmpl stream cont usage", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stream": True,
                                           "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}, **g}),
        Case("cmpl stream n=2", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stream": True, "n": 2}),
        Case("cmpl stream echo", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stream": True, "echo": True,
                                     **g}, greedy=True),
        Case("cmpl max_tokens 0", C, {"model": m, "prompt": "Hello", "max_tokens": 0}),
        Case("cmpl max_tokens -1", C, {"model": m, "prompt": "Hello", "max_tokens": -1}),
        Case("cmpl max_tokens null", C, {"model": m, "prompt": "Hello", "max_tokens": None, **g}),
        Case("cmpl max_tokens str", C, {"model": m, "prompt": "Hello", "max_tokens": "5", **g}),
        Case("cmpl max_tokens float", C, {"model": m, "prompt": "Hello", "max_tokens": 5.0, **g}),
        Case("cmpl max_tokens 5.5", C, {"model": m, "prompt": "Hello", "max_tokens": 5.5}),
        Case("cmpl huge max_tokens", C, {"model": m, "prompt": "Hello", "max_tokens": 10 ** 6}),
        Case("cmpl empty prompt", C, {"model": m, "prompt": "", "max_tokens": 3}),
        Case("cmpl empty list", C, {"model": m, "prompt": [], "max_tokens": 3}),
        Case("cmpl no prompt", C, {"model": m, "max_tokens": 3}),
        Case("cmpl prompt null", C, {"model": m, "prompt": None, "max_tokens": 3}),
        Case("cmpl prompt int", C, {"model": m, "prompt": 5, "max_tokens": 3}),
        Case("cmpl bad token id", C, {"model": m, "prompt": [10 ** 7], "max_tokens": 3}),
        Case("cmpl negative token id", C, {"model": m, "prompt": [-1], "max_tokens": 3}),
        Case("cmpl long prompt", C, {"model": m, "prompt": "word " * 5000, "max_tokens": 3}),
        Case("cmpl no model", C, {"prompt": "Hello", "max_tokens": 3, **g}, greedy=True),
        Case("cmpl unknown model", C, {"model": "nope", "prompt": "Hello", "max_tokens": 3}),
        Case("cmpl temperature -1", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "temperature": -1}),
        Case("cmpl temperature 3", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "temperature": 3}),
        Case("cmpl top_p 1.5", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "top_p": 1.5}),
        Case("cmpl top_p 0", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "top_p": 0}),
        Case("cmpl top_k 0", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "top_k": 0, **g}),
        Case("cmpl top_k -1", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "top_k": -1, **g}),
        Case("cmpl top_k -2", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "top_k": -2}),
        Case("cmpl min_p 2", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "min_p": 2}),
        Case("cmpl n 0", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "n": 0}),
        Case("cmpl n 1.5", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "n": 1.5}),
        Case("cmpl best_of<n", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "n": 2, "best_of": 1}),
        Case("cmpl best_of", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "n": 1, "best_of": 2}),
        Case("cmpl logprobs 21", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "logprobs": 21}),
        Case("cmpl logprobs -1", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "logprobs": -1}),
        Case("cmpl logit_bias", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "logit_bias": {"30": 100}, **g},
             greedy=True),
        Case("cmpl logit_bias bad key", C, {"model": m, "prompt": "Hello", "max_tokens": 3,
                                            "logit_bias": {"x": 1}}),
        Case("cmpl logit_bias 200", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "logit_bias": {"30": 200}}),
        Case("cmpl logit_bias big id", C, {"model": m, "prompt": "Hello", "max_tokens": 3,
                                           "logit_bias": {"9999999": 1}}),
        Case("cmpl freq pen 3", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "frequency_penalty": 3}),
        Case("cmpl rep pen 0", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "repetition_penalty": 0}),
        Case("cmpl seed neg", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "seed": -5}),
        Case("cmpl seed huge", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "seed": 2 ** 70}),
        Case("cmpl stop 5 strings", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stop": list("abcde"), **g}),
        Case("cmpl stop empty str", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stop": [""]}),
        Case("cmpl stop_token_ids", C, {"model": m, "prompt": "Hello", "max_tokens": 8, "stop_token_ids": [28],
                                        **g}, greedy=True),
        Case("cmpl min_tokens>max", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "min_tokens": 5}),
        Case("cmpl min_tokens", C, {"model": m, "prompt": "Hello", "max_tokens": 8, "min_tokens": 8,
                                    "stop": ["."], **g}, greedy=True),
        Case("cmpl ignore_eos", C, {"model": m, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True, **g},
             greedy=True),
        Case("cmpl suffix", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "suffix": "x"}),
        Case("cmpl user", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "user": "u1", **g}, greedy=True),
        Case("cmpl unknown field", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "frobnicate": 1, **g}),
        Case("cmpl stream bool str", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stream": "yes"}),
        Case("cmpl truncate", C, {"model": m, "prompt": "a b c d e f g", "max_tokens": 3,
                                  "truncate_prompt_tokens": 2, **g}, greedy=True),
        Case("cmpl prompt_logprobs", C, {"model": m, "prompt": "Hello there", "max_tokens": 1,
                                         "prompt_logprobs": 1, **g}, greedy=True),
        Case("cmpl guided_choice", C, {"model": m, "prompt": "Yes or no?", "max_tokens": 5,
                                       "guided_choice": ["yes", "no"], **g}, greedy=True),
        Case("cmpl structured regex", C, {"model": m, "prompt": "A number:", "max_tokens": 5,
                                          "structured_outputs": {"regex": "[0-9]{3}"}, **g}, greedy=True),
        Case("cmpl response_format json", C, {"model": m, "prompt": "JSON:", "max_tokens": 10,
                                              "response_format": {"type": "json_object"}, **g}),
        Case("cmpl return_token_ids", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "return_token_ids": True,
                                          **g}),
        Case("cmpl priority 1", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "priority": 1}),
        Case("cmpl request_id", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "request_id": "abc", **g}),
        # chat
        Case("chat greedy", CH, {"model": m, "messages": msgs, "max_tokens": 16, **g}, greedy=True),
        Case("chat no max", CH, {"model": m, "messages": msgs, **g}, greedy=True),
        Case("chat max_completion_tokens", CH, {"model": m, "messages": msgs, "max_completion_tokens": 5, **g},
             greedy=True),
        Case("chat system", CH, {"model": m, "messages": [{"role": "system", "content": "Be brief."}, *msgs],
                                 "max_tokens": 10, **g}, greedy=True),
        Case("chat developer role", CH, {"model": m, "messages": [{"role": "developer", "content": "Be brief."},
                                                                  *msgs], "max_tokens": 10, **g}, greedy=True),
        Case("chat content parts", CH, {"model": m, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Name three colors."}]}], "max_tokens": 10, **g}, greedy=True),
        Case("chat image part", CH, {"model": m, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 3}),
        Case("chat assistant null", CH, {"model": m, "messages": [*msgs, {"role": "assistant", "content": None},
                                                                  {"role": "user", "content": "More"}],
                                         "max_tokens": 5, **g}),
        Case("chat name field", CH, {"model": m, "messages": [{"role": "user", "content": "Hi", "name": "bob"}],
                                     "max_tokens": 5, **g}, greedy=True),
        Case("chat empty messages", CH, {"model": m, "messages": [], "max_tokens": 3}),
        Case("chat no messages", CH, {"model": m, "max_tokens": 3}),
        Case("chat bad role", CH, {"model": m, "messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 3}),
        Case("chat no content", CH, {"model": m, "messages": [{"role": "user"}], "max_tokens": 3}),
        Case("chat content int", CH, {"model": m, "messages": [{"role": "user", "content": 5}], "max_tokens": 3}),
        Case("chat messages str", CH, {"model": m, "messages": "Hi", "max_tokens": 3}),
        Case("chat n=2", CH, {"model": m, "messages": msgs, "max_tokens": 5, "n": 2, "seed": 3}),
        Case("chat stream", CH, {"model": m, "messages": msgs, "max_tokens": 8, "stream": True, **g}, greedy=True),
        Case("chat stream usage", CH, {"model": m, "messages": msgs, "max_tokens": 8, "stream": True,
                                       "stream_options": {"include_usage": True}, **g}, greedy=True),
        Case("chat stream n=2", CH, {"model": m, "messages": msgs, "max_tokens": 3, "stream": True, "n": 2}),
        Case("chat stream logprobs", CH, {"model": m, "messages": msgs, "max_tokens": 3, "stream": True,
                                          "logprobs": True, "top_logprobs": 2, **g}, greedy=True),
        Case("chat logprobs", CH, {"model": m, "messages": msgs, "max_tokens": 4, "logprobs": True,
                                   "top_logprobs": 2, **g}, greedy=True),
        Case("chat logprobs false top", CH, {"model": m, "messages": msgs, "max_tokens": 4, "top_logprobs": 2}),
        Case("chat top_logprobs 21", CH, {"model": m, "messages": msgs, "max_tokens": 4, "logprobs": True,
                                          "top_logprobs": 21}),
        Case("chat json_object", CH, {"model": m, "messages": msgs, "max_tokens": 20,
                                      "response_format": {"type": "json_object"}, **g}),
        Case("chat json_schema", CH, {"model": m, "messages": msgs, "max_tokens": 30, "response_format": {
            "type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}}}, **g}),
        Case("chat json_schema no schema", CH, {"model": m, "messages": msgs, "max_tokens": 5, "response_format": {
            "type": "json_schema", "json_schema": {"name": "c"}}}),
        Case("chat response_format bad", CH, {"model": m, "messages": msgs, "max_tokens": 5,
                                              "response_format": {"type": "xml"}}),
        Case("chat tools none", CH, {"model": m, "messages": msgs, "max_tokens": 8, "tools": [tool],
                                     "tool_choice": "none", **g}, greedy=True),
        Case("chat tools named", CH, {"model": m, "messages": msgs, "max_tokens": 30, "tools": [tool],
                                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, **g}),
        Case("chat tools named missing", CH, {"model": m, "messages": msgs, "max_tokens": 8, "tools": [tool],
                                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        Case("chat tool_choice no tools", CH, {"model": m, "messages": msgs, "max_tokens": 8,
                                               "tool_choice": "required"}),
        Case("chat tools required", CH, {"model": m, "messages": msgs, "max_tokens": 40, "tools": [tool],
                                         "tool_choice": "required", **g}),
        Case("chat tool msgs", CH, {"model": m, "messages": [
            *msgs, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "max_tokens": 8, **g}, greedy=True),
        Case("chat echo", CH, {"model": m, "messages": [*msgs, {"role": "assistant", "content": "Red,"}],
                               "echo": True, "max_tokens": 5, "add_generation_prompt": False,
                               "continue_final_message": True, **g}, greedy=True),
        Case("chat continue+add_gen", CH, {"model": m, "messages": [*msgs, {"role": "assistant", "content": "R"}],
                                           "max_tokens": 5, "add_generation_prompt": True,
                                           "continue_final_message": True}),
        Case("chat stop", CH, {"model": m, "messages": msgs, "max_tokens": 20, "stop": ["e"], **g}, greedy=True),
        Case("chat best_of", CH, {"model": m, "messages": msgs, "max_tokens": 3, "best_of": 2}),
        Case("chat parallel_tool_calls", CH, {"model": m, "messages": msgs, "max_tokens": 5,
                                              "parallel_tool_calls": False, **g}, greedy=True),
        Case("chat functions legacy", CH, {"model": m, "messages": msgs, "max_tokens": 5,
                                           "functions": [tool["function"]]}),
        Case("chat audio modality", CH, {"model": m, "messages": msgs, "max_tokens": 5, "modalities": ["audio"]}),
        Case("chat max_tokens window", CH, {"model": m, "messages": msgs, "max_tokens": 10 ** 6}),
        Case("chat return_token_ids", CH, {"model": m, "messages": msgs, "max_tokens": 3, "return_token_ids": True,
                                           **g}),
        Case("chat beam", CH, {"model": m, "messages": msgs, "max_tokens": 4, "use_beam_search": True, "n": 2}),
        Case("chat tools auto", CH, {"model": m, "messages": msgs, "max_tokens": 8, "tools": [tool]}),
        Case("chat both max", CH, {"model": m, "messages": msgs, "max_tokens": 3, "max_completion_tokens": 6, **g},
             greedy=True),
        Case("chat top_logprobs 0", CH, {"model": m, "messages": msgs, "max_tokens": 3, "logprobs": True,
                                         "top_logprobs": 0, **g}, greedy=True),
        Case("chat greedy n=2", CH, {"model": m, "messages": msgs, "max_tokens": 3, "n": 2, **g}),
        Case("chat stream_options no stream", CH, {"model": m, "messages": msgs, "max_tokens": 3,
                                                   "stream_options": {"include_usage": True}}),
        Case("chat skip_special false", CH, {"model": m, "messages": msgs, "max_tokens": 40,
                                             "skip_special_tokens": False, **g}, greedy=True),
        Case("chat incl stop str", CH, {"model": m, "messages": msgs, "max_tokens": 20, "stop": ["e"],
                                        "include_stop_str_in_output": True, **g}, greedy=True),
        Case("chat no gen prompt", CH, {"model": m, "messages": msgs, "max_tokens": 5,
                                        "add_generation_prompt": False, **g}, greedy=True),
        Case("chat truncate", CH, {"model": m, "messages": msgs, "max_tokens": 5, "truncate_prompt_tokens": 5,
                                   **g}, greedy=True),
        Case("chat tool no id", CH, {"model": m, "messages": [*msgs, {"role": "tool", "content": "x"}],
                                     "max_tokens": 5, **g}),
        Case("chat reasoning field", CH, {"model": m, "messages": [
            *msgs, {"role": "assistant", "content": "Red", "reasoning_content": "hmm"},
            {"role": "user", "content": "More"}], "max_tokens": 5, **g}, greedy=True),
        Case("chat emoji", CH, {"model": m, "messages": [{"role": "user", "content": "Say 🙂 twice"}],
                                "max_tokens": 12, **g}, greedy=True),
        Case("chat special text", CH, {"model": m, "messages": [{"role": "user", "content": "<|im_start|>hi"}],
                                       "max_tokens": 6, **g}, greedy=True),
        Case("chat own template", CH, {"model": m, "messages": msgs, "max_tokens": 3,
                                       "chat_template": "{{ messages[0]['content'] }}"}),
        Case("chat documents", CH, {"model": m, "messages": msgs, "max_tokens": 3,
                                    "documents": [{"title": "a", "text": "b"}]}),
        Case("chat bad_words", CH, {"model": m, "messages": msgs, "max_tokens": 8, "bad_words": ["Red"], **g},
             greedy=True),
        Case("chat allowed ids", CH, {"model": m, "messages": msgs, "max_tokens": 4,
                                      "allowed_token_ids": [28, 30, 2], **g}, greedy=True),
        Case("cmpl logprobs 0", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "logprobs": 0, **g},
             greedy=True),
        Case("cmpl stream echo logprobs", C, {"model": m, "prompt": "Hi there", "max_tokens": 2, "stream": True,
                                              "echo": True, "logprobs": 1, **g}, greedy=True),
        Case("cmpl stream n=2 usage", C, {"model": m, "prompt": "Hello", "max_tokens": 3, "stream": True, "n": 2,
                                          "seed": 0, "stream_options": {"include_usage": True}}),
        Case("cmpl special text", C, {"model": m, "prompt": "<|im_start|>user\nHi<|im_end|>", "max_tokens": 6,
                                      **g}, greedy=True),
        Case("cmpl spaces_between", C, {"model": m, "prompt": "Hello", "max_tokens": 6,
                                        "spaces_between_special_tokens": False, **g}, greedy=True),
        Case("cmpl stop eos id", C, {"model": m, "prompt": "Hello", "max_tokens": 40, "stop_token_ids": [2], **g},
             greedy=True),
        Case("cmpl 4 stops", C, {"model": m, "prompt": "1, 2, 3,", "max_tokens": 20, "stop": ["x", "y", "z", ","],
                                 **g}, greedy=True),
        Case("pooling", "/pooling", {"model": m, "input": "Hello"}),
        Case("score", "/v1/score", {"model": m, "text_1": "a", "text_2": "b"}),
        # other routes
        Case("models", "/v1/models"),
        Case("model by id", f"/v1/models/{m}"),
        Case("model unknown", "/v1/models/nope"),
        Case("health", "/health"),
        Case("version", "/version"),
        Case("tokenize", "/tokenize", {"model": m, "prompt": "Hello world"}),
        Case("tokenize chat", "/tokenize", {"model": m, "messages": msgs}),
        Case("tokenize no special", "/tokenize", {"model": m, "prompt": "Hello", "add_special_tokens": False}),
        Case("tokenize return_token_strs", "/tokenize", {"model": m, "prompt": "Hello world",
                                                         "return_token_strs": True}),
        Case("detokenize", "/detokenize", {"model": m, "tokens": [19556, 905]}),
        Case("detokenize bad id", "/detokenize", {"model": m, "tokens": [10 ** 7]}),
        Case("no route", "/v1/nope", {"model": m}),
        Case("get on post route", C),
        Case("bad json", C, b"{not json"),
        Case("json array body", C, b"[1, 2]"),
        Case("text content type", C, json.dumps({"model": m, "prompt": "Hi", "max_tokens": 2}).encode(),
             headers={"Content-Type": "text/plain"}),
        Case("embeddings", "/v1/embeddings", {"model": m, "input": "Hello"}),
        Case("responses", "/v1/responses", {"model": m, "input": "Name three colors.", "max_output_tokens": 8,
                                            "temperature": 0}),
        Case("responses stream", "/v1/responses", {"model": m, "input": "Hi", "max_output_tokens": 4,
                                                   "stream": True, "temperature": 0}),
    ]


def tool_cases(m: str) -> list[Case]:
    """Tool calling, for two servers that read the same tool-call format (`--suite tools`): vLLM with
    `--enable-auto-tool-choice --tool-call-parser hermes --chat-template T`, Kairos with `chat_template=T
    tool_call_parser=hermes`, T a template that shows tools and `<tool_call>` replies."""
    CH = "/v1/chat/completions"
    g = {"temperature": 0}
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    time_ = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                              "parameters": {"type": "object", "properties": {
                                                  "city": {"type": "string"}}, "required": ["city"]}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    return [
        Case("tools auto", CH, {"model": m, "messages": ask, "max_tokens": 60, "tools": [weather, time_], **g},
             greedy=True),
        Case("tools auto stream", CH, {"model": m, "messages": ask, "max_tokens": 60, "tools": [weather, time_],
                                       "stream": True, **g}),
        Case("tools named", CH, {"model": m, "messages": ask, "max_tokens": 40, "tools": [weather, time_],
                                 "tool_choice": named, **g}),
        Case("tools named stream", CH, {"model": m, "messages": ask, "max_tokens": 40, "tools": [weather, time_],
                                        "tool_choice": named, "stream": True, **g}),
        Case("tools required", CH, {"model": m, "messages": ask, "max_tokens": 60, "tools": [weather, time_],
                                    "tool_choice": "required", **g}),
        Case("tools required one", CH, {"model": m, "messages": ask, "max_tokens": 60, "tools": [weather, time_],
                                        "tool_choice": "required", "parallel_tool_calls": False, **g}),
        Case("tools required stream", CH, {"model": m, "messages": ask, "max_tokens": 60, "tools": [weather],
                                           "tool_choice": "required", "stream": True, **g}),
        Case("tools none", CH, {"model": m, "messages": ask, "max_tokens": 20, "tools": [weather],
                                "tool_choice": "none", **g}, greedy=True),
        Case("tools answer", CH, {"model": m, "messages": [
            *ask, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], "max_tokens": 20,
            "tools": [weather], **g}, greedy=True),
        Case("tools bad named", CH, {"model": m, "messages": ask, "max_tokens": 20, "tools": [weather],
                                     "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        Case("tools bad schema", CH, {"model": m, "messages": ask, "max_tokens": 20, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "x": {"type": "string", "pattern": "^a+$"}}}}}], "tool_choice": "required"}),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kairos", default="http://127.0.0.1:8000")
    p.add_argument("--vllm", default="http://127.0.0.1:8011")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--only", nargs="*", help="case names (substrings)")
    p.add_argument("--suite", choices=("api", "tools"), default="api",
                   help="api: the routes, fields and bad input; tools: tool calling (see `tool_cases`)")
    p.add_argument("--json", help="write the differences here")
    a = p.parse_args(argv)
    found: dict[str, list[str]] = {}
    for c in (cases if a.suite == "api" else tool_cases)(a.model):
        if a.only and not any(s in c.name for s in a.only):
            continue
        try:
            k, v = send(a.kairos, c), send(a.vllm, c)
        except OSError as e:
            found[c.name] = [f"transport: {e}"]
            print(f"{c.name}: transport: {e}", flush=True)
            continue
        diffs = compare(c, k, v)
        if diffs:
            found[c.name] = diffs
            for d in diffs:
                print(f"{c.name}: {d}", flush=True)
    print(f"{len(found)} of the cases differ", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
