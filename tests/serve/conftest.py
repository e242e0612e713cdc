"""ONE Ray + Serve instance for all serving tests (package-scoped: it stops after the last of them) (cold start is
the expensive part on 2 cores), with one session app and the side apps of the modules that need their own.

The session app: kairos-tiny in float32, 2 LLM replicas (so routing is observable), a small KV cache, 1 torch thread
per replica, a 64 KiB body cap. Tests talk real HTTP to 127.0.0.1:8000 and use a handle for replica stats. A side app
(`SideApp`) is deployed with it, at once, and deleted by its module.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# A replica that serves HTTP behind HAProxy stays reachable this long after it is told to stop, so that load
# balancers can deregister it (5 s by default, `deployments.haproxy_ingress.DRAIN_S`). Nothing but Serve's own
# HAProxy sends to the test apps, and each deletion would wait it out.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")

APP_NAME = "kairos-test"
BASE_URL = "http://127.0.0.1:8000"
MAX_BODY = 64 * 1024
TEST_ARGS = dict(model="kairos-tiny", dtype="float32", num_replicas=2, num_kv_blocks=128, block_size=16,
                 num_threads=1, max_num_seqs=16, max_body_bytes=MAX_BODY, served_model_name="kairos-tiny",
                 routing_stats_period_s=1.0, metrics_interval_s=0.5, health_check_period_s=2.0, reroute_rejected=1,
                 tool_call_parser="hermes")  # (kairos-tiny's template shows no format: as vLLM's --tool-call-parser)


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    """Poll `url`/health until it answers 200, as a load balancer's readiness probe would: the Ingress answers 503
    `starting` until an LLM replica has answered it (`deployments.ingress.Readiness`)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url + "/health", timeout=10)
        if r.status_code == 200:
            assert r.json() == {"status": "ok"}
            return
        assert r.status_code == 503 and r.json() == {"status": "starting"}, r.text
        assert r.headers["retry-after"] == "1"
        assert time.monotonic() < deadline, f"{url} not ready after {timeout_s:.0f} s"
        time.sleep(0.05)


def _order(item) -> int:
    """0: a unit (no session app); 1: an app test of a module that must run alone (RUNS_ALONE); 2: the others."""
    if "serve_app" not in getattr(item, "fixturenames", ()):
        return 0
    return 1 if getattr(getattr(item, "module", None), "RUNS_ALONE", False) else 2


def pytest_collection_modifyitems(session, config, items) -> None:
    """Within this package, the tests that need no session app (units) run first, so that none of them runs beside
    the app's idle replicas; then those of the modules that must have the cores to themselves (`RUNS_ALONE`: latency
    under load, kills, autoscaling on what is turned away), then the rest, beside the other test files `make test`'s
    second process runs by then (tests/conftest.py). With the app's package scope, the rest of the suite runs after
    its Ray cluster has stopped (`serve run` in a subprocess runs beside that rest: tests/conftest.py)."""
    here = Path(__file__).resolve().parent
    idx = [i for i, it in enumerate(items) if here in Path(str(it.path)).resolve().parents]
    if not idx:
        return
    block = [items[i] for i in idx]
    block.sort(key=_order)  # stable: file order otherwise
    for i, it in zip(idx, block):
        items[i] = it


@pytest.fixture(autouse=True)
def _no_gpus_here(monkeypatch) -> None:
    """The apps these tests build take no GPU on a GPU host either: their replicas default to one per GPU there is
    (`deployments.args.gpus_for_app`), and on this machine, before Ray is up, that is the machine's."""
    from deployments import args

    monkeypatch.setattr(args, "_local_gpus", lambda: 0)


