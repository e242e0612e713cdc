"""engine.backends.cuda.triton_attention compiled on a GPU, at realistic sizes, against the gather + softmax
reference of tests/paged_attention_reference.py; and CUDA-graph capture of the decode kernels.

Skipped without CUDA. `KAIROS_GPU_TESTS_ON_CPU=1` together with `TRITON_INTERPRET=1` (set before the process
starts) dry-runs this module on the CPU through Triton's interpreter at reduced sizes.

Run as a script on a GPU (`python -m tests.gpu.test_triton_attention_cuda`), it prints the decode kernels' time
and effective bandwidth for a Llama-3.1-8B-shaped layer, and the prefill kernel's TFLOP/s.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.timing import graph_seconds
from tests.paged_attention_reference import (
    TOL, assert_close, make_paged, run_decode_case, run_prefill_case, triton_device_or_skip)

ON_CUDA, DEV = triton_device_or_skip("attention kernels")
ON_CPU = not ON_CUDA

# Sizes shrink by this factor on the CPU dry run (the interpreter runs each program in numpy).
SHRINK = 1 if ON_CUDA else 16


def spread_lengths(n: int, lo: int, hi: int, seed: int = 0, zeros: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    for i in range(zeros):  # padded slots (context 0), spread through the batch
        lens[(i * 7 + 3) % n] = 0
    return lens


# Llama-3.1-8B's attention: 32 query heads over 8 KV heads, head_dim 128 (4 KV heads on the CPU dry run).
KVH, GROUP, D = 8, 4, 128
KVH_RUN = KVH if ON_CUDA else 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_8b_shape_mixed_lengths_any_split(dtype):
    lens = spread_lengths(128 // SHRINK, 1, 4096 // SHRINK, zeros=3)
    lens[:4] = [1, 15, 16, 17]
    outs = [run_decode_case(lens, GROUP, D, 16, dtype, DEV, num_splits=s, num_kv_heads=KVH_RUN)
            for s in (1, None, 8)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("group,head_dim,block_size,dtype", [
    (1, 64, 16, torch.float16),
    (8, 128, 32, torch.bfloat16),
    (4, 80, 16, torch.bfloat16),
    (4, 96, 64, torch.float16),
    (2, 256, 16, torch.bfloat16),
    (4, 128, 16, torch.float32),
])
def test_decode_gqa_head_dims_block_sizes(group, head_dim, block_size, dtype):
    lens = spread_lengths(16, 1, 1024 // SHRINK, seed=1, zeros=1)
    run_decode_case(lens, group, head_dim, block_size, dtype, DEV, num_splits=None, num_kv_heads=4)
    run_decode_case(lens, group, head_dim, block_size, dtype, DEV, num_splits=4, num_kv_heads=4)


def test_decode_batch_one_long_context_splits():
    # One sequence of 32k tokens: the default split count spreads it over the GPU.
    from engine.backends.cuda import triton_attention as ta

    L = 32768 if ON_CUDA else 600
    assert ta.choose_num_splits(1, KVH_RUN, L, ta.num_sms_of(torch.device(DEV))) > 1
    run_decode_case([L], GROUP, D, 16, torch.bfloat16, DEV, num_splits=None, num_kv_heads=KVH_RUN)


def test_prefill_8b_shape_chunks_over_prefixes():
    # Full prompts, chunks over cached prefixes, a decode-like row, and a sequence with no new tokens.
    n = 1024 // SHRINK
    q_lens = [n, n // 2, 77, 1, 0, n, 3, 200 // SHRINK]
    seq_lens = [n, n // 2 + 300 // SHRINK, 77 + 2000 // SHRINK, 900 // SHRINK, 40, 2 * n, 3, 200 // SHRINK]
    run_prefill_case(q_lens, seq_lens, GROUP, D, 16, torch.bfloat16, DEV, num_kv_heads=KVH_RUN)


@pytest.mark.parametrize("group,head_dim,dtype", [(1, 64, torch.float16), (8, 128, torch.bfloat16),
                                                  (4, 80, torch.float32), (2, 256, torch.bfloat16)])
def test_prefill_gqa_head_dims(group, head_dim, dtype):
    run_prefill_case([300 // SHRINK, 1, 65, 17], [300 // SHRINK, 40, 65 + 130, 17], group, head_dim, 32, dtype, DEV)


def test_prefill_matches_decode_for_single_tokens():
    lens = spread_lengths(32, 1, 2048 // SHRINK, seed=2)
    dec = run_decode_case(lens, GROUP, D, 16, torch.bfloat16, DEV, num_splits=1, num_kv_heads=KVH_RUN)
    pre = run_prefill_case([1] * len(lens), lens, GROUP, D, 16, torch.bfloat16, DEV, num_kv_heads=KVH_RUN)
    torch.testing.assert_close(dec, pre, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_cuda_graph_capture_and_replay_with_new_inputs(num_splits):
    """Captured once for a batch of 32 (with a preallocated workspace), replayed after the batch's queries,
    context lengths (zeros for padded slots included) and block tables change in place: it matches eager calls."""
    from engine.backends.cuda import triton_attention as ta

    B, bs, max_blocks, dtype = 32, 16, 128, torch.bfloat16
    H = KVH * GROUP
    num_blocks = B * max_blocks
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(num_blocks, bs, KVH, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(num_blocks, bs, KVH, D, device="cuda", dtype=dtype, generator=g)
    q = torch.zeros(B, H, D, device="cuda", dtype=dtype)
    ctx = torch.zeros(B, dtype=torch.int32, device="cuda")
    tables = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    out = torch.zeros(B, H, D, device="cuda", dtype=dtype)
    ws = ta.alloc_decode_workspace(B, H, D, num_splits, "cuda")

    def fill(seed: int) -> None:
        gg = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(B, H, D, device="cuda", dtype=dtype, generator=gg))
        lens = torch.randint(1, max_blocks * bs + 1, (B,), device="cuda", generator=gg, dtype=torch.int32)
        lens[::5] = 0
        ctx.copy_(lens)
        tables.copy_(torch.randperm(num_blocks, device="cuda", generator=gg)[: B * max_blocks]
                     .view(B, max_blocks).to(torch.int32))

    def call() -> None:
        ta.paged_decode_attention(q, k, v, tables, ctx, D ** -0.5, out, num_splits=num_splits, workspace=ws)

    fill(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (2, 3):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        call()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, out, atol=0, rtol=0)  # same kernels, same inputs: bit-identical
        assert (got[::5] == 0).all()
        assert torch.isfinite(got).all()


@pytest.mark.skipif(not ON_CUDA, reason="needs a GPU")
def test_decode_long_context_bf16_matches_reference_at_8b_batch():
    """The acceptance shape: 8B attention, batch 64, contexts spread 128-2048, default splits."""
    lens = spread_lengths(64, 128, 2048, seed=4)
    k, v, tables = make_paged(lens, KVH, D, 16, torch.bfloat16, "cuda", seed=4)
    from engine.backends.cuda import triton_attention as ta
    from tests.paged_attention_reference import reference_attention

    q = torch.randn(64, KVH * GROUP, D, device="cuda", dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ta.paged_decode_attention(q, k, v, tables, ctx, D ** -0.5, out)
    ref = reference_attention(q, k, v, tables, torch.arange(65, device="cuda", dtype=torch.int32), ctx, D ** -0.5)
    assert_close(out, ref, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Micro-benchmark (run as a script on a GPU; prints, asserts nothing)
# ---------------------------------------------------------------------------------------------------------------

def _time_graph(fns, reps: int = 10) -> float:
    """Seconds per call, from a CUDA graph of the calls `fns` (one per layer, so that the KV read comes from HBM,
    not from L2): no launch overhead, as in the engine's captured decode."""
    return graph_seconds(fns, reps)


