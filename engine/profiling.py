"""Fit the scheduler's latency model by timing the real model on the real device (cached as JSON)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.kv import BlockManager
from core.request import Request
from core.sampling import SamplingParams
from engine.file_lock import held
from scheduling.predictor import LatencyModel, cell_medians, profile

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger("kairos.profiling")
# 3: decode probes hold mixed context lengths; 4: GPU grid, prefill knee; 5: attention term (a GPU's chunks over a
# cached prefix and hybrid steps: its meta's "probes")
PROFILE_VERSION = 5
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
CTX_LENS = (64, 128, 256, 512)
# A GPU replica runs hundreds of requests at contexts in the thousands: its probes reach `max_num_seqs` and the
# model's window, on a sample of the (batch, context) grid that fits the cache
GPU_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
GPU_CTX_LENS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
GPU_GRID_SAMPLES = 40
# A GPU's prompts of a few thousand tokens spend little on attention, which a long prompt's chunks deep in it spend
# most on: chunks timed over a cached prefix (these sizes, at these shares of the window) fix the attention term; and
# hybrid steps (a fresh prompt of these sizes beside these many decodes, at GPU_MIXED_CTX) say how a step's prefill
# and decode rows add up (`LatencyModel.fit_mixed`)
GPU_CHUNK_SIZES = (512, 2048)
GPU_CHUNK_DEPTHS = (0.25, 0.5, 1.0)
GPU_MIXED_TOKENS = (64, 256, 1024)
GPU_MIXED_BATCHES = (16, 64, 256)
GPU_MIXED_CTX = 1024


_SAMPLE_BYTES = 1 << 20


def model_identity(path: str) -> str:
    """What a cached profile is keyed by for the model at `path`: for a checkpoint folder, its name and a hash of its
    config.json and of each weight file's name, size, first and last MiB; else the path. The same checkpoint built
    again elsewhere (a test session's temporary folder) finds its profile; a checkpoint rewritten in place does not."""
    folder = Path(path)
    if not folder.is_dir():
        return str(path)
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.name == "config.json":
            h.update(f.name.encode() + f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:
                h.update(fh.read(_SAMPLE_BYTES))
                fh.seek(max(0, size - _SAMPLE_BYTES))
                h.update(fh.read(_SAMPLE_BYTES))
    return f"{folder.name}-{h.hexdigest()[:16]}"


def _meta(engine: "LLMEngine") -> dict:
    """What the fit was made for (its cache key), in plain JSON values: the fit travels pickled to processes that
    import no torch (`engine.core_proc`'s client), where a `torch.__version__` (a TorchVersion) would import it."""
    b, c = engine.bundle, engine.config
    meta = {"version": PROFILE_VERSION, "model": model_identity(b.path), "dtype": str(b.dtype),
            "device": str(b.device),
            "threads": torch.get_num_threads(), "block_size": c.block_size, "kv_dtype": str(engine.cache.dtype),
            "upcast_linears": engine.upcast_linears, "impl": "kairos" if engine.runner.decoder else "hf",
            # an engine that serves LoRA adapters runs its steps another way (engine.lora; its MLP unfused on a CPU)
            # (and its fit prices steps with adapters of up to max_lora_rank: `profile_lora`)
            **({"lora": {"max_lora_rank": c.max_lora_rank, "probe": 2}} if c.serves_lora else {}),
            **engine.backend.identity(),  # e.g. the CPU kernels' build (their source, flags, CPU), graph use
            "torch": torch.__version__,
            # the GPU grid reaches max_num_seqs and twice the prefill budget: a fit probed for other ones is not reused
            # (and a GPU's fit of chunks over a cached prefix and of hybrid steps is not one from before: a CPU's fit
            # is as it was, and keeps its cache)
            **({"max_num_seqs": c.scheduler.max_num_seqs, "prefill_max_tokens": c.scheduler.prefill_max_tokens,
                "probes": "chunks+hybrid"} if b.device.type == "cuda" else {})}
    return json.loads(json.dumps(meta))  # (as a cached fit's reads back: lists for tuples, str for TorchVersion)


def _default_path(meta: dict) -> Path:
    root = Path(os.environ.get("KAIROS_CACHE", Path.home() / ".cache" / "kairos")) / "profiles"
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"latency-{key}.json"


PROFILE_BUDGET = 1024  # the prefill budget the profile probes up to twice of, where none is configured


class Prober:
    """Times real steps (forward + sampling) of throwaway requests on the real cache. Only on an idle engine:
    before its worker starts, or inside `LLMEngine.run_idle`. With nothing in flight every cache block is
    free, so the probes take their blocks from a scratch `BlockManager` and touch no scheduler state.

    A decode probe of (B, L) holds B contexts whose mean is exactly L but whose lengths spread over about
    [L/4, 7L/4] in mirrored pairs, as a served batch's do: the step runs its attention in length groups
    (the torch reference backend's length groups, or a paged kernel whose work follows each context), so a fit
    on equal lengths would under-predict every real step.
    """

    def __init__(self, engine: "LLMEngine") -> None:
        self.e = engine
        self.rng = random.Random(0)
        self.gen = torch.Generator().manual_seed(0)
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def _requests(self, prompts: list[list[int]], computed: int) -> tuple[list[Request], BlockManager]:
        """Requests over these token ids with blocks for all of them; all but the last `computed` from the end
        count as already in the cache (the KV contents do not change the step time)."""
        blocks = BlockManager(self.e.cache.num_blocks, self.e.cache.block_size)
        reqs = [Request(f"probe-{i}", list(ids), self.params) for i, ids in enumerate(prompts)]
        for r in reqs:
            blocks.ensure(r, r.num_tokens)
            r.num_computed_tokens = max(0, r.num_tokens - computed) if computed else 0
        return reqs, blocks

    def _ids(self, n: int) -> list[int]:
        # what the tokens are does not change a step's time; a GPU probe holds up to millions of them
        return torch.randint(self.e.bundle.vocab_limit, (n,), generator=self.gen).tolist()

    def _timed(self, prefill: list[Request], decode: list[Request]) -> float:
        t0 = time.perf_counter()
        logits = self.e.runner.execute(prefill, decode)
        self.e.sampler.sample(logits, prefill + decode)  # its one copy of the tokens to the host waits for the device
        return (time.perf_counter() - t0) * 1000.0

    def prefill_ms(self, prompts: list[list[int]]) -> float:
        """One prefill step over these prompts (ms)."""
        reqs, _ = self._requests(prompts, 0)
        return self._timed(reqs, [])

    def prefill(self, n: int) -> float:
        return self.prefill_ms([self._ids(n)])

    def lengths(self, batch: int, ctx: int) -> list[int]:
        """`batch` lengths with mean exactly `ctx`, each within [1, max_model_len - 1]."""
        spread = min(3 * ctx // 4, ctx - 1, self.e.max_model_len - 1 - ctx)
        lens = [ctx] * (batch % 2)
        for _ in range(batch // 2):
            d = self.rng.randint(0, max(spread, 0))
            lens += [ctx - d, ctx + d]
        return lens

    def decode(self, batch: int, ctx: int) -> float:
        return self.decode_ms(self.lengths(batch, ctx))

    def decode_ms(self, lens: list[int], loras: list[int] | None = None) -> float:
        """One decode step over contexts of these lengths (ms); `loras`: the ids of LoRA adapters its rows run
        through, in turn."""
        reqs, _ = self._requests([self._ids(n) for n in lens], 1)
        for i, r in enumerate(reqs if loras else ()):
            r.lora_id = loras[i % len(loras)]
        return self._timed([], reqs)

    def chunk(self, n: int, start: int) -> float:
        """One prefill step of a prompt's `n` tokens after its first `start`, which count as cached (ms)."""
        reqs, _ = self._requests([self._ids(start + n)], n)
        return self._timed(reqs, [])

    def mixed(self, n: int, batch: int, ctx: int) -> float:
        """One hybrid step: a fresh prompt of `n` tokens beside `batch` decodes of mean context `ctx` (ms)."""
        return self.mixed_ms([self._ids(n)], self.lengths(batch, ctx))

    def mixed_ms(self, prompts: list[list[int]], lens: list[int]) -> float:
        """One step that prefills these prompts and decodes contexts of these lengths together (a hybrid step)."""
        prefill, _ = self._requests(prompts, 0)
        decode, _ = self._requests([self._ids(n) for n in lens], 1)
        for i, r in enumerate(decode):
            r.request_id = f"probe-decode-{i}"
        return self._timed(prefill, decode)

    def prepare_ms(self, lens: list[int]) -> float:
        """Only the runner's input preparation of such a decode step (ms)."""
        reqs, _ = self._requests([self._ids(n) for n in lens], 1)
        t0 = time.perf_counter()
        self.e.runner.prepare([], reqs)
        return (time.perf_counter() - t0) * 1000.0


LORA_ADAPTERS = (1, 2, 4)  # the adapters a LoRA probe's rows run through
LORA_BATCHES = (1, 4, 16, 64, 256)


def profile_lora(engine: "LLMEngine", probe: Prober, batches: tuple[int, ...], ctx: int, capacity: int,
                 repeats: int = 3) -> tuple[list[tuple[float, float, float]], dict]:
    """What a decode step takes more with rows of LoRA adapters, on an engine that serves them: steps of B rows at
    mean context `ctx` (B of `batches`, at most four of `LORA_BATCHES`), without adapters and with the rows spread over
    k of them (random adapters of max_lora_rank, installed for the probes only), paired: the ``(B, k, extra ms)``
    samples `LatencyModel.fit_lora` takes, and their fit's report once fitted by the caller. A step whose set of
    adapters changed (stacked anew) is not timed: the set of a batch's adapters changes only as requests come and
    go."""
    from engine.lora import synthetic_adapter

    decoder = engine.runner.decoder
    ks = list(LORA_ADAPTERS)
    ids = [-(j + 1) for j in range(max(ks))]  # (ids no request has: the registry's start at 1)
    block = engine.cache.block_size
    points = [B for B in LORA_BATCHES if B <= max(batches) and B * (2 * ctx + block) <= capacity] or [1]
    points = sorted({points[0], *points[-3:]})
    for i in ids:
        decoder.install_lora(decoder.prepare_lora(synthetic_adapter(
            i, decoder.lora_shape, engine.config.max_lora_rank, decoder.dtype, decoder.embed.device)))
    samples: list[tuple[float, float, float]] = []
    try:
        for B in points:  # warm up: each size once
            probe.decode_ms(probe.lengths(B, ctx), ids[:1])
        for _ in range(repeats):
            for B in points:
                lens = probe.lengths(B, ctx)
                plain = probe.decode_ms(lens)
                for k in (k for k in ks if k <= B):
                    if k > 1:  # a step's set of adapters is stacked when it changes (`LoraStacks`): not timed
                        probe.decode_ms(lens, ids[:k])
                    samples.append((B, k, probe.decode_ms(lens, ids[:k]) - plain))
    finally:
        for i in ids:
            decoder.remove_lora(i)
    return samples, {"lora_batches": points, "lora_adapters": ks, "lora_ctx": ctx, "n_lora": len(samples)}


def load_or_profile(engine: "LLMEngine", time_budget_s: float = 12.0, *,
                    fresh: bool = False) -> tuple[LatencyModel, dict]:
    """The cached fit for this engine's setup, or (none cached, or `fresh`) a new one, saved for next time."""
    meta = _meta(engine)
    path = Path(engine.config.scheduler.predictor_path or _default_path(meta))
    if fresh:  # this engine's own new fit (`reprofile`): replicas on devices of their own need not wait in turn
        return _profile(engine, time_budget_s, meta, path)
    if (cached := _cached(path, meta)) is not None:
        return cached
    # none cached: one engine of a setup profiles at a time (a host's replicas start together), and the others wait
    # for its fit and load it, instead of each profiling (on shared cores, timed against each other's probes)
    with held(path, "latency profile"):
        if (cached := _cached(path, meta)) is not None:
            return cached
        return _profile(engine, time_budget_s, meta, path)


def _cached(path: Path, meta: dict) -> tuple[LatencyModel, dict] | None:
    if not path.exists():
        return None
    try:
        model = LatencyModel.load(path)
        if model.meta.get("fit") and {k: model.meta.get(k) for k in meta} == meta:
            return model, dict(model.meta["fit"], cached=True, path=str(path))
    except (ValueError, KeyError, OSError) as e:
        log.warning("ignoring unreadable latency profile %s: %s", path, e)
    return None


def _profile(engine: "LLMEngine", time_budget_s: float, meta: dict, path: Path) -> tuple[LatencyModel, dict]:
    """A new fit of the engine's setup, saved at `path`."""
    probe = Prober(engine)
    limit = engine.max_model_len - 1
    capacity = engine.cache.num_blocks * engine.cache.block_size
    block = engine.cache.block_size  # mixed lengths round up to a block each
    sc = engine.config.scheduler
    budget = sc.prefill_max_tokens or PROFILE_BUDGET
    grid = None
    if engine.bundle.device.type == "cuda":
        batches = tuple(B for B in GPU_BATCH_SIZES if B <= sc.max_num_seqs)
        ctx_lens = tuple(L for L in GPU_CTX_LENS if L <= limit) or (min(limit, 32),)
        fits = [(B, L) for B in batches for L in ctx_lens if B * (2 * L + block) <= capacity] \
            or [(1, max(1, min(ctx_lens[0], (capacity - block) // 2)))]  # a cache too small for the grid
        rng = random.Random(0)
        corners = {fits[0], fits[-1], *[(B, min(L for b, L in fits if b == B)) for B in {b for b, _ in fits}]}
        rest = [c for c in fits if c not in corners]
        grid = sorted(corners) + sorted(rng.sample(rest, min(len(rest), max(0, GPU_GRID_SAMPLES - len(corners)))))
        sizes = sorted({n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, budget,
                                    min(2 * budget, limit)) if n <= min(limit, capacity, max(budget, 16) * 2)})
        chunks = sorted({(n, at) for n in GPU_CHUNK_SIZES if n <= min(budget, limit)
                         for f in GPU_CHUNK_DEPTHS
                         if (at := int(f * (min(limit, capacity) - n)) // block * block) >= n})
        ctx = min(GPU_MIXED_CTX, limit // 2)
        mixed = [(n, B, ctx) for n in GPU_MIXED_TOKENS for B in GPU_MIXED_BATCHES
                 if n <= min(budget, limit) and B + 1 <= sc.max_num_seqs and n + B * (2 * ctx + block) <= capacity]
    else:  # (a CPU's fit as it was: its prefill and decode steps alone)
        chunks, mixed = [], []
        ctx_lens = tuple(L for L in CTX_LENS if L <= limit) or (min(limit, 32),)
        batches = tuple(B for B in BATCH_SIZES if B * (max(ctx_lens) + block) <= capacity) or (1,)
        # up to twice the budget, or the longest prompt the window takes where that is less (the fit's longest size
        # decides how well it extrapolates, `LatencyModel.fit_prefill`)
        sizes = sorted({n for n in (16, 32, 64, 128, 256, 512, budget, min(2 * budget, limit))
                        if n <= min(limit, capacity)})
    sizes = sizes or [max(1, min(limit, capacity))]  # a window or a cache under 16 tokens
    big = grid[-1] if grid else (batches[-1], ctx_lens[-1])
    for _ in range(2):  # warm up: page in the weights, size the workspace
        probe.prefill(sizes[-1])
        probe.decode(*big)
    t0 = time.perf_counter()
    model, report = profile(probe.prefill, probe.decode, prefill_sizes=sizes, batch_sizes=batches,
                            ctx_lens=ctx_lens, repeats=5, time_budget_s=time_budget_s, grid=grid,
                            find_knee=grid is not None, run_chunk=probe.chunk if chunks else None, chunks=chunks,
                            run_mixed=probe.mixed if mixed else None, mixed=mixed,
                            token_ladder=engine.backend.token_ladder() if grid is not None else ())
    if engine.config.serves_lora and engine.runner.decoder is not None:
        samples, lora_report = profile_lora(engine, probe, batches, ctx_lens[min(1, len(ctx_lens) - 1)], capacity)
        model.fit_lora(samples)
        cells = cell_medians(samples)
        lora_report.update(lora_coef=[round(c, 5) for c in model.lora_coef],
                           lora_mae_ms=round(sum(abs(model.lora_ms(int(k), b) - ms) for b, k, ms in cells)
                                             / max(1, len(cells)), 3))
        report.update(lora_report)
    report = dict(report, seconds=round(time.perf_counter() - t0, 2))
    model.meta = dict(meta, fit=report)
    why = untrusted(report)
    if why is not None:  # served with for now (the steps' own corrections apply); the next start profiles afresh
        log.warning("latency model fitted in %.1fs but not kept for later starts (%s): %s", report["seconds"], why,
                    report)
        return model, dict(report, cached=False, path=None, untrusted=why)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save(path)
    except OSError as e:
        log.warning("could not save latency profile to %s: %s", path, e)
    log.info("latency model fitted in %.1fs: %s", report["seconds"], report)
    return model, dict(report, cached=False, path=str(path))


UNTRUSTED_MAPE = 3.0  # a fit whose prefill or held-out decode error is above this (300%) is not kept


def untrusted(report: dict) -> str | None:
    """Why a fit (`scheduling.predictor.profile`'s report) is not to be kept for later starts, None where it may be:
    the time budget ran out before there were samples for its terms (four decode terms fitted to a couple of samples
    read a step many times too long), or its error is gross (`UNTRUSTED_MAPE`: steps timed on a busy host). A fit
    kept was reused at every start, however bad; one not kept serves its engine's run, and the next start profiles
    afresh."""
    if report.get("budget_exhausted") and (report.get("n_decode", 0) < 4 or report.get("n_prefill", 0) < 3):
        return (f"the {report.get('seconds', '?')} s budget ran out at {report.get('n_decode')} decode and "
                f"{report.get('n_prefill')} prefill samples")
    for key in ("prefill_mape", "mape_holdout"):
        if report.get(key) is not None and report[key] > UNTRUSTED_MAPE:
            return f"{key} {report[key]:.2f}: the steps' times do not follow the model (a busy host?)"
    return None


def refit(engine: "LLMEngine", time_budget_s: float, scale: tuple[float, float]) -> dict:
    """A fresh fit for an idle engine (inside `run_idle`): cached unscaled, handed to the scheduler scaled."""
    try:
        model, report = load_or_profile(engine, time_budget_s, fresh=True)
    except Exception as err:  # noqa: BLE001 - the caller gets the error; the old fit stays
        raise RuntimeError(f"profiling failed: {err!r}") from err
    engine.profile_report = report
    engine.scheduler.set_predictor(model.scaled(*scale))
    return dict(report)
