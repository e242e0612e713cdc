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

from engine.request import Request
from engine.sampling import SamplingParams
from scheduling.predictor import LatencyModel, profile

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger("kairos.profiling")
PROFILE_VERSION = 3  # 3: decode probes hold mixed context lengths
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
CTX_LENS = (64, 128, 256, 512)


def _meta(engine: "LLMEngine") -> dict:
    b, c = engine.bundle, engine.config
    return {"version": PROFILE_VERSION, "model": b.path, "dtype": str(b.dtype), "device": str(b.device),
            "threads": torch.get_num_threads(), "block_size": c.block_size, "kv_dtype": str(engine.cache.dtype),
            "upcast_linears": engine.upcast_linears,
            "torch": torch.__version__}


def _default_path(meta: dict) -> Path:
    root = Path(os.environ.get("KAIROS_CACHE", Path.home() / ".cache" / "kairos")) / "profiles"
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"latency-{key}.json"


class _Prober:
    """Builds throwaway requests on the real cache and times real steps (forward + sampling).

    A decode probe of (B, L) holds B contexts whose mean is exactly L but whose lengths spread over about
    [L/4, 7L/4] in mirrored pairs, as a served batch's do: the step runs its attention in length groups
    (`model_runner.group_by_length`), so a batch of equal lengths is ~5-10% cheaper than a real one of the
    same mean, and a fit on equal lengths under-predicts every real step by that much.
    """

    def __init__(self, engine: "LLMEngine") -> None:
        self.e = engine
        self.rng = random.Random(0)
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def _req(self, n: int) -> Request:
        ids = [self.rng.randrange(self.e.bundle.vocab_limit) for _ in range(n)]
        return Request("probe", ids, self.params)

    def _timed(self, prefill: list[Request], decode: list[Request]) -> float:
        t0 = time.perf_counter()
        logits = self.e.runner.execute(prefill, decode)
        self.e.sampler.sample(logits, prefill + decode)  # .tolist() synchronises CUDA
        return (time.perf_counter() - t0) * 1000.0

    def prefill(self, n: int) -> float:
        r = self._req(n)
        self.e.blocks.ensure(r, n)
        try:
            return self._timed([r], [])
        finally:
            self.e.blocks.free(r)

    def lengths(self, batch: int, ctx: int) -> list[int]:
        """`batch` lengths with mean exactly `ctx`, each within [1, max_model_len - 1]."""
        spread = min(3 * ctx // 4, ctx - 1, self.e.max_model_len - 1 - ctx)
        lens = [ctx] * (batch % 2)
        for _ in range(batch // 2):
            d = self.rng.randint(0, max(spread, 0))
            lens += [ctx - d, ctx + d]
        return lens

    def decode(self, batch: int, ctx: int) -> float:
        return self.time_decode(self.lengths(batch, ctx))

    def time_decode(self, lens: list[int]) -> float:
        """One decode step over contexts of these lengths (ms)."""
        reqs = [self._req(n) for n in lens]
        try:
            for r, n in zip(reqs, lens):
                self.e.blocks.ensure(r, n)
                r.num_computed_tokens = n - 1  # KV contents do not change the step time
            return self._timed([], reqs)
        finally:
            for r in reqs:
                self.e.blocks.free(r)


def load_or_profile(engine: "LLMEngine", time_budget_s: float = 12.0, *,
                    fresh: bool = False) -> tuple[LatencyModel, dict]:
    """The cached fit for this engine's setup, or (none cached, or `fresh`) a new one, saved for next time."""
    meta = _meta(engine)
    path = Path(engine.config.scheduler.predictor_path or _default_path(meta))
    if path.exists() and not fresh:
        try:
            model = LatencyModel.load(path)
            if model.meta.get("fit") and {k: model.meta.get(k) for k in meta} == meta:
                return model, dict(model.meta["fit"], cached=True, path=str(path))
        except (ValueError, KeyError, OSError) as e:
            log.warning("ignoring unreadable latency profile %s: %s", path, e)
    probe = _Prober(engine)
    limit = engine.max_model_len - 1
    capacity = engine.blocks.num_blocks * engine.blocks.block_size
    ctx_lens = tuple(L for L in CTX_LENS if L <= limit) or (min(limit, 32),)
    block = engine.blocks.block_size  # mixed lengths round up to a block each
    batches = tuple(B for B in BATCH_SIZES if B * (max(ctx_lens) + block) <= capacity) or (1,)
    budget = engine.config.scheduler.prefill_max_tokens or 1024
    sizes = sorted({n for n in (16, 32, 64, 128, 256, 512, budget, 2 * budget) if n <= min(limit, capacity)})
    for _ in range(2):  # warm up: page in the weights, size the workspace
        probe.prefill(sizes[-1])
        probe.decode(batches[-1], ctx_lens[-1])
    t0 = time.perf_counter()
    model, report = profile(probe.prefill, probe.decode, prefill_sizes=sizes, batch_sizes=batches,
                            ctx_lens=ctx_lens, repeats=5, time_budget_s=time_budget_s)
    report = dict(report, seconds=round(time.perf_counter() - t0, 2))
    model.meta = dict(meta, fit=report)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save(path)
    except OSError as e:
        log.warning("could not save latency profile to %s: %s", path, e)
    log.info("latency model fitted in %.1fs: %s", report["seconds"], report)
    return model, dict(report, cached=False, path=str(path))
