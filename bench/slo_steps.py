"""Per-step accounting for bench.slo's engine mode: where a decoding request's time per token goes.

`StepTap` wraps one engine's `Scheduler.on_step_done` (called on the worker thread after every step) for the
duration of a point and keeps, per step kind, the whole-step wall time, and for decode-only steps the ratio of
that wall time to the latency model's ITL(B, L) for the same batch: the model every gate admits with. Two
figures come out of it, and together they are what a static gate's margin must cover:
- `prefill_only_pct`: the share of engine time spent in prefill-only steps, during which no decode runs
  (prefill-first policies; kairos's hybrid steps have almost none);
- `decode_wall_over_model_p50`: the median real decode step against the model (1 = the profile holds).
The same ratios, from an FCFS run, calibrate the model (bench/slo_calibrate.py).
"""
from __future__ import annotations

from typing import Any

from bench.common import percentile


class StepTap:
    def __init__(self, scheduler: Any) -> None:
        self._sched = scheduler
        self._inner = scheduler.on_step_done
        self.total_ms = 0.0
        self.prefill_only_ms = 0.0
        self.decode_ratios: list[float] = []
        self.prefill_ratios: list[float] = []
        scheduler.on_step_done = self._observe  # an instance attribute shadows the method until close()

    def _observe(self, plan: Any, step_ms: float, wall_ms: float, now: float) -> None:
        self.total_ms += wall_ms
        if plan.prefill and not plan.decode:
            self.prefill_only_ms += wall_ms
            if self._sched.predictor is not None:
                self.prefill_ratios.append(wall_ms / self._sched.predictor.prefill_ms(plan.num_prefill_tokens))
        elif plan.decode and not plan.prefill and self._sched.predictor is not None:
            avg_len = sum(r.num_tokens for r in plan.decode) / len(plan.decode)
            pred = self._sched.predictor.itl_ms(len(plan.decode), avg_len)
            if pred > 0:
                self.decode_ratios.append(wall_ms / pred)
        self._inner(plan, step_ms, wall_ms, now)

    def close(self) -> dict[str, Any]:
        """Restore the scheduler's own method; return this tap's raw sums (pool them with `step_figures`)."""
        del self._sched.on_step_done
        return {"total_ms": self.total_ms, "prefill_only_ms": self.prefill_only_ms,
                "decode_ratios": self.decode_ratios, "prefill_ratios": self.prefill_ratios}


def step_figures(taps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Pool the taps of a point's seeds into its two figures (None where nothing was measured)."""
    total = sum(t["total_ms"] for t in taps)
    ratios = [x for t in taps for x in t["decode_ratios"]]
    return {"prefill_only_pct": 100.0 * sum(t["prefill_only_ms"] for t in taps) / total if total > 0 else None,
            "decode_wall_over_model_p50": percentile(ratios, 50) if ratios else None}
