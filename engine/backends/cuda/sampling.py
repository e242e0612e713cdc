"""Top-p (nucleus) draws on the GPU with no host sync, in Triton: rejection sampling under a rising pivot.

A row's nucleus is its smallest set of most likely tokens whose mass reaches top_p, ties at the last kept probability
kept in (as `engine.sampler`'s exact search): token j is in it iff the mass of the tokens strictly more likely than j
is below top_p. One program takes one row, in rounds:
- draw j from the tokens more likely than the pivot (at first: every token of non-zero probability), in proportion to
  their probabilities (inverse CDF with the round's uniform number; the scan stops at j);
- accept j if the mass strictly above p_j is below top_p (one pass over the row); else the pivot rises to p_j: every
  nucleus token is more likely than a rejected one, so the next draw's set still holds the whole nucleus.
Each draw is proportional to p over a set that holds the nucleus, so the accepted token is distributed exactly as a
draw from the renormalised nucleus, whatever the rounds before. A round accepts with probability at least
top_p / (the mass left), and the mass left shrinks with each rejection: a peaked row accepts in its first round, a
flat one within a few. After `ROUNDS` rejections (as good as never) the row's most likely token, always in the
nucleus, is taken.

The candidate search of `engine.sampler` needs a host sync to learn which rows it covered and an exact bisection of
31 passes for flat rows (a random-weight model's rows are flat); this reads each row about 1.5 times a round, and
the step's tokens stay on the device (overlap scheduling launches the next step before they reach the host).
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (CI).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUNDS = 32  # uniform numbers per row and step: a row's draw depends only on its own
_INTERPRETED = type(tl.cdiv).__name__ == "InterpretedFunction"


@triton.jit  # V and the strides are the model's: one kernel, compiled at start (CudaBackend.compile_kernels)
def _top_p_kernel(p_ptr, total_ptr, top_p_ptr, u_ptr, out_ptr, V, stride_p, stride_u,
                  ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = p_ptr + row * stride_p
    offs = tl.arange(0, BLOCK)
    tp = tl.load(top_p_ptr + row)
    mass = tl.load(total_ptr + row)  # of the tokens above the pivot
    lo = mass * 0.0  # the pivot: tokens with p > lo may be drawn
    tok = tl.full((), -1, tl.int32)
    r = tl.full((), 0, tl.int32)
    while (tok < 0) & (r < ROUNDS):
        target = tl.load(u_ptr + row * stride_u + r) * mass
        run = mass * 0.0
        j = tl.full((), -1, tl.int32)
        last = tl.full((), -1, tl.int32)  # the last token above the pivot seen: the draw if rounding fell short
        start = tl.full((), 0, tl.int32)
        while (j < 0) & (start < V):
            idx = start + offs
            p = tl.load(base + idx, mask=idx < V, other=0.0)
            p = tl.where(p > lo, p, 0.0)
            s = tl.sum(p, axis=0)
            tile_last = tl.max(tl.where(p > 0.0, idx, -1), axis=0)
            if run + s > target:
                c = tl.cumsum(p, axis=0) + run
                j = tl.min(tl.where((c > target) & (p > 0.0), idx, V), axis=0)
                j = tl.where(j >= V, tile_last, j)  # the cumulative sum's rounding never crossed: its last token
            last = tl.maximum(last, tile_last)
            run += s
            start += BLOCK
        j = tl.maximum(tl.where(j < 0, last, j), 0)  # (no token above the pivot: a rejected round, never read out)
        pj = tl.load(base + j.to(tl.int64))
        above = mass * 0.0
        for s2 in range(0, V, BLOCK):
            idx = s2 + offs
            p = tl.load(base + idx, mask=idx < V, other=0.0)
            above += tl.sum(tl.where(p > pj, p, 0.0), axis=0)
        if above < tp:
            tok = j
        else:
            lo = pj
            mass = above
        r += 1
    if tok < 0:  # the most likely token (the first of them)
        best = mass * 0.0 - 1.0
        for s3 in range(0, V, BLOCK):
            idx = s3 + offs
            p = tl.load(base + idx, mask=idx < V, other=-1.0)
            m = tl.max(p, axis=0)
            i = tl.min(tl.where(p == m, idx, V), axis=0)
            if m > best:
                best = m
                tok = i
    tl.store(out_ptr + row, tok.to(tl.int64))


def top_p_draw(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [n, V] (>= 0, fp32) from its top_p nucleus: `top_p` [n], `u` [n, ROUNDS] uniform
    numbers in [0, 1), `total` [n] each row's sum. Returns int64 [n] on the probabilities' device."""
    n, width = probs.shape
    out = torch.empty(n, dtype=torch.long, device=probs.device)
    if n == 0:
        return out
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    u = u.float().contiguous()
    # a top_p that rounds to 0 in fp32 (the API takes any top_p > 0) keeps the most likely token, as the smallest
    # positive one does
    top_p = top_p.float().clamp(min=torch.finfo(torch.float32).tiny)
    block = 512 if _INTERPRETED else 2048
    _top_p_kernel[(n,)](probs, total.float().contiguous(), top_p.contiguous(), u, out, width,
                        probs.stride(0), u.stride(0), ROUNDS=u.shape[1], BLOCK=block,
                        num_warps=1 if _INTERPRETED else 8)
    return out
