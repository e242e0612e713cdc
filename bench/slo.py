"""Heterogeneous-SLO goodput benchmark: policies × loads, open-loop, after scorpio.md §2/§4.

    python -m bench.slo --quick                         # <=3 min smoke: 3 policies at 1.5 x lambda*, short requests
    python -m bench.slo                                 # full default sweep (all 7 policies x 6 loads, <= 30 min)
    python -m bench.slo --num-requests 400 --seeds 0,1,2   # the protocol's full size (hours on a 2-core box)
    python -m bench.slo --target http://127.0.0.1:8000  # drive a running server (its own policy) over HTTP

What one run does:
1. Starts one engine per policy (the policy is fixed at construction; all stay alive), FCFS first. Engine start
   profiles the model once (cached JSON under ~/.cache/kairos/profiles, or --reprofile). The FIRST engine's
   fitted predictor sets the SLO tiers (u = 2·Prefill(budget), d4, d12 at L̄) for every policy; they stay fixed.
   In engine mode (unless --predictor-json) the schedulers' model follows the machine: one FCFS run at lambda*
   calibrates the probe fit to served steps (--calibrate), and before every (policy, seed) run the engine
   re-times its model and gets that fit times the calibration (--refresh-profile): this VM's speed drifts by up
   to ~35% within a minute, and a stale or probe-only fit would misjudge every TPOT the static gates (scorpio,
   tpot_guard) admit (bench/slo_calibrate.py).
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
4. Writes results.json, results.csv, records.jsonl (one line per request), tiers-profile.json (the fit that set
   the tiers: --predictor-json it to rerun on them) and the PNGs into --out, prints a
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

import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import slo_metrics as M  # noqa: E402
from bench import workload as W  # noqa: E402
from bench.common import fmt, loadavg, run_info, write_json  # noqa: E402

from bench.slo_report import (_records_lines, acceptance, compare, format_acceptance, hops_table,  # noqa: E402,F401
                              load_table, protocol_lambda_90, write_csv)
from bench.slo_cli import ALL_POLICIES, Plan, _plan  # noqa: E402,F401
from bench.slo_cli import build_parser as _build_parser  # noqa: E402
from bench.slo_calibrate import PROFILE_BUDGET_S, calibrate, fresh_fit  # noqa: E402
from bench.slo_points import (_dist, _drain_for, _Engines, _overrides, _predictor_info,  # noqa: E402
                              _summarize_point, policy_spec)
from bench.slo_run import PointRun, run_engine_point, run_http_point, served_model  # noqa: E402,F401
from bench.slo_search import (TARGET_ADHERENCE, capacity_guess, completion_rate, find_capacity,  # noqa: E402,F401
                              find_lambda_star)

log = logging.getLogger("kairos.bench.slo")


def build_parser():
    """bench.slo's flags (bench/slo_cli.py), with this module's docstring as the --help text."""
    return _build_parser(__doc__)

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
        if args.predictor_json:  # the tiers of that run, even where the engine had to re-profile (older format)
            from scheduling.predictor import LatencyModel
            predictor = LatencyModel.load(args.predictor_json)
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
    predictor.save(out_dir / "tiers-profile.json")  # --predictor-json this to rerun on the same tiers
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
    calibrating = refresh and args.calibrate is not False  # it scales the refreshed fits: nothing to scale without
    n_runs = len(order) * len(rates) * len(plan.seeds)
    starts = 0.0 if http else (max(engines.start_s.values()) * (len(order) - 1)
                               + (n_runs * PROFILE_BUDGET_S * 0.6 if refresh else 0.0))
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

    # ---- calibration: served steps against the probe fit (FCFS at lambda*)
    calib = None
    d_ref = lambda m: (m.itl_ms(4, scale.l_bar), m.itl_ms(12, scale.l_bar))  # noqa: E731
    live: dict[str, Any] = {} if http else {order[0]: eng}
    if calibrating:
        live.setdefault("fcfs", eng if order[0] == "fcfs" else engines.start("fcfs"))
        n_cal = args.probe_requests or (200 if args.quick else 240)
        items = W.generate(replace(base, num_requests=n_cal, rate_rps=lam, seed=plan.seeds[0]), scale.tiers)
        calib = calibrate(live["fcfs"], lambda e: run_items(items, "calibration", "cal", e).engine["tap"])
        print(f"calibration (FCFS at lambda*, n={n_cal}): a served decode step takes {calib['decode']:.2f}x the "
              f"probe fit (median of {calib['n_decode_steps']} steps), a prefill step {calib['prefill']:.2f}x "
              f"({calib['n_prefill_steps']}); the static policies' refreshed fits are scaled by these", flush=True)

    # ---- sweep: load-major, every policy's engine kept alive, so that a drift in machine speed during the
    # run hits all policies of a load alike instead of whichever policy happened to run last
    results: list[dict[str, Any]] = []
    rec_path = out_dir / "records.jsonl"
    rec_path.write_text("")
    profiles: list[dict[str, Any]] = []
    for load, rate in zip(plan.loads, rates):
        for policy in order:
            if policy not in policies:
                continue
            if not http and policy not in live:
                live[policy] = engines.start(policy)
            e = live.get(policy)
            runs = []
            fits = []
            for seed in plan.seeds:
                if refresh:  # the model as of now, calibrated to served steps
                    fits.append(fresh_fit(e, calib, d_ref, scale.d12_ms))
                    profiles.append({"policy": policy, "load": load, "seed": seed, **fits[-1]})
                items = W.generate(replace(base, num_requests=n_req, rate_rps=rate, seed=seed), scale.tiers)
                run = run_items(items, f"{policy} {load:g}x seed {seed}", f"{policy}-{load:g}-{seed}", e)
                runs.append((seed, run))
                with open(rec_path, "a") as f:
                    f.write("\n".join(_records_lines(policy, load, seed, run, args.warmup_frac)) + "\n")
            r = _summarize_point(policy, load, rate, runs, args.warmup_frac, tiers)
            if e is not None:  # the scheduler's model at the end of the point
                pe = e.scheduler.predictor
                r["predictor"] = {"decode_coef_end": list(pe.decode_coef) if pe is not None else None,
                                  "prefill_coef_end": list(pe.prefill_coef) if pe is not None else None}
            results.append(r)
            speed = sum(f["d12_over_tiers"] for f in fits) / len(fits) if fits else None
            print(f"  {policy:<11} {load:>4g}x {rate:6.3f} rps: goodput {r['goodput_rps']:.3f} rps, adherence "
                  f"{100 * r['adherence']:5.1f}%, rejected {r['rejected']}, TTFT/TPOT viol "
                  f"{r['ttft_violations']}/{r['tpot_violations']}, timeouts {r['timeouts']}"
                  + (f", prefill-only steps {fmt(r.get('prefill_only_pct'))}% of engine time, decode step / model "
                     f"{fmt(r.get('decode_wall_over_model_p50'), 2)}" if not http else "")
                  + (f", fit {speed:.2f}x the tiers'" if speed is not None else "") + "  "
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
            "reprofile": args.reprofile, "refresh_profile": refresh, "calibrate": calibrating,
            "quick": args.quick, "drain_s": args.drain, "prompt_len": _dist(base.prompt),
            "output_len": _dist(base.output), "engine_start_s": engines.start_s,
            "workload": W.describe(W.generate(replace(base, num_requests=n_req, rate_rps=lam, seed=plan.seeds[0]),
                                              scale.tiers)),
        },
        "predictor": pred_info,
        "calibration": calib,
        "profiles_per_run": profiles,
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


if __name__ == "__main__":
    raise SystemExit(main())
