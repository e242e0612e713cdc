"""engine.backends.cuda.triton_attention against a gather + masked-softmax reference, on CPU tensors through
Triton's interpreter. Shapes are small: the interpreter runs each program in numpy.
tests/gpu/test_triton_attention_cuda.py runs the same checks compiled on a GPU at realistic sizes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a GPU is present: tests/gpu/test_triton_attention_cuda.py runs these kernels compiled",
                allow_module_level=True)
# triton.jit picks the interpreter at decoration time, triton's own library functions (tl.cdiv, tl.max, ...)
# included, so the variable must be set before triton is first imported in this process.
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton); the CUDA backend's kernels need it")
import triton.language as tl  # noqa: E402

if type(tl.cdiv).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (set it in the environment to run "
                "these tests in a CPU-only process)", allow_module_level=True)

from tests.paged_attention_reference import (  # noqa: E402
    COMPILE_CASES, TOL, assert_close, make_paged, patch_interpreter_for_numpy, reference_attention, run_decode_case,
    run_prefill_case)


patch_interpreter_for_numpy()
from engine.backends.cuda import triton_attention as ta  # noqa: E402

assert ta.INTERPRETED


# ---------------------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------------------

BS = 16
# 1, block_size - 1, block_size, a few blocks, long, and a padded slot of context 0.
MIXED = [1, BS - 1, BS, 3 * BS + 5, 0, 9 * BS + 3]


@pytest.mark.parametrize("group,head_dim,dtype", [
    (1, 64, torch.float32),
    (4, 128, torch.bfloat16),
    (8, 64, torch.bfloat16),
    (4, 80, torch.float32),
])
def test_decode_mixed_lengths_split_and_unsplit(group, head_dim, dtype):
    one = run_decode_case(MIXED, group, head_dim, BS, dtype, "cpu", num_splits=1)
    split = run_decode_case(MIXED, group, head_dim, BS, dtype, "cpu", num_splits=4)
    torch.testing.assert_close(one.float(), split.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert (one[4] == 0).all() and (split[4] == 0).all()


def test_decode_block_size_32_many_splits_and_auto():
    # More splits than a short sequence has tiles: the surplus splits stay empty and are never merged.
    run_decode_case([3, 33, 200], 2, 64, 32, torch.float16, "cpu", num_splits=7)
    run_decode_case([3, 33, 200], 2, 64, 32, torch.float16, "cpu", num_splits=None)


@pytest.mark.parametrize("group,head_dim,block_size", [(2, 96, 64), (1, 256, 16), (3, 64, 8)])
def test_decode_other_head_dims_block_sizes_and_groups(group, head_dim, block_size):
    # head_dim 96 and 256 (BLOCK_D 128 / 256 and a 32-token tile), blocks of 64 (a tile inside one block) and
    # of 8 (a tile across eight blocks), and a group of 3 (padded to 16 rows, 13 of them masked).
    lens = [1, block_size, 2 * block_size + 1, 70]
    one = run_decode_case(lens, group, head_dim, block_size, torch.float16, "cpu", num_splits=1)
    split = run_decode_case(lens, group, head_dim, block_size, torch.float16, "cpu", num_splits=3)
    torch.testing.assert_close(one, split, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_decode_strided_q_out_and_preallocated_workspace():
    # q and out as views into wider buffers (as when q is a slice of a fused qkv projection).
    seq_lens, kvh, group, d = [5, 70], 2, 2, 64
    k, v, tables = make_paged(seq_lens, kvh, d, BS, torch.float32, "cpu")
    H = kvh * group
    qkv = torch.randn(2, H + 2 * kvh, d)
    q = qkv[:, :H]
    out_buf = torch.full((2, H + 1, d), 7.0)
    out = out_buf[:, :H]
    ctx = torch.tensor(seq_lens, dtype=torch.int32)
    ws = ta.alloc_decode_workspace(8, H, d, 4, "cpu")  # sized for a larger batch, shared
    ta.paged_decode_attention(q, k, v, tables, ctx, 0.125, out, num_splits=4, workspace=ws)
    ref = reference_attention(q, k, v, tables, torch.arange(3, dtype=torch.int32), ctx, 0.125)
    assert_close(out, ref, torch.float32)
    assert (out_buf[:, H] == 7.0).all()
    with pytest.raises(ValueError, match="workspace"):
        ta.paged_decode_attention(q, k, v, tables, ctx, 0.125, out, num_splits=4, workspace=ws[:10])


def test_decode_all_padded_batch():
    out = run_decode_case([0, 0], 4, 64, BS, torch.bfloat16, "cpu", num_splits=3)
    assert (out == 0).all()


def test_choose_num_splits():
    assert ta.choose_num_splits(64, 8, 4096, 132) == 1  # programs alone fill the GPU
    assert ta.choose_num_splits(1, 8, 4096, 132) == 16  # context-capped: 4096 / 256
    assert ta.choose_num_splits(1, 8, 100_000, 132) == 32  # two programs per SM (33), as a power of two
    assert ta.choose_num_splits(1, 1, 10**7, 1000) == ta.MAX_NUM_SPLITS
    assert ta.choose_num_splits(4, 8, 128, 132) == 1  # short contexts are not split
    assert ta.split_counts(8, 100_000, 132) == [1, 2, 4, 8, 16, 32]
    assert ta.split_counts(8, 4096, 132) == [1, 2, 4, 8, 16]
    assert all(ta.choose_num_splits(b, 8, ctx, 132) in ta.split_counts(8, 8192, 132)
               for b in range(1, 40) for ctx in range(16, 8193, 112))
    assert ta.decode_workspace_numel(4, 32, 128, 1) == 0
    assert ta.decode_workspace_numel(4, 32, 128, 8) == 4 * 32 * 8 * 130


def test_compile_variants_launches_every_split_count_and_both_prefill_configs_without_touching_the_cache():
    """A start-up warm-up on a padded row: every split count the window allows, the prefill kernel at a short and
    a long query; the cache's blocks are only read (the scratch block), its contents unchanged."""
    torch.manual_seed(0)
    k = torch.randn(5, 16, 2, 64, dtype=torch.bfloat16)  # 4 blocks and a scratch block of 16 tokens
    v = torch.randn_like(k)
    k0, v0 = k.clone(), v.clone()
    n = ta.compile_variants(k, v, num_heads=8, max_context_len=4096, scratch_block=4)
    assert n == len(ta.split_counts(2, 4096, 132)) + 2  # 1..16 splits, and the prefill's two configurations
    assert torch.equal(k, k0) and torch.equal(v, v0)


