"""The CUDA backend: the torch reference backend with our Triton paged attention (`triton_attention.py`) and decode
steps replayed from CUDA graphs (`graphs.py`).

- Decodes attend through `paged_decode_attention`, which reads each context's K/V through its block table in place
  (no gather, no mask, any mix of lengths; split-K over long contexts), all of a step's decodes in one call a layer.
- Fresh prompts attend causally through SDPA (its flash kernel in half precision), consecutive prompts of one length
  in one call; prompts over a cached prefix (and chunks of a chunked prefill) through `paged_prefill_attention`, in
  one call for all of them.
- Decode-only steps of our own decoder replay a CUDA graph captured at start for a ladder of batch sizes up to
  `max_num_seqs`, over persistent input buffers filled from pinned host memory (`graphs.DecodeGraphs`); the padding
  rows of a graph's batch write their K/V into a scratch block of the cache and attend to nothing.
- Steps with prefill rows of up to `mixed_graph_tokens` tokens (prompts, chunks, and the decodes riding with them)
  replay a graph of a token ladder (`graphs.MixedGraphs`: the decodes through the decode kernel, the chunks through
  `paged_prefill_attention`, both at grids fixed by the graph's size): an eager forward of a few hundred tokens
  costs more host time (an op and a launch per layer) than the GPU spends on it.
- Sampling runs on the device (`engine.sampler`; top-p rows through `sampling.py`, with no host sync), one copy of
  the step's tokens to the host.

Without Triton (or `kernels="off"`), every step runs the torch reference backend's ops. The Triton kernels also run
on a CPU device under `TRITON_INTERPRET=1`, which is how CI checks this backend's metadata end to end; graphs need
CUDA.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.backends.base import AttnMetadata, PreparedStep, StepBatch, lora_groups, pack, to_device
from engine.backends.torch_ref import TorchAttnMetadata, TorchBackend, TorchMatmuls

log = logging.getLogger("kairos.cuda")


def _triton():
    """The Triton kernels module, or the reason it cannot be used."""
    try:
        from engine.backends.cuda import triton_attention
    except Exception as e:  # noqa: BLE001 - ImportError, or Triton failing to find a driver
        return None, f"{type(e).__name__}: {e}"
    return triton_attention, None


def decode_window(max_model_len: int, block_size: int) -> int:
    """The longest context a decode's split count is chosen for: the window in whole blocks, as a decode reads it
    (its block table's width times the block size). A block size that does not divide the split step takes it past
    the window's own count (the start-up compile of `compile_kernels` then missed a split count a full-length
    decode used)."""
    return -(-max_model_len // block_size) * block_size


@dataclass(slots=True)
class CudaAttnMetadata(TorchAttnMetadata):
    # the decodes, rows [decode_start, decode_start + B) of the packed step, through the paged decode kernel
    decode_start: int = 0
    decode_tables: torch.Tensor | None = None  # int32 [B, W]
    decode_lens: torch.Tensor | None = None  # int32 [B], 0 for a graph's padding rows
    num_splits: int | None = None  # fixed for a captured graph; None: chosen from shapes per call
    workspace_splits: torch.Tensor | None = None  # the split-K partials (a graph's own, preallocated)
    # prompts over a cached prefix (and prefill chunks), rows [paged_start, paged_end), through the prefill kernel
    paged_start: int = 0
    paged_end: int = 0
    paged_tables: torch.Tensor | None = None  # int32 [S, W]
    paged_query_start: torch.Tensor | None = None  # int32 [S + 1], relative to paged_start
    paged_seq_lens: torch.Tensor | None = None  # int32 [S]
    paged_max_query: int = 0


def _tables(rows: list[list[int]], width: int | None = None) -> torch.Tensor:
    """Block tables as one int32 [n, width] host tensor (row tails zero: the kernels never read past a length)."""
    width = width if width is not None else max((len(t) for t in rows), default=1)
    flat: list[int] = []
    for t in rows:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    return torch.tensor(flat, dtype=torch.int32).view(len(rows), max(width, 1) if rows else 0)


class CudaMatmuls(TorchMatmuls):
    """F.linear matmuls with the elementwise work between them in the fused Triton kernels (`fused.py`): silu(gate)
    * up in one kernel, and (for a decoder that asks) each residual add fused with the RMSNorm after it."""

    def __init__(self, fused) -> None:
        super().__init__()
        self.fused = fused

    def mlp(self, x: torch.Tensor, mlp: tuple[torch.Tensor, int], down: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        w, n = mlp
        return h + self.linear(self.fused.silu_mul(self.linear(x, w), n), down)

    def silu_mul(self, gu: torch.Tensor, n: int) -> torch.Tensor:
        return self.fused.silu_mul(gu, n)

    def residual_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, h: torch.Tensor,
                      norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + x @ W^T + b, rms_norm of that): the sum is written in place into h."""
        return self.fused.add_rms_norm(h, self.linear(x, w, b), norm_w, eps)

    def mlp_norm(self, x: torch.Tensor, mlp: tuple[torch.Tensor, int], down: torch.Tensor, h: torch.Tensor,
                 norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + mlp(x), rms_norm of that), the next layer's input norm fused with the add (h updated in place)."""
        w, n = mlp
        return self.fused.add_rms_norm(h, self.linear(self.fused.silu_mul(self.linear(x, w), n), down), norm_w, eps)


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device, kernels: str = "auto", fused_ops: bool | None = None) -> None:
        super().__init__(device, kernels)
        self.ops = None
        if kernels != "off":
            self.ops, why = _triton()
            if self.ops is None:
                if kernels == "on":
                    raise ValueError(f"kernels='on' but the CUDA backend's Triton kernels cannot run: {why}")
                log.warning("Triton paged attention not used (%s): the engine runs torch ops instead (slower)", why)
        # the fused small ops (RMSNorm, RoPE + cache write, silu * up): on wherever the Triton kernels are
        self.fused = None
        if self.ops is not None and fused_ops is not False:
            from engine.backends.cuda import fused
            self.fused = fused
        self.fused_rope_write = self.fused is not None
        self.graphs = None  # `graphs.DecodeGraphs` once captured
        self.mixed = None  # `graphs.MixedGraphs` once captured (steps with prefill rows)
        self.mixed_tokens = 0  # the most tokens of a step with prefill rows that replays a graph (`capture`)
        self.num_heads = 0  # the model's query heads (`bind`)
        self.draw_width = 0  # the sampler's probability rows (`sampler`: its vocab_limit)
        self.scratch_blocks = 1  # a graph's padding rows write here (on a CPU device too: the graphs' buffers run
        # eagerly there, under TRITON_INTERPRET=1, in the tests)

    def identity(self) -> dict:
        # (graphs where decode graphs were captured: an engine of enforce_eager, or whose RoPE a capture refuses, is
        # timed eagerly, and keeps a fit of its own)
        graphs = self.device.type == "cuda" and self.ops is not None and self.kernels_setting != "off" \
            and self.graphs is not None
        out = {"backend": self.name, "triton": self.ops is not None, "fused": self.fused is not None, "graphs": graphs}
        if graphs and self.mixed_tokens:
            out["mixed_graph_tokens"] = self.mixed_tokens
        return out

    def token_ladder(self) -> tuple[int, ...]:
        if self.mixed is None or not self.mixed_tokens:
            return ()
        from engine.backends.cuda.graphs import mixed_ladder
        return tuple(mixed_ladder(self.mixed_tokens))

    # ---------------------------------------------------------------- the model's ops
    def matmuls(self, dtype: torch.dtype, upcast: bool, inner_dims: tuple[int, ...], lora: bool = False
                ) -> TorchMatmuls:
        return TorchMatmuls() if self.fused is None else CudaMatmuls(self.fused)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused is None:
            return super().rms_norm(x, weight, eps)
        return self.fused.rms_norm(x, weight, eps)

    def rope_write(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, meta: AttnMetadata, layer: int) -> None:
        cache = meta.cache
        self.fused.rope_write(qkv, num_heads, num_kv_heads, cos, sin, positions, meta.slot_mapping,
                              cache.k[layer], cache.v[layer])

    def sampler(self, vocab_limit: int, eos_token_ids: list[int]):
        """The torch sampler on the device, its top-p rows drawn by our Triton kernel (no host sync: `sampling.py`)."""
        if self.ops is None:
            return super().sampler(vocab_limit, eos_token_ids)
        from engine.backends.cuda import sampling
        from engine.sampler import Sampler
        self.draw_width = vocab_limit
        return Sampler(vocab_limit, eos_token_ids, self.device, top_p_draw=sampling.top_p_draw,
                       rounds=sampling.ROUNDS)

    # ---------------------------------------------------------------- host -> device
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    def _long(self, values: list[int]) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=torch.long))

    # ---------------------------------------------------------------- metadata
    def prepare(self, step: StepBatch) -> PreparedStep:
        if self.ops is None:
            return super().prepare(step)
        bs = self.cache.block_size
        # fresh prompts first (SDPA), then prompts over a cached prefix (the prefill kernel), then the decodes
        prefix = [step.prefill[i].num_computed_tokens > 0 for i in range(len(step.prefill))]
        order_p = sorted(range(len(step.prefill)), key=prefix.__getitem__)
        p = pack(step, bs, prefill_order=order_p)
        fresh = [s for s in p.spans if not prefix[s[0]]]
        paged = [s for s in p.spans if prefix[s[0]]]
        fields: dict = {"prefills": self.sdpa_prefills(step, fresh)}
        if paged:
            p0 = paged[0][1]
            starts = [q_start - p0 for _, q_start, _, _ in paged]
            starts.append(p.decode_start - p0)
            fields.update(
                paged_start=p0, paged_end=p.decode_start,
                paged_tables=self._to_device(_tables([step.prefill[i].block_table[:-(-end // bs)]
                                                      for i, _, _, end in paged])),
                paged_query_start=self._to_device(torch.tensor(starts, dtype=torch.int32)),
                paged_seq_lens=self._to_device(torch.tensor([end for *_, end in paged], dtype=torch.int32)),
                paged_max_query=max(end - start for _, _, start, end in paged))
        if step.decode:
            fields.update(
                decode_start=p.decode_start,
                decode_tables=self._to_device(_tables([r.block_table[:-(-r.num_tokens // bs)]
                                                       for r in step.decode])),
                decode_lens=self._to_device(torch.tensor([r.num_tokens for r in step.decode], dtype=torch.int32)))
        meta = CudaAttnMetadata(self, self.cache, self._long(p.slots), max(p.positions, default=0),
                                workspace=self.workspace, lora=lora_groups(p, self.device), **fields)
        return PreparedStep(self._long(p.tokens), self._long(p.positions), self._long(p.rows), meta, p.prompt_rows)

    # ---------------------------------------------------------------- attention
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata,
               scaling: float | None) -> torch.Tensor:
        if not isinstance(meta, CudaAttnMetadata):
            return super().attend(layer, query, key, value, meta, scaling)
        if not meta.kv_written:
            self.write_kv(layer, key, value, meta)
        cache = meta.cache
        kc, vc = cache.k[layer], cache.v[layer]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        q = query if query.dtype == cache.dtype else query.to(cache.dtype)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.attend_prefills(layer, q, key, value, meta, scaling, out)
        # the decodes before the paged prefills: a mixed graph's decode entries past its step's decodes (context 0)
        # write zeros into rows the prefill kernel then writes (`graphs.MixedGraphs`)
        if meta.decode_tables is not None:
            n = meta.decode_tables.shape[0]
            rows = slice(meta.decode_start, meta.decode_start + n)
            self.ops.paged_decode_attention(q[rows], kc, vc, meta.decode_tables, meta.decode_lens, scale, out[rows],
                                            num_splits=meta.num_splits, workspace=meta.workspace_splits)
        if meta.paged_end > meta.paged_start:
            rows = slice(meta.paged_start, meta.paged_end)
            self.ops.paged_prefill_attention(q[rows], kc, vc, meta.paged_tables, meta.paged_query_start,
                                             meta.paged_seq_lens, scale, out[rows],
                                             max_query_len=meta.paged_max_query)
        return out if out.dtype == query.dtype else out.to(query.dtype)

    # ---------------------------------------------------------------- graphs
    def bind(self, spec, model_dtype: torch.dtype, num_heads: int) -> None:
        super().bind(spec, model_dtype, num_heads)
        self.num_heads = num_heads

    def compile_kernels(self, max_model_len: int = 0) -> dict:
        """Launch every Triton kernel variant a step of this model can need once over the attached cache
        (`triton_attention.compile_variants`, and a top-p draw), so that none compiles while requests run. A failure
        is logged, not raised: it only leaves a variant to compile on first use."""
        t0 = time.perf_counter()
        cache = self.cache
        window = decode_window(max_model_len, cache.block_size) if max_model_len \
            else cache.num_blocks * cache.block_size
        scratch = cache.num_blocks if cache.scratch_blocks else 0
        try:
            launches = self.ops.compile_variants(cache.k[0], cache.v[0], self.num_heads, window, scratch)
            if self.draw_width:  # the sampler's rows as it hands them to the draw: [n, vocab_limit], contiguous
                from engine.backends.cuda import sampling
                probs = torch.full((1, self.draw_width), 1.0 / self.draw_width, device=self.device)
                sampling.top_p_draw(probs, torch.full((1,), 0.5, device=self.device),
                                    torch.zeros(1, sampling.ROUNDS, device=self.device), probs.sum(1))
                launches += 1
        except Exception:  # noqa: BLE001 - a warm-up: the kernels still compile when first used
            log.warning("compiling the Triton kernels at start failed; they compile on first use", exc_info=True)
            return {"kernel_variants": 0}
        return {"kernel_variants": launches, "compile_s": round(time.perf_counter() - t0, 2)}

    def capture(self, runner, max_num_seqs: int = 0, max_model_len: int = 0, mixed_tokens: int = 0) -> dict:
        """At start, over the serving cache: compile every Triton kernel variant a step can need (`compile_variants`,
        and the top-p draw), then capture the decode graphs, where the decoder can be captured, and the mixed graphs
        (steps with prefill rows of up to `mixed_tokens` tokens; 0: none)."""
        if self.device.type != "cuda" or self.ops is None:
            return {"graphs": 0}
        report = self.compile_kernels(max_model_len)
        if runner.decoder is None or not max_num_seqs:
            return {"graphs": 0, **report}
        if not runner.decoder.table_rope:  # RoPE computed from positions each step: HF's dynamic kinds sync with the
            log.warning("decode graphs off: this model's RoPE (%s) is computed each step",  # host, which a capture
                        getattr(runner.decoder.rotary, "rope_type", None))  # refuses
            return {"graphs": 0, **report}
        from engine.backends.cuda.graphs import DecodeGraphs, MixedGraphs
        self.graphs = DecodeGraphs(self, runner.decoder, self.cache, max_num_seqs, max_model_len)
        runner.decoder.tables_captured = True
        report = {**self.graphs.capture(), **report}
        if mixed_tokens > 0:
            self.mixed_tokens = mixed_tokens
            try:
                self.mixed = MixedGraphs(self, runner.decoder, self.cache, mixed_tokens, max_num_seqs, max_model_len)
                report.update(self.mixed.capture(self.graphs.pool))
            except Exception as e:  # noqa: BLE001 - those steps run eagerly, as without the graphs
                log.warning("mixed graphs not captured; steps with prefill rows run eagerly", exc_info=True)
                if self.mixed is not None:
                    self.mixed.release()
                self.mixed, self.mixed_tokens = None, 0
                report.update(mixed_graphs=0, mixed_error=f"{type(e).__name__}: {e}")
        return report

    def execute(self, runner, step: StepBatch) -> torch.Tensor:
        g = self.graphs
        if runner.decoder is not None and runner.decoder.loras \
                and (any(r.lora_id for r in step.prefill) or any(r.lora_id for r in step.decode)):
            return runner.forward(self.prepare(step), step.prev_tokens)  # LoRA rows: eager (no graph holds them)
        if not step.prefill:
            if g is not None and 0 < len(step.decode) <= g.max_batch:
                return g.replay(step.decode, step.prev_tokens)
        elif self.mixed is not None and not step.prompt_spans \
                and self.mixed.fits(step.num_tokens(), len(step.prefill), len(step.decode)):  # (its rows: sampled)
            return self.mixed.run(step, step.prev_tokens)
        return runner.forward(self.prepare(step), step.prev_tokens)

    def release(self) -> None:
        if self.device.type == "cuda":  # a step still in flight (overlap scheduling) reads what is freed here
            torch.cuda.synchronize(self.device)
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.mixed is not None:
            self.mixed.release()
            self.mixed = None
        super().release()
