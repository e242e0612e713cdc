"""Load a causal LM + fast tokenizer into a `ModelBundle` (embedded Kairos models, local dirs, hub ids).

A Llama-family checkpoint that Kairos's own decoder will run, in a local folder (or, offline, a hub id's files in the
hub cache), is read straight from its safetensors (`engine.own_model`: no transformers modeling code imported);
everything else goes through `from_pretrained` (the embedded models are built once into the cache by
`engine.default_model.ensure_default_model` and then loaded like any checkpoint). With `HF_HUB_OFFLINE=1` nothing is
fetched (`local_files_only=True`). `attn_implementation` is passed through to `from_pretrained`; Kairos's paged
attention (`engine.attention.ATTN_NAME`) is registered first.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from core.sampling import SamplingParams, finite_number
from engine.backends import default_dtype
from engine.config import SUPPORTED_FAMILIES, check_family
from engine import own_model
from engine.attention import ATTN_NAME
from engine.attention import register as register_paged_attention
from engine.default_model import EMBEDDED_MODELS, ensure_default_model, quiet_progress_bars

log = logging.getLogger("kairos.loader")
ROPE_BUFFERS = ("inv_freq", "original_inv_freq")  # a rotary module's frequencies (ours, HF's): kept in fp32


_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,  # (vLLM's --dtype names)
    "float": torch.float32,
}


@dataclass
class ModelBundle:
    model: Any  # transformers PreTrainedModel (causal LM), or `own_model.CausalLM`; eval mode, no grads
    tokenizer: Any  # fast tokenizer (has `.backend_tokenizer` for DecodeStream)
    config: Any  # the HF config
    device: torch.device
    dtype: torch.dtype
    name: str  # what the user asked for ("kairos-default", a path, a hub id)
    path: str  # resolved checkpoint directory (or hub id)
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    vocab_limit: int = 0  # = len(tokenizer) (capped at the embedding rows): ids >= this are never sampled
    tokenizer_path: str = ""  # where the tokenizer was loaded from (resolved like `path`)
    # the sampling knobs its generation_config sets, as it sets them (`sampling_defaults` reads them)
    generation_sampling: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- device / dtype


def resolve_device(s: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda if available else cpu; otherwise a torch device string ("cpu", "cuda", "cuda:1"). A CUDA device
    always comes back with its index ("cuda" is the current device, cuda:0 unless set): torch.cuda.set_device and the
    memory queries refuse an unindexed one."""
    if isinstance(s, torch.device):
        dev = s
    elif s is None or str(s).strip().lower() == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(str(s).strip().lower())
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid device {s!r}: expected auto, cpu, cuda or cuda:N ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {s!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {s!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {s!r}: expected auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(s: str | torch.dtype, device: torch.device | str, backend: str = "auto") -> torch.dtype:
    """Map a dtype option to a torch dtype.

    "fp32"/"float32"/"float", "bf16"/"bfloat16", "fp16"/"float16"/"half" are taken literally. "auto" is the device's
    backend's choice (`engine.backends`): on CUDA bfloat16 where the GPU supports it, else float16; on CPUs with
    native bf16 (AVX512-BF16 or AMX) bfloat16, whatever the checkpoint's dtype, as vLLM's CPU backend does; on other
    CPUs float32, where bf16 GEMMs are emulated.
    """
    if isinstance(s, torch.dtype):
        if s not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {s}: expected float32, bfloat16 or float16")
        return s
    key = str(s).strip().lower()
    if key in _DTYPES:
        return _DTYPES[key]
    if key != "auto":
        raise ValueError(f"unsupported dtype {s!r}: expected auto, {', '.join(_DTYPES)}")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    return default_dtype(dev, backend)


# --------------------------------------------------------------------------- helpers


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _short(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~", ".\\")) or s.count("/") > 1 or "\\" in s or s in (".", "..")


def _resolve_source(model: str, what: str) -> tuple[str, bool]:
    """Return (path or hub id, is_local)."""
    if model in EMBEDDED_MODELS:
        return str(ensure_default_model(model)), True
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded), True
    if os.path.exists(expanded):
        raise ValueError(f"cannot load {what} {model!r}: {expanded} is a file, expected a checkpoint directory")
    if _looks_like_path(model):
        raise ValueError(f"cannot load {what} {model!r}: no such directory")
    return model, False  # a hub id


def model_max_len(config: Any) -> int | None:
    """The positions a model takes: its config's, times the factor of a RoPE scaling that extends them (YaRN's from
    its original positions, linear's), as vLLM derives them (Qwen2.5's long-context set-up adds YaRN to its config).
    Llama 3's and LongRoPE's configs give their extended positions already; dynamic NTK is left at the config's (its
    frequencies past them hang on the longest sequence in the batch)."""
    base = next((v for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
                 if isinstance(v := getattr(config, attr, None), int) and not isinstance(v, bool) and v > 0), None)
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if base is None or not isinstance(scaling, dict):
        return base
    kind, factor = scaling.get("rope_type") or scaling.get("type"), scaling.get("factor")
    if kind not in ("yarn", "linear") or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or factor <= 1:
        return base
    original = scaling.get("original_max_position_embeddings")
    if kind == "yarn" and isinstance(original, int) and not isinstance(original, bool) and original > 0:
        base = original
    return int(base * factor)


_FULL_ATTENTION = frozenset({"llama", "gpt2"})  # families whose every layer attends to the whole context


def sliding_window(config: Any) -> int | None:
    """The attention window of a model whose layers (some or all) attend only to their last W positions (Mistral's
    `sliding_window`; Qwen2/3 with `use_sliding_window`, from `max_window_layers` on), None where every layer
    attends to the whole context. Kairos's attention is full attention, which equals sliding-window attention
    exactly while the context holds at most W tokens: `load_model` caps the context window there (as vLLM's
    `--disable-sliding-window` does)."""
    w = getattr(config, "sliding_window", None)
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
        return None
    if getattr(config, "model_type", None) in _FULL_ATTENTION:  # (their attention never reads the key: HF's, vLLM's)
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return w if "sliding_attention" in types else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return w


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v if x is not None]


# --------------------------------------------------------------------------- load


def _generation_config(path: str, config: Any, hub_kw: dict[str, Any]) -> Any:
    """The checkpoint's generation config, as `from_pretrained` sets it: its generation_config.json, else (none, or
    one that cannot be read) the generation keys of its config.json."""
    from transformers import GenerationConfig

    kw = {k: v for k, v in hub_kw.items() if k != "trust_remote_code"}
    try:
        return GenerationConfig.from_pretrained(path, **kw)
    except OSError:
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True, **kw)


