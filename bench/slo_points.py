"""bench.slo's engines and points: one engine per policy label, one summary per (policy, load) point."""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from bench import slo_metrics as M
from bench import workload as W
from bench.common import percentile
from bench.models import resolve_bench_model
from bench.slo_run import PointRun, hop_summary
from bench.slo_steps import step_figures

def _drain_for(items: Sequence[W.WorkItem], drain: float | None) -> float:
    if drain is not None:
        return drain
    span = items[-1].arrival_s if items else 0.0
    return min(60.0, max(10.0, 0.25 * span))


class _Engines:
    """Starts engines one at a time (policy fixed at construction) and remembers the start times."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start_s: dict[str, float] = {}
        self._model: str | None = None
        self.predictor_path: str | None = None  # None: the shared cache (~/.cache/kairos/profiles)

    def model_path(self) -> str:
        if self._model is None:
            self._model = resolve_bench_model(self.args.model)
        return self._model

    def start(self, label: str):
        """An engine for `label`: a policy name, optionally with overrides (`kairos+monotone_skip=false`)."""
        from engine.config import EngineConfig
        from engine.engine import LLMEngine
        from scheduling.config import SchedulerConfig

        a = self.args
        policy, extra = policy_spec(label)
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(
            model=self.model_path(), dtype=a.dtype, device="cpu", num_threads=a.engine_threads,
            kv_cache_memory_gb=a.kv_gb,
            scheduler=SchedulerConfig(policy=policy, max_num_seqs=a.max_num_seqs,
                                      prefill_max_tokens=a.prefill_max_tokens, predictor_path=self.predictor_path,
                                      **{**_overrides(a.sched), **extra})))
        self.start_s[label] = time.perf_counter() - t0
        return eng


def _overrides(pairs: Sequence[str] | None) -> dict[str, Any]:
    """`--sched key=value` pairs as SchedulerConfig overrides (values parsed as JSON when they parse)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, val = pair.partition("=")
        if not sep:
            raise SystemExit(f"--sched takes key=value, got {pair!r}")
        try:
            out[key.strip()] = json.loads(val)
        except json.JSONDecodeError:
            out[key.strip()] = val
    return out


def policy_spec(label: str) -> tuple[str, dict[str, Any]]:
    """`kairos+monotone_skip=false+vbs_gate=false` -> ("kairos", {...}): a preset plus overrides (ablations)."""
    name, *pairs = label.split("+")
    return name, _overrides(pairs)


def _predictor_info(eng: Any | None, predictor: Any) -> dict[str, Any]:
    rep = dict(getattr(eng, "profile_report", None) or {}) if eng is not None else {}
    info: dict[str, Any] = {
        "r2": rep.get("r2"), "mape": rep.get("mape_holdout", rep.get("mape_train")),
        "mape_train": rep.get("mape_train"), "prefill_r2": rep.get("prefill_r2"),
        "prefill_mape": rep.get("prefill_mape"), "n_samples": rep.get("n_samples"),
        "cached": rep.get("cached"), "path": rep.get("path"), "profile_seconds": rep.get("seconds"),
    }
    try:
        info["prefill_coef"] = list(predictor.prefill_coef)
        info["decode_coef"] = list(predictor.decode_coef)
    except AttributeError:
        pass
    return info


def _summarize_point(policy: str, load: float, rate: float, runs: list[tuple[int, PointRun]],
                     warmup: float, tiers: Sequence[str]) -> dict[str, Any]:
    per_seed = []
    pooled: list[M.RequestRecord] = []
    wall = 0.0
    for seed, run in runs:
        s = M.summarize(run.records, warmup_frac=warmup, tiers=tiers)
        per_seed.append({"seed": seed, "goodput_rps": s["goodput_rps"], "adherence": s["adherence"],
                         "wall_s": s["wall_s"], "n": s["n"]})
        pooled.extend(M.drop_warmup(run.records, warmup))
        wall += s["wall_s"]
    s = M.summarize(pooled, warmup_frac=0.0, wall_s=wall, tiers=tiers)  # warm-up already dropped per seed
    s["n_dropped_warmup"] = sum(len(r.records) for _, r in runs) - len(pooled)
    eng = [r.engine for _, r in runs if r.engine]
    steps = sum(e["steps"] for e in eng)
    sched = sum(e["phase_s"].get("schedule", 0.0) for e in eng)
    busy = sum(sum(e["phase_s"].values()) for e in eng)
    lags = sorted(x for _, r in runs for x in r.submit_lag_ms)
    hops = hop_summary(pooled)
    return {
        "policy": policy, "load_multiple": load, "rate_rps": rate, **s,
        "timeouts": sum(r.timeouts for _, r in runs),
        "sched_ms_per_step": sched / steps * 1000.0 if steps else None,
        "sched_pct": sched / busy * 100.0 if busy > 0 and steps else None,
        "step_ms": busy / steps * 1000.0 if steps else None,
        "steps": steps,
        **(step_figures([e["tap"] for e in eng]) if eng else {}),
        "engine_busy_pct": busy / wall * 100.0 if wall > 0 and eng else None,
        "submit_lag_p99_ms": percentile(lags, 99) if lags else None,
        "per_seed": per_seed, **M.pool(per_seed),
        **({"http_hops_ms": hops} if hops else {}),
    }


def _dist(d: W.LengthDist) -> dict[str, Any]:
    return {"median": d.median, "sigma": d.sigma, "cap": d.cap, "min": d.min_len}
