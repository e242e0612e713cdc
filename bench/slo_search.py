"""bench.slo's lambda* searches: the protocol's 90%-adherence rate, and FCFS's capacity (saturation)."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from bench import slo_metrics as M
from bench import workload as W

log = logging.getLogger("kairos.bench.slo")

TARGET_ADHERENCE = 0.90


def find_lambda_star(measure: Callable[[float], float], guess: float, *, target: float = TARGET_ADHERENCE,
                     factor: float = 1.6, bisect_steps: int = 2, max_expand: int = 6,
                     out_of_time: Callable[[], bool] = lambda: False) -> tuple[float, list[dict]]:
    """Highest rate with measure(rate) >= target: expand geometrically from `guess`, then bisect (log space).

    `measure(rate)` returns the adherence of a short run. Returns (lambda*, probes). If even the lowest probe
    misses, lambda* is that rate / factor (flagged in the probes); if the highest meets, it is that rate.
    Once `out_of_time()`, bisection stops, and so does the expansion after its first two probes.
    """
    probes: list[dict] = []

    def probe(rate: float) -> bool:
        a = measure(rate)
        probes.append({"rate_rps": rate, "adherence": a})
        log.info("lambda* probe: %.3f rps -> adherence %.3f", rate, a)
        return a >= target

    lo = hi = None
    r = guess
    for k in range(max_expand):
        if k >= 2 and out_of_time():
            probes.append({"note": "expansion cut short by the time budget"})
            break
        if probe(r):
            lo = r
            if hi is not None:
                break
            r *= factor
        else:
            hi = r
            if lo is not None:
                break
            r /= factor
    if lo is None:
        lo = min(p["rate_rps"] for p in probes if "rate_rps" in p) / factor
        probes.append({"note": "never reached the target; lambda* extrapolated one factor below"})
        return lo, probes
    if hi is None:
        probes.append({"note": "target met at every probe; lambda* is the highest rate tried"})
        return lo, probes
    for _ in range(bisect_steps):
        if out_of_time():
            probes.append({"note": "bisection cut short by the time budget"})
            break
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def completion_rate(records: Sequence[M.RequestRecord], trim: float = 0.2) -> float | None:
    """Completions per second over the middle of a run (the first and last `trim` of completions dropped):
    under overload this is the engine's service rate, free of the ramp-up and of the final drain."""
    ends = sorted(r.finished_s for r in records if r.completed and r.finished_s is not None)
    a, b = int(len(ends) * trim), int(len(ends) * (1 - trim)) - 1
    if b - a < 5 or ends[b] <= ends[a]:
        return None
    return (b - a) / (ends[b] - ends[a])


def find_capacity(measure: Callable[[float], float | None], guess: float, *, saturated: float = 0.85,
                  factor: float = 2.0, max_tries: int = 4) -> tuple[float, list[dict]]:
    """FCFS capacity: the completion rate it sustains when offered more than it can serve.

    `measure(rate)` runs FCFS open-loop at `rate` and returns its completion rate. The offered rate starts at
    `guess` and grows by `factor` until the completion rate falls below `saturated` × offered (the queue then
    grows without bound); that completion rate is the capacity. If it never saturates, the highest completion
    rate seen is returned (flagged)."""
    probes: list[dict] = []
    rate, best = guess, 0.0
    for _ in range(max_tries):
        got = measure(rate)
        probes.append({"rate_rps": rate, "completion_rps": got})
        if got is not None:
            best = max(best, got)
            if got < saturated * rate:
                return got, probes
        rate *= factor
    probes.append({"note": "FCFS never saturated; capacity is the highest completion rate seen"})
    return best, probes


def capacity_guess(predictor: Any, scale: W.SLOScale) -> float:
    """A rough FCFS-lambda* starting point (rps): 40% of the rate that one request's prefill plus its share of
    decode steps at B=4 allows (FCFS loses the strict tier's d4 TPOT well before the engine saturates)."""
    per_req_ms = predictor.prefill_ms(scale.mean_prompt) + scale.mean_output * predictor.itl_ms(4, scale.l_bar) / 4
    return max(0.02, 0.4 * 1000.0 / max(per_req_ms, 1e-3))
