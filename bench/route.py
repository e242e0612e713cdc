"""Routing across replicas over HTTP, back to back: the served replicas' FCFS capacity, then kairos under each router.

    python -m bench.route [--serve "model=kairos-tiny dtype=float32 num_replicas=2 num_gpus=0 num_threads=1"]
                          [--routers slo,pow2] [--loads 1,1.5] [--seeds 0,1,2] [--num-requests 242]
                          [--lambda-star RPS] [--predictor-json TIERS] [--dataset-path SHAREGPT_JSON]
                          [--out DIR] [--summary NAME]
    python -m bench.route --tally DIR     # the arms an earlier run left in DIR, tabulated again (nothing served)

1. Unless `--lambda-star` is given: `serve run deployments:app SERVE policy=fcfs`, and `bench.slo --target` finds
   lambda* (FCFS's completion rate under overload over HTTP, all replicas together) and fixes the SLO tiers
   (`--predictor-json`, else a profile of one engine on this machine), saved as DIR/fcfs/tiers-profile.json.
2. For each arm R (a router, optionally with app arguments of its own: `slo+reroute_rejected=1`): a fresh `serve run
   deployments:app SERVE policy=kairos ignore_eos_length=false router=R` (`router=slo reroute_rejected=1`), then
   `bench.slo --target` at every load x seed on those tiers and that lambda*.
Prints goodput, adherence, per-tier adherence and counts, rejections by reason, TPOT misses and how the requests,
output tokens and tiers split over the replicas (`x-kairos-replica`), per router and load. Each server is fresh and
stopped before the next. Never run beside another benchmark.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.driver import served
from bench.report import command_line, write_summary

MODULE = "bench.route"
DEFAULT_SERVE = "model=kairos-tiny dtype=float32 num_replicas=2 num_gpus=0 num_threads=1"


def _slo(target: str, out: Path, log: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.slo", "--target", target, "--dataset", "sharegpt", "--budget-min", "0",
           "--no-progress", "--no-plots", "--out", str(out), *extra]
    with open(log, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    return json.loads((out / "results.json").read_text())


def _row(router: str, res: dict, records: list[dict] | None = None) -> dict:
    """One router x load: the figures of bench.slo's results, summed over seeds where they are counts; with that
    load's lines of records.jsonl, also how many requests of each tier each replica answered (warm-up excluded)."""
    tiers = res["per_tier"]
    split = {rid: (v["requests"], v["output_tokens"]) for rid, v in sorted(res.get("per_replica", {}).items())}
    replica_tiers: dict[str, dict[str, int]] = {}
    for r in records or []:
        if not r["warmup"] and r.get("replica"):
            by = replica_tiers.setdefault(r["replica"], {})
            by[r["tier"]] = by.get(r["tier"], 0) + 1
    return {
        "router": router, "load": res["load_multiple"], "rate_rps": round(res["rate_rps"], 3), "n": res["n"],
        "goodput_rps": round(res.get("goodput_rps_mean", res["goodput_rps"]), 3),
        "adherence": round(res.get("adherence_mean", res["adherence"]), 4),
        "per_tier_adherence": {t: round(v["adherence"], 4) for t, v in tiers.items()},
        "per_tier_good": {t: v["good"] for t, v in tiers.items()},
        "per_tier_ttft_misses": {t: v["ttft_violations"] for t, v in tiers.items()},
        "rejection_rate": round(res["rejection_rate"], 4), "reject_reasons": res.get("reject_reasons", {}),
        "ttft_misses": res["ttft_violations"], "tpot_misses": res["tpot_violations"],
        "tok_s": round(res["token_throughput"], 1), "replica_split": split,
        "replica_tiers": dict(sorted(replica_tiers.items())), "per_seed": res.get("per_seed", []),
    }


def _rows(router: str, arm_out: Path) -> list[dict]:
    """The rows of one arm's finished bench.slo run (its --out directory), one per load."""
    results = json.loads((arm_out / "results.json").read_text())["results"]
    recs_path = arm_out / "records.jsonl"
    records = [json.loads(line) for line in recs_path.open()] if recs_path.exists() else []
    return [_row(router, res, [r for r in records if r["load_multiple"] == res["load_multiple"]])
            for res in results]


