"""A per-request output queue filled by the worker thread and read from threads or asyncio.

put() never blocks; readers either block (`get`, iteration) or await (`aget`, async iteration).
If the reader is behind, pending deltas are merged on read so it never falls further behind. Each item's put time is
kept with it, for the reader to take with the items it read (`take_token_times`): when its tokens came out of the
engine (the engine process's own send time, where its client puts them: `put`'s `at`), however late or merged they
were read (the replica's latency metrics).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from typing import Protocol

from core.messages import RequestOutput, TokenLogprob


class OutputSink(Protocol):
    """Where the engine's worker thread puts a request's items (never blocks): a `RequestStream` in-process,
    a batch bound for the client in `engine.core_proc`."""

    def put(self, item: RequestOutput) -> None: ...

    def put_token(self, request_id: str, text: str, token_id: int, num_prompt_tokens: int,
                  num_output_tokens: int, logprobs: TokenLogprob | None = None,
                  prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        """Put a request's token item: `RequestOutput(request_id, text, [token_id], num_prompt_tokens=...,
        num_output_tokens=..., logprobs=[logprobs] if any, prompt_logprobs=...)`, which a sink may keep in a cheaper
        form (the engine process's batch)."""
        ...


class RequestStream:
    __slots__ = ("request_id", "prompt_token_ids", "prompt_thinking", "arrival_s", "_items", "_times", "_read_times",
                 "_lock", "_cond", "_blocked", "_waiter", "_close_waiter", "_closed")

    def __init__(self, request_id: str, prompt_token_ids: list[int] | None = None,
                 prompt_thinking: str | None = None, arrival_s: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids  # the request's prompt, as the engine took it
        self.prompt_thinking = prompt_thinking  # where asked, where it leaves the thinking (`Request.prompt_thinking`)
        self.arrival_s = arrival_s  # the request's arrival (`Request.arrival_s`, time.monotonic()), where known
        self._items: deque[RequestOutput] = deque()
        self._times: deque[float] = deque()  # each item's put time (time.monotonic()), beside it
        # (put time, tokens) of the token items read and not yet taken, for a reader that asked (`track_token_times`)
        self._read_times: list[tuple[float, int]] | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._blocked = 0  # threads waiting in `get` (notified only then: a put is made for every token)
        # (loop, future, the loop's thread) of an awaiting reader
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future, int] | None = None
        self._close_waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future, int] | None = None
        self._closed = False

    # --- producer side (worker thread) ---
    def put(self, item: RequestOutput, at: float | None = None) -> None:
        """`item` onto the stream; `at`: when its producer made it (time.monotonic(); None: now)."""
        with self._lock:
            if self._closed:
                return
            self._items.append(item)
            self._times.append(time.monotonic() if at is None else at)
            closer = None
            if item.finished:
                self._closed = True
                closer, self._close_waiter = self._close_waiter, None
            waiter, self._waiter = self._waiter, None
            if self._blocked:
                self._cond.notify_all()
        for w in (waiter, closer):
            if w is not None:
                loop, fut, thread = w
                if thread == threading.get_ident():  # put on the reader's own loop (the engine client's reader_loop)
                    _wake(fut)
                    continue
                try:
                    loop.call_soon_threadsafe(_wake, fut)
                except RuntimeError:  # its loop has closed (a reader that gave up): nobody waits there any more
                    pass

    def put_token(self, request_id: str, text: str, token_id: int, num_prompt_tokens: int,
                  num_output_tokens: int, logprobs: TokenLogprob | None = None,
                  prompt_logprobs: list[TokenLogprob] | None = None, at: float | None = None) -> None:
        self.put(RequestOutput(request_id, text, [token_id], num_prompt_tokens=num_prompt_tokens,
                               num_output_tokens=num_output_tokens, logprobs=None if logprobs is None else [logprobs],
                               prompt_logprobs=prompt_logprobs), at)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- consumer side ---
    def track_token_times(self) -> None:
        """From now on keep, for `take_token_times`, the put times of the token items read (call it before the first
        read, from the reader's thread or loop)."""
        if self._read_times is None:
            self._read_times = []

    def take_token_times(self) -> list[tuple[float, int]]:
        """(put time, number of tokens) of each item with tokens read since the last call, in order, where tracked
        (`track_token_times`; else none). The reader's own: call it from the thread or loop that reads."""
        got = self._read_times
        if not got:
            return []
        self._read_times = []
        return got

    def _pop_merged(self) -> RequestOutput:
        parts = [self._pop()]
        while self._items and not parts[-1].finished:
            parts.append(self._pop())
        if len(parts) == 1:
            return parts[0]
        logprobs = [x for p in parts for x in p.logprobs or ()] \
            if any(p.logprobs is not None for p in parts) else None
        prompt = next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None)
        return dataclasses.replace(parts[-1], text="".join(p.text for p in parts),
                                   token_ids=[t for p in parts for t in p.token_ids], logprobs=logprobs,
                                   prompt_logprobs=prompt)

    def _pop(self) -> RequestOutput:
        item, t = self._items.popleft(), self._times.popleft()
        if item.token_ids and self._read_times is not None:
            self._read_times.append((t, len(item.token_ids)))
        return item

    def get(self, timeout: float | None = None) -> RequestOutput:
        with self._cond:
            self._blocked += 1
            try:
                if not self._cond.wait_for(lambda: bool(self._items), timeout):
                    raise TimeoutError(f"no output for {self.request_id} within {timeout}s")
            finally:
                self._blocked -= 1
            return self._pop_merged()

    async def aget(self) -> RequestOutput:
        while True:
            with self._lock:
                if self._items:
                    return self._pop_merged()
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiter = (loop, fut, threading.get_ident())
            try:
                await fut
            finally:  # (cancelled: a later put need not wake a reader that is gone)
                with self._lock:
                    if self._waiter is not None and self._waiter[1] is fut:
                        self._waiter = None

    async def wait_closed(self, timeout: float) -> bool:
        """Wait until the final item has been put or `timeout` seconds pass; True if closed. Only the final
        item wakes this waiter (not every token), so a stream batcher can sleep its interval yet flush the
        last tokens at once."""
        with self._lock:
            if self._closed:
                return True
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._close_waiter = (loop, fut, threading.get_ident())
        # (a timer, not wait_for: on 3.11 wait_for may swallow a cancellation that comes as the final item is put)
        timer = loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            with self._lock:
                if self._close_waiter is not None and self._close_waiter[1] is fut:
                    self._close_waiter = None
        return self._closed

    def __iter__(self):
        while True:
            out = self.get()
            yield out
            if out.finished:
                return

    async def __aiter__(self):
        while True:
            out = await self.aget()
            yield out
            if out.finished:
                return


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