# ---------------------------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group,head_dim,dtype", [
    (1, 64, torch.float32),
    (4, 128, torch.bfloat16),
    (8, 64, torch.bfloat16),
    (4, 80, torch.float32),
])
def test_prefill_varlen_over_cached_prefix(group, head_dim, dtype):
    # Full prompts (1, 20), chunks over a cached prefix (7 of 40, 16 of 50), a decode-like row (1 of 33),
    # and a sequence with no new tokens.
    q_lens = [1, 20, 7, 1, 0, 16]
    seq_lens = [1, 20, 40, 33, 12, 50]
    run_prefill_case(q_lens, seq_lens, group, head_dim, BS, dtype, "cpu")


def test_prefill_group_of_three_and_head_dim_256():
    # A group of 3 packs 21 query tokens x 3 heads into a 64-row tile (one row masked).
    run_prefill_case([30, 4], [45, 4], 3, 64, 16, torch.float16, "cpu")
    run_prefill_case([9, 1], [20, 17], 2, 256, 32, torch.bfloat16, "cpu")


def test_prefill_matches_decode_for_single_tokens():
    seq_lens = [1, 15, 16, 53]
    dec = run_decode_case(seq_lens, 4, 64, BS, torch.float32, "cpu", num_splits=2)
    pre = run_prefill_case([1] * 4, seq_lens, 4, 64, BS, torch.float32, "cpu")
    torch.testing.assert_close(dec, pre, atol=1e-5, rtol=1e-5)


def test_prefill_long_chunk_spans_query_tiles():
    # A 70-token chunk at group 2 spans two query tiles of 64 rows (32 tokens x 2 heads) ... and more.
    run_prefill_case([70, 3], [90, 3], 2, 64, 32, torch.bfloat16, "cpu")


def test_bad_shapes_raise():
    k, v, tables = make_paged([4], 2, 64, BS, torch.float32, "cpu")
    q = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match="multiple"):
        ta.paged_decode_attention(q, k, v, tables, torch.tensor([4], dtype=torch.int32), 1.0, torch.empty_like(q))
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="num_splits"):
        ta.paged_decode_attention(q, k, v, tables, torch.tensor([4], dtype=torch.int32), 1.0, torch.empty_like(q),
                                  num_splits=0)
    with pytest.raises(ValueError, match="dtype"):
        ta.paged_decode_attention(q.half(), k, v, tables, torch.tensor([4], dtype=torch.int32), 1.0,
                                  torch.empty_like(q.half()))


# ---------------------------------------------------------------------------------------------------------------
# Compiled for Hopper, without a GPU
# ---------------------------------------------------------------------------------------------------------------

# The most dynamic shared memory one block may take on an H100/H200 (227 KiB).
HOPPER_SMEM = 227 * 1024


def test_kernels_compile_for_hopper_without_spills():
    """The interpreter accepts code the GPU compiler may not; Triton's own compiler and ptxas (shipped in its
    wheel) build the kernels for sm_90 here, with no GPU, in a process without TRITON_INTERPRET. Every variant
    must compile and fit an SM's shared memory, and the 16-bit kernels (the fast path) must not spill registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.paged_attention_reference import compile_report; compile_report()"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    expected = sum(2 if kind == "decode" and n > 1 else 1 for kind, *_, n in COMPILE_CASES)
    assert len(rows) == expected, r.stdout
    for row in rows:
        assert row["shared"] <= HOPPER_SMEM, row
        if row["dtype"] != "fp32" and "local" in row:
            assert row["local"] == 0 and row["stack"] == 0, row


def test_the_start_up_compile_covers_the_split_count_of_a_window_in_whole_blocks():
    """A decode picks its split count from its block table's width in tokens (whole blocks): at block size 48 a
    256-token window is read as 288 tokens, which takes two splits where 256 took one; the start-up compile is
    sized by that width, so none of its counts compiles while requests run."""
    from engine.backends.cuda.backend import decode_window

    assert decode_window(256, 48) == 288 and decode_window(256, 16) == 256
    assert ta.split_counts(8, 256) == [1] and ta.choose_num_splits(1, 8, 288) == 2
    assert ta.choose_num_splits(1, 8, 288) in ta.split_counts(8, decode_window(256, 48))
