"""Soak test: a mixed, open-loop workload for a long time; per-window health figures; KV leak check at the end.

    python -m bench.soak                                   # 10 min against an in-process app (kairos-tiny x 2)
    python -m bench.soak --duration-s 30 --report-every-s 10 --json /tmp/soak.json
    python -m bench.soak --target http://127.0.0.1:8000 --app-name default   # a running server (same host: RSS,
                                                                              # and KV via Ray if reachable)
Workload (seeded): completions and chat, streaming and not, some with SLO headers, some streams dropped early
(before the first byte, right after the headers, or after k chunks). Every request asks for an exact number of
tokens (ignore_eos), so a short answer is detected. Each window (--report-every-s, default 60 s) prints requests
served, rejections (429) and errors by kind, p99 TTFT and E2E, and the RSS of the app's replicas (psutil over the
Ray worker processes, same host only). At the end the load stops, the replicas must go idle, and the KV blocks
still in use (total - free, per replica) are reported: any leak -> exit code 1 (--fail-on-errors: errors -> 2).

Without --target, the app is started in this process: on the Ray/Serve instance already running here (e.g. a test
session; deployed as a separate application and deleted afterwards), else on a fresh local Ray with Serve on a
free port (shut down afterwards).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from bench.common import percentile, run_info, write_json
from bench.soak_observe import Inspector, LocalApp, Window, outcomes, fmt_window, process_rss_mb

WORDS = ("time river model cache token latency budget signal amber forest quiet engine north winter paper "
         "orbit silver garden thread margin spark window harbor ledger canvas echo").split()


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--duration-s", type=float, default=600.0, help="how long to offer load (default 600)")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate, requests/s (Poisson; default 4)")
    p.add_argument("--report-every-s", type=float, default=60.0, help="window of the periodic report (default 60)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON here")
    p.add_argument("--target", metavar="URL", help="a running server (default: start the app in this process)")
    p.add_argument("--app-name", help="Serve application to inspect (default: kairos-soak in-process, "
                                      "'default' with --target)")
    p.add_argument("--ray-address", default="auto", help="Ray cluster of --target for the KV check (default auto)")
    p.add_argument("--api-key", default=os.environ.get("KAIROS_API_KEY"), help="Bearer key (env KAIROS_API_KEY)")
    p.add_argument("--model", default="kairos-tiny", help="in-process app: model (default kairos-tiny)")
    p.add_argument("--num-replicas", type=int, default=2, help="in-process app: LLM replicas (default 2)")
    p.add_argument("--app-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="in-process app: extra build_app argument (repeatable), e.g. policy=edf; defaults: "
                        "num_threads=1 num_kv_blocks=512")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"),
                   help="tokens per request, uniform (default 8 64)")
    p.add_argument("--stream-frac", type=float, default=0.6)
    p.add_argument("--chat-frac", type=float, default=0.5)
    p.add_argument("--slo-frac", type=float, default=0.25, help="share of requests with x-slo-* headers")
    p.add_argument("--disconnect-frac", type=float, default=0.1, help="share of streams the client drops early")
    p.add_argument("--max-inflight", type=int, default=128, help="client-side cap; arrivals beyond it are "
                                                                   "counted as client_backlog and not sent")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request client timeout")
    p.add_argument("--quiesce-timeout-s", type=float, default=60.0, help="wait for idle replicas at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-on-errors", action="store_true", help="exit 2 when any request failed unexpectedly")
    a = p.parse_args(argv)
    if a.duration_s <= 0 or a.rate <= 0 or a.report_every_s <= 0:
        p.error("--duration-s, --rate and --report-every-s must be positive")
    if not 1 <= a.max_tokens[0] <= a.max_tokens[1]:
        p.error("--max-tokens needs 1 <= MIN <= MAX")
    return a


# ------------------------------------------------------------------------------------------------ workload
@dataclass
class Spec:
    i: int
    chat: bool
    stream: bool
    slo: dict[str, str]
    max_tokens: int
    prompt: str
    drop_at: int | None  # None: read everything; -1: before the first byte; 0: after headers; k: after k chunks
    drop_delay_s: float = 0.0


def make_spec(i: int, rng: random.Random, a: argparse.Namespace) -> Spec:
    stream = rng.random() < a.stream_frac
    mt = rng.randint(*a.max_tokens)
    slo: dict[str, str] = {}
    if rng.random() < a.slo_frac:
        slo["x-slo-ttft-ms"] = str(rng.choice([1000, 3000, 10000]))
        if rng.random() < 0.5:
            slo["x-slo-tpot-ms"] = str(rng.choice([200, 500, 1000]))
    drop = None
    if stream and rng.random() < a.disconnect_frac:
        drop = rng.choice([-1, 0] + list(range(1, max(2, mt // 2))))
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
    return Spec(i, rng.random() < a.chat_frac, stream, slo, mt, prompt, drop, rng.uniform(0.0, 0.1))


def _body(s: Spec) -> dict[str, Any]:
    b: dict[str, Any] = {"max_tokens": s.max_tokens, "ignore_eos": True, "stream": s.stream, "temperature": 0.8,
                         "seed": s.i}
    if s.stream:
        b["stream_options"] = {"include_usage": True}
    if s.chat:
        b["messages"] = [{"role": "system", "content": "You are a soak test."}, {"role": "user", "content": s.prompt}]
    else:
        b["prompt"] = s.prompt
    return b


async def run_one(ac: Any, s: Spec, timeout_s: float) -> dict[str, Any]:
    """One request; returns {"outcome": ok|disconnected|rejected|error, "kind": ..., "ttft", "e2e"}."""
    import httpx

    path = "v1/chat/completions" if s.chat else "v1/completions"
    res: dict[str, Any] = {"chat": s.chat, "stream": s.stream, "slo": bool(s.slo), "ttft": None, "e2e": None}
    t0 = time.monotonic()

    async def go() -> None:
        async with ac.stream("POST", path, json=_body(s), headers=s.slo) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    code = json.loads(raw)["error"].get("code")
                except (ValueError, KeyError, TypeError, AttributeError):
                    code = "non_json"
                if r.status_code == 429:
                    res.update(outcome="rejected", kind=str(code))
                    if not r.headers.get("retry-after"):
                        res.update(outcome="error", kind="429_without_retry_after")
                else:
                    res.update(outcome="error", kind=f"http_{r.status_code}:{code}")
                return
            if s.drop_at == 0:
                res.update(outcome="disconnected", kind="after_headers")
                return
            if not s.stream:
                body = json.loads(await r.aread())
                n = body["usage"]["completion_tokens"]
                res["e2e"] = time.monotonic() - t0
                res.update(outcome="ok", kind="ok") if n == s.max_tokens else \
                    res.update(outcome="error", kind="token_count_mismatch")
                return
            chunks, usage, error, done = 0, None, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    error = ev["error"].get("message", "?")
                    continue
                if ev.get("usage"):
                    usage = ev["usage"]
                ch = ev.get("choices") or []
                if ch and (ch[0].get("text") or (ch[0].get("delta") or {}).get("content")):
                    if res["ttft"] is None:
                        res["ttft"] = time.monotonic() - t0
                    chunks += 1
                    if s.drop_at is not None and chunks >= s.drop_at:
                        res.update(outcome="disconnected", kind="after_chunks")
                        return
            res["e2e"] = time.monotonic() - t0
            if error is not None:
                res.update(outcome="error", kind="stream_error_event", message=error)
            elif not done:
                res.update(outcome="error", kind="stream_without_done")
            elif not usage or usage["completion_tokens"] != s.max_tokens:
                res.update(outcome="error", kind="token_count_mismatch")
            else:
                res.update(outcome="ok", kind="ok")

    try:
        if s.drop_at == -1:
            try:
                await asyncio.wait_for(go(), timeout=s.drop_delay_s)
            except asyncio.TimeoutError:
                res.update(outcome="disconnected", kind="before_first_byte")
        else:
            await asyncio.wait_for(go(), timeout=timeout_s)
    except asyncio.TimeoutError:
        res.update(outcome="error", kind="client_timeout")
    except httpx.HTTPError as e:
        res.update(outcome="error", kind=f"transport:{type(e).__name__}")
    except (ValueError, KeyError, TypeError) as e:
        res.update(outcome="error", kind=f"bad_response:{type(e).__name__}")
    res.setdefault("outcome", "error")
    res.setdefault("kind", "unknown")
    return res


# ------------------------------------------------------------------------------------------------ main loop
async def offer_load(a: argparse.Namespace, url: str, app: str | None,
                     log: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Open-loop Poisson arrivals for --duration-s; returns (window summaries, every request's result).
    A result counts in the window in which the request *ended*; the tail after the load stops goes to the totals."""
    import httpx

    rng = random.Random(a.seed)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.max_inflight + 8, max_keepalive_connections=32)
    windows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    unit = "minute" if a.report_every_s == 60 else "window"
    async with httpx.AsyncClient(base_url=url.rstrip("/") + "/", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(a.timeout_s)) as ac:
        t_start = time.monotonic()
        t_end = t_start + a.duration_s
        cur = [Window(1, 0.0)]
        pending: set[asyncio.Task] = set()

        def done(task: asyncio.Task) -> None:
            pending.discard(task)
            r = task.result()
            results.append(r)
            cur[0].results.append(r)

        i, t_next = 0, t_start
        next_report = min(t_start + a.report_every_s, t_end)
        while True:
            now = time.monotonic()
            if now >= next_report:
                rss = await asyncio.to_thread(process_rss_mb, app)
                w = cur[0].summary(now - t_start, rss, len(pending))
                windows.append(w)
                log(fmt_window(w, unit))
                if now >= t_end - 1e-3:
                    break
                cur[0] = Window(cur[0].index + 1, now - t_start)
                next_report = min(next_report + a.report_every_s, t_end)
                continue
            if now >= t_next:
                if len(pending) >= a.max_inflight:
                    cur[0].backlog += 1
                else:
                    task = asyncio.create_task(run_one(ac, make_spec(i, rng, a), a.timeout_s))
                    pending.add(task)
                    task.add_done_callback(done)
                i += 1
                t_next += rng.expovariate(a.rate)
                continue
            await asyncio.sleep(max(0.0, min(t_next, next_report) - time.monotonic()))
        if pending:  # let the tail finish (bounded by the per-request timeout)
            log(f"[soak] load stopped; waiting for {len(pending)} requests in flight")
            await asyncio.wait(set(pending), timeout=a.timeout_s + 5)
    return windows, results