def _cached_snapshot(repo_id: str) -> str | None:
    """The folder of hub id `repo_id`'s files in the local hub cache (its main revision), None where none is cached:
    what `from_pretrained` reads offline."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a valid repo id: from_pretrained says why
        return None


def _from_pretrained(model: str, path: str, config: Any, dev: torch.device, load_kw: dict[str, Any],
                     hub_kw: dict[str, Any], load_format: str) -> Any:
    """The model through transformers' `from_pretrained` (`load_format="dummy"`: `from_config`, random weights)."""
    from transformers import AutoModelForCausalLM

    if load_kw.get("attn_implementation") == ATTN_NAME:
        register_paged_attention()
    try:
        if load_format == "dummy":
            lm = _dummy_model(AutoModelForCausalLM, config, dev, load_kw)
            # the checkpoint's generation config, as from_pretrained reads it (its EOS ids, sampling defaults)
            lm.generation_config = _generation_config(path, config, hub_kw)
        else:
            with quiet_progress_bars():
                lm, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **load_kw)
            _check_loaded(model, info)
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        # (a tensor of another shape than the config's: transformers' RuntimeError, naming none; a corrupt file:
        # safetensors')
        raise ValueError(f"cannot load model {model!r}: {_mismatched(path, config) or _short(e)}") from None
    return lm


def _mismatched(path: str, config: Any) -> str | None:
    """The first tensor of a local checkpoint's safetensors whose shape is not the one its config describes, a
    safetensors file that cannot be read (truncated: its error named no file), or its shard index that is not JSON,
    said as a reason (None: none found)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    try:
        files = own_model.weight_files(path) if os.path.isdir(path) else None
    except ValueError as e:  # (an index that is not JSON)
        return str(e)
    if not files:
        return None
    try:
        with torch.device("meta"):
            wanted = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
        for file in files:
            try:
                opened = safe_open(str(file), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError, or an OSError
                return f"{file.name} is not a readable safetensors file ({_short(e)})"
            with opened as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    if key in wanted and wanted[key] != shape:
                        return own_model.shape_mismatch(key, shape, wanted[key], file)
    except Exception:  # noqa: BLE001 - (a reason where one is found; transformers' own message otherwise)
        return None
    return None


def _check_rotary(model: str, lm: Any, config: Any) -> None:
    """Refuse a rotary embedding narrower than the heads it turns where the family's attention turns whole heads
    (a partial_rotary_factor under a scaled RoPE in a Llama-family config): its first step failed with a bare
    AssertionError, and HF's own forward cannot run it either."""
    rot = getattr(getattr(lm, "model", None), "rotary_emb", None)
    inv = getattr(rot, "inv_freq", None)
    head = getattr(config, "head_dim", None) or (config.hidden_size // config.num_attention_heads
                                                 if getattr(config, "num_attention_heads", None) else None)
    if getattr(config, "model_type", None) in own_model.FAMILIES and isinstance(inv, torch.Tensor) and head \
            and 2 * inv.numel() != head:
        raise ValueError(f"cannot load model {model!r}: its rotary embedding turns {2 * inv.numel()} of each head's "
                         f"{head} dimensions (partial_rotary_factor), which this model family's attention does not "
                         "run")


