"""A reasoning model's thinking read out of its reply (`deployments.reasoning`), whole and streamed in pieces of
every size: the same reasoning and content however the text is cut."""
from __future__ import annotations

import pytest

from deployments.reasoning import ReplyReader, reasoning_reader
from deployments.tool_calls import ReplyDelta, model_format_reader

# (parser, reply, reasoning, content)
CASES = [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "It is 4."),
    ("qwen3", "It is 4, no thinking.", None, "It is 4, no thinking."),
    ("qwen3", "  <think>cut short", "cut short", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think></think>", None, None),
    ("qwen3", "    def f():\n        pass", None, "    def f():\n        pass"),  # (no thinking: the text as it is)
    ("deepseek_r1", "<th", "<th", None),
    ("deepseek_r1", "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "4"),
    ("deepseek_r1", "<think>Hmm.</think>4", "Hmm.", "4"),
    ("deepseek_r1", "never closed </thi", "never closed </thi", None),
    ("deepseek_r1", "a < b </think> so <think> stays", "a < b ", "so <think> stays"),
]


@pytest.mark.parametrize("parser,reply,reasoning,content", CASES)
def test_a_reply_splits_into_the_same_reasoning_and_content_whole_and_in_every_cut(parser, reply, reasoning,
                                                                                    content) -> None:
    assert ReplyReader(reasoning_reader(parser), None).whole(reply) == (reasoning, content, [])
    for step in range(1, len(reply) + 1):
        r, out = ReplyReader(reasoning_reader(parser), None), ReplyDelta()
        for k in range(0, len(reply), step):
            out.add(r.feed(reply[k:k + step]))
        out.add(r.end())
        assert (out.reasoning or None, out.content or None) == (reasoning, content), step


def test_thinking_streams_as_it_comes_and_calls_after_it_are_read() -> None:
    r = ReplyReader(reasoning_reader("qwen3"), model_format_reader("hermes"))
    assert r.feed("<thi").delta() == {}
    assert r.feed("nk>Rain?</").delta() == {"reasoning_content": "Rain?"}
    d = r.feed('think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert d.reasoning == "" and d.content == "" and d.calls[0]["function"] == {"name": "f", "arguments": "{}"}
    assert r.calls == 1 and r.as_calls
    from deployments.tool_calls import NamedToolReader

    named = ReplyReader(reasoning_reader("qwen3"), NamedToolReader("f"))  # a named tool's call after the thinking
    reasoning, content, calls = named.whole('<think>which?</think>\n{"a": 1}')
    assert (reasoning, content) == ("which?", None) and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert ReplyReader(reasoning_reader("qwen3"), NamedToolReader("f")).whole("<think>x</think>{") == ("x", "{", [])
    hidden = ReplyReader(reasoning_reader("deepseek_r1"), None, show=False)  # vLLM's include_reasoning false
    assert hidden.whole("secret</think>answer") == (None, "answer", [])
