"""OpenAI's Responses API over the chat path (`deployments.responses`): a request read as its chat completion, the
chat's answer written back as a response, and a chat stream as the Responses API's events."""
from __future__ import annotations

import json

import pytest

from deployments.responses import ResponseEvents, ResponsesError, chat_request, from_chat


def test_a_request_reads_as_the_chat_it_amounts_to() -> None:
    chat, echoed = chat_request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 30, "temperature": 0.5, "stream": True,
        "input": [{"role": "developer", "content": "Use tools."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "21C"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "slo_ttft_ms": 500, "store": True,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})
    # a developer message stays one (a template that does not name the role reads it as the system's, merged
    # with the instructions: engine.inputs); the calls join one assistant turn
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    assert chat["max_completion_tokens"] == 30 and chat["temperature"] == 0.5 and chat["slo_ttft_ms"] == 500
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w",
                                                                              "schema": {"type": "object"}}}
    assert chat["stream_options"] == {"include_usage": True} and "store" not in chat and "input" not in chat
    assert echoed["instructions"] == "Be brief." and echoed["max_output_tokens"] == 30
    assert chat_request({"input": "hi"})[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert chat_request({"input": "hi", "reasoning": {"effort": "none"}})[0]["reasoning_effort"] == "none"
    # the instructions and a system input item: one system message first (templates take one, first); an assistant
    # message then its call (the items this server's own responses hold, sent back): one assistant turn
    msgs = chat_request({"instructions": "Be brief.", "input": [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}]})[0]["messages"]
    assert msgs == [{"role": "system", "content": "Be brief.\n\nAnswer in French."},
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Let me check.", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]


@pytest.mark.parametrize("raw,param", [
    ({"input": []}, "input"), ({}, "input"), ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"), ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]"), ({"input": "x", "tools": [{"type": "web_search"}]},
                                                             "tools[0]"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"), ({"input": "x", "tool_choice": 3},
                                                                            "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ({"input": "x", "include": ["bogus.value"]}, "include"), ({"input": "x", "metadata": "x"}, "metadata"),
    ({"input": "x", "metadata": {"k": 5}}, "metadata"), ({"input": "x", "user": 5}, "user"),
    ({"input": "x", "truncation": "middle"}, "truncation")])
def test_what_is_not_a_request_here_is_refused_naming_its_field(raw, param) -> None:
    with pytest.raises(ResponsesError) as e:
        chat_request(raw)
    assert e.value.param == param and str(e.value).startswith(param)


def _chat(content=None, reasoning=None, calls=(), finish="stop") -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return {"id": "resp_1", "object": "chat.completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_a_chats_answer_is_a_response_with_its_items() -> None:
    r = from_chat("resp_1", _chat("Hello", reasoning="think", calls=[("f", "{}")]), {"tools": []})
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][1]["content"][0] == {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
    assert r["output"][2]["call_id"] == "c0" and r["output"][2]["name"] == "f"
    assert r["status"] == "completed" and r["usage"]["input_tokens"] == 3 and r["usage"]["output_tokens"] == 4
    cut = from_chat("resp_1", _chat("Hel", finish="length"), {})
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    # the truncation asked for, as vLLM echoes it (it said disabled whatever was asked)
    echoed = chat_request({"input": "hi", "truncation": "auto", "metadata": {"k": "v"}, "user": "u"})[1]
    assert from_chat("resp_1", _chat("Hi"), echoed)["truncation"] == "auto" and echoed["metadata"] == {"k": "v"}


def _sse(*chunks: dict | str) -> list[bytes]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "resp_1", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_chat_stream_is_the_responses_events_and_ends_with_the_whole_response() -> None:
    ev = ResponseEvents("resp_1", "", {"tools": []})
    chunks = _sse(_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "hm"}),
                  _chunk({"content": "He"}), _chunk({"content": "llo"}),
                  _chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a"'}}]}),
                  _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
                  {"id": "resp_1", "model": "m", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5,
                                                                          "total_tokens": 7}}, "[DONE]")
    events = [json.loads(e.decode().split("data: ", 1)[1]) for c in chunks for e in ev.feed(c)]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert [o["type"] for o in done["output"]] == ["reasoning", "message", "function_call"]
    assert done["output"][1]["content"][0]["text"] == "Hello" and done["output"][2]["arguments"] == '{"a": 1}'
    assert done["usage"]["output_tokens"] == 5 and done["model"] == "m"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    # the message's one part: added by content_part.added, not already in the item added (OpenAI's; an SDK that
    # builds the item from the events had two parts)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[1]["type"] == "message" and added[1]["content"] == []
    cut = ResponseEvents("resp_2", "m", {})
    tail = [json.loads(e.decode().split("data: ", 1)[1]) for c in _sse(_chunk({"content": "x"}, "length"), "[DONE]")
            for e in cut.feed(c)]
    assert tail[-1]["type"] == "response.completed" and tail[-1]["response"]["status"] == "incomplete"
    cut_call = ResponseEvents("resp_4", "m", {})  # a call the cap cut: the response is incomplete
    tail = [json.loads(e.decode().split("data: ", 1)[1]) for c in _sse(
        _chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                "function": {"name": "f", "arguments": '{"a": '}}]}, "length"), "[DONE]")
        for e in cut_call.feed(c)]
    done = tail[-1]["response"]
    assert done["status"] == "incomplete" and done["output"][0]["arguments"] == '{"a": '
    failed = ResponseEvents("resp_3", "m", {})
    tail = [json.loads(e.decode().split("data: ", 1)[1]) for c in _sse(
        _chunk({"content": "x"}), {"error": {"message": "boom", "type": "server_error", "code": "replica_error"}},
        "[DONE]") for e in failed.feed(c)]
    assert [e["type"] for e in tail][-2:] == ["error", "response.failed"] and tail[-2]["message"] == "boom"


