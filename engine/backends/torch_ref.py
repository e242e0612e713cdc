"""The torch reference backend: every part of the seam in plain torch ops, on any device.

The fallback where no faster backend runs, and the oracle the others are tested against. Attention:
- fresh prompts (no cached prefix) attend causally over their own K/V, consecutive prompts of one length in one
  batched SDPA call;
- a prefill over a cached prefix gathers its blocks and uses an offset causal mask;
- decodes come sorted by context length in groups of similar length; each group is one batched SDPA over its blocks
  gathered into a reused workspace, padded only to the group's longest context (padding every decode to the batch's
  longest would make a step cost B x max length instead of the sum of lengths).
On CUDA, SDPA's cuDNN backend is turned off: it builds a graph for every new shape, and length groups change shape
every step. Flash / memory-efficient attention do not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import AttnMetadata, Backend, PreparedStep, StepBatch, fuse_linears, lora_groups, pack
from engine.sampler import Sampler

# A decode group costs a gather + SDPA call per layer; about this many blocks' worth of padded work. A longer
# request starts a new group once joining would pad the group's members by more than that in total.
GROUP_OVERHEAD_BLOCKS = 16


def group_by_length(needs: list[int], overhead: int = GROUP_OVERHEAD_BLOCKS) -> list[tuple[int, int]]:
    """Split ascending block counts into contiguous [start, end) groups, each padded to its last (longest)."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(needs):
        if i > start and n * (i - start) - total > overhead:
            groups.append((start, i))
            start, total = i, 0
        total += n
    if needs:
        groups.append((start, len(needs)))
    return groups


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

    def clear(self) -> None:
        self._bufs.clear()


@dataclass(slots=True)
class DecodeGroup:
    start: int  # first token of the group in the packed sequence
    count: int
    nb: int  # blocks per request after padding to the group's longest context
    blocks: torch.Tensor  # [count * nb] flat block ids (padded with 0)
    mask: torch.Tensor  # [count, 1, 1, nb * block_size] bool


@dataclass(slots=True)
class TorchAttnMetadata(AttnMetadata):
    workspace: Workspace | None = None
    # prefills through SDPA: (q_start, q_len, ctx_len, block_ids or None when ctx_len == q_len)
    prefills: list[tuple[int, int, int, torch.Tensor | None]] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # decodes, one token per request


def prefill_runs(prefills: list[tuple[int, int, int, torch.Tensor | None]]):
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


