"""The latency profile of a GPU replica, replayed against a synthetic GPU: how well `engine.profiling._profile`'s fit
predicts the steps a GPU runs, without one.

    python -m bench.gpu_profile_replay [--seeds 0-4] [--noise 0.02] [--json PATH]

The synthetic GPU serves Llama-3.1-8B's shape in bf16 on an H100-like card: a forward reads the weights once
(16 GB at 3 TB/s) or is bound by its GEMMs (a smooth roofline at 600 TFLOP/s), each decode row reads its context's
KV (128 KiB a token), a prompt's attention costs its token pairs, decode steps are padded to the decode graphs'
batch ladder and steps with prefill rows to the mixed graphs' token ladder (eager past it, with a launch floor), and
each step is scattered by a lognormal `--noise`. `_profile` runs on it as on a CUDA engine (its probes timed on the
synthetic card, its time budget spent on the card's time and this host's), and each fit is judged against the card
without noise: a chunk deep in a long prompt, a long prompt, hybrid steps (a prompt beside decodes) over a grid, and
steps off the token ladder. What it cannot say: whether a real card's steps have this shape (the profile's report on
a device says, in `mixed`, `mixed_mape_sum`, `mixed_mape_shared`, `n_chunk`).
"""
from __future__ import annotations

import argparse
import functools
import math
import random
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Sequence

from bench.report import write_json


class SyntheticGpu:
    """Step times (ms) of an 8B bf16 model on an H100-like card, shaped as Kairos's CUDA backend runs them."""

    def __init__(self, noise: float = 0.02, seed: int = 0, max_seqs: int = 256, mixed_tokens: int = 512) -> None:
        self.bw, self.peak, self.attn_peak = 3.0e12, 600e12, 300e12
        self.weights, self.flop_tok = 16.06e9, 2 * 7.0e9
        self.kv_tok = 32 * 8 * 128 * 2 * 2  # K and V of a token over the layers (bytes)
        self.pair_flop = 4 * 4096 * 32  # QK and PV of a (query, key) pair over the layers
        from engine.backends.cuda.graphs import ladder, mixed_ladder  # (the graphs' sizes: no CUDA needed)

        self.decode_sizes, self.mixed_sizes = ladder(max_seqs), mixed_ladder(mixed_tokens)
        self.noise, self.rng = noise, random.Random(seed)

    def _linear_ms(self, tokens: int) -> float:
        memory = self.weights / self.bw * 1e3
        compute = tokens * self.flop_tok / self.peak * 1e3
        return (memory ** 4 + compute ** 4) ** 0.25

    def _scatter(self, ms: float) -> float:
        return ms * math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else ms

    def step(self, chunks: Sequence[tuple[int, int]], lens: Sequence[int]) -> float:
        """A step computing the prompt spans `chunks` ((start, end) each) beside decodes of contexts `lens`."""
        kv_ms = sum(lens) * self.kv_tok / (0.8 * self.bw) * 1e3
        if not chunks:
            rows = next(s for s in self.decode_sizes if s >= len(lens))
            return self._scatter(self._linear_ms(rows) + kv_ms + 0.63 + 0.4 + 0.0035 * len(lens))
        tokens = sum(e - s for s, e in chunks) + len(lens)
        attn_ms = sum((e * e - s * s) / 2 for s, e in chunks) * self.pair_flop / self.attn_peak * 1e3
        if self.mixed_sizes and tokens <= self.mixed_sizes[-1]:
            padded = next(s for s in self.mixed_sizes if s >= tokens)
            return self._scatter(self._linear_ms(padded) + attn_ms + kv_ms + 0.9 + 0.004 * tokens)
        device_ms = self._linear_ms(tokens) + attn_ms + kv_ms
        return self._scatter(max(device_ms, 32 * 14 * 0.01 + 0.5) + 0.3 + 0.002 * tokens)

    def prefill(self, n: int, start: int = 0) -> float:
        return self.step([(start, start + n)], [])