def _print(rows: list[dict]) -> None:
    tiers = list(rows[0]["per_tier_adherence"]) if rows else []
    print(f"{'router':8} {'load':>5} {'goodput':>8} {'adher.':>7}  {' / '.join(tiers):30} {'rej.':>6} "
          f"{'TTFT/TPOT miss':>14} {'tok/s':>7}  replica split (req / tok)")
    for r in rows:
        per = " / ".join(f"{100 * r['per_tier_adherence'][t]:.1f}" for t in tiers)
        split = ", ".join(f"{q} / {t / 1000:.1f}k" for q, t in r["replica_split"].values())
        print(f"{r['router']:8} {r['load']:>5g} {r['goodput_rps']:>8.3f} {100 * r['adherence']:>6.1f}%  {per:30} "
              f"{100 * r['rejection_rate']:>5.1f}% {r['ttft_misses']:>6} / {r['tpot_misses']:<6} {r['tok_s']:>7.0f}  "
              f"{split}")
        good = ", ".join(f"{t} {r['per_tier_good'][t]} (TTFT misses {r['per_tier_ttft_misses'][t]})" for t in tiers)
        print(f"    within SLO: {good}; rejected: {r['reject_reasons']}")
        for rid, by in r["replica_tiers"].items():
            print(f"    replica {rid}: " + ", ".join(f"{t} {by.get(t, 0)}" for t in tiers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", default=DEFAULT_SERVE, help=f"serve run arguments of every server (default: "
                   f"{DEFAULT_SERVE!r}); policy and router are added per arm")
    p.add_argument("--routers", default="slo,pow2", help="comma list of arms, run in this order: router= values, each "
                   "optionally with app arguments of its own after '+' (slo+reroute_rejected=1)")
    p.add_argument("--loads", default="1,1.5", help="multiples of lambda*")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--num-requests", type=int, default=242)
    p.add_argument("--lambda-star", type=float, default=None, help="skip the FCFS capacity probe")
    p.add_argument("--predictor-json", default=None, help="the SLO tiers of an earlier run (tiers-profile.json)")
    p.add_argument("--dataset-path", default=None, help="bench.slo --dataset-path (default: the packaged ShareGPT)")
    p.add_argument("--model", default=None, help="bench.slo --model (tokenizer of the ShareGPT prompts; default: "
                   "the model= of --serve, else kairos-tiny)")
    p.add_argument("--out", default="bench/out/route")
    p.add_argument("--summary", help="keep the figures as bench/summaries/NAME.json")
    p.add_argument("--tally", metavar="DIR", help="serve nothing: tabulate the arms an earlier run left in DIR (its "
                   "--out; each arm's bench.slo directory), e.g. one cut off by a time limit")
    args = p.parse_args(argv)
    if args.tally:
        rows = [row for arm in sorted(d for d in Path(args.tally).iterdir() if (d / "results.json").exists())
                for row in _rows(arm.name, arm)]
        _print(sorted(rows, key=lambda r: (r["load"], r["router"])))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or next((t.split("=", 1)[1] for t in args.serve.split() if t.startswith("model=")),
                               "kairos-tiny")
    common = ["--model", model] + (["--dataset-path", args.dataset_path] if args.dataset_path else [])
    tiers = args.predictor_json
    lam = args.lambda_star
    if lam is None:
        with served(f"{args.serve} policy=fcfs", out / "serve-fcfs.log") as target:
            res = _slo(target, out / "fcfs", out / "fcfs.log",
                       common + ["--loads", "1", "--num-requests", "20", "--probe-requests", "160", "--label", "fcfs"]
                       + (["--predictor-json", tiers] if tiers else []))
        lam = float(res["lambda_star_rps"])
        tiers = tiers or str(out / "fcfs" / "tiers-profile.json")
        print(f"lambda* = {lam:.3f} req/s (FCFS over HTTP, {args.serve})", flush=True)
    rows: list[dict] = []
    doc = {"lambda_star_rps": lam, "serve": args.serve, "seeds": args.seeds, "rows": rows}
    for router in [r.strip() for r in args.routers.split(",") if r.strip()]:
        arm_args = " ".join(["router=" + router.split("+")[0], *router.split("+")[1:]])
        # bench.slo forces its replies' lengths with ignore_eos behind a cap, which a server reads as "the reply is
        # max_tokens long" unless told otherwise (ignore_eos_length; bench/README "Goodput under heterogeneous SLOs")
        with served(f"{args.serve} policy=kairos ignore_eos_length=false {arm_args}",
                    out / f"serve-{router}.log") as target:
            _slo(target, out / router, out / f"{router}.log",
                 common + ["--lambda-star", f"{lam}", "--loads", args.loads, "--seeds", args.seeds,
                           "--num-requests", str(args.num_requests), "--policies", "kairos",
                           "--label", f"kairos-router={router}"]
                 + (["--predictor-json", tiers] if tiers else []))
        rows += _rows(router, out / router)
        _print([r for r in rows if r["router"] == router])
        (out / "route.json").write_text(json.dumps(doc, indent=1))  # after each router: a cut-off run keeps its arms
    print(f"\nlambda* = {lam:.3f} req/s; {args.serve}; seeds {args.seeds}, {args.num_requests} requests a point")
    _print(sorted(rows, key=lambda r: (r["load"], r["router"])))
    if args.summary:
        by = {(r["router"], r["load"]): r for r in rows}
        parts = []
        for load in sorted({r["load"] for r in rows}):
            b = by.get(("pow2", load))
            for name in sorted({r["router"] for r in rows} - {"pow2"}):
                a = by.get((name, load))
                if a and b and b["goodput_rps"] > 0:
                    parts.append(f"{load:g}x: {name} {a['goodput_rps']:.2f} vs pow2 {b['goodput_rps']:.2f} req/s "
                                 f"({a['goodput_rps'] / b['goodput_rps']:.2f}x), adherence "
                                 f"{100 * a['adherence']:.1f} vs {100 * b['adherence']:.1f}%")
        headline = f"{args.serve} over HTTP, ShareGPT, seeds {args.seeds}, lambda* {lam:.2f}: " + "; ".join(parts)
        print(f"summary: {write_summary(args.summary, command_line(MODULE, argv), headline, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
