"""engine.backends.cuda.triton_attention against a gather + masked-softmax reference, on CPU tensors through
Triton's interpreter (TRITON_INTERPRET=1). Shapes are small: the interpreter runs each program in numpy.
tests/gpu/test_triton_attention_cuda.py runs the same checks compiled on a GPU at realistic sizes."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the CUDA backend's kernels need it")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

from engine.backends.cuda import triton_attention as ta  # noqa: E402


def _interpreter_numpy_fix():
    """Triton <= 3.7's interpreter turns a scalar (a 1-element array there) into a loop bound with int(array),
    which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed in 3.8). Re-patch __index__ with an explicit
    element read on top of the interpreter's own patches (its scope restores both, last first)."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_kairos_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kairos_fix = True
    interpreter._patch_lang_tensor = patched


_interpreter_numpy_fix()


# ---------------------------------------------------------------------------------------------------------------
# Reference and fixtures (shared with tests/gpu/test_triton_attention_cuda.py)
# ---------------------------------------------------------------------------------------------------------------

def reference_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Per sequence: gather its tokens through the block table, expand GQA, causal softmax in fp32."""
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for s, L in enumerate(seq_lens.tolist()):
        a, b = qsl[s], qsl[s + 1]
        if b == a or L == 0:
            continue
        t = torch.arange(L, device=q.device)
        blocks = block_tables[s, t // bs].long()
        k = k_cache[blocks, t % bs].float().repeat_interleave(H // kvh, dim=1)  # [L, H, D]
        v = v_cache[blocks, t % bs].float().repeat_interleave(H // kvh, dim=1)
        qs = q[a:b].float()  # [n, H, D]
        n = b - a
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        qpos = L - n + torch.arange(n, device=q.device)
        scores = scores.masked_fill(t[None, None, :] > qpos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, extra_blocks=3, seed=0):
    """A cache holding the sequences in shuffled (non-contiguous) blocks. Every cache row that belongs to no
    sequence's context (free blocks, the rows past a context in its last block) is NaN, and each block-table row's
    tail past its context holds out-of-range ids: a kernel that reads either shows it."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // block_size) for L in seq_lens]
    max_blocks = max(nblk + [1]) + 2
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    tables = torch.randint(10**6, 2**30, (len(seq_lens), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for s, L in enumerate(seq_lens):
        for j in range(nblk[s]):
            blk = int(perm[used])
            used += 1
            tables[s, j] = blk
            rows = min(block_size, L - j * block_size)
            k[blk, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=g)
            v[blk, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=g)
    return k.to(device, dtype), v.to(device, dtype), tables.to(device)


TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "non-finite output: a kernel read a row or block it must not"
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def run_decode_case(seq_lens, group, head_dim, block_size, dtype, device, num_splits, num_kv_heads=2, seed=0):
    H = num_kv_heads * group
    k, v, tables = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    B = len(seq_lens)
    q = torch.randn(B, H, head_dim, generator=g).to(device, dtype)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    ta.paged_decode_attention(q, k, v, tables, ctx, scale, out, num_splits=num_splits)
    # One query per live sequence; a padded slot (context 0) has none, and its row must be zeros.
    ref = torch.zeros(B, H, head_dim, device=device)
    live = [i for i, L in enumerate(seq_lens) if L > 0]
    if live:
        ref[live] = reference_attention(q[live], k, v, tables[live], torch.arange(len(live) + 1, device=device),
                                        ctx[live], scale)
    assert_close(out, ref, dtype)
    return out


def run_prefill_case(q_lens, seq_lens, group, head_dim, block_size, dtype, device, num_kv_heads=2, seed=0):
    H = num_kv_heads * group
    k, v, tables = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    T = sum(q_lens)
    q = torch.randn(T, H, head_dim, generator=g).to(device, dtype)
    qsl = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill_attention(q, k, v, tables, qsl, sl, scale, out, max_query_len=max(q_lens))
    ref = reference_attention(q, k, v, tables, qsl, sl, scale)
    assert_close(out, ref, dtype)
    return out


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
    assert ta.choose_num_splits(1, 8, 100_000, 132) == 33  # two programs per SM
    assert ta.choose_num_splits(1, 1, 10**7, 1000) == ta.MAX_NUM_SPLITS
    assert ta.choose_num_splits(4, 8, 128, 132) == 1  # short contexts are not split
    assert ta.decode_workspace_numel(4, 32, 128, 1) == 0
    assert ta.decode_workspace_numel(4, 32, 128, 8) == 4 * 32 * 8 * 130


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
