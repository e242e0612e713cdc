"""Scale to zero (`autoscaling_config` min_replicas 0): the app starts with no LLM replica and /health 200; a request
makes Serve start one and is served once it answers; with no request in flight, Serve stops it again (Kairos's
policy: `deployments.autoscaling.idle`), and the Ingress, idle again, starts none by itself. (That a request after
a scale-down starts another is tests/serve/test_units.py's, without a second cold start here.)"""
from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.conftest import TEST_ARGS, SideApp, side_app_url

ZERO_APP, ZERO_PREFIX = "kairos-zero", "/zero"
SCALING = {"min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0.0, "downscale_delay_s": 1.0,
           "downscale_to_zero_delay_s": 1.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}


def _zero_app(_: object):
    from deployments import build_app

    args = {k: v for k, v in TEST_ARGS.items() if k != "num_replicas"}
    # (the engine in the replica's process: a cold start without a second process's imports)
    return build_app({**args, "autoscaling_config": SCALING, "graceful_shutdown_timeout_s": 5.0,
                      "engine_process": False})


SIDE_APP = SideApp(ZERO_APP, ZERO_PREFIX, _zero_app)


@pytest.fixture(scope="module")
def zero_url(serve_app: dict):
    yield from side_app_url(serve_app, SIDE_APP, blocking=False)  # (no LLM replica left to wait for)


def _running(state: str = "RUNNING") -> int:
    from ray import serve

    dep = serve.status().applications[ZERO_APP].deployments["LLMServer"]
    return dep.replica_states.get(state, 0)


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_request_starts_an_llm_replica_of_an_app_scaled_to_zero_which_stops_once_idle(zero_url: str) -> None:
    assert _running() == 0  # (none at the start: min_replicas)
    assert httpx.get(zero_url + "/health").json() == {"status": "ok"}  # (takes requests: a load balancer's 200)
    r = httpx.post(zero_url + "/v1/completions", json={"prompt": "wake up", "max_tokens": 4, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert _running() == 1
    _until(lambda: _running() == 0, 60, "the idle LLM replica was not stopped")
    # idle again: nothing the Ingress sends starts a replica (it stops asking whether one can serve), /health 200
    time.sleep(2.5)  # (a period of the Ingress's readiness monitor)
    assert _running() == 0 and _running("STARTING") == 0
    assert httpx.get(zero_url + "/health").json() == {"status": "ok"}
    # the request's wait for the cold start, on the serving port's /metrics (kairos_ingress_replica_wait_s)
    metrics = httpx.get(zero_url + "/metrics").text
    waited = [line for line in metrics.splitlines() if line.startswith("ray_kairos_ingress_replica_wait_s_count")
              and 'reason="scaled_to_zero"' in line and f'application="{ZERO_APP}"' in line]
    assert waited and float(waited[0].rsplit(" ", 1)[1]) >= 1, metrics[:2000]
