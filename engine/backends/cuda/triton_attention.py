"""Paged attention kernels in Triton for the CUDA backend.

The KV cache of one layer is ``k_cache`` / ``v_cache`` of shape [num_blocks, block_size, num_kv_heads, head_dim]
(the last dimension contiguous). A sequence's token ``t`` lives in physical block ``block_tables[s, t // block_size]``
at row ``t % block_size``. The kernels read K/V through the block table in place: no gather, no mask tensor, and
never a block-table entry (or a cache row) past a sequence's length, so row tails may hold anything.

Two entry points:

* :func:`paged_decode_attention`: one query token per sequence (flash-decoding). Stage 1 runs one program per
  (sequence, KV head, split); the program loads its KV head's whole group of query heads, so every K/V tile is read
  once per group. Long contexts are cut into ``num_splits`` contiguous ranges whose partial (max, sum, acc) go to a
  workspace; stage 2 merges them. With one split, stage 1 writes the output directly. CUDA-graph capturable: the
  grid depends on shapes and ``num_splits`` only, nothing syncs with the host, and a preallocated ``workspace``
  (:func:`alloc_decode_workspace`) makes the call allocation-free.
* :func:`paged_prefill_attention`: varlen causal attention for prefill / chunked prefill over a cached prefix. Each
  program takes a tile of one sequence's query tokens times its KV head's group of query heads, and streams that
  sequence's cached K/V once for the whole tile.

Both use fp32 accumulation and an online softmax in the exp2 domain (the scale is folded with log2(e)).

GQA packing: a decode program computes ``S = Q_group @ K^T`` with ``tl.dot``, the group padded to at least 16 rows
(the minimum tile of an MMA). The padding rows cost tensor-core work only; decode attention is bound by the bytes of
K/V it reads, which are loaded once per group whatever the group size, and one code path serves every ratio from
MHA (group 1) to MQA.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Stage 2 holds all of a head's partials in registers: [MAX_NUM_SPLITS, head_dim] fp32.
MAX_NUM_SPLITS = 64
# A split shorter than this is not worth its partial's write and merge (see choose_num_splits).
MIN_TOKENS_PER_SPLIT = 256


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100/H200-sized 132 for a CPU tensor, i.e. the interpreter)."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def _kv_tile(head_dim_padded: int, elem_size: int) -> int:
    """Tokens of K/V a program loads per iteration: rows of up to 256 bytes take 64-token tiles (16 KiB each of K
    and V, e.g. bf16 at head_dim 128), wider rows (fp32, or head_dim 256) proportionally fewer, so that a tile's
    registers and pipelined shared-memory buffers stay within one SM's budget."""
    row = head_dim_padded * elem_size
    return 64 if row <= 256 else 32 if row <= 512 else 16


def _prefill_config(head_dim_padded: int, elem_size: int, group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) of the prefill kernel. BLOCK_M rows are (query token, group head) pairs:
    128 rows over 8 warps for long 16-bit prompts at head_dim <= 128; else 64 rows over 4 warps (short chunks,
    decode-like rows, head_dim 256), 32 for fp32 at head_dim >= 128. An fp32 cache also pipelines over 2 stages
    instead of 3. Each choice keeps a program's tiles in registers (no spills) and its buffers in shared memory."""
    big = head_dim_padded <= 128 and elem_size == 2 and max_query_len * group >= 128
    rows = 128 if big else 32 if elem_size == 4 and head_dim_padded >= 128 else 64
    return max(rows, _pow2(group)), 8 if big else 4, 3 if elem_size == 2 else 2


