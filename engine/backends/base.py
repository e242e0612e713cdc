"""The device backend seam: what a device (CPU, CUDA, or the device-agnostic torch reference) implements.

The generic engine (`engine.engine`, `model_runner`, `decoder`, `attention`, `kv_cache`, `loader`) imports only this
module and `engine.backends.create`. A backend owns:
- the KV cache's dtype (`cache_dtype`) and any blocks it reserves for itself (`scratch_blocks`);
- the step's attention metadata (`prepare`: a `StepBatch` in, a `PreparedStep` out) and attention over the paged
  cache (`attend`: writes the step's K/V into the cache, returns the attention output);
- how the decoder's matmuls run (`matmuls`), its norms and fused RoPE + cache write where it has them, and a whole
  step in one call where it can (`whole_step`);
- the sampler (`sampler`);
- thread or stream policy and graph capture (`capture`, `execute`: a graph backend replays captured steps there);
- what it holds on the device, freed by `release`.

The torch reference backend (`engine.backends.torch_ref`) implements all of it with torch ops on any device; the CPU
and CUDA backends extend it. Picture one step:

    scheduler -> StepBatch(prefill, decode, ends) -> backend.execute(runner, step)
        = runner.forward(backend.prepare(step), step.prev_tokens)  (or a graph replay)
            -> decoder / HF forward -> backend.attend(layer, q, k, v, meta) per layer
    logits -> backend's sampler -> tokens
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from core.request import Request

if TYPE_CHECKING:
    from engine.kv_cache import KVCache, KVCacheSpec
    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler


_host_step = threading.local()  # `started`: the Event of the step the thread runs on the host stream, if any


def await_long_call(started: threading.Event | None) -> None:
    """The host stream's thread (`engine.host_stream`): `long_call_starts` on this thread sets `started` (None: no
    step of the stream runs here)."""
    _host_step.started = started


def long_call_starts() -> None:
    """A backend is about to make a long call that releases the GIL (a whole step's layers in one kernel call). Where
    the step runs on the engine's host stream (`engine.host_stream`), the worker that launched it waits for this
    before its own host work: it then runs that work while the call runs, instead of taking the GIL from the step at
    each of its short calls."""
    ev = getattr(_host_step, "started", None)
    if ev is not None:
        ev.set()


@dataclass(slots=True)
class StepBatch:
    """One step as the scheduler planned it: each prefill computes its positions [num_computed_tokens, ends[i]) and
    samples only if it reaches its num_tokens; each decode computes its last token.
    Overlap scheduling: a token id -(j + 1) is a placeholder for row j of the previous step's sampled tokens, which
    are still on the device (`prev_tokens`, [R] long); the inputs read it there (`resolve_placeholders`)."""
    prefill: list[Request]
    decode: list[Request]
    ends: list[int]
    prev_tokens: torch.Tensor | None = None
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)  # `prompt_spans`

    @classmethod
    def of(cls, prefill: list[Request], decode: list[Request], ends: list[int] | None = None,
           prev_tokens: torch.Tensor | None = None) -> "StepBatch":
        ends = ends if ends is not None else [r.num_tokens for r in prefill]
        return cls(prefill, decode, ends, prev_tokens, prompt_spans(prefill, ends))

    def num_tokens(self) -> int:
        """The tokens the step computes: each prefill's chunk, one per decode."""
        return sum(end - r.num_computed_tokens for r, end in zip(self.prefill, self.ends)) + len(self.decode)


def prompt_spans(prefill: list[Request], ends: list[int]) -> list[tuple[int, int, int]]:
    """(prefill index, first position, count) of the prompt positions whose logits a step returns after its sampled
    rows, in prefill order: those its prefills compute for requests that ask for prompt logprobs (`SamplingParams.
    prompt_logprobs`) and have no reply yet (a request preempted after its first token has had them). The logits at
    position q are prompt token q + 1's, so a prompt's last position is not among them (it samples)."""
    out = []
    for i, (r, end) in enumerate(zip(prefill, ends)):
        if r.params.prompt_logprobs is not None and not r.num_output_tokens:
            start, stop = r.num_computed_tokens, min(end, r.num_prompt_tokens - 1)
            if stop > start:
                out.append((i, start, stop - start))
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory with a non-blocking copy (torch's blocking copy from
    pageable memory waits for the whole stream: the step in flight, with overlap scheduling)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_placeholders(ids: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """`ids` with each placeholder -(j + 1) replaced by `prev[j]`, on the device, without a sync (`StepBatch`). A row
    that failed (-1: probabilities not finite) reads as token 0: its request ends with an error when the host learns
    it, and no id below 0 may reach the embedding (on a GPU an out-of-range index is a device-side assert)."""
    if prev is None or prev.numel() == 0:
        return ids
    rows = (-ids - 1).clamp_(min=0, max=prev.numel() - 1)
    return torch.where(ids < 0, prev.index_select(0, rows).clamp(min=0), ids)


@dataclass(slots=True)
class AttnMetadata:
    """What every backend's attention needs; backends subclass it with their own fields."""
    backend: "Backend"
    cache: "KVCache"
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    max_position: int = 0  # the step's largest position id
    kv_written: bool = False  # the decoder already wrote this step's K/V into the cache (a fused RoPE + write)
    # LoRA (engine.lora): (adapter id, the packed rows of its requests, None: every row) for each adapter the step's
    # requests name; None: no request names one
    lora: list[tuple[int, torch.Tensor | None]] | None = None


@dataclass(slots=True)
class PreparedStep:
    """The model's inputs for one packed step: tokens [T], their positions [T], the rows [R] whose logits are
    sampled (in `prefill + decode` request order) and then the last `prompt_rows` of them, rows whose logits give
    prompt logprobs (`prompt_spans`), and the backend's attention metadata."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    meta: AttnMetadata
    prompt_rows: int = 0


@dataclass(slots=True)
class Packed:
    """The step's tokens packed into one sequence, as Python lists (a backend turns them into tensors).
    `spans[j]` = (i, q_start, start, end): prefill `step.prefill[i]` computes positions [start, end) at rows
    [q_start, q_start + end - start); the decodes take rows from `decode_start` on, in the order `pack` was given."""
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    decode_start: int = 0
    prompt_rows: int = 0  # the last of `rows` that give prompt logprobs (`prompt_spans`)
    lora: dict[int, list[int]] = field(default_factory=dict)  # the rows of each LoRA adapter's requests, by its id


def pack(step: StepBatch, block_size: int, prefill_order: list[int] | None = None,
         decode_order: list[int] | None = None, decodes_first: bool = False) -> Packed:
    """Pack the step's tokens: the prefills in `prefill_order`, then the decodes in `decode_order` (default: as
    given; `decodes_first`: the decodes, then the prefills). The logit rows keep request order whatever the packing
    order."""
    p = Packed()
    bs = block_size
    tokens, positions, slots = p.tokens, p.positions, p.slots
    last: list[int | None] = [None] * len(step.prefill)
    rank = [0] * len(step.decode)

    def prefills() -> None:
        for i in (prefill_order if prefill_order is not None else range(len(step.prefill))):
            r, end = step.prefill[i], step.ends[i]
            start = r.num_computed_tokens
            q_start = len(tokens)
            table = r.block_table
            tokens.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend([table[q // bs] * bs + q % bs for q in range(start, end)])
            if end == r.num_tokens:  # a chunk that leaves prompt for later samples nothing
                last[i] = len(tokens) - 1
            p.spans.append((i, q_start, start, end))
            if r.lora_id:
                p.lora.setdefault(r.lora_id, []).extend(range(q_start, len(tokens)))

    def decodes() -> None:
        p.decode_start = len(tokens)
        for pos, i in enumerate(decode_order if decode_order is not None else range(len(step.decode))):
            r = step.decode[i]
            rank[i] = pos
            q = r.num_tokens - 1
            if r.lora_id:
                p.lora.setdefault(r.lora_id, []).append(len(tokens))
            tokens.append(r.token_ids[-1])
            positions.append(q)
            slots.append(r.block_table[q // bs] * bs + q % bs)

    if decodes_first:
        decodes()
        prefills()
    else:
        prefills()
        decodes()
    p.rows = [x for x in last if x is not None]
    p.rows.extend(p.decode_start + rank[i] for i in range(len(step.decode)))
    if step.prompt_spans:  # then the prompt positions that give prompt logprobs (`prompt_spans`), in prefill order
        q_of = {i: q_start for i, q_start, _, _ in p.spans}
        for i, _, count in step.prompt_spans:
            p.rows.extend(range(q_of[i], q_of[i] + count))
            p.prompt_rows += count
    return p


def lora_groups(p: Packed, device: torch.device) -> list[tuple[int, torch.Tensor | None]] | None:
    """`AttnMetadata.lora` of a packed step: None where no request names an adapter; (id, None) where one adapter's
    requests are all of the step's rows."""
    if not p.lora:
        return None
    if len(p.lora) == 1:
        (i, rows), = p.lora.items()
        if len(rows) == len(p.tokens):
            return [(i, None)]
    return [(i, to_device(torch.tensor(rows, dtype=torch.long), device)) for i, rows in p.lora.items()]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, the weight applied in the input's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Backend:
    """The interface (with the defaults a backend without the feature keeps). `engine.backends.torch_ref.TorchBackend`
    implements every abstract method; subclasses override what their device does better."""

    name: ClassVar[str] = "base"
    scratch_blocks: int = 0  # cache blocks the backend keeps for itself beyond the scheduler's (graph padding)
    fused_rope_write: bool = False  # `rope_write` writes K/V into the cache with the rotation (then kv_written)

    def __init__(self, device: torch.device, kernels: str = "auto") -> None:
        self.device = device
        self.kernels_setting = kernels
        self.spec: "KVCacheSpec | None" = None
        self.cache: "KVCache | None" = None

    # ---------------------------------------------------------------- before the cache exists
    @staticmethod
    def default_dtype(device: torch.device) -> torch.dtype:
        """The activations' dtype for `dtype="auto"` on this device."""
        raise NotImplementedError

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for `kv_cache_dtype="auto"`."""
        raise NotImplementedError

    def adapt_model(self, model: torch.nn.Module, upcast: str) -> int:
        """Change the loaded HF modules for this device before anything runs (returns how many were changed)."""
        return 0

    def bind(self, spec: "KVCacheSpec", model_dtype: torch.dtype, num_heads: int) -> None:
        """The model is loaded and the cache's shape and dtype are known: load kernels, choose paths."""
        self.spec = spec

    def attach(self, cache: "KVCache | None") -> None:
        """The cache the steps run over (a warm-up's small one first, where the backend sizes it after one)."""
        self.cache = cache

    # ---------------------------------------------------------------- the model's ops
    def matmuls(self, dtype: torch.dtype, upcast: bool, inner_dims: tuple[int, ...], lora: bool = False) -> Any:
        """The decoder's matmul strategy (`pack`, `pack_mlp`, `linear`, `residual`, `mlp`, `copies_weights`, and for
        LoRA steps `gate_up` and `silu_mul`); `lora`: the decoder serves LoRA adapters."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rope_write(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, meta: AttnMetadata, layer: int) -> None:
        raise NotImplementedError

    def whole_step(self, decoder: Any, h: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> bool:
        """Run every layer of this step in one call where the backend can (h updated in place); False: it cannot."""
        return False

    def prepare(self, step: StepBatch) -> PreparedStep:
        raise NotImplementedError

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata,
               scaling: float | None) -> torch.Tensor:
        """One layer's attention for the packed step: query [T, H, hd], key/value [T, kvh, hd] (any strides).
        Writes the new K/V into the cache (unless `meta.kv_written`) and returns [T, H, hd] in the query's dtype."""
        raise NotImplementedError

    def sampler(self, vocab_limit: int, eos_token_ids: list[int]) -> "Sampler":
        raise NotImplementedError

    # ---------------------------------------------------------------- running steps
    def capture(self, runner: "ModelRunner", max_num_seqs: int = 0, max_model_len: int = 0,
                mixed_tokens: int = 0) -> dict:
        """Capture what the backend replays (CUDA graphs: decode steps up to `max_num_seqs` requests over contexts up
        to `max_model_len`, and steps with prefill rows up to `mixed_tokens` tokens) once the model and cache are
        ready; returns a report."""
        return {}

    def execute(self, runner: "ModelRunner", step: StepBatch) -> torch.Tensor:
        """Logits [R, vocab] of the step's sampled rows, in `prefill + decode` order."""
        return runner.forward(self.prepare(step), step.prev_tokens)

    def identity(self) -> dict:
        """What a cached latency profile depends on beyond the model (kernel builds, graph use)."""
        return {"backend": self.name}

    def token_ladder(self) -> tuple[int, ...]:
        """The token counts a step with prefill rows is padded to, in order, where the backend pads them (graphs
        captured at fixed sizes); a step of more tokens than the last runs as it is. Empty: none padded."""
        return ()

    def release(self) -> None:
        """Free what the backend holds on the device (buffers, graphs); the engine is shutting down."""
        self.cache = None


def fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) along the output dim; the modules keep views of the result."""
    w = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    b = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    off = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(w[off:off + n], requires_grad=False)
        if b is not None:
            m.bias = torch.nn.Parameter(b[off:off + n], requires_grad=False)
        off += n
    if any(has_bias) and b is None:
        raise ValueError("some but not all of the fused projections have biases")
    return w, b
