"""How a box's speed wanders over time: one decode step of a fixed batch, timed back to back, for `--seconds`.

A shared CPU does not scatter each step on its own: it runs slow or fast for a while (its neighbours' load, the
clock), so steps a moment apart are slow together. bench.sim models a box as `--jitter` (each step's own lognormal
scatter) and `--drift` / `--drift-s` (an Ornstein-Uhlenbeck wander of the log of its speed: `bench.sim.Drift`).
This measures both on the real engine, nothing else running:

- the log of each step over the run's median; its spread is the whole scatter;
- the medians of `--window`-second windows: a window holds hundreds of steps, so each step's own scatter averages
  out of them and they follow the drift, averaged over the window. Their lag-1 correlation and spread give the
  drift's time constant and sigma, read as an Ornstein-Uhlenbeck process's window averages (`ou_from_windows`);
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
    """Spread (sd of the log) of the medians of `window_s`-second windows of steps started at `t` (s) taking `ms`,
    and the lag-1 correlation of those medians (windows of fewer than 5 steps left out)."""
    lg = np.log(ms / np.median(ms))
    bins = np.floor(t / window_s).astype(int)
    meds = np.array([np.median(lg[bins == b]) for b in np.unique(bins) if (bins == b).sum() >= 5])
    rho = float(np.corrcoef(meds[:-1], meds[1:])[0, 1]) if len(meds) > 2 else math.nan
    return {"window_s": window_s, "windows": int(len(meds)), "sigma": float(meds.std()), "rho": rho}


def ou_from_windows(sd: float, rho: float, window_s: float) -> tuple[float, float]:
    """(sigma, time constant s) of an Ornstein-Uhlenbeck process whose averages over consecutive windows of
    `window_s` seconds have spread `sd` and lag-1 correlation `rho`. With x = window / tau, such averages have
    variance sigma^2 * 2 (x - 1 + e^-x) / x^2 and lag-1 covariance sigma^2 * (1 - e^-x)^2 / x^2, so rho falls from
    1 to 0 as x grows: x is found by bisection. (nan, nan) where rho is not in (0, 1)."""
    if not 0.0 < rho < 1.0:
        return math.nan, math.nan

    def corr(x: float) -> float:
        return (1.0 - math.exp(-x)) ** 2 / (2.0 * (x - 1.0 + math.exp(-x)))

    lo, hi = 1e-6, 1e3
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if corr(mid) > rho else (lo, mid)
    x = math.sqrt(lo * hi)
    return sd / math.sqrt(2.0 * (x - 1.0 + math.exp(-x)) / (x * x)), window_s / x


def fit(t: np.ndarray, ms: np.ndarray, window_s: float) -> dict[str, Any]:
    """The drift's sigma and time constant, and the jitter beyond it, from steps started at `t` taking `ms`."""
    total = float(np.log(ms / np.median(ms)).std())
    scales = [window_stats(t, ms, window_s * k) for k in (1, 4, 16)]
    sigma, tau = ou_from_windows(scales[0]["sigma"], scales[0]["rho"], window_s)
    if math.isnan(sigma):  # no correlation from window to window: no drift this method can tell
        sigma = 0.0
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
