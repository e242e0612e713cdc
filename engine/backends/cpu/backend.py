"""The CPU backend: the torch reference backend with Kairos's compiled CPU kernels (`kernels.py`, `cpu_kernels.cpp`)
where they build and run for this model, and the matmul strategy the CPU does best (`matmuls.py`, `matmul.py`).

With the kernels:
- RMSNorm, and RoPE fused with the cache write, run in compiled kernels;
- decode tokens attend through the paged decode kernel, which reads each context's blocks through its block table
  (no copy); short prefills ride in the same call, one query row per token whose context ends at that token
  (`paged_prefill_max`); longer prompts keep SDPA, which shares each K/V read among many queries;
- a step whose every token attends through the kernel runs every layer in one kernel call (`whole_step`) where the
  decoder's matmuls are the packed GEMM;
- greedy rows' argmax and the sampled rows' draw run in the kernels.
Without them (`kernels="off"`, no compiler, or an unsupported shape) everything is the torch reference backend's,
with oneDNN's packed bf16 GEMM where the CPU has native bf16 and upcast fp32 GEMMs where bf16 would be emulated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.backends.base import AttnMetadata, PreparedStep, StepBatch, long_call_starts, pack
from engine.backends.cpu import kernels as ck
from engine.backends.cpu.kernels import CpuKernels, DecoderShape
from engine.backends.cpu.matmul import cpu_has_avx2_fma, cpu_has_native_half, install, upcast_linear
from engine.backends.cpu.matmuls import OneDNNMatmuls, PackedMatmuls
from engine.backends.torch_ref import TorchAttnMetadata, TorchBackend, TorchMatmuls
from engine.sampler import Sampler

# With the kernels, a prefill whose context (prefix included) is at most this many tokens attends through the paged
# decode kernel, one query row per token; a longer one through SDPA, which shares each K/V read among many queries.
PAGED_PREFILL_MAX = 256
# In bf16 where the kernels' attention and GEMMs run on AVX512-BF16's dot product without AMX (AMD Zen 4), the paged
# kernel, whose steps also run every layer in one call, was the faster one at every length measured.
PAGED_PREFILL_MAX_AVX512_BF16 = 4096


def paged_prefill_max(kernels: CpuKernels | None, cache_dtype: torch.dtype) -> int:
    """The longest context (in tokens) whose prefill attends through the paged kernel (0: none, no kernels)."""
    if kernels is None:
        return 0
    if cache_dtype == torch.bfloat16 and kernels.packed_isa == "avx512_bf16":
        return PAGED_PREFILL_MAX_AVX512_BF16
    return PAGED_PREFILL_MAX


@dataclass(slots=True)
class PagedTokens:
    """The step's tokens that attend through the CPU kernel, `count` of them from `start` in the packed sequence:
    the decodes (one token each) and short prefills (each token a query row whose context ends at itself)."""
    start: int
    tables: torch.Tensor  # [count, max blocks] int32 block ids of each token's request (row tails unused)
    lens: torch.Tensor  # [count] int32 context lengths, this token included


@dataclass(slots=True)
class CpuAttnMetadata(TorchAttnMetadata):
    paged: PagedTokens | None = None  # the decodes (and short prefills) through the kernel instead of groups


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, device: torch.device, kernels: str = "auto") -> None:
        super().__init__(device, kernels)
        self.kernels: CpuKernels | None = None
        self.paged_prefill_max = 0  # set by `bind` once the kernels are chosen (benchmarks compare others)
        self._layer_tables: dict[int, tuple[int, torch.Tensor]] = {}  # id(decoder) -> (cache k ptr, layer table)
        self._scratch = torch.empty(0)

    @staticmethod
    def default_dtype(device: torch.device) -> torch.dtype:
        """bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), as vLLM's CPU backend does; fp32
        elsewhere, where bf16 GEMMs are emulated."""
        return torch.bfloat16 if cpu_has_native_half() else torch.float32

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The model's dtype on CPUs with native bf16 (half the bytes to write and gather, SDPA as fast as fp32), and
        for bf16 models also on AVX2 CPUs with the kernels on, whose decode attention reads bf16 rows as fast as fp32
        ones; fp32 elsewhere, where bf16/fp16 SDPA is several times slower."""
        if model_dtype == torch.float32:
            return model_dtype
        if model_dtype == torch.bfloat16 and cpu_has_native_half():
            return model_dtype
        if model_dtype == torch.bfloat16 and self.kernels_setting != "off" and cpu_has_avx2_fma():
            return model_dtype
        return torch.float32

    def adapt_model(self, model: torch.nn.Module, upcast: str) -> int:
        """bf16/fp16 linears on CPUs without native half GEMM run their multi-row matmuls in fp32 (`matmul.py`)."""
        return install(model, upcast)

    def bind(self, spec, model_dtype: torch.dtype, num_heads: int) -> None:
        super().bind(spec, model_dtype, num_heads)
        self.kernels = ck.choose(self.kernels_setting, self.device, model_dtype, spec.dtype, spec.head_dim,
                                 num_heads // spec.num_kv_heads)
        self.paged_prefill_max = paged_prefill_max(self.kernels, spec.dtype)
        self.fused_rope_write = self.kernels is not None

    def identity(self) -> dict:
        return {"backend": self.name, "cpu_build": self.kernels.build if self.kernels else None}

    # ---------------------------------------------------------------- the model's ops
    def matmuls(self, dtype: torch.dtype, upcast: bool, inner_dims: tuple[int, ...], lora: bool = False):
        """Kairos's packed GEMM where the kernels run it on this dtype and these widths (bf16: AMX, AVX512-BF16, or
        AVX2's FMAs on bf16 weights widened to fp32, which is itself an upcast matmul; fp32: AVX2 or AVX-512 FMA);
        else oneDNN's packed bf16 where the CPU has native bf16; else `F.linear` (upcast per call where bf16 would
        be emulated). `lora`: an engine that serves LoRA adapters (the packed GEMM's gate|up unfused)."""
        k = self.kernels
        if k is not None and k.packed_linear_supported(dtype, *inner_dims) \
                and (not upcast or (dtype == torch.bfloat16 and k.packed_isa == "avx2_fma")):
            return PackedMatmuls(k, gated=not lora)
        if dtype == torch.bfloat16 and not upcast and cpu_has_native_half() and torch.backends.mkldnn.is_available():
            return OneDNNMatmuls()
        return TorchMatmuls(upcast_linear if upcast else F.linear)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is None:
            return super().rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, weight, eps)

    def rope_write(self, qkv, num_heads, num_kv_heads, cos, sin, positions, meta: AttnMetadata, layer: int) -> None:
        cache = meta.cache
        self.kernels.rope_write(qkv, num_heads, num_kv_heads, cos, sin, positions, meta.slot_mapping,
                                cache.k[layer], cache.v[layer])

    def can_run_whole_step(self, decoder) -> bool:
        """Every layer in one kernel call: the packed GEMM, position-only RoPE, no per-head q/k norms."""
        return isinstance(decoder.mm, PackedMatmuls) and decoder.mm.gated and decoder.table_rope \
            and decoder.layers[0].q_norm is None

    def whole_step(self, decoder, h: torch.Tensor, positions: torch.Tensor, meta: CpuAttnMetadata) -> bool:
        p, cache = getattr(meta, "paged", None), meta.cache
        if p is None or meta.prefills or p.lens.shape[0] != h.shape[0] or cache.dtype != decoder.dtype:
            return False
        key = id(decoder)
        table = self._layer_tables.get(key)
        if table is None or table[0] != cache.k[0].data_ptr():
            table = self._layer_tables[key] = (cache.k[0].data_ptr(), self.kernels.layer_table(
                [(L.ln_in, L.ln_post, L.qkv_w, L.qkv_b, L.o_w, L.o_b, L.mlp, L.down_w, cache.k[i], cache.v[i])
                 for i, L in enumerate(decoder.layers)]))
        shape = DecoderShape(h.shape[1], decoder.num_heads, decoder.num_kv_heads, decoder.head_dim,
                             decoder.intermediate_size, decoder.eps, decoder.scaling)
        need = shape.scratch_elems(h.shape[0])
        if self._scratch.numel() < need or self._scratch.dtype != decoder.dtype:
            self._scratch = torch.empty(need, dtype=decoder.dtype)
        cos, sin = decoder.rope_tables
        long_call_starts()
        self.kernels.decode_layers(table[1], shape, h, cos, sin, positions, meta.slot_mapping, p.tables, p.lens,
                                   cache.block_size, self._scratch)
        return True

    def sampler(self, vocab_limit: int, eos_token_ids: list[int]) -> Sampler:
        k = self.kernels
        if k is None:
            return super().sampler(vocab_limit, eos_token_ids)
        return Sampler(vocab_limit, eos_token_ids, self.device, k.argmax_rows, k.sample_rows)

    # ---------------------------------------------------------------- metadata
    def prepare(self, step: StepBatch) -> PreparedStep:
        if self.kernels is None:
            return super().prepare(step)
        bs = self.cache.block_size
        # prefills of up to `paged_prefill_max` tokens of context attend through the decode kernel too, one query row
        # per token (its context: the positions up to its own): one call for the step's prompts and its decodes.
        # Longer prompts keep SDPA, and come first.
        paged_prefill = [end <= self.paged_prefill_max for end in step.ends]
        order_p = sorted(range(len(step.prefill)), key=paged_prefill.__getitem__)
        p = pack(step, bs, prefill_order=order_p)
        sdpa_spans = [s for s in p.spans if not paged_prefill[s[0]]]
        row_tables: list[tuple[list[int], int]] = []  # per paged prompt: its blocks, and its rows in this step
        row_lens: list[int] = []  # per paged row: its context length
        paged_start = None
        for i, q_start, start, end in p.spans:
            if paged_prefill[i]:
                paged_start = q_start if paged_start is None else paged_start
                row_tables.append((step.prefill[i].block_table[:-(-end // bs)], end - start))
                row_lens.extend(range(start + 1, end + 1))
        paged = None
        decode = step.decode
        if decode or row_lens:
            dec_tables = [r.block_table[:-(-r.num_tokens // bs)] for r in decode]
            row_lens.extend(r.num_tokens for r in decode)
            width = max([len(t) for t, _ in row_tables] + [len(t) for t in dec_tables])
            # a prompt's rows share its table: one padded row per prompt, repeated by torch (building thousands of
            # rows as Python lists is slow); the decodes' rows in one list, as one tensor
            parts = [torch.tensor(t + [0] * (width - len(t)), dtype=torch.int32).expand(n, width)
                     for t, n in row_tables]
            if dec_tables:
                flat: list[int] = []
                for t in dec_tables:
                    flat.extend(t)
                    flat.extend([0] * (width - len(t)))
                parts.append(torch.tensor(flat, dtype=torch.int32).view(len(dec_tables), width))
            tables = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
            paged = PagedTokens(p.decode_start if paged_start is None else paged_start, tables,
                                torch.tensor(row_lens, dtype=torch.int32))
        meta = CpuAttnMetadata(self, self.cache, torch.tensor(p.slots, dtype=torch.long), max(p.positions, default=0),
                               workspace=self.workspace, prefills=self.sdpa_prefills(step, sdpa_spans), paged=paged)
        return self._step_inputs(p, meta)

    def attend_decodes(self, layer: int, query: torch.Tensor, meta: CpuAttnMetadata, scaling: float | None,
                       out: torch.Tensor) -> None:
        p = getattr(meta, "paged", None)
        if p is None:
            return super().attend_decodes(layer, query, meta, scaling, out)
        cache = meta.cache
        hd = query.shape[2]
        n = p.lens.shape[0]
        q = query[p.start:p.start + n]
        if q.stride(2) != 1 or q.stride(1) != hd:  # the HF modules' layout: heads outermost
            q = q.contiguous()
        # into `out` directly; the kernels run only where the cache is in the activations' dtype
        self.kernels.decode_attn(q, cache.k[layer], cache.v[layer], p.tables, p.lens,
                                 hd ** -0.5 if scaling is None else scaling, out=out[p.start:p.start + n])

    def release(self) -> None:
        self._layer_tables.clear()
        self._scratch = torch.empty(0)
        super().release()
