"""bench.soak's observers: per-minute windows, process RSS, the replicas' stats and KV, and a local app."""
from __future__ import annotations

import argparse
import math
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.common import loadavg, percentile

# ------------------------------------------------------------------------------------------------ observation
def outcomes(results: list[dict[str, Any]], ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of `results` by outcome (`ok`: the served ones), by route and by request kind."""
    return {
        "sent": len(results), "served": len(ok),
        "served_by": {"stream": sum(x["stream"] for x in ok), "chat": sum(x["chat"] for x in ok),
                      "slo": sum(x["slo"] for x in ok)},
        "disconnected": dict(Counter(x["kind"] for x in results if x["outcome"] == "disconnected")),
        "rejected": dict(Counter(x["kind"] for x in results if x["outcome"] == "rejected")),
        "errors": dict(Counter(x["kind"] for x in results if x["outcome"] == "error")),
    }


@dataclass
class Window:
    index: int
    start_s: float
    results: list[dict[str, Any]] = field(default_factory=list)
    backlog: int = 0

    def summary(self, end_s: float, rss: dict[str, list[float]], inflight: int) -> dict[str, Any]:
        r = self.results
        ok = [x for x in r if x["outcome"] == "ok"]
        ttft = [x["ttft"] for x in ok if x["ttft"] is not None]
        e2e = [x["e2e"] for x in ok if x["e2e"] is not None]
        nan = lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else v  # noqa: E731
        return {
            "window": self.index, "start_s": round(self.start_s, 1), "end_s": round(end_s, 1),
            **outcomes(r, ok),
            "client_backlog": self.backlog,
            "ttft_p50_s": nan(percentile(ttft, 50)), "ttft_p99_s": nan(percentile(ttft, 99)),
            "e2e_p50_s": nan(percentile(e2e, 50)), "e2e_p99_s": nan(percentile(e2e, 99)),
            "rss_mb": rss, "inflight_at_end": inflight, "loadavg": loadavg(),
        }


def fmt_window(w: dict[str, Any], unit: str) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

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
    """Replica stats through a deployment handle (needs Ray access); None when unavailable."""

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

    def num_replicas(self) -> int:
        from ray import serve

        try:
            dep = serve.status().applications[self.app].deployments["LLMServer"]
            return int(dep.replica_states.get("RUNNING", 0)) or 1
        except Exception:  # noqa: BLE001
            return 1

    def replica_stats(self, timeout_s: float = 20.0) -> dict[str, dict]:
        want = self.num_replicas()
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(seen) < want and time.monotonic() < deadline:
            st = self.handle.stats.remote().result(timeout_s=timeout_s)
            seen[st["replica"]] = st
        return seen

    def quiesce(self, timeout_s: float) -> tuple[bool, dict[str, dict]]:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.replica_stats()
            idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["inflight"] == 0 for s in stats.values())
            if idle or time.monotonic() > deadline:
                return idle, stats
            time.sleep(0.5)


# ------------------------------------------------------------------------------------------------ local app
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalApp:
    """The Kairos app in this process: on the running Ray/Serve if there is one, else on a fresh local Ray."""

    def __init__(self, a: argparse.Namespace) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import ray
        from ray import serve

        from deployments import build_app

        self.name = a.app_name or "kairos-soak"
        self.own_ray = not ray.is_initialized()
        if self.own_ray:
            ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        self.own_serve = client is None
        if self.own_serve:
            serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
            client = _get_global_client()
        http = client.http_config
        host = "127.0.0.1" if http.host in ("0.0.0.0", "::", "", None) else http.host
        self.prefix = "/" if self.own_serve else f"/{self.name}"
        args: dict[str, Any] = {"model": a.model, "num_replicas": a.num_replicas, "num_threads": 1,
                                "served_model_name": a.model, "num_kv_blocks": 512}  # 8k tokens, not 1 GiB
        for kv in a.app_arg:
            k, _, v = kv.partition("=")
            args[k.strip()] = v.strip()
        t0 = time.monotonic()
        serve.run(build_app(args), name=self.name, route_prefix=self.prefix, blocking=False)
        self.startup_s = time.monotonic() - t0
        self.url = f"http://{host}:{http.port}{'' if self.prefix == '/' else self.prefix}"

    def close(self) -> None:
        import ray
        from ray import serve

        try:
            serve.delete(self.name)
        finally:
            if self.own_serve:
                serve.shutdown()
            if self.own_ray:
                ray.shutdown()