@dataclass(frozen=True)
class SideApp:
    """A second application on the session's Serve instance, for one module's tests: the module names it SIDE_APP
    and takes its URL from `side_app`. Every collected module's side app is deployed with the session app, in one
    `serve.run_many`: their replicas start together, in the gaps of one another's starts, instead of in one
    module's setup after another's. Each stays up, idle, until its module's tests end; the module deletes it then."""
    name: str
    prefix: str
    build: Callable[[Path], Any]  # a scratch directory of its own -> the serve Application

    @property
    def url(self) -> str:
        return BASE_URL + self.prefix


def _side_apps(items) -> list[SideApp]:
    """The side apps of the modules whose collected tests use the session app, once each, in test order."""
    apps: dict[str, SideApp] = {}
    for it in items:
        app = getattr(getattr(it, "module", None), "SIDE_APP", None)
        if isinstance(app, SideApp) and "serve_app" in getattr(it, "fixturenames", ()):
            apps.setdefault(app.name, app)
    return list(apps.values())


def side_app(serve_app: dict, app: SideApp) -> str:
    """`app`'s URL, once it answers /health (deployed with the session app, `_side_apps`)."""
    assert app.name in serve_app["side_apps"], f"{app.name} was not deployed with the session app"
    wait_ready(app.url)
    return app.url


def side_app_url(serve_app: dict, app: SideApp, blocking: bool = True) -> Iterator[str]:
    """A module fixture's body: `app`'s URL (`side_app`), and the app deleted after the module's tests
    (`blocking`: its replicas gone, and their cores back, before the next tests)."""
    from ray import serve

    try:
        yield side_app(serve_app, app)
    finally:
        serve.delete(app.name, _blocking=blocking)


@pytest.fixture(scope="package")
def serve_app(request, tmp_path_factory) -> Iterator[dict]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments import build_app

    side = _side_apps(request.session.items)
    t0 = time.monotonic()
    # num_gpus=0: on a GPU host too the apps take no GPU (their replicas default to one per GPU Ray has)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 1024**2,
             _system_config={"metrics_report_interval_ms": 1000})  # metrics visible within ~1 s (default 10 s)
    t1 = time.monotonic()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run_many([serve.RunTarget(build_app(TEST_ARGS), name=APP_NAME, route_prefix="/")]
                   + [serve.RunTarget(a.build(tmp_path_factory.mktemp(a.name)), name=a.name, route_prefix=a.prefix)
                      for a in side])
    for url in [BASE_URL] + [a.url for a in side]:
        wait_ready(url)
    t2 = time.monotonic()
    print(f"\n[serve fixture] ray.init {t1 - t0:.1f}s, deploy-to-ready {t2 - t1:.1f}s "
          f"(apps: {', '.join([APP_NAME] + [a.name for a in side])})")
    try:
        yield {"base_url": BASE_URL, "app_name": APP_NAME, "startup_s": t2 - t0, "side_apps": [a.name for a in side]}
    finally:
        # Stopping the Ray node this fixture started stops every process of the apps in it at once (HAProxy dies with
        # its manager, `guard_haproxy`; an engine process with its replica); `serve.shutdown()` first waited out each
        # replica's drain, seconds of an idle suite. Nothing after this package uses Serve in this process.
        ray.shutdown()


@pytest.fixture(scope="package")
def base_url(serve_app: dict) -> str:
    return serve_app["base_url"]


@pytest.fixture(scope="package")
def llm_handle(serve_app: dict):
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=serve_app["app_name"])


def replica_stats(handle, want: int = 2, timeout_s: float = 10.0) -> dict[str, dict]:
    """Stats of every LLM replica: non-generate calls are spread at random by the router, so poll until all seen."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        st = handle.stats.remote().result(timeout_s=timeout_s)
        seen[st["replica"]] = st
    return seen


def wait_idle(handle, want: int, timeout_s: float = 30.0) -> dict[str, dict]:
    """Poll every replica's stats until nothing runs, waits or is in flight and every KV block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = replica_stats(handle, want=want)
        idle = len(stats) == want and all(
            s["num_running"] == 0 and s["num_waiting"] == 0 and s["inflight"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats.values())
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.25)