# ----------------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------------


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> int:
    """Splits per (sequence, KV head) for :func:`paged_decode_attention`.

    One split when the (sequence, KV head) programs alone fill the GPU (at least one per SM): then splitting only adds
    partial writes and a second kernel. Otherwise enough splits for about two programs per SM, but no more than
    the longest possible context cut into MIN_TOKENS_PER_SPLIT-token pieces, and at most MAX_NUM_SPLITS; rounded
    down to a power of two, since each count is a kernel of its own: a handful of them, all compiled at start
    (`compile_variants`), never one in the middle of serving.

    ``max_context_len`` must come from shapes or configuration (``block_tables.shape[1] * block_size``, or the
    model's window) rather than from context_lens, so that a captured CUDA graph keeps its grid. Sequences shorter
    than the longest use fewer splits inside the kernel (the surplus programs exit at once)."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    splits = triton.cdiv(2 * num_sms, programs)
    splits = min(splits, triton.cdiv(max(1, max_context_len), MIN_TOKENS_PER_SPLIT), MAX_NUM_SPLITS)
    return 1 << (max(1, splits).bit_length() - 1)


def split_counts(num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> list[int]:
    """Every split count :func:`choose_num_splits` can give for this model and window (any batch size)."""
    top = choose_num_splits(1, num_kv_heads, max_context_len, num_sms)
    return [1 << i for i in range(top.bit_length())]


def decode_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the split-K workspace: partial outputs [B, H, S, D], then (max, sum) pairs [B, H, S, 2]."""
    if num_splits <= 1:
        return 0
    return num_seqs * num_heads * num_splits * (head_dim + 2)


def alloc_decode_workspace(num_seqs: int, num_heads: int, head_dim: int, num_splits: int,
                           device: torch.device | str) -> torch.Tensor:
    """A workspace for :func:`paged_decode_attention` at up to ``num_seqs`` sequences and ``num_splits`` splits.
    Allocate it once for the largest batch (and largest split count) that will be captured; any smaller call can
    share it. Its contents need no initialisation."""
    n = decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits)
    return torch.empty(max(1, n), dtype=torch.float32, device=device)


@triton.jit
def _scores_and_values(q, k_base, v_base, bt_row, tok, n_mask, d_mask, offs_d, stride_kb, stride_kt, stride_vb,
                       stride_vt, BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr):
    """One K/V tile of a sequence, read in place through its block table (the block ids of the tile's tokens are
    masked past the context, so a row's tail is never read): the scores q @ K^T (unscaled) and the tile's V."""
    blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = (tok % BLOCK_SIZE).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + blk[:, None] * stride_kb + row[:, None] * stride_kt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_base + blk[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    else:
        s = tl.dot(q, tl.trans(k))
    return s, v


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold one tile's scaled, masked scores `s` (finite in every row's max) and values `v` into a row's running
    max `m_i`, denominator `l_i` and output `acc` (log2 domain): the updated (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the step's widest block table: one kernel for every width
def _decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # tokens per iteration
    DOT_F32: tl.constexpr,  # upcast dot operands (interpreter, or an fp32 cache)
    DOT_PREC: tl.constexpr,  # input_precision of the fp32 dots
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(ctx_ptr + seq)
    num_tiles = tl.cdiv(ctx, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    if NUM_SPLITS > 1:
        # An empty split (a short sequence, or a padded slot of context 0) writes nothing: stage 2 derives the
        # same split count from the context length and never reads it.
        if tile_lo >= tile_hi:
            return

    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for tile in range(tile_lo, tile_hi):
        tok = tile * TILE_N + offs_n
        n_mask = tok < ctx
        s, v = _scores_and_values(q, k_base, v_base, bt_row, tok, n_mask, d_mask, offs_d, stride_kb, stride_kt,
                                  stride_vb, stride_vt, BLOCK_SIZE, DOT_F32, DOT_PREC)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        # Every tile in [tile_lo, tile_hi) holds at least one token < ctx, so each row's max is finite.
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_F32, DOT_PREC)

    if NUM_SPLITS == 1:
        # Direct output; a context of 0 gives l_i == 0 and zeros.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials, indexed [seq, head, split]; acc unnormalised (relative to this split's max).
        idx = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + idx * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_stage2_kernel(
    ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    stride_ob, stride_oh,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,  # stage 1's tile, to count the splits it filled
):
    seq = tl.program_id(0)
    head = tl.program_id(1)

    ctx = tl.load(ctx_ptr + seq)
    num_tiles = tl.cdiv(ctx, TILE_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), 1)
    active = tl.cdiv(num_tiles, tiles_per_split)  # splits stage 1 wrote; 0 for an empty context

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < active
    d_mask = offs_d < HEAD_DIM
    idx = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + idx * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + idx * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(active > 0, m_max, 0.0)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l, axis=0)
    denom = tl.where(denom > 0, denom, 1.0)
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


# Whether this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when it was imported).
# The interpreter computes tl.dot on bf16 operands wrongly (numpy has no bf16), so there the kernels upcast their
# dot operands to fp32; compiled for a GPU, they stay in the cache dtype (tensor cores).
INTERPRETED = type(_decode_stage1_kernel).__name__ == "InterpretedFunction"


