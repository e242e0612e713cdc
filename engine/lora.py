"""LoRA adapters (PEFT's format) served beside the base model, as vLLM's `--enable-lora --lora-modules` serves them:
a request names an adapter as its `model` and its tokens run through the base weights plus that adapter's low-rank
update, in the same step as requests of the base model and of other adapters.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (or `adapter_model.bin`), as
PEFT's `save_pretrained` writes it. Its update of a projection W (out x in) is `scaling * B @ A` (A: r x in, B: out
x r; scaling `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA; a module's own rank and alpha where the
config's `rank_pattern` / `alpha_pattern` name it). Kairos applies it to the Llama-family projections its decoder
runs (q, k, v, o, gate, up, down), unmerged: y = x W^T + (x A^T) (scaling B)^T, for the rows of the requests that
name the adapter. q|k|v and gate|up run as one projection, so their adapters are kept fused too: their A's stacked
and their B's as one block-diagonal matrix (one pair of matmuls for the three, or two, updates).

What an adapter changes beyond those projections (embeddings, the LM head, `modules_to_save`, biases, DoRA) is
refused with the reason, rather than served differently from what it was trained as.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

from core.request import LoraSource

if TYPE_CHECKING:  # (torch is imported where tensors are made: the app's builder reads LoraSpec without it)
    import torch

log = logging.getLogger("kairos.engine")

# the projections an adapter may target, by the HF module names of the Llama family
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_MODULES + MLP_MODULES
MAX_RANK_LIMIT = 512
# adapter_config.json's keys that do not change how a served adapter computes (training, bookkeeping, initialisation),
# or that the loader reads: any other key that is set is refused (`read_config`)
SERVED_CONFIG_KEYS = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "lora_dropout", "init_lora_weights", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "megatron_config", "megatron_core", "runtime_config", "target_parameters",
    "qalora_group_size", "ensure_weight_tying",  # (these two: only with use_qalora / trainable tokens)
    "fan_in_fan_out"})  # (Conv1D's weights: PEFT sets it back to false for the Linear layers adapters here target)
KNOWN_UNSERVED = {"use_dora": "DoRA", "bias": "trained biases", "modules_to_save": "modules_to_save",
                  "layer_replication": "layer replication",
                  "alora_invocation_tokens": "activated LoRA", "trainable_token_indices": "trainable tokens",
                  "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


class LoraError(ValueError):
    """An adapter Kairos cannot serve (its files, its config, or its shapes): the message says why."""


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """An adapter to serve: the name requests give as their `model`, and its folder."""
    name: str
    path: str

    @staticmethod
    def parse(items) -> tuple["LoraSpec", ...]:
        """vLLM's `--lora-modules` forms: `name=path` strings, or mappings {"name", "path"} (JSON text too), a
        comma-separated string of `name=path`, or a mapping of name to path."""
        if items is None or items == "":
            return ()
        if isinstance(items, str):
            text = items.strip()
            if text.startswith(("[", "{")):
                try:
                    items = json.loads(text)
                except json.JSONDecodeError as e:
                    raise LoraError(f"lora_modules is not valid JSON: {e}") from None
            else:
                items = [s for s in text.split(",") if s.strip()]
        if isinstance(items, dict):  # vLLM's one {"name", "path"} object, else a mapping of name to path
            single = {"name", "path"} <= set(items) <= {"name", "path", "base_model_name"}
            items = [items] if single else [{"name": k, "path": v} for k, v in items.items()]
        out: list[LoraSpec] = []
        for it in items:
            if isinstance(it, LoraSpec):
                out.append(it)
                continue
            if isinstance(it, str) and it.lstrip().startswith("{"):  # vLLM's JSON object, one item of a list
                try:
                    it = json.loads(it)
                except json.JSONDecodeError as e:
                    raise LoraError(f"lora_modules: {it!r} is not valid JSON: {e}") from None
            if isinstance(it, str):
                name, sep, path = it.partition("=")
                if not sep:
                    raise LoraError(f"lora_modules: {it!r} is not name=path")
            elif isinstance(it, dict) and isinstance(it.get("name"), str) and isinstance(it.get("path"), str):
                name, path = it["name"], it["path"]
            elif isinstance(it, (list, tuple)) and len(it) == 2:
                name, path = it
            else:
                raise LoraError(f"lora_modules: {it!r} is neither name=path nor {{\"name\": ..., \"path\": ...}}")
            name, path = str(name).strip(), str(path).strip()
            if not name or not path:
                raise LoraError(f"lora_modules: {it!r} has an empty name or path")
            # (absolute where the app is built: a replica runs in another working directory)
            out.append(LoraSpec(name, os.path.abspath(os.path.expanduser(path))))
        names = [s.name for s in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise LoraError(f"lora_modules names {', '.join(dup)} more than once")
        return tuple(out)


@dataclass(slots=True)
class LoraLayer:
    """One layer's updates, each (A [R, in], scaled B [out, R]) or None where the adapter leaves it: q|k|v fused,
    o, gate|up fused, down."""
    qkv: tuple[torch.Tensor, torch.Tensor] | None = None
    o: tuple[torch.Tensor, torch.Tensor] | None = None
    gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
    down: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class LoraAdapter:
    """An adapter loaded for one decoder: its id (the request's `lora_id`, from 1), name, rank and layers."""
    id: int
    name: str
    path: str
    rank: int
    device: torch.device | None = None
    layers: list[LoraLayer] = field(default_factory=list)
    packed: dict[tuple[str, int], tuple] = field(default_factory=dict)  # (projection, layer): `pack_pair`'s

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for L in self.layers
                   for pair in (L.qkv, L.o, L.gate_up, L.down) if pair is not None for t in pair)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The base model's projection widths, which an adapter's shapes must match."""
    num_layers: int
    hidden: int
    q_out: int
    kv_out: int
    intermediate: int

    def io(self, module: str) -> tuple[int, int]:
        """(in, out) features of `module`."""
        return {"q_proj": (self.hidden, self.q_out), "k_proj": (self.hidden, self.kv_out),
                "v_proj": (self.hidden, self.kv_out), "o_proj": (self.q_out, self.hidden),
                "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}[module]


@dataclass(frozen=True, slots=True)
class LoraServing:
    """The adapters an engine serves, as its input processor checks what a request names: those of `lora_modules`
    by name, the folder of those loaded on demand (`dynamic_lora_loading_path`), and the model's `shape` and
    `max_rank` that a folder loaded at run time is checked against (`check_adapter`)."""
    names: frozenset[str]
    dynamic_root: str | None
    shape: ModelShape
    max_rank: int

    def serves(self, name: str) -> bool:
        return name in self.names or dynamic_adapter_dir(self.dynamic_root, name) is not None


def _pattern_value(patterns: dict, module_name: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module's name at its end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def read_config(path: Path) -> dict:
    f = path / "adapter_config.json"
    if not f.is_file():
        raise LoraError(f"LoRA adapter {str(path)!r}: no adapter_config.json there (a PEFT adapter folder)")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"LoRA adapter {str(path)!r}: adapter_config.json unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {str(path)!r}: adapter_config.json is not an object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoraError(f"LoRA adapter {str(path)!r}: peft_type {kind} (only LORA is served)")
    why = [f"{KNOWN_UNSERVED.get(k, k)} ({k}={v!r})"[:160] for k, v in cfg.items()
           if k not in SERVED_CONFIG_KEYS and _set(v) and not (k == "bias" and v == "none")]
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq")):
        # (these change the base weights as they initialise: PEFT redoes that as it loads such an adapter)
        why.append(f"an initialisation that changes the base weights (init_lora_weights={init!r}; PEFT's "
                   "path_initial_model_for_weight_conversion saves it as a plain LoRA)")
    if why:
        raise LoraError(f"LoRA adapter {str(path)!r} uses {', '.join(why)}, which Kairos does not serve (a key of "
                        "adapter_config.json it does not know, set, may change the model: it refuses it rather than "
                        "serve the adapter otherwise than it was trained)")
    for key in ("lora_alpha", "r"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise LoraError(f"LoRA adapter {str(path)!r}: {key} is {v!r}, not a positive number")
    for key in ("alpha_pattern", "rank_pattern"):
        patterns = cfg.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise LoraError(f"LoRA adapter {str(path)!r}: {key} is not an object of module patterns")
        for pattern, v in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise LoraError(f"LoRA adapter {str(path)!r}: {key} key {pattern!r} is no regex: {e}") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise LoraError(f"LoRA adapter {str(path)!r}: {key}[{pattern!r}] is {v!r}, not a positive number")
    return cfg


def _set(v) -> bool:
    """Whether a config value asks for something (a mapping of only unset values does not)."""
    if isinstance(v, dict):
        return any(_set(x) for x in v.values())
    return bool(v)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    import torch

    st, bin_ = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            return load_file(str(st))
        if bin_.is_file():
            return torch.load(str(bin_), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise LoraError(f"LoRA adapter {str(path)!r}: its weights do not read: {str(e)[:200]}") from None
    raise LoraError(f"LoRA adapter {str(path)!r}: no adapter_model.safetensors or adapter_model.bin there")


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of an adapter folder's tensors (a safetensors file's from its header, without reading them)."""
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors import safe_open

        with safe_open(str(st), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return {k: tuple(t.shape) for k, t in read_weights(path).items()}


def _pairs(name: str, shapes: dict[str, tuple[int, ...]], shape: ModelShape,
           max_rank: int) -> dict[tuple[int, str], tuple[str, str]]:
    """The (A, B) tensor names of each (layer, module) an adapter updates, its tensors' `shapes` checked against the
    model's `shape` and `max_rank`; LoraError where it updates anything else or is of other shapes."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        m = _KEY.match(key)
        if m is None:
            what = "embeddings" if "embed" in key else "the LM head" if "lm_head" in key else key
            raise LoraError(f"LoRA adapter {name!r} changes {what}, which Kairos does not serve (it applies "
                            f"adapters of {', '.join(TARGETS)})")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if module not in TARGETS:
            raise LoraError(f"LoRA adapter {name!r} targets {module}, which Kairos does not serve (it applies "
                            f"adapters of {', '.join(TARGETS)})")
        if layer >= shape.num_layers:
            raise LoraError(f"LoRA adapter {name!r} has layer {layer}; the model has {shape.num_layers}")
        pairs.setdefault((layer, module), {})[ab] = key
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r} has no LoRA weights")
    out: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer}'s {module} lacks its lora_A or lora_B")
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        fan_in, fan_out = shape.io(module)
        r = a[0] if a else 0
        if r == 0:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer}'s {module} has rank 0")
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b != (fan_out, r):
            raise LoraError(f"LoRA adapter {name!r}: layer {layer}'s {module} has A {a} and B {b}, not ({r}, "
                            f"{fan_in}) and ({fan_out}, {r}): trained for another model?")
        if r > max_rank:
            raise LoraError(f"LoRA adapter {name!r} has rank {r}, above max_lora_rank {max_rank}")
        out[(layer, module)] = (ab["A"], ab["B"])
    return out


def check_adapter(spec: LoraSpec, shape: ModelShape, max_rank: int) -> int:
    """Whether `spec`'s folder is an adapter a model of `shape` serves (its config, its tensors' names and shapes,
    none read in full): its rank, else LoraError saying why (`load_adapter` checks the same as it loads)."""
    path = Path(spec.path).expanduser()
    read_config(path)
    try:
        shapes = _tensor_shapes(path)
    except LoraError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise LoraError(f"LoRA adapter {spec.name!r}: its weights do not read: {e}") from e
    return max(shapes[a][0] for a, _ in _pairs(spec.name, shapes, shape, max_rank).values())


def load_adapter(spec: LoraSpec, adapter_id: int, shape: ModelShape, dtype: torch.dtype, device: torch.device,
                 max_rank: int) -> LoraAdapter:
    """`spec`'s adapter for a model of `shape`, its tensors in `dtype` on `device`; LoraError where it cannot be
    served as trained."""
    import torch

    path = Path(spec.path).expanduser()
    cfg = read_config(path)
    weights = read_weights(path)
    alpha0 = float(8 if cfg.get("lora_alpha") is None else cfg["lora_alpha"])  # (PEFT's LoraConfig default)
    rslora = bool(cfg.get("use_rslora"))
    rank = 0
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (ka, kb) in _pairs(spec.name, {k: tuple(t.shape) for k, t in weights.items()}, shape,
                                            max_rank).items():
        a, b = weights[ka].float(), weights[kb].float()
        r = a.shape[0]
        rank = max(rank, r)
        name = f"model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}"
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), name, alpha0))
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        scaled[(layer, module)] = (a, b * scaling)
    adapter = LoraAdapter(adapter_id, spec.name, str(path), rank, torch.device(device))

    def fused(layer: int, modules: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        present = [(m, scaled[(layer, m)]) for m in modules if (layer, m) in scaled]
        if not present:
            return None
        outs = [shape.io(m)[1] for m in modules]
        a = torch.cat([p[0] for _, p in present])
        b = torch.zeros(sum(outs), a.shape[0])
        col = 0
        for m, (_, bm) in present:
            row = sum(outs[:modules.index(m)])
            b[row:row + bm.shape[0], col:col + bm.shape[1]] = bm
            col += bm.shape[1]
        return a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous()

    for i in range(shape.num_layers):
        adapter.layers.append(LoraLayer(fused(i, ("q_proj", "k_proj", "v_proj")), fused(i, ("o_proj",)),
                                        fused(i, ("gate_proj", "up_proj")), fused(i, ("down_proj",))))
    return adapter


def synthetic_adapter(adapter_id: int, shape: ModelShape, rank: int, dtype: torch.dtype,
                      device: torch.device) -> LoraAdapter:
    """An adapter of `rank` on every projection, its weights random (what a step takes does not depend on them):
    the latency profile's, to time steps with adapters (`engine.profiling`)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(abs(adapter_id))

    def pair(fan_in: int, fan_out: int, fused: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = fused * rank
        return (torch.randn(r, fan_in, generator=gen, device=device, dtype=dtype) * 0.01,
                torch.randn(fan_out, r, generator=gen, device=device, dtype=dtype) * 0.01)

    adapter = LoraAdapter(adapter_id, f"profile-{abs(adapter_id)}", "", rank, torch.device(device))
    h, q, kv, inter = shape.hidden, shape.q_out, shape.kv_out, shape.intermediate
    for _ in range(shape.num_layers):
        adapter.layers.append(LoraLayer(pair(h, q + 2 * kv, 3), pair(q, h, 1), pair(h, 2 * inter, 2),
                                        pair(inter, h, 1)))
    return adapter


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def pack_pair(mm, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(A, B, the zero rows of rank padding) as the decoder's matmul strategy `mm` runs them (`mm.linear(x, A)`,
    then `mm.residual(xa, B, None, y)`): packed where it packs weights, the rank padded with zeros to a multiple of 32
    there (a packed bf16 GEMM's inner width; the zeros add nothing)."""
    import torch.nn.functional as F

    pad = -a.shape[0] % 32 if mm.copies_weights else 0
    if pad:
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    pack = getattr(mm, "pack_plain", mm.pack)  # (where the strategy has one: a pack that needs no thread team)
    return pack(a.contiguous()), pack(b.contiguous()), pad


class LoraStacks:
    """Several adapters' updates of each projection stacked (their A's one above the other, their B's side by side)
    for the steps whose rows name them all: two matmuls a projection, whatever their number, instead of two for
    each. Kept for the last set of adapters asked for (a batch's set changes only as requests come and go)."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._stacks: dict[tuple[str, int], tuple | None] = {}
        self._single: dict[int, dict[tuple[str, int], tuple | None]] = {}  # an adapter's own, by its id

    def forget(self, adapter_id: int) -> None:
        """An adapter was unloaded: a stack that holds it goes too."""
        self._single.pop(adapter_id, None)
        if self._key is not None and adapter_id in self._key:
            self._key, self._stacks = None, {}

    def of(self, adapters: list[LoraAdapter], mm) -> dict[tuple[str, int], tuple | None]:
        """Per (projection, layer): (A's, B's, as `pack_pair` packs them, and which adapter each column is: a tuple
        of (adapter index, its rank), the padding's index -1), or None where none of them changes it. One adapter
        (beside rows of the base model): its own packed pairs, kept apart from the last stack."""
        if len(adapters) == 1:
            got = self._single.get(adapters[0].id)
            if got is None:
                got = self._single[adapters[0].id] = self.build(adapters, mm)
            return got
        key = tuple(a.id for a in adapters)  # (an id is never used again: a stack of unloaded adapters is not met)
        if key != self._key:
            self._key, self._stacks = key, self.build(adapters, mm)
        return self._stacks

    @staticmethod
    def build(adapters: list[LoraAdapter], mm) -> dict[tuple[str, int], tuple | None]:
        """`of`'s stacks of `adapters`, made anew: where `mm` stacks packed weights as they are (`stack`), a few
        copies; else the stacked matrices packed."""
        import torch

        stacks: dict[tuple[str, int], tuple | None] = {}
        stack = getattr(mm, "stack", None)  # stacks packed pairs as they are (a CPU's packing), else None
        for i in range(len(adapters[0].layers)):
            for which in PROJECTIONS:
                parts = [(k, p) for k, a in enumerate(adapters) if (p := getattr(a.layers[i], which)) is not None]
                if not parts:
                    stacks[(which, i)] = None
                    continue
                packed = [adapters[k].packed[(which, i)] for k, _ in parts]
                if len(parts) == 1:  # one adapter changes it: its own packed pair
                    ap, bp = packed[0][:2]
                elif stack is not None:
                    ap, bp = stack([q[0] for q in packed], False), stack([q[1] for q in packed], True)
                else:
                    ap = bp = None
                if ap is not None and bp is not None:  # each adapter's rank padding stays in the stack
                    cols = tuple(c for (k, p), q in zip(parts, packed)
                                 for c in ((k, p[0].shape[0]),) + (((-1, q[2]),) if q[2] else ()))
                    stacks[(which, i)] = (ap, bp, cols)
                    continue
                a_cat, b_cat = torch.cat([p[0] for _, p in parts]), torch.cat([p[1] for _, p in parts], 1)
                cols = tuple((k, p[0].shape[0]) for k, p in parts)
                ap, bp, pad = pack_pair(mm, a_cat, b_cat)
                stacks[(which, i)] = (ap, bp, cols + ((-1, pad),) if pad else cols)
        return stacks


class LoraStep:
    """One step's LoRA updates: (adapter, its rows, None: all) for each adapter its requests name, applied to each
    projection's output through the decoder's matmul strategy `mm` (the backend's GEMMs). One adapter over every row:
    its own two matmuls; else the step's adapters stacked (`LoraStacks`), each row's update masked to its own
    adapter's columns (a base model's row: none)."""

    def __init__(self, groups: list, num_rows: int, stacks: LoraStacks, mm) -> None:
        import torch

        self.mm = mm
        self.one = groups[0][0] if len(groups) == 1 and groups[0][1] is None else None
        if self.one is not None:
            return
        self.stacks = stacks.of([a for a, _ in groups], mm)
        self.owner = torch.full((num_rows,), -2, dtype=torch.long, device=groups[0][0].device)
        for k, (_, rows) in enumerate(groups):
            if rows is None:
                self.owner.fill_(k)
            else:
                self.owner.index_fill_(0, rows, k)
        self.masks: dict[tuple, torch.Tensor] = {}

    def apply(self, y: torch.Tensor, x: torch.Tensor, which: str, layer: int) -> torch.Tensor:
        """y plus the update of projection `which` (qkv, o, gate_up, down) at `layer` of each row, from x (y itself,
        updated in place, where the matmul strategy adds in place)."""
        import torch

        mm = self.mm
        if self.one is not None:
            pair = self.one.packed.get((which, layer))
            if pair is None:
                return y
            return mm.residual(mm.linear(x, pair[0]), pair[1], None, y)
        entry = self.stacks[(which, layer)]
        if entry is None:
            return y
        a, b, cols = entry
        mask = self.masks.get(cols)
        if mask is None:
            col_owner = torch.tensor([k for k, r in cols for _ in range(r)], device=x.device)
            mask = self.masks[cols] = (self.owner[:, None] == col_owner[None, :]).to(x.dtype)
        return mm.residual(mm.linear(x, a).mul_(mask), b, None, y)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def dynamic_adapter_dir(root: str | None, name: str) -> Path | None:
    """The folder of adapter `name` under `root` (dynamic_lora_loading_path), where `name` is a plain folder name
    (or `<model>:<folder name>`, as a request's model names it: the ingress passes it so, apart from the names of
    lora_modules) and the folder holds an adapter config; else None."""
    name = name.rpartition(":")[2]
    if not root or not _NAME.fullmatch(name) or name in (".", ".."):
        return None
    path = Path(root).expanduser() / name
    return path if (path / "adapter_config.json").is_file() else None


@dataclass(slots=True)
class LoraLoaded:
    """A load the registry's loader finished (the adapter built, or why it was not), for the worker to install
    (`LoraRegistry.installed`)."""
    key: tuple[str, LoraSource | None]
    adapter: LoraAdapter | None
    error: LoraError | None = None
    load_id: int = 0  # the load's own id (`LoraRegistry.stale`: one past its deadline that ended late)


class LoraRegistry:
    """The adapters an engine serves, owned by its worker thread. Those of `lora_modules` are loaded at start and
    kept; one of `dynamic_lora_loading_path` (a folder there, named by a request) is loaded when the first request
    that names it arrives, and so is one loaded at run time (vLLM's /v1/load_lora_adapter: its request brings the
    folder, `LoraSource`). Past `max_loras` adapters the least recently used one that no request holds and that is
    not of `lora_modules` is unloaded (Ray Serve LLM's multi-LoRA). Each load has an id of its own
    (`Request.lora_id`), never used again: an adapter loaded again is a new namespace of the prefix cache. A run-time
    adapter loaded again under its name (`load_inplace`, a later `LoraSource.version`) replaces the earlier load for
    the requests that arrive after; those that hold the earlier one finish on it, and it is unloaded as the last
    of them ends.

    With a `loader` (a function that runs a job on another thread) a load runs there, reading the files and laying
    the adapter out while the worker runs its steps: `acquire` says None (the request waits), and the loader hands
    the result to `post` (`LoraLoaded`, which the worker gives `installed`). Without one, `acquire` loads at once."""

    def __init__(self, decoder, static: dict[str, str], dynamic_root: str | None, max_loras: int,
                 max_rank: int, loader: Callable[[Callable[[], None]], object] | None = None,
                 post: Callable[[LoraLoaded], None] | None = None) -> None:
        self.decoder = decoder
        self.dynamic_root = dynamic_root
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.loader, self._post = loader, post  # (None: loads on the worker, at once)
        self._ids: dict[str, int] = {}  # loaded adapters' ids by name (the load requests get)
        self._names: dict[int, str] = {}  # and their names by id (replaced loads too, until unloaded)
        self._sources: dict[int, LoraSource | None] = {}  # a run-time load's source (None: by name)
        self._static: set[int] = set()  # the ids of lora_modules' loads (never unloaded as idle)
        self._holders: dict[int, int] = {}  # requests in the engine per adapter id
        self._idle: dict[int, str] = {}  # evictable adapters no request holds, least recently released first
        self._pending: dict[tuple[str, LoraSource | None], int] = {}  # loads on the loader, and each one's id
        self._next = 1
        for name, path in static.items():
            self._install(self.decoder.build_lora(LoraSpec(name, path), self._take_id(), self.max_rank), None,
                          static=True)

    def _take_id(self) -> int:
        i, self._next = self._next, self._next + 1
        return i

    def _install(self, adapter: LoraAdapter, source: LoraSource | None, static: bool = False) -> int:
        """Serve a built adapter under its name: idle (evictable) until a request `hold`s it, unless `static`."""
        self._evict(self.max_loras - 1)
        self.decoder.install_lora(adapter)
        i, name = adapter.id, adapter.name
        self._ids[name], self._names[i], self._sources[i] = i, name, source
        self._holders[i] = 0
        if static:
            self._static.add(i)
        else:  # (a load whose requests all ended while it was read is unloaded as any idle one)
            self._idle[i] = name
        log.info("LoRA adapter %r loaded (rank %d, %.1f MB) from %s", name, adapter.rank, adapter.nbytes() / 2**20,
                 adapter.path)
        return i

    @property
    def loaded(self) -> list[str]:
        return list(self._ids)

    @property
    def loading(self) -> int:
        """Loads on the loader now."""
        return len(self._pending)

    def _current(self, name: str, source: LoraSource | None) -> int | None:
        """The load of `name` a request that brings `source` runs through, where there is one: the one loaded,
        unless `source` is a later load (then it is retired: the request gets a new one). A request of an earlier
        load that arrives after a later one runs through the later one. A request that brings none (a folder's
        adapter, `<model>:<folder>`) never runs through a load made at run time under its name: that one was
        unloaded at the front since (it is retired, the folder's loaded)."""
        i = self._ids.get(name)
        if i is not None:
            held = self._sources[i]
            later = held is not None if source is None else held is None or held.version < source.version
            if later:
                self._retire(i)  # loaded again since (or a lora_modules adapter of its name): the new load serves
                return None
        return i

    def _pending_for(self, name: str, source: LoraSource | None) -> tuple[str, LoraSource | None] | None:
        """The load of `name` on the loader that a request bringing `source` waits for: its own, or a later one."""
        if source is None:
            return (name, None) if (name, None) in self._pending else None
        later = [k for k in self._pending if k[0] == name and k[1] is not None and k[1].version >= source.version]
        return min(later, key=lambda k: k[1].version) if later else None

    def acquire(self, name: str, source: LoraSource | None = None) -> int | tuple[str, LoraSource | None]:
        """The id of adapter `name` for a request that will run through it (`source`: a run-time adapter's folder
        and load), held for it until `release`; or the key of the load on the loader it waits for (`installed`
        serves it, then the request `hold`s it). LoraError where there is no such adapter or it cannot be served."""
        i = self._current(name, source)
        if i is None:
            key = self._pending_for(name, source)
            if key is not None:
                return key
            key = (name, source)
            path = Path(source.path) if source is not None else dynamic_adapter_dir(self.dynamic_root, name)
            if path is None:
                raise LoraError(f"no LoRA adapter named {name!r} is served here")
            spec, i = LoraSpec(name, str(path)), self._take_id()
            if self.loader is not None:
                self._pending[key] = i
                self.loader(lambda: self._post(self._build(key, spec, i)))
                return key
            got = self._build(key, spec, i)
            if got.error is not None:
                raise got.error
            i = self._install(got.adapter, source)
        return self.hold(i)

    def _build(self, key: tuple[str, LoraSource | None], spec: LoraSpec, i: int) -> LoraLoaded:
        """(On the loader, or the worker without one.) The adapter built, or the reason it was not."""
        try:
            return LoraLoaded(key, self.decoder.build_lora(spec, i, self.max_rank), load_id=i)
        except LoraError as e:
            return LoraLoaded(key, None, e, i)
        except Exception as e:  # noqa: BLE001 - a folder being written, a file torch cannot read: its requests'
            return LoraLoaded(key, None, LoraError(f"LoRA adapter {spec.name!r} did not load from {spec.path}: {e}"),
                              i)

    def stale(self, done: LoraLoaded) -> bool:
        """Whether a finished load is one `forget` gave up on (past its deadline): dropped, its requests failed
        already; those that named the adapter since wait for a load of their own."""
        return self._pending.get(done.key) != done.load_id

    def forget(self, key: tuple[str, LoraSource | None]) -> None:
        """(On the worker.) A load past its deadline: requests that name the adapter from now on start another
        (what the stuck one brings, if it ends, is dropped: `stale`)."""
        self._pending.pop(key, None)

    def installed(self, done: LoraLoaded) -> int:
        """(On the worker.) Serve a load the loader finished: the id the requests that waited for it run through
        (`hold` each; none left: it stays idle), or its LoraError. A later load of the name that landed meanwhile
        serves them instead."""
        self._pending.pop(done.key, None)
        if done.error is not None:
            raise done.error
        name, source = done.key
        i = self._current(name, source)
        return i if i is not None else self._install(done.adapter, source)  # (a later load on its way replaces it)

    def hold(self, lora_id: int) -> int:
        """A request runs through load `lora_id` until its `release`."""
        self._idle.pop(lora_id, None)
        self._holders[lora_id] += 1
        return lora_id

    def release(self, lora_id: int) -> None:
        """A request that held adapter `lora_id` has ended."""
        n = self._holders.get(lora_id)
        if n is None:
            return
        self._holders[lora_id] = n - 1
        if n > 1:
            return
        name = self._names[lora_id]
        if self._ids.get(name) != lora_id:  # replaced by a later load: its last request has ended
            self._unload(lora_id, "replaced by a later load")
        elif lora_id not in self._static:
            self._idle[lora_id] = name
            self._evict(self.max_loras)

    def _retire(self, lora_id: int) -> None:
        """A load that new requests no longer get: unloaded now where no request holds it, else by `release`."""
        del self._ids[self._names[lora_id]]
        self._idle.pop(lora_id, None)
        if not self._holders[lora_id]:
            self._unload(lora_id, "replaced by a later load")

    def _unload(self, lora_id: int, why: str) -> None:
        name = self._names.pop(lora_id)
        if self._ids.get(name) == lora_id:
            del self._ids[name]
        del self._holders[lora_id], self._sources[lora_id]
        self._static.discard(lora_id)
        self._idle.pop(lora_id, None)
        self.decoder.remove_lora(lora_id)
        log.info("LoRA adapter %r (load %d) unloaded: %s", name, lora_id, why)

    def _evict(self, keep: int) -> None:
        """Unload idle adapters (not of lora_modules), least recently used first, while more than `keep` are
        loaded."""
        while len(self._ids) > keep and self._idle:
            self._unload(next(iter(self._idle)), f"the least recently used of those idle, past max_loras "
                                                 f"{self.max_loras}")