class TorchMatmuls:
    """Matmuls through `F.linear` (or another function of the same signature)."""

    copies_weights = False

    def __init__(self, linear=F.linear) -> None:
        self.linear = linear

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> tuple[torch.Tensor, int]:
        return fuse_linears([gate, up])[0], gate.weight.shape[0]

    def residual(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return h + self.linear(x, w, b)

    def mlp(self, x: torch.Tensor, mlp: tuple[torch.Tensor, int], down: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        w, n = mlp
        gu = self.linear(x, w)
        return h + self.linear(F.silu(gu[:, :n]) * gu[:, n:], down)

    def gate_up(self, x: torch.Tensor, mlp: tuple[torch.Tensor, int]) -> torch.Tensor:
        """gate|up before the activation, [T, 2 * intermediate] (a LoRA step adds its updates there)."""
        return self.linear(x, mlp[0])

    def silu_mul(self, gu: torch.Tensor, n: int) -> torch.Tensor:
        return F.silu(gu[:, :n]) * gu[:, n:]


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: torch.device, kernels: str = "auto") -> None:
        super().__init__(device, kernels)
        self.workspace = Workspace()
        if device.type == "cuda":  # per-shape graph builds on every new group shape (module docstring)
            torch.backends.cuda.enable_cudnn_sdp(False)

    @staticmethod
    def default_dtype(device: torch.device) -> torch.dtype:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.device.type == "cuda" or model_dtype == torch.float32:
            return model_dtype
        return torch.float32  # half SDPA on a CPU without native half runs several times slower

    def matmuls(self, dtype: torch.dtype, upcast: bool, inner_dims: tuple[int, ...], lora: bool = False
                ) -> TorchMatmuls:
        return TorchMatmuls()

    def sampler(self, vocab_limit: int, eos_token_ids: list[int]) -> Sampler:
        return Sampler(vocab_limit, eos_token_ids, self.device)

    # ---------------------------------------------------------------- metadata
    def _meta(self, p, **fields) -> TorchAttnMetadata:
        return TorchAttnMetadata(self, self.cache, torch.tensor(p.slots, dtype=torch.long, device=self.device),
                                 max(p.positions, default=0), workspace=self.workspace, **fields)

    def _step_inputs(self, p, meta: AttnMetadata) -> PreparedStep:
        dev = self.device
        meta.lora = lora_groups(p, dev)
        return PreparedStep(torch.tensor(p.tokens, dtype=torch.long, device=dev),
                            torch.tensor(p.positions, dtype=torch.long, device=dev),
                            torch.tensor(p.rows, dtype=torch.long, device=dev), meta, p.prompt_rows)

    def sdpa_prefills(self, step: StepBatch, spans) -> list[tuple[int, int, int, torch.Tensor | None]]:
        """The SDPA entries of these prefill spans: fresh prompts attend over their own K/V, a prefix gathers."""
        out = []
        bs = self.cache.block_size
        for i, q_start, start, end in spans:
            blocks = None
            if start > 0:  # cached prefix: attend over the cache
                blocks = torch.tensor(step.prefill[i].block_table[:-(-end // bs)], dtype=torch.long,
                                      device=self.device)
            out.append((q_start, end - start, end, blocks))
        return out

    def prepare(self, step: StepBatch) -> PreparedStep:
        bs = self.cache.block_size
        dev = self.device
        need = [-(-r.num_tokens // bs) for r in step.decode]
        order = sorted(range(len(step.decode)), key=need.__getitem__)  # by length for the groups
        p = pack(step, bs, decode_order=order)
        groups = []
        for g0, g1 in group_by_length([need[i] for i in order], GROUP_OVERHEAD_BLOCKS):
            members = order[g0:g1]
            nb = need[members[-1]]
            flat: list[int] = []
            for i in members:
                flat.extend(step.decode[i].block_table[:need[i]])
                flat.extend([0] * (nb - need[i]))
            ctx_t = torch.tensor([step.decode[i].num_tokens for i in members], device=dev)
            mask = (torch.arange(nb * bs, device=dev)[None, :] < ctx_t[:, None]).view(len(members), 1, 1, nb * bs)
            groups.append(DecodeGroup(p.decode_start + g0, len(members), nb,
                                      torch.tensor(flat, dtype=torch.long, device=dev), mask))
        meta = self._meta(p, prefills=self.sdpa_prefills(step, p.spans), decode_groups=groups)
        return self._step_inputs(p, meta)

    # ---------------------------------------------------------------- attention
    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata) -> None:
        cache = meta.cache
        kvh, hd = cache.num_kv_heads, cache.head_dim
        cache.k[layer].view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, key.to(cache.dtype))
        cache.v[layer].view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, value.to(cache.dtype))

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata,
               scaling: float | None) -> torch.Tensor:
        if not meta.kv_written:
            self.write_kv(layer, key, value, meta)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self.attend_prefills(layer, query, key, value, meta, scaling, out)
        self.attend_decodes(layer, query, meta, scaling, out)
        return out

    def attend_prefills(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        meta: TorchAttnMetadata, scaling: float | None, out: torch.Tensor) -> None:
        cache = meta.cache
        num_heads, hd = query.shape[1], query.shape[2]
        kvh, cdt = cache.num_kv_heads, cache.dtype
        kc, vc = cache.k[layer], cache.v[layer]
        gqa = num_heads != kvh
        for q_start, q_len, n, blocks in prefill_runs(meta.prefills):
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

    def attend_decodes(self, layer: int, query: torch.Tensor, meta: TorchAttnMetadata, scaling: float | None,
                       out: torch.Tensor) -> None:
        cache = meta.cache
        num_heads, hd = query.shape[1], query.shape[2]
        kvh, bs, cdt = cache.num_kv_heads, cache.block_size, cache.dtype
        kc, vc = cache.k[layer], cache.v[layer]
        group = num_heads // kvh
        for g in meta.decode_groups:
            B, nb, d0 = g.count, g.nb, g.start
            # the `group` query heads that share a KV head ride as that head's query rows: no KV repeat
            q = query[d0:d0 + B].reshape(B, kvh, group, hd).to(cdt)
            kbuf = meta.workspace.get("k", (B * nb, bs, kvh, hd), kc)
            vbuf = meta.workspace.get("v", (B * nb, bs, kvh, hd), vc)
            torch.index_select(kc, 0, g.blocks, out=kbuf)
            torch.index_select(vc, 0, g.blocks, out=vbuf)
            k = kbuf.view(B, nb * bs, kvh, hd).transpose(1, 2)
            v = vbuf.view(B, nb * bs, kvh, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling)  # [B, kvh, group, hd]
            out[d0:d0 + B] = o.reshape(B, num_heads, hd)

    def release(self) -> None:
        self.workspace.clear()
        super().release()