def test_a_chunk_that_ends_a_call_and_goes_on_with_text_keeps_the_call_whole() -> None:
    """Merged deltas (a stream whose reader fell behind) may end an open call and begin text after it in one chunk:
    the call gets its rest before the text closes it, and the text is a message after it, not a cut call and a
    nameless second one; a chunk with text and then a new call begins the call after the text."""
    ev = ResponseEvents("resp_1", "m", {"tools": []})
    chunks = _sse(_chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": '}}]}),
                  _chunk({"content": " Done.", "tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
                  _chunk({"content": " And", "tool_calls": [{"index": 1, "id": "c1", "type": "function",
                                                             "function": {"name": "g", "arguments": "{}"}}]},
                         "tool_calls"), "[DONE]")
    events = [json.loads(e.decode().split("data: ", 1)[1]) for c in chunks for e in ev.feed(c)]
    out = events[-1]["response"]["output"]
    assert [(o["type"], o.get("name"), o.get("arguments")) for o in out] == [
        ("function_call", "f", '{"a": 1}'), ("message", None, None), ("function_call", "g", "{}")]
    assert out[1]["content"][0]["text"] == " Done. And"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]


def test_parallel_calls_stream_one_after_another_and_the_item_a_cap_cut_is_incomplete() -> None:
    """Each item is done before the next is added (vLLM's and OpenAI's order; a client that keeps one current item
    lost the first call's done); the call the cap cut, whose arguments may not parse, is `incomplete`, streamed and
    whole, as the response is."""
    ev = ResponseEvents("resp_1", "m", {"tools": []})
    chunks = _sse(_chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": 1}'}}]}),
                  _chunk({"tool_calls": [{"index": 1, "id": "c1", "type": "function",
                                          "function": {"name": "g", "arguments": '{"b": '}}]}, "length"), "[DONE]")
    events = [json.loads(e.decode().split("data: ", 1)[1]) for c in chunks for e in ev.feed(c)]
    order = [(e["type"], e.get("output_index")) for e in events if e["type"].startswith("response.output_item")]
    assert order == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1)]
    done = events[-1]["response"]
    assert done["status"] == "incomplete" and [o["status"] for o in done["output"]] == ["completed", "incomplete"]
    whole = from_chat("resp_1", _chat("Hel", calls=[("f", '{"a": 1}')], finish="length"), {})
    assert [o["status"] for o in whole["output"]] == ["completed", "incomplete"]


def test_a_reasoning_item_sent_back_is_the_thinking_of_the_assistant_turn_after_it() -> None:
    """As vLLM reads it: a reasoning item's text is the next assistant turn's reasoning (which templates show within a
    tool-calling loop); one a user's turn follows is dropped."""
    think = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "I should call get"}]}
    msgs = chat_request({"input": [
        {"role": "user", "content": "Weather?"}, think,
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "say it"}]},
        {"type": "message", "role": "assistant", "content": "Sunny."}, think,
        {"role": "user", "content": "Thanks"}]})[0]["messages"]
    assert msgs[1] == {"role": "assistant", "content": None, "reasoning_content": "I should call get", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}
    assert msgs[3] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "say it"}
    assert msgs[4] == {"role": "user", "content": "Thanks"} and len(msgs) == 5


