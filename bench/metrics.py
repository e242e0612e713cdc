"""The figures every benchmark reports, as pure functions over numbers and `driver.Record`s (no engine).

Distributions: `percentile`, `distribution` (n/min/mean/max/p50/p90/p99). SLO attainment, with the SCORPIO /
DistServe definitions (`summarize` a run):

- TTFT = first token − arrival; TPOT = (E2E − TTFT)/(n − 1) = (last token − first token)/(n − 1), 0 for n = 1.
- A request is *good* iff it was not rejected, completed (finish_reason stop/length), TTFT ≤ F and TPOT ≤ T.
- goodput = #good / window (req/s); adherence = #good / #all, so rejections (and timeouts, errors) are misses.
- Violations are counted among *served* (not rejected) requests: a TTFT violation is a late or missing first
  token; a TPOT violation is TPOT > T over the tokens it got (needs ≥ 2). `incomplete` counts served requests
  that did not complete (timed out / aborted / failed).
- Warm-up: the first `warmup_frac` of the requests by arrival are dropped from every statistic.
- window (for goodput): from the first kept arrival to the last kept arrival, unless the caller passes `window_s`:
  the same for every policy offered the same arrivals, so their goodputs compare as their good requests do (over
  the run's own end, each policy's was over its own tail, and a harness's drain moved it).
- wall (for token throughput): from the first kept arrival to the last kept end (last token, rejection or give-up
  time), unless the caller passes `wall_s`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.driver import Record


# --------------------------------------------------------------------------- distributions


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default "linear" method); q in [0, 100]. NaN if empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"n", "min", "mean", "max", "p50", "p90", "p99"} of `values` (NaN fields when empty)."""
    xs = [float(v) for v in values]
    out: dict[str, float] = {"n": len(xs)}
    out["min"] = min(xs) if xs else math.nan
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    for q in qs:
        out[f"p{q:g}"] = percentile(xs, q)
    return out


# --------------------------------------------------------------------------- SLO attainment


def tpot_s(rec: Record) -> float | None:
    """(E2E − TTFT)/(n − 1); 0.0 for a single token; None without any token."""
    if rec.n_out <= 0 or rec.ttft_s is None:
        return None
    if rec.n_out == 1:
        return 0.0
    e2e = rec.e2e_s
    if e2e is None:
        return None
    return max(0.0, e2e - rec.ttft_s) / (rec.n_out - 1)


def ttft_ok(rec: Record) -> bool:
    return rec.ttft_s is not None and rec.ttft_s * 1000.0 <= rec.ttft_slo_ms


def tpot_ok(rec: Record) -> bool:
    t = tpot_s(rec)
    return t is not None and t * 1000.0 <= rec.tpot_slo_ms


def is_good(rec: Record) -> bool:
    return rec.completed and ttft_ok(rec) and tpot_ok(rec)


def ttft_violation(rec: Record) -> bool:
    """Served (not rejected) and the first token came late or never."""
    return not rec.rejected and not ttft_ok(rec)


def tpot_violation(rec: Record) -> bool:
    """Served, at least 2 tokens, and TPOT over them exceeds the SLO."""
    t = tpot_s(rec)
    return not rec.rejected and rec.n_out >= 2 and t is not None and t * 1000.0 > rec.tpot_slo_ms


def drop_warmup(records: Iterable[Record], frac: float = 0.1) -> list[Record]:
    """Sort by arrival and drop the first floor(frac · n) requests."""
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"warm-up fraction must be in [0, 1), got {frac}")
    recs = sorted(records, key=lambda r: r.arrival_s)
    return recs[int(math.floor(frac * len(recs))):]


