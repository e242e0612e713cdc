"""Test helpers: tiny random HF checkpoints (GPT-2, Llama with GQA, Qwen2 with qkv bias, Qwen3 with q/k norms),
built offline.

`build_tiny_checkpoint(family, out_dir)` writes a real checkpoint with `save_pretrained` (safetensors,
config.json, generation_config.json) plus a 512-token byte-level BPE tokenizer trained on the bundled
corpus, so tests exercise the same `from_pretrained` path as real models. Deterministic for a given
seed (same bytes in any process). Model vocab == len(tokenizer) == 512.

`q4_1_round_trip(w)`, `q8_0_round_trip(w)`: a weight's values after a GGUF Q4_1 / Q8_0 round trip, the values the
grid-weight kernels pack exactly (tests). `idle_stats(engine)`: an engine's stats once it has published its last step.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from engine.default_model import (
    EOS_TOKEN,
    IM_END,
    deterministic_cpu_build,
    quiet_progress_bars,
    build_tokenizer,
)

TinyFamily = Literal["gpt2", "llama", "qwen2", "qwen3"]
TINY_FAMILIES: tuple[str, ...] = ("gpt2", "llama", "qwen2", "qwen3")
TINY_VOCAB = 512
TINY_MAX_POSITIONS = 512


def _tiny_config(family: str, vocab: int, eos_id: int):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=TINY_MAX_POSITIONS, **ids
        )
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        intermediate_size=128,
        max_position_embeddings=TINY_MAX_POSITIONS,
        **ids,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)  # q/k/v projections carry a bias in Qwen2
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16)  # RMSNorm over each head's q and k before RoPE
    raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")


def build_tiny_checkpoint(family: TinyFamily, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write a tiny random `family` checkpoint + tokenizer into `out_dir` (created). Returns the path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(TINY_VOCAB)
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    config = _tiny_config(family, len(tok), eos_id)
    config.dtype = "float32"
    with deterministic_cpu_build(seed):
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[eos_id, tok.convert_tokens_to_ids(IM_END)], pad_token_id=eos_id
    )
    with quiet_progress_bars():
        model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def q4_1_round_trip(w: "torch.Tensor") -> "torch.Tensor":
    """w's values after a Q4_1 round trip as GGUF makes it (ggml's quantize_row_q4_1_ref, then gguf's de-quantize in
    fp32): per block of 32 k of a row, d = fp16((max - min) / 15), m = fp16(min), q = trunc((x - min) / d + 0.5)
    capped at 15, value fl(fl(d * q) + m)."""
    import torch

    b = w.reshape(w.shape[0], -1, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.where(d > 0, (b - lo) * torch.where(d > 0, 1 / d, 0) + 0.5, 0).floor().clamp(0, 15)
    return ((d.half().float() * q) + lo.half().float()).reshape(w.shape)


def q8_0_round_trip(w: "torch.Tensor") -> "torch.Tensor":
    """w's values after a Q8_0 round trip (quantize_row_q8_0_ref, then gguf's de-quantize): per block of 32 k,
    d = amax / 127, q = round(x / d), value fl(fp16(d) * q)."""
    import torch

    b = w.reshape(w.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, b * torch.where(d > 0, 1 / d, 0), 0).round() + 0.0  # q is an int8: no -0
    return (d.half().float() * q).reshape(w.shape)


__all__ = ["TINY_FAMILIES", "TINY_MAX_POSITIONS", "TINY_VOCAB", "TinyFamily", "build_tiny_checkpoint", "q4_1_round_trip",
           "q8_0_round_trip"]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_lora(base: str | os.PathLike[str], out_dir: str | os.PathLike[str], seed: int = 0,
                    targets: tuple[str, ...] = LORA_TARGETS, r: int = 8, alpha: float = 16, rslora: bool = False,
                    scale: float = 3.0) -> Path:
    """Write a PEFT LoRA adapter of `base` (a checkpoint's folder) into `out_dir` with PEFT's own `save_pretrained`:
    random A and B (PEFT's init leaves B zero, an update of nothing), times `scale` so that it changes the replies.
    Needs peft (a test dependency)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with deterministic_cpu_build(seed):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                            use_rslora=rslora)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.mul_(scale)
    out = Path(out_dir)
    with quiet_progress_bars():
        peft_model.save_pretrained(out)
    return out


def idle_stats(engine, timeout: float = 10.0):
    """An engine's stats once it has published its last step (a reply's final item goes out before it): every KV
    block free and nothing running, or as they are at `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        if (st.num_running == 0 and st.kv_blocks_free == st.kv_blocks_total) or time.monotonic() > deadline:
            return st
        time.sleep(0.01)
