"""bench.slo's command line: the flags and the run plan they make (policies, loads, seeds, sizes, budget)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench import workload as W
from bench.slo_points import policy_spec

ALL_POLICIES = ("fcfs", "pack", "edf", "edf_reject", "tpot_guard", "scorpio", "kairos")
QUICK_POLICIES = ("fcfs", "scorpio", "kairos")
DEFAULT_LOADS = "0.5,0.75,1,1.25,1.5,2"
QUICK_LOADS = "1.5"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.replace(" ", "").split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


# --------------------------------------------------------------------------- the benchmark

def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The flags; `description` is bench.slo's module docstring (its --help text)."""
    ap = argparse.ArgumentParser(prog="python -m bench.slo", description=description,
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
                    help="before every (policy, seed) run, the engine re-times its model (~2 s) and its scheduler "
                         "gets that fit (times the calibration); the SLO tiers stay those of the first profile. "
                         "Default: on in engine mode unless --predictor-json is given (this VM's speed drifts by up "
                         "to ~35%% within a minute, which an earlier profile cannot see)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                    help="one FCFS run at lambda* before the sweep measures served steps against the probe fit "
                         "(median ratio, decode and prefill); the refreshed fits of the policies without the online "
                         "ITL correction are scaled by it, as SCORPIO fits its model on served steps "
                         "(bench/slo_calibrate.py). Default: on with --refresh-profile, which it needs")
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
