"""Kairos's own forward for Llama-family checkpoints (llama, mistral, qwen2, qwen3) over the paged cache.

The HF module tree stays the source of the weights and of the RoPE tables; this class only runs them, with
the step's tokens packed into one [T] sequence:

    x = rms_norm(h); q, k, v = x @ W_qkv (+ bias); [qwen3: per-head rms_norm of q, k]; RoPE on q and k;
    o = attend(...)  (cache write + attention, `engine.attention`); h += o @ W_o
    x = rms_norm(h); h += (silu(x @ W_gate) * (x @ W_up)) @ W_down

and the final norm and LM head only on the rows whose logits are sampled. q|k|v are concatenated once at
load into one projection; how the matmuls run is the backend's: `TorchMatmuls` (F.linear; gate|up
concatenated too, the HF modules' parameters becoming views of the fused tensors, so nothing is stored
twice), `OneDNNMatmuls` (packed bf16, elementwise work fused into the GEMMs) or `PackedMatmuls` (Kairos's
GEMM on its own packed layout: bf16 on AMX tiles or AVX512-BF16 dot products, fp32 on AVX-512 or AVX2 FMAs;
elementwise work fused into its epilogue). Where every token of a step attends through the paged kernel
(decodes, and prefills of short contexts) and the backend is `PackedMatmuls`, the whole step's layers run in one
kernel call (`CpuKernels.decode_layers`). No per-layer Python of the HF modules runs (kwargs, attention-interface
lookup, cache objects).
Numerics follow HF's: RMSNorm in fp32 then cast, RoPE tables from the model's own rotary module.
With `OneDNNMatmuls` or `PackedMatmuls` the packed weights are copies, so the decoder empties the HF projections' weights
(embeddings and norms stay): the HF forward of that model object is unusable afterwards (`model_impl=hf` keeps it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttnMetadata, attend
from engine.cpu_kernels import CpuKernels, DecoderShape, PackedWeight
from engine.cpu_matmul import cpu_has_native_half, upcast_linear

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_TABLE_ROPE = ("default", "linear", "llama3", "yarn")  # position-only RoPE: one table for every step


def unsupported_reason(model: nn.Module) -> str | None:
    """None when `KairosDecoder` can run this model, else why not (the engine then runs the HF forward)."""
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model family {cfg.model_type!r} (ours: {', '.join(FAMILIES)})"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a standard *ForCausalLM module tree"
    return None


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) along the output dim; the modules keep views of the result."""
    w = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    b = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    off = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[off:off + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[off:off + n], requires_grad=False)
        off += n
    if any(has_bias) and b is None:
        raise ValueError("some but not all of the fused projections have biases")
    return w, b


