"""Bench models: the built-on-demand llama-110m checkpoint, model-name resolution, weight sizes, memory."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.default_model import LLAMA_COMMON

# Llama 768/12/12/2048/32000, tied (baseline.md "llama-110m"): the heavy bench model.
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "llama-110m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        # the shared Llama settings, less model_type (never part of this spec, so the cache hash stays)
        **{k: v for k, v in LLAMA_COMMON.items() if k != "model_type"},
    },
}
BENCH_SEED = 0
_TOKENIZER_SOURCE = "kairos-default"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def bench_model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    from engine.default_model import cache_root, recipe_hash

    spec = {"name": name, "seed": BENCH_SEED, "config": BENCH_MODELS[name],
            "tokenizer_from": f"{_TOKENIZER_SOURCE}-{recipe_hash(_TOKENIZER_SOURCE)}"}
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / "bench" / f"{name}-{h}"


def ensure_bench_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build bench model `name` (random init, seed 0, fp32) once with save_pretrained; return its directory.

    The tokenizer (and generation config: eos = <|endoftext|>, <|im_end|>) is copied from the embedded
    kairos-default checkpoint. Built in a temp dir and published with os.replace (safe against races).
    """
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    target = bench_model_dir(name, cache_dir)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file() \
            and (target / "tokenizer.json").is_file():
        return target
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.default_model import deterministic_cpu_build, ensure_default_model, quiet_progress_bars

    src = ensure_default_model(_TOKENIZER_SOURCE, cache_dir)
    src_cfg = json.loads((src / "config.json").read_text())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        config = LlamaConfig(**BENCH_MODELS[name], bos_token_id=src_cfg.get("bos_token_id", 0),
                             eos_token_id=src_cfg.get("eos_token_id", 0), pad_token_id=src_cfg.get("pad_token_id", 0))
        config.dtype = "float32"
        with deterministic_cpu_build(BENCH_SEED):
            model = LlamaForCausalLM(config)
        model.eval()
        with quiet_progress_bars():
            model.save_pretrained(tmp)
        del model
        for f in _TOKENIZER_FILES:  # overwrites save_pretrained's generation_config.json with the ChatML one
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
        (tmp / "kairos_bench_model.json").write_text(json.dumps(
            {"name": name, "seed": BENCH_SEED, "config": BENCH_MODELS[name], "tokenizer_from": str(src)},
            indent=2, sort_keys=True) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    gc.collect()
    return target


def resolve_bench_model(name: str) -> str:
    """What to hand to `load_model`/`EngineConfig(model=...)`: bench-model names become their built directory;
    embedded names (kairos-default, kairos-tiny), paths and hub ids pass through unchanged."""
    if name in BENCH_MODELS:
        return str(ensure_bench_model(name))
    return name


def resolve_model_path(name: str) -> str:
    """The checkpoint directory (or hub id) for `name`, building embedded / bench models if needed."""
    if name in BENCH_MODELS:
        return str(ensure_bench_model(name))
    from engine.default_model import EMBEDDED_MODELS, ensure_default_model

    if name in EMBEDDED_MODELS:
        return str(ensure_default_model(name))
    p = os.path.expanduser(name)
    return os.path.abspath(p) if os.path.isdir(p) else name


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters (tied weights counted once) — what one decode step must read."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def num_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def free_memory() -> None:
    """Collect garbage and trim the malloc heap, to return memory between phases (drop your references first)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed arenas back to the OS (glibc)
    except (OSError, AttributeError):
        pass


__all__ = [
    "BENCH_MODELS", "LoadLog", "best_of", "bench_model_dir", "clean", "command_line", "cpu_flags", "cpu_model",
    "ensure_bench_model", "format_table", "free_memory", "loadavg", "measure_bandwidth_gb_s", "now_iso",
    "num_params", "percentile", "print_table", "resolve_bench_model", "resolve_model_path", "run_info",
    "summarize", "timed", "weight_bytes", "write_json",
]
