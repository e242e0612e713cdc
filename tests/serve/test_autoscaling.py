"""Serve's autoscaling of the LLM replicas (`autoscaling_config`, Kairos's policy), on an app that scales to zero
(min_replicas 0): it starts with no LLM replica and /health 200; a request makes Serve start one and is served once
it answers; a replica that turns requests away for its load (429s) grows the app to two, though its ongoing
requests stay far below Serve's target, and the SLO router sends requests to the new one; with no request in flight,
Serve stops them all (`deployments.autoscaling.idle`), and the Ingress, idle again, starts none by itself. (That a
request after a scale-down starts another is tests/serve/test_units.py's, without another cold start here.)"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serve.conftest import TEST_ARGS, SideApp, side_app_url

AUTO_APP, AUTO_PREFIX = "kairos-auto", "/auto"
# (ongoing requests never reach the target: only what the replica turns away can scale the app up)
SCALING = {"min_replicas": 0, "max_replicas": 2, "target_ongoing_requests": 100, "upscale_delay_s": 0.0,
           "metrics_interval_s": 0.5, "look_back_period_s": 2.0, "downscale_delay_s": 1.0,
           "downscale_to_zero_delay_s": 1.0}


def _auto_app(_: object):
    from deployments import build_app

    args = {k: v for k, v in TEST_ARGS.items() if k != "num_replicas"}
    # (the engine in the replica's process: a replica starts without a second process's imports)
    return build_app({**args, "max_num_seqs": 2, "max_waiting": 2, "autoscaling_config": SCALING,
                      "engine_process": False, "graceful_shutdown_timeout_s": 5.0})


# (tests/serve/conftest.py: before the package's other tests, with the cores to itself: the app grows on what its
# replica turns away under load, within deadlines)
RUNS_ALONE = True
SIDE_APP = SideApp(AUTO_APP, AUTO_PREFIX, _auto_app)


@pytest.fixture(scope="module")
def auto_url(serve_app: dict):
    yield from side_app_url(serve_app, SIDE_APP, blocking=False)  # (no LLM replica left to wait for)


def _running(app: str, state: str = "RUNNING") -> int:
    from ray import serve

    dep = serve.status().applications[app].deployments["LLMServer"]
    return dep.replica_states.get(state, 0)


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_an_app_scaled_to_zero_starts_a_replica_grows_on_what_it_turns_away_and_stops_them_once_idle(
        auto_url: str) -> None:
    assert _running(AUTO_APP) == 0  # (none at the start: min_replicas)
    assert httpx.get(auto_url + "/health").json() == {"status": "ok"}  # (takes requests: a load balancer's 200)
    r = httpx.post(auto_url + "/v1/completions", json={"prompt": "wake up", "max_tokens": 4, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert _running(AUTO_APP) == 1
    replicas: set[str] = set()
    statuses: list[int] = []

    async def run() -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=auto_url, timeout=60) as ac:
            async def client(i: int) -> None:
                while not stop.is_set():
                    r = await ac.post("/v1/completions", json={"prompt": f"load {i}", "max_tokens": 200,
                                                                "ignore_eos": True})
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        replicas.add(r.headers["x-kairos-replica"])
                    else:
                        await asyncio.sleep(0.05)  # (turned away: a client that retries, not at once)

            tasks = [asyncio.create_task(client(i)) for i in range(8)]  # 8 at once: 2 run, 2 wait, the rest 429
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(replicas) < 2:
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert len(replicas) == 2, f"requests served by {replicas}; LLM replicas running: {_running(AUTO_APP)}"
    assert set(statuses) <= {200, 429} and 429 in statuses, statuses  # (turned away: a 429, never an error)
    _until(lambda: _running(AUTO_APP) == 0, 90, "the idle LLM replicas were not stopped")
    # idle again: nothing the Ingress sends starts a replica (it stops asking whether one can serve), /health 200
    time.sleep(2.5)  # (a period of the Ingress's readiness monitor)
    assert _running(AUTO_APP) == 0 and _running(AUTO_APP, "STARTING") == 0
    assert httpx.get(auto_url + "/health").json() == {"status": "ok"}
    # the first request's wait for the cold start, on the serving port's /metrics (kairos_ingress_replica_wait_s)
    metrics = httpx.get(auto_url + "/metrics").text
    waited = [line for line in metrics.splitlines() if line.startswith("ray_kairos_ingress_replica_wait_s_count")
              and 'reason="scaled_to_zero"' in line and f'application="{AUTO_APP}"' in line]
    assert waited and float(waited[0].rsplit(" ", 1)[1]) >= 1, metrics[:2000]
