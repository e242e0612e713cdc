"""Our attention function over the paged KV cache, registered with transformers' AttentionInterface.

The model is called on one packed sequence [1, T]: first the tokens of every prefill (or chunk),
then one token per decoding request. Each layer writes its new K/V into the cache by slot, then:
- a prefill with no cached prefix attends causally over its own fresh K/V (consecutive prompts of one length
  in one batched SDPA call);
- a prefill with a cached prefix gathers its blocks and uses an offset causal mask;
- decode tokens, with Kairos's CPU kernels (`engine.cpu_kernels`): one call that reads each context's blocks
  through its block table, no copy; short prefills ride in the same call, one query row per token whose context
  ends at that token (`model_runner.paged_prefill_max`);
- decode tokens otherwise come sorted by context length in groups of similar length; each group is one batched
  SDPA over its blocks gathered into a reused workspace, padded only to the group's longest context (padding
  every decode to the batch's longest made a step cost B x max length instead of the sum of lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.cpu_kernels import CpuKernels
from engine.kv_cache import KVCache

ATTN_NAME = "kairos_paged"


class Workspace:
    """Grow-only scratch buffers for gathered K/V (fresh large allocations page-fault on every step)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(n, 1), dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


@dataclass(slots=True)
class DecodeGroup:
    start: int  # first token of the group in the packed sequence
    count: int
    nb: int  # blocks per request after padding to the group's longest context
    blocks: torch.Tensor  # [count * nb] flat block ids (padded with 0)
    mask: torch.Tensor  # [count, 1, 1, nb * block_size] bool


@dataclass(slots=True)
class PagedTokens:
    """The step's tokens that attend through the CPU kernel, `count` of them from `start` in the packed sequence:
    the decodes (one token each) and short prefills (each token a query row whose context ends at itself)."""
    kernels: CpuKernels
    start: int
    tables: torch.Tensor  # [count, max blocks] int32 block ids of each token's request (row tails unused)
    lens: torch.Tensor  # [count] int32 context lengths, this token included


@dataclass(slots=True)
class AttnMetadata:
    cache: KVCache
    workspace: Workspace
    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    # prefills: (q_start, q_len, ctx_len, block_ids or None when ctx_len == q_len)
    prefills: list[tuple[int, int, int, torch.Tensor | None]] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # decodes, one token per request
    paged: PagedTokens | None = None  # the decodes (and short prefills) instead, through the CPU kernel
    max_position: int = 0  # the step's largest position id
    kv_written: bool = False  # the decoder already wrote this step's K/V into the cache (`cpu_kernels.rope_write`)


def _prefill_runs(prefills: list[tuple[int, int, int, torch.Tensor | None]]):
    """The step's prefills for `attend`: consecutive fresh prompts of one length merge into one run
    (q_start, q_len, count, None); a prefill over a cached prefix stays alone as (q_start, q_len, ctx_len, blocks)."""
    run: list[int] | None = None  # [q_start, q_len, count]
    for q_start, q_len, ctx_len, blocks in prefills:
        if blocks is None and run is not None and q_len == run[1] and q_start == run[0] + run[1] * run[2]:
            run[2] += 1
            continue
        if run is not None:
            yield run[0], run[1], run[2], None
            run = None
        if blocks is None:
            run = [q_start, q_len, 1]
        else:
            yield q_start, q_len, ctx_len, blocks
    if run is not None:
        yield run[0], run[1], run[2], None


def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, m: AttnMetadata,
           scaling: float | None) -> torch.Tensor:
    """One layer's attention for the packed step: query [T, H, hd], key/value [T, kvh, hd] (any strides).
    Writes the new K/V into the cache and returns [T, H, hd] in the query's dtype."""
    cache = m.cache
    T, num_heads, hd = query.shape
    kvh, bs, cdt = cache.num_kv_heads, cache.block_size, cache.dtype
    kc, vc = cache.k[layer], cache.v[layer]
    if not m.kv_written:
        kc.view(-1, kvh, hd).index_copy_(0, m.slot_mapping, key.to(cdt))
        vc.view(-1, kvh, hd).index_copy_(0, m.slot_mapping, value.to(cdt))
    gqa = num_heads != kvh
    out = torch.empty((T, num_heads, hd), dtype=query.dtype, device=query.device)

    for q_start, q_len, n, blocks in _prefill_runs(m.prefills):
        if blocks is None:  # n fresh prompts of q_len tokens each, back to back: one batched causal SDPA
            rows = slice(q_start, q_start + n * q_len)
            q, k, v = (t[rows].reshape(n, q_len, -1, hd).transpose(1, 2).to(cdt) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scaling, enable_gqa=gqa)
            out[rows].view(n, q_len, num_heads, hd).copy_(o.transpose(1, 2))
            continue
        ctx_len = n  # a prefill over a cached prefix: its blocks gathered, an offset causal mask
        q = query[q_start:q_start + q_len].transpose(0, 1).unsqueeze(0).to(cdt)  # [1, H, L, hd]
        k = kc.index_select(0, blocks).view(1, -1, kvh, hd)[:, :ctx_len].transpose(1, 2)
        v = vc.index_select(0, blocks).view(1, -1, kvh, hd)[:, :ctx_len].transpose(1, 2)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[q_start:q_start + q_len] = o[0].transpose(0, 1)

    if m.paged is not None:
        p = m.paged
        n = p.lens.shape[0]
        q = query[p.start:p.start + n]
        if q.stride(2) != 1 or q.stride(1) != hd:  # the HF modules' layout: heads outermost
            q = q.contiguous()
        # into `out` directly; the kernels run only where the cache is in the activations' dtype
        p.kernels.decode_attn(q, kc, vc, p.tables, p.lens, hd ** -0.5 if scaling is None else scaling,
                              out=out[p.start:p.start + n])
    group = num_heads // kvh
    for g in m.decode_groups:
        B, nb, d0 = g.count, g.nb, g.start
        # the `group` query heads that share a KV head ride as that head's query rows: no KV repeat
        q = query[d0:d0 + B].reshape(B, kvh, group, hd).to(cdt)
        kbuf = m.workspace.get("k", (B * nb, bs, kvh, hd), kc)
        vbuf = m.workspace.get("v", (B * nb, bs, kvh, hd), vc)
        torch.index_select(kc, 0, g.blocks, out=kbuf)
        torch.index_select(vc, 0, g.blocks, out=vbuf)
        k = kbuf.view(B, nb * bs, kvh, hd).transpose(1, 2)
        v = vbuf.view(B, nb * bs, kvh, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling)  # [B, kvh, group, hd]
        out[d0:d0 + B] = o.reshape(B, num_heads, hd)
    return out


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    kairos: AttnMetadata | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """The HF attention interface over `attend`: query [1, H, T, hd], key/value [1, kvh, T, hd]."""
    if kairos is None:
        raise RuntimeError("kairos_paged attention needs the `kairos` metadata kwarg (use the engine's runner)")
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 kairos, scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention)