def wall_of(records: Sequence[Record]) -> float:
    """The run's span: its first arrival to its last request's end (what the token throughput is over)."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.arrival_s for r in records)


def window_of(records: Sequence[Record]) -> float:
    """The arrivals' span: its first arrival to its last (what goodput is over), as they were due
    (`Record.scheduled_s`, where every record has it), else as they were sent. The same for every policy offered the
    same arrivals, so that their goodputs compare as their good requests do: over `wall_of`, each was over its own
    last end (a reply not good, a request timed out at the drain's end), and moved with the harness's drain; over the
    sends, a client that fell behind under one policy's load (an HTTP client's) stretched that policy's span
    alone."""
    if not records:
        return 0.0
    times = [r.scheduled_s for r in records]
    if any(t is None for t in times):
        times = [r.arrival_s for r in records]
    return max(times) - min(times)


def _latency_stats(recs: Sequence[Record]) -> dict[str, float]:
    served = [r for r in recs if not r.rejected]
    ttft = [r.ttft_s * 1000.0 for r in served if r.ttft_s is not None]
    tpot = [t * 1000.0 for t in (tpot_s(r) for r in served if r.n_out >= 2) if t is not None]
    return {
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
    }


def _counts(recs: Sequence[Record]) -> dict[str, Any]:
    n = len(recs)
    good = sum(is_good(r) for r in recs)
    rej = sum(r.rejected for r in recs)
    return {
        "n": n,
        "good": good,
        "adherence": good / n if n else math.nan,
        "rejected": rej,
        "rejection_rate": rej / n if n else math.nan,
        "ttft_violations": sum(ttft_violation(r) for r in recs),
        "tpot_violations": sum(tpot_violation(r) for r in recs),
        "incomplete": sum(not r.rejected and not r.completed for r in recs),
    }


def per_replica(records: Iterable[Record]) -> dict[str, dict[str, int]]:
    """HTTP runs: how the load split over the LLM replicas (requests each answered, completed, output tokens)."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        if r.replica:
            d = out.setdefault(r.replica, {"requests": 0, "completed": 0, "output_tokens": 0})
            d["requests"] += 1
            d["completed"] += int(r.completed)
            d["output_tokens"] += r.n_out
    return dict(sorted(out.items()))


def summarize(records: Iterable[Record], *, warmup_frac: float = 0.1, wall_s: float | None = None,
              tiers: Sequence[str] | None = None, window_s: float | None = None) -> dict[str, Any]:
    """Every metric of one run (one policy × load × seed, or pooled records with an explicit `wall_s` and
    `window_s`). Goodput is over the arrivals' span (`window_of`), the token throughput over the run's (`wall_of`)."""
    records = list(records)
    kept = drop_warmup(records, warmup_frac)
    wall = wall_of(kept) if wall_s is None else float(wall_s)
    window = window_of(kept) if window_s is None else float(window_s)
    c = _counts(kept)
    out_tokens = sum(r.n_out for r in kept)
    reasons: dict[str, int] = {}
    for r in kept:
        if r.rejected:
            key = r.reject_reason or "rejected"
            reasons[key] = reasons.get(key, 0) + 1
    names = list(tiers) if tiers is not None else list(dict.fromkeys(r.tier for r in kept))
    per_tier = {}
    for name in names:
        sub = [r for r in kept if r.tier == name]
        per_tier[name] = {**_counts(sub), **_latency_stats(sub)}
    return {
        **c,
        "n_dropped_warmup": len(records) - len(kept),
        "wall_s": wall,
        "window_s": window,
        "goodput_rps": c["good"] / window if window > 0 else math.nan,
        "token_throughput": out_tokens / wall if wall > 0 else math.nan,
        "output_tokens": out_tokens,
        "reject_reasons": reasons,
        **_latency_stats(kept),
        "per_tier": per_tier,
        "per_replica": per_replica(kept),
        "rerouted": rerouted(kept),
    }


def rerouted(records: Iterable[Record]) -> dict[str, int]:
    """HTTP runs with router=slo: the requests a replica turned away that the ingress sent on to another one, and
    what became of them."""
    sub = [r for r in records if r.rerouted]
    return {"requests": len(sub), "served": sum(not r.rejected for r in sub), "good": sum(is_good(r) for r in sub)}


def pool(summaries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean and population std of goodput / adherence across seeds (the pooled numbers come from `summarize`)."""
    out: dict[str, float] = {}
    for key in ("goodput_rps", "adherence"):
        xs = [s[key] for s in summaries if s.get(key) is not None and not math.isnan(s[key])]
        m = sum(xs) / len(xs) if xs else math.nan
        out[f"{key}_mean"] = m
        out[f"{key}_std"] = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) if xs else math.nan
    return out


def predicted_length_rank(records: Iterable[Record]) -> dict[str, Any] | None:
    """How the lengths the server's length predictor expected at arrival (`Record.predicted_len`, from the engine's
    final item or the usage's `kairos_metrics`) rank the replies' lengths (`output_len`: where each reply ends):
    Spearman's correlation over the records that have both, and their count; None under 3 of them (no predictor
    ran: hidden or exact lengths, another server; or over HTTP, replies the client ended itself at their hidden
    length, whose final usage chunk never comes)."""
    pairs = [(r.predicted_len, r.output_len) for r in records if r.predicted_len is not None and r.output_len > 0]
    if len(pairs) < 3:
        return None
    from scheduling.length_predictor import spearman

    rho = spearman(*zip(*pairs))
    return {"n": len(pairs), "spearman": None if math.isnan(rho) else rho}