def spread(batch: int, ctx: int, rng: random.Random) -> list[int]:
    """`batch` contexts of mean `ctx`, spread as a served batch's (as the profile's probes)."""
    lens = [ctx] * (batch % 2)
    for _ in range(batch // 2):
        d = rng.randint(0, 3 * ctx // 4)
        lens += [ctx - d, ctx + d]
    return lens


def fit(gpu: SyntheticGpu, budget_s: float = 12.0, window: int = 32768, kv_tokens: int = 366_000,
        max_num_seqs: int = 256, budget: int = 2048, block: int = 16) -> tuple[Any, dict]:
    """`engine.profiling._profile` on a stand-in CUDA engine whose steps the synthetic card times."""
    from engine import profiling
    from scheduling import predictor

    spent = {"ms": 0.0}

    def timed(self: Any, prefill: list, decode: list) -> float:
        ms = gpu.step([(r.num_computed_tokens, r.num_tokens) for r in prefill], [r.num_tokens for r in decode])
        spent["ms"] += ms
        return ms

    sched = types.SimpleNamespace(max_num_seqs=max_num_seqs, prefill_max_tokens=budget)
    engine = types.SimpleNamespace(
        max_model_len=window, cache=types.SimpleNamespace(num_blocks=kv_tokens // block, block_size=block),
        config=types.SimpleNamespace(scheduler=sched, serves_lora=False),
        bundle=types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), vocab_limit=128_000),
        backend=types.SimpleNamespace(token_ladder=lambda: tuple(gpu.mixed_sizes)), runner=None, sampler=None)
    real_timed, real_profile = profiling.Prober._timed, profiling.profile
    profiling.Prober._timed = timed
    profiling.profile = functools.partial(predictor.profile, clock=lambda: time.perf_counter() + spent["ms"] / 1e3)
    try:
        with tempfile.TemporaryDirectory() as d:
            return profiling._profile(engine, budget_s, {"replay": 1}, Path(d) / "fit.json")
    finally:
        profiling.Prober._timed, profiling.profile = real_timed, real_profile


def judge(model: Any, truth: SyntheticGpu, seed: int = 2) -> dict[str, Any]:
    """The fit's predictions over the card's steps without noise (prediction / truth)."""
    from scheduling.predictor import prefill_sq

    rng = random.Random(seed)
    hybrid = sorted(model.mixed_ms(n, prefill_sq(at, at + n), b, ctx)
                    / truth.step([(at, at + n)], spread(b, ctx, rng))
                    for n in (16, 64, 256, 512, 1024, 2048) for b in (1, 8, 64, 256) for ctx in (512, 2048)
                    for at in (0, 4096))
    deep = prefill_sq(30720, 32768)
    return {"mixed": model.mixed, "gamma": model.prefill_coef[2],
            "chunk_2048_at_30k": model.step_prefill_ms(2048, deep) / truth.prefill(2048, 30720),
            "prompt_32k": model.step_prefill_ms(32768) / truth.prefill(32768),
            "hybrid_median": hybrid[len(hybrid) // 2], "hybrid_min": hybrid[0], "hybrid_max": hybrid[-1],
            "off_ladder": {n: model.step_prefill_ms(n) / truth.prefill(n) for n in (129, 200, 257, 300, 450)}}


def _seeds(text: str) -> list[int]:
    a, _, b = text.partition("-")
    return list(range(int(a), int(b) + 1)) if b else [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_profile_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0-4", help="the card's noise seeds, as 0-4 or 0,2 (default 0-4)")
    p.add_argument("--noise", type=float, default=0.02, help="each step's lognormal scatter (default 0.02)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON here")
    a = p.parse_args(argv)
    truth, rows = SyntheticGpu(noise=0.0), []
    for seed in _seeds(a.seeds):
        model, report = fit(SyntheticGpu(noise=a.noise, seed=seed))
        got = judge(model, truth)
        got.update(seed=seed, **{k: report.get(k) for k in ("mixed_mape_sum", "mixed_mape_shared", "n_chunk",
                                                              "n_mixed", "budget_exhausted")})
        rows.append(got)
        print(f"seed {seed}: mixed {got['mixed']} (hybrid probes' error: sum {got['mixed_mape_sum']:.3f}, shared "
              f"{got['mixed_mape_shared']:.3f}); predicted / true: a 2,048-token chunk at 30k "
              f"{got['chunk_2048_at_30k']:.2f}, a 32k prompt {got['prompt_32k']:.2f}, hybrid steps median "
              f"{got['hybrid_median']:.2f} ({got['hybrid_min']:.2f}-{got['hybrid_max']:.2f}); off the ladder "
              + " ".join(f"{n}: {r:.2f}" for n, r in got["off_ladder"].items()), flush=True)
    if a.json:
        write_json(a.json, {"noise": a.noise, "seeds": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