def _layers(per_layer_bytes: int) -> int:
    """Layers to rotate through: together at least 512 MB (ten times an H200's L2), at most 32."""
    return max(2, min(32, -(-512 * 10**6 // per_layer_bytes)))


def bench(block_size: int = 16) -> list[dict]:
    from engine.backends.cuda import triton_attention as ta

    H, dtype, esize = KVH * GROUP, torch.bfloat16, 2
    rows = []
    cases = [(b, "512", [512] * b) for b in (1, 16, 64, 128, 256)]
    cases += [(b, "128-2048", spread_lengths(b, 128, 2048, seed=b)) for b in (16, 64, 128)]
    cases += [(1, "32768", [32768]), (4, "8192", [8192] * 4)]
    for B, label, lens in cases:
        max_blocks = -(-max(lens) // block_size)
        num_blocks = B * max_blocks
        per_layer = 2 * num_blocks * block_size * KVH * D * esize
        nl = _layers(per_layer)
        k = torch.randn(nl, num_blocks, block_size, KVH, D, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        tables = torch.randperm(num_blocks, device="cuda").view(B, max_blocks).to(torch.int32)
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        splits = ta.choose_num_splits(B, KVH, max_blocks * block_size, ta.num_sms_of(q.device))
        for ns in sorted({1, splits}):
            ws = ta.alloc_decode_workspace(B, H, D, ns, "cuda")
            fns = [lambda i=i: ta.paged_decode_attention(q, k[i], v[i], tables, ctx, D ** -0.5, out,
                                                         num_splits=ns, workspace=ws) for i in range(nl)]
            t = _time_graph(fns)
            nbytes = sum(lens) * KVH * D * 2 * esize + 2 * q.nbytes
            rows.append({"kernel": "decode", "batch": B, "contexts": label, "num_splits": ns,
                         "default": ns == splits, "us": round(t * 1e6, 2), "GB/s": round(nbytes / t / 1e9, 1)})
            print(rows[-1], flush=True)
        del k, v
        torch.cuda.empty_cache()
    # Prefill: 8 prompts of 1024 tokens, causal.
    n, S = 1024, 8
    lens = [n] * S
    k, v, tables = make_paged(lens, KVH, D, block_size, dtype, "cuda")
    k.nan_to_num_(0.0)
    v.nan_to_num_(0.0)
    q = torch.randn(S * n, H, D, device="cuda", dtype=dtype)
    qsl = torch.arange(0, S * n + 1, n, device="cuda", dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    t = _time_graph([lambda: ta.paged_prefill_attention(q, k, v, tables, qsl, sl, D ** -0.5, out,
                                                        max_query_len=n)])
    flops = 4 * S * (n * (n + 1) / 2) * H * D  # QK^T and PV over the causal half
    rows.append({"kernel": "prefill", "batch": S, "contexts": str(n), "us": round(t * 1e6, 1),
                 "TFLOP/s": round(flops / t / 1e12, 1)})
    print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    import json
    import sys

    if not ON_CUDA:
        sys.exit("the benchmark needs a GPU")
    print(torch.cuda.get_device_name(), "triton", __import__("triton").__version__)
    result = bench()
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, "triton_attention_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
