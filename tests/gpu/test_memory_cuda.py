"""A second engine in one process, after `shutdown()` of the first, gets the same KV cache: on CUDA the cache is
sized from what the card has free (`gpu_memory_utilization`), so a shut-down engine that kept its cache left
the next one nothing (seen on an H200: "KV cache of 0 blocks cannot hold one full context"). No explicit cache
size here, and nothing but `gc.collect()` between the two engines, as a user's process would do."""
from __future__ import annotations

import gc

from tests.gpu.conftest import greedy, make_engine, run_all

SLACK_BYTES = 64 * 1024**2


def test_second_engine_after_shutdown_gets_the_same_cache(device, ckpts):
    import torch

    cuda = device == "cuda"
    kw = {"gpu_memory_utilization": 0.3} if cuda else {}  # the CPU's default cache: 1 GiB
    if cuda:  # what the process keeps for good once any engine ran (cuBLAS's workspaces per stream, the graph
        # capture's stream), made before the baseline: this test alone measures as it does after the others
        make_engine(ckpts["llama"], device, **kw).shutdown()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
    sizes = []
    for i in range(2):
        eng = make_engine(ckpts["llama"], device, **kw)
        try:
            sizes.append(eng.cache.num_blocks)
            out = run_all([eng.add_request([5, 6, 7, 8 + i], greedy(8))])
            assert len(out[0]) == 8
        finally:
            eng.shutdown()
        del eng
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - baseline
            assert held <= SLACK_BYTES, f"engine {i + 1} still holds {held / 2**20:.0f} MiB after shutdown"
    assert sizes[1] == sizes[0] > 0
