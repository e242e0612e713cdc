"""Kairos's own forward for Llama-family checkpoints (llama, mistral, qwen2, qwen3) over the paged cache.

The model's module tree (HF's, or the same tree read by `engine.own_model` without transformers' modeling code) stays
the source of the weights and of the RoPE tables; this class only runs them, with the step's tokens packed into one
[T] sequence:

    x = rms_norm(h); q, k, v = x @ W_qkv (+ bias); [qwen3: per-head rms_norm of q, k]; RoPE on q and k;
    o = attend(...)  (cache write + attention: the backend's); h += o @ W_o
    x = rms_norm(h); h += (silu(x @ W_gate) * (x @ W_up)) @ W_down

and the final norm and LM head only on the rows whose logits are sampled. q|k|v are concatenated once at
load into one projection. Everything device-specific is the backend's (`engine.backends.base.Backend`): how the
matmuls run (`matmuls`: F.linear on fused weights, or a backend's packed weights with fused epilogues), the norms,
RoPE fused with the cache write where the backend has it, and a whole step in one call where it can (`whole_step`).
No per-layer Python of the HF modules runs (kwargs, attention-interface lookup, cache objects).
Numerics follow HF's: RMSNorm in fp32 then cast, RoPE tables from the model's own rotary module.
Where the backend's matmuls copy the weights (packed layouts) the decoder empties the HF projections' weights
(embeddings and norms stay): the HF forward of that model object is unusable afterwards (`model_impl=hf` keeps it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import AttnMetadata, Backend, fuse_linears, rms_norm
from engine.lora import (PROJECTIONS, LoraAdapter, LoraError, LoraSpec, LoraStacks, LoraStep, ModelShape, load_adapter,
                         pack_pair)
from engine.own_model import TABLE_ROPE
from engine.own_model import unsupported_reason as config_unsupported


def unsupported_reason(model: nn.Module) -> str | None:
    """None when `KairosDecoder` can run this model, else why not (the engine then runs the HF forward)."""
    reason = config_unsupported(model.config)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a standard *ForCausalLM module tree"
    return None


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


class KairosDecoder:
    def __init__(self, model: nn.Module, max_positions: int, backend: Backend, upcast: bool = False,
                 lora: bool = False) -> None:
        """`lora`: serve LoRA adapters (`build_lora`, `install_lora`): steps whose requests name one run each layer unfused, their
        updates added after each projection."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"KairosDecoder cannot run this model: {reason}")
        cfg = model.config
        inner = model.model
        self.backend = backend
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.intermediate_size = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scaling = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.dtype = self.embed.dtype
        hidden = cfg.hidden_size
        self.mm = mm = backend.matmuls(self.dtype, upcast, (hidden, self.num_heads * self.head_dim,
                                                            cfg.intermediate_size), lora=lora)
        self.serves_lora = lora
        self.loras: dict[int, LoraAdapter] = {}  # by id (a request's lora_id)
        self.lora_stacks = LoraStacks()  # the last set of adapters of a step's rows, stacked
        self.lora_shape = ModelShape(len(model.model.layers), hidden, self.num_heads * self.head_dim,
                                     self.num_kv_heads * self.head_dim, cfg.intermediate_size)
        self.norm = inner.norm.weight
        self.lm_head = mm.pack(model.lm_head.weight)
        self.rotary = inner.rotary_emb
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, mm.pack(qkv_w), qkv_b,
                mm.pack(a.o_proj.weight), a.o_proj.bias, mm.pack_mlp(mlp.gate_proj, mlp.up_proj),
                mm.pack(mlp.down_proj.weight),
                None if qn is None else qn.weight, None if kn is None else kn.weight))
            if mm.copies_weights:  # keep one copy of the weights: the HF projections are emptied
                for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        self.table_rope = (getattr(self.rotary, "rope_type", None) or "default") in TABLE_ROPE
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, hd]
        self.tables_captured = False  # CUDA graphs read the tables where they are: they may no longer move
        if self.table_rope:
            self.grow_tables(max_positions)
        # a step whose every token the backend can run in one call (the CPU kernels' decode_layers)
        can = getattr(backend, "can_run_whole_step", None)
        self.whole_step = bool(can and can(self))

    def grow_tables(self, n: int) -> None:
        self.rope_tables = self._rope(torch.arange(n, device=self.embed.device)[None])

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=self.dtype, device=self.embed.device)
        cos, sin = self.rotary(probe, positions)
        return cos[0], sin[0]  # [T, hd]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor | None,
                 meta: AttnMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; logits [len(logit_rows), vocab] for those rows of the packed step (with
        `logit_rows` None: every row's last hidden state [T, hidden], for `head` to take the rows from)."""
        if self.table_rope:
            if meta.max_position >= self.rope_tables[0].shape[0]:  # probes may run past max_model_len
                if self.tables_captured:  # new tables would leave the graphs reading freed memory
                    raise ValueError(f"position {meta.max_position} is past the {self.rope_tables[0].shape[0]} "
                                     "positions of the RoPE tables the decode graphs were captured over")
                self.grow_tables(2 * meta.max_position)
        H, KV, hd, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        T = input_ids.shape[0]
        backend, mm = self.backend, self.mm
        norm, linear, attend = backend.rms_norm, mm.linear, backend.attend
        fused = backend.fused_rope_write and self.table_rope  # RoPE + cache write in one call
        if fused:
            meta.kv_written = True
        elif self.table_rope:
            cos, sin = (t.index_select(0, positions)[:, None] for t in self.rope_tables)  # over heads
        else:
            cos, sin = (t[:, None] for t in self._rope(positions[None]))
        h = F.embedding(input_ids, self.embed)
        # (an adapter unloaded since the step was planned: only an ended request's discarded row named it)
        groups = None  # (by id: the same set of adapters, the same stack)
        if meta.lora:
            groups = [(a, rows) for i, rows in sorted(meta.lora, key=lambda g: g[0]) if (a := self.loras.get(i))]
        lora = LoraStep(groups, T, self.lora_stacks, mm) if groups else None
        if self.whole_step and lora is None and backend.whole_step(self, h, positions, meta):
            return h if logit_rows is None else self.head(h[logit_rows])
        # each residual add fused with the RMSNorm after it (not where LoRA updates come between them)
        fuse_norm = hasattr(mm, "residual_norm") and lora is None
        layers = self.layers
        x = norm(h, layers[0].ln_in, eps)
        for i, L in enumerate(layers):
            if i and not fuse_norm:
                x = norm(h, L.ln_in, eps)
            qkv = linear(x, L.qkv_w, L.qkv_b)
            if lora is not None:
                qkv = lora.apply(qkv, x, "qkv", i)
            heads = qkv.view(T, H + 2 * KV, hd)
            if L.q_norm is not None:  # qwen3: per-head norms of q and k, before RoPE
                heads[:, :H] = rms_norm(heads[:, :H], L.q_norm, eps)
                heads[:, H:H + KV] = rms_norm(heads[:, H:H + KV], L.k_norm, eps)
            if fused:
                backend.rope_write(qkv, H, KV, *self.rope_tables, positions, meta, i)
                qk = heads[:, :H + KV]
            else:
                qk = heads[:, :H + KV]
                half = hd // 2
                qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
            o = attend(i, qk[:, :H], qk[:, H:], heads[:, H + KV:], meta, self.scaling)
            if lora is not None:
                h = self._lora_rest(i, L, o.view(T, H * hd), h, lora)
            elif not fuse_norm:
                h = mm.residual(o.view(T, H * hd), L.o_w, L.o_b, h)
                h = mm.mlp(norm(h, L.ln_post, eps), L.mlp, L.down_w, h)
            else:  # (h + o W_o, its norm), then (h + mlp, the next layer's input norm): h updated in place
                h, x = mm.residual_norm(o.view(T, H * hd), L.o_w, L.o_b, h, L.ln_post, eps)
                if i + 1 < len(layers):
                    h, x = mm.mlp_norm(x, L.mlp, L.down_w, h, layers[i + 1].ln_in, eps)
                else:
                    h = mm.mlp(x, L.mlp, L.down_w, h)
        return h if logit_rows is None else self.head(h.index_select(0, logit_rows))

    def _lora_rest(self, i: int, L: _Layer, o: torch.Tensor, h: torch.Tensor, lora: LoraStep) -> torch.Tensor:
        """A LoRA step's layer after attention: o_proj, the MLP, each with the step's adapters' updates."""
        mm = self.mm
        h = lora.apply(mm.residual(o, L.o_w, L.o_b, h), o, "o", i)
        x = self.backend.rms_norm(h, L.ln_post, self.eps)
        gu = lora.apply(mm.gate_up(x, L.mlp), x, "gate_up", i)
        a = mm.silu_mul(gu, self.intermediate_size)
        return lora.apply(mm.residual(a, L.down_w, None, h), a, "down", i)

    def build_lora(self, spec: LoraSpec, adapter_id: int, max_rank: int) -> LoraAdapter:
        """`spec`'s adapter read and laid out as the steps run it, not yet served (LoraError where it cannot be):
        any thread may build one while the worker runs steps (`LoraRegistry`'s loader)."""
        if not self.serves_lora:
            raise LoraError("this engine was not started to serve LoRA adapters (enable_lora)")
        return self.prepare_lora(load_adapter(spec, adapter_id, self.lora_shape, self.dtype, self.embed.device,
                                              max_rank))

    def prepare_lora(self, adapter: LoraAdapter) -> LoraAdapter:
        """`adapter`'s updates laid out as the matmul strategy runs them (any thread)."""
        adapter.packed = {(which, i): pack_pair(self.mm, *pair) for i, L in enumerate(adapter.layers)
                          for which in PROJECTIONS if (pair := getattr(L, which)) is not None}
        if adapter.device is not None and adapter.device.type == "cuda":
            torch.cuda.current_stream(adapter.device).synchronize()  # its copies landed before a step reads them
        return adapter

    def install_lora(self, adapter: LoraAdapter) -> LoraAdapter:
        """Serve a built adapter to the requests whose lora_id is its id (on the worker, between steps)."""
        self.loras[adapter.id] = adapter
        return adapter

    def remove_lora(self, adapter_id: int) -> None:
        self.loras.pop(adapter_id, None)
        self.lora_stacks.forget(adapter_id)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of these rows' last hidden states: the final norm, then the LM head."""
        return self.mm.linear(self.backend.rms_norm(h, self.norm, self.eps), self.lm_head)


def build_decoder(model_impl: str, bundle, backend: Backend, upcast: bool = False,
                  lora: bool = False) -> KairosDecoder | None:
    """The decoder `model_impl` asks for: "hf" -> None (HF forward); "kairos" -> ours or a ValueError;
    "auto" -> ours when it supports the model. `lora`: it serves LoRA adapters (only ours does: a ValueError
    where it cannot run the model)."""
    reason = unsupported_reason(bundle.model) if model_impl != "hf" else "model_impl='hf'"
    if lora and reason is not None:
        raise ValueError(f"LoRA adapters are served by Kairos's own decoder (llama, mistral, qwen2, qwen3), which "
                         f"cannot run {bundle.name!r}: {reason}")
    if model_impl == "hf":
        return None
    if reason is None:
        return KairosDecoder(bundle.model, bundle.max_model_len, backend, upcast, lora)
    if model_impl == "kairos":
        raise ValueError(f"model_impl='kairos' cannot run {bundle.name!r}: {reason}; use model_impl='hf'")
    return None
