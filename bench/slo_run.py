"""Running one load point of bench.slo: open-loop against the in-process engine, or over HTTP (SSE)."""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import slo_metrics as M
from bench import workload as W
from bench.common import SSE_DONE, parse_server_timing, sse_data, summarize
from bench.slo_steps import StepTap

log = logging.getLogger("kairos.bench.slo")


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return None
    if not enabled:
        return None
    # disable=None: no bar when stderr is not a terminal (a log file would get a line per update)
    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True, file=sys.stderr, disable=None)


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
    tap = StepTap(eng.scheduler)
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
    taps = tap.close()
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
        "tap": taps,
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
                rec.hops = _hops(resp.headers.get("server-timing"), (time.monotonic() - arrival) * 1000.0)
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
                    obj = sse_data(line)
                    if obj is None:
                        continue
                    if obj == SSE_DONE:
                        break
                    now = time.monotonic()
                    if "error" in obj:
                        rec.finish_reason = "error"
                        continue
                    for c in obj.get("choices") or []:
                        if "text" in c:  # one chunk per delivery of >= 1 token (its text may be '' mid-character)
                            chunks += 1
                            rec.token_times.append(now)
                            if rec.ttft_s is None:
                                rec.ttft_s = now - arrival
                                if "headers" in rec.hops:
                                    rec.hops["body"] = rec.ttft_s * 1000.0 - rec.hops["headers"]
                        if c.get("finish_reason"):
                            rec.finish_reason = c["finish_reason"]
                    if obj.get("usage"):
                        rec.n_out = int(obj["usage"].get("completion_tokens", 0))
                        em = obj.get("kairos_metrics") or {}
                        for k in ("ttft", "tpot"):
                            if em.get(f"{k}_ms") is not None:
                                rec.hops[f"engine_{k}"] = float(em[f"{k}_ms"])
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


HOPS = ("client_proxy", "parse", "route", "replica", "body", "engine_ttft", "engine_tpot")
HOP_NOTES = {
    "client_proxy": "request sent -> response headers, minus the ingress's own time: client, HTTP proxy, proxy->ingress",
    "parse": "ingress: read and validate the body",
    "route": "ingress -> replica handle call: routing and transport, both ways",
    "replica": "replica: tokenize, engine queue, prefill, first output",
    "body": "response headers -> first token chunk at the client",
    "engine_ttft": "TTFT as the engine measured it (add_request -> first token), from the usage chunk",
    "engine_tpot": "TPOT as the engine measured it; the client's TPOT minus this is what delivery adds",
}


def _hops(server_timing: str | None, headers_ms: float) -> dict[str, float]:
    """One request's split of its time to first token, from the ingress's Server-Timing header."""
    st = parse_server_timing(server_timing)
    hops = {"headers": headers_ms, **st}
    if st:
        hops["client_proxy"] = headers_ms - sum(st.values())
    return hops


def hop_summary(records: Sequence[M.RequestRecord]) -> dict[str, dict[str, float]]:
    """n/min/mean/max and p50/p90/p99 per hop over the requests that reported one (HTTP mode)."""
    out: dict[str, dict[str, float]] = {}
    for hop in HOPS:
        xs = [r.hops[hop] for r in records if hop in r.hops]
        if xs:
            out[hop] = summarize(xs)
    return out


def run_http_point(url: str, model: str, items: Sequence[W.WorkItem], *, drain_s: float, progress: bool = False,
                   desc: str = "", transport: Any = None) -> PointRun:
    bar = _progress(len(items), desc, progress)
    try:
        return asyncio.run(_http_point(url.rstrip("/"), model, items, drain_s, transport, bar))
    finally:
        if bar is not None:
            bar.close()


def served_model(url: str) -> str:
    import httpx
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:  # noqa: BLE001
        log.warning("could not read %s/v1/models (%r); sending model=None", url, e)
        return ""