def _fix_longrope(model: str, lm: Any, config: Any, max_model_len: int) -> None:
    """LongRoPE (Phi-3's, `rope_type` longrope) as vLLM runs it: its long factors for every position where the context
    window passes the pretraining one (`original_max_position_embeddings`), else its short ones. HF's rotary module
    chooses by the longest position of the tensor it is given: over a packed step of several requests, a short one
    took the long factors because another was long (and a chunked prompt's chunks took different ones). ValueError
    where this transformers' module does not hold what the choice needs."""
    for m in lm.modules():
        if getattr(m, "rope_type", None) != "longrope":
            continue
        params = getattr(config, "rope_parameters", None) or {}
        original = params.get("original_max_position_embeddings") \
            or getattr(config, "original_max_position_embeddings", None)
        short = getattr(m, "original_inv_freq", None)
        if not isinstance(original, int) or not isinstance(short, torch.Tensor):
            raise ValueError(f"cannot load model {model!r}: its LongRoPE needs original_max_position_embeddings and "
                             "a rotary module that keeps its short factors")
        if max_model_len > original:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

            chosen = ROPE_INIT_FUNCTIONS["longrope"](config, short.device, seq_len=original + 1)[0]
        else:
            chosen = short.clone()
        # (its update picks one of the two by each call's longest position: both are the one chosen)
        m.inv_freq.copy_(chosen.to(m.inv_freq.device, m.inv_freq.dtype))
        m.original_inv_freq, m.long_inv_freq = chosen, chosen


