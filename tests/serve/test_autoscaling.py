"""Serve's autoscaling of the LLM replicas (`autoscaling_config`, Kairos's policy): a replica that turns requests
away for its load (429s) grows the app from one replica to two, though its ongoing requests stay far below Serve's
target, and the SLO router sends requests to the new one."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serve.conftest import TEST_ARGS, SideApp, side_app_url

AUTO_APP, AUTO_PREFIX = "kairos-auto", "/auto"
# (ongoing requests never reach the target: only what the replica turns away can scale the app)
SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 100, "upscale_delay_s": 0.0,
           "metrics_interval_s": 0.5, "look_back_period_s": 2.0, "downscale_delay_s": 600.0}


def _auto_app(_: object):
    from deployments import build_app

    args = {k: v for k, v in TEST_ARGS.items() if k != "num_replicas"}
    # (the engine in the replica's process: the new replica starts without a second process's imports)
    return build_app({**args, "max_num_seqs": 2, "max_waiting": 2, "autoscaling_config": SCALING,
                      "engine_process": False})


SIDE_APP = SideApp(AUTO_APP, AUTO_PREFIX, _auto_app)


@pytest.fixture(scope="module")
def auto_url(serve_app: dict):
    yield from side_app_url(serve_app, SIDE_APP)


def _running(app: str) -> int:
    from ray import serve

    dep = serve.status().applications[app].deployments["LLMServer"]
    return dep.replica_states.get("RUNNING", 0)


def test_requests_turned_away_for_load_add_a_replica_that_the_router_uses(auto_url: str) -> None:
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
    assert _running(AUTO_APP) == 2
    assert set(statuses) <= {200, 429} and 429 in statuses, statuses  # (turned away: a 429, never an error)
