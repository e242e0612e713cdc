"""Several models in one app (Ray Serve LLM's `build_openai_app` with several llm_configs): an LLM deployment per
model behind one Ingress that sends each request to the model its `model` names."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import SideApp, side_app_url

MULTI_APP, MULTI_PREFIX = "kairos-multi", "/multi"
# (each engine in its replica's process: no child process to start beside the session's other apps)
ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 16, "num_threads": 1, "max_num_seqs": 4,
          "engine_process": False}


def _multi_app(_: object):
    from deployments import build_openai_app

    def model(name: str, **engine) -> dict:
        return {"model_loading_config": {"model_id": name, "model_source": "kairos-tiny"},
                "engine_kwargs": {**ENGINE, **engine}, "deployment_config": {"ray_actor_options": {"num_gpus": 0}}}
    # (one checkpoint twice: the windows tell them apart)
    return build_openai_app({"llm_configs": [model("tiny-a"), model("tiny-b", max_model_len=256)]})


SIDE_APP = SideApp(MULTI_APP, MULTI_PREFIX, _multi_app)


@pytest.fixture(scope="module")
def url(serve_app: dict):
    # (not blocking: Serve waits out its shutdown loop before it stops the idle replicas; their engines, in their
    # processes, stop with them while the next tests run)
    yield from side_app_url(serve_app, SIDE_APP, blocking=False)


def test_each_request_goes_to_the_model_it_names(url: str) -> None:
    from ray import serve

    deployments = set(serve.status().applications[MULTI_APP].deployments)
    assert deployments == {"Ingress", "LLMServer:tiny-a", "LLMServer:tiny-b"}, deployments
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").json() == {"status": "ok"}
        cards = {m["id"]: m["max_model_len"] for m in c.get("/v1/models").json()["data"]}
        assert cards["tiny-a"] > 256 and cards["tiny-b"] == 256, cards
        assert c.get("/v1/models/tiny-b").json()["max_model_len"] == 256
        long = {"prompt": [5] * 300, "max_tokens": 2}
        r = c.post("/v1/completions", json={**long, "model": "tiny-a"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-a", r.text
        r = c.post("/v1/completions", json={**long, "model": "tiny-b"})  # tiny-b's window: 256
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        for none in ({}, {"model": ""}):  # no model: Ray Serve LLM's 400
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **none})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "tiny-b" in r.text, r.text
        r = c.post("/v1/chat/completions", json={"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 3, "stream": True})
        events = [e[6:] for e in r.text.splitlines() if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[0])["model"] == "tiny-b"
        assert c.post("/tokenize", json={"model": "tiny-b", "prompt": "hi"}).json()["max_model_len"] == 256
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] > 256  # (no model: the first's)
        # a name both are known by (their checkpoint's): the first model's
        assert c.post("/v1/completions", json={**long, "model": "kairos-tiny"}).status_code == 200
        r = c.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and "tiny-a" in err["message"] \
            and "tiny-b" in err["message"], r.text
        assert c.get("/v1/models/nope").status_code == 404
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404
