"""Heterogeneous-SLO goodput benchmark: policies × loads, open-loop, after scorpio.md §2/§4.

    python -m bench.slo --quick                         # <=3 min smoke: 3 policies at 1.5 x lambda*, short requests
    python -m bench.slo                                 # full default sweep (all 7 policies x 6 loads, <= 30 min)
    python -m bench.slo --num-requests 400 --seeds 0,1,2   # the protocol's full size (hours on a 2-core box)
    python -m bench.slo --target http://127.0.0.1:8000  # drive a running server (its own policy) over HTTP

What one run does:
1. Starts one engine per policy (the policy is fixed at construction; all stay alive), FCFS first. Engine start
   profiles the model once (cached JSON under ~/.cache/kairos/profiles, or --reprofile). The FIRST engine's
   fitted predictor sets the SLO tiers (u = 2·Prefill(budget), d4, d12 at L̄) for every policy. In engine
   mode each load point then starts fresh engines on a profile taken just before it (--refresh-profile, the
   default unless --predictor-json): this VM's speed drifts by up to ~30% within minutes, and a stale offline
   profile would misjudge every TPOT the static gates (scorpio, tpot_guard) admit. The tiers stay fixed.
2. Finds lambda*, FCFS's capacity (default, --lambda-def capacity): FCFS runs open-loop at a rising offered
   rate (×2 from an analytical guess) until its completion rate, measured over the middle 60% of completions,
   falls below 85% of the offered rate; that completion rate is lambda*. Above it FCFS's queue grows without
   bound. `--lambda-def adherence` is the protocol's definition instead (highest rate with FCFS adherence
   >= 90%: geometric expansion, then bisection). On this box FCFS's adherence hovers near 90% over a wide
   band of rates (its strict tier loses TPOT long before the engine saturates), so that definition is
   ill-conditioned here; the run still reports the protocol's value read off the sweep (lambda_star_90_rps).
   The requests are identical at every rate; only the arrival times scale. Skip it with --lambda-star.
3. Sweeps loads × policies open-loop, load-major (every policy at a load before the next load, so that a drift
   in machine speed hits all policies alike): the main thread sleeps until each request's arrival time and
   calls add_request (never blocks); one consumer thread drains the streams and keeps the final metrics (all
   timestamps are the engine's own time.monotonic). Requests unfinished `drain` seconds after the last arrival
   are aborted and counted as misses (finish_reason "timeout").
4. Writes results.json, results.csv, records.jsonl (one line per request) and the PNGs into --out, prints a
   table per load and the acceptance checks at 1.5×lambda*. `--compare RESULTS_JSON` adds a side-by-side
   with an earlier run (the HTTP run against the in-process one).

Policy labels may carry scheduler overrides for ablations: `--policies kairos,kairos+itl_correction=false`.

Model: kairos-tiny by default (the protocol's "tiny Llama, 4 layers, d=256"); with kairos-default lambda* is
well below 1 req/s on this box and a 30-minute sweep holds only ~10 requests per point.
Run length: the protocol asks for 400 requests per point × 3 seeds, so by default the requests per point
are capped at 400 AND shrunk so that the whole run fits --budget-min (30 min; quick: 3 min); the printed
plan shows the count and what 400/point would cost. The lambda* search (adherence definition) gets at most
~25% of the budget (bisection is cut short); the capacity search takes 2-3 probes of 240 requests.
Pass --num-requests N to force exactly N per point (no budget cap).
--quick is a smoke test, not a small copy of the sweep: 3 policies at 1.5×lambda* only, and
shorter requests (prompt median 40 / cap 160, output median 16 / cap 64), so lambda* is a few times higher and
the 3-minute budget holds 200 requests per point. Its numbers are not comparable with the full sweep.

dtype: float32 by default. On this AVX2 box (no AVX512-BF16/AMX) bf16 matmuls are emulated and run 3-5x
slower than fp32, so fp32 is the faster and the representative choice here; use --dtype bfloat16 on
hardware with native bf16.

Engine threads: 1 (torch.set_num_threads(1)), leaving the second core to the load generator (§4).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import slo_metrics as M  # noqa: E402
from bench import workload as W  # noqa: E402
from bench.common import fmt, loadavg, percentile, run_info, write_json  # noqa: E402
from bench.common import resolve_bench_model  # noqa: E402

from bench.slo_report import (_records_lines, acceptance, compare, format_acceptance, hops_table,  # noqa: E402,F401
                              load_table, protocol_lambda_90, write_csv)
from bench.slo_run import (PointRun, hop_summary, run_engine_point, run_http_point,  # noqa: E402,F401
                           served_model)
from bench.slo_search import (TARGET_ADHERENCE, capacity_guess, completion_rate, find_capacity,  # noqa: E402,F401
                              find_lambda_star)

log = logging.getLogger("kairos.bench.slo")

ALL_POLICIES = ("fcfs", "pack", "edf", "edf_reject", "tpot_guard", "scorpio", "kairos")
QUICK_POLICIES = ("fcfs", "scorpio", "kairos")
DEFAULT_LOADS = "0.5,0.75,1,1.25,1.5,2"
QUICK_LOADS = "1.5"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.replace(" ", "").split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


# --------------------------------------------------------------------------- the benchmark

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.slo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run (<3 min): policies {','.join(QUICK_POLICIES)}, loads {QUICK_LOADS}, "
                         "<=60 requests per point, coarse lambda* search")
    ap.add_argument("--policies", default=None, help=f"comma list (default: all = {','.join(ALL_POLICIES)})")
    ap.add_argument("--loads", default=None, help=f"multiples of lambda* (default {DEFAULT_LOADS})")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="exactly N requests per point (protocol: 400). Default: up to 400 (quick: 60), "
                         "reduced so the sweep fits --budget-min")
    ap.add_argument("--min-requests", type=int, default=None,
                    help="floor of the budget-reduced request count (default 10)")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="wall-clock budget of the whole run in minutes (default 30; quick 3; 0: no cap)")
    ap.add_argument("--seeds", default="0", help="comma list of workload seeds (default 0; protocol: 0,1,2)")
    ap.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    ap.add_argument("--mix", default="equal", help="tier mix: equal | 60-30-10 | a-b-c")
    ap.add_argument("--hint", choices=("exact", "noisy", "none"), default="exact",
                    help="output-length hint sent with each request")
    ap.add_argument("--strict-batch", type=float, default=4,
                    help="T_strict = headroom x ITL(this batch, L) (protocol: 4 -> d4)")
    ap.add_argument("--loose-batch", type=float, default=12,
                    help="T_loose = headroom x ITL(this batch, L) (protocol: 12)")
    ap.add_argument("--tpot-headroom", type=float, default=W.GATE_HEADROOM,
                    help="TPOT tiers = headroom x ITL(batch, L); default 1.3/0.99, the VBS gate's margin")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="drop this fraction of requests (by arrival)")
    ap.add_argument("--prompt-median", type=float, default=None, help="prompt tokens, lognormal median (100; quick 40)")
    ap.add_argument("--prompt-cap", type=int, default=None, help="prompt tokens, cap (512; quick 160)")
    ap.add_argument("--output-median", type=float, default=None, help="output tokens, lognormal median (60; quick 16)")
    ap.add_argument("--output-cap", type=int, default=None, help="output tokens, cap (256; quick 64)")
    ap.add_argument("--length-sigma", type=float, default=0.8, help="lognormal sigma of both lengths")
    ap.add_argument("--lambda-star", type=float, default=None, help="skip the search and use this rate (rps)")
    ap.add_argument("--lambda-def", choices=("capacity", "adherence"), default="capacity",
                    help="lambda* = FCFS's capacity (its completion rate under overload; default) or the "
                         "protocol's highest rate with FCFS adherence >= 90%%")
    ap.add_argument("--probe-requests", type=int, default=None,
                    help="requests per lambda* probe (default: ~45 s of arrivals, 20..120; quick: ~12 s, 15..40)")
    ap.add_argument("--drain", type=float, default=None,
                    help="seconds to wait after the last arrival before unfinished requests count as misses "
                         "(default: max(10, 25%% of the arrival span), capped at 60)")
    # engine
    ap.add_argument("--model", default="kairos-tiny", help="kairos-default | kairos-tiny | llama-110m | HF dir")
    ap.add_argument("--dtype", default="float32", help="float32 (default: fastest on this AVX2 box) | bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--prefill-max-tokens", type=int, default=512, help="prefill token budget (= SLO budget)")
    ap.add_argument("--sched", action="append", metavar="KEY=VALUE",
                    help="scheduler override for every policy (repeatable), e.g. --sched vbs_margin=1.2 (ablations)")
    ap.add_argument("--kv-gb", type=float, default=0.25, help="KV cache per engine (GiB; all engines stay alive)")
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine (protocol: 1)")
    ap.add_argument("--reprofile", action="store_true",
                    help="fit a fresh latency profile now (saved in --out) instead of the cached one: SLOs then "
                         "match the machine's current speed (+~15 s)")
    ap.add_argument("--refresh-profile", action=argparse.BooleanOptionalAction, default=None,
                    help="re-profile the engine before each load point (saved as latency-profile-<load>x.json in "
                         "--out) and give every policy at that point the fresh fit; the SLO tiers stay those of the "
                         "first profile. Default: on in engine mode unless --predictor-json is given (this VM's "
                         "speed drifts by up to ~30%% over tens of minutes, which an offline profile cannot see)")
    ap.add_argument("--predictor-json", default=None,
                    help="latency-model JSON (e.g. an earlier run's latency-profile.json) for the SLO tiers and, in "
                         "engine mode, for the engines' schedulers: the same tiers as that run")
    # HTTP
    ap.add_argument("--target", default=None, help="URL of a running Kairos server (POST /v1/completions)")
    ap.add_argument("--client-nice", type=int, default=19,
                    help="HTTP mode: lower this process's CPU priority by N (Ray Serve's workers run at nice 15; on "
                         "a box shared with the server the load generator must not outrank them). 0: leave it")
    ap.add_argument("--label", default="server", help="policy label for the results in HTTP mode")
    # output
    ap.add_argument("--out", default=None, help="output directory (default bench/out/slo-<timestamp>)")
    ap.add_argument("--compare", default=None, metavar="RESULTS_JSON",
                    help="print this run against an earlier one (e.g. HTTP vs in-process at the same loads)")
    ap.add_argument("--json", default=None, help="also write the results JSON here")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


@dataclass
class Plan:
    policies: list[str]
    loads: list[float]
    seeds: list[int]
    n_cap: int
    n_fixed: bool
    n_min: int
    budget_s: float
    probe_seconds: float
    probe_bounds: tuple[int, int]
    bisect_steps: int


def _plan(args: argparse.Namespace) -> Plan:
    q = args.quick
    policies = [p.strip() for p in (args.policies or ",".join(QUICK_POLICIES if q else ALL_POLICIES)).split(",")
                if p.strip()]
    for p in policies:
        if policy_spec(p)[0] not in ALL_POLICIES and not args.target:
            raise SystemExit(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
    loads = _floats(args.loads or (QUICK_LOADS if q else DEFAULT_LOADS))
    if not loads or any(x <= 0 for x in loads):
        raise SystemExit("--loads must be positive multiples of lambda*")
    seeds = _ints(args.seeds)
    fixed = args.num_requests is not None
    budget = args.budget_min if args.budget_min is not None else (0.0 if fixed else (3.0 if q else 30.0))
    return Plan(policies, loads, seeds or [0], args.num_requests or (200 if q else 400), fixed,
                args.min_requests or 10, budget * 60.0,
                12.0 if q else 45.0, (15, 40) if q else (20, 120), 1 if q else 2)


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
        "engine_busy_pct": busy / wall * 100.0 if wall > 0 and eng else None,
        "submit_lag_p99_ms": percentile(lags, 99) if lags else None,
        "per_seed": per_seed, **M.pool(per_seed),
        **({"http_hops_ms": hops} if hops else {}),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    plan = _plan(args)
    out_dir = Path(args.out or f"bench/out/slo-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    mix = W.parse_mix(args.mix)
    http = args.target is not None
    if http and args.client_nice:  # Ray runs its workers at nice 15: an equal-priority client would starve them
        os.nice(args.client_nice)
    policies = [args.label] if http else plan.policies
    info = run_info("bench.slo", argv)
    print(f"bench.slo: {'HTTP ' + args.target if http else 'engine'} | model {args.model} {args.dtype} | "
          f"policies {','.join(policies)} | loads {','.join(f'{x:g}' for x in plan.loads)} | seeds "
          f"{','.join(map(str, plan.seeds))} | {args.arrival} | mix {args.mix} | hint {args.hint} | "
          f"loadavg {loadavg()}", flush=True)

    engines = _Engines(args)
    if args.reprofile:
        engines.predictor_path = str((out_dir / "latency-profile.json").resolve())
        Path(engines.predictor_path).unlink(missing_ok=True)
    elif args.predictor_json and not args.target:  # a copy: an engine whose setup differs re-profiles into it
        engines.predictor_path = str((out_dir / "latency-profile.json").resolve())
        if Path(args.predictor_json).resolve() != Path(engines.predictor_path):
            shutil.copyfile(args.predictor_json, engines.predictor_path)
    eng = None
    if http:
        order = list(policies)
        model_name = served_model(args.target)
        if args.predictor_json:
            from scheduling.predictor import LatencyModel
            predictor, pred_eng = LatencyModel.load(args.predictor_json), None
        else:
            pred_eng = engines.start("fcfs")
            predictor = pred_eng.scheduler.predictor
        vocab, max_len = (pred_eng.bundle.vocab_limit, pred_eng.max_model_len) if pred_eng else (2556, None)
        pred_info = _predictor_info(pred_eng, predictor)
        if pred_eng is not None:
            pred_eng.shutdown()
    else:
        need_fcfs = args.lambda_star is None or "fcfs" in policies
        order = (["fcfs"] if need_fcfs else []) + [p for p in policies if p != "fcfs"]
        eng = engines.start(order[0])
        predictor = eng.scheduler.predictor
        vocab, max_len = eng.bundle.vocab_limit, eng.max_model_len
        pred_info = _predictor_info(eng, predictor)
    q = args.quick
    sig = args.length_sigma
    prompt = W.LengthDist(args.prompt_median or (40 if q else 100), sig, args.prompt_cap or (160 if q else 512), 4)
    output = W.LengthDist(args.output_median or (16 if q else 60), sig, args.output_cap or (64 if q else 256), 2)
    base = W.WorkloadSpec(arrival=args.arrival, mix=mix, hint=args.hint, vocab_size=vocab, max_model_len=max_len,
                          prompt=prompt, output=output)
    scale = W.slo_scale(predictor, args.prefill_max_tokens, base, strict_batch=args.strict_batch,
                        loose_batch=args.loose_batch, headroom=args.tpot_headroom)
    tiers = [t.name for t in scale.tiers]
    pred_info["slo_scale"] = scale.to_dict()
    print("SLO tiers (ms): " + ", ".join(f"{t.name} TTFT {t.ttft_ms:.0f} / TPOT {t.tpot_ms:.1f}" for t in scale.tiers)
          + f"  [u={scale.u_ms:.0f}, d4={scale.d4_ms:.1f}, d12={scale.d12_ms:.1f}, L={scale.l_bar:.0f}; "
            f"fit r2={fmt(pred_info['r2'], 3)} mape={fmt(pred_info['mape'], 3)}]", flush=True)

    def run_items(items: list[W.WorkItem], desc: str, tag: str, engine: Any = None) -> PointRun:
        drain = _drain_for(items, args.drain)
        if http:
            return run_http_point(args.target, model_name, items, drain_s=drain, progress=progress, desc=desc)
        return run_engine_point(engine or eng, items, drain_s=drain, tag=tag, progress=progress, desc=desc)

    # ---- lambda*
    search: dict[str, Any] = {}
    probe_no = [0]

    def probe(rate: float, n: int, desc: str, tag: str) -> PointRun:
        """One FCFS search run: the first seed's workload, n requests at `rate`."""
        probe_no[0] += 1
        items = W.generate(replace(base, num_requests=n, rate_rps=rate, seed=plan.seeds[0]), scale.tiers)
        return run_items(items, f"{desc} {rate:.2f} rps", f"{tag}{probe_no[0]}")

    if args.lambda_star is not None:
        lam = float(args.lambda_star)
        search = {"given": True, "definition": args.lambda_def}
    elif args.lambda_def == "capacity":
        t0 = time.perf_counter()

        def measure_cap(rate: float) -> float | None:
            n = args.probe_requests or (200 if args.quick else 240)
            got = completion_rate(probe(rate, n, "capacity probe", "cap").records)
            print(f"  capacity probe {probe_no[0]}: offered {rate:.3f} rps, n={n} -> FCFS completes "
                  f"{fmt(got, 3)} rps", flush=True)
            return got

        lam, probes = find_capacity(measure_cap, 2.5 * capacity_guess(predictor, scale))
        search = {"definition": "capacity", "probes": probes, "seconds": time.perf_counter() - t0,
                  "policy": "fcfs" if not http else args.label}
    else:
        guess = capacity_guess(predictor, scale)

        def measure(rate: float) -> float:
            n = args.probe_requests or int(min(plan.probe_bounds[1], max(plan.probe_bounds[0],
                                                                       rate * plan.probe_seconds)))
            run = probe(rate, n, "lambda* probe", "probe")
            a = M.summarize(run.records, warmup_frac=args.warmup_frac)["adherence"]
            print(f"  lambda* probe {probe_no[0]}: {rate:.3f} rps, n={n} -> FCFS adherence {100 * a:.1f}%",
                  flush=True)
            return a

        t0 = time.perf_counter()
        search_end = t_start + (0.25 * plan.budget_s if plan.budget_s > 0 else math.inf)
        lam, probes = find_lambda_star(measure, guess, bisect_steps=plan.bisect_steps,
                                       max_expand=4 if args.quick else 6,
                                       out_of_time=lambda: time.perf_counter() > search_end)
        search = {"definition": "adherence", "guess_rps": guess, "probes": probes,
                  "seconds": time.perf_counter() - t0, "target_adherence": TARGET_ADHERENCE,
                  "policy": "fcfs" if not http else args.label}
    print(f"lambda* = {lam:.3f} rps{' (given)' if search.get('given') else ''}", flush=True)
    notes = " ".join(p.get("note", "") for p in search.get("probes", []))
    if "never reached" in notes and "cut short" in notes:
        print(f"  note: the search used its time share (25% of the budget) before FCFS reached "
              f"{TARGET_ADHERENCE:.0%} adherence; lambda* is extrapolated one step below the lowest probe.",
              flush=True)
    elif "never reached" in notes:
        print(f"  WARNING: FCFS never reached {TARGET_ADHERENCE:.0%} adherence, so lambda* was extrapolated. The "
              f"machine is probably slower now than its cached latency profile (loadavg {loadavg()}), which "
              "makes the strict tier (d4) unattainable at any load: rerun on a quiet machine, or with --reprofile.",
              flush=True)

    # ---- size the sweep to the budget
    rates = [m * lam for m in plan.loads]
    n_points = len(policies) * len(plan.seeds)
    n_req = plan.n_cap
    refresh = (not http) and (args.refresh_profile if args.refresh_profile is not None else not args.predictor_json)
    starts = 0.0 if http else max(engines.start_s.values()) * (len(order) * len(rates) if refresh else len(order) - 1)
    per_req_s = n_points * sum(1.0 / r for r in rates)  # seconds of arrivals per request of every point
    drain_est = n_points * len(rates) * 6.0  # typical wait for the last requests after the last arrival
    if not plan.n_fixed and plan.budget_s > 0:
        left = plan.budget_s - (time.perf_counter() - t_start) - starts - 15.0  # imports, plots, files
        fit = int(max(0.0, left - drain_est) * 0.92 / per_req_s)
        n_req = max(plan.n_min, min(plan.n_cap, fit))
    eta = n_req * per_req_s + drain_est + starts
    print(f"sweep: {n_req} requests per point "
          f"({'fixed' if plan.n_fixed else f'cap {plan.n_cap}, sized to the {plan.budget_s / 60:g}-min budget'}), "
          f"{len(policies) * len(rates) * len(plan.seeds)} points, ETA ~{eta / 60:.1f} min "
          f"(400/point would take ~{(400 * per_req_s + drain_est + starts) / 3600:.1f} h)", flush=True)
    if n_req < 40:
        print(f"  note: only {n_req} requests per point: adherence has a resolution of "
              f"~{100 / max(1, n_req - int(n_req * args.warmup_frac)):.0f} pts; use --num-requests/--budget-min "
              "on a quiet machine for protocol-size runs", flush=True)

    # ---- sweep: load-major, every policy's engine kept alive, so that a drift in machine speed during the
    # run hits all policies of a load alike instead of whichever policy happened to run last
    results: list[dict[str, Any]] = []
    rec_path = out_dir / "records.jsonl"
    rec_path.write_text("")
    live: dict[str, Any] = {} if http else {order[0]: eng}
    profiles: dict[str, Any] = {}
    for load, rate in zip(plan.loads, rates):
        if refresh:  # fresh engines on a profile taken now: the first one started profiles, the rest load it
            for e in live.values():
                e.shutdown()
            live = {}
            engines.predictor_path = str((out_dir / f"latency-profile-{load:g}x.json").resolve())
            Path(engines.predictor_path).unlink(missing_ok=True)
        for policy in order:
            if policy not in policies:
                continue
            if not http and policy not in live:
                live[policy] = engines.start(policy)
                if refresh and f"{load:g}" not in profiles:
                    profiles[f"{load:g}"] = _refreshed(live[policy].scheduler.predictor, scale)
                    print(f"  profile for {load:g}x: {profiles[f'{load:g}']['summary']}", flush=True)
            e = live.get(policy)
            runs = []
            for seed in plan.seeds:
                items = W.generate(replace(base, num_requests=n_req, rate_rps=rate, seed=seed), scale.tiers)
                run = run_items(items, f"{policy} {load:g}x seed {seed}", f"{policy}-{load:g}-{seed}", e)
                runs.append((seed, run))
                with open(rec_path, "a") as f:
                    f.write("\n".join(_records_lines(policy, load, seed, run, args.warmup_frac)) + "\n")
            r = _summarize_point(policy, load, rate, runs, args.warmup_frac, tiers)
            if e is not None:  # this engine's fit (same cached profile for all)
                rep = e.profile_report or {}
                pe = e.scheduler.predictor
                r["predictor"] = {"r2": rep.get("r2"), "mape": rep.get("mape_holdout", rep.get("mape_train")),
                                  "decode_coef_end": list(pe.decode_coef) if pe is not None else None,
                                  "prefill_coef_end": list(pe.prefill_coef) if pe is not None else None}
            results.append(r)
            print(f"  {policy:<11} {load:>4g}x {rate:6.3f} rps: goodput {r['goodput_rps']:.3f} rps, adherence "
                  f"{100 * r['adherence']:5.1f}%, rejected {r['rejected']}, TTFT/TPOT viol "
                  f"{r['ttft_violations']}/{r['tpot_violations']}, timeouts {r['timeouts']}  "
                  f"[{time.perf_counter() - t_start:.0f}s, load {loadavg().split(' ')[0]}]", flush=True)
    for e in live.values():
        e.shutdown()
    results.sort(key=lambda r: (order.index(r["policy"]), r["load_multiple"]))

    # ---- report
    for load in plan.loads:
        print(load_table(results, load, tiers))
    acc = acceptance(results)
    print(format_acceptance(acc))
    lam90 = protocol_lambda_90(results)
    if lam90 is not None and search.get("definition") == "capacity":
        print(f"  protocol lambda*_90 (highest swept rate with FCFS adherence >= {TARGET_ADHERENCE:.0%}): "
              f"{lam90:.3f} rps = {lam90 / lam:.2f} x capacity", flush=True)
    if http:
        print(hops_table(results))
    comparison = None
    if args.compare:
        base_doc = json.loads(Path(args.compare).read_text())
        print("\n" + compare(results, base_doc["results"], label=policies[0] if not http else "HTTP"))
        comparison = {"baseline": args.compare, "baseline_results": base_doc["results"]}
    wall = time.perf_counter() - t_start
    info["loadavg_end"] = loadavg()
    doc = {
        "benchmark": "slo",
        "lambda_star_rps": lam,
        "lambda_star_search": search,
        "lambda_star_90_rps": lam90,
        "comparison": comparison,
        "config": {
            "mode": "http" if http else "engine", "target": args.target, "model": args.model, "dtype": args.dtype,
            "engine_threads": args.engine_threads, "max_num_seqs": args.max_num_seqs,
            "sched_overrides": _overrides(args.sched), "kv_gb": args.kv_gb,
            "prefill_max_tokens": args.prefill_max_tokens, "policies": policies, "loads": plan.loads,
            "seeds": plan.seeds, "num_requests_per_point": n_req, "num_requests_fixed": plan.n_fixed,
            "budget_min": plan.budget_s / 60.0, "arrival": args.arrival, "gamma_shape": base.gamma_shape,
            "mix": dict(zip(tiers, mix)), "hint": args.hint, "warmup_frac": args.warmup_frac,
            "strict_batch": args.strict_batch, "loose_batch": args.loose_batch, "tpot_headroom": args.tpot_headroom,
            "reprofile": args.reprofile, "refresh_profile": refresh,
            "quick": args.quick, "drain_s": args.drain, "prompt_len": _dist(base.prompt),
            "output_len": _dist(base.output), "engine_start_s": engines.start_s,
            "workload": W.describe(W.generate(replace(base, num_requests=n_req, rate_rps=lam, seed=plan.seeds[0]),
                                              scale.tiers)),
        },
        "predictor": pred_info,
        "profiles_per_load": profiles,
        "tiers": {t.name: {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms} for t in scale.tiers},
        "results": results,
        "acceptance": acc,
        "run": {**info, "wall_s": wall},
    }
    write_json(out_dir / "results.json", doc)
    if args.json:
        write_json(Path(args.json), doc)
    write_csv(out_dir / "results.csv", results, tiers)
    pngs: list[str] = []
    if not args.no_plots:
        try:
            from bench import plots
            pngs = [str(p) for p in plots.make_all(doc, out_dir, records_path=rec_path)]
        except Exception as e:  # noqa: BLE001 - plots must never lose the numbers
            log.warning("plotting failed: %r", e)
            print(f"plotting failed: {e!r}", file=sys.stderr)
    print(f"\nwrote {out_dir}/results.json, results.csv, records.jsonl" + (f", {len(pngs)} PNGs" if pngs else "")
          + (f" and {args.json}" if args.json else "") + f"  (wall {wall:.0f} s)", flush=True)
    return 0


def _refreshed(pred: Any, scale: W.SLOScale) -> dict[str, Any]:
    """A load point's fresh fit against the one that set the tiers: d4/d12 at the same L̄, and their ratio."""
    d4, d12 = float(pred.itl_ms(4, scale.l_bar)), float(pred.itl_ms(12, scale.l_bar))
    ratio = d12 / scale.d12_ms if scale.d12_ms else math.nan
    return {"d4_ms": d4, "d12_ms": d12, "d12_over_tiers": ratio, "decode_coef": list(pred.decode_coef),
            "prefill_coef": list(pred.prefill_coef),
            "summary": f"d4 {d4:.2f} ms, d12 {d12:.2f} ms ({ratio:.2f}x the tiers' profile)"}


def _dist(d: W.LengthDist) -> dict[str, Any]:
    return {"median": d.median, "sigma": d.sigma, "cap": d.cap, "min": d.min_len}


if __name__ == "__main__":
    raise SystemExit(main())
