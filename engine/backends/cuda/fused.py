"""Fused small ops of the decoder's layer for the CUDA backend, in Triton: RMSNorm (alone or with the residual add
before it), silu(gate) * up, and RoPE on q and k with the K/V cache write.

Each kernel reads its inputs once and writes its outputs once (a memory-bound op costs its bytes), with the numerics
of the torch path it replaces (HF's), so greedy tokens stay exact:

* :func:`rms_norm`: statistics in fp32, the normalised row cast to the input's dtype, then the weight applied in the
  promoted dtype (``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``).
* :func:`add_rms_norm`: ``h + delta`` rounded to h's dtype (as torch's add), then :func:`rms_norm` of that sum.
* :func:`silu_mul`: ``F.silu(g) * u`` over the fused gate|up projection's output: silu in fp32 rounded to the input's
  dtype (as F.silu), the product in fp32 rounded again (as torch's mul).
* :func:`rope_write`: HF's ``q * cos + rotate_half(q) * sin`` with its three roundings in the activations' dtype,
  q and k rotated in place in the fused qkv projection's output, the rotated k and the v rows written into the paged
  cache (``[num_blocks, block_size, kv_heads, head_dim]``) at each token's flat slot.

All are CUDA-graph capturable: the grid and compile-time parameters come from shapes only, nothing reads a tensor's
values on the host, and outputs are allocated from shapes (or given). Under ``TRITON_INTERPRET=1`` they run on CPU
tensors (CI); there the blocks are larger (fewer programs: the interpreter runs each in numpy) and fp32 -> bf16
casts round to nearest even by hand (the interpreter's own cast truncates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# A row of up to this many elements is normalised from registers in one read; a longer one in chunks of this size,
# read twice (the second read mostly from L2).
MAX_BLOCK_N = 16384


@triton.jit
def _round(x, dtype: tl.constexpr, FIX_BF16: tl.constexpr):
    """fp32 `x` rounded to `dtype` (nearest even). FIX_BF16: the interpreter's fp32 -> bf16 cast truncates, so the
    rounding is done on the bits first (the cast is then exact)."""
    if FIX_BF16:
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm, with an optional residual add before it
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # the step's token count: one kernel for every count
def _rms_norm_kernel(x_ptr, d_ptr, s_ptr, w_ptr, y_ptr, M, N, stride_x, stride_d, stride_s, stride_y, eps,
                     ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                     FIX_BF16: tl.constexpr):
    """Rows [pid * BLOCK_M, +BLOCK_M) of x [M, N]. ADD: s = x + d (rounded to x's dtype) is stored to s_ptr and
    normalised instead of x."""
    X_DT: tl.constexpr = x_ptr.dtype.element_ty
    Y_DT: tl.constexpr = y_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        cmask = cols < N
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if ADD:
            d = tl.load(d_ptr + rows[:, None] * stride_d + cols[None, :], mask=m, other=0.0).to(tl.float32)
            s = _round(x + d, X_DT, FIX_BF16)
            tl.store(s_ptr + rows[:, None] * stride_s + cols[None, :], s, mask=m)
            x = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        n = _round(x * rstd[:, None], X_DT, FIX_BF16).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = _round(w[None, :] * n, Y_DT, FIX_BF16)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=m)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            c = off + cols
            m = rmask[:, None] & (c < N)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
            if ADD:
                d = tl.load(d_ptr + rows[:, None] * stride_d + c[None, :], mask=m, other=0.0).to(tl.float32)
                s = _round(x + d, X_DT, FIX_BF16)
                tl.store(s_ptr + rows[:, None] * stride_s + c[None, :], s, mask=m)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)
        if ADD:
            tl.debug_barrier()  # the sums stored above are read back below, possibly by other threads of the block
        src_ptr = s_ptr if ADD else x_ptr
        stride_src = stride_s if ADD else stride_x
        for off in range(0, N, BLOCK_N):
            c = off + cols
            cm = c < N
            m = rmask[:, None] & cm[None, :]
            x = tl.load(src_ptr + rows[:, None] * stride_src + c[None, :], mask=m, other=0.0).to(tl.float32)
            n = _round(x * rstd[:, None], X_DT, FIX_BF16).to(tl.float32)
            w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[:, None] * stride_y + c[None, :], _round(w[None, :] * n, Y_DT, FIX_BF16), mask=m)


def _interpreted() -> bool:
    return type(_rms_norm_kernel).__name__ == "InterpretedFunction"


# Whether these kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = _interpreted()


def _norm_config(M: int, N: int, max_block: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, ONE_PASS, num_warps). On a GPU: one row per program from 2048 elements up, else enough
    rows to make a program ~2048 elements; 16-byte loads per thread at 4-16 warps. Interpreted: as many rows as fit
    64K elements (few programs)."""
    block_n = min(triton.next_power_of_2(N), max_block)
    one_pass = block_n >= N
    if INTERPRETED:
        block_m = max(1, min(triton.next_power_of_2(M), 65536 // block_n))
        return block_m, block_n, one_pass, 1
    block_m = max(1, 2048 // block_n)
    return block_m, block_n, one_pass, max(1, min(16, block_m * block_n // 512))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, N] with a contiguous last dim (a view where it can be)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _launch_norm(x2, d2, s2, weight, y2, eps, max_block):
    M, N = x2.shape
    if M == 0:
        return
    block_m, block_n, one_pass, warps = _norm_config(M, N, max_block)
    d2 = x2 if d2 is None else d2
    s2 = x2 if s2 is None else s2
    _rms_norm_kernel[(triton.cdiv(M, block_m),)](
        x2, d2, s2, weight, y2, M, N, x2.stride(0), d2.stride(0), s2.stride(0), y2.stride(0), float(eps),
        ADD=d2 is not x2, BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass, FIX_BF16=INTERPRETED,
        num_warps=warps)


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{x.shape[-1]}] vector, got {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             _max_block: int = MAX_BLOCK_N) -> torch.Tensor:
    """HF's RMSNorm of the rows of x [..., N]: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, statistics in
    fp32. Returns y (or fills `out`), shaped like x, in the promoted dtype of weight and x."""
    _check_norm(x, weight)
    x2 = _rows(x)
    dt = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=dt, device=x.device) if out is None else out
    if y.shape != x.shape or y.dtype != dt or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {dt} tensor")
    _launch_norm(x2, None, None, weight, y.view(-1, x.shape[-1]), eps, _max_block)
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 h_out: torch.Tensor | None = None, _max_block: int = MAX_BLOCK_N) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: ``h_new = h + delta`` (rounded to h's dtype, as torch's
    add) and ``y = rms_norm(h_new, weight, eps)``. h_new is written IN PLACE into h unless `h_out` is given
    (h_out may be h). h, delta: [M, N] with contiguous rows (delta in any float dtype). Returns (h_new, y)."""
    _check_norm(h, weight)
    if h.dim() != 2 or delta.shape != h.shape or h.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError(f"h {tuple(h.shape)} and delta {tuple(delta.shape)} must be [M, N] with contiguous rows")
    s = h if h_out is None else h_out
    if s.shape != h.shape or s.dtype != h.dtype or s.stride(-1) != 1:
        raise ValueError(f"h_out must be a {tuple(h.shape)} {h.dtype} tensor with contiguous rows")
    y = torch.empty(h.shape, dtype=torch.promote_types(weight.dtype, h.dtype), device=h.device)
    _launch_norm(h, delta, s, weight, y, eps, _max_block)
    return s, y


# ----------------------------------------------------------------------------------------------------------------
# silu(gate) * up
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(gu_ptr, out_ptr, M, N, stride_gu, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FIX_BF16: tl.constexpr):
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rows < M)[:, None] & (cols < N)[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(g_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + N, mask=m, other=0.0).to(tl.float32)
    a = _round(g / (1.0 + tl.exp(-g)), DT, FIX_BF16).to(tl.float32)  # F.silu, rounded to the dtype
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], _round(a * u, DT, FIX_BF16), mask=m)


def silu_mul(gu: torch.Tensor, n: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.silu(gu[:, :n]) * gu[:, n:]`` for the fused gate|up projection's output gu [M, 2n] (rows contiguous).
    Returns [M, n] in gu's dtype (or fills `out`)."""
    if gu.dim() != 2 or gu.shape[1] != 2 * n or gu.stride(1) != 1:
        raise ValueError(f"gu must be [M, {2 * n}] with contiguous rows, got {tuple(gu.shape)}")
    M = gu.shape[0]
    out = torch.empty(M, n, dtype=gu.dtype, device=gu.device) if out is None else out
    if out.shape != (M, n) or out.dtype != gu.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{M}, {n}] {gu.dtype} with contiguous rows")
    if M == 0:
        return out
    if INTERPRETED:
        block_n = min(triton.next_power_of_2(n), 4096)
        block_m, warps = max(1, min(triton.next_power_of_2(M), 65536 // block_n)), 1
    else:
        block_m, block_n, warps = 1, 1024, 4
    grid = (triton.cdiv(M, block_m), triton.cdiv(n, block_n))
    _silu_mul_kernel[grid](gu, out, M, n, gu.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                           FIX_BF16=INTERPRETED, num_warps=warps)
    return out


# ----------------------------------------------------------------------------------------------------------------
# RoPE on q and k, and the K/V cache write
# ----------------------------------------------------------------------------------------------------------------


# No FMA contraction in RoPE: LLVM narrows each rounded product to a bf16 op and would fuse one of them into the sum
# (fma.rn.bf16), skipping the product's rounding that torch's path makes (a last-bit difference in some
# of the elements).
ROPE_COMPILE = {"enable_fp_fusion": False}


@triton.jit(do_not_specialize=["R"])
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                       R, stride_t, stride_cos, stride_sin, stride_cb, stride_co, stride_ch,
                       stride_vb, stride_vo, stride_vh,
                       NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, RND: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, FIX_BF16: tl.constexpr):
    """Rows r = t * (H + 2 KV) + head of the packed step's heads, BLOCK_R at a time: q and k heads are rotated in
    place; k and v heads are written to the cache at the token's slot."""
    NH: tl.constexpr = NUM_HEADS + 2 * NUM_KV
    QKV_DT: tl.constexpr = qkv_ptr.dtype.element_ty
    CACHE_DT: tl.constexpr = k_cache_ptr.dtype.element_ty
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    t = (r // NH).to(tl.int64)
    head = r % NH
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    m = rmask[:, None] & dmask[None, :]
    base = qkv_ptr + t[:, None] * stride_t + head[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)

    rot = head < NUM_HEADS + NUM_KV  # q and k heads
    pos = tl.load(pos_ptr + t, mask=rmask & rot, other=0)
    mr = m & rot[:, None]
    c_base = cos_ptr + pos[:, None] * stride_cos + d[None, :]
    s_base = sin_ptr + pos[:, None] * stride_sin + d[None, :]
    c1 = tl.load(c_base, mask=mr, other=0.0).to(tl.float32)
    c2 = tl.load(c_base + HALF, mask=mr, other=0.0).to(tl.float32)
    s1 = tl.load(s_base, mask=mr, other=0.0).to(tl.float32)
    s2 = tl.load(s_base + HALF, mask=mr, other=0.0).to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product and the sum rounded to RND (HF's)
    o1 = _round(_round(f1 * c1, RND, FIX_BF16).to(tl.float32) + _round(-f2 * s1, RND, FIX_BF16).to(tl.float32),
                RND, FIX_BF16)
    o2 = _round(_round(f2 * c2, RND, FIX_BF16).to(tl.float32) + _round(f1 * s2, RND, FIX_BF16).to(tl.float32),
                RND, FIX_BF16)
    o1 = _round(o1.to(tl.float32), QKV_DT, FIX_BF16)
    o2 = _round(o2.to(tl.float32), QKV_DT, FIX_BF16)
    tl.store(base, o1, mask=mr)
    tl.store(base + HALF, o2, mask=mr)

    # the cache: rotated k, and v as it is
    is_k = rot & (head >= NUM_HEADS)
    is_v = head >= NUM_HEADS + NUM_KV
    kv = rmask & (is_k | is_v)
    slot = tl.load(slot_ptr + t, mask=kv, other=0).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    w1 = tl.where(is_k[:, None], o1.to(tl.float32), f1)
    w2 = tl.where(is_k[:, None], o2.to(tl.float32), f2)
    w1 = _round(w1, CACHE_DT, FIX_BF16)
    w2 = _round(w2, CACHE_DT, FIX_BF16)
    kh = tl.where(is_k, head - NUM_HEADS, 0)
    vh = tl.where(is_v, head - NUM_HEADS - NUM_KV, 0)
    k_dst = k_cache_ptr + (blk * stride_cb + off * stride_co + kh * stride_ch)[:, None] + d[None, :]
    v_dst = v_cache_ptr + (blk * stride_vb + off * stride_vo + vh * stride_vh)[:, None] + d[None, :]
    mk = m & is_k[:, None]
    mv = m & is_v[:, None]
    tl.store(k_dst, w1, mask=mk)
    tl.store(k_dst + HALF, w2, mask=mk)
    tl.store(v_dst, w1, mask=mv)
    tl.store(v_dst + HALF, w2, mask=mv)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> None:
    """RoPE (HF's rotate_half convention) on the q and k heads of qkv [T, (H + 2 KV) * hd], in place, and the
    rotated k and the v heads written into the paged cache at `slot_mapping` [T] (flat slot = block * block_size +
    offset; padding rows may point at a scratch block: they are written like any other).

    cos, sin: [max_positions, hd] tables indexed by `positions` [T] (HF's, the halves of a row may differ). The
    rotation is computed as HF's is: each of x * cos, rotate_half(x) * sin and their sum rounded to the promoted
    dtype of qkv and the tables. k_cache, v_cache: [num_blocks, block_size, KV, hd], head dim contiguous; the values
    are cast to the cache's dtype."""
    T = qkv.shape[0]
    NH = num_heads + 2 * num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] % NH or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {NH} * head_dim] with contiguous rows, got {tuple(qkv.shape)}")
    hd = qkv.shape[1] // NH
    if hd % 2:
        raise ValueError(f"head_dim {hd} must be even for RoPE")
    if cos.dim() != 2 or cos.shape[1] != hd or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos/sin must be [positions, {hd}] tables, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for c in (k_cache, v_cache):
        if c.dim() != 4 or c.shape[2:] != (num_kv_heads, hd) or c.stride(3) != 1:
            raise ValueError(f"k_cache/v_cache must be [blocks, block_size, {num_kv_heads}, {hd}], got "
                             f"{tuple(c.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache differ in shape or dtype")
    if positions.shape != (T,) or slot_mapping.shape != (T,):
        raise ValueError(f"positions and slot_mapping must be [{T}]")
    if T == 0:
        return
    rnd = _TL[torch.promote_types(qkv.dtype, cos.dtype)]
    R = T * NH
    half = hd // 2
    block_half = triton.next_power_of_2(half)
    if INTERPRETED:
        block_r, warps = max(1, min(triton.next_power_of_2(R), 16384 // block_half)), 1
    else:
        block_r, warps = max(1, 1024 // block_half), 4
    _rope_write_kernel[(triton.cdiv(R, block_r),)](
        qkv, cos, sin, positions, slot_mapping, k_cache, v_cache,
        R, qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=hd, HALF=half, BLOCK_SIZE=k_cache.shape[1], RND=rnd,
        BLOCK_R=block_r, BLOCK_HALF=block_half, FIX_BF16=INTERPRETED, num_warps=warps, **ROPE_COMPILE)
