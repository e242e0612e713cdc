"""bench.slo's latency model as the schedulers get it: a fresh probe fit before every run, calibrated once on
served steps.

SCORPIO fits its step-time model offline on step times logged while serving the dataset (its
`predictor/analytic_model` reads `profiled_result/<model>-<dataset>-decode.jsonl`). Our engine fits at start on
isolated probe steps (engine/profiling.py) instead, and on this box a served step is slower than a probe of the
same (B, L): the client's threads share the caches and the memory bus, and a step also pays for scheduling and
for emitting its tokens. Measured (`python -m bench.slo ... -v`, FCFS at lambda*): a served decode step runs at
a median ~1.05-1.15x its fresh probe fit. So, as SCORPIO does, the model the policies admit with is brought to
served steps: one FCFS run at lambda* (`calibrate`) measures the median served/probe ratio of decode-only and of
prefill-only steps, and every fit after that is scaled by those two factors. A policy with the online ITL
correction (kairos) gets the fit unscaled: its correction measures the same served/model ratio while serving,
and a calibration underneath would count it twice (its gate margin is max(1.3, measured), so a calibrated
model raised its floor to 1.3 x 1.13 and it rejected 138 of 400 at 0.5 x lambda*, more than scorpio).

The VM's speed also drifts, by up to ~35% within a minute (a fixed probe step measured every 2 s went 7.8 ->
10.6 -> 8.1 ms), which a fit taken minutes earlier cannot see. So before every (policy, seed) run each engine
re-times its model (`LLMEngine.reprofile`, ~2 s, per-cell medians) and gets that fit times the calibration
(`fresh_fit`). The SLO tiers stay those of the first profile: they define the workload, not the scheduler.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.common import percentile

PROFILE_BUDGET_S = 4.0


def factors(taps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median served/model ratio of decode-only and prefill-only steps (1.0 where a kind was never seen)."""
    dec = [x for t in taps for x in t["decode_ratios"] if math.isfinite(x) and x > 0]
    pre = [x for t in taps for x in t["prefill_ratios"] if math.isfinite(x) and x > 0]
    return {"decode": percentile(dec, 50) if dec else 1.0, "prefill": percentile(pre, 50) if pre else 1.0,
            "n_decode_steps": len(dec), "n_prefill_steps": len(pre)}


def calibrate(fcfs_engine: Any, run: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """The calibration factors from one run (`run(engine)` returns its StepTap's raw sums) on a fresh fit."""
    fcfs_engine.reprofile(time_budget_s=PROFILE_BUDGET_S)
    return factors([run(fcfs_engine)])


def fresh_fit(eng: Any, calib: dict[str, Any] | None, d_ref: Callable[[Any], tuple[float, float]],
              tiers_d12: float) -> dict[str, Any]:
    """Re-time `eng`'s model now, scale it by `calib` (not under an online correction), give it to the
    scheduler; returns what it measured.

    `d_ref(model)` gives the model's (d4, d12) at the tiers' L̄, so that the fit can be compared with the one
    that set the tiers (`d12_over_tiers`, before calibration: the machine's speed now against then).
    """
    online = eng.scheduler.correction is not None  # it measures this ratio itself, while serving
    c_dec, c_pre = (calib["decode"], calib["prefill"]) if calib is not None and not online else (1.0, 1.0)
    rep = eng.reprofile(time_budget_s=PROFILE_BUDGET_S, scale=(c_dec, c_pre))
    d4, d12 = (x / c_dec for x in d_ref(eng.scheduler.predictor))
    return {"d4_ms": d4, "d12_ms": d12, "d12_over_tiers": d12 / tiers_d12 if tiers_d12 else math.nan,
            "calibrated": (c_dec, c_pre) != (1.0, 1.0),
            "mape": rep.get("mape_holdout"), "seconds": rep.get("seconds")}
