"""A model's tokenizer for a process that runs no model: where its files are, and a light way to load it.

transformers' `AutoTokenizer` imports its configuration classes, and with them torch (its distributed tensors and
sympy too): seconds of CPU and hundreds of MB in a process that needs only the tokenizer, e.g. a Serve replica whose
engine runs in a child process (`engine.core_proc`). Where a local directory's tokenizer_config.json names
transformers' generic fast tokenizer and no code of its own, `load_light` builds that class from the directory
directly, without `AutoTokenizer` and without torch. `AutoTokenizer` may still pick another class for such a
directory (its choice also reads the model's config); so whoever uses `load_light` checks the class against the one
`AutoTokenizer` built in the engine (`class_name`), and loads through `AutoTokenizer` where they differ.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.default_model import EMBEDDED_MODELS, is_complete, model_dir

# the names a tokenizer_config.json gives transformers' generic fast tokenizer (the second, its name before v5)
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def ready_tokenizer_dir(model: str, tokenizer: str | None = None) -> str | None:
    """The local directory `engine.loader.load_model` will load the tokenizer of (`model`, `tokenizer`) from, where
    it exists already (an embedded model built before, a checkpoint directory), else None (a hub id, an embedded
    model not built yet, a path that is not a directory): what another process may load beside the engine's own
    start without building, downloading or racing it for anything."""
    name = tokenizer if tokenizer is not None else model
    if not isinstance(name, str) or not name.strip():
        return None
    if name in EMBEDDED_MODELS:
        target = model_dir(name)
        return str(target) if is_complete(target) else None
    expanded = os.path.expanduser(name)
    return os.path.abspath(expanded) if os.path.isdir(expanded) else None


def class_name(tokenizer: Any) -> str:
    """The tokenizer's class, qualified by its module: what `load_light`'s result is checked against."""
    cls = type(tokenizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def load_light(path: str) -> Any | None:
    """The generic fast tokenizer of local directory `path`, loaded without `AutoTokenizer`, where its
    tokenizer_config.json names that class (`GENERIC_CLASSES`) and no code of its own (auto_map), beside a
    tokenizer.json; else None (also where transformers has no such class). Raises what loading raises."""
    folder = Path(path)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES or "auto_map" in config
            or not (folder / "tokenizer.json").is_file()):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: PLC0415 - no torch
    except ImportError:  # a transformers without that module: AutoTokenizer, then
        return None
    return TokenizersBackend.from_pretrained(str(folder), local_files_only=True)
