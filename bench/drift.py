"""How a box's speed wanders over time: one decode step of a fixed batch, timed back to back, for `--seconds`.

A shared CPU does not scatter each step on its own: it runs slow or fast for a while (its neighbours' load, the
clock), so steps a moment apart are slow together. bench.sim models a box as `--jitter` (each step's own lognormal
scatter) and `--drift` / `--drift-s` (an Ornstein-Uhlenbeck wander of the log of its speed: `bench.sim.Drift`).
This measures both on the real engine, nothing else running:

- the log of each step over the run's median; its spread is the whole scatter;
- the medians of `--window`-second windows: a window holds hundreds of steps, so each step's own scatter averages
  out of them and they follow the drift, averaged over the window. Their lag-1 correlation and spread, less what
  the steps' own scatter still adds to them, give the drift's time constant and sigma, read as an
  Ornstein-Uhlenbeck process's window averages (`ou_from_windows`);
- the jitter: what the whole scatter has beyond the drift, sqrt(total^2 - sigma^2);
- the same spread and correlation over windows 4x and 16x as long: a box whose wander has slower parts than one
  time constant keeps more correlation there than that time constant gives.

    python -m bench.drift --seconds 90 --summary drift-kairos-tiny-zen4
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any, Sequence

import numpy as np

from bench.report import command_line, write_summary


def window_stats(t: np.ndarray, ms: np.ndarray, window_s: float) -> dict[str, float]:
    """The medians of the log step times (over the run's median) in consecutive `window_s`-second windows of steps
    started at `t` (s) taking `ms`, whole windows only: their spread, their lag-1 correlation (over neighbouring
    windows of 5 steps or more), how many there are and the mean steps in one."""
    lg = np.log(ms / np.median(ms))
    bins = np.floor(t / window_s).astype(int)
    whole = int(t.max() // window_s) if len(t) else 0  # the last window is cut short: left out
    meds, counts = np.full(whole, np.nan), np.zeros(whole)
    for b in range(whole):
        x = lg[bins == b]
        counts[b] = len(x)
        if len(x) >= 5:
            meds[b] = np.median(x)
    ok = np.isfinite(meds)
    pairs = ok[:-1] & ok[1:]
    rho = float(np.corrcoef(meds[:-1][pairs], meds[1:][pairs])[0, 1]) if pairs.sum() > 2 else math.nan
    return {"window_s": window_s, "windows": int(ok.sum()), "sigma": float(meds[ok].std()) if ok.any() else math.nan,
            "rho": rho, "steps_per_window": float(counts[ok].mean()) if ok.any() else 0.0}


def ou_from_windows(sd: float, rho: float, window_s: float) -> tuple[float, float]:
    """(sigma, time constant s) of an Ornstein-Uhlenbeck process whose averages over consecutive windows of
    `window_s` seconds have spread `sd` and lag-1 correlation `rho`. With x = window / tau, such averages have
    variance sigma^2 * 2 (x - 1 + e^-x) / x^2 and lag-1 covariance sigma^2 * (1 - e^-x)^2 / x^2, so rho falls from
    1 to 0 as x grows: x is found by bisection. (nan, nan) where rho is not in (0, 1), or where it is so small that
    the time constant would be under a twentieth of a window (too short for such windows to tell)."""
    if not 0.0 < rho < 1.0:
        return math.nan, math.nan

    def var(x: float) -> float:  # the window average's variance over sigma^2, x - 1 + e^-x kept exact for small x
        return 2.0 * (x + math.expm1(-x)) / (x * x)

    def corr(x: float) -> float:
        return math.expm1(-x) ** 2 / (x * x) / var(x)

    lo, hi = 1e-6, 20.0
    if corr(hi) >= rho:
        return math.nan, math.nan
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if corr(mid) > rho else (lo, mid)
    x = math.sqrt(lo * hi)
    return sd / math.sqrt(var(x)), window_s / x


def fit(t: np.ndarray, ms: np.ndarray, window_s: float) -> dict[str, Any]:
    """The drift's sigma and time constant, and the jitter beyond it, from steps started at `t` (s) taking `ms`.

    A window's median carries some of the steps' own scatter: about pi/2 x (their spread)^2 / (steps in it) of
    variance, uncorrelated from window to window. That is taken off the medians' variance (the whole scatter stands
    in for the jitter's, an upper bound) and so out of their correlation too, before they are read as the drift's
    window averages. A correlation under two standard errors (2 / sqrt(windows)) is no drift this method can tell:
    0, with no time constant."""
    if len(ms) == 0:
        raise ValueError("no steps were timed")
    total = float(np.log(ms / np.median(ms)).std())
    scales = [window_stats(t, ms, window_s * k) for k in (1, 4, 16)]
    w = scales[0]
    sigma, tau = 0.0, math.nan
    noise = math.pi / 2.0 * total ** 2 / w["steps_per_window"] if w["steps_per_window"] else math.inf
    sd2 = w["sigma"] ** 2 - noise if w["windows"] > 2 else -1.0
    if sd2 > 0 and w["rho"] > 2.0 / math.sqrt(w["windows"]):
        s, x = ou_from_windows(math.sqrt(sd2), min(w["rho"] * w["sigma"] ** 2 / sd2, 0.999999), window_s)
        if not math.isnan(s):
            sigma, tau = s, x
    return {"steps": int(len(ms)), "median_ms": float(np.median(ms)), "total_sigma": total,
            "drift": sigma, "drift_s": tau, "jitter": math.sqrt(max(total ** 2 - sigma ** 2, 0.0)),
            "windows": scales}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drift", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-tiny")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine (bench.slo's: 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=300, help="the batch's mean context length")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=0.25, help="seconds per window whose median is one sample")
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json")
    args = ap.parse_args(argv)

    from bench.driver import resolve_model_path
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.profiling import Prober
    from scheduling.config import SchedulerConfig

    eng = LLMEngine(EngineConfig(model=resolve_model_path(args.model), device="cpu", num_threads=args.threads,
                                 scheduler=SchedulerConfig(policy="fcfs")))
    steps: list[tuple[float, float]] = []

    def probe(e: Any) -> None:
        p = Prober(e)
        lens = p.lengths(args.batch, args.context)
        p.decode_ms(lens)  # warm this shape up
        end = time.perf_counter() + args.seconds
        while (now := time.perf_counter()) < end:
            steps.append((now, p.decode_ms(lens)))

    try:
        eng.run_idle(probe, timeout=args.seconds + 120.0)
    finally:
        eng.shutdown()
    if not steps:
        raise SystemExit("bench.drift: no step was timed (--seconds too short?)")
    t = np.array([a for a, _ in steps])
    f = fit(t - t[0], np.array([b for _, b in steps]), args.window)
    print(f"{f['steps']} steps of {args.batch} rows at context {args.context}: median {f['median_ms']:.3f} ms, "
          f"log-sd {f['total_sigma']:.3f}")
    for w in f["windows"]:
        print(f"  {w['window_s']:g}-s windows ({w['windows']}): sd of their medians (log) {w['sigma']:.3f}, "
              f"lag-1 correlation {w['rho']:.2f}")
    head = (f"{args.model}, {args.batch} rows at context {args.context}, {args.seconds:g} s: drift {f['drift']:.2f} "
            f"over {f['drift_s']:.1f} s, jitter {f['jitter']:.2f} (bench.sim --drift/--drift-s/--jitter)")
    print(head)
    if args.summary:
        path = write_summary(args.summary, command_line("bench.drift", argv),
                             head, {**f, "model": args.model, "batch": args.batch, "context": args.context,
                                    "seconds": args.seconds, "threads": args.threads})
        print(f"summary -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