class TorchMatmuls:
    """Matmuls through `F.linear` (or `cpu_matmul.upcast_linear` for bf16 on CPUs without native bf16)."""

    copies_weights = False

    def __init__(self, linear=F.linear) -> None:
        self.linear = linear

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> tuple[torch.Tensor, int]:
        return _fuse([gate, up])[0], gate.weight.shape[0]

    def residual(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return h + self.linear(x, w, b)

    def mlp(self, x: torch.Tensor, mlp: tuple[torch.Tensor, int], down: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        w, n = mlp
        gu = self.linear(x, w)
        return h + self.linear(F.silu(gu[:, :n]) * gu[:, n:], down)


class OneDNNMatmuls:
    """bf16 on CPUs with native bf16 (AVX512-BF16 / AMX): oneDNN weights packed once at load, with the
    step's elementwise work fused into the GEMMs as post-ops: silu into the gate projection, the product
    into the up projection, the residual adds into o_proj and down_proj. One-row GEMMs on packed weights ran
    1.8-2.9x faster than `F.linear` on the same bf16 tensors in a micro-benchmark whose weights stayed in
    cache; in the engine's step most of that is lost to DRAM bandwidth (bench/README.md)."""

    copies_weights = True  # the packed tensors are copies: the decoder drops the originals

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pack(gate.weight), self.pack(up.weight)

    def residual(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, h, w, b, "add")

    def mlp(self, x: torch.Tensor, mlp: tuple[torch.Tensor, torch.Tensor], down: torch.Tensor,
            h: torch.Tensor) -> torch.Tensor:
        gate, up = mlp
        g = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
        a = torch.ops.mkldnn._linear_pointwise.binary(x, g, up, None, "mul")
        return torch.ops.mkldnn._linear_pointwise.binary(a, h, down, None, "add")


class PackedMatmuls:
    """Kairos's own GEMM (`CpuKernels.linear`) on weights packed once at load, the bias, the residual adds and
    silu(gate) * up fused into its epilogue. bf16 on CPUs with AMX or AVX512-BF16 (AMX's layout, which AVX512-BF16's
    dot product reads as it is): at 1-32 rows (decode) ~1.4x (AMX) to ~2x (Zen 4) faster than oneDNN's packed GEMM,
    level on prefill. fp32 on AVX-512 or AVX2 FMAs: decode steps 2-3.6x faster than torch's linear (MKL), which
    re-reads the weights for each of 1-3 rows (bench/README.md)."""

    copies_weights = True

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def pack(self, w: torch.Tensor) -> PackedWeight:
        w = w.detach()
        return self.kernels.pack_exact(w)

    def linear(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.linear(x, w, b)

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> PackedWeight:
        g, u = gate.weight.detach(), up.weight.detach()
        return self.kernels.pack_exact_gated(g, u)

    def residual(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, w, b, residual=h)  # h += x @ W^T + b, in place

    def mlp(self, x: torch.Tensor, mlp: PackedWeight, down: PackedWeight, h: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(self.kernels.linear(x, mlp), down, residual=h)


Matmuls = TorchMatmuls | OneDNNMatmuls | PackedMatmuls


def choose_matmuls(dtype: torch.dtype, device: torch.device, upcast: bool, kernels: CpuKernels | None = None,
                   inner_dims: tuple[int, ...] = ()) -> Matmuls:
    """Kairos's packed GEMM where the kernels run it on this dtype and these widths (bf16: AMX, AVX512-BF16, or
    AVX2's FMAs on bf16 weights widened to fp32, which is itself an upcast matmul; fp32: AVX2 or AVX-512 FMA); else
    oneDNN's packed bf16 where the CPU has native bf16; else `F.linear` (upcast per call where bf16 would be
    emulated)."""
    if device.type == "cpu" and kernels is not None and kernels.packed_linear_supported(dtype, *inner_dims) \
            and (not upcast or (dtype == torch.bfloat16 and kernels.packed_isa == "avx2_fma")):
        return PackedMatmuls(kernels)
    if device.type == "cpu" and dtype == torch.bfloat16 and not upcast and cpu_has_native_half() \
            and torch.backends.mkldnn.is_available():
        return OneDNNMatmuls()
    return TorchMatmuls(upcast_linear if upcast else F.linear)


@dataclass(slots=True)
class _Layer:
    ln_in: torch.Tensor
    ln_post: torch.Tensor
    qkv_w: torch.Tensor  # q|k|v fused, as the matmul backend packed it
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    mlp: tuple  # gate and up, as the backend's `pack_mlp` returned them
    down_w: torch.Tensor
    q_norm: torch.Tensor | None  # qwen3: RMSNorm over each head's dims, before RoPE
    k_norm: torch.Tensor | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, the weight applied in the input's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class KairosDecoder:
    def __init__(self, model: nn.Module, max_positions: int, upcast: bool = False,
                 kernels: CpuKernels | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"KairosDecoder cannot run this model: {reason}")
        cfg = model.config
        inner = model.model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = float(cfg.rms_norm_eps)
        self.scaling = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.dtype = self.embed.dtype
        hidden = cfg.hidden_size
        self.mm = mm = choose_matmuls(self.dtype, self.embed.device, upcast, kernels,
                                      (hidden, self.num_heads * self.head_dim, cfg.intermediate_size))
        self.norm = inner.norm.weight
        self.lm_head = mm.pack(model.lm_head.weight)
        self.rotary = inner.rotary_emb
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([a.q_proj, a.k_proj, a.v_proj])
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, mm.pack(qkv_w), qkv_b,
                mm.pack(a.o_proj.weight), a.o_proj.bias, mm.pack_mlp(mlp.gate_proj, mlp.up_proj),
                mm.pack(mlp.down_proj.weight),
                None if qn is None else qn.weight, None if kn is None else kn.weight))
            if mm.copies_weights:  # keep one copy of the weights: the HF projections are emptied
                for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        self._table_rope = (getattr(self.rotary, "rope_type", None) or "default") in _TABLE_ROPE
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        if self._table_rope:
            self._grow_tables(max_positions)
        self.kernels = kernels  # CPU: norms, RoPE + cache write in compiled kernels (`engine.cpu_kernels`)
        self.norm_fn = rms_norm if kernels is None else kernels.rms_norm
        # a step whose every token attends through the kernel (decodes, short prefills: `model_runner.prepare`)
        # runs every layer in one kernel call where the model has the plain Llama/Qwen2 shape
        self.whole_step = isinstance(mm, PackedMatmuls) and self._table_rope and self.layers[0].q_norm is None
        self._shape = DecoderShape(hidden, self.num_heads, self.num_kv_heads, self.head_dim, cfg.intermediate_size,
                                   self.eps, self.scaling)
        self._table: tuple[int, torch.Tensor] | None = None  # (the KV cache's first k data_ptr, layer table)
        self._scratch = torch.empty(0, dtype=self.dtype)

    def _decode_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> None:
        cache = meta.cache
        if self._table is None or self._table[0] != cache.k[0].data_ptr():
            self._table = (cache.k[0].data_ptr(), self.kernels.layer_table(
                [(L.ln_in, L.ln_post, L.qkv_w, L.qkv_b, L.o_w, L.o_b, L.mlp, L.down_w, cache.k[i], cache.v[i])
                 for i, L in enumerate(self.layers)]))
        need = self._shape.scratch_elems(h.shape[0])
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=self.dtype)
        p = meta.paged
        self.kernels.decode_layers(self._table[1], self._shape, h, *self._tables, positions, meta.slot_mapping,
                                   p.tables, p.lens, cache.block_size, self._scratch)

    def _grow_tables(self, n: int) -> None:
        self._tables = self._rope(torch.arange(n, device=self.embed.device)[None])

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=self.dtype, device=self.embed.device)
        cos, sin = self.rotary(probe, positions)
        return cos[0], sin[0]  # [T, hd]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor,
                 meta: AttnMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; logits [len(logit_rows), vocab] for those rows of the packed step."""
        if self._table_rope:
            if meta.max_position >= self._tables[0].shape[0]:  # probes may run past max_model_len
                self._grow_tables(2 * meta.max_position)
        H, KV, hd, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        T = input_ids.shape[0]
        mm, norm = self.mm, self.norm_fn
        linear = mm.linear
        fused = self.kernels is not None and self._table_rope  # RoPE + cache write in one kernel call
        if fused:
            meta.kv_written = True
        elif self._table_rope:
            cos, sin = self._tables[0][positions][:, None], self._tables[1][positions][:, None]  # over heads
        else:
            cos, sin = (t[:, None] for t in self._rope(positions[None]))
        h = F.embedding(input_ids, self.embed)
        if self.whole_step and meta.paged is not None and not meta.prefills and meta.paged.lens.shape[0] == T \
                and meta.cache.dtype == self.dtype:
            self._decode_layers(h, positions, meta)
            return linear(norm(h[logit_rows], self.norm, eps), self.lm_head)
        for i, L in enumerate(self.layers):
            x = norm(h, L.ln_in, eps)
            qkv = linear(x, L.qkv_w, L.qkv_b)
            heads = qkv.view(T, H + 2 * KV, hd)
            if L.q_norm is not None:  # qwen3: per-head norms of q and k, before RoPE
                heads[:, :H] = rms_norm(heads[:, :H], L.q_norm, eps)
                heads[:, H:H + KV] = rms_norm(heads[:, H:H + KV], L.k_norm, eps)
            if fused:
                self.kernels.rope_write(qkv, H, KV, *self._tables, positions, meta.slot_mapping,
                                        meta.cache.k[i], meta.cache.v[i])
                qk = heads[:, :H + KV]
            else:
                qk = heads[:, :H + KV]
                half = hd // 2
                qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
            o = attend(i, qk[:, :H], qk[:, H:], heads[:, H + KV:], meta, self.scaling)
            h = mm.residual(o.view(T, H * hd), L.o_w, L.o_b, h)
            h = mm.mlp(norm(h, L.ln_post, eps), L.mlp, L.down_w, h)
        h = norm(h[logit_rows], self.norm, eps)
        return linear(h, self.lm_head)


def build_decoder(model_impl: str, bundle, upcast: bool = False,
                  kernels: CpuKernels | None = None) -> KairosDecoder | None:
    """The decoder `model_impl` asks for: "hf" -> None (HF forward); "kairos" -> ours or a ValueError;
    "auto" -> ours when it supports the model."""
    if model_impl == "hf":
        return None
    reason = unsupported_reason(bundle.model)
    if reason is None:
        return KairosDecoder(bundle.model, bundle.max_model_len, upcast, kernels)
    if model_impl == "kairos":
        raise ValueError(f"model_impl='kairos' cannot run {bundle.name!r}: {reason}; use model_impl='hf'")
    return None