def test_an_error_names_the_responses_fields_not_the_chats() -> None:
    from deployments.responses import responses_message, responses_param

    assert responses_param("max_completion_tokens") == responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("tools.0.function.name") == "tools.0.name"
    assert responses_param("messages.2.content") == "input" and responses_param("temperature") == "temperature"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("reasoning_effort") == "reasoning.effort"
    assert responses_message("tools.0.function.name: Field required") == "tools.0.name: Field required"
    assert responses_message("response_format: a schema is needed at json_schema.schema") == \
        "text.format: a schema is needed at text.format.schema"
    assert responses_message("'max_tokens' or 'max_completion_tokens' is too large: 9") == \
        "'max_output_tokens' is too large: 9"


def test_the_texts_logprobs_come_where_include_asks_for_them() -> None:
    """include ["message.output_text.logprobs"] with top_logprobs (vLLM's and OpenAI's): the chat asks for them, and
    the response's output_text (streamed: each text delta and the text's done event) carries them; without the
    include none are asked for (the field was dropped and the logprobs always [])."""
    from openai.types.responses import Response

    chat, echoed = chat_request({"input": "hi", "top_logprobs": 2, "include": ["message.output_text.logprobs"]})
    assert (chat["logprobs"], chat["top_logprobs"], echoed["top_logprobs"]) == (True, 2, 2)
    assert "logprobs" not in chat_request({"input": "hi", "top_logprobs": 2})[0]
    assert chat_request({"input": "hi", "include": ["message.output_text.logprobs"]})[0]["top_logprobs"] == 0
    for bad, param in (({"top_logprobs": 21}, "top_logprobs"), ({"include": "logprobs"}, "include")):
        with pytest.raises(ResponsesError) as e:
            chat_request({"input": "hi", **bad})
        assert e.value.param == param
    lp = [{"token": "He", "logprob": -0.1, "bytes": [72, 101], "top_logprobs": [
        {"token": "He", "logprob": -0.1, "bytes": [72, 101]}, {"token": "Hi", "logprob": -2.5, "bytes": [72, 105]}]},
        {"token": "llo", "logprob": -0.2, "bytes": [108, 108, 111], "top_logprobs": []}]
    whole = _chat("Hello")
    whole["choices"][0]["logprobs"] = {"content": lp}
    r = from_chat("resp_1", whole, echoed)
    assert r["output"][0]["content"][0]["logprobs"] == lp and r["top_logprobs"] == 2
    Response.model_validate(r)
    ev = ResponseEvents("resp_1", "m", echoed)
    chunks = [{**_chunk({"content": "He"}), "choices": [{"index": 0, "delta": {"content": "He"},
                                                         "finish_reason": None, "logprobs": {"content": lp[:1]}}]},
              {**_chunk({"content": "llo"}), "choices": [{"index": 0, "delta": {"content": "llo"},
                                                          "finish_reason": "stop", "logprobs": {"content": lp[1:]}}]}]
    events = [json.loads(e.decode().split("data: ", 1)[1]) for c in _sse(*chunks, "[DONE]") for e in ev.feed(c)]
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"] == [lp[:1], lp[1:]]
    assert next(e for e in events if e["type"] == "response.output_text.done")["logprobs"] == lp
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == lp


def test_held_back_tokens_keep_their_logprobs_and_a_failure_leaves_its_item_incomplete() -> None:
    """A token the chat stream held back (it might have opened a call) comes in a chunk with no text and its
    logprobs, its text later: the text's delta carries them (they were lost, so the streamed text had fewer
    logprobs than the same reply whole). A stream that fails leaves the item it cut incomplete, and the response's
    error code is one of OpenAI's (the chat's own, `replica_failed`, stays in the `error` event)."""
    from openai.types.responses import Response

    lp = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in ("Hello ", "<", "b>")]

    def chunk(text: str | None, lps: list, finish: str | None = None) -> dict:
        return {"id": "resp_1", "model": "m", "choices": [{"index": 0, "delta": {} if text is None else {
            "content": text}, "finish_reason": finish, "logprobs": {"content": lps}}]}

    ev = ResponseEvents("resp_1", "m", {"top_logprobs": 0})
    chunks = _sse(chunk("Hello ", lp[:1]), chunk(None, lp[1:2]), chunk("<b>", lp[2:], "stop"), "[DONE]")
    events = [json.loads(e.decode().split("data: ", 1)[1]) for c in chunks for e in ev.feed(c)]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == lp
    failed = ResponseEvents("resp_2", "m", chat_request({"input": "hi"})[1])
    tail = [json.loads(e.decode().split("data: ", 1)[1]) for c in _sse(
        _chunk({"content": "Hel"}), {"error": {"message": "gone", "type": "server_error", "code": "replica_failed"}})
        for e in failed.feed(c)]
    assert tail[-2]["code"] == "replica_failed"
    response = tail[-1]["response"]
    assert response["error"]["code"] == "server_error" and response["output"][0]["status"] == "incomplete"
    Response.model_validate(response)
