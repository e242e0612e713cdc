"""Heterogeneous-SLO goodput benchmark: policies × loads, open-loop, after scorpio.md §2/§4.

    python -m bench.slo --quick                         # <=3 min smoke: 3 policies at 1.5 x lambda*, short requests
    python -m bench.slo                                 # full default sweep (all 7 policies x 6 loads, <= 30 min)
    python -m bench.slo --num-requests 400 --seeds 0,1,2   # the protocol's full size (hours on a 2-core box)
    python -m bench.slo --target http://127.0.0.1:8000  # drive a running server (its own policy) over HTTP

What one run does:
1. Starts one engine per policy (the policy is fixed at construction), FCFS first. Engine start profiles the
   model once (cached JSON under ~/.cache/kairos/profiles), so later starts take seconds. The FIRST engine's
   fitted predictor sets the SLO tiers (u = 2·Prefill(budget), d4, d12 at L̄) for every policy.
2. Finds lambda* = the highest rate at which FCFS keeps >= 90% adherence: geometric expansion from an
   analytical guess, then bisection in log space, on short runs of the same seeded workload (the requests are
   identical at every rate; only the arrival times scale). Skip it with --lambda-star.
3. Sweeps loads × policies open-loop: the main thread sleeps until each request's arrival time and calls
   add_request (never blocks); one consumer thread drains the streams and keeps the final metrics (all
   timestamps are the engine's own time.monotonic). Requests unfinished `drain` seconds after the last arrival
   are aborted and counted as misses (finish_reason "timeout").
4. Writes results.json, results.csv, records.jsonl (one line per request) and the PNGs into --out, prints a
   table per load and the acceptance checks at 1.5×lambda*.

Model: kairos-tiny by default (the protocol's "tiny Llama, 4 layers, d=256"); with kairos-default lambda* is
well below 1 req/s on this box and a 30-minute sweep holds only ~10 requests per point.
Run length: the protocol asks for 400 requests per point × 3 seeds (10+ hours per seed here), so by default the requests per point are capped at 400
AND shrunk so that the whole run fits --budget-min (30 min; quick: 3 min); the printed plan shows the count and
what 400/point would cost. The lambda* search gets at most ~25% of the budget (bisection is cut short).
Pass --num-requests N to force exactly N per point (no budget cap).
--quick is a smoke test, not a small copy of the sweep: 3 policies at 1.5×lambda* only, coarse search, and
shorter requests (prompt median 40 / cap 160, output median 16 / cap 64), so lambda* is a few times higher and
the 3-minute budget holds tens of requests per point. Its numbers are not comparable with the full sweep.

dtype: float32 by default. On this AVX2 box (no AVX512-BF16/AMX) bf16 matmuls are emulated and run 3-5x
slower than fp32, so fp32 is the faster and the representative choice here; use --dtype bfloat16 on
hardware with native bf16.

Engine threads: 1 (torch.set_num_threads(1)), leaving the second core to the load generator (§4).
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import slo_metrics as M  # noqa: E402
from bench import workload as W  # noqa: E402
from bench.common import clean, free_memory, loadavg, percentile, run_info, write_json  # noqa: E402
from bench.common import resolve_bench_model  # noqa: E402

log = logging.getLogger("kairos.bench.slo")

ALL_POLICIES = ("fcfs", "pack", "edf", "edf_reject", "tpot_guard", "scorpio", "kairos")
QUICK_POLICIES = ("fcfs", "scorpio", "kairos")
DEFAULT_LOADS = "0.5,0.75,1,1.25,1.5,2"
QUICK_LOADS = "1.5"
TARGET_ADHERENCE = 0.90
CHECK_LOAD = 1.5
TIER_SHORT = {"interactive": "T1", "strict_tpot": "T2", "relaxed": "T3"}


# --------------------------------------------------------------------------- small helpers (kept private)

def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    w = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w[i]) if i == 0 else v.rjust(w[i]) for i, v in enumerate(vals)) + " |"

    sep = "|" + "|".join("-" * (x + 2) if i == 0 else "-" * (x + 1) + ":" for i, x in enumerate(w)) + "|"
    out = [line(list(headers)), sep, *(line(r) for r in cells)]
    return (f"\n{title}\n" if title else "") + "\n".join(out)


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return None
    if not enabled:
        return None
    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True, file=sys.stderr)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.replace(" ", "").split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


# --------------------------------------------------------------------------- running one point

@dataclass
class PointRun:
    records: list[M.RequestRecord]
    started_s: float  # monotonic time of arrival 0
    submit_lag_ms: list[float] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)  # scheduler-time stats (engine mode)
    timeouts: int = 0


def _sampling(max_tokens: int):
    from engine.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _record_from_output(w: W.WorkItem, out: Any, *, timed_out: bool = False, give_up_s: float | None = None,
                        fallback_arrival: float = 0.0) -> M.RequestRecord:
    m = out.metrics
    arrival = m.arrival_s if m is not None else fallback_arrival
    reason = out.finish_reason
    rec = M.RequestRecord(
        tier=w.tier, ttft_slo_ms=w.ttft_ms, tpot_slo_ms=w.tpot_ms, arrival_s=arrival,
        rejected=reason == "rejected", finish_reason="timeout" if timed_out else reason,
        ttft_s=None if m is None or m.first_token_s is None else m.first_token_s - arrival,
        token_times=list(m.token_times) if m is not None else [], n_out=out.num_output_tokens,
        finished_s=give_up_s if timed_out else (m.finished_s if m is not None else None),
        reject_reason=out.reject_reason, prompt_len=len(w.prompt_ids))
    if rec.finished_s is None:
        rec.finished_s = give_up_s if give_up_s is not None else rec.end_s
    return rec


def run_engine_point(eng: Any, items: Sequence[W.WorkItem], *, drain_s: float, tag: str = "r",
                     progress: bool = False, desc: str = "") -> PointRun:
    """Open-loop: submit each item at its arrival time, drain every stream, abort stragglers after `drain_s`."""
    from engine.request import SLO

    n = len(items)
    records: list[M.RequestRecord | None] = [None] * n
    handoff: queue.SimpleQueue = queue.SimpleQueue()
    deadline = [math.inf]  # set once the last request is submitted
    bar = _progress(n, desc, progress)
    timeouts = [0]

    def finish(i: int, out: Any, timed_out_ok: bool) -> None:
        w = items[i]
        if out is None:  # the engine never answered even the abort: a miss with no metrics
            records[i] = M.RequestRecord(w.tier, w.ttft_ms, w.tpot_ms, time.monotonic(), finish_reason="timeout",
                                         finished_s=deadline[0], prompt_len=len(w.prompt_ids))
        else:
            late = timed_out_ok and out.finish_reason not in M.COMPLETED and out.finish_reason != "rejected"
            records[i] = _record_from_output(w, out, timed_out=late, give_up_s=deadline[0])
        timeouts[0] += records[i].finish_reason == "timeout"
        if bar is not None:
            bar.update(1)

    def consume() -> None:
        """Polls `closed` every 20 ms instead of waking on every token, so the engine keeps the GIL."""
        pending: dict[int, tuple[Any, str]] = {}
        submitted_all = False
        while True:
            while True:
                try:
                    got = handoff.get_nowait()
                except queue.Empty:
                    break
                if got is None:
                    submitted_all = True
                else:
                    pending[got[0]] = (got[1], got[2])
            for i in [i for i, (st, _) in pending.items() if st.closed]:
                st, _ = pending.pop(i)
                finish(i, _last(st, 5.0), False)
            if submitted_all and not pending:
                return
            if time.monotonic() >= deadline[0]:  # give up: abort the stragglers, keep what they got
                for _, rid in pending.values():
                    eng.abort(rid)
                for i, (st, _) in sorted(pending.items()):
                    finish(i, _last(st, 30.0), True)
                return
            time.sleep(0.02)

    consumer = threading.Thread(target=consume, name="slo-consumer", daemon=True)
    consumer.start()
    phase0, steps0 = dict(eng._phase), eng._steps
    lags: list[float] = []
    t0 = time.monotonic() + 0.05
    for i, w in enumerate(items):
        delay = t0 + w.arrival_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        lags.append(max(0.0, time.monotonic() - (t0 + w.arrival_s)) * 1000.0)
        rid = f"{tag}-{i}"
        try:
            stream = eng.add_request(w.prompt_ids, _sampling(w.max_tokens), SLO(w.ttft_ms, w.tpot_ms,
                                                                               w.output_len_hint), request_id=rid)
        except Exception as e:  # noqa: BLE001 - a refused submission is a miss, not a crash of the benchmark
            now = time.monotonic()
            records[i] = M.RequestRecord(w.tier, w.ttft_ms, w.tpot_ms, now, finish_reason="error", finished_s=now,
                                         reject_reason=f"submit: {e!r}"[:200], prompt_len=len(w.prompt_ids))
            if bar is not None:
                bar.update(1)
            continue
        handoff.put((i, stream, rid))
    deadline[0] = time.monotonic() + drain_s
    handoff.put(None)
    consumer.join()
    if bar is not None:
        bar.close()
    phase1, steps1 = dict(eng._phase), eng._steps
    d = {k: phase1.get(k, 0.0) - phase0.get(k, 0.0) for k in phase1}
    dsteps = steps1 - steps0
    busy = sum(d.values())
    eng_stats = {
        "steps": dsteps,
        "phase_s": d,
        "sched_ms_per_step": d.get("schedule", 0.0) / dsteps * 1000.0 if dsteps else math.nan,
        "sched_pct": d.get("schedule", 0.0) / busy * 100.0 if busy > 0 else math.nan,
        "step_ms": busy / dsteps * 1000.0 if dsteps else math.nan,
    }
    return PointRun([r for r in records if r is not None], t0, lags, eng_stats, timeouts[0])


def _last(stream: Any, timeout: float) -> Any:
    """Read a stream to its final item (None if nothing arrives within `timeout` seconds)."""
    end = time.monotonic() + timeout
    while True:
        try:
            out = stream.get(timeout=max(0.01, end - time.monotonic()))
        except TimeoutError:
            return None
        if out.finished:
            return out


# --------------------------------------------------------------------------- HTTP mode

async def _http_point(url: str, model: str, items: Sequence[W.WorkItem], drain_s: float,
                      transport: Any = None, bar: Any = None) -> PointRun:
    import httpx

    n = len(items)
    records: list[M.RequestRecord | None] = [None] * n
    lags: list[float] = []

    async def one(i: int, w: W.WorkItem, client: httpx.AsyncClient) -> None:
        headers = {"x-slo-ttft-ms": f"{w.ttft_ms:.3f}", "x-slo-tpot-ms": f"{w.tpot_ms:.3f}"}
        if w.output_len_hint is not None:
            headers["x-slo-output-len"] = str(w.output_len_hint)
        body = {"model": model, "prompt": w.prompt_ids, "max_tokens": w.max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        arrival = time.monotonic()
        rec = M.RequestRecord(w.tier, w.ttft_ms, w.tpot_ms, arrival, prompt_len=len(w.prompt_ids))
        records[i] = rec
        chunks = 0
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
                if resp.status_code == 429:
                    await resp.aread()
                    rec.rejected, rec.finish_reason = True, "rejected"
                    rec.reject_reason = resp.headers.get("x-kairos-reject-reason") or "http_429"
                    return
                if resp.status_code != 200:
                    await resp.aread()
                    rec.finish_reason, rec.reject_reason = "error", f"http {resp.status_code}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    now = time.monotonic()
                    if "error" in obj:
                        rec.finish_reason = "error"
                        continue
                    for c in obj.get("choices") or []:
                        if c.get("text"):
                            chunks += 1
                            rec.token_times.append(now)
                            if rec.ttft_s is None:
                                rec.ttft_s = now - arrival
                        if c.get("finish_reason"):
                            rec.finish_reason = c["finish_reason"]
                    if obj.get("usage"):
                        rec.n_out = int(obj["usage"].get("completion_tokens", 0))
        except asyncio.CancelledError:
            rec.finish_reason = "timeout"
            raise
        except Exception as e:  # noqa: BLE001 - a broken connection is a miss
            rec.finish_reason, rec.reject_reason = "error", repr(e)[:200]
        finally:
            rec.n_out = rec.n_out or chunks
            rec.finished_s = time.monotonic()
            if bar is not None:
                bar.update(1)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits,
                                 transport=transport) as client:
        tasks = []
        t0 = time.monotonic() + 0.05
        for i, w in enumerate(items):
            delay = t0 + w.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, time.monotonic() - (t0 + w.arrival_s)) * 1000.0)
            tasks.append(asyncio.create_task(one(i, w, client)))
        done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        give_up = time.monotonic()
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    timeouts = 0
    for r in records:
        if r is not None and r.finish_reason == "timeout":
            r.finished_s = give_up
            timeouts += 1
    return PointRun([r for r in records if r is not None], t0, lags, {}, timeouts)


def run_http_point(url: str, model: str, items: Sequence[W.WorkItem], *, drain_s: float, progress: bool = False,
                   desc: str = "", transport: Any = None) -> PointRun:
    bar = _progress(len(items), desc, progress)
    try:
        return asyncio.run(_http_point(url.rstrip("/"), model, items, drain_s, transport, bar))
    finally:
        if bar is not None:
            bar.close()


def _served_model(url: str) -> str:
    import httpx
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:  # noqa: BLE001
        log.warning("could not read %s/v1/models (%r); sending model=None", url, e)
        return ""


# --------------------------------------------------------------------------- lambda* search

def find_lambda_star(measure: Callable[[float], float], guess: float, *, target: float = TARGET_ADHERENCE,
                     factor: float = 1.6, bisect_steps: int = 2, max_expand: int = 6,
                     out_of_time: Callable[[], bool] = lambda: False) -> tuple[float, list[dict]]:
    """Highest rate with measure(rate) >= target: expand geometrically from `guess`, then bisect (log space).

    `measure(rate)` returns the adherence of a short run. Returns (lambda*, probes). If even the lowest probe
    misses, lambda* is that rate / factor (flagged in the probes); if the highest meets, it is that rate.
    Once `out_of_time()`, bisection stops, and so does the expansion after its first two probes.
    """
    probes: list[dict] = []

    def probe(rate: float) -> bool:
        a = measure(rate)
        probes.append({"rate_rps": rate, "adherence": a})
        log.info("lambda* probe: %.3f rps -> adherence %.3f", rate, a)
        return a >= target

    lo = hi = None
    r = guess
    for k in range(max_expand):
        if k >= 2 and out_of_time():
            probes.append({"note": "expansion cut short by the time budget"})
            break
        if probe(r):
            lo = r
            if hi is not None:
                break
            r *= factor
        else:
            hi = r
            if lo is not None:
                break
            r /= factor
    if lo is None:
        lo = min(p["rate_rps"] for p in probes if "rate_rps" in p) / factor
        probes.append({"note": "never reached the target; lambda* extrapolated one factor below"})
        return lo, probes
    if hi is None:
        probes.append({"note": "target met at every probe; lambda* is the highest rate tried"})
        return lo, probes
    for _ in range(bisect_steps):
        if out_of_time():
            probes.append({"note": "bisection cut short by the time budget"})
            break
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def capacity_guess(predictor: Any, scale: W.SLOScale) -> float:
    """A rough FCFS-lambda* starting point (rps): 40% of the rate that one request's prefill plus its share of
    decode steps at B=4 allows (FCFS loses the strict tier's d4 TPOT well before the engine saturates)."""
    per_req_ms = predictor.prefill_ms(scale.mean_prompt) + scale.mean_output * predictor.itl_ms(4, scale.l_bar) / 4
    return max(0.02, 0.4 * 1000.0 / max(per_req_ms, 1e-3))


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
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine (protocol: 1)")
    ap.add_argument("--reprofile", action="store_true",
                    help="fit a fresh latency profile now (saved in --out) instead of the cached one: SLOs then "
                         "match the machine's current speed (+~15 s)")
    ap.add_argument("--predictor-json", default=None,
                    help="latency-model JSON for the SLO scaling (HTTP mode; default: profile a local engine)")
    # HTTP
    ap.add_argument("--target", default=None, help="URL of a running Kairos server (POST /v1/completions)")
    ap.add_argument("--label", default="server", help="policy label for the results in HTTP mode")
    # output
    ap.add_argument("--out", default=None, help="output directory (default bench/out/slo-<timestamp>)")
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
        if p not in ALL_POLICIES and not args.target:
            raise SystemExit(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
    loads = _floats(args.loads or (QUICK_LOADS if q else DEFAULT_LOADS))
    if not loads or any(x <= 0 for x in loads):
        raise SystemExit("--loads must be positive multiples of lambda*")
    seeds = _ints(args.seeds)
    fixed = args.num_requests is not None
    budget = args.budget_min if args.budget_min is not None else (0.0 if fixed else (3.0 if q else 30.0))
    return Plan(policies, loads, seeds or [0], args.num_requests or (60 if q else 400), fixed,
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

    def start(self, policy: str):
        from engine.config import EngineConfig
        from engine.engine import LLMEngine
        from scheduling.config import SchedulerConfig

        a = self.args
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(
            model=self.model_path(), dtype=a.dtype, device="cpu", num_threads=a.engine_threads,
            scheduler=SchedulerConfig(policy=policy, max_num_seqs=a.max_num_seqs,
                                      prefill_max_tokens=a.prefill_max_tokens, predictor_path=self.predictor_path)))
        self.start_s[policy] = time.perf_counter() - t0
        return eng


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
    return {
        "policy": policy, "load_multiple": load, "rate_rps": rate, **s,
        "timeouts": sum(r.timeouts for _, r in runs),
        "sched_ms_per_step": sched / steps * 1000.0 if steps else None,
        "sched_pct": sched / busy * 100.0 if busy > 0 and steps else None,
        "step_ms": busy / steps * 1000.0 if steps else None,
        "steps": steps,
        "engine_busy_pct": busy / wall * 100.0 if wall > 0 and eng else None,
        "submit_lag_p99_ms": percentile(lags, 99) if lags else None,
        "per_seed": per_seed, **M.pool([p for p in per_seed]),
    }


CSV_FIELDS = ("policy", "load_multiple", "rate_rps", "goodput_rps", "adherence", "n", "good", "rejected",
              "rejection_rate", "ttft_violations", "tpot_violations", "incomplete", "timeouts", "token_throughput",
              "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "sched_ms_per_step", "sched_pct",
              "step_ms", "engine_busy_pct", "wall_s", "submit_lag_p99_ms")


def write_csv(path: Path, results: Sequence[dict], tiers: Sequence[str]) -> None:
    cols = list(CSV_FIELDS)
    for t in tiers:
        cols += [f"{t}_adherence", f"{t}_ttft_p50_ms", f"{t}_ttft_p99_ms", f"{t}_tpot_p50_ms", f"{t}_tpot_p99_ms"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            row = [r.get(c) for c in CSV_FIELDS]
            for t in tiers:
                pt = r.get("per_tier", {}).get(t, {})
                row += [pt.get("adherence"), pt.get("ttft_p50_ms"), pt.get("ttft_p99_ms"), pt.get("tpot_p50_ms"),
                        pt.get("tpot_p99_ms")]
            w.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else
                        (f"{v:.6g}" if isinstance(v, float) else v) for v in row])


def load_table(results: Sequence[dict], load: float, tiers: Sequence[str]) -> str:
    rows = []
    for r in results:
        if r["load_multiple"] != load:
            continue
        pt = r.get("per_tier", {})
        rows.append([r["policy"], r["goodput_rps"], 100 * r["adherence"],
                     *[100 * pt.get(t, {}).get("adherence", math.nan) for t in tiers],
                     100 * r["rejection_rate"], r["ttft_violations"], r["tpot_violations"], r["incomplete"],
                     r["token_throughput"], r["sched_ms_per_step"], r["sched_pct"]])
    rate = next((r["rate_rps"] for r in results if r["load_multiple"] == load), math.nan)
    heads = ["policy", "goodput rps", "adh %", *[f"{TIER_SHORT.get(t, t)} %" for t in tiers], "rej %",
             "TTFT viol", "TPOT viol", "incompl", "tok/s", "sched ms/step", "sched %"]
    n = next((r["n"] for r in results if r["load_multiple"] == load), 0)
    return _table(heads, rows, f"load {load:g}x lambda* = {rate:.3f} rps  (n = {n} per policy after warm-up)")


def acceptance(results: Sequence[dict], at: float = CHECK_LOAD) -> dict[str, Any]:
    """The §4 checks at the load nearest to `at`×lambda*."""
    loads = sorted({r["load_multiple"] for r in results})
    if not loads:
        return {}
    load = min(loads, key=lambda x: (abs(x - at), -x))
    by = {r["policy"]: r for r in results if r["load_multiple"] == load}
    out: dict[str, Any] = {"load_multiple": load}
    f, s, k = by.get("fcfs"), by.get("scorpio"), by.get("kairos")
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
    if not acc:
        return ""
    lines = [f"\nAcceptance checks at {acc['load_multiple']:g}x lambda*:"]
    if "scorpio_over_fcfs_goodput" in acc:
        lines.append(f"  scorpio / fcfs goodput        : {acc['scorpio_over_fcfs_goodput']:.2f}x")
        lines.append(f"  scorpio - fcfs adherence      : {acc['scorpio_minus_fcfs_adherence_pts']:+.1f} pts")
    if "kairos_goodput_ge_scorpio" in acc:
        lines.append(f"  kairos >= scorpio (goodput)   : {_fmt(acc['kairos_goodput_ge_scorpio'])}"
                     f" ({acc['kairos_goodput_rps']:.3f} vs {acc['scorpio_goodput_rps']:.3f} rps; adherence: "
                     f"{_fmt(acc['kairos_adherence_ge_scorpio'])}, "
                     f"{acc['kairos_minus_scorpio_adherence_pts']:+.1f} pts)")
    if "kairos_over_fcfs_goodput" in acc:
        lines.append(f"  kairos / fcfs goodput         : {acc['kairos_over_fcfs_goodput']:.2f}x")
    if "ttft_violations_fcfs_vs_edf_reject" in acc:
        a, b = acc["ttft_violations_fcfs_vs_edf_reject"]
        lines.append(f"  TTFT violations fcfs -> edf_reject : {a} -> {b}")
    if "tpot_violations_fcfs_vs_tpot_guard" in acc:
        a, b = acc["tpot_violations_fcfs_vs_tpot_guard"]
        lines.append(f"  TPOT violations fcfs -> tpot_guard : {a} -> {b}")
    return "\n".join(lines)


def _records_lines(policy: str, load: float, seed: int, run: PointRun, warmup: float) -> list[str]:
    kept = {id(r) for r in M.drop_warmup(run.records, warmup)}
    out = []
    for r in sorted(run.records, key=lambda r: r.arrival_s):
        t = M.tpot_s(r)
        out.append(json.dumps(clean({
            "policy": policy, "load_multiple": load, "seed": seed, "tier": r.tier, "warmup": id(r) not in kept,
            "arrival_s": r.arrival_s - run.started_s, "rejected": r.rejected, "finish_reason": r.finish_reason,
            "reject_reason": r.reject_reason, "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000.0,
            "tpot_ms": None if t is None else t * 1000.0, "n_out": r.n_out, "prompt_len": r.prompt_len,
            "ttft_slo_ms": r.ttft_slo_ms, "tpot_slo_ms": r.tpot_slo_ms, "good": M.is_good(r),
            "end_s": r.end_s - run.started_s})))
    return out


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
    eng = None
    if http:
        order = list(policies)
        model_name = _served_model(args.target)
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
            f"fit r2={_fmt(pred_info['r2'], 3)} mape={_fmt(pred_info['mape'], 3)}]", flush=True)

    def run_items(items: list[W.WorkItem], desc: str, tag: str) -> PointRun:
        drain = _drain_for(items, args.drain)
        if http:
            return run_http_point(args.target, model_name, items, drain_s=drain, progress=progress, desc=desc)
        return run_engine_point(eng, items, drain_s=drain, tag=tag, progress=progress, desc=desc)

    # ---- lambda*
    search: dict[str, Any] = {}
    if args.lambda_star is not None:
        lam = float(args.lambda_star)
        search = {"given": True}
    else:
        guess = capacity_guess(predictor, scale)
        probe_no = [0]

        def measure(rate: float) -> float:
            n = args.probe_requests or int(min(plan.probe_bounds[1], max(plan.probe_bounds[0],
                                                                       rate * plan.probe_seconds)))
            items = W.generate(replace(base, num_requests=n, rate_rps=rate, seed=plan.seeds[0]), scale.tiers)
            probe_no[0] += 1
            run = run_items(items, f"lambda* probe {rate:.2f} rps", f"probe{probe_no[0]}")
            a = M.summarize(run.records, warmup_frac=args.warmup_frac)["adherence"]
            print(f"  lambda* probe {probe_no[0]}: {rate:.3f} rps, n={n} -> FCFS adherence {100 * a:.1f}%",
                  flush=True)
            return a

        t0 = time.perf_counter()
        search_end = t_start + (0.25 * plan.budget_s if plan.budget_s > 0 else math.inf)
        lam, probes = find_lambda_star(measure, guess, bisect_steps=plan.bisect_steps,
                                       max_expand=4 if args.quick else 6,
                                       out_of_time=lambda: time.perf_counter() > search_end)
        search = {"guess_rps": guess, "probes": probes, "seconds": time.perf_counter() - t0,
                  "target_adherence": TARGET_ADHERENCE, "policy": "fcfs" if not http else args.label}
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
    starts = 0.0 if http else max(engines.start_s.values()) * (len(order) - 1)
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

    # ---- sweep
    results: list[dict[str, Any]] = []
    rec_path = out_dir / "records.jsonl"
    rec_path.write_text("")
    for pi, policy in enumerate(order):
        if not http and pi > 0:
            eng.shutdown()
            eng = None
            free_memory()
            eng = engines.start(policy)
        if policy not in policies:
            continue
        for load, rate in zip(plan.loads, rates):
            runs = []
            for seed in plan.seeds:
                items = W.generate(replace(base, num_requests=n_req, rate_rps=rate, seed=seed), scale.tiers)
                run = run_items(items, f"{policy} {load:g}x seed {seed}", f"{policy}-{load:g}-{seed}")
                runs.append((seed, run))
                with open(rec_path, "a") as f:
                    f.write("\n".join(_records_lines(policy, load, seed, run, args.warmup_frac)) + "\n")
            r = _summarize_point(policy, load, rate, runs, args.warmup_frac, tiers)
            if eng is not None:  # this engine's fit (same cached profile for all; kairos refits online)
                rep = eng.profile_report or {}
                pe = eng.scheduler.predictor
                r["predictor"] = {"r2": rep.get("r2"), "mape": rep.get("mape_holdout", rep.get("mape_train")),
                                  "decode_coef_end": list(pe.decode_coef) if pe is not None else None,
                                  "prefill_coef_end": list(pe.prefill_coef) if pe is not None else None}
            results.append(r)
            print(f"  {policy:<11} {load:>4g}x {rate:6.3f} rps: goodput {r['goodput_rps']:.3f} rps, adherence "
                  f"{100 * r['adherence']:5.1f}%, rejected {r['rejected']}, TTFT/TPOT viol "
                  f"{r['ttft_violations']}/{r['tpot_violations']}, timeouts {r['timeouts']}  "
                  f"[{time.perf_counter() - t_start:.0f}s, load {loadavg().split(' ')[0]}]", flush=True)
    if eng is not None:
        eng.shutdown()

    # ---- report
    for load in plan.loads:
        print(load_table(results, load, tiers))
    acc = acceptance(results)
    print(format_acceptance(acc))
    wall = time.perf_counter() - t_start
    info["loadavg_end"] = loadavg()
    doc = {
        "benchmark": "slo",
        "lambda_star_rps": lam,
        "lambda_star_search": search,
        "config": {
            "mode": "http" if http else "engine", "target": args.target, "model": args.model, "dtype": args.dtype,
            "engine_threads": args.engine_threads, "max_num_seqs": args.max_num_seqs,
            "prefill_max_tokens": args.prefill_max_tokens, "policies": policies, "loads": plan.loads,
            "seeds": plan.seeds, "num_requests_per_point": n_req, "num_requests_fixed": plan.n_fixed,
            "budget_min": plan.budget_s / 60.0, "arrival": args.arrival, "gamma_shape": base.gamma_shape,
            "mix": dict(zip(tiers, mix)), "hint": args.hint, "warmup_frac": args.warmup_frac,
            "strict_batch": args.strict_batch, "loose_batch": args.loose_batch, "tpot_headroom": args.tpot_headroom, "reprofile": args.reprofile,
            "quick": args.quick, "drain_s": args.drain, "prompt_len": _dist(base.prompt),
            "output_len": _dist(base.output), "engine_start_s": engines.start_s,
            "workload": W.describe(W.generate(replace(base, num_requests=n_req, rate_rps=lam, seed=plan.seeds[0]),
                                              scale.tiers)),
        },
        "predictor": pred_info,
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


def _dist(d: W.LengthDist) -> dict[str, Any]:
    return {"median": d.median, "sigma": d.sigma, "cap": d.cap, "min": d.min_len}


if __name__ == "__main__":
    raise SystemExit(main())
