"""How well the engine's probe fit predicts decode steps, and how fast this machine's speed drifts.

    python -m bench.probe_check [--model kairos-tiny] [--reps 3] [--drift-s 60] [--json PATH]

1. Fits: per repeat, two profiles of the same grid back to back (engine/profiling.py's `profile`): decode
   probes with equal context lengths (the profile before v3) and with mixed lengths of the same mean (v3).
   Each is scored on 32 batches of served-like lengths (lognormal prompt + partial output) timed right after:
   the median measured / predicted step (1.00 = unbiased).
2. Drift: one fixed decode probe (B=12, L=173, mixed lengths), timed 20 times every 2 s for --drift-s seconds;
   prints the median of each round and the max/min ratio over the run.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.common import run_info, write_json
from bench.models import resolve_bench_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-tiny")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--drift-s", type=float, default=60.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from engine.engine import LLMEngine
    from engine.profiling import BATCH_SIZES, CTX_LENS, _Prober
    from scheduling.predictor import profile

    eng = LLMEngine(model=resolve_bench_model(args.model), dtype="float32", device="cpu", max_num_seqs=64,
                    kv_cache_memory_gb=0.25, prefill_max_tokens=512)
    probe = _Prober(eng)

    step = probe.time_decode
    rng = random.Random(7)
    served = [[max(8, int(rng.lognormvariate(4.6, 0.8)) + rng.randint(0, 60)) for _ in range(b)]
              for b in (4, 8, 16, 24) for _ in range(8)]
    fits = []
    kinds = {"equal": lambda b, n: step([n] * b), "mixed": probe.decode}
    for rep in range(args.reps):
        row = {"rep": rep}
        for kind, run in kinds.items():
            model, _ = profile(probe.prefill, run, prefill_sizes=[16, 512], batch_sizes=BATCH_SIZES,
                               ctx_lens=CTX_LENS, repeats=5, seed=rep)
            row[kind] = statistics.median(step(ls) / model.itl_ms(len(ls), sum(ls) / len(ls)) for ls in served)
        fits.append(row)
        print(f"fit {rep}: served-like batch / fit, median: equal-length probes {row['equal']:.3f}, "
              f"mixed-length probes {row['mixed']:.3f}", flush=True)
    drift = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.drift_s:
        drift.append(statistics.median(step(probe.lengths(12, 173)) for _ in range(20)))
        print(f"  drift {time.perf_counter() - t0:5.1f} s: B=12 L=173 step {drift[-1]:.2f} ms", flush=True)
        time.sleep(2.0)
    eng.shutdown()
    spread = max(drift) / min(drift) if drift else None
    if drift:
        print(f"drift over {args.drift_s:g} s: {min(drift):.2f}-{max(drift):.2f} ms, max/min {spread:.2f}")
    if args.json:
        write_json(args.json, {"benchmark": "probe_check", "fits": fits, "drift_ms": drift,
                               "drift_max_over_min": spread, "run": run_info("bench.probe_check", argv)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
