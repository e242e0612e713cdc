"""SCORPIO's experiment on one GPU replica, end to end over Ray Serve (bench/device/slo_gpu.sh runs it; see there).

1. Writes the config of a Llama of `--shape` (llama-8b: Llama-3.1-8B's config; no download) under --model-dir, with
   kairos-tiny's tokenizer (the length predictor's tokens; ShareGPT's reply lengths are counted in them); the
   servers build its random bf16 weights on the device (`load_format=dummy`), none written or read.
2. `serve run` of the app `deployments:app model=DIR device=... predictor_path=P` from a Serve config whose LLM
   deployment's user_config is {policy: fcfs}: the replica profiles itself at start and keeps the fit in P.
   `bench.slo --target --predictor-json P --probe-only` derives the three TPOT tiers and the TTFT SLO from that fit
   (as bench.slo does in-process on the CPU; by default at the seats and twice that, --strict-batch /
   --loose-batch) and finds lambda* over HTTP (by default FCFS's capacity, its completion rate under overload;
   --lambda-def). The points' requests are then sized to the time left (`size_points`, --num-requests down to
   --min-requests).
3. The arms (`arm_plan`), each a bench.slo run over the seeds at lambda* and those tiers: every policy (fcfs,
   scorpio, kairos; after fcfs with `length_predictor=true`) at the highest load first, then the lower loads of
   --all-loads (kairos, fcfs), then kairos with `--lengths exact` at the highest load (the bound); the predicted arm
   (`--lengths predicted`) otherwise. One server runs them all: a policy's knobs go to the running replica as its
   LLM deployment's user_config (the config deployed again with only that changed; `LLMReplica.reconfigure` swaps
   the engine's scheduler once it is idle, over the same model, KV cache, CUDA graphs and fit), so no server starts
   or stops between arms (--no-one-server: a fresh server per policy, as the first leases ran).
4. One summary JSON (--summary-out): every point's goodput, adherence, per-tier adherence, TPOT met among the
   admitted, the shortest-first oracle (bench.bound) over the predicted arm, and the issue's acceptance checks.
   It is rewritten after every phase, so a run cut off by its time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def log(msg: str) -> None:
    print(f"[slo_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(shape: str, out: Path, dtype: str, device: str, window: int, *, weights: bool = True) -> Path:
    """A random Llama of `shape` (bench.engine's shapes) with kairos-tiny's tokenizer, saved once per shape/dtype.
    Without `weights`, its config.json and tokenizer alone, for an engine with `load_format=dummy`, which builds the
    same random weights on its device (the same seed and initialisation) instead of reading gigabytes of them."""
    if (out / "config.json").is_file() and (not weights or any(out.glob("*.safetensors"))):
        return out
    import torch
    from transformers import AutoTokenizer

    from bench.engine import build_shape_model, shape_config
    from engine.default_model import ensure_default_model

    src = ensure_default_model("kairos-tiny")
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = shape_config(shape, len(AutoTokenizer.from_pretrained(src)), window)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, k, src_cfg.get(k, 0))
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if weights:
        model = build_shape_model(cfg, torch.device(device), getattr(torch, dtype))
        model.save_pretrained(tmp, max_shard_size="5GB")
        del model
    else:
        cfg.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"built {shape} ({dtype}, on {device}{'' if weights else ', its config alone'}) in "
        f"{time.perf_counter() - t0:.0f} s -> {out}")
    return out


class Clock:
    def __init__(self, limit_s: float) -> None:
        self.t0, self.limit_s = time.monotonic(), limit_s

    def left(self) -> float:
        return self.limit_s - (time.monotonic() - self.t0)


def run_slo(target: str, out: Path, args: argparse.Namespace, clock: Clock, extra: list[str]) -> dict | None:
    """`bench.slo --target` into `out` (its log beside it); None when it failed or ran out of time."""
    cmd = [sys.executable, "-m", "bench.slo", "--target", target, "--dataset", "sharegpt", "--budget-min", "0",
           "--no-progress", "--no-plots", "--model", str(args.model_dir), "--prefill-max-tokens",
           str(args.prefill_max_tokens), "--strict-batch", str(args.strict_batch), "--loose-batch",
           str(args.loose_batch), "--out", str(out), *(["--dataset-path", args.dataset_path] if args.dataset_path
                                                      else []),
           *(["--client-procs", str(args.client_procs)] if args.client_procs is not None else []), *extra]
    left = clock.left() - 20.0
    if left < 30.0:
        log(f"out of time before {out.name}")
        return None
    log(" ".join(cmd[2:]))
    log_path = out.with_name(out.name + ".log")  # (not with_suffix: "fcfs-predicted-1.5x" has ".5x" for one)
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            log(f"{out.name}: cut off by the time limit")
            return None
    if rc != 0 or not (out / "results.json").is_file():
        log(f"{out.name}: bench.slo exit {rc}; see {log_path}")
        return None
    return json.loads((out / "results.json").read_text())


def expected_s(phases: dict[str, float], points: int, margin_s: float = 20.0,
               start_s: float | None = None, arrivals_s: float = 0.0) -> float | None:
    """How long an arm of `points` points (a seed each, its arrivals lasting `arrivals_s`) will take, from the phases
    of the arms that ran before it (this call's or a resumed one's): its start (`start_s`: the server up runs it as
    it is, or takes it in place; else the longest start so far), and the time per point of the last that ran any,
    less its lambda* probes and its own arrivals (`ARM_arrivals_s`: a point at a lower load lasts longer); None
    before any ran."""
    starts = [start_s] if start_s is not None else [v for k, v in phases.items() if k.endswith("_start_s")]
    per_point = None
    for k, n in phases.items():  # in the order they ran: the last one's rate stands
        name = k.removesuffix("_points")
        if k.endswith("_points") and n > 0 and f"{name}_s" in phases and f"{name}_start_s" in phases:
            per_point = ((phases[f"{name}_s"] - phases[f"{name}_start_s"] - phases.get(f"{name}_probe_s", 0.0)) / n
                         - phases.get(f"{name}_arrivals_s", 0.0))
    if per_point is None or not starts:
        return None
    return max(starts) + points * (per_point + arrivals_s) + margin_s


def size_points(left_s: float, lam: float, point_loads: list[float], runs: int, *, cap: int, floor: int,
                point_overhead_s: float, run_overhead_s: float, margin_s: float = 20.0) -> int:
    """Requests per point such that the points at `point_loads` (x lambda*, one entry a seed at a load) of `runs`
    bench.slo runs take `left_s`: a point's arrivals last N / (load x lambda*), then its drain and the client's start
    (`point_overhead_s`); a run starts bench.slo (tokenizer, ShareGPT) and may swap the replica's policy
    (`run_overhead_s`). Within [floor, cap]: under the floor a point holds too few requests for FCFS's queue to
    build past lambda* (what does not fit is left to a resumed call)."""
    per_request = sum(1.0 / (m * lam) for m in point_loads if m > 0 and lam > 0)
    spare = left_s - margin_s - runs * run_overhead_s - len(point_loads) * point_overhead_s
    if per_request <= 0:
        return cap
    return max(floor, min(cap, int(spare / per_request)))


def records(out: Path) -> list[dict]:
    p = out / "records.jsonl"
    return [json.loads(line) for line in p.open() if line.strip()] if p.is_file() else []


def point_row(policy: str, arm: str, res: dict, recs: list[dict]) -> dict:
    """One policy x arm x load: bench.slo's figures, and TPOT met among the admitted (warm-up excluded)."""
    mine = [r for r in recs if r["load_multiple"] == res["load_multiple"] and not r["warmup"]]
    admitted = [r for r in mine if not r["rejected"] and (r.get("n_out") or 0) >= 2 and r.get("tpot_ms") is not None]
    met = sum(r["tpot_ms"] <= r["tpot_slo_ms"] for r in admitted)
    return {"policy": policy, "lengths": arm, "load": res["load_multiple"], "rate_rps": res["rate_rps"],
            "goodput_rps": res["goodput_rps"], "adherence": res["adherence"], "n": res["n"],
            "per_seed": res.get("per_seed", []),
            "per_tier_adherence": {t: v.get("adherence") for t, v in res.get("per_tier", {}).items()},
            "rejection_rate": res["rejection_rate"], "ttft_violations": res["ttft_violations"],
            "tpot_violations": res["tpot_violations"], "admitted_with_tpot": len(admitted),
            "tpot_met_admitted": met / len(admitted) if admitted else None,
            "ttft_p50_ms": res.get("ttft_p50_ms"), "ttft_p99_ms": res.get("ttft_p99_ms"),
            "tpot_p99_ms": res.get("tpot_p99_ms"), "token_throughput": res.get("token_throughput"),
            # where the time to first token went, hop by hop (Server-Timing and the engine's own TTFT): the client's
            # TTFT beside the engine's tells what the HTTP path adds under this load
            "http_hops_ms": {hop: {k: d[k] for k in ("p50", "p90", "p99", "max") if k in d}
                             for hop, d in (res.get("http_hops_ms") or {}).items()}}


def arm_knobs(label: str) -> dict[str, str]:
    """The scheduler knobs of a policy label's server: its policy; after fcfs the length predictor on (the predicted
    arm's) and the label's knobs (kairos+credit_batching=false: credit_batching=false). Its rows keep the label."""
    name, *knobs = label.split("+")
    if name == "fcfs" and not knobs:
        return {"policy": "fcfs"}
    return {"policy": name, "length_predictor": "true", **dict(k.split("=", 1) for k in knobs)}


def arm_plan(labels: list[str], loads: list[float], all_loads: list[str], exact: list[str]
             ) -> list[tuple[str, str, float]]:
    """The run's arms (label, lengths, load), each one bench.slo run over the seeds, in the order they run: every
    label at the highest load first (the issue's main checks), then the lower loads for `all_loads` (highest
    first, the last label at a load first at the next, one swap fewer), then the exact arms of `exact` (the bound)."""
    hi = max(loads)
    plan = [(label, "predicted", hi) for label in labels]
    at = list(labels)
    for load in sorted(set(loads), reverse=True)[1:]:
        at = [x for x in reversed(at) if x in all_loads]
        plan += [(label, "predicted", load) for label in at]
    return plan + [(label, "exact", hi) for label in labels if label in exact]


def arms_done(rows: list[dict]) -> set[tuple[str, str, float]]:
    """The arms (label, lengths, load) that `rows` measured."""
    return {(r["policy"], r["lengths"], r["load"]) for r in rows}


def arm_key(label: str, lengths: str, load: float) -> str:
    """An arm's name in the summary's phases and servers: kairos@1.5x, kairos-exact@1.5x."""
    return f"{label}{'' if lengths == 'predicted' else '-' + lengths}@{load:g}x"


def arm_dir(label: str, lengths: str, load: float) -> str:
    """An arm's bench.slo --out folder (under --out)."""
    return f"{label}-{lengths}-{load:g}x"


def app_args(knobs: dict[str, str]) -> str:
    """Knobs as `serve run deployments:app` arguments."""
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def arm_server_args(label: str) -> str:
    """`arm_knobs` as app arguments."""
    return app_args(arm_knobs(label))


def from_disk(args: argparse.Namespace, common: str) -> str:
    """The first leases' way to serve, for a run whose dummy-weight servers from a Serve config did not come up: the
    weights written to disk, a server per policy from its app arguments (`common` without load_format=dummy)."""
    build_model(args.shape, args.model_dir, args.dtype, args.device, args.window, weights=True)
    args.one_server = False
    return common.replace(" load_format=dummy", "")


def in_place(knobs: dict[str, str]) -> bool:
    """Whether a running server takes these knobs in place (its LLM deployment's user_config: scheduler knobs only;
    `LLMReplica.reconfigure`), instead of a server of its own."""
    from engine.config import FIXED_SCHEDULER_KNOBS
    from scheduling.config import SchedulerConfig

    return all(k in SchedulerConfig.model_fields and k not in FIXED_SCHEDULER_KNOBS for k in knobs)


def steps_between(now: dict | None, before: dict | None) -> dict | None:
    """A server's decode step / model by decode rows ({rows: {"steps", "mean"}}, since its start) over the steps
    between two readings: one policy's, on a server that ran others before it."""
    if not now or not before:
        return now
    out = {}
    for rows, d in now.items():
        b = before.get(rows, {"steps": 0, "mean": 0.0})
        n = d["steps"] - b["steps"]
        if n > 0:
            out[rows] = {"steps": n, "mean": round((d["steps"] * d["mean"] - b["steps"] * b["mean"]) / n, 4)}
    return out or None


def acceptance(rows: list[dict], oracle: list[dict], loads: list[float]) -> dict[str, Any]:
    """The issue's checks, where the rows allow them (None: not measured)."""
    by = {(r["policy"], r["lengths"], r["load"]): r for r in rows}
    hi, lo = max(loads), min(loads)
    f, s, k = (by.get((p, "predicted", hi)) for p in ("fcfs", "scorpio", "kairos"))
    out: dict[str, Any] = {"load_high": hi, "load_low": lo}
    if f and s:
        out["scorpio_over_fcfs_goodput"] = s["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else None
    if s and k:
        out["kairos_over_scorpio_goodput"] = k["goodput_rps"] / s["goodput_rps"] if s["goodput_rps"] else None
        sp = {x["seed"]: x["goodput_rps"] for x in s["per_seed"]}
        out["kairos_over_scorpio_per_seed"] = {x["seed"]: (x["goodput_rps"] / sp[x["seed"]] if sp.get(x["seed"])
                                                           else None) for x in k["per_seed"] if x["seed"] in sp}
        per = [x for x in out["kairos_over_scorpio_per_seed"].values() if x is not None]
        out["kairos_over_scorpio_min_seed"] = min(per) if per else None
    if k:
        out["kairos_tpot_met_admitted"] = k["tpot_met_admitted"]
        out["kairos_min_tier_adherence"] = min((v for v in k["per_tier_adherence"].values() if v is not None),
                                               default=None)  # (a tier no request of the run fell in: none)
        good = sum(o["policies"].get("kairos", {}).get("good", 0) for o in oracle if o["load_multiple"] == hi)
        # (against one bound for every policy, the most any policy's decode work completes shortest first: its own
        # shrank with what it turned away)
        orc = sum(o.get("oracle_best_own_tokens", 0) for o in oracle if o["load_multiple"] == hi)
        out["kairos_over_oracle_own_tokens"] = good / orc if orc else None
    e = by.get(("kairos", "exact", hi))
    if k and e:
        out["kairos_predicted_over_exact_goodput"] = k["goodput_rps"] / e["goodput_rps"] if e["goodput_rps"] else None
    # (the low load's checks only where a lower load ran: with one load they were the high load's, misread as 1x)
    f1, k1 = (by.get(("fcfs", "predicted", lo)), by.get(("kairos", "predicted", lo))) if lo < hi else (None, None)
    if k1:
        out["kairos_adherence_low_load"] = k1["adherence"]
    if f1 and k1:
        out["kairos_goodput_ge_fcfs_low_load"] = k1["goodput_rps"] >= f1["goodput_rps"]
    checks = {"scorpio_2x_fcfs": ("scorpio_over_fcfs_goodput", 2.0), "kairos_1.15x_scorpio_each_seed":
              ("kairos_over_scorpio_min_seed", 1.15), "kairos_tpot_99": ("kairos_tpot_met_admitted", 0.99),
              "kairos_every_tier_25": ("kairos_min_tier_adherence", 0.25),
              "kairos_90pct_oracle": ("kairos_over_oracle_own_tokens", 0.9),
              "kairos_low_load_adherence_95": ("kairos_adherence_low_load", 0.95)}
    out["checks"] = {name: (None if out.get(key) is None else out[key] >= th) for name, (key, th) in checks.items()}
    out["checks"]["kairos_low_load_goodput_ge_fcfs"] = out.get("kairos_goodput_ge_fcfs_low_load")
    if f and s:  # FCFS may serve nothing within SLO: compare the goodputs, not their ratio
        out["checks"]["scorpio_2x_fcfs"] = s["goodput_rps"] >= 2.0 * f["goodput_rps"] and s["goodput_rps"] > 0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b", choices=("llama-8b", "llama-1b", "tiny"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--window", type=int, default=4096, help="max_position_embeddings of the built model")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the model is built (default /tmp/kairos-SHAPE)")
    ap.add_argument("--serve", default="", help="more app arguments of every server (e.g. num_threads=1)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prefill-max-tokens", type=int, default=2048)
    ap.add_argument("--strict-batch", type=float, default=256, help="bench.slo --strict-batch (T_strict at this "
                    "batch: by default the seats, so that a full batch meets every tier, as in SCORPIO's evaluation)")
    ap.add_argument("--loose-batch", type=float, default=512, help="bench.slo --loose-batch")
    ap.add_argument("--keep-server", action="store_true", help="leave the server running (in a process session of "
                    "its own) where arms are left for a resumed call, which then takes it over: no second start "
                    "(a host's tool ends only what runs in the caller's session)")
    ap.add_argument("--one-server", action=argparse.BooleanOptionalAction, default=True, help="one server for "
                    "every policy: the next policy's scheduler knobs go to the running replica in place (its LLM "
                    "deployment's user_config), with no model load or Ray start between policies; --no-one-server: "
                    "a fresh server per policy")
    ap.add_argument("--policies", default="scorpio,kairos", help="after fcfs, one server each, in this order; a "
                    "label's knobs are its server's arguments (kairos+credit_batching=false)")
    ap.add_argument("--resume", action="store_true", help="go on with the run in --out that a time limit cut off (a "
                    "second call on the same host): its model, replica profile (so its tiers), lambda* and finished "
                    "arms are kept; what it had not finished runs")
    ap.add_argument("--loads", default="1,1.5")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--num-requests", type=int, default=1000, help="a point's requests: past lambda*, FCFS's queue "
                    "builds only in a point longer than its seats admit at once")
    ap.add_argument("--min-requests", type=int, default=1000, help="once lambda* is known, a point's requests are "
                    "sized so that every point left fits --limit-s, from --num-requests down to this (past lambda*, "
                    "FCFS's queue builds only in points of a few times the seats, and on the fourth lease's H200 "
                    "profile bench.sim puts scorpio past 2x fcfs only from 1,000 requests a point: bench/README, "
                    "\"SLO serving on a GPU replica\")")
    ap.add_argument("--point-overhead-s", type=float, default=15.0, help="the sizing's time per point besides its "
                    "arrivals: the drain after the last one, the client's start")
    ap.add_argument("--run-overhead-s", type=float, default=20.0, help="the sizing's time per bench.slo run (an arm: "
                    "a policy at a load): its start (tokenizer, ShareGPT), the replica's policy swapped in place")
    ap.add_argument("--probe-requests", type=int, default=1000)
    ap.add_argument("--lambda-star", type=float, default=None, help="skip the lambda* search")
    ap.add_argument("--lambda-def", choices=("adherence", "capacity"), default="capacity",
                    help="bench.slo --lambda-def: capacity (default), FCFS's completion rate under overload (probes "
                    "of a few hundred requests read it low: they do not fill a batch of max_num_seqs long replies); "
                    "adherence, the reference protocol's highest rate at which FCFS keeps 90%% adherence, which "
                    "with tiers tighter than a full batch's step is bound by the strict tier, not the throughput")
    ap.add_argument("--all-loads", default="fcfs,kairos", help="policies run at every load; the others at the "
                    "highest only (the acceptance compares scorpio at the highest load only)")
    ap.add_argument("--lambda-guess", choices=("b4", "seats"), default="seats", help="bench.slo --lambda-guess")
    ap.add_argument("--lambda-refine", type=int, default=3,
                    help="bench.slo --lambda-refine: probes between the last adherent rate and the first that is not "
                         "(each halves the bracket; with one alone lambda* can land far under FCFS's 90%% rate: "
                         "bench/README.md)")
    ap.add_argument("--exact", default="kairos", help="policies also run with --lengths exact at the highest load")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT JSON (the bundle's .dev/sharegpt-sub.json)")
    ap.add_argument("--client-procs", type=int, default=None, help="bench.slo --client-procs (default: its own, a "
                    "quarter of the cores, 1 to 4)")
    ap.add_argument("--limit-s", type=float, default=540.0, help="the whole run's time limit, start-up included")
    ap.add_argument("--out", type=Path, default=Path("bench/out/slo_gpu"))
    ap.add_argument("--summary-out", type=Path, default=None, help="the summary JSON (default OUT/slo-gpu.json)")
    args = ap.parse_args(argv)
    clock = Clock(args.limit_s)
    from bench.bound import bounds
    from bench.driver import (adopt_served, http_front, lag_between, loop_lag, reconfigure_served,
                              rejected_seats_full, served, server_metrics, stop_host)
    from bench.report import run_info

    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir or Path(f"/tmp/kairos-{args.shape}-{args.dtype}")
    summary_path = args.summary_out or args.out / "slo-gpu.json"
    loads = [float(x) for x in args.loads.split(",") if x]
    profile = args.out / "replica-profile.json"
    kept = args.out / "slo-gpu.json"  # the run's own copy of its summary, which --resume goes on from
    doc: dict[str, Any] = {"benchmark": "slo_gpu", "shape": args.shape, "dtype": args.dtype, "device": args.device,
                           "run": run_info("bench/device/slo_gpu.py", argv), "rows": [], "phases": {}}
    doc["run"]["command"] = shlex.join(["python", "bench/device/slo_gpu.py", *(sys.argv[1:] if argv is None else argv)])
    same = {"shape": args.shape, "dtype": args.dtype, "device": args.device, "loads": args.loads, "seeds": args.seeds,
            "num_requests": args.num_requests, "strict_batch": args.strict_batch, "loose_batch": args.loose_batch,
            "max_num_seqs": args.max_num_seqs, "prefill_max_tokens": args.prefill_max_tokens, "serve": args.serve}
    doc["setup"] = same  # what a resumed run must share with the one it goes on from
    before = None
    if args.resume and kept.is_file() and profile.is_file():
        try:
            before = json.loads(kept.read_text())
        except ValueError:
            log(f"{kept} is unreadable: a fresh run")
        if before is not None and before.get("setup") != same:
            log(f"{kept} is another run's (setup {before.get('setup')}): a fresh run")
            before = None
    if before is not None:
        doc.update({k: before[k] for k in ("rows", "phases", "lambda_star_rps", "lambda_star_search", "tiers",
                                           "num_requests", "decode_over_model_by_rows", "event_loop_lag",
                                           "rejected_seats_full", "servers",
                                           "http_front", "fallback", "kept_server", "server_config")
                    if k in before})
        doc["resumed"] = {"run": before.get("run"), "wall_s": before.get("wall_s")}
        log(f"resuming: {len(doc['rows'])} rows, lambda* {doc.get('lambda_star_rps')}")
    else:
        if args.resume:
            log(f"nothing to resume in {args.out}: a fresh run")
        profile.unlink(missing_ok=True)
    if args.lambda_star is not None:  # a given rate is the run's lambda* (a resumed run reads it from here)
        doc["lambda_star_rps"], doc["lambda_star_search"] = args.lambda_star, {"given": True}
    try:
        import torch

        if args.device.startswith("cuda") and torch.cuda.is_available():
            doc["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the name is cosmetic
        pass

    def save() -> None:  # whole files only: a call cut off mid-write leaves the last one
        doc["wall_s"] = time.monotonic() - clock.t0
        for path in {summary_path, kept}:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=str))
            os.replace(tmp, path)
        beside = summary_path.parent / profile.name  # the replica profile beside the summary (a call cut off before
        if profile.is_file() and beside.resolve() != profile.resolve():  # its archive is written keeps it)
            tmp = beside.with_name(beside.name + ".tmp")
            tmp.write_bytes(profile.read_bytes())
            os.replace(tmp, beside)

    build_model(args.shape, args.model_dir, args.dtype, args.device, args.window, weights=False)
    doc["phases"]["built_s"] = time.monotonic() - clock.t0
    # the client forces every reply's length with ignore_eos and ends a predicted arm's replies itself, before
    # max_tokens: ignore_eos_length=false keeps max_tokens a cap for the servers' schedulers (bench.slo.arm_sched)
    common = (f"model={args.model_dir} load_format=dummy dtype={args.dtype} device={args.device} "
              f"max_num_seqs={args.max_num_seqs} "
              f"max_waiting={2 * args.max_num_seqs} prefill_max_tokens={args.prefill_max_tokens} "
              f"predictor_path={profile.resolve()} ignore_eos_length=false {args.serve}")
    if doc.get("fallback"):  # the call resumed fell back to app arguments and weights on disk: so does this one
        common = from_disk(args, common)
    seed_list = [x for x in args.seeds.split(",") if x]
    plan = arm_plan(["fcfs"] + [p for p in args.policies.split(",") if p], loads,
                    [p for p in args.all_loads.split(",") if p], [p for p in args.exact.split(",") if p])
    done = arms_done(doc["rows"])
    arm_recs = [x for label, lengths, load in plan if lengths == "predicted" and (label, lengths, load) in done
                for x in records(args.out / arm_dir(label, lengths, load))]
    lam = doc.get("lambda_star_rps")  # given, or kept by the run resumed (fcfs's search records it)
    servers = contextlib.ExitStack()  # the server that is up: the next arm takes it in place where it can
    target, steps_before, running = None, None, None  # (running: the label whose knobs the server has)
    lag_before: dict | None = None  # the server's event-loop lag histogram at the end of its last run
    full_before: float | None = None  # and its requests turned away with every seat taken, then

    def lag_since(name: str) -> None:
        """The replica's event-loop lag over run `name` (an arm, or the lambda* probes), and the requests it turned
        away while every seat was taken (`rejected_seats_full`: where many, the seats and not the policy bound its
        batch): one scrape, just after bench.slo's own settled one; a server without the series records nothing."""
        nonlocal lag_before, full_before
        got = server_metrics(target, lambda text: (loop_lag(text), rejected_seats_full(text)), limit_s=0.0) \
            if target is not None else None
        now, full = got if got is not None else (None, None)
        if now:
            doc.setdefault("event_loop_lag", {})[name] = lag_between(now, lag_before)
            lag_before = now
        if full is not None or now:  # a server that exports the lag but has turned none away with its seats taken
            doc.setdefault("rejected_seats_full", {})[name] = int((full or 0.0) - (full_before or 0.0))
            full_before = full or 0.0
    ending = False  # the call's last close of `servers` (not a server replaced mid-run)

    def keep() -> bool:  # at the end of this call: the server up stays for a resumed call, arms being left
        left = set(plan) - arms_done(doc["rows"])
        if not (ending and args.keep_server and left and target is not None and running is not None
                and doc.get("server_config")):
            return False
        doc["kept_server"] = {"target": target, "running": running, "steps": steps_before, "lag": lag_before,
                              "seats_full": full_before,
                              "config": doc["server_config"]}
        log(f"the server at {target} ({running}) is left running for a resumed call")
        return True

    left_up = doc.pop("kept_server", None) if before is not None else None
    if left_up and args.one_server and not doc.get("fallback"):  # a server the resumed call left running
        if adopt_served(left_up["target"], Path(left_up["config"])):
            target, running, steps_before = left_up["target"], left_up["running"], left_up.get("steps")
            lag_before, full_before = left_up.get("lag"), left_up.get("seats_full")
            servers.callback(lambda: None if keep() else stop_host())
            log(f"took over the server the resumed call left at {target} ({running})")
        else:
            log(f"the server the resumed call left at {left_up['target']} does not answer: a fresh one")
    if before is not None and target is None and args.device != "cpu":
        stop_host()  # what an earlier call may have left on the host (a server cut off, or one that does not answer)
    try:
        for label, lengths, load in plan:
            if (label, lengths, load) in done:
                continue
            arm, knobs = arm_key(label, lengths, load), arm_knobs(label)
            if clock.left() < 90:
                log(f"out of time before {arm}")
                break
            # a run cut off keeps nothing: an arm that would not fit is left whole to a resumed call
            taken = target is not None and (running == label or args.one_server and in_place(knobs))
            moved = [v for k, v in doc["phases"].items() if k.endswith("_start_s") and doc.get("servers", {}).get(
                k.removesuffix("_start_s")) == "in place"]
            start = 0.0 if taken and running == label else max(moved, default=10.0) if taken else None
            arrivals = doc["num_requests"] / (load * lam) if lam and doc.get("num_requests") else 0.0
            need = expected_s(doc["phases"], len(seed_list), start_s=start, arrivals_s=arrivals)
            if need is not None and clock.left() < need:
                log(f"{clock.left():.0f} s left, {arm} wants about {need:.0f} s: left for a resumed call")
                break
            t0 = time.monotonic()
            rows_before = len(doc["rows"])
            # the server up runs this arm: as it is (the same label), or with the label's knobs in place (its
            # replica's scheduler swapped once drained; no model load, no new Ray); else a server of its own
            if target is not None and running != label and not (
                    args.one_server and in_place(knobs) and reconfigure_served(
                        target, knobs, args.out / "serve.log", timeout_s=min(120.0, max(30.0, clock.left() - 60)))):
                if args.one_server and in_place(knobs):
                    log(f"the server did not take {label}'s knobs in place: a server of its own")
                servers.close()
                target, steps_before, running, lag_before, full_before = None, None, None, None, None
            if target is None:
                user_config = knobs if args.one_server and in_place(knobs) else None
                extra = "" if user_config is not None else app_args(knobs)
                log_path = args.out / f"serve-{label}.log"
                try:  # (a cut-off start raises: the run ends with what it has)
                    target = servers.enter_context(served(
                        f"{common} {extra}", log_path, user_config=user_config,
                        start_timeout_s=max(60.0, clock.left() - 60), ray_stop=args.device != "cpu",
                        keep=keep if user_config is not None and args.keep_server else None))
                except RuntimeError as e:
                    if user_config is None and "load_format=dummy" not in common or clock.left() < 120:
                        raise
                    # a lease is not spent on a new path that fails: once more as the first leases served, from
                    # the app's arguments over weights written to disk, a server per policy
                    log(f"{label}'s server did not come up ({e}): again from app arguments, with the weights on "
                        "disk, a server per policy")
                    if log_path.exists():
                        log_path.rename(log_path.with_suffix(".failed.log"))
                    common, doc["fallback"] = from_disk(args, common), str(e)
                    target = servers.enter_context(served(
                        f"{common} {app_args(knobs)}", log_path,
                        start_timeout_s=max(60.0, clock.left() - 60), ray_stop=args.device != "cpu"))
                doc.setdefault("servers", {})[arm] = "started"
                doc["server_config"] = str(log_path.with_suffix(".serve.json")) if user_config is not None else None
            else:
                doc.setdefault("servers", {})[arm] = "in place" if running != label else "as it was"
            running = label
            doc["phases"][f"{arm}_start_s"] = time.monotonic() - t0
            doc.setdefault("http_front", {})[label] = http_front()
            if not profile.is_file():
                log("the replica left no profile at predictor_path; the tiers cannot follow it")
                return 2
            if lam is None:  # FCFS's lambda* search, a run of its own: the points are then sized to the time left
                tp = time.monotonic()
                res = run_slo(target, args.out / "fcfs-probe", args, clock, [
                    "--predictor-json", str(profile), "--loads", str(load), "--seeds", args.seeds,
                    # (--num-requests as the points': the ShareGPT pool, so the tiers, are the same in every run)
                    "--num-requests", str(args.num_requests), "--label", "fcfs", "--lengths", "predicted",
                    "--probe-only", "--probe-requests", str(args.probe_requests), "--lambda-def", args.lambda_def,
                    "--lambda-refine", str(args.lambda_refine), "--lambda-guess", args.lambda_guess])
                doc["phases"][f"{arm}_probe_s"] = time.monotonic() - tp
                lag_since("fcfs-probe")
                if res is None:
                    log("no lambda*: FCFS's capacity search failed; stopping")
                    break
                lam = float(res["lambda_star_rps"])
                doc["lambda_star_rps"], doc["lambda_star_search"] = lam, res.get("lambda_star_search")
                doc["tiers"] = res.get("tiers")
                log(f"lambda* = {lam:.3f} req/s ({doc['phases'][f'{arm}_probe_s']:.0f} s); tiers {doc['tiers']}")
                save()
            if "num_requests" not in doc:  # once, for every arm's points (a resumed call keeps it)
                todo = [x for x in plan if x not in done]
                doc["num_requests"] = size_points(
                    clock.left(), lam, [x[2] for x in todo for _ in seed_list], len(todo),
                    cap=args.num_requests, floor=min(args.min_requests, args.num_requests),
                    point_overhead_s=args.point_overhead_s, run_overhead_s=args.run_overhead_s)
                log(f"{doc['num_requests']} requests a point: {len(todo) * len(seed_list)} points in the "
                    f"{clock.left():.0f} s left (--num-requests {args.num_requests}, --min-requests "
                    f"{args.min_requests})")
            out = args.out / arm_dir(label, lengths, load)
            res = run_slo(target, out, args, clock, [
                "--predictor-json", str(profile), "--loads", f"{load:g}", "--seeds", args.seeds, "--num-requests",
                str(doc["num_requests"]), "--label", label, "--lambda-star", str(lam), "--lengths", lengths])
            if res is not None:
                recs = records(out)
                if lengths == "predicted":
                    arm_recs += recs
                doc["rows"] += [point_row(label, lengths, r, recs) for r in res["results"]]
                steps = res.get("server_decode_over_model_by_rows")
                if steps:  # decode step / model by decode rows over this arm's steps (lambda* probes too)
                    doc.setdefault("decode_over_model_by_rows", {})[arm] = steps_between(steps, steps_before)
                    steps_before = steps
                lag_since(arm)
            doc["phases"][f"{arm}_s"] = time.monotonic() - t0
            # (its points: a seed each, as `expected_s` counts them; a row holds its load's seeds)
            doc["phases"][f"{arm}_arrivals_s"] = doc["num_requests"] / (load * lam)  # a point's, at its load
            doc["phases"][f"{arm}_points"] = sum(max(1, len(r.get("per_seed") or []))
                                                 for r in doc["rows"][rows_before:])
            doc["oracle"] = bounds(arm_recs)
            doc["acceptance"] = acceptance(doc["rows"], doc["oracle"], loads)
            save()
    except BaseException as e:  # the summary says how the run ended (a server that never came up: no rows)
        doc["error"] = f"{type(e).__name__}: {e}"
        save()
        raise
    finally:
        ending = True
        servers.close()
    doc["oracle"] = bounds(arm_recs)
    doc["acceptance"] = acceptance(doc["rows"], doc["oracle"], loads)
    save()
    for r in doc["rows"]:
        log(f"{r['policy']:8} {r['lengths']:9} {r['load']:>4g}x {r['rate_rps']:7.2f} rps: goodput "
            f"{r['goodput_rps']:.2f} rps, adherence {100 * r['adherence']:.1f}%, TPOT met (admitted) "
            f"{r['tpot_met_admitted']}, tiers {r['per_tier_adherence']}")
    log(f"acceptance: {json.dumps(doc['acceptance'])}")
    log(f"summary -> {summary_path} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