def _totals(all_results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [x for x in all_results if x["outcome"] == "ok"]
    return {
        **outcomes(all_results, ok),
        "ttft_p50_s": percentile([x["ttft"] for x in ok if x["ttft"] is not None], 50),
        "ttft_p99_s": percentile([x["ttft"] for x in ok if x["ttft"] is not None], 99),
        "e2e_p50_s": percentile([x["e2e"] for x in ok if x["e2e"] is not None], 50),
        "e2e_p99_s": percentile([x["e2e"] for x in ok if x["e2e"] is not None], 99),
    }


def main(argv: Sequence[str] | None = None, log: Any = None) -> int:
    a = parse_args(argv)
    log = log or (lambda s: print(s, flush=True))
    info = run_info("bench.soak", argv)
    local = None
    if a.target:
        url, app = a.target, a.app_name or "default"
    else:
        local = LocalApp(a)
        url, app = local.url, local.name
        log(f"[soak] in-process app {app!r} ({a.model} x {a.num_replicas}) ready at {url} in {local.startup_s:.1f}s")
    try:
        inspector = Inspector(app, None if local else a.ray_address)
        if inspector.handle is None:
            log(f"[soak] no replica stats ({inspector.why}): the KV leak check will be skipped")
        rss_start = process_rss_mb(app)
        log(f"[soak] offering {a.rate:g} req/s for {a.duration_s:g}s to {url} (report every {a.report_every_s:g}s)")
        windows, results = asyncio.run(offer_load(a, url, app, log))
        totals = _totals(results)
        kv: dict[str, Any] = {"checked": False}
        if inspector.handle is not None:
            idle, stats = inspector.quiesce(a.quiesce_timeout_s)
            leaked = {rid: s["kv_blocks_total"] - s["kv_blocks_free"] for rid, s in stats.items()}
            kv = {"checked": True, "quiesced": idle, "leaked": sum(leaked.values()), "by_replica": leaked,
                  "replicas": {rid: {k: s.get(k) for k in ("kv_blocks_total", "kv_blocks_free", "num_running",
                                                           "num_waiting", "inflight", "aborted", "rss_bytes")}
                               for rid, s in stats.items()}}
        rss_end = process_rss_mb(app)
    finally:
        if local is not None:
            local.close()

    log(f"[soak] total: sent {totals['sent']}, served {totals['served']} (stream {totals['served_by']['stream']}, "
        f"chat {totals['served_by']['chat']}, slo {totals['served_by']['slo']}), disconnected "
        f"{sum(totals['disconnected'].values())} {totals['disconnected']}, rejected {totals['rejected']}, "
        f"errors {totals['errors']}; TTFT p50/p99 {totals['ttft_p50_s']:.3f}/{totals['ttft_p99_s']:.3f}s, "
        f"E2E p50/p99 {totals['e2e_p50_s']:.3f}/{totals['e2e_p99_s']:.3f}s")
    log(f"[soak] RSS MB start {rss_start} -> end {rss_end}")
    code = 0
    if kv["checked"]:
        log(f"[soak] KV blocks leaked after quiescence: {kv['leaked']} (per replica total-free: {kv['by_replica']}; "
            f"quiesced={kv['quiesced']})")
        if kv["leaked"] or not kv["quiesced"]:
            code = 1
    else:
        log("[soak] KV blocks leaked: not checked (no replica stats)")
    if code == 0 and a.fail_on_errors and totals["errors"]:
        code = 2
    if a.json:
        write_json(a.json, {"run": info, "args": vars(a), "url": url, "app": app, "windows": windows,
                            "totals": totals, "kv": kv, "rss_mb_start": rss_start, "rss_mb_end": rss_end,
                            "exit_code": code})
    log(f"[soak] exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
