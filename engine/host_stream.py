"""Overlap scheduling where the device is the host (a CPU engine with `overlap=on`): each step's forward and draw
run on a thread of their own, one step at a time in launch order, as a GPU's stream runs a step's kernels. The
engine's worker plans and prepares step N+1, and hands step N-1's tokens to their streams, while step N computes
(`EngineConfig.overlap`).

Python runs one thread at a time. A step that gave the GIL up at each of its short calls would wait for the worker's
host work at each, and run no faster than with no overlap at all. So `launch` returns only once the step has started
its long call, the one that releases the GIL for most of the step (the CPU backend's whole-step kernel, which calls
`engine.backends.base.long_call_starts`), or has ended, for a step with no such call. The worker's host work then runs
during that call, and the step's own Python before and after it runs alone.

The thread reads only what the worker hands it: the step's prepared inputs (fresh tensors), the tokens of the step
before (placeholders in the inputs read them there), and the draw's plan (`Sampler.plan`, taken at launch). The
worker launches a step only once the step before has landed (`Pending.result`). A step that failed is re-run request
by request on the worker before anything reads its tokens, as without overlap."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from engine.backends import base
from engine.sampler import SampledTokens


class Pending:
    """A step launched on the host stream; `result` waits for its tokens (None where no row samples) and its
    milliseconds on the stream, and raises what the step raised."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> tuple[SampledTokens | None, float]:
        return self._future.result()


class HostStream:
    """One thread that runs the launched steps in order, with the engine's torch threads."""

    def __init__(self, num_threads: int, name: str = "kairos-step") -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.set_num_threads,
                                        initargs=(num_threads,))

    def launch(self, fn: Callable[[], SampledTokens | None]) -> Pending:
        """Run `fn` (the step's forward and draw) after every step launched before it; returns once it has started
        its long call or ended."""
        started = threading.Event()
        pending = Pending(self._pool.submit(_run, fn, started))
        started.wait()
        return pending

    def close(self) -> None:
        """Wait for the step in flight (it writes the KV cache), then stop the thread."""
        self._pool.shutdown(wait=True)


def _run(fn: Callable[[], SampledTokens | None], started: threading.Event) -> tuple[SampledTokens | None, float]:
    base.await_long_call(started)
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        base.await_long_call(None)
        started.set()
    return out, (time.perf_counter() - t0) * 1000.0