# tensors an older checkpoint may hold that every model computes instead (vLLM skips them too)
_COMPUTED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _check_loaded(model: str, info: dict[str, Any]) -> None:
    """Refuse a checkpoint whose tensors are not the ones its config says (transformers' loading info, after the
    model's own ignore lists): one it lacks would be served with random weights, and one it holds that the model does
    not use would be dropped (a bias the config leaves out), both only logged by transformers, as vLLM refuses."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not k.endswith(_COMPUTED))
    if missing or unexpected:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
        said = ([f"missing {few(missing)}"] if missing else []) + \
            ([f"unused {few(unexpected)}"] if unexpected else [])
        raise ValueError("its tensors are not those its config describes: " + "; ".join(said))


def _has_remote_code(path: str) -> bool:
    cfg = Path(path) / "config.json"
    try:
        return "auto_map" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def _dummy_model(auto: Any, config: Any, dev: torch.device, load_kw: dict[str, Any]) -> Any:
    """The model of `config` with random weights, created on `dev` (no host copy of a large model), seeded."""
    kw = {k: v for k, v in load_kw.items() if k in ("dtype", "attn_implementation", "trust_remote_code")}
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.device(dev):
        torch.manual_seed(0)
        return auto.from_config(config, **kw)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def _check_tokenizer_files(path: str, name: str) -> None:
    """A local folder with no tokenizer files, or a SentencePiece model with no tokenizer.json where sentencepiece
    is not installed: ValueError saying so (transformers said to install sentencepiece or tiktoken). A folder that
    is not here (a hub id) is left to transformers."""
    if not os.path.isdir(path):
        return
    names = set(os.listdir(path))
    if not names & set(TOKENIZER_FILES) and not any(n.endswith((".tiktoken", ".model")) or "tekken" in n
                                                    for n in names):
        raise ValueError(f"cannot load tokenizer {name!r}: no tokenizer files in {path} (tokenizer.json, "
                         "tokenizer_config.json, ...): copy the base model's there, or give tokenizer=<its folder>")
    if "tokenizer.model" in names and "tokenizer.json" not in names:
        import importlib.util

        if importlib.util.find_spec("sentencepiece") is None and importlib.util.find_spec("tiktoken") is None:
            raise ValueError(f"cannot load tokenizer {name!r}: {path} has a SentencePiece tokenizer.model and no "
                             "tokenizer.json; add its tokenizer.json (a fast tokenizer's save_pretrained writes one), "
                             "or install sentencepiece and protobuf to convert it")


def load_model(
    model: str,
    *,
    tokenizer: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    max_model_len: int | None = None,
    backend: str = "auto",
    load_format: str = "auto",
    chat_template: str | None = None,
    own_decoder: bool = False,
) -> ModelBundle:
    """Load `model` (kairos-default / kairos-random-42m / kairos-tiny, a local HF directory, or a hub id) and its tokenizer.
    With `load_format="dummy"` (vLLM's) the weights are not read: the model of its config is built on the device with
    random weights (seed 0, the architecture's own initialisation), for measuring speed; its outputs mean nothing.

    Raises ValueError (never a bare OSError) for unknown paths/ids, unsupported model families,
    non-fast tokenizers, bad dtype/device strings, or a `max_model_len` beyond the model's positions or its sliding
    attention window (`sliding_window`).

    `own_decoder`: the caller runs the model with Kairos's own decoder where it can (never with the HF forward): a
    local checkpoint it can run (or, offline, a hub id's files in the hub cache) is read without transformers'
    modeling code (`engine.own_model`).
    """
    from transformers import AutoConfig, AutoTokenizer

    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"cannot load model {model!r}: expected a model name, directory or hub id")
    dev = resolve_device(device)
    resolve_dtype(dtype, torch.device("cpu"))  # validate the string before any loading work
    path, is_local = _resolve_source(model, "model")
    tok_path = path if tokenizer is None else _resolve_source(tokenizer, "tokenizer")[0]
    hub_kw: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if _offline():
        hub_kw["local_files_only"] = True

    if not trust_remote_code and is_local and _has_remote_code(path):
        raise ValueError(f"cannot load model {model!r}: its config.json names custom code (auto_map); "
                         "Kairos does not run checkpoint code unless trust_remote_code=True is set explicitly")
    if is_local and not os.path.isfile(os.path.join(path, "config.json")):  # (transformers: "should have a model_type")
        raise ValueError(f"cannot load model {model!r}: no config.json in {path}")
    try:
        config = AutoConfig.from_pretrained(path, **hub_kw)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build (its classes raise many kinds)
        where = "" if is_local else "not a local directory or embedded model, and as a hub id: "
        raise ValueError(f"cannot load model {model!r}: {where}{_short(e)}") from None
    family = getattr(config, "model_type", None)
    check_family(model, family)
    rope = getattr(config, "rope_parameters", None)
    rope_type = rope.get("rope_type") if isinstance(rope, dict) else None
    if isinstance(rope_type, str) and rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415 - light (no modeling)

        if rope_type not in ROPE_INIT_FUNCTIONS:  # (it failed with a bare KeyError's text as it loaded)
            raise ValueError(f"cannot load model {model!r}: its RoPE type {rope_type!r} (rope_scaling) is none this "
                             f"transformers knows ({', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    quant = getattr(config, "quantization_config", None)
    if quant is not None:  # (its modules would be transformers' quantized ones, or an ImportError for their library)
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        raise ValueError(f"cannot load model {model!r}: it is a quantized checkpoint ({method or 'quantization_config'}"
                         "), which Kairos does not serve: give its unquantized (bf16/fp16/fp32) checkpoint")

    model_max = model_max_len(config)
    window = sliding_window(config)
    if max_model_len is not None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if model_max is not None and max_model_len > model_max:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's maximum context of {model_max} positions"
            )
        if window is not None and max_model_len > window:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds model {model!r}'s sliding attention window of {window} "
                "tokens: Kairos attends to the whole context, which equals the model's attention only up to its "
                f"window; pass max_model_len <= {window}"
            )
        limit = max_model_len
    elif model_max is not None:
        limit = model_max
        if window is not None and window < limit:
            log.warning("model %r attends within a sliding window of %d tokens; Kairos attends to the whole "
                        "context, so its context window is capped at %d (of %d positions)", model, window, window,
                        limit)
            limit = window
    else:
        raise ValueError(f"model {model!r} does not declare its context length; pass max_model_len")

    _check_tokenizer_files(tok_path, tokenizer or model)
    try:
        tok = AutoTokenizer.from_pretrained(tok_path, **hub_kw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load tokenizer {tokenizer or model!r}: {_short(e)}") from None
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(
            f"tokenizer for {tokenizer or model!r} is not a fast (tokenizers-backed) tokenizer; "
            "streaming detokenization needs one (save it with tokenizer.json)"
        )
    if chat_template is not None:  # vLLM's --chat-template: in place of the tokenizer's own
        tok.chat_template = chat_template

    torch_dtype = resolve_dtype(dtype, dev, backend)
    load_kw = dict(hub_kw, config=config, dtype=torch_dtype)
    if attn_implementation is not None:
        load_kw["attn_implementation"] = attn_implementation
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    lm = None
    if own_decoder and load_format == "auto":
        local = path if is_local else _cached_snapshot(path) if _offline() else None
        if local is not None:
            try:
                lm = own_model.load(local, config, torch_dtype, dev)
                if lm is not None:
                    lm.generation_config = _generation_config(local, config, hub_kw)
            except (OSError, ValueError, RuntimeError, SafetensorError) as e:
                raise ValueError(f"cannot load model {model!r}: {_short(e)}") from None
    if lm is None:
        lm = _from_pretrained(model, path, config, dev, load_kw, hub_kw, load_format)
    _check_rotary(model, lm, config)
    _fix_longrope(model, lm, config, limit)
    # the rotary frequencies stay in fp32, as HF's and vLLM's (a cast to bf16 turns a long prompt's angles)
    rope = [(m, name, b.detach().float().clone()) for m in lm.modules()
            for name, b in m.named_buffers(recurse=False) if name in ROPE_BUFFERS and b is not None]
    lm = lm.to(device=dev, dtype=torch_dtype)
    for m, name, b in rope:
        m._buffers[name] = b.to(dev)
    lm.eval()
    lm.requires_grad_(False)

    eos: list[int] = []
    gen_cfg = getattr(lm, "generation_config", None)
    for v in (getattr(gen_cfg, "eos_token_id", None), getattr(config, "eos_token_id", None), tok.eos_token_id):
        for i in _ids(v):
            if i not in eos:
                eos.append(i)

    out_emb = lm.get_output_embeddings()
    rows = int(out_emb.weight.shape[0]) if out_emb is not None else int(config.vocab_size)
    try:
        given = gen_cfg.to_diff_dict() if gen_cfg is not None else {}
    except Exception:  # noqa: BLE001 - an odd generation config: no sampling defaults, as without one
        log.warning("model %s: its generation config could not be read; no sampling defaults", model)
        given = {}
    return ModelBundle(
        model=lm,
        tokenizer=tok,
        config=config,
        device=dev,
        dtype=torch_dtype,
        name=model,
        path=path,
        max_model_len=limit,
        eos_token_ids=eos,
        vocab_limit=min(len(tok), rows),
        tokenizer_path=tok_path,
        generation_sampling={k: given[k] for k in SAMPLING_DEFAULT_KEYS if k in given},
    )


# what a generation_config may set that requests take (vLLM's `--generation-config auto`); max_new_tokens is taken
# as max_tokens: a cap on every reply, as vLLM's
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def sampling_defaults(given: dict[str, Any]) -> tuple[dict[str, float | int], dict[str, Any]]:
    """What a checkpoint's generation_config sets (`ModelBundle.generation_sampling`) as the defaults of requests
    that leave them out, as vLLM's `--generation-config auto` takes them: the temperature, top_p, top_k, min_p and
    repetition_penalty it sets (those it leaves unset are not), each one `SamplingParams.validate` takes, and its
    max_new_tokens as `max_tokens` (a cap on every reply: vLLM's); and what it sets that is not taken (an invalid
    value), for the log."""
    taken: dict[str, float | int] = {}
    skipped: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        v = given.get(key)
        if v is None:
            continue
        number = finite_number(v) and not isinstance(v, bool)
        name = "max_tokens" if key == "max_new_tokens" else key
        value = (int(v) if name in ("top_k", "max_tokens") else float(v)) if number else None
        try:
            if value is None or value != v or (name == "max_tokens" and value < 1):  # (a top_k of 2.5)
                raise ValueError
            SamplingParams(**{name: value}).validate()
            taken[name] = value
        except ValueError:
            skipped[key] = v
    return taken, skipped


__all__ = ["ModelBundle", "SUPPORTED_FAMILIES", "load_model", "resolve_device", "resolve_dtype"]
