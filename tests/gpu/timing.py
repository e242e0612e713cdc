"""Timing for the GPU micro-benchmarks (tests/gpu/*'s script modes): CUDA-graph replays, no launch overhead."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_seconds(fns: Sequence[Callable[[], object]], reps: int) -> float:
    """Seconds per call, from one CUDA graph of the calls `fns` (in order) replayed `reps` times, as the engine
    replays its captured steps: the calls run once on a side stream first (lazy initialisation stays out of the
    capture), and the graph once before the clock starts."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * len(fns))
