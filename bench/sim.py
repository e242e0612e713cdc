"""bench.slo's experiment replayed on a virtual clock: the real Scheduler, a latency model for the machine.

Why. A policy's goodput on a 2-core box moves by ±10% from run to run (the box's speed drifts, the run is short, a
replica's choices snowball), so a mechanism worth a few percent cannot be told from noise there, and a GPU is not
always at hand. This replays the same workload (`bench.workload.generate`: ShareGPT prompts, tiers, arrivals, the
length arms) through `scheduling.scheduler.Scheduler`, the object the engine drives, with no model: each step takes
what a *truth* latency model says of it (prefill tokens and decode rows at their mean context), times `factor` (the
machine slower than the model the scheduler plans with, as the bench's "decode step / model" reports), a lognormal
jitter and, with `--drift`, the box's speed wandering over time (`Drift`; the summary `drift-kairos-tiny-zen4` holds
a 2-core box's), plus a fixed host time per step. The scheduler sees only its own latency model and what it
measures, as in the engine. Everything else is deterministic, so paired comparisons need far fewer seeds, and a
GPU-shaped truth model (`--truth`, a LatencyModel JSON profiled on that GPU) shows what the scheduler does at batch
sizes in the hundreds. The scheduler gets the defaults of the device the `--tiers` model was fitted on (its meta's
device; a GPU's `engine.config.GPU_SCHEDULER_DEFAULTS`) wherever the run leaves a knob unset, as the engine applies
them.

What it leaves out: the engine's host work beyond `--host-ms` per step, HTTP, overlap scheduling (a step's tokens
count when the step ends), KV pressure (blocks are ample), EOS (replies end at their reference length), and the
scheduler's own time: each policy's line reports it (host microseconds per step, its calls timed on this machine)
but the virtual clock does not charge it, so the decisions stay deterministic. It ranks mechanisms; real runs
(bench.slo) measure them.

    python -m bench.sim --tiers bench/out/RUN/tiers-profile.json --policies kairos,scorpio,kairos+lengths=exact \\
        --loads 1.5 --seeds 0-9

A label's `+noise=SIGMA` (simulator only) replaces the shipped length predictor by a synthetic one of known quality:
it sees each request's reference length times a lognormal error of spread SIGMA and gives the scheduler what a
calibrated predictor would: the posterior of the length given that, under the run's own spread of lengths, over
the predictor's buckets (`noisy_outlook`). Each line reports the Spearman correlation of the
lengths the scheduler planned with at arrival and the replies' reference lengths, so a sweep of SIGMA shows how
good a predictor must rank for a goodput.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench import driver as D
from bench import metrics as M
from bench import workload as W
from bench.slo import (arm_sched, completion_rate, drain_for, length_arm, overrides, policy_spec, probe_text,
                       search_lambda)
from core.request import SLO, FinishReason, Request
from core.sampling import SamplingParams
from engine.config import EngineConfig, for_device
from scheduling.config import SchedulerConfig
from scheduling.length_predictor import EDGES, LEN_HI, LEN_LO, conditional_means, spearman
from scheduling.predictor import LatencyModel
from scheduling.scheduler import Scheduler


@dataclass(frozen=True)
class Machine:
    """The simulated machine: step ms = (truth prefill + truth decode - hybrid saving) x factor x jitter x drift +
    host_ms + host_row_ms x decode rows (jitter and drift lognormal of median 1: a drift of spread s makes the mean
    step e^(s^2 / 2) as long). A hybrid step (a prefill and decodes in one forward) saves `hybrid_saving_ms` against
    its two parts alone, at most the smaller part, where the truth adds them up (`LatencyModel.mixed` "sum"): on a
    GPU both parts pay a launch-bound floor (the weights read once), which one forward pays once; a truth fitted as
    one forward ("shared") counts it already."""

    truth: LatencyModel
    factor: float = 1.25
    jitter: float = 0.1  # sigma of the lognormal multiplier
    host_ms: float = 0.15
    seed: int = 0

    drift: float = 0.0  # sigma of the log of the box's speed as it wanders (Drift); 0: a steady box
    drift_s: float = 1.0  # how long the wander takes to forget itself (s)
    hybrid_saving_ms: float = 0.0  # what a hybrid step saves against its prefill and decode alone (0: their sum)
    host_row_ms: float = 0.0  # host time per decode row on top of host_ms (sampling, detokenizing, streaming a token)

    def step_ms(self, prefill_tokens: int, decode_rows: int, mean_len: float, rng: random.Random,
                prefill_sq: float | None = None, speed: float = 1.0) -> float:
        """A step's time; `speed`: the drift's multiplier now (`Drift.at`)."""
        # (its prefill beside its decode rows, as the truth's fit adds them up: `LatencyModel.beside_ms`)
        ms = self.truth.beside_ms(prefill_tokens, prefill_sq, float(decode_rows), mean_len) if prefill_tokens else 0.0
        if decode_rows:
            decode = self.truth.itl_ms(float(decode_rows), mean_len)
            # (a hybrid step's saving where the truth adds its prefill and decode up: "shared" counts it already)
            saving = self.hybrid_saving_ms if self.truth.mixed == "sum" else 0.0
            ms += decode - (min(saving, ms, decode) if ms else 0.0)
        mult = math.exp(rng.gauss(0.0, self.jitter)) if self.jitter > 0 else 1.0
        return ms * self.factor * mult * speed + self.host_ms + self.host_row_ms * decode_rows


class Drift:
    """A box's speed wandering over time, as a CPU shared with its neighbours does: step times x e^x, x an
    Ornstein-Uhlenbeck process of stationary spread `sigma` that forgets itself over `tau_s` seconds (steps a
    moment apart are slow or fast together, where `jitter` scatters each step on its own). Its own random stream, so
    a run without drift draws what it drew before."""

    def __init__(self, sigma: float, tau_s: float, seed: int) -> None:
        if not (sigma >= 0 and (sigma == 0 or tau_s > 0)):  # nan fails too
            raise ValueError("drift takes a spread >= 0 and, with a spread, a time > 0")
        self.sigma, self.tau_s = sigma, tau_s
        self.rng = random.Random(seed + 104729)
        self.x, self.t = 0.0, None

    def at(self, now: float) -> float:
        """The multiplier of a step starting at `now` (s, not decreasing)."""
        if self.sigma == 0:
            return 1.0
        if self.t is None:
            self.x = self.rng.gauss(0.0, self.sigma)
        else:
            a = math.exp(-max(now - self.t, 0.0) / self.tau_s)
            self.x = self.x * a + self.sigma * math.sqrt(1.0 - a * a) * self.rng.gauss(0.0, 1.0)
        self.t = now
        return math.exp(self.x)


def noisy_outlook(true_len: int, sigma: float, rng: random.Random, prior: tuple[float, float] | None = None,
                  cap: float | None = None) -> tuple[float, ...]:
    """A synthetic length prediction of known quality (the `noise=SIGMA` arm), read as the shipped predictor's are
    (conditional means: E[len], then E[len | len > t]). It observes m = log L + SIGMA z. Without `prior`, its
    distribution is the lognormal of median e^m and spread SIGMA. With `prior` (mean, sd of log lengths over the
    requests) it is the posterior of log L given m, as a calibrated predictor's would be: normal, of mean
    (m tau^2 + mu0 SIGMA^2) / (tau^2 + SIGMA^2) and variance SIGMA^2 tau^2 / (tau^2 + SIGMA^2). Either way over the
    predictor's buckets, and within `cap` (the request's max_tokens), as the scheduler reads the shipped one's."""
    m = math.log(max(1, true_len)) + sigma * rng.gauss(0.0, 1.0)
    mu, sd = m, sigma
    if prior is not None and sigma > 0:
        mu0, tau = prior
        w = tau * tau / (tau * tau + sigma * sigma)
        mu, sd = w * m + (1.0 - w) * mu0, math.sqrt(w) * sigma
    cuts = [LEN_LO, *EDGES, LEN_HI]
    cdf = [0.0 if i == 0 else 1.0 if i == len(cuts) - 1 else
           0.5 * (1.0 + math.erf((math.log(c) - mu) / (max(sd, 1e-6) * math.sqrt(2.0))))
           for i, c in enumerate(cuts)]
    p = [max(b - a, 0.0) for a, b in zip(cdf, cdf[1:])]
    tot = sum(p)
    return conditional_means(np.asarray([x / tot for x in p]), cap=cap)


