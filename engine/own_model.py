"""A Llama-family checkpoint's modules read straight from its safetensors, for Kairos's own decoder.

`KairosDecoder` uses a model's modules only as holders of its weights and of its RoPE tables: it never runs their
forward. Building them through transformers' `from_pretrained` imports its modeling code, which imports much of
torch besides (distributed tensors, dynamo, sympy): several seconds of CPU in every engine process that starts (a
replica's cold start, a scale-up's first token), before any weight is read. This builds the same tree under the
same names (`model.embed_tokens`, `model.layers[i].self_attn.{q,k,v,o}_proj`, qwen3's `q_norm` and `k_norm`,
`.mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`, `model.norm`, `model.rotary_emb`,
`lm_head`), with the biases the HF class of the family has, and fills it from the checkpoint's tensors, cast to the
dtype asked for.

Only where the result is the model `from_pretrained` would build (`why_not`): the checkpoint is safetensors files
(the one file, else the shards its index names), and holds exactly the tensors of that tree, of its shapes (a tied LM
head: none of its own), with no quantization, no code of its own and no other weights file named; the RoPE is one
whose tables depend on the position alone. Anything else is None, and the caller loads it with `from_pretrained`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger("kairos.loader")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TABLE_ROPE = ("default", "linear", "llama3", "yarn")  # position-only RoPE: one table serves every step
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def unsupported_reason(config: Any) -> str | None:
    """None where `KairosDecoder` can run a model of this config, else why not (the engine then runs HF's forward)."""
    if getattr(config, "model_type", None) not in FAMILIES:
        return f"model family {getattr(config, 'model_type', None)!r} (ours: {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v, o) biases, as the family's HF attention module has them."""
    if config.model_type == "qwen2":
        return True, False
    if config.model_type == "mistral":
        return False, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _rope(config: Any) -> tuple[str, dict] | None:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not isinstance(params.get("rope_type"), str):
        return None
    return params["rope_type"], params


class RMSNorm(nn.Module):
    """A norm's weight (the decoder runs the norm)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n), requires_grad=False)


class Rotary(nn.Module):
    """The cos/sin tables of the checkpoint's RoPE, computed as the family's HF rotary module computes them: inverse
    frequencies in fp32 (`rope_type` default, or transformers' init function of that type), scaled by its attention
    factor, cast to the activations' dtype."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        rope_type, params = _rope(config)
        self.rope_type = rope_type
        if rope_type == "default":
            dim = _head_dim(config)
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415 - light (no modeling)

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hd, heads = _head_dim(config), config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        qkv_bias, o_bias = _attention_biases(config)
        self.q_proj = nn.Linear(config.hidden_size, heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * hd, config.hidden_size, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm, self.k_norm = RMSNorm(hd), RMSNorm(hd)


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class Layer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)


class Body(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        # (given its weight: an nn.Embedding initialises one it makes, which on the meta device imports torch's
        # compiler)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size)


class CausalLM(nn.Module):
    """The module tree of a Llama-family *ForCausalLM, holding its weights: no forward of its own (the engine runs
    it with `KairosDecoder`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.generation_config = None  # (the loader's: as from_pretrained reads it)
        self.model = Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this model's modules hold its weights for Kairos's own decoder; they have no forward "
                           "(model_impl='hf' loads it with transformers)")


def shape_mismatch(key: str, shape: tuple[int, ...], wanted: tuple[int, ...], file: Path) -> str:
    """Why a checkpoint cannot load: its tensor `key` in `file` is of another shape than its config describes."""
    return (f"its tensor {key} is {list(shape)} in {file.name}, where its config.json describes {list(wanted)} (a "
            "vocab_size that is not the embedding's rows?)")


def weight_files(path: str | Path) -> list[Path] | None:
    """The safetensors files of a checkpoint directory, as `from_pretrained` picks them: the one file, else the shards
    its index names (None: neither, or an index naming a file outside the directory)."""
    root = Path(path)
    single = root / _SINGLE
    if single.is_file():
        return [single]
    index = root / _INDEX
    if not index.is_file():
        return None
    try:
        text = index.read_text()
    except OSError:
        return None
    try:
        names = sorted(set(json.loads(text)["weight_map"].values()))
    except ValueError as e:  # (transformers' own read named no file)
        raise ValueError(f"{_INDEX} is not JSON ({e})") from None
    except (KeyError, TypeError, AttributeError):
        return None
    if not names or any(not isinstance(n, str) or Path(n).is_absolute() or ".." in Path(n).parts for n in names):
        return None
    files = [root / n for n in names]
    return files if all(f.is_file() for f in files) else None


def why_not(config: Any) -> str | None:
    """None where `load` can build a model of this config (its tensors permitting), else why it is left to
    `from_pretrained`."""
    reason = unsupported_reason(config)
    if reason is not None:
        return reason
    if getattr(config, "quantization_config", None) is not None:
        return "a quantized checkpoint"
    if getattr(config, "auto_map", None):
        return "the checkpoint's own code (auto_map)"
    if getattr(config, "transformers_weights", None):
        return "weights named by transformers_weights"
    rope = _rope(config)
    if rope is None or rope[0] not in TABLE_ROPE:
        return f"RoPE {rope[0] if rope else None!r}"
    return None


def load(path: str | Path, config: Any, dtype: torch.dtype, device: torch.device) -> CausalLM | None:
    """The model of a local checkpoint directory, its weights read from its safetensors onto `device` in `dtype`;
    None where it must be loaded with `from_pretrained` (`why_not`, no safetensors, or tensors that are not exactly
    the tree's)."""
    reason = why_not(config)
    files = weight_files(path) if reason is None else None
    if files is None:
        log.debug("%s: loaded with transformers (%s)", path, reason or "no safetensors weights")
        return None
    with torch.device("meta"):
        lm = CausalLM(config)
    lm.model.rotary_emb = Rotary(config)  # (after the meta block: its tables are computed, not read)
    wanted = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        wanted.pop("lm_head.weight")
    dev = "cpu" if device.type == "cpu" else str(device)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=dev) as f:
            for key in f.keys():
                shape = tuple(f.get_slice(key).get_shape())
                if key in wanted and wanted[key] != shape:  # (transformers named no tensor: ignore_mismatched_sizes)
                    raise ValueError(shape_mismatch(key, shape, wanted[key], file))
                if wanted.get(key) != shape or key in state:
                    log.debug("%s: loaded with transformers (tensor %s %s)", path, key, shape)
                    return None
                state[key] = f.get_tensor(key).to(dtype)
    if state.keys() != wanted.keys():
        log.debug("%s: loaded with transformers (tensors missing: %s)", path, sorted(wanted.keys() - state.keys()))
        return None
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    lm.load_state_dict(state, strict=True, assign=True)
    if tied:  # one parameter, as HF ties them
        lm.lm_head.weight = lm.model.embed_tokens.weight
    return lm