def _dot_precision() -> str:
    """Precision of the dots over an fp32 cache: exact fp32 in the interpreter (numpy); on a GPU "tf32x3", three
    tensor-core TF32 products whose sum is as accurate as fp32 FMA, where an "ieee" FMA dot of these tiles would
    spill registers."""
    return "ieee" if INTERPRETED else "tf32x3"


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the head dimension of q, out, k_cache and v_cache must be contiguous")
    if q.shape[-1] != k_cache.shape[3] or out.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, out {tuple(out.shape)} and cache head_dim {k_cache.shape[3]} differ")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the cache ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    if q.shape[-2] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k_cache.shape[2]} KV heads")


@functools.lru_cache(maxsize=256)
def _decode_meta(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype,
                 num_splits: int) -> tuple[dict, dict]:
    """Compile-time parameters and launch options of the two decode kernels (stage 2's unused with one split).
    Cached: the callers spread the dicts into a launch and never change them."""
    group = num_heads // num_kv_heads
    block_d = _pow2(head_dim, 16)
    tile_n = _kv_tile(block_d, cache_dtype.itemsize)
    stage1 = dict(NUM_SPLITS=num_splits, GROUP=group, BLOCK_G=_pow2(group, 16), HEAD_DIM=head_dim, BLOCK_D=block_d,
                  BLOCK_SIZE=block_size, TILE_N=tile_n, DOT_F32=INTERPRETED or cache_dtype == torch.float32,
                  DOT_PREC=_dot_precision(), num_warps=4)
    stage2 = dict(NUM_SPLITS=num_splits, BLOCK_S=_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
                  TILE_N=tile_n, num_warps=4)
    return stage1, stage2


