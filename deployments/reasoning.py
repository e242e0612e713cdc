"""A reasoning model's thinking, read out of a chat reply as it streams (vLLM's `--reasoning-parser`), and a reply's
whole reading (`ReplyReader`: its reasoning, its content, its tool calls).

A reasoning model writes its thinking between `<think>` and `</think>`, then its answer; a chat response gives the
thinking as the message's (or a streamed delta's) `reasoning_content` and the answer as its `content`, as vLLM's.
The app's `reasoning_parser` says where the thinking starts (`PARSERS`):
- `deepseek_r1`: at the reply's start (its chat template opens `<think>` in the prompt; one the model writes again is
  dropped) up to `</think>`: a reply that never closes it is all reasoning (DeepSeek-R1, QwQ, Qwen3's thinking-only
  releases);
- `qwen3`: only where the reply opens with `<think>` (Qwen3, whose thinking may be switched off): a reply that does
  not is all content.
Where the replica says how the rendered prompt leaves the thinking (`RequestOutput.prompt_thinking`), that decides
instead: a template that opened `<think>` (Qwen3's thinking-only releases) starts the reply in it; one that closed it
(the thinking switched off) leaves the reply content unless it opens with `<think>`.
A request held to a format (JSON mode, a guided regex, a named or required tool) thinks first too, as vLLM's: its
format holds from the end of the thinking (`SamplingParams.thinking`, `core.json_grammar.thinking_first`).
"""
from __future__ import annotations

from typing import Any

from deployments.tool_calls import ReplyDelta, ToolCallReader, held_back

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningReader:
    """Splits one reply's text, piece by piece (`feed`, then `end`), into (reasoning, content)."""

    def __init__(self, opened: bool) -> None:
        """`opened`: the thinking begins at the reply's start (deepseek_r1), else only at a `<think>` it opens
        with (qwen3)."""
        self._buf = ""
        self._mode = "lead" if opened else "start"  # lead: thinking, a `<think>` may still come first
        self._ws = False  # after `</think>`, until content begins: its leading whitespace is dropped

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while True:
            buf = self._buf
            if self._mode in ("start", "lead"):
                head = buf.lstrip()
                if not head or (START.startswith(head) and head != START):
                    return reasoning, content  # (could still open with `<think>`)
                if head.startswith(START):
                    self._buf, self._mode = head[len(START):], "think"
                elif self._mode == "lead":
                    self._mode = "think"
                else:
                    self._mode = "content"
            elif self._mode == "think":
                i = buf.find(END)
                if i < 0:
                    cut = len(buf) - held_back(buf, END)
                    reasoning += buf[:cut]
                    self._buf = buf[cut:]
                    return reasoning, content
                reasoning += buf[:i]
                self._buf, self._mode, self._ws = buf[i + len(END):], "content", True
            else:
                self._buf = ""
                if self._ws:
                    buf = buf.lstrip()
                    self._ws = not buf
                return reasoning, content + buf

    def end(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._mode == "think":
            return buf, ""
        if self._mode == "lead":  # whitespace, or a `<think>` cut short: thinking (from the reply's start)
            return (buf, "") if buf.strip() else ("", "")
        return "", buf.lstrip() if self._ws else buf


def reasoning_reader(parser: str, prompt: str | None = None) -> ReasoningReader:
    """`parser`'s reader, where the prompt leaves the thinking as `prompt` says (`RequestOutput.prompt_thinking`):
    "open" (the template opened `<think>`): the reply starts in the thinking, whatever the parser; "closed" (a
    template that switched the thinking off closed it): only a `<think>` the reply opens with starts it; None:
    as the parser says."""
    return ReasoningReader(opened=prompt == "open" or (prompt is None and parser == "deepseek_r1"))


class ReplyReader:
    """A chat reply's reading, piece by piece: its reasoning (`reasoning`, where the app reads it), then in what is
    left its tool calls (`tools`, where the request asks that they be read), else its content."""

    def __init__(self, reasoning: ReasoningReader | None, tools: ToolCallReader | None, show: bool = True,
                 one_call: bool = False) -> None:
        """`show`: the reasoning is given (vLLM's include_reasoning), else dropped; `one_call`: only the reply's
        first tool call is given (parallel_tool_calls false, as vLLM's)."""
        self.reasoning, self.tools, self.show, self.one_call = reasoning, tools, show, one_call

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    @property
    def as_calls(self) -> bool:
        return self.tools is not None and self.tools.as_calls

    def feed(self, text: str) -> ReplyDelta:
        return self._read(*(self.reasoning.feed(text) if self.reasoning is not None else ("", text)), False)

    def end(self) -> ReplyDelta:
        return self._read(*(self.reasoning.end() if self.reasoning is not None else ("", "")), True)

    def _read(self, reasoning: str, content: str, last: bool) -> ReplyDelta:
        if self.tools is None:
            out = ReplyDelta(content=content)
        else:
            out = self.tools.feed(content)
            if last:
                out.add(self.tools.end())
            if self.one_call:
                out.calls = [c for c in out.calls if c["index"] == 0]
        out.reasoning = reasoning if self.show else ""
        return out

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """A whole reply's reasoning (None where it is not read for any, or has none), content (None where only
        whitespace is left beside its reasoning or calls) and calls (each whole)."""
        if self.reasoning is None:
            content, calls = self.tools.whole(text) if self.tools is not None else (text, [])
            return None, content, calls[:1] if self.one_call else calls
        (r1, c1), (r2, c2) = self.reasoning.feed(text), self.reasoning.end()
        reasoning, content = (r1 + r2 if self.show else ""), c1 + c2
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            got, calls = self.tools.whole(content)
            content, calls = got or "", calls[:1] if self.one_call else calls
        return reasoning or None, content if content.strip() else None, calls
