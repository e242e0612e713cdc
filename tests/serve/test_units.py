"""Fast checks without Ray running: args mapping, protocol parsing, router ranking, auth, health check."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deployments import protocol as P
from deployments.args import AppArgs, load_api_keys
from deployments.router import rank, view
from engine.config import EngineConfig


def test_app_args_map_flat_knobs_into_nested_configs() -> None:
    a = AppArgs.model_validate({"model": "/m", "num_replicas": "2", "num_gpus": "1", "policy": "scorpio",
                                "prefill_max_tokens": "2048", "num_kv_blocks": 512, "vbs_margin": 1.5})
    cfg = a.engine_config()
    assert isinstance(cfg, EngineConfig) and cfg.model == "/m" and cfg.num_kv_blocks == 512
    assert cfg.scheduler.policy == "scorpio" and cfg.scheduler.prefill_max_tokens == 2048
    assert cfg.scheduler.vbs_margin == 1.5 and a.num_replicas == 2 and a.num_gpus == 1
    assert a.model_name == "m"
    defaults = AppArgs().engine_config()
    assert defaults == EngineConfig()  # nothing given -> the engine's own defaults


def test_app_args_reject_unknown_and_invalid() -> None:
    with pytest.raises(ValidationError, match="did you mean 'policy'"):
        AppArgs.model_validate({"polcy": "edf"})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"policy": "nope"})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"num_replicas": 0})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"block_size": -1})


def test_every_engine_and_scheduler_knob_is_reachable() -> None:
    from scheduling.config import SchedulerConfig

    names = set(AppArgs.model_fields)
    assert set(EngineConfig.model_fields) - {"scheduler"} <= names
    assert set(SchedulerConfig.model_fields) <= names
    assert {"model", "num_replicas", "num_gpus", "policy"} <= names


def test_api_keys(tmp_path, monkeypatch) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nk1\n\nk2\n")
    monkeypatch.setenv("KAIROS_KEYS", "k3, k4")
    assert load_api_keys("KAIROS_KEYS", str(f)) == ["k3", "k4", "k1", "k2"]
    monkeypatch.setenv("EMPTY_KEYS", "")
    with pytest.raises(ValueError, match="refusing"):
        load_api_keys("EMPTY_KEYS", None)


def test_bearer_auth() -> None:
    from fastapi import Request

    from deployments.ingress import APIError, Ingress

    auth = Ingress.func_or_class._auth
    ing = SimpleNamespace(_keys=[b"secret-1", b"secret-2"])  # no replica needed for the check itself

    def req(auth: str | None) -> Request:
        headers = [] if auth is None else [(b"authorization", auth.encode())]
        return Request({"type": "http", "headers": headers})

    auth(ing, req("Bearer secret-2"))
    for bad in (None, "Bearer nope", "Basic secret-1", "secret-1"):
        with pytest.raises(APIError) as e:
            auth(ing, req(bad))
        assert e.value.status == 401


def test_protocol_slo_values() -> None:
    assert P.parse_slo_header("x", " 250 ") == 250.0
    assert P.parse_slo_header("x", "64", integer=True) == 64
    for bad in ("0", "-1", "abc", "nan", "inf", "1e12"):
        with pytest.raises(ValueError):
            P.parse_slo_header("x", bad)


def test_completion_prompt_forms() -> None:
    assert P.CompletionRequest.model_validate({"prompt": ["one"]}).prompt == "one"
    assert P.CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    kw = P.CompletionRequest.model_validate({"prompt": "a", "stop": "x", "top_k": 3}).sampling_kwargs(5)
    assert kw["stop"] == ["x"] and kw["top_k"] == 3 and kw["max_tokens"] == 5
    with pytest.raises(ValidationError):
        P.CompletionRequest.model_validate({"prompt": [[1], [2]]})


def _replica(name: str, stats: dict) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats=stats)


def _stats(queue_ms: float, median_ms: float, load: int = 0, itl: float | None = 10.0, kv: int = 100) -> dict:
    return {"predicted_queue_ms": queue_ms, "predicted_ttft_ms": median_ms, "median_prompt_tokens": 64,
            "queue_len": load, "inflight": load, "num_running": load, "vbs": load, "itl_ms": itl,
            "strictest_tpot_ms": None, "kv_free_blocks": kv}


def _rank(replicas: list, slo: dict, inflight: dict | None = None, prompt_tokens: int = 64) -> list[str]:
    inflight = inflight or {}
    views = {r.replica_id: view(r.routing_stats, inflight.get(r.replica_id, 0), prompt_tokens) for r in replicas}
    return [r.replica_id for r in rank(replicas, views, slo)]


def test_router_prefers_attainable_slo_with_most_slack() -> None:
    busy, idle = _replica("busy", _stats(400, 450, load=8)), _replica("idle", _stats(20, 70))
    assert _rank([busy, idle], {"ttft_ms": 300})[0] == "idle"
    # best effort: least loaded first
    assert _rank([busy, idle], {}) == ["idle", "busy"]
    # nothing attainable: fall back to least loaded
    assert _rank([busy, idle], {"ttft_ms": 1}) == ["idle", "busy"]


def test_router_counts_its_own_inflight_between_reports() -> None:
    a, b = _replica("a", _stats(20, 70)), _replica("b", _stats(20, 70))
    assert _rank([a, b], {}, inflight={"a": 3}) == ["b", "a"]
    assert _rank([a, b], {"ttft_ms": 150}, inflight={"b": 5}) == ["a", "b"]


def test_router_tpot_headroom() -> None:
    slow = _replica("slow", {**_stats(10, 20, load=4), "itl_ms": 45.0})
    fast = _replica("fast", {**_stats(10, 20, load=4), "itl_ms": 10.0})
    assert _rank([slow, fast], {"tpot_ms": 50})[0] == "fast"
    # a running request's strict TPOT SLO also limits what may join the batch
    strict = _replica("strict", {**_stats(10, 20, load=1), "itl_ms": 10.0, "strictest_tpot_ms": 11.0})
    loose = _replica("loose", {**_stats(10, 20, load=2), "itl_ms": 10.0})
    assert _rank([strict, loose], {"tpot_ms": 100}) == ["loose", "strict"]


def test_router_without_stats_spreads_by_inflight() -> None:
    a, b = _replica("a", {}), _replica("b", {})
    assert _rank([a, b], {"ttft_ms": 100}, inflight={"a": 1}) == ["b", "a"]


def test_check_health_raises_when_engine_dead() -> None:
    from deployments.replica import LLMServer

    check = LLMServer.func_or_class.check_health
    check(SimpleNamespace(replica_id="r", engine=SimpleNamespace(is_alive=lambda: True)))
    with pytest.raises(RuntimeError, match="dead"):
        check(SimpleNamespace(replica_id="r", engine=SimpleNamespace(is_alive=lambda: False)))


def test_plain_chat_format() -> None:
    from deployments.replica import render_plain_chat

    assert render_plain_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == \
        "System: S\nUser: U\nAssistant:"


def test_serve_config_yaml_is_valid() -> None:
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from deployments import build_app

    root = Path(__file__).resolve().parents[2]
    cfg = ServeDeploySchema.model_validate(yaml.safe_load((root / "serve_config.yaml").read_text()))
    app_cfg = cfg.applications[0]
    assert app_cfg.import_path == "deployments:build_app"
    a = AppArgs.model_validate(app_cfg.args)
    assert a.num_gpus == 1 and build_app(a) is not None
    llm = next(d for d in app_cfg.deployments if d.name == "LLMServer")
    assert llm.ray_actor_options.num_gpus == 1


def test_cluster_yaml_is_valid() -> None:
    from pathlib import Path

    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    root = Path(__file__).resolve().parents[2]
    cfg = prepare_config(yaml.safe_load((root / "cluster.yaml").read_text()))
    validate_config(cfg)
    assert cfg["available_node_types"]["head"]["resources"] == {"CPU": 0}


def test_stream_batching_merges_tokens_but_sends_the_first_at_once() -> None:
    """stream_interval_ms: after the first token at most one message per interval, with every token kept."""
    import asyncio
    import threading

    import engine.engine  # noqa: F401 - generate() imports it; import (torch) before the producer's clock starts
    from deployments.replica import LLMServer
    from engine.outputs import RequestOutput
    from engine.request import SLO
    from engine.stream import RequestStream

    def run(interval_s: float) -> list[dict]:
        st = RequestStream("r1")

        def produce() -> None:
            for i in range(40):
                time.sleep(0.002)
                st.put(RequestOutput("r1", text=f"t{i} ", token_ids=[i], num_output_tokens=i + 1,
                                     finished=i == 39, finish_reason="length" if i == 39 else None))

        noop = lambda *a, **k: None  # noqa: E731
        me = SimpleNamespace(
            stream_interval_s=interval_s, log_prompts=False, inflight=0, aborted=0, itl_ms=None, replica_id="r",
            _prompt_lens=[], _prepare=lambda req: ([1, 2], None, SLO()),
            engine=SimpleNamespace(add_request=lambda *a, **k: st, abort=noop),
            metrics=SimpleNamespace(on_admitted=noop, on_itl=noop, on_finished=noop, on_rejected=noop))

        async def collect() -> list[dict]:
            threading.Thread(target=produce, daemon=True).start()
            return [x async for x in LLMServer.func_or_class.generate(me, {"request_id": "r1"})]

        return asyncio.run(collect())

    every = run(0.0)
    batched = run(0.025)
    for items in (every, batched):
        assert "".join(x["text"] for x in items) == "".join(f"t{i} " for i in range(40))
        assert sum(x["n"] for x in items) == 40 and items[-1]["finished"]
    assert batched[0]["n"] == 1  # the first token is never held back
    assert len(batched) < len(every) / 2


def test_sse_sends_a_chunk_for_every_token_delivery_even_without_text() -> None:
    """A token that only starts a multi-byte character has no text yet; its chunk still goes out (as in vLLM),
    since clients time tokens by chunk arrival: holding it made the first token look seconds late."""
    import asyncio
    import json

    from deployments.ingress import Ingress

    items = [{"text": "", "n": 1, "finished": False}, {"text": "é", "n": 1, "finished": False},
             {"text": "", "n": 1, "finished": True, "finish_reason": "length", "num_prompt_tokens": 2,
              "num_output_tokens": 3}]

    class Gen:
        def __init__(self) -> None:
            self.i = 1

        async def __anext__(self) -> dict:
            self.i += 1
            return items[self.i - 1]

        def cancel(self) -> None:
            pass

    me = SimpleNamespace(model_name="m")

    async def collect() -> list[bytes]:
        return [c async for c in Ingress.func_or_class._sse(me, Gen(), items[0], "completion", "cmpl-1", False)]

    chunks = [json.loads(c.decode()[6:]) for c in asyncio.run(collect()) if c != b"data: [DONE]\n\n"]
    assert [c["choices"][0]["text"] for c in chunks] == ["", "é", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_wait_closed_wakes_on_the_final_item_only() -> None:
    """The stream batcher sleeps its interval on wait_closed: tokens do not wake it, the final item does."""
    import asyncio
    import threading

    from engine.outputs import RequestOutput
    from engine.stream import RequestStream

    async def scenario() -> tuple[bool, bool, float]:
        st = RequestStream("r")
        st.put(RequestOutput("r", text="a", token_ids=[1]))
        not_closed = await st.wait_closed(0.01)  # a token is not the end: times out
        threading.Timer(0.05, lambda: st.put(RequestOutput("r", text="b", token_ids=[2], finished=True,
                                                           finish_reason="length"))).start()
        t0 = time.monotonic()
        closed = await st.wait_closed(30.0)  # woken by the final item, long before the timeout
        return not_closed, closed, time.monotonic() - t0

    not_closed, closed, waited = asyncio.run(scenario())
    assert not not_closed and closed and waited < 10.0