def _strides(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_tables: torch.Tensor) -> tuple[int, ...]:
    """The strides the decode and prefill kernels take, in their order: q's and out's token and head strides, each
    cache's block, slot and head strides, the block table's row stride."""
    return (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, *, num_splits: int | None = None,
                           workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q, out: [B, H, D] (out in q's dtype; q and out may be strided views with a contiguous last dim).
    k_cache, v_cache: [num_blocks, block_size, KVH, D]. block_tables: int32 [B, max_blocks].
    context_lens: int32 [B], the tokens each query attends to, its own (already in the cache) included; 0 for a
    padded slot, whose output is zeros. num_splits: None picks :func:`choose_num_splits` from shapes only.
    workspace: fp32, at least :func:`decode_workspace_numel` elements when num_splits > 1; allocated here if None.
    """
    _check_cache(q, k_cache, v_cache, out)
    B, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    if B == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(B, KVH, block_tables.shape[1] * block_size, num_sms_of(q.device))
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")
    part_acc = part_ml = out  # placeholders, unused with one split
    if num_splits > 1:
        need = decode_workspace_numel(B, H, D, num_splits)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < need or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous fp32 tensor of >= {need} elements")
        part_acc = workspace[: B * H * num_splits * D]
        part_ml = workspace[B * H * num_splits * D: need]
    meta1, meta2 = _decode_meta(H, KVH, D, block_size, k_cache.dtype, num_splits)
    _decode_stage1_kernel[(B, KVH, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        scale * LOG2E,
        *_strides(q, out, k_cache, v_cache, block_tables),
        H,
        **meta1,
    )
    if num_splits > 1:
        _decode_stage2_kernel[(B, H)](
            context_lens, out, part_acc, part_ml,
            out.stride(0), out.stride(1),
            H,
            **meta2,
        )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Prefill (varlen, causal, over the paged cache)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seqlen_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,  # rows of the tile: (query token, head of the group) pairs, a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Query tiles in reverse: a sequence's last tiles attend to the most keys, so they start first and the short
    # ones fill in behind them.
    qblk = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if qblk * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seqlen_ptr + seq)
    prefix = seq_len - q_len  # tokens before this sequence's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    qpos = qblk * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kvh * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (qpos < q_len)
    d_mask = offs_d < HEAD_DIM
    io_mask = m_mask[:, None] & d_mask[None, :]
    tok_q = (q_start + qpos).to(tl.int64)

    q = tl.load(q_ptr + tok_q[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causal limit: query qpos sees tokens < prefix + qpos + 1. The tile's last query bounds the KV range.
    q_last = tl.minimum(qblk * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = prefix + q_last + 1
    limit = prefix + qpos + 1  # per row
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start in range(0, kv_end, TILE_N):
        tok = start + offs_n
        n_mask = tok < kv_end
        s, v = _scores_and_values(q, k_base, v_base, bt_row, tok, n_mask, d_mask, offs_d, stride_kb, stride_kt,
                                  stride_vb, stride_vt, BLOCK_SIZE, DOT_F32, DOT_PREC)
        # Token 0 is visible to every row (padding rows included), so each row's max is finite from the first tile.
        s = tl.where(tok[None, :] < limit[:, None], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_F32, DOT_PREC)

    o = acc / l_i[:, None]
    tl.store(out_ptr + tok_q[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


@functools.lru_cache(maxsize=256)
def _prefill_meta(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype,
                  max_query_len: int) -> dict:
    """Compile-time parameters and launch options of the prefill kernel."""
    group = num_heads // num_kv_heads
    block_d = _pow2(head_dim, 16)
    elem = cache_dtype.itemsize
    block_m, num_warps, num_stages = _prefill_config(block_d, elem, group, max_query_len)
    return dict(GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_SIZE=block_size, TILE_N=_kv_tile(block_d, elem),
                DOT_F32=INTERPRETED or cache_dtype == torch.float32, DOT_PREC=_dot_precision(),
                num_warps=num_warps, num_stages=num_stages)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, out: torch.Tensor, *, max_query_len: int) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's paged cache (prefill, chunked prefill, prefix
    reuse; also decode, as q_len 1).

    q, out: [T, H, D], the new tokens of S sequences packed; query_start_loc: int32 [S+1] cumulative offsets.
    seq_lens: int32 [S], each sequence's total tokens in the cache; its queries are its last q_len tokens (already
    written to the cache), and query i attends to tokens [0, seq_len - q_len + i]. A sequence with q_len 0 is
    skipped. block_tables: int32 [S, max_blocks]. max_query_len: a host int >= every q_len (sizes the grid).
    """
    _check_cache(q, k_cache, v_cache, out)
    T, H, D = q.shape
    S = query_start_loc.shape[0] - 1
    _, block_size, KVH, _ = k_cache.shape
    if T == 0 or S <= 0 or max_query_len <= 0:
        return out
    meta = _prefill_meta(H, KVH, D, block_size, k_cache.dtype, max_query_len)
    grid = (triton.cdiv(max_query_len, meta["BLOCK_Q"]), S, KVH)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E,
        *_strides(q, out, k_cache, v_cache, block_tables),
        **meta,
    )
    return out


def compile_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_context_len: int,
                     scratch_block: int = 0) -> int:
    """Launch each kernel variant a step of this model can need once, on a padded row, so that Triton compiles
    them all at start and not in the middle of serving, where a first compile stalls every running request: the
    decode kernels at every split count `split_counts` gives (an eager decode's count follows its step's widest
    context), and the prefill kernel at its short- and long-query configurations. The decodes attend to nothing
    (context length 0); the prefills read the scratch block and write a throwaway output. Returns the launches."""
    _, block_size, kvh, hd = k_cache.shape
    dev, dt = k_cache.device, k_cache.dtype
    table = torch.full((1, 1), scratch_block, dtype=torch.int32, device=dev)
    n = 0
    q = torch.zeros(1, num_heads, hd, dtype=dt, device=dev)
    out = torch.empty_like(q)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    for s in split_counts(kvh, max_context_len, num_sms_of(dev)):
        paged_decode_attention(q, k_cache, v_cache, table, zero, 1.0, out, num_splits=s)
        n += 1
    group = num_heads // kvh
    for t in sorted({1, -(-128 // group)}):  # both sides of _prefill_config's line (queries x group = 128)
        qp = torch.zeros(t, num_heads, hd, dtype=dt, device=dev)
        starts = torch.tensor([0, t], dtype=torch.int32, device=dev)
        lens = torch.tensor([t], dtype=torch.int32, device=dev)
        tables = torch.full((1, -(-t // block_size)), scratch_block, dtype=torch.int32, device=dev)
        paged_prefill_attention(qp, k_cache, v_cache, tables, starts, lens, 1.0, torch.empty_like(qp),
                                max_query_len=t)
        n += 1
    return n