def run_span_s(recs: Sequence[D.Record]) -> float:
    """A run's length on the virtual clock: its first arrival to its last request's end (the point's share of a
    device's time, its clients' and server's overheads aside)."""
    if not recs:
        return 0.0
    return max(r.finished_s if r.finished_s is not None else r.arrival_s for r in recs) - min(r.arrival_s for r in recs)


def simulate(config: SchedulerConfig, items: Sequence[W.WorkItem], machine: Machine, planner: LatencyModel, *,
             max_model_len: int = 2048, block_size: int = 16, drain_s: float = 30.0,
             tokenizer_fingerprint: str | None = None, clock: dict[str, float] | None = None,
             noise: float | None = None, lengths: list[tuple[float, int]] | None = None,
             seats_full: set[int] | None = None) -> list[D.Record]:
    """Offer `items` (arrival order) to a fresh Scheduler on a virtual clock; one Record per item. With `clock`,
    the host time the scheduler's own calls took is added to its "s" (seconds) and the steps run to "steps": what
    it costs per step on this host, which the virtual clock does not charge. With `noise` each request's length
    prediction is synthetic (`noisy_outlook`) instead of the shipped predictor's. With `lengths`, each request's
    (expected length at arrival, reference length) is appended to it. With `seats_full`, the index of each request the
    scheduler turned away while every seat (max_num_seqs) was taken is added to it."""
    blocks = config.max_num_seqs * (max_model_len // block_size + 2) + 64
    sched = Scheduler(config, blocks, block_size, max_model_len, predictor=planner,
                      tokenizer_fingerprint=tokenizer_fingerprint)
    if clock is not None:
        sched = _Timed(sched, clock)
    rng = random.Random(machine.seed)
    drift = Drift(machine.drift, machine.drift_s, machine.seed)
    noise_rng = random.Random(machine.seed + 7919)
    prior = None  # the noise arm's: the spread of the run's log lengths
    if noise is not None and len(items) > 1:
        logs = [math.log(max(1, w.output_len)) for w in items]
        prior = (statistics.fmean(logs), statistics.pstdev(logs))
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    recs: dict[str, D.Record] = {}
    reqs: dict[str, Request] = {}
    t, k = 0.0, 0
    end = (items[order[-1]].arrival_s if items else 0.0) + drain_s

    def close(req: Request, reason: FinishReason, now: float) -> None:
        if not sched.finish(req, reason, now):
            return
        rec = recs[req.request_id]
        rec.finish_reason = reason.value
        rec.finished_s = now
        rec.token_times = list(req.token_times)
        rec.n_out = len(req.token_times)
        if req.first_token_s is not None:
            rec.ttft_s = req.first_token_s - rec.arrival_s

    while t < end:
        while k < len(order) and items[order[k]].arrival_s <= t:
            i = order[k]
            w = items[i]
            k += 1
            rid = f"sim-{i}"
            slo = SLO(*(x if math.isfinite(x) else None for x in (w.ttft_ms, w.tpot_ms)), w.output_len_hint).validate()
            req = Request(rid, list(w.prompt_ids), SamplingParams(max_tokens=w.max_tokens, ignore_eos=True).validate(),
                          slo, arrival_s=w.arrival_s)
            req.bench_stop_after = w.stop_after
            if noise is not None and w.stop_after is not None:
                req.length_outlook = noisy_outlook(w.stop_after, noise, noise_rng, prior,
                                                   min(w.max_tokens, max_model_len - len(w.prompt_ids)))
                req.predicted_len = max(1, int(round(req.length_outlook[0])))
            recs[rid] = D.Record(w.tier, w.ttft_ms, w.tpot_ms, w.arrival_s, prompt_len=len(w.prompt_ids),
                                 max_tokens=w.max_tokens, output_len=w.output_len, index=i, sent_s=w.arrival_s)
            reqs[rid] = req
            seats_before = sched.num_rejected_seats_full
            reason = sched.add(req)
            if lengths is not None:
                lengths.append((float(req.expected_output_len), w.output_len))
            if reason is not None:
                recs[rid].rejected, recs[rid].reject_reason = True, str(reason.value)
                if seats_full is not None and sched.num_rejected_seats_full > seats_before:
                    seats_full.add(i)
                close(req, FinishReason.REJECTED, t)
        seats_before = sched.num_rejected_seats_full
        plan = sched.schedule(t)
        full = seats_full is not None and sched.num_rejected_seats_full > seats_before  # (the scheduler's count)
        for req, reason in plan.rejected:
            recs[req.request_id].rejected, recs[req.request_id].reject_reason = True, str(reason.value)
            if full:
                seats_full.add(recs[req.request_id].index)
            close(req, FinishReason.REJECTED, t)
        if plan.empty:
            if k < len(order):
                t = max(t + 1e-4, min(items[order[k]].arrival_s, t + 0.005))
            elif not sched.has_work():
                break
            else:
                t += 0.005
            continue
        rows = plan.requests
        ms = machine.step_ms(plan.num_prefill_tokens, len(plan.decode), plan.decode_mean_len, rng,
                             plan.num_prefill_sq, drift.at(t))
        index = sched.launched(plan, rows)
        t += ms / 1000.0
        for req, _tok, reason in sched.resolved(rows, index, [7] * len(rows), t):
            if reason is not None:
                close(req, reason, t)
        sched.on_step_done(plan, ms, t, rows)
    for rid, req in reqs.items():  # what the drain left unfinished
        rec = recs[rid]
        if rec.finish_reason is None:
            close(req, FinishReason.ABORT, t)
            rec.finish_reason = "timeout"
    return [recs[f"sim-{i}"] for i in range(len(items))]


def over_oracle(measured: Sequence[D.Record]) -> float:
    """The good requests of a run's measured arrivals over the shortest-first oracle's with the same decoded tokens
    (`bench.bound`'s "own tokens", the GPU experiment's "≥ 90% of the oracle"); NaN where the oracle has none."""
    from bench.bound import shortest_first

    decoded = sum(r.n_out or 0 for r in measured if not r.rejected)
    best = shortest_first([r.output_len or r.max_tokens for r in measured], decoded)
    return sum(M.is_good(r) for r in measured) / best if best else math.nan


def scaled_replies(items: Sequence[W.WorkItem], factor: float, max_model_len: int,
                   cap: Callable[[int], int] | None = None) -> list[W.WorkItem]:
    """`items` with every reply `factor` times its reference length, at least one token: within its cap where the
    length is hidden (`stop_after`), within the window where it is the forced max_tokens (and its hint with it), and
    within `cap(prompt length)` too (the hidden arms' cap, `workload.length_cap`: every arm's replies the same)."""
    out = []
    for w in items:
        if w.stop_after is not None:
            out.append(replace(w, stop_after=max(1, min(w.max_tokens, round(w.stop_after * factor)))))
        else:
            most = max_model_len - len(w.prompt_ids) - 1
            if cap is not None:
                most = min(most, cap(len(w.prompt_ids)))
            n = max(1, min(most, round(w.max_tokens * factor)))
            out.append(replace(w, max_tokens=n, output_len_hint=n if w.output_len_hint is not None else None))
    return out


class _Timed:
    """A Scheduler whose calls from the loop are timed on the host (perf_counter) into `clock`."""

    _CALLS = ("add", "schedule", "launched", "resolved", "on_step_done", "finish")

    def __init__(self, sched: Scheduler, clock: dict[str, float]) -> None:
        self._sched, self._clock = sched, clock
        clock.setdefault("s", 0.0)
        clock.setdefault("steps", 0.0)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._sched, name)
        if name not in self._CALLS:
            return attr
        clock = self._clock

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                clock["s"] += time.perf_counter() - t
                if name == "on_step_done":
                    clock["steps"] += 1
        return timed


def host_ms_of(text: str) -> dict[str | None, float]:
    """`--host-ms`: a number (every label's), or comma-separated LABEL=MS (a label may hold '=': the last one
    splits) with at most one bare number for the other labels (0.15 without one). None keys the default."""
    out: dict[str | None, float] = {None: 0.15}
    seen_default = False
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        label, eq, value = part.rpartition("=")
        try:
            ms = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: want MS or LABEL=MS") from None
        if not ms >= 0 or math.isinf(ms):
            raise argparse.ArgumentTypeError(f"{part!r}: host ms must be finite and >= 0")
        if not eq:
            if seen_default:
                raise argparse.ArgumentTypeError(f"{text!r}: one bare number at most (the other labels' host ms)")
            seen_default = True
        out[label.strip() if eq else None] = ms
    return out


HOST_PHASES = ("schedule", "sample", "postprocess")  # a bench.slo run's host phases a step, beside its forward


def host_ms_from(path: str) -> dict[str, float]:
    """`--host-from`: each policy label's host ms a step in a bench.slo run (its results.json, or its summary in
    bench/summaries): the schedule, sample and postprocess phases of its `phase_ms_per_step` (the first point of each
    label; the forward is the step model's). A label without phases (an HTTP run's) is left out."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = doc.get("results") or [{"policy": label, **point} for label, point in
                                   ((doc.get("figures") or {}).get("policies") or {}).items()]
    out: dict[str, float] = {}
    for r in rows:
        phases = r.get("phase_ms_per_step") or {}
        if r.get("policy") and r["policy"] not in out and all(k in phases for k in HOST_PHASES):
            out[r["policy"]] = sum(phases[k] for k in HOST_PHASES)
    return out


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part.strip():
            out.append(int(part))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--tiers", required=True, help="a LatencyModel JSON (bench.slo's tiers-profile.json): the scheduler's model "
      "and the tiers' base")
    a("--truth", default=None, help="the machine's LatencyModel JSON (default: --tiers)")
    a("--factor", type=float, default=None, help="machine / model step time (default 1.25, a 2-core CPU box's; a "
      "GPU replica's profile held closer to 1: a lease's bench.slo prints its decode step / model by rows)")
    a("--jitter", type=float, default=0.1, help="sigma of each step's own lognormal scatter")
    a("--drift", type=float, default=0.0, help="sigma of the log of the box's speed as it wanders over time (Drift; "
      "0: steady)")
    a("--drift-s", type=float, default=1.0, help="the drift's time constant (s)")
    a("--hybrid-saving-ms", type=float, default=0.0, help="the machine's: what a step that prefills and decodes "
      "together saves against the two alone (ms, at most the smaller; 0: their sum, as the scheduler plans). "
      "bench.prefill_model's hybrid steps measure it (its summaries' hybrid_steps)")
    a("--host-ms", type=host_ms_of, default=host_ms_of("0.15"), metavar="MS|LABEL=MS,...",
      help="host time added to every step (ms): one for all, or per policy label, e.g. 'kairos=0.27,scorpio=0.12,"
      "0.15' (a label's own, else the bare number, else 0.15): a replay of a bench.slo run takes each policy's "
      "measured host ms a step (--host-from reads them), which the probe fit leaves out")
    a("--host-from", default=None, metavar="JSON", help="each label's host ms a step from a bench.slo run's "
      "results.json or summary (its schedule + sample + postprocess phases), where --host-ms names no ms of its own")
    a("--host-row-ms", type=float, default=0.0, help="host time per decode row on top of --host-ms (ms): a bench.slo "
      "run's decode_host_ms_by_rows grows by about this a row (its policies alike), its fixed part being the "
      "policy's own (--host-ms LABEL=MS)")
    a("--policies", default="fcfs,scorpio,kairos")
    a("--loads", default="1.5")
    a("--seeds", default="0-9")
    a("--num-requests", type=int, default=400)
    a("--dataset", choices=("sharegpt", "synthetic"), default="sharegpt", help="as bench.slo's (synthetic: "
      "lognormal lengths, random ids)")
    a("--pool", type=int, default=W.SHAREGPT_POOL, help="as bench.slo's")
    a("--prompt-median", type=float, default=100, help="synthetic: prompt tokens, lognormal median")
    a("--prompt-cap", type=int, default=512, help="synthetic: prompt tokens, cap")
    a("--output-median", type=float, default=60, help="synthetic: output tokens, lognormal median")
    a("--output-cap", type=int, default=256, help="synthetic: output tokens, cap")
    a("--lengths", choices=W.LENGTH_ARMS, default="predicted")
    a("--reply-scale", type=float, default=1.0, help="every reply this many times its reference length (within its "
      "cap and the window): a served model that answers longer or shorter than ShareGPT's references, which the "
      "length predictor learned (length_calibration)")
    a("--no-hints", action="store_true", help="the exact arm's requests send no output-length hint: their forced "
      "max_tokens and ignore_eos alone say their lengths (as `vllm bench serve --ignore-eos` sends them), which a "
      "policy reads with ignore_eos_length")
    a("--lambda-star", type=float, default=None, help="skip the lambda* search")
    a("--lambda-def", choices=("capacity", "adherence"), default="capacity", help="as bench.slo's")
    a("--probe-requests", type=int, default=240, help="requests per lambda* probe")
    a("--lambda-guess", choices=("b4", "seats"), default="b4", help="as bench.slo's (slo_gpu.sh: seats): the "
      "search's first rate; from b4's the adherence search's doublings may not reach a GPU replica's lambda*")
    a("--lambda-adherence", type=float, default=0.9, help="as bench.slo's")
    a("--lambda-refine", type=int, default=2, help="as bench.slo's (slo_gpu.sh's adherence lambda*: 3)")
    a("--max-num-seqs", type=int, default=32)
    a("--strict-batch", type=float, default=4, help="as bench.slo's (slo_gpu.sh: its seats, 256)")
    a("--loose-batch", type=float, default=12, help="as bench.slo's (slo_gpu.sh: 512)")
    a("--prefill-max-tokens", type=int, default=512)
    a("--max-model-len", type=int, default=2048)
    a("--sched", action="append", default=[], help="key=value scheduler override for every policy")
    a("--warmup-frac", type=float, default=0.1)
    a("--json", default=None, help="write the results here")
    a("--summary", default=None, help="bench/summaries/NAME.json: the command, the figures and a headline")
    args = ap.parse_args(argv)
    if args.host_from:
        for label, ms in host_ms_from(args.host_from).items():
            args.host_ms.setdefault(label, ms)  # a label --host-ms names keeps its own
    try:  # the drift's own rule on its arguments
        Drift(args.drift, args.drift_s, 0)
    except ValueError as e:
        ap.error(f"--drift/--drift-s: {e}")
    planner = LatencyModel.load(args.tiers)
    truth = LatencyModel.load(args.truth) if args.truth else planner
    if args.factor is None:
        args.factor = 1.25
        if str(truth.meta.get("device", "cpu")).startswith("cuda"):
            print("bench.sim: --factor 1.25 (a CPU box's) on a GPU replica's profile; its leases measured their steps "
                  "nearer their model (bench/README, \"SLO serving on a GPU replica\"): pass --factor", flush=True)
    corpus = None
    if args.dataset == "sharegpt":
        from bench.slo import build_parser, sharegpt_corpus

        corpus = sharegpt_corpus(build_parser().parse_args(["--dataset", "sharegpt"]),
                                 max(args.num_requests, args.probe_requests, args.pool), args.max_model_len)
    sigma = W.WorkloadSpec().prompt.sigma
    base = W.WorkloadSpec(max_model_len=args.max_model_len, corpus=corpus, lengths=args.lengths,  # Poisson, equal mix
                          prompt=W.LengthDist(args.prompt_median, sigma, args.prompt_cap, 4),
                          output=W.LengthDist(args.output_median, sigma, args.output_cap, 2))
    scale = W.slo_scale(planner, args.prefill_max_tokens, base, strict_batch=args.strict_batch,
                        loose_batch=args.loose_batch)
    seeds = parse_seeds(args.seeds)
    # the workload's ids are kairos-tiny's (bench.slo's default model), the tokenizer the shipped predictor counts in
    from bench.driver import resolve_model_path
    from scheduling.length_predictor import tokenizer_fingerprint

    fp = tokenizer_fingerprint(resolve_model_path("kairos-tiny"))

    def noise_of(label: str) -> tuple[str, float | None]:
        """A label's sim-only `+noise=SIGMA` (synthetic predictions, `noisy_outlook`), and the label without it."""
        parts = label.split("+")
        sigma = overrides(parts[1:]).get("noise")
        if sigma is not None and (isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma < 0
                                  or length_arm(label, args.lengths) != "predicted"):
            raise SystemExit(f"{label}: noise takes a spread >= 0, in the predicted arm (its lengths are hidden "
                             "from the scheduler; the synthetic prediction stands in for the predictor's)")
        return "+".join(p for p in parts if not p.startswith("noise=")), None if sigma is None else float(sigma)

    # the scheduler defaults of the device the --tiers model was fitted on, where the run leaves a knob unset, as the
    # engine applies them (engine.config.for_device: a GPU replica's)
    device_type = str(planner.meta.get("device", "cpu")).split(":")[0]

    def config(label: str) -> SchedulerConfig:
        policy, extra = policy_spec(noise_of(label)[0])
        cfg = SchedulerConfig(**{"policy": policy, "max_num_seqs": args.max_num_seqs,
                                 "prefill_max_tokens": args.prefill_max_tokens,
                                 **arm_sched(length_arm(label, args.lengths)), **overrides(args.sched), **extra})
        return for_device(EngineConfig(scheduler=cfg), device_type).scheduler

    def host_of(label: str) -> float:
        """The host ms a step of `label` takes (`--host-ms`: its own, else the other labels')."""
        return args.host_ms.get(label, args.host_ms[None])

    def run(label: str, rate: float, seed: int, n: int, clock: dict[str, float] | None = None,
            lengths: list[tuple[float, int]] | None = None, seats_full: set[int] | None = None) -> list[D.Record]:
        spec = replace(base, num_requests=n, rate_rps=rate, seed=seed, lengths=length_arm(label, args.lengths))
        items = W.generate(spec, scale.tiers)
        if args.reply_scale != 1.0:  # (every arm's replies within the hidden arms' cap, as at 1)
            items = scaled_replies(items, args.reply_scale, args.max_model_len, lambda k: W.length_cap(spec, k))
        if args.no_hints:
            items = [replace(w, output_len_hint=None) for w in items]
        machine = Machine(truth, args.factor, args.jitter, host_of(label), seed, args.drift, args.drift_s,
                          args.hybrid_saving_ms, args.host_row_ms)
        return simulate(config(label), items, machine, planner, max_model_len=args.max_model_len,
                        drain_s=drain_for(items, None),  # (bench.slo's: a run's drain, the same in both)
                        tokenizer_fingerprint=fp, clock=clock, noise=noise_of(label)[1], lengths=lengths,
                        seats_full=seats_full)

    t0 = time.perf_counter()
    probes: list[dict] = []
    if args.lambda_star is not None:
        lam = args.lambda_star
    else:
        names = [t.name for t in scale.tiers]
        spans: list[float] = []

        def probe(rate: float) -> list[D.Record]:
            recs = run("fcfs", rate, seeds[0], args.probe_requests)
            spans.append(run_span_s(recs))
            return recs

        def adherence(rate: float) -> float:
            return M.summarize(probe(rate), warmup_frac=args.warmup_frac, tiers=names)["adherence"]

        lam, probes = search_lambda(args, planner, scale, adherence, lambda r: completion_rate(probe(r)))
        print("bench.sim: lambda* search " + "; ".join(probe_text(p) for p in probes)
              + f"; {len(spans)} probes, " + " + ".join(f"{x:.1f}" for x in spans) + " s", flush=True)
    print(f"bench.sim: lambda* {lam:.3f} rps; tiers " + ", ".join(
        f"{t.name} {t.ttft_ms:.0f}/{t.tpot_ms:.2f}" for t in scale.tiers), flush=True)
    out: dict[str, Any] = {"lambda_star_rps": lam, "lambda_search": probes, "args": {
        **vars(args), "host_ms": {k or "*": v for k, v in args.host_ms.items()}}, "points": [],
                           "ratios": []}
    for load in [float(x) for x in args.loads.split(",")]:
        rate = lam * load
        by: dict[str, list[float]] = {}
        for label in [p.strip() for p in args.policies.split(",") if p.strip()]:
            per_seed, tiers_served, tpot_missed, reasons, oracle, spans = [], {}, [], {}, [], []
            full_by_tier: dict[str, int] = {}  # the measured rejections made while every seat was taken
            clock: dict[str, float] = {}
            lengths: list[tuple[float, int]] = []
            for seed in seeds:
                full: set[int] = set()
                recs = run(label, rate, seed, args.num_requests, clock, lengths, full)
                spans.append(run_span_s(recs))
                s = M.summarize(recs, warmup_frac=args.warmup_frac, tiers=[t.name for t in scale.tiers])
                per_seed.append(s["goodput_rps"])
                tpot_missed.append(s["tpot_violations"] / max(1, s["n"] - s["rejected"]))
                measured = M.drop_warmup(recs, args.warmup_frac)
                oracle.append(over_oracle(measured))
                for r in measured:
                    if r.rejected:
                        by_why = reasons.setdefault(r.tier, {})
                        by_why[r.reject_reason] = by_why.get(r.reject_reason, 0) + 1
                        if r.index in full:
                            full_by_tier[r.tier] = full_by_tier.get(r.tier, 0) + 1
                for t in scale.tiers:
                    tiers_served.setdefault(t.name, []).append(s["per_tier"].get(t.name, {}).get(
                        "adherence", math.nan))
            by[label] = per_seed
            tiers_txt = " ".join(f"{name[:4]} {100 * statistics.fmean(v):.0f}%" for name, v in tiers_served.items())
            sched_us = 1e6 * clock["s"] / max(1.0, clock["steps"])
            # how well the lengths the scheduler planned with at arrival rank the replies' (NaN where all alike)
            rank = spearman(*zip(*lengths)) if len(lengths) > 1 else math.nan
            turned = sum(sum(v.values()) for v in reasons.values())
            print(f"  {label:40s} {load:g}x: goodput {statistics.fmean(per_seed):.3f} rps "
                  f"(seeds {' '.join(f'{g:.2f}' for g in per_seed)})  {tiers_txt}  TPOT missed by "
                  f"{100 * statistics.fmean(tpot_missed):.1f}% of admitted; oracle {sum(oracle) / len(oracle):.2f}; "
                  f"lengths' Spearman {rank:.3f}; scheduler {sched_us:.0f} us/step on this host; "
                  f"{statistics.fmean(spans):.1f} s a run; {sum(full_by_tier.values())} of {turned} turned away "
                  f"with every seat taken", flush=True)
            out["points"].append({"policy": label, "load": load, "goodput_rps": per_seed, "tiers": tiers_served,
                                  "tpot_missed": tpot_missed, "rejected_by_tier": reasons,
                                  "rejected_seats_full_by_tier": full_by_tier,
                                  "over_oracle_own_tokens": oracle,
                                  "length_spearman": None if math.isnan(rank) else rank,
                                  "scheduler_us_per_step": sched_us, "run_s": spans,
                                  "host_ms": host_of(label)})
        first = next(iter(by))
        for label, g in by.items():
            if label != first and statistics.fmean(g) > 0:
                ratios = [x / y for x, y in zip(by[first], g) if y > 0]  # (a seed where `label` made none: left out,
                of_means = statistics.fmean(by[first]) / statistics.fmean(g)  # and said so)
                out["ratios"].append({"load": load, "of": first, "over": label, "mean_of_ratios":
                                      statistics.fmean(ratios), "min": min(ratios), "ratio_of_means": of_means,
                                      "seeds": len(ratios), "of_seeds": len(g)})
                left = f", {len(g) - len(ratios)} of {len(g)} seeds left out: none good there" \
                    if len(ratios) < len(g) else ""
                print(f"    {first} / {label}: mean of ratios {statistics.fmean(ratios):.3f} "
                      f"(min {min(ratios):.2f}{left}), ratio of means {of_means:.3f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.summary:
        from bench.report import command_line, write_summary

        goodput = ", ".join(f"{p['policy']} {statistics.fmean(p['goodput_rps']):.2f}" for p in out["points"])
        ratios = ", ".join(f"/{r['over']} {r['mean_of_ratios']:.2f}" for r in out["ratios"])
        head = (f"simulated ({len(seeds)} seeds, {args.dataset}, lengths {args.lengths}, lambda* {lam:.2f} rps, "
                f"truth {Path(args.truth or args.tiers).name} x{args.factor:g}): {goodput}; {ratios}")
        print(f"summary -> {write_summary(args.summary, command_line('bench.sim', argv), head, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
