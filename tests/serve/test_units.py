"""Fast checks without Ray running: args mapping, protocol parsing, router ranking, auth, health check."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from core.messages import ChatTurn, GenerateRequest, ProtocolError, RequestOutput, RoutingStats
from core.request import SLO, FinishReason
from core.sampling import SamplingParams
from deployments import protocol as P
from deployments.args import AppArgs, load_api_keys
from deployments.autoscaling import INFLIGHT, DemandRates
from deployments.router import rank, view
from engine.config import EngineConfig
from scheduling.ttft_guard import margin_at


def test_app_args_map_flat_knobs_into_nested_configs() -> None:
    a = AppArgs.model_validate({"model": "/m", "num_replicas": "2", "num_gpus": "1", "policy": "scorpio",
                                "prefill_max_tokens": "2048", "num_kv_blocks": 512, "vbs_margin": 1.5})
    cfg = a.engine_config()
    assert isinstance(cfg, EngineConfig) and cfg.model == "/m" and cfg.num_kv_blocks == 512
    assert cfg.scheduler.policy == "scorpio" and cfg.scheduler.prefill_max_tokens == 2048
    assert cfg.scheduler.vbs_margin == 1.5 and a.num_replicas == 2 and a.num_gpus == 1
    assert a.model_name == "m"
    defaults = AppArgs().engine_config()
    # nothing given -> the engine's own defaults, on a GPU-less replica, as an OpenAI server (max_tokens past the
    # context is a 400, as vLLM's)
    assert defaults == EngineConfig(device="cpu", max_tokens_over_context="reject")
    with pytest.raises(ValidationError, match="max_queued_requests must be -1"):  # (Serve refused it at deploy time)
        AppArgs.model_validate({"max_queued_requests": 0})
    assert AppArgs.model_validate({"max_queued_requests": -1}).max_queued_requests == -1
    # CORS credentials go only to listed origins: with '*' Starlette reflected any page's origin, credentials allowed
    for origins in ("*", "https://a.example, *"):
        with pytest.raises(ValidationError, match="allow_credentials needs the origins listed"):
            AppArgs.model_validate({"allow_credentials": True, "allowed_origins": origins})
    assert AppArgs.model_validate({"allow_credentials": True, "allowed_origins": "https://a.example"}).allow_credentials
    # a device no engine takes, and a GPU asked for a replica on the CPU (it waited for a GPU it never used), at
    # build time (the replicas failed their starts, or never started)
    for bad in ("tpu", "gpu", "cuda:abc", "cuda:"):
        with pytest.raises(ValidationError, match="expected auto, cpu, cuda or cuda:N"):
            AppArgs.model_validate({"device": bad})
    assert AppArgs.model_validate({"device": " CUDA:1 "}).engine_config().device == "cuda:1"
    with pytest.raises(ValidationError, match="num_gpus 0.5 with device cpu"):
        AppArgs.model_validate({"device": "cpu", "num_gpus": 0.5})
    assert AppArgs.model_validate({"device": "cpu", "num_gpus": 0}).placement()[0] == 0
    # a typo in autoscaling_config (Serve's drops the key: the bound it meant was no bound)
    with pytest.raises(ValidationError, match="unknown field.*'max_replica' \\(did you mean 'max_replicas'"):
        AppArgs.model_validate({"autoscaling_config": '{"min_replicas": 1, "max_replica": 4}'})


def test_replicas_take_only_the_gpu_share_they_are_given() -> None:
    from engine.kv_cache import cuda_cache_bytes

    # Ray leaves CUDA visible to an actor with num_gpus=0: "auto" would put every such replica on GPU 0
    assert AppArgs().engine_config().device == "cpu"
    assert AppArgs.model_validate({"num_gpus": 1}).engine_config().device == "auto"
    assert AppArgs.model_validate({"device": "cuda"}).engine_config().device == "cuda"  # the user's choice stands
    half = AppArgs.model_validate({"num_gpus": 0.5}).engine_config()
    assert half.gpu_memory_utilization == pytest.approx(0.5 * EngineConfig().gpu_memory_utilization)
    assert AppArgs.model_validate({"num_gpus": 0.5, "gpu_memory_utilization": 0.3}).engine_config(
    ).gpu_memory_utilization == 0.3
    gib = 1 << 30
    # one engine per 80 GiB card, 1 GiB of weights: 85% of the card less the weights
    assert cuda_cache_bytes(free=79 * gib, total=80 * gib, own=gib, utilization=0.85) == int(0.85 * 80 * gib - gib)
    # the second of two half-card replicas: its own share, not what the first one left free
    assert cuda_cache_bytes(free=45 * gib, total=80 * gib, own=gib, utilization=0.425) == int(0.425 * 80 * gib - gib)
    # a card another process filled: only what is free, less a 2% margin; never negative
    assert cuda_cache_bytes(free=10 * gib, total=80 * gib, own=gib, utilization=0.85) == int(10 * gib - 1.6 * gib)
    assert cuda_cache_bytes(free=gib, total=80 * gib, own=gib, utilization=0.85) == 0
    # the largest step's activations (measured, then freed) need room again beside the cache: 16 GiB of weights and
    # a 4 GiB peak on a card with 14 GiB free leaves a cache of 14 - 4 - 1.6 GiB
    assert cuda_cache_bytes(free=14 * gib, total=80 * gib, own=20 * gib, utilization=0.5, peak=4 * gib) == \
        int(14 * gib - 4 * gib - 1.6 * gib)


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


def test_engine_threads_spare_a_core_only_for_big_engines_and_team_up_otherwise() -> None:
    from deployments.replica import EngineCores, engine_threads

    # 2 cores, 1 replica: a spare core would halve the engine; it takes both, on the thread team, whose workers
    # keep Ray's nice while the engine's own thread goes first
    assert engine_threads(2, None, 1, True, "1") == EngineCores(2, True, True)
    assert engine_threads(3, None, 1, True, "1") == EngineCores(3, True, True)
    assert engine_threads(16, None, 1, True, "1") == EngineCores(15, True, False)  # one core for Serve, engine first
    assert engine_threads(2, None, 2, True, "1") == EngineCores(1, False, False)  # 2 replicas fill both cores
    assert engine_threads(16, None, 4, True, "1") == EngineCores(3, True, False)
    assert engine_threads(2, None, 1, False, "1") == EngineCores(2, False, False)  # engine as a thread: all cores
    assert engine_threads(2, 2, 1, True, "1") == EngineCores(2, True, True)  # explicit num_threads wins
    assert engine_threads(2, 1, 1, True, "1") == EngineCores(1, True, False)
    # num_cpus>0: Ray splits the cores (its OMP_NUM_THREADS stands) and the replicas' count is not known here
    assert engine_threads(4, None, None, True, "1") == EngineCores(None, False, False)
    assert engine_threads(2, 1, None, True, None) == EngineCores(1, False, False)
    # on a GPU: one thread (it feeds the GPU), ahead of Serve's Python in its own process; num_threads still wins
    assert engine_threads(16, None, 1, True, "1", gpu=True) == EngineCores(1, True, False)
    assert engine_threads(16, None, None, False, None, gpu=True) == EngineCores(1, False, False)
    assert engine_threads(16, 4, 1, True, "1", gpu=True) == EngineCores(4, True, False)


def test_api_keys(tmp_path, monkeypatch) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nk1\n\nk2\n")
    monkeypatch.setenv("KAIROS_KEYS", "k3, k4")
    assert load_api_keys("KAIROS_KEYS", str(f)) == ["k3", "k4", "k1", "k2"]
    monkeypatch.setenv("EMPTY_KEYS", "")
    with pytest.raises(ValueError, match="refusing"):
        load_api_keys("EMPTY_KEYS", None)
    # an indented comment is no key; an editor's byte-order mark and CRLFs are not part of a key
    f.write_bytes("\ufeffalpha-key\r\n  # old key, revoked: omega-key\r\nbeta-key\r\n".encode())
    assert load_api_keys(None, str(f)) == ["alpha-key", "beta-key"]
    # a name given empty (an unset variable in a template) would serve unauthenticated: refused
    for env, path in (("", None), (None, ""), ("  ", str(f))):
        with pytest.raises(ValueError, match="is empty; refusing"):
            load_api_keys(env, path)


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
    # a key beyond ASCII: the header's bytes as the client sent them (UTF-8), not Starlette's Latin-1 reading
    auth(SimpleNamespace(_keys=["clé-secrète".encode()]), req("Bearer clé-secrète"))


def test_a_request_leaving_sampling_knobs_out_takes_the_models_defaults() -> None:
    """The model's sampling defaults (its generation_config, in the engine's `model_info`) fill the knobs a request
    leaves out; what it sends wins; before any engine has answered there are none to take."""
    from fastapi import Request

    from deployments.ingress import OpenAIFrontend

    class Front(OpenAIFrontend):
        info: dict | None = {"model": "m", "max_model_len": 64, "sampling_defaults": {"temperature": 0.6, "top_k": 20}}

        def _ready_info(self) -> dict | None:
            return self.info

    f = object.__new__(Front)
    f._init_frontend({"model_name": "m", "max_body_bytes": 4096})
    http = Request({"type": "http", "headers": []})
    msgs = [{"role": "user", "content": "hi"}]
    _, (req,) = f._build(http, {"messages": msgs}, "chat", "r1")
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (0.6, 1.0, 20)
    _, (req,) = f._build(http, {"messages": msgs, "temperature": 0.0, "top_k": 0}, "chat", "r2")
    assert (req.params.temperature, req.params.top_k) == (0.0, 0)
    f.info = None
    _, (req,) = f._build(http, {"prompt": "hi"}, "completion", "r3")
    assert (req.params.temperature, req.params.top_k) == (1.0, 0)


def test_a_chats_length_hint_counts_what_its_template_shows_and_text_of_any_script() -> None:
    """The router's guess of a prompt's tokens (`prompt_len_hint`, before the replica counts them) takes in a chat's
    tools, documents and tool calls and its turns' markers, and a token for each character that is not ASCII (CJK
    text is about one a character): only the turns' text, 4 characters a token, read a tool-heavy chat as nearly
    free to prefill."""
    from fastapi import Request

    from deployments.ingress import OpenAIFrontend

    class Front(OpenAIFrontend):
        def _ready_info(self) -> dict | None:
            return {"model": "m", "max_model_len": 1 << 16}

    f = object.__new__(Front)
    f._init_frontend({"model_name": "m", "max_body_bytes": 1 << 20})
    http = Request({"type": "http", "headers": []})
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 20,
                                               "parameters": {"type": "object"}}} for i in range(10)]
    bare = f._build(http, {"messages": hi}, "chat", "r1")[1][0].prompt_len_hint
    raw = {"messages": hi, "tools": tools, "tool_choice": "none"}
    tooled = f._build(http, raw, "chat", "r2")[1][0].prompt_len_hint
    assert tooled > bare + 10 * 20 * 12 // 4 // 2
    cjk = f._build(http, {"messages": [{"role": "user", "content": "漢" * 2000}]}, "chat", "r3")[1][0]
    assert cjk.prompt_len_hint >= 2000
    assert f._build(http, {"prompt": "ab" * 400}, "completion", "r4")[1][0].prompt_len_hint == 200


def _local_fast_path(front_cls: type, generate: Any) -> tuple[Any, Any]:
    """A bare instance of frontend `front_cls` whose requests stream `generate(req)` here (no replica), and the
    generation fast path serving it."""
    from deployments.direct import LocalStream
    from deployments.ingress import GenerationFastPath

    class Front(front_cls):
        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    class Api:
        docs_url = None

    front = object.__new__(Front)
    front._init_frontend({"model_name": "m", "max_body_bytes": 4096})
    return front, GenerationFastPath(front, Api())  # type: ignore[arg-type]


def test_a_request_sent_before_any_engine_answered_takes_the_defaults_said_meanwhile() -> None:
    """Routed, at start: a request that came before an LLM replica said the model's sampling defaults is validated at
    once, waits for one (`_until_ready`), and is sent with those defaults; the model it names is checked against the
    one that replica loaded."""
    from deployments.ingress import OpenAIFrontend

    sent: list[GenerateRequest] = []

    async def generate(req: GenerateRequest):
        sent.append(req)
        yield RequestOutput(req.request_id, text="!", token_ids=[2], finished=True, finish_reason="length",
                            num_prompt_tokens=1, num_output_tokens=1)

    class Front(OpenAIFrontend):
        info: dict | None = None

        def _ready_info(self) -> dict | None:
            return self.info

        async def _until_ready(self) -> None:  # an LLM replica answers meanwhile
            self.info = {"model": "/models/m", "max_model_len": 64, "sampling_defaults": {"temperature": 0.6}}

    front, app = _local_fast_path(Front, generate)

    async def run(body: dict) -> list[dict]:
        out: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(msg: dict) -> None:
            out.append(msg)

        await asyncio.wait_for(app(
            {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}, receive, send), 5)
        return out

    bad = asyncio.run(run({"prompt": "hi", "max_tokens": 0}))  # refused before any wait
    assert bad[0]["status"] == 400 and front.info is None and not sent
    ok = asyncio.run(run({"prompt": "hi", "max_tokens": 1, "model": "/models/m"}))  # the model it loads: not a 404
    assert ok[0]["status"] == 200 and sent[0].params.temperature == 0.6
    assert asyncio.run(run({"prompt": "hi", "max_tokens": 1, "model": "other"}))[0]["status"] == 404


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
    # max_tokens left out: OpenAI's 16; an explicit null: the context left (vLLM's; it was 16, a 400 near the window)
    assert P.CompletionRequest.model_validate({"prompt": "a"}).default_max_tokens() == 16
    assert P.CompletionRequest.model_validate({"prompt": "a", "max_tokens": None}).default_max_tokens() is None
    assert P.CompletionRequest.model_validate({"prompt": [[1], [2]]}).prompts() == [[1], [2]]  # a batch
    assert P.CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    for bad in ([[1], []], [[1], [-1]], ["a", ""], ["a"] * (P.MAX_BATCH_PROMPTS + 1), [[1], "a"]):
        with pytest.raises(ValidationError):
            P.CompletionRequest.model_validate({"prompt": bad})


def _replica(name: str, stats: dict) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats=stats)


def _stats(queue_ms: float, median_ms: float, load: int = 0, itl: float | None = 10.0, kv: int = 100,
           sq_ms: float = 0.0, gate: tuple[float, float] | None = None, inv_sum: float = 0.0,
           be_share: float = 0.0) -> dict:
    return RoutingStats(predicted_queue_ms=queue_ms, predicted_ttft_ms=median_ms, median_prompt_tokens=64,
                        prefill_sq_ms=sq_ms,
                        num_waiting=0, num_running=load, inflight=load, vbs=load, itl_ms=itl,
                        step_batch=None if itl is None else max(load, 1), strictest_tpot_ms=None,
                        gate_base_ms=gate[0] if gate else None, gate_row_ms=gate[1] if gate else None,
                        tpot_inv_sum=inv_sum, best_effort_share=be_share,
                        kv_blocks_free=kv, kv_blocks_total=kv, alive=True, ts=0.0).to_dict()


def _rank(replicas: list, slo: dict, inflight: dict | None = None, prompt_tokens: int = 64) -> list[str]:
    inflight = inflight or {}
    views = {r.replica_id: view(r.routing_stats, inflight.get(r.replica_id, 0), prompt_tokens) for r in replicas}
    return [r.replica_id for r in rank(replicas, views, SLO(**slo))]


def test_router_prefers_attainable_slo_with_most_slack() -> None:
    busy, idle = _replica("busy", _stats(400, 450, load=8)), _replica("idle", _stats(20, 70))
    assert _rank([busy, idle], {"ttft_ms": 300})[0] == "idle"
    # best effort: least loaded first
    assert _rank([busy, idle], {}) == ["idle", "busy"]
    # nothing attainable: fall back to least loaded
    assert _rank([busy, idle], {"ttft_ms": 1}) == ["idle", "busy"]


def test_router_ranks_a_resent_request_by_the_ttft_it_has_left() -> None:
    """A request resent after time spent elsewhere (`waited_ms`) is ranked by what is left of its TTFT SLO, as the
    engine schedules it: a replica that meets the whole SLO with more TPOT slack, but not what is left, goes after
    one that meets what is left."""
    from deployments.router import SLORouter

    slow = _replica("slow", _stats(115, 120, load=1, itl=10.0))
    quick = _replica("quick", _stats(5, 10, load=3, itl=21.0))
    def first(waited_ms: float, call: str) -> str:
        router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
        router.initialize_state()
        req = GenerateRequest("cmpl-1", prompt="x" * 256, slo=SLO(ttft_ms=500.0, tpot_ms=40.0), prompt_len_hint=64,
                              waited_ms=waited_ms)
        p = SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=call), args=(req,),
                            kwargs={})
        return asyncio.run(router.choose_replicas([slow, quick], p))[0][0].replica_id

    assert first(0.0, "h0") == "slow"  # (both meet 500 ms: the lighter batch's TPOT slack)
    assert first(400.0, "h1") == "quick"  # (100 ms left)


def test_router_sends_nothing_to_a_replica_whose_engine_died_while_another_can_serve() -> None:
    """A replica whose engine died fails every request at once and reports no load: until Serve's health checks
    replace it, it would look the least loaded. Its report says it is dead: it comes last, for every SLO."""
    dead = _replica("dead", {**_stats(1, 2), "alive": False})
    busy = _replica("busy", _stats(400, 450, load=8))
    for slo in ({}, {"ttft_ms": 300}, {"ttft_ms": 1}, {"tpot_ms": 50}):
        assert _rank([dead, busy], slo) == ["busy", "dead"], slo
    assert _rank([dead], {}) == ["dead"]  # the only one: still tried (the request gets its 503)


def test_router_predicts_a_long_prompts_ttft_with_its_attention() -> None:
    """The replica reports its model at 1 and 64 prompt tokens and gamma (ms per token pair): a prompt of 8000 tokens
    costs its line and gamma x (8000² - 1), not the line alone."""
    gamma = 2.5e-4
    q, m = 10.0, 10.0 + 0.5 * 63 + gamma * (64 * 64 - 1)  # alpha 0.5 ms a token
    v = view(_stats(q, m, sq_ms=gamma), 0, 8000)
    assert v.pred_ttft_ms == pytest.approx(q + 0.5 * 7999 + gamma * (8000 ** 2 - 1))
    assert view(_stats(q, m, sq_ms=gamma), 0, 64).pred_ttft_ms == pytest.approx(m)
    assert view(_stats(20, 70), 0, 127).pred_ttft_ms == pytest.approx(20 + 50 / 63 * 126)  # no gamma: the line


def test_router_predicts_a_prompts_ttft_with_the_replicas_own_model() -> None:
    """A GPU fit has a knee: every step of up to theta tokens costs c0, the line beyond. An idle replica's two points
    (1 and a median of 64 tokens) both read c0: the line through them put a prompt of 8,192 tokens at c0, and
    unreported arrivals at nothing. The replica reports its model's terms and its waiting tokens; the router's
    prediction is the replica's (`engine.stats.predict_ttft_ms`), arrivals added as ~median prompts."""
    from engine.stats import predict_ttft_ms
    from scheduling.predictor import LatencyModel

    model = LatencyModel(c0=14.6, theta=512.0, prefill_coef=(0.024, 3.0, 1e-7))
    c0, theta, alpha, beta, gamma = model.prefill_params()
    for waiting, sq in ((0, 0.0), (1000, 1000.0 ** 2), (300, 2 * 150.0 ** 2)):
        st = SimpleNamespace(waiting_tokens=waiting, waiting_sq=sq)  # (what predict_ttft_ms reads of EngineStats)
        report = {**_stats(predict_ttft_ms(model, st, 1, 10**6), predict_ttft_ms(model, st, 64, 10**6),
                           sq_ms=gamma), "prefill_c0_ms": c0, "prefill_theta": theta, "prefill_alpha_ms": alpha,
                  "prefill_beta_ms": beta, "waiting_tokens": waiting, "waiting_sq": sq}
        for n in (1, 64, 600, 2048, 8192):
            assert view(report, 0, n).pred_ttft_ms == pytest.approx(predict_ttft_ms(model, st, n, 10**6)), (waiting, n)
        more = SimpleNamespace(waiting_tokens=waiting + 20 * 64, waiting_sq=sq + 20 * 64.0 ** 2)
        assert view(report, 0, 100, fresh=20).pred_ttft_ms == pytest.approx(predict_ttft_ms(model, more, 100, 10**6))
    assert view(_stats(10, 20), 0, 127).pred_ttft_ms == pytest.approx(10 + 10 / 63 * 126)  # (no terms: the line)


def test_a_replica_without_a_report_is_not_ranked_first_for_a_tpot_slo() -> None:
    """A replica that has not reported yet (just started) has nothing to check a TPOT SLO against: unknown, after the
    replicas with measured headroom (as for a TTFT SLO), not first for every TPOT request until its first report."""
    new, a = _replica("new", {}), _replica("a", {**_stats(20, 70, load=2), "itl_ms": 10.0})
    for slo in ({"tpot_ms": 50}, {"ttft_ms": 500}, {"ttft_ms": 500, "tpot_ms": 50}):
        assert _rank([new, a], slo) == ["a", "new"], slo
    assert _rank([new, a], {}) == ["new", "a"]  # best effort: by load, as before


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


def test_router_projects_itl_with_the_arrivals_it_sent_since_the_report() -> None:
    # both report a batch of 2 at 10 ms; three strict requests went to "a" since: joining it would make its batch
    # 6 (projected 30 ms), over a 20 ms TPOT; joining "b" makes 3 (15 ms)
    a, b = _replica("a", _stats(10, 20, load=2)), _replica("b", _stats(10, 20, load=2))
    assert _rank([a, b], {"tpot_ms": 20}, inflight={"a": 5, "b": 2}) == ["b", "a"]
    assert _rank([a, b], {"tpot_ms": 20}, inflight={"a": 2, "b": 5}) == ["a", "b"]


def test_router_counts_the_tpot_slos_it_sent_before_any_report() -> None:
    # "a" has a request of TPOT 10 in flight (not reported yet): a request of TPOT 40 joining it must keep 10 ms
    a, b = _replica("a", _stats(10, 20, load=2, itl=8.0)), _replica("b", _stats(10, 20, load=2, itl=8.0))
    views = {"a": view(a.routing_stats, 3, 64, inflight_tpot_ms=10.0), "b": view(b.routing_stats, 2, 64)}
    assert views["a"].strictest_tpot_ms == 10.0 and views["b"].strictest_tpot_ms is None
    assert [r.replica_id for r in rank([a, b], views, SLO(tpot_ms=40))] == ["b", "a"]


def test_router_puts_the_replicas_that_turned_the_request_away_last() -> None:
    @dataclasses.dataclass(frozen=True)
    class Rid:
        unique_id: str

    a, b, c = (SimpleNamespace(replica_id=Rid(n), routing_stats=_stats(10, 20, load=i)) for i, n in enumerate("abc"))
    views = {r.replica_id: view(r.routing_stats, 0, 64) for r in (a, b, c)}
    best = [r.replica_id.unique_id for r in rank([a, b, c], views, SLO(ttft_ms=1000))]
    assert best == ["a", "b", "c"]  # least loaded first
    assert [r.replica_id.unique_id for r in rank([a, b, c], views, SLO(ttft_ms=1000), ("a",))] == ["b", "c", "a"]


def test_the_pow2_router_passes_over_replicas_that_failed_the_request_or_are_dead(monkeypatch) -> None:
    """A replica whose engine died answers at once, so power of two choices finds it the least loaded: a request
    resent away from it went straight back (twice, then a 503). Serve's picks are kept otherwise."""
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

    from deployments.router import Pow2Router

    def rep(name, alive=True):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={"alive": alive})

    a, b, c, dead = rep("a"), rep("b"), rep("c"), rep("d", alive=False)
    picks: list = []

    async def serve_picks(self, candidates, pending=None):
        return [list(picks)]

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", serve_picks)
    router = object.__new__(Pow2Router)  # no Ray: Serve's own pick is stubbed

    def choose(avoid=(), method="generate", candidates=(a, b, c, dead), failed=()):
        req = GenerateRequest("cmpl-1", prompt="x", avoid_replicas=tuple(avoid) + tuple(failed),
                              failed_replicas=tuple(failed))
        pending = SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=(req,), kwargs={})
        ranks = asyncio.run(router.choose_replicas(list(candidates), pending))
        return [[r.replica_id.unique_id for r in group] for group in ranks]

    picks[:] = [a, b]
    assert choose() == [["a", "b"]]  # nothing to pass over: Serve's pick as it is
    assert choose(avoid=["a"]) == [["b"], ["a"]]  # the replica that turned it away: last
    assert choose(failed=["a"]) == [["b"]]  # the one whose engine failed it: not while another can take it
    picks[:] = [dead, a]
    assert choose() == [["a"]]  # a dead engine not where another can take it (Serve queues for the live ones)
    picks[:] = [dead]
    assert choose(candidates=(dead,)) == [["d"]]  # the only one: still tried (the request gets its 503)
    random.seed(3)
    picks[:] = [dead, b]
    got = choose(avoid=["b"])  # both picks passed over: two of the others first
    assert sorted(got[0]) == ["a", "c"] and got[1:] == [["b"]]
    assert choose(avoid=["b"], method="stats") == [["b"], ["d"]]  # other methods: a dead engine last (as SLORouter)


def test_both_routers_pass_over_a_replica_that_stopped_reporting(monkeypatch) -> None:
    """A replica whose process stopped (or that a partition cut off) keeps its last routing stats in Serve's
    controller until the health check replaces it, about 90 s: both routers rank it with the dead once its report
    reached them SILENT_S before the others' latest. First seen, a report is as old as its stamp against the
    freshest; then each is timed as it changes here: a replica on a node whose clock is behind the others' by more
    than SILENT_S, reporting each period, is not silent once its report changes."""
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

    from deployments import router as router_mod
    from deployments.router import SILENT_S, Pow2Router, Silence, SLORouter

    from collections import namedtuple

    rid = namedtuple("rid", "unique_id")  # hashable, as Serve's ReplicaID

    def rep(name, ts):
        return SimpleNamespace(replica_id=rid(name), routing_stats=RoutingStats(
            num_waiting=0, num_running=0, inflight=0, vbs=0.0, strictest_tpot_ms=None, kv_blocks_free=100,
            kv_blocks_total=100, predicted_ttft_ms=10.0, predicted_queue_ms=1.0, median_prompt_tokens=64,
            prefill_sq_ms=0.0, itl_ms=5.0, step_batch=1.0, alive=True, ts=ts).to_dict())

    now = 1_000_000.0  # another node's clock: only the gaps between reports count
    fresh, also, stuck = rep("fresh", now), rep("also", now - 1.0), rep("stuck", now - SILENT_S - 5)
    assert Silence().quiet([fresh, also, stuck]) == [rid("stuck")]
    assert Silence().quiet([stuck]) == [] and Silence().quiet([fresh, rep("new", 0.0)]) == []  # alone, or no report
    # this process's clock (monotonic), as reports change: "skewed" stamps 60 s behind the others, "stopped" stops
    clock = {"t": 500.0}
    monkeypatch.setattr(router_mod.time, "monotonic", lambda: clock["t"])
    watch = Silence()
    for k in range(40):
        t = now + k
        reps = [rep("fresh", t), rep("skewed", t - 60.0), rep("stopped", min(t, now + 3))]
        got = watch.quiet(reps)
        if k == 0:
            assert got == [rid("skewed")]  # first seen: as old as its stamp against the freshest
        else:
            assert got == ([rid("stopped")] if k - 3 > SILENT_S else []), k
        clock["t"] += 1.0
    # a routing_stats_period_s past SILENT_S: replicas reporting every 20 s, 17 s apart, are heard as they report;
    # one that stops is silent three of its intervals after its last report
    watch = Silence()
    for k in range(200):
        t = now + k
        last_a, last_b = t - t % 20, max(now, t - (t - 17) % 20)
        reps = [rep("a", last_a), rep("b", last_b), rep("gone", min(last_a, now + 40))]
        got = watch.quiet(reps)
        assert got in ([], [rid("gone")]) and (got == [] or k - 40 > 3 * 20), k
        clock["t"] += 1.0
    assert got == [rid("gone")]
    monkeypatch.undo()
    router = object.__new__(SLORouter)
    router.initialize_state()

    def choose(r, method="generate"):
        req = GenerateRequest(f"cmpl-{random.random()}", prompt="x", slo=SLO(ttft_ms=1000.0))
        pending = SimpleNamespace(metadata=SimpleNamespace(call_method=method, internal_request_id=req.request_id),
                                  args=(req,), kwargs={})
        return [g[0].replica_id.unique_id for g in asyncio.run(r.choose_replicas([stuck, fresh, also], pending))]

    for _ in range(5):  # the least loaded of all, and not at all while another can take the request
        got = choose(router)
        assert sorted(got) == ["also", "fresh"]
        assert choose(router, "stats")[-1] == "stuck"  # (other methods: last)
    # a request resent away from a replica that failed it (its engine died before its report says so): not there
    # while another can take it (it went back there, and its resend too: a 503 where the other one was full)
    resent = GenerateRequest("cmpl-r", prompt="x", slo=SLO(ttft_ms=1000.0), avoid_replicas=("fresh",),
                             failed_replicas=("fresh",))
    ctx = SimpleNamespace(should_backoff=False)
    pending = SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id="cmpl-r"),
                              args=(resent,), kwargs={}, routing_context=ctx)
    assert [g[0].replica_id.unique_id for g in asyncio.run(router.choose_replicas([stuck, fresh, also], pending))] \
        == ["also"]
    assert ctx.should_backoff  # (Serve backs off between tries only where told: a full replica was asked at once)
    # one that only turned it away (busy): last, not left out
    busy = dataclasses.replace(resent, request_id="cmpl-b", failed_replicas=())
    pending = SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id="cmpl-b"),
                              args=(busy,), kwargs={})
    assert [g[0].replica_id.unique_id for g in asyncio.run(router.choose_replicas([stuck, fresh, also], pending))] \
        == ["also", "fresh"]

    async def serve_picks(self, candidates, pending=None):
        return [[stuck, fresh]]

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", serve_picks)
    pow2 = object.__new__(Pow2Router)
    assert choose(pow2) == ["fresh"]


def test_router_sends_a_prompt_where_its_prefix_went_while_that_costs_little_slack() -> None:
    """Prefix affinity: a request whose prompt begins as one sent to a replica goes there (its prefix cache likely
    holds it) while that replica's slack is within AFFINITY_SLACK of the best (best effort: its load within
    AFFINITY_LOAD of the least loaded); else the ranking stands. A short prompt has no prefix to match."""
    import asyncio

    from deployments.router import PREFIX_CHARS, SLORouter, prefix_keys, prefix_match

    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()
    system = "You are a careful assistant. " * 40  # 1,160 characters

    def pending(call_id: str, prompt: str, **slo):
        req = GenerateRequest(f"cmpl-{call_id}", prompt=prompt, slo=SLO(**slo), prompt_len_hint=64)
        return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=call_id),
                               args=(req,), kwargs={})

    def choose(replicas, p) -> str:
        got = asyncio.run(router.choose_replicas(replicas, p))[0][0].replica_id
        router.on_request_routed(p, got, None)
        router.on_request_completed(got, p.metadata.internal_request_id)
        return got

    a, b = _replica("a", _stats(10, 20, kv=100)), _replica("b", _stats(10, 20, kv=99))  # "a" first on ties
    assert choose([a, b], pending("0", "hi")) == "a"
    assert router._prefixes == {}  # (shorter than PREFIX_CHARS: nothing to remember)
    b_first = [_replica("a", _stats(10, 20, load=1)), b]  # "b" less loaded: best effort goes there
    assert choose(b_first, pending("1", system + "first question")) == "b"
    assert choose([a, b], pending("2", system + "second question")) == "b"  # "a" no longer first: "b" holds it
    assert choose([a, b], pending("3", "another " * 200)) == "a"  # no prefix of it went anywhere
    busy_b = _replica("b", _stats(10, 20, load=4))  # 4 requests above "a": past AFFINITY_LOAD
    assert choose([a, busy_b], pending("4", system + "third")) == "a"
    assert choose([a, b], pending("4b", system + "then")) == "a"  # both hold it now: the ranking stands
    # with SLOs: within the slack bound it goes where the prefix is, past it to the most slack
    system = "Answer in French. " * 60
    assert choose(b_first, pending("4c", system + "first")) == "b"
    near = _replica("b", _stats(10, 50))  # TTFT 50 ms of 400: slack 0.875 against "a"'s 0.95
    far = _replica("b", _stats(10, 300))  # slack 0.25
    assert choose([a, near], pending("5", system + "fourth", ttft_ms=400)) == "b"
    assert choose([a, far], pending("6", system + "fifth", ttft_ms=400)) == "a"
    # the keys: the text cut at 256, 512, 1,024 characters, longest first; a match counts how far it goes
    keys = prefix_keys(GenerateRequest("x", prompt=system))
    assert len(keys) == 3 and PREFIX_CHARS == 256
    assert prefix_match(keys, router._prefixes["b"]) == 3 and prefix_match(keys, None) == 0
    assert prefix_keys(GenerateRequest("x", prompt=system[:300])) == keys[-1:]
    # a chat's keys begin with what its template shows first (its tools); token ids count as text
    from core.messages import ChatTurn, PromptOptions

    turns = (ChatTurn("user", system),)
    with_tools = GenerateRequest("x", messages=turns, options=PromptOptions(tools='[{"type": "function"}]'))
    assert prefix_keys(with_tools) != prefix_keys(GenerateRequest("x", messages=turns))
    with_docs = GenerateRequest("x", messages=turns, options=PromptOptions(documents='[{"text": "a"}]'))
    other_docs = GenerateRequest("x", messages=turns, options=PromptOptions(documents='[{"text": "b"}]'))
    assert len({tuple(prefix_keys(r)) for r in (with_docs, other_docs, GenerateRequest("x", messages=turns))}) == 3
    thinking = GenerateRequest("x", messages=turns, options=PromptOptions(chat_template_kwargs={"enable_thinking": 0}))
    assert prefix_keys(thinking) != prefix_keys(GenerateRequest("x", messages=turns))
    assert len(prefix_keys(GenerateRequest("x", prompt=tuple(range(10**6))))) == 11  # (256 chars to 256 KiB)
    # a prefix is the replica's where the call landed, not where it was ranked first
    p = pending("7", "Reply briefly. " * 40)
    assert asyncio.run(router.choose_replicas([a, b], p))[0][0].replica_id == "a"
    router.on_request_routed(p, "b", None)  # "a" was full
    keys = prefix_keys(p.args[0])
    assert prefix_match(keys, router._prefixes["b"]) == len(keys) and prefix_match(keys, router._prefixes["a"]) == 0


def test_router_bookkeeping_survives_a_reroute_under_the_same_request_id() -> None:
    from deployments.router import SLORouter

    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()

    def pending(tpot):
        req = GenerateRequest("cmpl-1", prompt="x", slo=SLO(tpot_ms=tpot))
        return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id="http-1"),
                               args=(req,), kwargs={})

    router.on_request_routed(pending(20.0), "a", None)  # "a" turns it away, the ingress calls again
    router.on_request_routed(pending(15.0), "b", None)  # (its TTFT SLO shortened, the same request id)
    assert router._inflight == {"a": {20.0: 1}, "b": {15.0: 1}}
    router.on_request_completed("a", "http-1")
    assert router._inflight["a"].total() == 0 and router._inflight["b"] == {15.0: 1}
    router.on_request_completed("b", "http-1")
    assert router._inflight["b"].total() == 0 and router._calls == {}


def test_router_spreads_requests_chosen_before_serve_reports_them_routed() -> None:
    # Serve calls on_request_routed only after the replica accepted the call (a round trip): requests arriving
    # together are all chosen before that, and must not all go to the same replica
    import asyncio

    from deployments.router import SLORouter

    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()
    a, b = _replica("a", _stats(10, 20)), _replica("b", _stats(10, 20, kv=99))  # "a" first on ties (more KV free)

    def pending(call_id: str, tpot: float | None = None):
        req = GenerateRequest(f"cmpl-{call_id}", prompt="x", slo=SLO(tpot_ms=tpot))
        return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=call_id),
                               args=(req,), kwargs={})

    def choose(p) -> str:
        return asyncio.run(router.choose_replicas([a, b], p))[0][0].replica_id

    calls = [pending(f"http-{i}") for i in range(4)]
    assert [choose(p) for p in calls] == ["a", "b", "a", "b"]
    assert choose(calls[0]) == "a" and router._inflight == {"a": {None: 2}, "b": {None: 2}}  # a retry: no double count
    router.on_request_routed(calls[0], "b", None)  # ranked "a" first, but "a" was full: it landed on "b"
    assert router._inflight == {"a": {None: 1}, "b": {None: 3}} and "http-0" not in router._chosen
    for p, where in zip(calls[1:], "bab"):
        router.on_request_routed(p, where, None)
    assert router._inflight == {"a": {None: 1}, "b": {None: 3}} and router._chosen == {}
    for p, where in zip(calls, "bbab"):
        router.on_request_completed(where, p.metadata.internal_request_id)
    assert router._inflight["a"].total() == 0 and router._inflight["b"].total() == 0
    # a call chosen but never routed (cancelled while routing) stops counting after a while
    choose(pending("http-9", 20.0))
    from deployments.router import CHOSEN_TTL_S

    router._chosen["http-9"] = (*router._chosen["http-9"][:2], time.monotonic() - CHOSEN_TTL_S - 1.0)
    choose(pending("http-10"))
    assert "http-9" not in router._chosen and router._inflight["a"].get(20.0) is None


def test_router_holds_a_tpot_slo_against_the_replicas_own_gate() -> None:
    """A replica reports its VBS gate as a line (base + row x VBS' < T_min'): the router calls a TPOT SLO attainable
    where that gate would admit the request, with the requests it sent since the report in the batch, and counts each
    request at its TPOT's share of the steps, as the gate does."""
    from deployments.router import slack

    line = _stats(10, 20, itl=3.0, gate=(1.0, 0.2))  # measured 3 ms steps (at batch 1) long ago; idle now
    assert [slack(view(line, n, 64), SLO(tpot_ms=1.5)) is not None for n in range(4)] == [True, True, False, False]
    loose = {**_stats(10, 20, load=4, itl=3.0, gate=(1.0, 0.2), inv_sum=4 / 10.0), "strictest_tpot_ms": 10.0}
    # four requests at TPOT 10 decode every fifth step under a TPOT 2 pace: the batch is 0.8 + 1, not 5
    assert view(loose, 4, 64).itl_with(2.0, 2.0) == pytest.approx(1.0 + 0.2 * 1.8)
    assert slack(view(loose, 4, 64), SLO(tpot_ms=2.0)) is not None
    # a request of TPOT 20 joining them counts half a step at their pace, and must keep it
    assert view(loose, 4, 64).itl_with(20.0, 10.0) == pytest.approx(1.0 + 0.2 * 4.5)
    assert view(_stats(10, 20, itl=3.0), 0, 64).itl_with(1.5, 1.5) == pytest.approx(3.0)  # no line: the step
    # one request at TPOT 100 and 8 best-effort ones (half a step each) running; a TPOT 25 request: the gate counts
    # 25 x (1/100 + 1/25) + 8 x 0.5 = 5.25, so 10 + 3 x 5.25 = 25.75 ms, over 25: not attainable (the best-effort
    # share is not rescaled to the stricter pace); and each of this router's calls since the report counts 1
    mixed = {**_stats(10, 20, load=9, itl=3.0, gate=(10.0, 3.0), inv_sum=0.01, be_share=4.0),
             "strictest_tpot_ms": 100.0}
    assert view(mixed, 9, 64).itl_with(25.0, 25.0) == pytest.approx(25.75)
    assert slack(view(mixed, 9, 64), SLO(tpot_ms=25.0)) is None
    assert view(mixed, 14, 64).itl_with(25.0, 25.0) == pytest.approx(25.75 + 3.0 * 5)
    assert RoutingStats.from_dict({k: v for k, v in mixed.items() if k not in ("gate_base_ms", "tpot_inv_sum")})
    with pytest.raises(ProtocolError):  # a key the router needs is still required; an unknown one refused
        RoutingStats.from_dict({k: v for k, v in mixed.items() if k != "ts"})
    with pytest.raises(ProtocolError):
        RoutingStats.from_dict({**mixed, "zzz": 1})


def test_a_burst_of_strict_requests_goes_where_the_gates_admit_it() -> None:
    """A burst inside one routing-stats period: every request is chosen before any report counts it. Replica "a"'s
    gate admits two requests at TPOT 1.5 ms, "b"'s four; the router sends each its share, and the first past both
    to the least loaded. (Projected from the steps both measured alike, the burst split 3:3, and "a" turned one
    away.)"""
    import asyncio

    from deployments.router import SLORouter

    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()
    a = _replica("a", _stats(10, 20, itl=3.0, gate=(1.0, 0.2)))
    b = _replica("b", _stats(10, 20, itl=3.0, gate=(1.0, 0.11), kv=99))

    def pending(call_id: str):
        req = GenerateRequest(f"cmpl-{call_id}", prompt="x", slo=SLO(tpot_ms=1.5))
        return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=call_id),
                               args=(req,), kwargs={})

    chosen = [asyncio.run(router.choose_replicas([a, b], pending(f"http-{i}")))[0][0].replica_id for i in range(7)]
    assert sorted(chosen[:6]) == ["a", "a", "b", "b", "b", "b"] and chosen[6] == "a"


def _fake_clock(monkeypatch) -> list[float]:
    """This process's wall clock, as the router and the refusals read it: moved by the test (`clock[0] += s`)."""
    clock = [time.time()]
    fake = SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic)
    monkeypatch.setattr("deployments.router.time", fake)
    monkeypatch.setattr("deployments.refusals.time", fake)
    return clock


def test_a_replica_that_just_turned_a_request_away_is_passed_over_for_as_strict_ones_until_it_reports(
        monkeypatch) -> None:
    import asyncio

    from deployments.refusals import note_refusal
    from deployments.router import SLORouter

    clock = _fake_clock(monkeypatch)

    @dataclasses.dataclass(frozen=True)
    class Rid:
        unique_id: str

    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()
    a = SimpleNamespace(replica_id=Rid("a"), routing_stats=_stats(10, 20, gate=(1.0, 0.1)))
    b = SimpleNamespace(replica_id=Rid("b"), routing_stats=_stats(10, 20, gate=(1.0, 0.1), kv=99))  # "a" wins ties

    def first(tpot: float | None, ttft: float | None = None, priority: int = 0) -> str:
        req = GenerateRequest("cmpl-x", prompt="x", slo=SLO(tpot_ms=tpot, ttft_ms=ttft), priority=priority)
        p = SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=f"c{random.random()}"),
                            args=(req,), kwargs={})
        return asyncio.run(router.choose_replicas([a, b], p))[0][0].replica_id.unique_id

    def forget_choices() -> None:  # each choice counts as in flight: start every check from empty replicas
        router._inflight.clear()
        router._chosen.clear()

    assert first(20.0) == "a"
    forget_choices()
    note_refusal("a", SLO(tpot_ms=20.0), "tpot_unattainable")  # what the ingress does on a 429 from "a"
    assert first(20.0) == "b" and first(15.0) == "b"  # as strict or stricter: elsewhere
    forget_choices()
    assert first(50.0) == "a"  # looser: "a" may still have room
    forget_choices()
    assert first(None, 500.0) == "a"  # another SLO
    forget_choices()
    assert first(20.0, priority=-1) == "b"  # the TPOT gate judges each request alone: as strict, elsewhere too
    forget_choices()
    note_refusal("a", SLO(ttft_ms=500.0), "ttft_unattainable")
    assert first(None, 400.0) == "b" and first(None, 400.0, priority=-1) == "a"  # a TTFT refusal: its queue's order
    forget_choices()
    note_refusal("a", SLO(tpot_ms=20.0), "tpot_unattainable")
    a.routing_stats = {**a.routing_stats, "ts": 0.5}  # a report from "a" whose clock is 1.76e9 s behind ours...
    clock[0] += 1.5
    assert first(20.0) == "b"  # ...taken before the refusal: it still holds
    forget_choices()
    a.routing_stats = {**a.routing_stats, "ts": 1.5}  # a newer report shows "a" as it is now
    assert first(20.0) == "a" and not router._refused
    forget_choices()
    note_refusal("a", SLO(), "overloaded")  # its queue is full: a request without an SLO is turned away there too
    assert first(None) == "b" and first(None, priority=-1) == "a"


def test_the_router_forgets_a_replica_serve_stopped(monkeypatch) -> None:
    """A scale-down (or a redeploy) stops replicas without their dying: what the router kept of them (refusals,
    in-flight counts, prefixes) goes with them, as for a dead one."""
    from ray.serve._private.request_router.request_router import RequestRouter

    from deployments.refusals import note_refusal
    from deployments.router import SLORouter

    @dataclasses.dataclass(frozen=True)
    class Rid:
        unique_id: str

    def base_update(self, replicas):  # (Serve's own bookkeeping, as far as the router reads it)
        self._replica_id_set = {r.replica_id for r in replicas}

    monkeypatch.setattr(RequestRouter, "update_replicas", base_update)
    router = object.__new__(SLORouter)
    router.initialize_state()
    router._replica_id_set = set()
    a, b = (SimpleNamespace(replica_id=Rid(n)) for n in ("a", "b"))
    router.update_replicas([a, b])
    note_refusal("a", SLO(tpot_ms=20.0), "tpot_unattainable")
    router._count(a.replica_id, 20.0, +1)
    router._prefixes[a.replica_id] = {"k": 1}
    router.update_replicas([b])
    assert "a" not in router._refused and a.replica_id not in router._inflight and a.replica_id not in router._prefixes


def test_router_does_not_count_a_call_that_completed_before_it_was_routed() -> None:
    """Serve may run a call's completion callback before `on_request_routed` (a call that failed at once). It is not
    counted: a report need not prove it gone (one that counts other ingress replicas' calls never would), and its
    strict TPOT SLO would hold the replica's pace down for good."""
    from deployments.router import SLORouter

    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()
    req = GenerateRequest("cmpl-0", prompt="x", slo=SLO(tpot_ms=5.0))
    p = SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id="http-0"), args=(req,),
                        kwargs={})
    router._chosen["http-0"] = ("a", 5.0, time.monotonic())  # (chosen: Serve asks the router first)
    router.on_request_completed("a", "http-0")
    router.on_request_routed(p, "a", None)
    assert not router._inflight.get("a") and router._calls == {}
    router.on_request_routed(p, "a", None)  # (routed again: a retry under the same id counts)
    assert dict(router._inflight["a"]) == {5.0: 1}
    # a call the replica turned away ends (Serve cancels it), then its retry under the same id is chosen and lands
    # on the same replica (the only one): it runs, and counts
    import asyncio

    router = object.__new__(SLORouter)
    router.initialize_state()
    a = _replica("a", _stats(10, 20))
    asyncio.run(router.choose_replicas([a], p))
    router.on_request_completed("a", "http-0")
    asyncio.run(router.choose_replicas([a], p))
    router.on_request_routed(p, "a", None)
    assert dict(router._inflight["a"]) == {5.0: 1}
    # the Ingress's other calls through the handle (token_text, ...) are never routed as generate calls: no trace
    for i in range(50):
        router.on_request_completed("a", f"other-{i}")
    assert not router._ended_early


def test_router_drops_calls_a_report_proves_finished(monkeypatch) -> None:
    # a call whose completion never reaches the router would count as in flight forever and steer every request away
    # from its replica, unless a report fixes it
    import asyncio

    from deployments.router import REPORT_LAG_S, SLORouter

    clock = _fake_clock(monkeypatch)
    router = object.__new__(SLORouter)  # only its bookkeeping: no Ray
    router.initialize_state()

    def pending(call_id: str, tpot: float | None = None):
        req = GenerateRequest(f"cmpl-{call_id}", prompt="x", slo=SLO(tpot_ms=tpot))
        return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=call_id),
                               args=(req,), kwargs={})

    router.on_request_routed(pending("http-0", 10.0), "a", None)  # (its completion is lost)
    router.on_request_routed(pending("http-1"), "a", None)  # still running there
    assert router._inflight["a"].total() == 2
    t0 = 1000.0  # the replicas' clock, far from this process's
    a, b = _replica("a", {**_stats(10, 20), "ts": t0}), _replica("b", {**_stats(10, 20, kv=99), "ts": t0})
    # a report taken right after they were routed proves nothing yet (it may not include them)
    asyncio.run(router.choose_replicas([a, b], pending("http-2")))
    assert router._inflight["a"].total() == 2
    # a later report counts one call running: one of ours is gone, and the strict TPOT with it (the oldest)
    clock[0] += REPORT_LAG_S + 1.0
    a.routing_stats = {**_stats(10, 20, load=1), "ts": t0 + REPORT_LAG_S + 1.0}
    b.routing_stats = {**_stats(10, 20, kv=99), "ts": t0 + REPORT_LAG_S + 1.0}
    chosen = asyncio.run(router.choose_replicas([a, b], pending("http-3")))[0][0].replica_id
    assert dict(router._inflight["a"]) == {None: 1 + (chosen == "a")}
    router.on_request_completed("a", "http-1")
    assert router._calls == {}


def test_routers_of_several_ingress_replicas_spread_a_burst_between_reports(monkeypatch) -> None:
    """Four ingress replicas, each with its own router, two LLM replicas that report 8 calls in flight each (2 from
    each router). A burst of 3 requests at each ingress before the next report: each router counts the calls it sent
    since the report, not its in-flight count less the report's (which stays below 0: every router saw no change and
    sent all 12 to the replica that wins ties)."""
    import asyncio

    from deployments.router import SLORouter

    clock = _fake_clock(monkeypatch)
    a = _replica("a", {**_stats(10, 20, load=8), "ts": 50.0})
    b = _replica("b", {**_stats(10, 20, load=8, kv=99), "ts": 50.0})  # "a" first on ties (more KV free)
    routers = []
    for k in range(4):
        router = object.__new__(SLORouter)
        router.initialize_state()
        for i, where in enumerate("aabb"):  # routed before the report: in its count
            router.on_request_routed(_pending(f"old-{k}-{i}"), where, None)
        routers.append(router)
    clock[0] += 0.5  # the report comes (taken after those calls)
    sent = Counter()
    for k, router in enumerate(routers):
        for i in range(3):
            p = _pending(f"new-{k}-{i}", ttft=1000.0)
            where = asyncio.run(router.choose_replicas([a, b], p))[0][0].replica_id
            router.on_request_routed(p, where, None)
            sent[where] += 1
    assert sent == {"a": 8, "b": 4}  # each router: a, b, a
    # a call routed before the report that ended since is one fewer there than it shows
    router = routers[0]
    router.on_request_completed("a", "old-0-0")
    router.on_request_completed("a", "old-0-1")
    router.on_request_completed("a", "new-0-0")
    router.on_request_completed("a", "new-0-2")
    assert router._fresh == {"a": -2, "b": 1}
    p = _pending("new-0-3", ttft=1000.0)
    assert asyncio.run(router.choose_replicas([a, b], p))[0][0].replica_id == "a"
    # the next report (taken after the ends, 1 s later by the replicas' clock) counts afresh: the one call to "b"
    clock[0] += 1.0
    a.routing_stats = {**a.routing_stats, "ts": 51.0}
    b.routing_stats = {**b.routing_stats, "ts": 51.0}
    router._unchoose("new-0-3")
    asyncio.run(router.choose_replicas([a, b], _pending("new-0-4", ttft=1000.0)))
    assert router._fresh == {"a": 1, "b": 0}  # (the call just chosen)


def _pending(call_id: str, tpot: float | None = None, ttft: float | None = None) -> SimpleNamespace:
    req = GenerateRequest(f"cmpl-{call_id}", prompt="x", slo=SLO(tpot_ms=tpot, ttft_ms=ttft))
    return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", internal_request_id=call_id),
                           args=(req,), kwargs={})


def test_a_report_the_router_cannot_read_leaves_the_replica_unreported_and_routing_going(caplog) -> None:
    """A key a newer replica adds (a rolling upgrade) is left out; a report with a key missing or of the wrong type
    is the replica's not having reported (logged once): routing still answers, where an exception would leave Ray's
    pending request waiting."""
    import asyncio

    from deployments.router import SLORouter

    router = object.__new__(SLORouter)
    router.initialize_state()
    newer = _replica("newer", {**_stats(10, 20, load=3), "ts": 5.0, "new_field": [1]})
    broken = _replica("broken", {**_stats(10, 20), "num_running": "3"})
    plain = _replica("plain", _stats(10, 20, load=1))
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        views = {r.replica_id: view(router._stats(r), 0, 64) for r in (newer, broken, plain)}
        assert views["newer"].load == 3 and views["plain"].load == 1
        assert views["broken"].pred_ttft_ms is None and views["broken"].load == 0  # as one with no report yet
        for i in range(3):
            ranked = asyncio.run(router.choose_replicas([newer, broken, plain], _pending(f"c{i}", ttft=500.0)))
            assert len(ranked) == 3 and ranked[-1][0].replica_id == "broken"
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ProtocolError, match="num_running"):
        RoutingStats.from_dict(broken.routing_stats)
    for bad in ({"alive": 1}, {"ts": None}, {"kv_blocks_free": 1.5}, {"vbs": True}):
        with pytest.raises(ProtocolError):
            RoutingStats.from_dict({**plain.routing_stats, **bad})
    assert RoutingStats.from_dict({**plain.routing_stats, "itl_ms": None, "vbs": 2, "kv_blocks_free": np.int64(7)})


def test_router_without_stats_spreads_by_inflight() -> None:
    a, b = _replica("a", {}), _replica("b", {})
    assert _rank([a, b], {"ttft_ms": 100}, inflight={"a": 1}) == ["b", "a"]


def test_check_health_raises_when_engine_dead() -> None:
    from deployments.replica import LLMServer

    check = LLMServer.func_or_class.check_health
    check(SimpleNamespace(replica_id="r", engine=SimpleNamespace(dead_reason=lambda: None)))
    with pytest.raises(RuntimeError, match="dead: engine worker hung"):  # Serve's log says why
        check(SimpleNamespace(replica_id="r", engine=SimpleNamespace(dead_reason=lambda: "engine worker hung")))


def test_plain_chat_format() -> None:
    from engine.inputs import render_plain_chat

    assert render_plain_chat([ChatTurn("system", "S"), ChatTurn("user", "U")]) == \
        "System: S\nUser: U\nAssistant:"


def test_serve_config_yaml_is_valid() -> None:
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from deployments import build_app

    root = Path(__file__).resolve().parents[2]
    cfg = ServeDeploySchema.model_validate(yaml.safe_load((root / "serve_config.yaml").read_text()))
    app_cfg = cfg.applications[0]
    assert app_cfg.import_path == "deployments:app"
    a = AppArgs.model_validate(app_cfg.args)
    assert a.num_gpus == 1 and build_app(a) is not None
    llm = next(d for d in app_cfg.deployments if d.name == "LLMServer")
    assert llm.ray_actor_options.num_gpus == 1
    # a replica takes what its engine holds (running and waiting): a cap of max_num_seqs (256) left the engine's
    # queue, where the scheduler orders and turns requests away, empty, and the rest waited at the Ingress's handle
    sched = a.resolved().replica_scheduler()
    assert llm.max_ongoing_requests == a.resolved().max_ongoing_requests == sched.max_num_seqs + sched.max_waiting


def test_app_is_a_builder_for_serve_run_with_and_without_arguments(tmp_path) -> None:
    """`serve run deployments:app model=DIR dtype=float32` and a plain `serve run deployments:app` both work:
    Serve hands `app` its key=value arguments (or none); `serve build` gets the built `default_app`."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as serve_builds

    import deployments

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # (a folder without one is refused at build)
    for args in ({"model": str(tmp_path), "dtype": "float32"}, {}, {"num_replicas": 2},
                 {"num_replicas": 2, "access_log": "true"}):
        built = serve_builds(deployments.app, args)
        assert isinstance(built, Application)
        top = built._bound_deployment
        if args.get("num_replicas", 1) == 1:  # topology=auto: one replica serves HTTP itself
            assert top.name == "LLMServer" and top.func_or_class.__name__ == "DirectFrontend"
            engine_config = top.init_args[0]
            deployed = [top]
        else:  # Ingress(llm, settings) -> LLMServer
            assert top.name == "Ingress"
            llm = top.init_args[0]._bound_deployment
            assert llm.name == "LLMServer" and llm.num_replicas == 2
            engine_config = llm.init_args[0]
            deployed = [top, llm]
        for d in deployed:  # Serve's access log: off unless asked
            assert d._deployment_config.logging_config["enable_access_log"] is ("access_log" in args)
        # the knobs given, and device=cpu (no GPU given); the rest the engine fills in for its device
        assert engine_config == {"device": "cpu", "max_tokens_over_context": "reject", "scheduler": {},
                                 **{k: v for k, v in args.items() if k in ("model", "dtype")}}
        cfg = EngineConfig.model_validate(engine_config)
        assert cfg.model == args.get("model", "kairos-default") and cfg.dtype == args.get("dtype", "auto")
    assert isinstance(deployments.default_app, Application)  # built when asked for (a module __getattr__)
    assert deployments.default_app is deployments.default_app
    with pytest.raises(ValueError, match="Arguments can only be passed"):
        serve_builds(deployments.default_app, {"model": "x"})
    with pytest.raises(ValidationError):
        serve_builds(deployments.app, {"num_replicas": 0})


def test_replicas_default_to_one_per_gpu_that_ray_can_give(monkeypatch) -> None:
    """`serve run deployments:app` on a GPU box serves on its GPUs, one replica each (routed through the SLO
    router where there are several), as vLLM takes the GPU by default; on a box without one, a replica on the CPU.
    Given numbers, and a device other than auto or cuda, stand."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as serve_builds

    import deployments
    from deployments import args as A

    monkeypatch.setattr(A, "gpus_for_app", lambda: 4.0)
    a = AppArgs().resolved()
    assert (a.num_gpus, a.num_replicas, a.direct) == (1.0, 4, False)
    assert AppArgs().engine_config().device == "auto"  # the replica's own GPU
    top = serve_builds(deployments.app, {})._bound_deployment
    llm = top.init_args[0]._bound_deployment
    assert top.name == "Ingress" and llm.num_replicas == 4 and llm.ray_actor_options["num_gpus"] == 1.0
    assert AppArgs.model_validate({"num_gpus": 0.5}).resolved().num_replicas == 8
    assert AppArgs.model_validate({"num_gpus": 2}).resolved().num_replicas == 2
    assert AppArgs.model_validate({"num_gpus": 8}).resolved().num_replicas == 1  # a node that big, or it waits
    assert AppArgs.model_validate({"num_gpus": 0.1}).resolved().num_replicas == 40  # not 39 (4.0 / 0.1 = 39.99...)
    # more replicas asked for than there are GPUs: on the CPU, as before (num_gpus says how to share them)
    assert AppArgs.model_validate({"num_replicas": 8}).resolved().num_gpus == 0.0
    assert (AppArgs.model_validate({"num_replicas": 2}).resolved().num_gpus) == 1.0
    assert AppArgs.model_validate({"device": "cuda"}).resolved().num_gpus == 1.0
    for given in ({"device": "cpu"}, {"device": "cuda:1"}, {"num_gpus": 0}):  # the user places the engine
        r = AppArgs.model_validate(given).resolved()
        assert (r.num_gpus, r.num_replicas, r.direct) == (0.0, 1, True)
    assert AppArgs.model_validate({"num_gpus": 0}).engine_config().device == "cpu"
    monkeypatch.setattr(A, "gpus_for_app", lambda: 0.0)
    r = AppArgs().resolved()
    assert (r.num_gpus, r.num_replicas, r.direct) == (0.0, 1, True) and AppArgs().engine_config().device == "cpu"
    assert AppArgs.model_validate({"num_replicas": 3}).resolved().num_gpus == 0.0


def test_a_gpu_engine_takes_the_gpu_scheduler_defaults_for_the_knobs_not_given(monkeypatch) -> None:
    """vLLM's batch sizes on a GPU (256 running requests): the engine fills in what was not given once it knows its
    device, and a config sent to a replica or an engine process keeps which knobs were given."""
    from engine.config import GPU_SCHEDULER_DEFAULTS, for_device
    from scheduling.config import SchedulerConfig

    from deployments import args as A

    gpu = for_device(EngineConfig(), "cuda").scheduler
    assert {k: getattr(gpu, k) for k in GPU_SCHEDULER_DEFAULTS} == GPU_SCHEDULER_DEFAULTS
    assert for_device(EngineConfig(), "cpu") == EngineConfig()
    # a policy's own on top: kairos's gate without a static margin; SCORPIO's published 1.3 stays, as a margin given
    assert gpu.vbs_margin == 1.0 and gpu.flags().vbs_margin == 1.0
    assert EngineConfig().scheduler.flags().vbs_margin == 1.05
    scorpio = for_device(EngineConfig(scheduler=SchedulerConfig(policy="scorpio")), "cuda").scheduler
    assert scorpio.vbs_margin is None and scorpio.flags().vbs_margin == 1.3
    given = for_device(EngineConfig(scheduler=SchedulerConfig(vbs_margin=1.1)), "cuda").scheduler
    assert given.flags().vbs_margin == 1.1
    sent = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8)).model_dump(mode="json", exclude_unset=True)
    got = for_device(EngineConfig.model_validate(sent), "cuda").scheduler
    assert (got.max_num_seqs, got.max_waiting, got.prefill_max_tokens) == (8, 512, 2048)
    monkeypatch.setattr(A, "gpus_for_app", lambda: 2.0)
    assert AppArgs().replica_scheduler().max_num_seqs == 256  # a batched completion's prompts in flight per replica
    assert AppArgs.model_validate({"max_num_seqs": 32}).replica_scheduler().max_num_seqs == 32
    assert AppArgs.model_validate({"num_gpus": 0}).replica_scheduler().max_num_seqs == 64
    assert AppArgs.model_validate({"num_gpus": 0, "device": "cuda"}).replica_scheduler().max_num_seqs == 256
    # the router's cap on a replica holds what its engine does, running and waiting (256 at least, as before)
    assert AppArgs().resolved().max_ongoing_requests == 256 + 512
    assert AppArgs.model_validate({"num_gpus": 0}).resolved().max_ongoing_requests == 256
    assert AppArgs.model_validate({"max_ongoing_requests": 100}).resolved().max_ongoing_requests == 100


def test_the_gpus_for_an_app_are_the_clusters_once_connected(monkeypatch) -> None:
    import ray

    from deployments import args as A

    monkeypatch.setattr(A, "_torch_has_cuda", lambda: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    assert A.gpus_for_app() == 8.0
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert A.gpus_for_app() == 0.0
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(A, "_local_gpus", lambda: 2)
    assert A.gpus_for_app() == 2.0
    monkeypatch.setattr(A, "_torch_has_cuda", lambda: False)  # a CPU build of torch cannot use them
    assert A.gpus_for_app() == 0.0


def test_a_local_checkpoint_of_a_family_the_engine_cannot_run_is_refused_when_the_app_is_built(tmp_path) -> None:
    """`serve run deployments:app model=DIR` with a Gemma checkpoint fails at once with the loader's message, not
    after Serve has tried to start its replicas three times; a path this machine does not have is left to them."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as serve_builds

    import deployments

    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text('{"model_type": "gemma2"}')
    with pytest.raises(ValidationError, match=r"unsupported model family 'gemma2'; supported: gpt2, llama"):
        serve_builds(deployments.app, {"model": str(tmp_path / "gemma")})
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    for fine in (tmp_path / "llama", tmp_path / "elsewhere", "org/some-model", "kairos-tiny"):
        assert AppArgs.model_validate({"model": str(fine)}).model == str(fine)


def test_cluster_yaml_is_valid() -> None:
    from pathlib import Path

    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    root = Path(__file__).resolve().parents[2]
    cfg = prepare_config(yaml.safe_load((root / "cluster.yaml").read_text()))
    validate_config(cfg)
    assert cfg["available_node_types"]["head"]["resources"] == {"CPU": 0}


def test_stream_batching_merges_tokens_but_sends_the_first_at_once() -> None:
    """stream pacing: after the first token at most one message per hold, with every token kept."""
    import asyncio
    import threading

    import engine.engine  # noqa: F401 - generate() imports it; import (torch) before the producer's clock starts
    from deployments.pacing import StreamPacing
    from deployments.replica import LLMServer
    from engine.stream import RequestStream

    def run(interval_s: float) -> list[RequestOutput]:
        st = RequestStream("r1")

        def produce() -> None:
            for i in range(40):
                time.sleep(0.002)
                st.put(RequestOutput("r1", text=f"t{i} ", token_ids=[i], num_output_tokens=i + 1,
                                     finished=i == 39, finish_reason="length" if i == 39 else None))

        noop = lambda *a, **k: None  # noqa: E731
        me = SimpleNamespace(
            pacing=StreamPacing(interval_s), log_prompts=False, inflight=0, _inflight_peak=0, aborted=0, itl_ms=None,
            replica_id="r",
            demand=DemandRates(),
            _prompt_lens=[], _decode_left={}, engine=SimpleNamespace(generate=lambda req: st, abort=noop,
                                                    stats=lambda: SimpleNamespace(step_ms=2.0, step_batch=1.0)),
            metrics=SimpleNamespace(on_admitted=noop, on_itls=noop, on_finished=noop, on_rejected=noop, on_tokens=noop,
                                    on_first_token=noop,
                                    tier_label=lambda slo: slo.tier))

        async def collect() -> list[RequestOutput]:
            threading.Thread(target=produce, daemon=True).start()
            gen = LLMServer.func_or_class.generate(me, GenerateRequest("r1", prompt=(1, 2)))
            return [x async for x in gen]

        return asyncio.run(collect())

    every = run(0.0)
    batched = run(0.025)
    for items in (every, batched):
        assert "".join(x.text for x in items) == "".join(f"t{i} " for i in range(40))
        assert sum(len(x.token_ids) for x in items) == 40 and items[-1].finished
    assert len(batched[0].token_ids) == 1  # the first token is never held back
    assert len(batched) < len(every) / 2


def test_a_stream_its_caller_abandons_is_counted_aborted_or_abandoned_with_its_tokens() -> None:
    """A caller that goes away after three tokens leaves an `abort` finish of an admitted request (its prompt and
    three tokens counted as they came), and its request aborted in the engine; one that goes away before the first
    token leaves an abandoned request, never admitted. A finished request's tokens are counted as they stream, and
    those its stream never carried at its end."""
    import asyncio

    import engine.engine  # noqa: F401
    from deployments.pacing import StreamPacing
    from deployments.replica import LLMServer
    from engine.stream import RequestStream

    calls: list[tuple] = []
    noop = lambda *a, **k: None  # noqa: E731

    def replica(st: RequestStream) -> SimpleNamespace:
        return SimpleNamespace(
            pacing=StreamPacing(0.0), log_prompts=False, inflight=0, _inflight_peak=0, aborted=0, itl_ms=None,
            replica_id="r",
            demand=DemandRates(),
            _prompt_lens=[], _decode_left={}, engine=SimpleNamespace(generate=lambda req: st,
                                                                     abort=lambda rid: calls.append(("abort", rid))),
            metrics=SimpleNamespace(
                tier_label=lambda slo: slo.tier, on_admitted=lambda t, n: calls.append(("admitted", t, n)),
                on_tokens=lambda t, n: calls.append(("tokens", t, n)), on_itls=noop, on_rejected=noop,
                on_first_token=lambda t, s: calls.append(("first", t)),
                on_finished=lambda t, slo, out, n: calls.append(("finished", t, out.num_output_tokens, n)),
                on_aborted=lambda t: calls.append(("aborted", t)), on_abandoned=lambda t: calls.append(("gone", t))))

    async def three(st: RequestStream, me: SimpleNamespace, items: int) -> None:
        gen = LLMServer.func_or_class.generate(me, GenerateRequest("r1", prompt=(1, 2), slo=SLO(tpot_ms=1.5)))
        for _ in range(items):
            await gen.__anext__()
        await gen.aclose()

    st = RequestStream("r1")
    for i in range(3):  # queued before the first read: they come out merged, as one item of three tokens
        st.put(RequestOutput("r1", text=f"t{i}", token_ids=[i], num_prompt_tokens=2, num_output_tokens=i + 1))
    me = replica(st)
    asyncio.run(three(st, me, 1))
    assert calls == [("first", "tpot1.5"), ("admitted", "tpot1.5", 2), ("tokens", "tpot1.5", 3), ("abort", "r1"),
                     ("aborted", "tpot1.5")]  # (its TTFT counted at its first token, though it never finished)
    assert me.inflight == 0 and me.aborted == 1
    calls.clear()
    me = replica(RequestStream("r1"))

    async def gone_before_the_first_token() -> None:
        task = asyncio.ensure_future(three(RequestStream("r1"), me, 1))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(gone_before_the_first_token())
    assert calls == [("abort", "r1"), ("gone", "tpot1.5")] and me.inflight == 0
    calls.clear()
    st = RequestStream("r1")
    st.put(RequestOutput("r1", text="a", token_ids=[5], num_prompt_tokens=2, num_output_tokens=1))
    st.put(RequestOutput("r1", text="", token_ids=[], num_prompt_tokens=2, num_output_tokens=2, finished=True,
                         finish_reason="stop"))  # the stop token: counted, never streamed
    asyncio.run(three(st, replica(st), 1))
    assert calls == [("first", "tpot1.5"), ("admitted", "tpot1.5", 2), ("tokens", "tpot1.5", 1),
                     ("finished", "tpot1.5", 2, 1)]
    # a request that fails before the engine admits it (an adapter that does not load, a duplicate id, a shutdown)
    # is not counted admitted, nor its prompt's tokens (it was, with them: vllm:prompt_tokens too); one that failed
    # once admitted (a step) is
    from core.messages import ErrorKind, RequestMetrics

    failed = RequestOutput.failed("r1", "LoRA adapter 'x' uses DoRA", ErrorKind.INVALID_REQUEST)
    for metrics, counted in ((None, False), (RequestMetrics(0.0, None, None, 1.0), False),
                             (RequestMetrics(0.0, 1.0, None, 1.0), True)):
        calls.clear()
        st = RequestStream("r1")
        st.put(dataclasses.replace(failed, num_prompt_tokens=2, metrics=metrics))  # (the engine's own: no metrics)
        me = replica(st)
        asyncio.run(three(st, me, 1))
        assert (("admitted", "tpot1.5", 2) in calls) == counted and me.demand.admitted == counted, calls
        assert any(c[0] == "finished" for c in calls) == counted, calls  # only an admitted request is finished
        assert me._prompt_lens == ([2] if counted else []), me._prompt_lens
    # aborted while it waited (its ingress died, the engine shut down): abandoned, never finished
    calls.clear()
    st = RequestStream("r1")
    st.put(RequestOutput("r1", finished=True, finish_reason="abort", error="engine shut down",
                         metrics=RequestMetrics(0.0, None, None, 1.0)))
    asyncio.run(three(st, replica(st), 1))
    assert calls == [("gone", "tpot1.5")], calls
    # aborted while its prompt ran (its caller's death): abandoned too, with no prompt tokens counted (they were,
    # as an admitted request's, where its caller closing the stream at that point counted it abandoned)
    calls.clear()
    st = RequestStream("r1")
    st.put(RequestOutput("r1", finished=True, finish_reason="abort", num_prompt_tokens=2,
                         metrics=RequestMetrics(0.0, 0.5, None, 1.0)))
    asyncio.run(three(st, replica(st), 1))
    assert calls == [("gone", "tpot1.5")], calls


def test_ttft_and_inter_token_latencies_are_timed_as_the_engine_gave_the_tokens(monkeypatch) -> None:
    """The replica's TTFT and ITL series time a stream's tokens as they were put on it (the engine's pace), from the
    request's arrival: a reader that takes five tokens merged into one item (stream pacing, a busy loop) still sees
    a 300 ms stall among them, and the first token's TTFT as it came."""
    import asyncio

    import engine.engine  # noqa: F401
    import engine.stream as stream_mod
    from deployments.pacing import StreamPacing
    from deployments.replica import LLMServer
    from engine.stream import RequestStream

    clock = iter([10.0, 10.01, 10.02, 10.32, 10.33])
    monkeypatch.setattr(stream_mod.time, "monotonic", lambda: next(clock))
    st = RequestStream("r1", arrival_s=9.5)
    for i in range(5):
        st.put(RequestOutput("r1", text=f"t{i}", token_ids=[i], num_prompt_tokens=2, num_output_tokens=i + 1,
                             finished=i == 4, finish_reason="length" if i == 4 else None))
    monkeypatch.undo()
    seen: list[tuple] = []
    noop = lambda *a, **k: None  # noqa: E731
    me = SimpleNamespace(
        pacing=StreamPacing(0.0), log_prompts=False, inflight=0, _inflight_peak=0, aborted=0, itl_ms=None,
        replica_id="r", demand=DemandRates(), _prompt_lens=[], _decode_left={},
        engine=SimpleNamespace(generate=lambda req: st, abort=noop),
        metrics=SimpleNamespace(tier_label=lambda slo: slo.tier, on_admitted=noop, on_tokens=noop, on_rejected=noop,
                                on_finished=noop, on_aborted=noop, on_abandoned=noop,
                                on_first_token=lambda t, s: seen.append(("ttft", round(s, 3))),
                                on_itls=lambda t, gaps: seen.extend(("itl", round(s, 3), n) for s, n in gaps)))

    async def read() -> list[RequestOutput]:
        return [x async for x in LLMServer.func_or_class.generate(me, GenerateRequest("r1", prompt=(1, 2)))]

    items = asyncio.run(read())
    assert len(items) == 1 and items[0].token_ids == [0, 1, 2, 3, 4]  # (read at once: one item of five tokens)
    assert seen == [("ttft", 0.5), ("itl", 0.01, 1), ("itl", 0.01, 1), ("itl", 0.3, 1), ("itl", 0.01, 1)], seen


def test_a_direct_replica_builds_requests_with_the_scheduler_its_user_config_switched_to() -> None:
    """topology=direct: the replica answers HTTP with the model's info it read at start; a `reconfigure` (Serve's
    user_config) that turns priority scheduling on reaches its requests too: a client's priority was zeroed for good,
    though the engine ranked by it."""
    from starlette.requests import Request

    from deployments.direct import DirectFrontend
    from engine.config import reconfigured
    from scheduling.config import SchedulerConfig

    class Engine:  # what LLMEngine.reconfigure does to its inputs
        def __init__(self) -> None:
            self.inputs = SimpleNamespace(priority_scheduling=False, eos_token_ids=[2],
                                          reject_max_tokens_over_context=True, max_logprobs=20,
                                          tokenizer=SimpleNamespace(chat_template=None))
            self.max_model_len, self.sampling_defaults = 512, {}

        def is_alive(self) -> bool:
            return True

        def reconfigure(self, knobs: dict) -> SchedulerConfig:
            cfg = reconfigured(SchedulerConfig(), SchedulerConfig(), knobs, "cpu")
            self.inputs.priority_scheduling = cfg.by_priority
            return cfg

    class Direct(DirectFrontend):
        def __del__(self) -> None:  # (no engine to stop: its coroutine would never be awaited)
            pass

    d = object.__new__(Direct)
    d.engine, d.model_name, d.replica_id, d._user_config = Engine(), "m", "r", {}
    d._init_frontend({"model_name": "m", "max_body_bytes": 1 << 20})
    d._info = d.model_info()  # (as its __init__ reads it)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    body = {"model": "m", "prompt": "hi", "priority": -5, "max_tokens": 4}
    assert d._build(Request(scope), body, "completion", "cmpl-1")[1][0].priority == 0  # (no priority scheduling)
    d.reconfigure({"scheduling_policy": "priority"})
    assert d._build(Request(scope), body, "completion", "cmpl-2")[1][0].priority == -5


def test_a_direct_replica_tokenizes_for_tokenize_off_its_event_loop() -> None:
    """topology=direct: /tokenize and /detokenize (and echo's, beam search's) run the replica's tokenizer on a
    thread, as Serve runs a routed replica's methods: on the event loop, a megabyte's tokenization or a chat's
    template stalled every stream the replica was writing. Its coroutine methods stay on the loop."""
    import asyncio
    import threading

    from deployments.direct import DirectFrontend

    class Direct(DirectFrontend):
        def __del__(self) -> None:
            pass

        def prompt_tokens(self, *args):  # (the replica's own: synchronous)
            return {"thread": threading.get_ident()}

        async def check_lora(self, name, path):
            return {"thread": threading.get_ident()}

    d = object.__new__(Direct)

    async def main():
        loop = threading.get_ident()
        tok = await d._replica_call("prompt_tokens", "hi", None, None, False)
        lora = await d._replica_call("check_lora", "a", "/x")
        return loop, tok["thread"], lora["thread"]
    loop, tok, lora = asyncio.run(main())
    assert tok != loop and lora == loop


def test_replica_metrics_bound_the_tier_labels_clients_make() -> None:
    """A tier label is the request's SLOs: clients choose them, so a replica names at most MAX_TIER_LABELS tiers
    and counts the rest as `other`."""
    from deployments import metrics as Mx

    m = object.__new__(Mx.ReplicaMetrics)
    m._tiers = set()
    names = [m.tier_label(SLO(ttft_ms=10_000.0 + i)) for i in range(Mx.MAX_TIER_LABELS + 5)]
    assert names[:Mx.MAX_TIER_LABELS] == [f"ttft{10_000 + i}" for i in range(Mx.MAX_TIER_LABELS)]
    assert set(names[Mx.MAX_TIER_LABELS:]) == {Mx.OTHER_TIER}
    assert m.tier_label(SLO(ttft_ms=10_000.0)) == "ttft10000"  # a tier it named keeps its name


def test_a_request_sent_again_keeps_its_clients_slo_and_the_engine_gets_what_is_left() -> None:
    """An ingress that sends a request again (rerouted, or a batch's prompt after waiting) says how much of its TTFT
    SLO it spent (`waited_ms`): the engine schedules by the rest; labels and the unattainable test keep the client's
    SLO (a prompt that waited is turned away for the load, 429, not as an SLO no idle replica meets, 400)."""
    from deployments.replica import judge_rejection
    from core.messages import RejectReason
    from scheduling.config import SchedulerConfig

    req = GenerateRequest("r", prompt="x", slo=SLO(ttft_ms=3000.0, tpot_ms=20.0), waited_ms=2990.0)
    assert req.engine_slo == SLO(ttft_ms=pytest.approx(10.0), tpot_ms=20.0) and req.slo.tier == "ttft3000_tpot20"
    assert GenerateRequest("r", prompt="x", slo=SLO(tpot_ms=20.0), waited_ms=5.0).engine_slo == SLO(tpot_ms=20.0)
    model = SimpleNamespace(prefill_ms=lambda n, sq=0.0: 40.0, itl_ms=lambda b, length: 5.0)
    view = judge_rejection(RejectReason.TTFT_UNATTAINABLE, req, 8, model, SchedulerConfig(), 512, 0, None, [])
    assert view.reason == RejectReason.TTFT_UNATTAINABLE  # its 3000 ms were attainable: the wait lost them


def test_an_slo_tier_label_keeps_fractions_and_leaves_out_what_is_not_set() -> None:
    assert SLO(ttft_ms=80.0, tpot_ms=1.5).tier == "ttft80_tpot1.5" and SLO(ttft_ms=80.0, tpot_ms=1.0).tier == "ttft80_tpot1"
    assert SLO(ttft_ms=500.0).tier == "ttft500" and SLO(tpot_ms=20.0).tier == "tpot20"
    assert SLO().tier == "best_effort"


def test_stream_pacing_holds_only_past_the_chunk_budget() -> None:
    from deployments.pacing import StreamPacing

    p = StreamPacing(max_chunks_per_s=1000)
    # 4 streams on 5 ms steps: 800 chunks a second fit the budget, every token goes out at once
    assert p.hold_s(4, 5.0) == 0.0
    # 40 streams on 5 ms steps would send 8,000 a second: each holds 40 ms, 1,000 a second in all
    assert p.hold_s(40, 5.0) == pytest.approx(0.040)
    # steps slower than the hold: one chunk per step already stays within the budget
    assert p.hold_s(40, 50.0) == 0.0
    assert p.hold_s(2, None) == pytest.approx(0.002)  # no step time yet: taken as fast
    assert p.hold_s(0, 1.0) == 0.0
    # 200 streams open but 30 decoding (the rest queued for prefill send nothing): 30 share the budget
    assert p.hold_s(200, 5.0, step_batch=29.4) == pytest.approx(0.030)
    assert p.hold_s(4, 5.0, step_batch=30.0) == 0.0  # never more streams than are open
    # the fixed interval is a floor; no budget means only the floor
    assert StreamPacing(0.020, 1000).hold_s(4, 5.0) == pytest.approx(0.020)
    assert StreamPacing(0.020, 1000).hold_s(40, 5.0) == pytest.approx(0.040)
    assert StreamPacing(0.0, 0.0).hold_s(500, 0.1) == 0.0 and not StreamPacing().holds
    assert StreamPacing(0.001).holds and p.holds
    with pytest.raises(ValueError):
        StreamPacing(-1.0)
    # routed: the Ingress's budget shared by the LLM replicas behind it; direct: each replica's own
    assert StreamPacing.of_app(0.0, 2000.0, 4, 2).max_chunks_per_s == pytest.approx(1000.0)
    direct = StreamPacing.of_app(0.0, 2000.0, 1, routed=False, direct_max_chunks_s=5000.0)
    assert direct.max_chunks_per_s == 5000.0
    # a GPU replica's 256 decoding streams on 13 ms steps (about 20,000 chunks a second) hold about 51 ms each;
    # a CPU replica's 16 streams on 5 ms steps (3,200 a second) are never held
    assert direct.hold_s(256, 13.0) == pytest.approx(256 / 5000.0) and direct.hold_s(16, 5.0) == 0.0


def test_stream_pacing_splits_the_app_budget_over_the_replicas_behind_an_ingress() -> None:
    from deployments.pacing import StreamPacing

    assert StreamPacing.of_app(0, 2000, num_replicas=2).max_chunks_per_s == 1000
    assert StreamPacing.of_app(0, 2000, num_replicas=4, ingress_num_replicas=2).max_chunks_per_s == 1000
    assert StreamPacing.of_app(10, 2000, num_replicas=1, routed=False) == StreamPacing(0.010, 0)  # no Ingress
    assert StreamPacing.of_app(0, 0, num_replicas=3).max_chunks_per_s == 0


class _Gen:
    """A stand-in for the replica's streaming handle call: yields `items[1:]` (the first is passed in)."""

    def __init__(self, items: list) -> None:
        self.items, self.i, self.cancelled = items, 1, False

    async def __anext__(self):
        self.i += 1
        return self.items[self.i - 1]

    def cancel(self) -> None:
        self.cancelled = True


def _sse_chunks(items: list) -> list:
    import asyncio
    import json

    from deployments.ingress import Ingress

    async def collect() -> list[bytes]:
        gen = Ingress.func_or_class._sse(SimpleNamespace(served_model_name="m"), _Gen(items), items[0], "completion",
                                         "cmpl-1", False, "m")
        return [c async for c in gen]

    return [json.loads(c.decode()[6:]) for c in asyncio.run(collect()) if c != b"data: [DONE]\n\n"]


def test_sse_sends_a_chunk_for_every_token_delivery_even_without_text() -> None:
    """A token that only starts a multi-byte character has no text yet; its chunk still goes out (as in vLLM),
    since clients time tokens by chunk arrival: holding it made the first token look seconds late."""
    items = [RequestOutput("cmpl-1", token_ids=[1]), RequestOutput("cmpl-1", text="é", token_ids=[2]),
             RequestOutput("cmpl-1", token_ids=[3], finished=True, finish_reason="length", num_prompt_tokens=2,
                           num_output_tokens=3)]
    chunks = _sse_chunks(items)
    assert [c["choices"][0]["text"] for c in chunks] == ["", "é", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _chat_chunks(pieces: list[str], finish: str, reader) -> list[dict]:
    """The chunks of a chat stream (the Ingress's `_sse`) of a reply in `pieces` that ends with `finish`, read by
    `reader` (a factory of its `ReplyReader`)."""
    import asyncio
    import json

    from deployments.ingress import Ingress

    items = [RequestOutput("c", text=t, token_ids=[i]) for i, t in enumerate(pieces)]
    items[-1] = RequestOutput("c", text=pieces[-1], token_ids=[9], finished=True, finish_reason=finish,
                              num_prompt_tokens=3, num_output_tokens=len(pieces))

    async def collect() -> list[bytes]:
        gen = Ingress.func_or_class._sse(SimpleNamespace(served_model_name="m"), _Gen(items), items[0], "chat",
                                         "chatcmpl-1", False, "m", tools=reader)
        return [c async for c in gen]

    return [json.loads(c.decode()[6:]) for c in asyncio.run(collect()) if c != b"data: [DONE]\n\n"]


def test_a_chat_stream_carries_the_reasoning_and_tool_calls_its_reply_makes() -> None:
    """With a reader of the reply (a reasoning model's thinking; tool_choice auto, in the model's format), a chat
    stream's chunks carry the thinking as `reasoning_content`, the text before a call as content and each call as
    `tool_calls` deltas (its name once read, then its arguments as they come); the last chunk's finish reason is
    `tool_calls`. Read whole, the same reply gives the same message."""
    from deployments import protocol as P
    from deployments.reasoning import ReplyReader, reasoning_reader
    from deployments.tool_calls import merge_calls, model_format_reader

    def reader(_: str | None = None) -> ReplyReader:  # (a reasoning model's: its thinking first)
        return ReplyReader(reasoning_reader("qwen3"), model_format_reader("hermes"))

    pieces = ["<think>\nRain", "?</th", "ink>\n\nChecking", ". <tool", '_call>\n{"name": "get_weather", ',
              '"arguments": {"city": ', '"Oslo"}}\n</tool_call>', "\n"]
    chunks = _chat_chunks(pieces, "stop", reader)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas[1:]) == "Checking. "
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nRain?"
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert len(calls) == 2 and calls[0]["index"] == 0 and calls[0]["id"] and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert calls[1] == {"index": 0, "function": {"arguments": '"Oslo"}'}}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    whole = P.read_replies(P.chat_response("chatcmpl-1", "m", "".join(pieces), "stop", 3, 5), reader)
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Checking. "
    assert message["reasoning_content"] == "\nRain?"
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in merge_calls(calls)]


def test_a_chat_stream_cut_in_a_tool_call_by_its_cap_ends_with_finish_reason_length() -> None:
    """A streamed reply whose max_tokens cut it inside a call it sent ends `length` (the arguments are cut), as
    the same reply read whole does (there, the cut call stays text); one that ended on its own, `tool_calls`."""
    from deployments import protocol as P
    from deployments.reasoning import ReplyReader
    from deployments.tool_calls import model_format_reader

    def reader(_: str | None = None) -> ReplyReader:
        return ReplyReader(None, model_format_reader("hermes"))

    pieces = ['<tool_call>{"name": "f", ', '"arguments": {"city": ', '"Par']
    for fin, want in (("length", "length"), ("stop", "tool_calls")):
        chunks = _chat_chunks(pieces, fin, reader)
        assert chunks[-1]["choices"][0]["finish_reason"] == want, fin
        assert any(d["choices"][0]["delta"].get("tool_calls") for d in chunks)
    whole = P.read_replies(P.chat_response("chatcmpl-1", "m", "".join(pieces), "length", 3, 3), reader)
    assert whole["choices"][0]["finish_reason"] == "length" and "tool_calls" not in whole["choices"][0]["message"]


def test_malformed_stream_items_fail_loudly() -> None:
    """The typed contract: an unknown or malformed stream item raises at the receiving end and is never
    taken for a success (no finish_reason read off a dict, no 200 with a normal end)."""
    import asyncio

    from core.messages import ProtocolError, RoutingStats, check_output
    from deployments.errors import APIError
    from deployments.ingress import Ingress

    ok = RequestOutput("r", text="a", token_ids=[1])
    for bad in ({"text": "hi", "finished": True, "finish_reason": "stop"}, "done", None):
        with pytest.raises(ProtocolError):
            check_output(bad)
    with pytest.raises(ProtocolError, match="finish_reason"):
        RequestOutput("r", finished=True, finish_reason="complete")  # unknown reason
    with pytest.raises(ProtocolError):
        RequestOutput("r", finished=True)  # finished without a reason
    with pytest.raises(ProtocolError, match="reject_reason"):
        RequestOutput("r", finished=True, finish_reason="rejected")  # a rejection must say why
    with pytest.raises(ProtocolError):
        RequestOutput("r", finished=True, finish_reason="stop", reject_reason="overloaded")
    # an item that arrived pickled skips __post_init__; check() still catches a tampered one
    tampered = RequestOutput("r", finished=True, finish_reason="stop")
    object.__setattr__(tampered, "finish_reason", "stop-ish")
    with pytest.raises(ProtocolError):
        check_output(tampered)
    # the ingress, non-streaming: a dict in the stream is a 500 protocol error, not a completion
    me = SimpleNamespace(served_model_name="m", retry_after_s=1)
    me._rest = lambda *a: Ingress.func_or_class._rest(me, *a)
    with pytest.raises(APIError) as err:
        asyncio.run(Ingress.func_or_class._collect(me, _Gen([ok, {"text": "b", "finished": True}]), ok,
                                                   "completion", "r", {}, "m"))
    assert err.value.status == 500 and err.value.code == "protocol_error"
    # the ingress, streaming: an error event, never a chunk that ends the choice normally
    chunks = _sse_chunks([ok, {"text": "b", "finished": True, "finish_reason": "stop"}])
    assert chunks[-1]["error"]["type"] == "server_error"
    assert all(c.get("choices", [{}])[0].get("finish_reason") is None for c in chunks[:-1])
    # routing stats: missing or unknown keys are refused
    good = _stats(10, 20)
    assert RoutingStats.from_dict(good).kv_blocks_free == 100
    with pytest.raises(ProtocolError, match="missing"):
        RoutingStats.from_dict({k: v for k, v in good.items() if k != "vbs"})
    with pytest.raises(ProtocolError, match="unknown"):
        RoutingStats.from_dict({**good, "kv_free_blocks": 3})


def test_readiness_waits_for_the_first_replica_answer_and_retries_failures() -> None:
    """The Ingress's /health is 503 until an LLM replica answers `model_info`; a failed or hung probe is asked again."""
    import asyncio

    from deployments.ingress import Readiness

    calls: list[str] = []

    async def probe() -> dict:
        calls.append("probe")
        if len(calls) == 1:
            raise RuntimeError("replica still starting")
        if len(calls) == 2:
            await asyncio.sleep(10)  # hangs: cut by the timeout
        return {"max_model_len": 77}

    async def run() -> None:
        r = Readiness()
        assert not r.ready and r.info is None
        task = asyncio.create_task(r.watch(probe, timeout_s=0.05, retry_s=0.01))
        await asyncio.sleep(0)
        assert not r.ready
        await asyncio.wait_for(task, 5)
        assert r.ready and r.info == {"max_model_len": 77} and len(calls) == 3

    asyncio.run(run())


def test_readiness_monitor_says_when_no_llm_replica_can_serve() -> None:
    """Once ready, the Ingress asks every period: two answers in a row that no LLM replica can serve (Serve's
    controller counts none running, or the replica that answers has a dead engine) make /health 503 `unavailable`;
    one that can serves makes it 200 again. A probe that times out (busy replicas, whose queue it waits in) is no
    news either way: an overloaded app must not look dead."""
    from deployments.ingress import Readiness

    # (LLM replicas running, what the probe gets)
    answers = [(2, "ok"), (0, "-"), (2, "ok"), (1, "dead"), (1, "dead"), (0, "-"), (2, "timeout"), (2, "timeout"),
               (2, "ok")]
    downs: list[str | None] = []
    r = Readiness()
    rounds, now = iter(answers), {"p": "ok"}

    async def running() -> int:
        downs.append(r.down)  # what /health said before this round
        n, now["p"] = next(rounds, (2, "ok"))
        return n

    async def probe() -> dict:
        if now["p"] == "timeout":
            await asyncio.sleep(10)
        return {"max_model_len": 7, "alive": now["p"] == "ok"}

    async def run() -> None:
        task = asyncio.create_task(r.monitor(probe, running, period_s=0.001, timeout_s=0.05))
        while len(downs) <= len(answers):
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(run())
    assert downs[:5] == [None] * 5  # ok; none running once; ok; a dead engine once
    assert downs[5] == "the LLM replicas' engines exited"  # a second dead engine in a row
    assert downs[6] == "no LLM replica is running"  # a third: the latest reason
    assert downs[7:9] == ["no LLM replica is running"] * 2  # timeouts: no news, it stays as it was
    assert downs[9] is None  # a live engine answers


def test_an_app_that_scales_to_zero_probes_its_replicas_only_while_requests_are_sent() -> None:
    """min_replicas 0: a probe is a call through the handle, which Serve answers with a replica where none runs. The
    controller counted one running as Serve stopped the last idle one, the probe went to none, and a replica started
    that no request asked for (the CI's tests/serve/test_autoscaling.py). The monitor probes there only where a
    request was sent since its last look, or the app is down (to see it serve again); an app that never scales to
    zero probes every period."""
    from deployments.ingress import Readiness

    probes: list[float] = []

    async def running() -> int:
        return 1

    async def probe() -> dict:
        probes.append(time.monotonic())
        return {"max_model_len": 7}

    async def until(cond) -> None:  # (polled, bounded: a loaded box's slow loop is no failure, a regression is)
        async def poll() -> None:
            while not cond():
                await asyncio.sleep(0.005)
        await asyncio.wait_for(poll(), 5.0)

    async def run() -> None:
        r = Readiness(may_idle=True)
        r._heard({"max_model_len": 7})
        task = asyncio.create_task(r.monitor(probe, running, period_s=0.005, timeout_s=0.5))
        await asyncio.sleep(0.1)
        assert not probes  # idle: no request sent
        r.sent = time.monotonic()
        await until(lambda: probes)
        await asyncio.sleep(0.05)
        assert len(probes) == 1 and probes[0] >= r.sent  # a request sent: probed at the next look, once
        r.down = "the LLM replicas' engines exited"
        await until(lambda: len(probes) == 2 and r.down is None)  # down: probed until it serves again
        await asyncio.sleep(0.05)
        assert len(probes) == 2  # (and then no more: it serves, and no request was sent since)
        task.cancel()
        always = Readiness()
        always._heard({"max_model_len": 7})
        probes.clear()
        task = asyncio.create_task(always.monitor(probe, running, period_s=0.005, timeout_s=0.5))
        await until(lambda: len(probes) >= 2)
        task.cancel()

    asyncio.run(run())


def test_a_request_waits_for_an_llm_replica_a_bounded_time_then_gets_a_503() -> None:
    """Routed: a request that finds no LLM replica able to serve (none has loaded yet, or none can now) waits for one
    at most `unready_wait_s`, then gets a 503 `unavailable` with Retry-After; one that comes up meanwhile serves it."""
    from deployments.errors import APIError
    from deployments.ingress import IngressFrontend, Readiness

    front = object.__new__(IngressFrontend)
    front._readiness, front.unready_wait_s, front.retry_after_s = Readiness(), 0.1, 3
    front.cold_start_wait_s = 60.0  # (where the replicas say they scale to zero: not these)

    async def refused() -> APIError:
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            await front._until_ready()
        assert time.monotonic() - t0 >= 0.1
        return e.value

    async def run() -> None:
        e = await refused()  # never came up (an LLM replica Serve cannot place)
        assert (e.status, e.code, e.headers["Retry-After"]) == (503, "unavailable", "3") and "ready yet" in e.message

        async def ready_soon() -> None:
            await asyncio.sleep(0.03)
            front._readiness.info = {"max_model_len": 7}
        task = asyncio.create_task(ready_soon())
        await asyncio.wait_for(front._until_ready(), 1.0)  # comes up meanwhile
        await task
        await asyncio.wait_for(front._until_ready(), 1.0)  # ready: no wait
        front._readiness.down = "no LLM replica is running"
        e = await refused()
        assert e.status == 503 and "no LLM replica is running" in e.message
        front._readiness.down = None
        await asyncio.wait_for(front._until_ready(), 1.0)

    asyncio.run(run())


def test_an_app_scaled_to_zero_is_healthy_and_a_request_starts_a_replica(monkeypatch) -> None:
    """min_replicas 0: while Serve's controller counts no LLM replica, the Ingress is idle, not down: /health 200 and
    no probe (a call through the handle would start a replica). A request asks for one (a single probe however many
    wait), waits for its answer, and is sent; once the controller counts none again, the app is idle again, and down
    where Serve says the deployment failed."""
    from deployments import ingress
    from deployments.errors import APIError
    from deployments.ingress import IngressFrontend, Readiness

    state = {"running": 0, "answer": asyncio.Event(), "failed": None}
    probes: list[float] = []

    async def running() -> tuple[int, str | None]:  # (`running_replicas`: the count, and why the deployment failed)
        return state["running"], state["failed"]

    async def probe() -> dict:  # (waits in the handle until Serve has started a replica)
        probes.append(time.monotonic())
        await state["answer"].wait()
        return {"max_model_len": 7}

    front = object.__new__(IngressFrontend)
    front._readiness, front.unready_wait_s, front.retry_after_s = Readiness(may_idle=True), 0.01, 1
    waits: list[tuple[float, str]] = []  # what the Ingress's kairos_ingress_replica_wait_s took
    front._replica_wait = SimpleNamespace(observe=lambda s, tags: waits.append((s, tags["reason"])))
    front.cold_start_wait_s = 5.0  # (a cold start's wait, not unready_wait_s)
    front._probe = probe
    r = front._readiness

    async def until(cond) -> None:  # (bounded: a regression fails, never hangs)
        async def poll() -> None:
            while not cond():
                await asyncio.sleep(0.005)
        await asyncio.wait_for(poll(), 2.0)

    async def run() -> None:
        watch = asyncio.create_task(r.watch(probe, timeout_s=1.0, retry_s=0.01, running=running, period_s=0.01))
        await until(lambda: r.idle)
        assert await front.health() == {"status": "ok"} and not probes and not r.serving.is_set()
        waiting = [asyncio.create_task(front._until_ready()) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert len(probes) == 1 and not any(t.done() for t in waiting)  # one call asks for a replica
        state["running"] = 1
        state["answer"].set()
        await asyncio.wait_for(asyncio.gather(*waiting), 1.0)
        assert len(waits) == 3 and all(s >= 0.05 and why == "scaled_to_zero" for s, why in waits)
        await asyncio.wait_for(watch, 1.0)
        assert r.serving.is_set() and not r.idle and r.info == {"max_model_len": 7}
        # a count of none begun before a replica's answer is stale (the controller counted it running first)
        state["running"] = 0
        stale = asyncio.Event()

        async def slow_count() -> int:
            await stale.wait()
            return 0
        counting = asyncio.create_task(r._count(slow_count, 1.0))
        await asyncio.sleep(0.005)
        r._heard({"max_model_len": 7})
        stale.set()
        assert await counting == 0 and not r.idle and r.serving.is_set()
        monitor = asyncio.create_task(r.monitor(probe, running, period_s=0.01, timeout_s=0.5))
        await until(lambda: r.idle)  # scaled to zero again: idle, never down, no probe meanwhile
        n = len(probes)
        await asyncio.sleep(0.05)
        assert len(probes) == n and r.down is None and await front.health() == {"status": "ok"}
        # a deployment whose replicas fail to start: down (503), not idle
        state["failed"] = "replica constructor failed"
        await until(lambda: r.down is not None)
        assert not r.idle and r.down == "replica constructor failed"
        assert (await front.health()).status_code == 503
        state["failed"] = None
        await until(lambda: r.down is None)
        assert r.idle
        # an app whose arguments did not say it scales to zero, where its replicas say so (a Serve config's
        # `deployments:`): idle, not down, once none runs; and back where they say otherwise
        other = Readiness()
        other._heard({"max_model_len": 7, "scales_to_zero": True})
        assert other.may_idle and other.serving.is_set()
        assert await other._count(running, 0.5) == 0 and other.idle and other.down is None
        other._heard({"max_model_len": 7, "scales_to_zero": False})
        assert not other.may_idle and not other.idle
        other._heard({"max_model_len": 7})  # (an older replica: no word)
        assert not other.may_idle
        # a replica that never comes up: the request's 503 after the cold start's wait
        state["answer"] = asyncio.Event()
        front.cold_start_wait_s = 0.1
        with pytest.raises(APIError) as e:
            await front._until_ready()
        assert e.value.status == 503 and e.value.code == "unavailable"
        assert waits[-1][0] >= 0.1 and waits[-1][1] == "scaled_to_zero" and len(waits) == 4  # (a 503's wait too)
        asked = r._waking
        await asyncio.wait_for(asked, 1.0)  # (its ask for a replica lasted about as long as it waited)
        # unready_wait_s 0: a 503 at once, and still an ask (Serve starts a replica on it), else none ever would
        front.cold_start_wait_s = 0.0
        with pytest.raises(APIError):
            await front._until_ready()
        assert r._waking is not asked and not r._waking.done()
        await asyncio.wait_for(r._waking, 2.0)
        # a deployment Serve says failed: a request waits DOWN_WAIT_S at most, not a cold start's wait
        front.cold_start_wait_s = 600.0
        monkeypatch.setattr(ingress, "DOWN_WAIT_S", 0.05)
        state["failed"] = "replica constructor failed"
        await until(lambda: r.down is not None)
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(front._until_ready(), 2.0)
        assert "replica constructor failed" in e.value.message
        monitor.cancel()

    asyncio.run(run())


def test_a_replica_says_whether_its_deployment_scales_to_zero_as_serve_runs_it(monkeypatch) -> None:
    """`model_info`'s `scales_to_zero`: the replica context's deployment config (a Serve config's `deployments:` may
    set min_replicas where the app's arguments did not); None outside Serve. (No handle from the test process on an
    autoscaled deployment: such a handle once broke tests/serve/test_shutdown.py's later Serve.)"""
    from ray import serve
    from ray.serve.config import AutoscalingConfig

    from deployments.replica import scales_to_zero

    assert scales_to_zero() is None
    for scaling, says in ((AutoscalingConfig(min_replicas=0, max_replicas=2), True),
                          (AutoscalingConfig(min_replicas=1, max_replicas=2), False), (None, False)):
        ctx = SimpleNamespace(_deployment_config=SimpleNamespace(autoscaling_config=scaling))
        monkeypatch.setattr(serve, "get_replica_context", lambda ctx=ctx: ctx)
        assert scales_to_zero() is says


def test_a_replica_of_the_direct_topology_refuses_to_scale_to_zero(monkeypatch) -> None:
    """A Serve config's `deployments:` may give the direct topology's replicas min_replicas 0, which the app's
    arguments never saw: the replica refuses to start, by name, before it loads its model."""
    from deployments import direct

    monkeypatch.setattr(direct, "scales_to_zero", lambda: True)
    with pytest.raises(ValueError, match="min_replicas 0 needs the routed topology"):
        asyncio.run(direct.DirectFrontend.__init__(object.__new__(direct.DirectFrontend), {}, {}, 1, 1))


def test_a_request_whose_replicas_engine_died_goes_to_another_replica() -> None:
    """Serve routes to a replica whose engine died until its health checks fail; the ingress sends a request that
    failed there before its first item to another one (`failovers`), the failed replica in its avoid list; a
    request failed so anywhere else, or past its TTFT SLO, gets the 503 `replica_failed`. Streamed, an engine that
    dies mid-reply ends the stream with that error (its code too) and no usage chunk."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from core.messages import ErrorKind, ServedBy
    from core.request import FinishReason
    from deployments.direct import LocalStream
    from deployments.errors import APIError, item_failure
    from deployments.ingress import OpenAIFrontend

    sent: list[tuple[str, ...]] = []
    calls: list[float] = []  # waited_ms of each call
    died: list[BaseException] = []  # the next call's replica actor dies with this

    async def generate(req: GenerateRequest):
        sent.append(req.avoid_replicas)
        calls.append(req.waited_ms)
        assert req.failed_replicas == req.avoid_replicas  # (each failed it: the routers leave them out)
        if died:
            await asyncio.sleep(0.05)
            raise died.pop()
        if "A" not in req.avoid_replicas:  # lands on A, whose engine is dead
            yield RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ERROR,
                                error="engine unavailable: gone", error_kind=ErrorKind.UNAVAILABLE,
                                served_by=ServedBy("A", 0.1))
            return
        yield RequestOutput(req.request_id, text="Hi", token_ids=[1], served_by=ServedBy("B", 0.1))
        yield RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ERROR, error="engine failure: x",
                            error_kind=ErrorKind.UNAVAILABLE)  # then B's engine dies too

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:  # no engine has said what it serves
            return None

        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    def front(failovers: int, transport: str = "ray") -> Front:
        f = object.__new__(Front)
        f._init_frontend({"model_name": "m", "max_body_bytes": 4096, "failovers": failovers,
                          "llm_transport": transport})
        return f

    def request(ttft_ms: float | None = None) -> GenerateRequest:
        return GenerateRequest("r1", "x", params=SamplingParams(max_tokens=4), slo=SLO(ttft_ms=ttft_ms))

    async def run() -> None:
        req, gen, first = await front(2)._start(request(), time.perf_counter())
        assert req.avoid_replicas == ("A",) and first.served_by.replica == "B" and sent == [(), ("A",)]
        events = [e async for e in front(2)._sse(gen, first, "completion", "r1", True, "m")]
        body = json.loads(events[1][6:])
        assert json.loads(events[0][6:])["choices"][0]["text"] == "Hi"
        assert body["error"]["code"] == "replica_failed" and body["error"]["type"] == "server_error"
        assert events[2:] == [P.SSE_DONE]  # no usage chunk after the error
        sent.clear()
        _, _, first = await front(0)._start(request(), time.perf_counter())  # no failover (topology=direct)
        assert item_failure(first, {}, 1).code == "replica_failed" and sent == [()]
        sent.clear()
        _, _, first = await front(2)._start(request(ttft_ms=5.0), time.perf_counter() - 1.0)  # its TTFT SLO ran out
        assert first.error_kind is ErrorKind.UNAVAILABLE and sent == [()]
        # the replica actor itself died before the first item: sent again, the time lost off its TTFT SLO; one that
        # is only unreachable through Ray may still run it, so it is not sent again (a 503). Over gRPC a replica
        # that is gone is UNAVAILABLE, its call cancelled with the connection: sent again
        for error, transport, resent in ((ActorDiedError(), "ray", True), (ActorUnavailableError("gone", None), "ray",
                                                                           False),
                                         (ActorUnavailableError("gone", None), "grpc", True),
                                         (ActorDiedError(), "grpc", True)):
            calls.clear()
            died[:] = [error]
            if resent:
                req, _, first = await front(2, transport)._start(request(ttft_ms=5000.0), time.perf_counter())
                # died, then A (a dead engine: sent on), then B; each send with the time spent before it
                assert first.served_by.replica == "B" and len(calls) == 3 and calls[1] >= 50.0, calls
            else:
                with pytest.raises(APIError) as e:
                    await front(2)._start(request(ttft_ms=5000.0), time.perf_counter())
                assert e.value.code == "replica_failed" and len(calls) == 1

    asyncio.run(run())


def test_the_ttft_slo_counts_from_when_the_request_reached_the_server() -> None:
    """The engine gets what is left of a request's TTFT SLO: the time the Ingress spent on it before the send
    (reading and parsing its body, routing) is off the SLO on the first send too, as vLLM's arrival time is when its
    server got the request; a batch's prompts likewise, from the batch's arrival."""
    from core.request import FinishReason
    from deployments.direct import LocalStream
    from deployments.ingress import OpenAIFrontend

    from ray.exceptions import ActorDiedError

    sent: list[GenerateRequest] = []
    died: list[BaseException] = []  # the next send's replica actor dies with this

    async def generate(req: GenerateRequest):
        sent.append(req)
        if died:
            await asyncio.sleep(0.05)
            raise died.pop()
        yield RequestOutput(req.request_id, text="Hi", token_ids=[1], finished=True,
                            finish_reason=FinishReason.LENGTH, num_prompt_tokens=1, num_output_tokens=1)

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:  # no engine has said what it serves
            return None

        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    f = object.__new__(Front)
    f._init_frontend({"model_name": "m", "max_body_bytes": 4096, "failovers": 1})
    slo = SLO(ttft_ms=1000.0, tpot_ms=50.0)
    one = GenerateRequest("r1", "x", params=SamplingParams(max_tokens=1), slo=slo)
    body = P.CompletionRequest(model="m", prompt="x", max_tokens=1)

    async def run() -> None:
        t0 = time.perf_counter()
        t_in = t0 - 0.3  # the request reached the server 300 ms ago; parsed just now
        await f._respond(body, one, "completion", "r1", t_in, time.perf_counter())
        spent_ms = (time.perf_counter() - t_in) * 1000.0
        assert 300.0 <= sent[-1].waited_ms <= spent_ms  # counted once, from t_in
        assert sent[-1].engine_slo.ttft_ms == pytest.approx(1000.0 - sent[-1].waited_ms)
        assert sent[-1].slo == slo  # its labels and the idle-floor test keep the client's
        sent.clear()
        # the replica actor died under the first send: the second carries all the time since t_in, once
        died.append(ActorDiedError())
        t_in = time.perf_counter() - 0.3
        await f._respond(body, one, "completion", "r1", t_in, time.perf_counter())
        spent_ms = (time.perf_counter() - t_in) * 1000.0
        # (the failed send's own 50 ms pause between them)
        assert len(sent) == 2 and 300.0 <= sent[0].waited_ms
        assert sent[0].waited_ms + 50.0 <= sent[1].waited_ms <= spent_ms
        sent.clear()
        batch = [dataclasses.replace(one, request_id=f"r-{i}") for i in range(2)]
        t_in = time.perf_counter() - 0.3
        await f._respond_batch(P.CompletionRequest(model="m", prompt=["x", "y"], max_tokens=1), batch, "completion",
                               "r", t_in)
        spent_ms = (time.perf_counter() - t_in) * 1000.0
        assert len(sent) == 2 and all(300.0 <= r.waited_ms <= spent_ms for r in sent)
        # spent before it was sent: the engine gets almost nothing left (and turns it away by its TTFT guard)
        t_in = time.perf_counter() - 1.5
        await f._respond(body, one, "completion", "r1", t_in, time.perf_counter())
        assert sent[-1].waited_ms >= 1500.0 and sent[-1].engine_slo.ttft_ms == pytest.approx(1e-3)

    asyncio.run(run())


def test_the_wait_between_haproxy_and_the_ingress_is_off_the_ttft_slo(monkeypatch) -> None:
    """HAProxy stamps a request with when it read it and on which machine's clock (`haproxy_ingress.received_rule`):
    on the Ingress's clock the time since then is off the request's TTFT SLO, and its Server-Timing shows it
    (`proxy`); another clock (another machine, whatever its name), a stamp from the future or too old (a step of the
    wall clock) or a malformed one count nothing. (tests/serve/test_api.py sees the stamp arrive through HAProxy.)"""
    from core import messages
    from deployments.ingress import proxy_wait_ms, server_timing

    if messages.clock_id() is not None:  # this machine's own: its boot id (a client cannot read it to forge a stamp)
        assert proxy_wait_ms(f"t={(time.time() - 0.1) * 1e6:.0f},h={messages.clock_id()}") >= 100.0
    monkeypatch.setattr(messages, "clock_id", lambda: "a")
    assert proxy_wait_ms("t=1000000,h=a", now_s=1.25) == pytest.approx(250.0)
    assert proxy_wait_ms("t=1000000,h=elsewhere", now_s=1.25) == 0.0  # another clock
    assert proxy_wait_ms("t=2000000,h=a", now_s=1.25) == 0.0  # the future
    assert proxy_wait_ms("t=1000000,h=a", now_s=1.0 + 61.0) == 0.0  # a clock's step, not a wait
    for bad in (None, "", "t=x,h=a", "h=a", "garbage", "t=1,h"):
        assert proxy_wait_ms(bad, now_s=1.25) == 0.0, bad
    monkeypatch.setattr(messages, "clock_id", lambda: None)  # no clock id (not Linux): no stamp counts
    assert proxy_wait_ms("t=1000000,h=a", now_s=1.25) == 0.0
    timing = server_timing(10.0, 10.002, 10.05, 40.0, proxy_ms=3.0)  # the wait shows where the time went
    assert timing.startswith("proxy;dur=3.0, parse;dur=2.0")
    assert not server_timing(10.0, 10.002, 10.05, 40.0).startswith("proxy")  # no stamp: no entry


def test_the_way_from_the_ingress_to_an_llm_replica_is_off_the_ttft_slo(monkeypatch) -> None:
    """The routed Ingress stamps each send with its clock and monotonic time (`GenerateRequest.sent_at`); the LLM
    replica, on the same clock, counts the time since as spent (routing, Serve's queue, transport: `arrived`), once;
    on another clock (another machine), or from the future, nothing."""
    from core import messages
    from deployments.ingress import IngressFrontend

    clock = messages.clock_id()
    monkeypatch.setattr(messages, "clock_id", lambda: "a")
    req = GenerateRequest("r", prompt="x", slo=SLO(ttft_ms=1000.0), waited_ms=5.0, sent_at=("a", 100.0))
    got = req.arrived(100.25)
    assert got.waited_ms == pytest.approx(255.0) and got.sent_at is None and got.arrived(200.0) == got
    assert got.engine_slo.ttft_ms == pytest.approx(745.0)
    assert dataclasses.replace(req, sent_at=("b", 100.0)).arrived(100.25).waited_ms == 5.0  # another clock
    assert req.arrived(99.0).waited_ms == 5.0  # the future
    assert GenerateRequest("r", prompt="x").arrived(1.0) == GenerateRequest("r", prompt="x")  # in-process
    monkeypatch.setattr(messages, "clock_id", lambda: None)  # no clock id: nothing counts
    assert req.arrived(100.25).waited_ms == 5.0
    monkeypatch.setattr(messages, "clock_id", lambda: clock)

    opened: list[GenerateRequest] = []
    f = object.__new__(IngressFrontend)
    f._actor_id = "ingress-1"
    f.llm = SimpleNamespace(generate=SimpleNamespace(remote=opened.append))
    f._readiness = SimpleNamespace(running=3)
    t0 = time.monotonic()
    f._open(req)
    assert opened[0].caller == "ingress-1"
    assert opened[0].sent_at[0] == clock and t0 <= opened[0].sent_at[1] <= time.monotonic()
    assert opened[0].replicas_running == 3  # (an autoscaled app's replicas split the chunk budget over them)


def test_a_direct_replicas_wait_for_a_slot_is_off_the_ttft_slo() -> None:
    """A replica serving HTTP itself (topology=direct) holds a request that finds every generation slot taken; the
    engine gets its TTFT SLO less that wait too (GenerateRequest.waited_ms), once."""
    from core.request import FinishReason
    from deployments.direct import DirectFrontend

    sent: list[GenerateRequest] = []

    class Direct(DirectFrontend):
        async def generate(self, req: GenerateRequest):  # type: ignore[override]
            sent.append(req)
            await asyncio.sleep(0.1)
            yield RequestOutput(req.request_id, text="Hi", token_ids=[1], finished=True,
                                finish_reason=FinishReason.LENGTH, num_prompt_tokens=1, num_output_tokens=1)

    d = object.__new__(Direct)
    d._cap, d._calls, d.retry_after_s = None, 0, 1

    async def drain(req: GenerateRequest) -> None:
        async for _ in d._bounded(req):
            pass

    async def run() -> None:
        d._slots = asyncio.Semaphore(1)
        reqs = [GenerateRequest(f"r{i}", "x", slo=SLO(ttft_ms=1000.0), waited_ms=5.0) for i in range(2)]
        await asyncio.gather(*(drain(r) for r in reqs))
        assert [r.waited_ms for r in sent][0] == pytest.approx(5.0, abs=5.0)  # a free slot: no wait added
        assert 5.0 + 90.0 <= sent[1].waited_ms < 5.0 + 400.0  # the first one's 100 ms on top of its 5
        assert sent[1].engine_slo.ttft_ms == pytest.approx(1000.0 - sent[1].waited_ms)

    asyncio.run(run())


def test_a_streamed_batch_ends_at_a_prompt_whose_engine_died() -> None:
    """A batch's prompt whose engine dies mid-reply ends the batch's stream with its error event (naming the prompt,
    with the code a 503 would have) and cancels the others: no usage chunk, no choice left without its end."""
    from core.messages import ErrorKind
    from core.request import FinishReason
    from deployments.ingress import OpenAIFrontend

    cancelled: list[str] = []

    async def generate(req: GenerateRequest):
        ended = False
        try:
            yield RequestOutput(req.request_id, text=req.prompt, token_ids=[1])
            if req.prompt == "b":
                ended = True
                yield RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ERROR,
                                    error="engine failure: x", error_kind=ErrorKind.UNAVAILABLE)
                return
            await asyncio.sleep(10)
            ended = True
            yield RequestOutput(req.request_id, text="!", token_ids=[2], finished=True, finish_reason="length",
                                num_prompt_tokens=1, num_output_tokens=2)
        finally:
            if not ended:  # closed or cancelled before its end
                cancelled.append(req.prompt)

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:  # no engine has said what it serves
            return None

    _, app = _local_fast_path(Front, generate)

    async def run() -> bytes:
        sent: list[dict] = []
        raw = json.dumps({"prompt": ["a", "b", "c"], "max_tokens": 4, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()

        async def receive() -> dict:
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(msg: dict) -> None:
            sent.append(msg)

        await asyncio.wait_for(app({"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
                                    "headers": [(b"content-type", b"application/json")], "query_string": b""},
                                   receive, send), 5)
        await asyncio.sleep(0.05)
        assert sent[0]["status"] == 200
        return b"".join(m.get("body", b"") for m in sent[1:])

    body = asyncio.run(run())
    events = [e[6:] for e in body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"].startswith("prompt 1: ") and error["code"] == "replica_failed"
    assert all("usage" not in json.loads(e) or json.loads(e)["usage"] is None for e in events[:-2])
    assert sorted(cancelled) == ["a", "c"]


def test_direct_replica_caps_its_engine_share_and_queue_and_aborts_closed_streams() -> None:
    """topology=direct: at most `max_ongoing_requests` requests in the engine, `max_queued_requests` more waiting for
    a slot, a 429 beyond; a stream cancelled by its client (or closed before it started) releases its slot and runs
    the replica's abort."""
    import asyncio

    from deployments.direct import DirectFrontend, LocalStream
    from deployments.errors import APIError

    async def run() -> None:
        release = asyncio.Event()
        started: list[str] = []
        aborted: list[str] = []

        async def generate(req: GenerateRequest):
            started.append(req.request_id)
            try:
                yield RequestOutput(req.request_id, text="a", token_ids=[1])
                await release.wait()
                yield RequestOutput(req.request_id, text="b", token_ids=[2], finished=True, finish_reason="length",
                                    num_output_tokens=2)
            finally:
                if not release.is_set():
                    aborted.append(req.request_id)

        class Direct(DirectFrontend):
            def __del__(self) -> None:  # no engine to stop (Serve awaits the real, async one)
                pass

        me = object.__new__(Direct)
        me.generate, me.retry_after_s = generate, 3
        me._slots, me._cap, me._calls = asyncio.Semaphore(1), 2, 0
        a = me._open(GenerateRequest("a", prompt=(1,)))
        assert (await a.__anext__()).text == "a" and me._calls == 1  # holds the one slot
        b = me._open(GenerateRequest("b", prompt=(1,)))
        b_first = asyncio.create_task(b.__anext__())  # waits for the slot
        await asyncio.sleep(0.01)
        assert not b_first.done() and me._calls == 2 and started == ["a"]
        c = me._open(GenerateRequest("c", prompt=(1,)))
        with pytest.raises(APIError) as e:
            await c.__anext__()
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "3", "x-kairos-reject-reason": "overloaded"} \
            and me._calls == 2
        never = me._open(GenerateRequest("never", prompt=(1,)))
        never.cancel()  # closed before it started: counts nothing
        a.cancel()  # the client of `a` went away while it held the slot: aborted, slot to `b`
        assert (await asyncio.wait_for(b_first, 5)).text == "a"
        assert aborted == ["a"] and started == ["a", "b"] and me._calls == 1
        release.set()
        assert (await b.__anext__()).finished
        assert me._calls == 0  # given back with the last item: the frontend stops there without closing
        with pytest.raises(StopAsyncIteration):
            await b.__anext__()
        assert me._calls == 0 and aborted == ["a"]
        assert isinstance(b, LocalStream)

    asyncio.run(run())


def test_a_direct_replica_whose_engine_died_fails_its_readiness_probe() -> None:
    """/health is a load balancer's readiness probe: 503 `starting` before the engine is up, 200 while it serves,
    503 `unavailable` once the engine died (until Serve's own health check has the replica replaced)."""
    import asyncio

    from deployments.direct import DirectFrontend

    class Direct(DirectFrontend):
        def __del__(self) -> None:
            pass

    me = object.__new__(Direct)
    alive = [True]
    me.engine = type("E", (), {"is_alive": lambda _s: alive[0]})()
    me._info = None
    r = asyncio.run(me.health())
    assert (r.status_code, json.loads(r.body)) == (503, {"status": "starting"})
    me._info = {"model": "m", "max_model_len": 8}
    assert asyncio.run(me.health()) == {"status": "ok"}
    alive[0] = False
    r = asyncio.run(me.health())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert json.loads(r.body) == {"status": "unavailable", "reason": "the replica's LLM engine exited"}


def test_a_replica_counts_a_request_out_when_it_yields_the_last_item() -> None:
    """The frontend stops reading at a finished item and does not close the stream: the replica's in-flight count
    (routing stats, pacing, metrics) must not wait for that generator to be collected. (And a request an Ingress on
    this host sent reaches the engine with its way here off its TTFT SLO.)"""
    import asyncio
    from collections import deque

    from deployments.pacing import StreamPacing
    from core.messages import clock_id
    from deployments.replica import LLMReplica

    class Stream:
        def __init__(self, items: list[RequestOutput]) -> None:
            self.items = items
            self.prompt_token_ids, self.prompt_thinking = [1], None

        async def aget(self) -> RequestOutput:
            return self.items.pop(0)

    class Metrics:
        def __getattr__(self, name: str):
            return lambda *a, **k: None

    async def run() -> None:
        me = object.__new__(LLMReplica)
        aborted: list[str] = []
        seen: list[GenerateRequest] = []  # what the engine got
        me.engine = type("E", (), {"generate": lambda _s, req: seen.append(req) or Stream([
            RequestOutput(req.request_id, text="a", token_ids=[1], num_prompt_tokens=1),
            RequestOutput(req.request_id, text="b", token_ids=[2], finished=True, finish_reason="length")]),
            "abort": lambda _s, rid: aborted.append(rid), "shutdown": lambda _s, timeout=None: None})()
        me.log_prompts, me.pacing, me.metrics, me.replica_id = False, StreamPacing(), Metrics(), "r"
        me.inflight, me._inflight_peak, me.aborted, me._prompt_lens, me._decode_left = 0, 0, 0, deque(maxlen=4), {}
        me.demand = DemandRates()
        done = me.generate(GenerateRequest("done", prompt=(1,)))
        assert (await done.__anext__()).text == "a" and me.inflight == 1
        # Serve's autoscaling reads the most in flight since its last read (a scale to zero waits out short ones)
        assert (await me.record_autoscaling_stats())[INFLIGHT] == 1.0
        assert (await done.__anext__()).finished and me.inflight == 0  # before the generator is resumed or closed
        gone = me.generate(GenerateRequest("gone", prompt=(1,)))
        await gone.__anext__()
        await gone.aclose()  # the client went away mid-stream: counted out once, aborted in the engine
        assert me.inflight == 0 and aborted == ["gone"] and me.aborted == 1
        await done.aclose()
        assert me.inflight == 0 and aborted == ["gone"]
        assert [(await me.record_autoscaling_stats())[INFLIGHT] for _ in range(2)] == [1.0, 0.0]  # (ended since)
        # sent by an Ingress on this host 200 ms ago: the engine gets its TTFT SLO less that way here
        sent = me.generate(GenerateRequest("sent", prompt=(1,), slo=SLO(ttft_ms=1000.0),
                                           sent_at=(clock_id(), time.monotonic() - 0.2)))
        assert [(await sent.__anext__()).finished for _ in range(2)] == [False, True]
        assert (200.0 <= seen[-1].waited_ms < 1000.0 or clock_id() is None) and seen[-1].sent_at is None
        # an autoscaled app's replica splits the Ingress's chunk budget over the replicas its requests say run
        me.pacing, me._pacing_running = StreamPacing.of_app(0.0, 2000.0, 4, autoscaled=True), None
        shared = me.generate(GenerateRequest("shared", prompt=(1,), replicas_running=2, return_token_ids=True))
        first = await shared.__anext__()
        assert me.pacing.max_chunks_per_s == 1000.0 and first.prompt_token_ids == [1]  # (vLLM's return_token_ids)
        # another call with an id in flight is refused before it touches that request's state (its clean-up
        # forgot the first's caller and plan, and could abort it)
        dup = me.generate(GenerateRequest("shared", prompt=(1,), caller="ingress-1"))
        refused = await dup.__anext__()
        assert refused.finish_reason is FinishReason.ERROR and "duplicate request id" in refused.error
        await dup.aclose()
        assert "shared" in me._decode_left and aborted == ["gone"] and me.inflight == 1
        await shared.aclose()

    asyncio.run(run())


def test_user_code_runs_on_the_http_loop_unless_the_user_says_otherwise(monkeypatch) -> None:
    from deployments import haproxy_ingress as H

    monkeypatch.setenv(H.USER_CODE_ENV, "1")  # the user's choice stands
    assert H.prefer_user_code_on_main_loop() is False and H.os.environ[H.USER_CODE_ENV] == "1"
    monkeypatch.delenv(H.USER_CODE_ENV)
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # too late: replicas may already run with Ray's default
    assert H.prefer_user_code_on_main_loop() is False and H.USER_CODE_ENV not in H.os.environ
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert H.prefer_user_code_on_main_loop() is True and H.os.environ[H.USER_CODE_ENV] == "0"


def test_haproxy_set_on_by_rays_own_flag_alone_is_started_through_the_launcher(monkeypatch) -> None:
    """Ray turns direct ingress on with RAY_SERVE_ENABLE_HA_PROXY=1 alone: HAProxy is on, and it must be started
    through Kairos's launcher (`guard_haproxy`: stats on 127.0.0.1, OpenAI-shaped errors, killed with Serve); with
    only one of the two flags set it was reported off and left to Ray's template."""
    import ray

    from deployments import haproxy_ingress as H

    guarded: list[int] = []
    monkeypatch.setattr(H, "guard_haproxy", lambda: guarded.append(1) or True)
    monkeypatch.setenv(H.DRAIN_ENV, H.DRAIN_S)  # (restored after the test: the flag's path sets it where unset)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    for flags, on in (({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, True), ({"RAY_SERVE_ENABLE_HA_PROXY": "0"}, False),
                      ({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}, True),
                      ({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}, False)):
        guarded.clear()
        for f in H.FLAGS:
            monkeypatch.delenv(f, raising=False)
        for f, v in flags.items():
            monkeypatch.setenv(f, v)
        assert H.prefer_haproxy_ingress() is on and bool(guarded) == on, flags


def test_serve_control_loop_is_slowed_to_half_a_second_unless_the_user_says_otherwise(monkeypatch) -> None:
    from deployments import haproxy_ingress as H

    monkeypatch.setenv(H.CONTROL_LOOP_ENV, "0.1")  # the user's choice stands
    assert H.prefer_quiet_control_loop() is False and H.os.environ[H.CONTROL_LOOP_ENV] == "0.1"
    monkeypatch.delenv(H.CONTROL_LOOP_ENV)
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # too late: the controller may already run
    assert H.prefer_quiet_control_loop() is False and H.CONTROL_LOOP_ENV not in H.os.environ
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert H.prefer_quiet_control_loop() is True and H.os.environ[H.CONTROL_LOOP_ENV] == "0.5"


def test_generation_fast_path_serves_the_generation_routes_and_leaves_the_rest_to_fastapi() -> None:
    """`GenerationFastPath`: POST /v1/completions and /v1/chat/completions go to the frontend's handler (SSE, errors
    as JSON); every other path, method and scope goes to the FastAPI app; a request cancelled mid-stream (as Serve
    cancels it when the client goes away) closes its engine stream."""
    import asyncio
    import json

    from deployments.direct import LocalStream
    from deployments.ingress import GenerationFastPath, OpenAIFrontend, route_path

    assert route_path({"path": "/api/v1/completions", "root_path": "/api"}) == "/v1/completions"
    assert route_path({"path": "/v1/completions", "root_path": ""}) == "/v1/completions"
    assert route_path({"path": "/apix/v1/completions", "root_path": "/api"}) == "/apix/v1/completions"
    closed: list[int] = []  # the max_tokens of each engine stream that was closed
    hold = asyncio.Event()

    async def generate(req: GenerateRequest):
        try:
            yield RequestOutput(req.request_id, text="Hi", token_ids=[1])
            if req.params.max_tokens > 2:
                await hold.wait()
            yield RequestOutput(req.request_id, text="!", token_ids=[2], finished=True, finish_reason="length",
                                num_prompt_tokens=1, num_output_tokens=2)
        finally:
            closed.append(req.params.max_tokens)

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:  # no engine has said what it serves
            return None

        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    front = object.__new__(Front)
    front._init_frontend({"model_name": "m", "max_body_bytes": 4096})
    to_fastapi: list[tuple[str, str]] = []

    class Api:  # stands for the FastAPI app
        docs_url = "/docs"

        async def __call__(self, scope, receive, send) -> None:
            to_fastapi.append((scope["type"], scope.get("path", "")))
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 404, "headers": []})

    app = GenerationFastPath(front, Api())  # type: ignore[arg-type]
    assert app.docs_url == "/docs"

    async def call(method: str, path: str, body: bytes = b"", scope_type: str = "http",
                   fail_at: int | None = None, gone_after_s: float | None = None) -> list[dict]:
        sent: list[dict] = []
        received = []

        async def receive() -> dict:
            received.append(1)
            if gone_after_s is not None and len(received) > 1:  # after the body: the client hangs up
                await asyncio.sleep(gone_after_s)
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg: dict) -> None:
            if len(sent) == fail_at:
                raise OSError("connection lost")
            sent.append(msg)

        await app({"type": scope_type, "method": method, "path": path, "root_path": "",
                   "headers": [(b"content-type", b"application/json")], "query_string": b""}, receive, send)
        return sent

    async def run() -> None:
        sent = await call("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}).encode())
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert (b"x-kairos-request-id", sent[0]["headers"][0][1]) in sent[0]["headers"]
        body = b"".join(m.get("body", b"") for m in sent[1:])
        events = [e for e in body.decode().split("\n\n") if e]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["Hi", "!"]
        assert events[-1] == "data: [DONE]" and sent[-1] == {"type": "http.response.body", "body": b"",
                                                             "more_body": False}
        sent = await call("POST", "/v1/chat/completions", b"{not json")
        assert sent[0]["status"] == 400 and b"invalid_json" in sent[1]["body"]
        rid = dict(sent[0]["headers"]).get(b"x-kairos-request-id", b"")  # a parse-time refusal names its request too
        assert rid.startswith(b"chatcmpl-")
        # a lone surrogate's bytes (json.loads let them through: the 404 naming the model could not be encoded, and
        # nothing was answered), NaN (an answer echoing it would be no JSON)
        for bad in (b'{"model": "x\xed\xa0\x80", "messages": [{"role": "user", "content": "hi"}]}',
                    b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"1": NaN}}'):
            sent = await call("POST", "/v1/completions", bad)
            assert sent[0]["status"] == 400 and b"invalid_json" in sent[1]["body"], bad
        sent = await call("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode())
        assert sent[0]["status"] == 200 and json.loads(sent[1]["body"])["choices"][0]["text"] == "Hi!"
        sent = await call("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2, "model": ""}).encode())
        assert sent[0]["status"] == 200, sent  # no model named: the served one (vLLM's), not a 404 for ""
        for method, path, kind in (("GET", "/health", "http"), ("GET", "/v1/completions", "http"),
                                   ("POST", "/v1/completions/", "http"), ("POST", "/v1/models", "http"),
                                   ("", "", "lifespan")):
            sent = await call(method, path, scope_type=kind)
            if kind == "http":  # FastAPI's answers name their request too
                assert dict(sent[0]["headers"])[b"x-kairos-request-id"].startswith(b"req-")
        assert to_fastapi == [("http", "/health"), ("http", "/v1/completions"), ("http", "/v1/completions/"),
                              ("http", "/v1/models"), ("lifespan", "")]
        task = asyncio.create_task(call("POST", "/v1/completions",
                                        json.dumps({"prompt": "x", "max_tokens": 9, "stream": True}).encode()))
        await asyncio.sleep(0.05)
        task.cancel()  # what Serve's ingress does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert 9 in closed and not hold.is_set()
        # sending failed mid-stream: the stream is closed at once, not when the garbage collector gets to it (the
        # kept traceback holds every frame of the failed call, the unfinished SSE generator included)
        with pytest.raises(OSError) as failed:
            await call("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 7, "stream": True}).encode(),
                       fail_at=1)
        await asyncio.sleep(0.01)
        assert 7 in closed and not hold.is_set() and failed.traceback
        with pytest.raises(OSError):  # the response's start already failed: its SSE generator never ran
            await call("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 6, "stream": True}).encode(),
                       fail_at=0)
        await asyncio.sleep(0.01)
        assert 6 in closed and not hold.is_set()
        # a client that hangs up while its whole completion is being generated (no stream to fail on): the request is
        # cancelled, its engine stream closed, and nothing is sent
        with pytest.raises(asyncio.CancelledError):
            await call("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 5}).encode(),
                       gone_after_s=0.05)
        await asyncio.sleep(0.01)
        assert 5 in closed and not hold.is_set()

    asyncio.run(run())


def test_until_disconnected_runs_the_work_at_once_and_cancels_it_when_the_client_goes() -> None:
    """The work (a request's way to its first item) starts in the caller's task before any callback that was ready
    before the call (no turn of the event loop on its way to the engine); its result comes back while the client
    stays; a client that hangs up cancels it (its `finally` runs: the stream closes) and the call raises
    CancelledError; a call cancelled from outside cancels the work too."""
    from deployments.ingress import until_disconnected

    async def run() -> None:
        order: list[str] = []
        hang_up = asyncio.Event()

        async def receive() -> dict:
            await hang_up.wait()
            return {"type": "http.disconnect"}

        async def work(tag: str, wait: float) -> str:
            order.append(f"{tag} started")
            try:
                await asyncio.sleep(wait)
                return tag
            finally:
                order.append(f"{tag} closed")

        asyncio.get_running_loop().call_soon(order.append, "ready callback")
        assert await until_disconnected(receive, work("a", 0.01)) == "a"
        assert order[:2] == ["a started", "ready callback"]

        order.clear()
        call = asyncio.ensure_future(until_disconnected(receive, work("b", 10.0)))
        await asyncio.sleep(0.01)
        hang_up.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert order == ["b started", "b closed"]

        order.clear()
        hang_up.clear()
        call = asyncio.ensure_future(until_disconnected(receive, work("c", 10.0)))
        await asyncio.sleep(0.01)
        call.cancel()  # Serve's own disconnect handling, or a shutdown
        with pytest.raises(asyncio.CancelledError):
            await call
        assert order == ["c started", "c closed"]
        assert len(asyncio.all_tasks()) == 1  # no watch left behind

    asyncio.run(run())


def test_a_shed_request_gets_429_with_retry_after_and_what_to_do():
    from core.messages import ServedBy
    from core.request import FinishReason
    from deployments.errors import item_failure
    first = RequestOutput("r", finished=True, finish_reason=FinishReason.REJECTED, reject_reason="shed",
                          served_by=ServedBy("rep", 1.0, 3))
    e = item_failure(first, {"x-request-id": "r"}, 1)
    assert e.status == 429 and e.code == "shed" and "smaller max_tokens" in e.message
    assert e.headers["Retry-After"] == "3" and e.headers["x-kairos-reject-reason"] == "shed"
    other = dataclasses.replace(first, reject_reason="tpot_unattainable")
    assert item_failure(other, {}, 1).message.startswith("request rejected by SLO admission control: "
                                                         "tpot_unattainable (the replica cannot keep the TPOT SLO now")


def test_an_engine_that_died_under_a_request_answers_as_a_dead_replica():
    """A killed replica's in-flight request sees either the replica die (a Ray actor error) or, first, its engine
    process (an `unavailable` item from the engine client): both are a 503 to retry, not a 500. A failed step stays
    a 500."""
    from ray.exceptions import RayActorError

    from core.messages import ErrorKind
    from core.request import FinishReason
    from deployments.errors import item_failure, replica_failure
    dead = RequestOutput("r", finished=True, finish_reason=FinishReason.ERROR, error_kind=ErrorKind.UNAVAILABLE,
                         error="engine failure: engine process exited (code -9)")
    for e in (item_failure(dead, {"x-kairos-request-id": "r"}, 2), replica_failure(RayActorError(), 2)):
        assert (e.status, e.code, e.headers["Retry-After"]) == (503, "replica_failed", "2"), vars(e)
        assert "replica serving this request died" in e.message
    assert "engine process exited" in item_failure(dead, {}, 2).message
    step = dataclasses.replace(dead, error_kind=ErrorKind.ENGINE, error="injected fault")
    failed = item_failure(step, {}, 2)  # (a step the engine failed: a retry may succeed)
    assert (failed.status, failed.code, failed.headers["Retry-After"]) == (500, "engine_error", "2")


def _rejection_view(reason: str, slo: SLO, prompt_tokens: int = 100, max_tokens: int = 50, waiting_tokens: int = 0,
                    step_ms: float | None = None, decode_left: tuple[int, ...] = (), policy: str = "kairos",
                    ttft_margin_ms=None, gate_scale: float = 1.0, planned_len: int | None = None,
                    nearest_end: int | None = None, judge_scale: float | None = None):
    from deployments.replica import judge_rejection
    from scheduling.config import SchedulerConfig
    from scheduling.predictor import LatencyModel

    # prefill: 1 ms per token + 10 ms; a decode step: 20 ms + 0.01 ms per context token per sequence
    model = LatencyModel(prefill_coef=(1.0, 10.0), decode_coef=(0.01, 20.0, 0.0, 0.0), theta=0.0)
    req = GenerateRequest("r", prompt=(1,), params=SamplingParams(max_tokens=max_tokens), slo=slo)
    return judge_rejection(reason, req, prompt_tokens, model, SchedulerConfig(policy=policy), 1024,
                           waiting_tokens, step_ms, list(decode_left), ttft_margin_ms, gate_scale=gate_scale,
                           planned_len=planned_len, nearest_end=nearest_end, judge_scale=judge_scale)


def test_an_slo_not_even_an_idle_replica_meets_is_unattainable_and_says_what_is():
    """The latency model's idle floor for this request: TTFT = its prefill alone + the TTFT margin (100 + 10 + 50);
    TPOT = one sequence's decode step at its mid-reply context, times the gate's margin over its slack."""
    v = _rejection_view("ttft_unattainable", SLO(ttft_ms=150.0))
    assert v.reason == "slo_unattainable" and v.retry_after_s is None
    assert v.best_ttft_ms == pytest.approx(160.0)
    assert v.best_tpot_ms == pytest.approx((20.0 + 0.01 * 125) * 1.05 / 0.99)  # kairos: margin 1.05
    # the margin the engine's guard measured (kairos: Scheduler.ttft_margin_ms) instead of the configured 50 ms
    v = _rejection_view("ttft_unattainable", SLO(ttft_ms=150.0), ttft_margin_ms=5.0)
    assert v.reason == "ttft_unattainable" and v.retry_after_s is not None and v.best_ttft_ms == pytest.approx(115.0)
    # measured by predicted prefill (ttft_guard.margin_at over the engine's table): this request's, 110 ms, gets 5
    table = ((128.0, 5.0), (8192.0, 16_000.0))  # a long prompt measured 16 s late raised the long ones' only
    v = _rejection_view("ttft_unattainable", SLO(ttft_ms=150.0),
                        ttft_margin_ms=lambda p: margin_at(table, p, 50.0))
    assert v.reason == "ttft_unattainable" and v.best_ttft_ms == pytest.approx(115.0)
    v = _rejection_view("ttft_unattainable", SLO(ttft_ms=5000.0), prompt_tokens=1000,
                        ttft_margin_ms=lambda p: margin_at(table, p, 50.0))
    assert v.reason == "slo_unattainable" and v.best_ttft_ms == pytest.approx(1010.0 + 16_000.0)
    assert _rejection_view("tpot_unattainable", SLO(tpot_ms=22.0)).reason == "slo_unattainable"
    # the decode steps the replica measured at 1.5x the profile (the gate's idle scale): a 30 ms TPOT is out of reach
    v = _rejection_view("tpot_unattainable", SLO(tpot_ms=30.0), gate_scale=1.5)
    assert v.reason == "slo_unattainable" and v.best_tpot_ms == pytest.approx((20.0 + 0.01 * 125) * 1.5 * 1.05 / 0.99)
    assert _rejection_view("tpot_unattainable", SLO(tpot_ms=30.0)).reason == "tpot_unattainable"
    # judged with the least scale of a longer memory (Scheduler.judge_gate_scale: the floor of an SLO offered lately)
    # while the floor it offers is drawn with the scale now: busy, and the offer the higher one
    v = _rejection_view("tpot_unattainable", SLO(tpot_ms=30.0), gate_scale=1.5, judge_scale=1.0)
    assert v.reason == "tpot_unattainable" and v.best_tpot_ms == pytest.approx((20.0 + 0.01 * 125) * 1.5 * 1.05 / 0.99)
    assert _rejection_view("tpot_unattainable", SLO(tpot_ms=22.0), gate_scale=1.5, judge_scale=1.0).reason \
        == "slo_unattainable"
    # a busy rejection of a request whose other SLO no idle replica meets: retrying cannot help either
    assert _rejection_view("ttft_unattainable", SLO(ttft_ms=5000.0, tpot_ms=1.0)).reason == "slo_unattainable"
    # ...unless the policy does not enforce that SLO (no VBS gate: the TPOT is not checked at all)
    assert _rejection_view("ttft_unattainable", SLO(ttft_ms=5000.0, tpot_ms=1.0), policy="edf_reject").reason \
        == "ttft_unattainable"
    # shedding and a full queue are load, whatever the SLO
    assert _rejection_view("shed", SLO(tpot_ms=1.0)).reason == "shed"


def test_the_idle_floor_plans_for_the_reply_length_the_scheduler_planned_for():
    """A request rejected by its TPOT on a busy replica is unattainable only if an idle replica would turn it away too,
    at the reply length the scheduler's gate planned it for (`RequestOutput.planned_output_len`: a predicted length
    where the cap is the window): a chat request with no max_tokens and a short predicted reply is a 429 to retry,
    not a 400, and its floor is offered at that length."""
    cap_floor = (20.0 + 0.01 * (100 + 900 / 2)) * 1.05 / 0.99  # the cap, 900 tokens: 26.6 ms
    v = _rejection_view("tpot_unattainable", SLO(tpot_ms=25.0), max_tokens=900)
    assert v.reason == "slo_unattainable" and v.best_tpot_ms == pytest.approx(cap_floor)
    v = _rejection_view("tpot_unattainable", SLO(tpot_ms=25.0), max_tokens=900, planned_len=60)
    assert v.reason == "tpot_unattainable" and v.best_tpot_ms == pytest.approx((20.0 + 0.01 * 130) * 1.05 / 0.99)
    for planned in (None, 0):  # none sent (an older engine): the hint, else max_tokens, as before
        assert _rejection_view("tpot_unattainable", SLO(tpot_ms=25.0), max_tokens=900,
                               planned_len=planned).reason == "slo_unattainable"


def test_a_busy_rejection_gets_a_retry_after_computed_from_the_queue():
    # TTFT: the queued prefill ahead (2,000 tokens) and its own: 2.11 s -> 3 s
    v = _rejection_view("ttft_unattainable", SLO(ttft_ms=500.0), waiting_tokens=2000)
    assert (v.reason, v.retry_after_s) == ("ttft_unattainable", 3) and v.best_ttft_ms == pytest.approx(160.0)
    # TPOT: the batch must thin out: plus the steps until the in-flight request nearest its end is done
    v = _rejection_view("tpot_unattainable", SLO(tpot_ms=60.0), step_ms=25.0, decode_left=(300, 80, 900))
    assert (v.reason, v.retry_after_s) == ("tpot_unattainable", 3)  # 0.11 s + 80 x 25 ms = 2.11 s
    assert _rejection_view("tpot_unattainable", SLO(tpot_ms=60.0)).retry_after_s == 1  # at least 1
    # the engine's own count of the nearest end (expected lengths as its scheduler plans them: a predicted reply of
    # a request whose max_tokens is the window) wins over the replica's from hints and max_tokens: 0.11 s + 8 x 25 ms
    v = _rejection_view("tpot_unattainable", SLO(tpot_ms=60.0), step_ms=25.0, decode_left=(8000, 7000), nearest_end=8)
    assert v.retry_after_s == 1
    assert _rejection_view("shed", SLO(tpot_ms=60.0), step_ms=25.0, nearest_end=200).retry_after_s == 6
    assert _rejection_view("overloaded", SLO(), waiting_tokens=10**6).retry_after_s == 60  # at most 60


def test_rejections_answer_400_unattainable_or_429_busy_with_their_headers():
    from core.messages import ServedBy
    from core.request import FinishReason
    from deployments.errors import item_failure

    unattainable = RequestOutput("r", finished=True, finish_reason=FinishReason.REJECTED,
                                 reject_reason="slo_unattainable", served_by=ServedBy("rep", 1.0, None, 160.0, 22.3))
    e = item_failure(unattainable, {"x-kairos-request-id": "r"}, 1)
    assert (e.status, e.type, e.code) == (400, "invalid_request_error", "slo_unattainable")
    assert e.headers["x-kairos-reject-reason"] == "slo_unattainable" and "Retry-After" not in e.headers
    # the offer: the idle floor with 25% headroom (it moves with what the replica measures), rounded up
    assert e.headers["x-kairos-slo-best-ttft-ms"] == "200.1" and e.headers["x-kairos-slo-best-tpot-ms"] == "27.9"
    assert "200.1 ms" in e.message and "27.9 ms" in e.message and e.headers["x-kairos-request-id"] == "r"
    busy = dataclasses.replace(unattainable, reject_reason="ttft_unattainable",
                               served_by=ServedBy("rep", 1.0, 4, 160.0, 22.3))
    e = item_failure(busy, {}, 1)
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "ttft_unattainable")
    assert e.headers["Retry-After"] == "4" and e.headers["x-kairos-reject-reason"] == "ttft_unattainable"


def test_max_tokens_beyond_the_context_window_is_a_400_naming_the_limit():
    from core.messages import ContextLengthExceeded, ErrorKind
    from core.request import FinishReason
    from deployments.errors import item_failure

    msg = str(ContextLengthExceeded(1000, 512, 20))
    assert msg == ("'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length "
                   "is 512 tokens and your request has 20 input tokens (1000 > 512 - 20).")
    item = RequestOutput("r", finished=True, finish_reason=FinishReason.ERROR, error=msg,
                         error_kind=ErrorKind.CONTEXT_LENGTH)
    e = item_failure(item, {}, 1)
    assert (e.status, e.code, e.param, e.message) == (400, "context_length_exceeded", "max_tokens", msg)


def test_served_names_and_json_content_types():
    from deployments.ingress import is_json_content_type, served_names

    assert served_names("kairos-default", "kairos-default") == ["kairos-default",
                                                                "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert served_names("mine", "kairos-default") == ["mine", "kairos-default", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert served_names("hf", "/models/hf") == ["hf", "/models/hf"]
    assert served_names("kairos-tiny", None) == ["kairos-tiny"]
    for ok in ("application/json", "Application/JSON; charset=utf-8", "application/merge-patch+json"):
        assert is_json_content_type(ok), ok
    for bad in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert not is_json_content_type(bad), bad


def test_metrics_exposition_keeps_only_kairos_and_serve_series():
    from deployments.metrics import filter_exposition

    text = """# HELP ray_kairos_ttft_s time to first token
# TYPE ray_kairos_ttft_s histogram
ray_kairos_ttft_s_bucket{le="0.1",tier="best_effort"} 3.0
# HELP ray_node_cpu_utilization cpu
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="127.0.0.1"} 12.5
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{route="/"} 7.0
"""
    assert filter_exposition(text).splitlines() == [
        "# HELP ray_kairos_ttft_s time to first token", "# TYPE ray_kairos_ttft_s histogram",
        'ray_kairos_ttft_s_bucket{le="0.1",tier="best_effort"} 3.0',
        "# TYPE ray_serve_num_http_requests_total counter", 'ray_serve_num_http_requests_total{route="/"} 7.0']
    assert filter_exposition("ray_node_mem 1\n") == ""
    # the vLLM series (Ray Serve LLM's names) as vLLM's own server names them
    vllm = """# HELP ray_vllm_num_requests_running requests running
# TYPE ray_vllm_num_requests_running gauge
ray_vllm_num_requests_running{model_name="m"} 2.0
ray_vllm_generation_tokens_total{model_name="m"} 9.0
"""
    assert filter_exposition(vllm).splitlines() == [
        "# HELP vllm:num_requests_running requests running", "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m"} 2.0', 'vllm:generation_tokens_total{model_name="m"} 9.0']
    # a histogram's _sum as Ray's agent rebuilds it (each observation its bucket's midpoint) is replaced by the exact
    # total the replica keeps beside it, per label set; that counter is left out
    sums = """# HELP ray_vllm_request_prompt_tokens prompt tokens
# TYPE ray_vllm_request_prompt_tokens histogram
ray_vllm_request_prompt_tokens_bucket{le="10.0",model_name="a",engine="0"} 1.0
ray_vllm_request_prompt_tokens_sum{model_name="a",engine="0"} 7.5
ray_vllm_request_prompt_tokens_count{model_name="a",engine="0"} 1.0
ray_vllm_request_prompt_tokens_sum{model_name="b",engine="0"} 1800.0
# HELP ray_vllm_request_prompt_tokens_exact_sum_total the exact total
# TYPE ray_vllm_request_prompt_tokens_exact_sum_total counter
ray_vllm_request_prompt_tokens_exact_sum_total{engine="0",model_name="a"} 8.0
ray_vllm_request_prompt_tokens_exact_sum_total{engine="0",model_name="b"} 1212.0
ray_vllm_e2e_request_latency_seconds_sum{model_name="a",engine="0"} 0.15
"""
    assert filter_exposition(sums).splitlines() == [
        "# HELP vllm:request_prompt_tokens prompt tokens", "# TYPE vllm:request_prompt_tokens histogram",
        'vllm:request_prompt_tokens_bucket{le="10.0",model_name="a",engine="0"} 1.0',
        'vllm:request_prompt_tokens_sum{model_name="a",engine="0"} 8.0',
        'vllm:request_prompt_tokens_count{model_name="a",engine="0"} 1.0',
        'vllm:request_prompt_tokens_sum{model_name="b",engine="0"} 1212.0',
        'vllm:e2e_request_latency_seconds_sum{model_name="a",engine="0"} 0.15']  # (no total seen: as it came)


def test_replica_metrics_export_the_series_ray_serve_llms_dashboard_reads_under_vllms_names(monkeypatch):
    """Ray's Serve LLM Grafana dashboard reads vLLM's series (`ray_vllm_*`, tagged model_name): the replica
    exports them from the engine's stats and each request's end, beside its own."""
    from types import SimpleNamespace

    from core.messages import RequestMetrics, RequestOutput
    from core.request import SLO
    from deployments import metrics as Mx

    incs: list[tuple[str, float, dict]] = []
    observed: list[tuple[str, float, dict]] = []
    gauges: dict[str, float] = {}

    class H:
        def __init__(self, name, description="", boundaries=(), tag_keys=()):
            self.name = name
            assert list(boundaries) == sorted(boundaries) and boundaries

        def set_default_tags(self, tags):
            pass

        def observe(self, value, tags=None):
            observed.append((self.name, value, dict(tags or {})))

    class G(H):
        def __init__(self, name, description="", tag_keys=()):
            self.name = name

        def set(self, value, tags=None):
            gauges[self.name] = value

    monkeypatch.setattr(Mx, "Counter", recording_counter(incs))
    monkeypatch.setattr(Mx, "Histogram", H)
    monkeypatch.setattr(Mx, "Gauge", G)
    m = Mx.ReplicaMetrics("m")
    m.update_engine(SimpleNamespace(num_running=2, num_waiting=3, kv_blocks_used=1, kv_blocks_total=4, preemptions=2,
                                    prefix_cache_queries=10, prefix_cache_hits=4), 0)
    assert (gauges["vllm_num_requests_running"], gauges["vllm_num_requests_waiting"],
            gauges["vllm_kv_cache_usage_perc"]) == (2, 3, 0.25)
    assert gauges["kairos_engine_alive"] == 1.0
    # a dead engine's last figures are no load: its gauges say nothing held, and that it is dead (they stayed at the
    # last figures, a busy replica on the dashboards, until Serve replaced it)
    from engine.stats import EngineStats

    m.update_engine(EngineStats(alive=False, num_waiting=3, num_running=2, kv_blocks_total=4, kv_blocks_free=1,
                                kv_blocks_used=3, vbs=2.0, strictest_tpot_ms=None, last_prefill_batch=1,
                                last_decode_batch=2, steps=9), 0)
    assert gauges["kairos_engine_alive"] == 0.0 and gauges["kairos_num_running"] == gauges["kairos_queue_len"] == 0
    assert gauges["vllm_num_requests_running"] == gauges["vllm_kv_cache_usage_perc"] == 0
    vllm = lambda: {n: v for n, v, _ in incs if n.startswith("vllm_") and not n.endswith("_exact_sum")}  # noqa: E731
    assert vllm() == {"vllm_num_preemptions": 2, "vllm_prefix_cache_queries": 10, "vllm_prefix_cache_hits": 4}
    incs.clear()
    m.on_admitted("best_effort", 7)
    m.on_first_token("best_effort", 0.3)  # (TTFT as the first token came, as vLLM observes it: not at the end)
    m.on_tokens("best_effort", 5)
    final = RequestOutput("r", finished=True, finish_reason="stop", num_prompt_tokens=7, num_output_tokens=6,
                          metrics=RequestMetrics(arrival_s=10.0, admitted_s=10.1, first_token_s=10.3,
                                                 finished_s=11.3, token_times=[10.3, 10.5, 10.7, 10.9, 11.1, 11.3]))
    m.on_finished("best_effort", SLO(), final, streamed=5)
    assert sum(n == "kairos_ttft_s" for n, _, _ in observed) == 1
    assert vllm() == {"vllm_prompt_tokens": 7, "vllm_generation_tokens": 6, "vllm_request_success": 1}
    assert [t for n, _, t in incs if n == "vllm_request_success"] == [{"finished_reason": "stop"}]
    got = {n: v for n, v, _ in observed if n.startswith("vllm_")}
    assert got == pytest.approx({
        "vllm_time_to_first_token_seconds": 0.3, "vllm_e2e_request_latency_seconds": 1.3,
        "vllm_request_queue_time_seconds": 0.1, "vllm_request_prefill_time_seconds": 0.2,
        "vllm_request_decode_time_seconds": 1.0, "vllm_request_inference_time_seconds": 1.2,
        "vllm_request_time_per_output_token_seconds": 0.2, "vllm_request_prompt_tokens": 7,
        "vllm_request_generation_tokens": 6, "vllm_request_max_num_generation_tokens": 6})
    # each histogram's exact total beside it (the serving port's /metrics gives it for the _sum Ray's agent rebuilds
    # from the buckets): its first at once (the agent gets both series in one report), later ones handed on with
    # the engine's gauges
    totals = lambda: {n: v for n, v, _ in incs if n.endswith("_exact_sum")}  # noqa: E731
    assert totals() == pytest.approx({f"{n}_exact_sum": v for n, v in got.items()})
    m.on_itls("best_effort", [(0.2, 2), (0.1, 1)])
    assert totals()["vllm_inter_token_latency_seconds_exact_sum"] == pytest.approx(0.5)
    incs.clear()
    m.on_first_token("best_effort", 0.25)
    m.on_itls("best_effort", [(0.1, 3)])
    assert totals() == {}
    stats = SimpleNamespace(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=4)
    m.update_engine(stats, 0)
    assert totals() == pytest.approx({"vllm_time_to_first_token_seconds_exact_sum": 0.25,
                                      "vllm_inter_token_latency_seconds_exact_sum": 0.3})
    incs.clear()
    m.update_engine(stats, 0)
    assert totals() == {}  # (handed on once)
    m.on_aborted("best_effort")
    assert [(n, t) for n, _, t in incs if n.startswith("vllm_")] == [
        ("vllm_request_success", {"finished_reason": "abort"})]


def test_the_vllm_series_take_vllms_buckets_and_the_replica_logs_vllms_stats_line(monkeypatch):
    """vLLM's histograms' buckets (a 16k-token reply's 400 s end to end fell past the top bucket, 300 s), and its
    engine's periodic stats line: throughput over the period, requests, KV cache usage, the prefix cache's hit rate;
    told once when idle, then quiet until it serves again."""
    from types import SimpleNamespace

    from deployments import metrics as Mx

    bounds: dict[str, list[float]] = {}
    tagged: dict[str, dict] = {}

    class H:
        def __init__(self, name, description="", boundaries=(), tag_keys=()):
            self.name, self.keys = name, tag_keys
            bounds[name] = list(boundaries)

        def set_default_tags(self, tags):
            assert set(tags) <= set(self.keys)
            tagged[self.name] = dict(tags)

        observe = set = inc = lambda self, *a, **k: None

    for kind in ("Counter", "Histogram", "Gauge"):
        monkeypatch.setattr(Mx, kind, H)
    m = Mx.ReplicaMetrics("m")
    # token counts' buckets are the same for every model (Ray's agent keeps the first a name is reported with on a
    # node: another model's replica with other buckets had its counts dropped), vLLM's 1-2-5 steps
    lengths = bounds["vllm_request_prompt_tokens"]
    assert lengths[:4] == [1.0, 2.0, 5.0, 10.0] and lengths[-1] == 1e7
    assert bounds["vllm_request_generation_tokens"] == bounds["vllm_request_max_num_generation_tokens"] == lengths
    # vLLM's labels: model_name and engine (queries by engine found nothing)
    assert all(t == {"model_name": "m", "engine": "0"} for n, t in tagged.items() if n.startswith("vllm_"))
    assert bounds["vllm_time_to_first_token_seconds"][-1] == 2560.0
    assert bounds["vllm_e2e_request_latency_seconds"][-1] == bounds["vllm_request_decode_time_seconds"][-1] == 7680.0
    assert bounds["vllm_inter_token_latency_seconds"][-1] == 80.0 and bounds["kairos_e2e_s"][-1] >= 7680
    log = Mx.StatsLog(10.0)
    st = SimpleNamespace(num_running=3, num_waiting=1, kv_blocks_used=1, kv_blocks_total=4, prefix_cache_queries=0,
                         prefix_cache_hits=0)
    assert log.line(100.0, m, st) is None  # (the period's start)
    m.on_admitted("a", 500)
    m.on_tokens("a", 200)
    m.flush_counts()
    assert log.line(105.0, m, st) is None  # (within the period)
    st.prefix_cache_queries, st.prefix_cache_hits = 400, 100
    assert log.line(110.0, m, st) == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    st.num_running = st.num_waiting = 0
    assert log.line(120.0, m, st).startswith("Avg prompt throughput: 0.0 tokens/s")  # (idle: said once)
    assert log.line(130.0, m, st) is None and log.line(140.0, m, st) is None
    m.on_tokens("a", 10)
    m.flush_counts()
    assert "generation throughput: 1.0 tokens/s" in log.line(150.0, m, st)


def recording_counter(incs: list) -> type:
    """A stand-in for Serve's Counter that appends (name, value, tags) of each `inc` to `incs` (Ray's refuses 0)."""
    class Ctr:
        def __init__(self, name, description="", tag_keys=()):
            self.name = name

        def set_default_tags(self, tags):
            pass

        def inc(self, value=1.0, tags=None):
            assert value > 0
            incs.append((self.name, value, dict(tags or {})))
    return Ctr


def generated(calls: list) -> list[tuple[float, str]]:
    """The generated-token counter's increments among recorded counter calls: (value, tier) each."""
    return [(v, t["tier"]) for n, v, t in calls if n == "kairos_generation_tokens"]


def test_replica_metrics_count_the_model_error_by_rows_from_cumulative_stats(monkeypatch):
    """The engine publishes cumulative (steps, sum of wall / model) per decode-rows bucket; the replica's counters
    take what is new since its last refresh, and start again with a new engine (its sums reset)."""
    from types import SimpleNamespace

    from deployments import metrics as Mx

    incs: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(Mx, "Counter", recording_counter(incs))
    m = Mx.ReplicaMetrics("m")

    def refresh(sums):
        incs.clear()
        m.update_engine(SimpleNamespace(decode_over_model=sums), 0)
        return sorted((n, v, t["rows"]) for n, v, t in incs if n.startswith("kairos_decode_step"))
    assert refresh({1: (4, 5.0), 16: (2, 1.8)}) == [
        ("kairos_decode_step_over_model_sum", 1.8, "16"), ("kairos_decode_step_over_model_sum", 5.0, "1"),
        ("kairos_decode_steps", 2, "16"), ("kairos_decode_steps", 4, "1")]
    assert refresh({1: (4, 5.0), 16: (2, 1.8)}) == []  # nothing new
    got = refresh({1: (6, 7.5), 16: (2, 1.8)})
    assert got == [("kairos_decode_step_over_model_sum", pytest.approx(2.5), "1"), ("kairos_decode_steps", 2, "1")]
    assert refresh({1: (1, 0.9)}) == [("kairos_decode_step_over_model_sum", 0.9, "1"), ("kairos_decode_steps", 1, "1")]

    def preempted(n: int) -> list[float]:  # the engine's cumulative count becomes the counter's increments
        incs.clear()
        m.update_engine(SimpleNamespace(preemptions=n, kv_blocks_used=3, kv_blocks_total=4), 0)
        return [v for name, v, _ in incs if name == "kairos_preemptions"]
    assert preempted(0) == [] and preempted(3) == [3] and preempted(3) == [] and preempted(5) == [2]
    assert preempted(1) == [1] and preempted(2) == [1]  # a new engine counts from 0 again

    def seats_full(n: int) -> list[float]:  # the same for the rejections made with every seat taken
        incs.clear()
        m.update_engine(SimpleNamespace(rejected_seats_full=n, kv_blocks_used=3, kv_blocks_total=4), 0)
        return [v for name, v, _ in incs if name == "kairos_requests_rejected_seats_full"]
    assert seats_full(0) == [] and seats_full(4) == [4] and seats_full(4) == [] and seats_full(9) == [5]
    assert seats_full(2) == [2]  # a new engine


def test_replica_metrics_mark_the_policy_the_engine_runs(monkeypatch):
    """`kairos_scheduler_policy`: 1 for the policy in the engine's stats, 0 for each it ran before (user_config
    changes it in place), every refresh."""
    from types import SimpleNamespace

    from deployments import metrics as Mx

    sets: dict[str, float] = {}

    class G:
        def __init__(self, name, description="", tag_keys=()):
            self.name = name

        def set_default_tags(self, tags):
            pass

        def set(self, value, tags=None):
            if self.name == "kairos_scheduler_policy":
                sets[tags["policy"]] = value

    monkeypatch.setattr(Mx, "Gauge", G)
    m = Mx.ReplicaMetrics("m")
    m.update_engine(SimpleNamespace(policy="fcfs"), 0)
    assert sets == {"fcfs": 1.0}
    m.update_engine(SimpleNamespace(policy="scorpio"), 0)
    m.update_engine(SimpleNamespace(), 0)  # a stats object without the field: nothing moves
    assert sets == {"fcfs": 0.0, "scorpio": 1.0}


def test_bench_reads_the_model_error_by_rows_from_prometheus_text():
    from bench.driver import decode_over_model

    text = """# TYPE ray_kairos_decode_steps_total counter
ray_kairos_decode_steps_total{Component="core_worker",deployment="LLMServer",model="m",replica="a",rows="16"} 10.0
ray_kairos_decode_steps_total{Component="core_worker",deployment="LLMServer",model="m",replica="b",rows="16"} 5.0
ray_kairos_decode_steps_total{deployment="LLMServer",model="m",replica="a",rows="2"} 4.0
ray_kairos_decode_step_over_model_sum_total{deployment="LLMServer",model="m",replica="a",rows="16"} 12.0
ray_kairos_decode_step_over_model_sum_total{deployment="LLMServer",model="m",replica="b",rows="16"} 6.0
ray_kairos_decode_step_over_model_sum_total{deployment="LLMServer",model="m",replica="a",rows="2"} 5.2
ray_kairos_decode_steps_total{deployment="LLMServer",model="m",replica="a",rows="x"} 1.0
ray_kairos_vbs{deployment="LLMServer",model="m"} 3.0
"""
    assert decode_over_model(text) == {2: (4, pytest.approx(5.2)), 16: (15, pytest.approx(18.0))}
    assert decode_over_model("") == {}


def test_bench_reads_the_rejections_made_with_every_seat_taken_from_prometheus_text():
    from bench.driver import rejected_seats_full

    text = """# TYPE ray_kairos_requests_rejected_seats_full_total counter
ray_kairos_requests_rejected_seats_full_total{deployment="LLMServer",model="m",replica="a"} 7.0
ray_kairos_requests_rejected_seats_full_total{deployment="LLMServer",model="m",replica="b"} 2.0
ray_kairos_vbs{deployment="LLMServer",model="m",replica="a"} 1.0
"""
    assert rejected_seats_full(text) == 9.0 and rejected_seats_full('ray_kairos_vbs{model="m"} 1.0') is None


def test_bench_reads_the_policy_each_replica_runs_from_prometheus_text():
    from bench.driver import running_policies

    text = """# TYPE ray_kairos_scheduler_policy gauge
ray_kairos_scheduler_policy{deployment="LLMServer",model="m",policy="fcfs",replica="a"} 0.0
ray_kairos_scheduler_policy{deployment="LLMServer",model="m",policy="scorpio",replica="a"} 1.0
ray_kairos_scheduler_policy{deployment="LLMServer",model="m",policy="fcfs",replica="b"} 1.0
ray_kairos_vbs{deployment="LLMServer",model="m",replica="a"} 1.0
"""
    assert running_policies(text) == {("a", "scorpio"), ("b", "fcfs")} and running_policies("") == set()


def test_beam_search_refuses_only_values_that_would_change_its_reply() -> None:
    """Beside use_beam_search a field it would not honour is a 400 where its value would change the reply: a
    logprobs of 0 too (it was taken for false, and the logprobs left out without a word); empty lists and maps, and
    tool_choice auto without tools, change nothing (a client's defaults were 400s); length_penalty without beam
    search has no effect, as vLLM's (it was a 400)."""
    beam = {"prompt": "x", "use_beam_search": True, "n": 2}
    for field, value in (("logprobs", 0), ("prompt_logprobs", 0), ("logprobs", 1), ("stop", ["a"]),
                         ("presence_penalty", 0.5)):
        with pytest.raises(ValidationError, match=f"{field} is not supported with use_beam_search"):
            P.CompletionRequest.model_validate({**beam, field: value})
    for field, value in (("stop", []), ("stop_token_ids", []), ("bad_words", []), ("logit_bias", {}),
                         ("presence_penalty", 0.0), ("logprobs", None)):
        P.CompletionRequest.model_validate({**beam, field: value})
    with pytest.raises(ValidationError, match="guided_json is not supported with use_beam_search"):
        P.CompletionRequest.model_validate({**beam, "guided_json": {}})  # (an empty schema is one: any value)
    chat = {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}
    P.ChatCompletionRequest.model_validate({**chat, "tools": [], "tool_choice": "auto"})
    P.ChatCompletionRequest.model_validate({**chat, "logprobs": False})
    with pytest.raises(ValidationError, match="logprobs is not supported with use_beam_search"):
        P.ChatCompletionRequest.model_validate({**chat, "logprobs": True})
    assert P.CompletionRequest.model_validate({"prompt": "x", "length_penalty": 1.5}).length_penalty == 1.5


def test_stop_strings_are_bounded_in_all() -> None:
    """256 stop strings of 2,000 characters each cost the engine's worker hundreds of microseconds a token for that
    request: their characters are bounded in all (a 400), their number too."""
    from core.sampling import MAX_STOP_CHARS

    SamplingParams(stop=("x" * 64,) * 256).validate()
    with pytest.raises(ValueError, match="characters in all"):
        SamplingParams(stop=("x" * 2000,) * 256).validate()
    with pytest.raises(ValueError, match="characters in all"):
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),)).validate()


def test_a_tool_choice_beside_a_grammar_names_the_tool_choice() -> None:
    """A named or required tool and a guided_grammar: the 400 says the two cannot both be given, naming tool_choice
    (it said a reply may be held to one format, as if two formats had been given)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ValidationError, match="tool_choice naming or requiring a tool and a response_format"):
        P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                "tool_choice": "required", "guided_grammar": 'root ::= "a"'})


def test_a_models_max_new_tokens_caps_every_reply() -> None:
    """A checkpoint's generation_config max_new_tokens is its replies' cap (vLLM's --generation-config auto takes
    it as max_tokens): a request's max_tokens above it is held to it; one without is capped by the engine, within
    the context its prompt leaves (tests/test_inputs.py)."""
    from engine.loader import sampling_defaults

    taken, skipped = sampling_defaults({"temperature": 0.6, "max_new_tokens": 2048})
    assert (taken, skipped) == ({"temperature": 0.6, "max_tokens": 2048}, {})
    assert sampling_defaults({"max_new_tokens": 0})[1] == {"max_new_tokens": 0}
    assert sampling_defaults({"max_new_tokens": True})[1] == {"max_new_tokens": True}
    chat = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    # (a request that sets none: the engine's cap, within the context left: InputProcessor.default_max_tokens)
    assert chat.sampling_kwargs(chat.default_max_tokens(), taken)["max_tokens"] is None
    cmpl = P.CompletionRequest.model_validate({"prompt": "x", "max_tokens": 4096})
    assert cmpl.sampling_kwargs(cmpl.default_max_tokens(), taken)["max_tokens"] == 2048
    cmpl = P.CompletionRequest.model_validate({"prompt": "x", "max_tokens": 8})
    assert cmpl.sampling_kwargs(cmpl.default_max_tokens(), taken)["max_tokens"] == 8


@pytest.mark.parametrize("field,value", [
    ("function_call", {"name": "f"}), ("functions", [{"name": "f"}]),
    ("structural_tag", '{"type": "structural_tag", "structures": [], "triggers": ["<f>"]}')])
def test_fields_that_change_the_output_and_are_not_implemented_are_refused(field, value) -> None:
    """OpenAI / vLLM apply these or answer 400; silently ignoring them would return an output the client did not
    ask for. Their defaults (or an explicit null) pass."""
    for schema, base in ((P.CompletionRequest, {"prompt": "x"}), (P.ChatCompletionRequest,
                                                                   {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(ValidationError, match=f"{field} is not supported"):
            schema.model_validate({**base, field: value})
        schema.model_validate({**base, field: None})
    for field_, default in (("response_format", {"type": "text"}), ("length_penalty", 1.0),
                            ("tool_choice", "none"), ("use_beam_search", False), ("parallel_tool_calls", False)):
        P.CompletionRequest.model_validate({"prompt": "x", field_: default})


def test_logit_bias_reaches_the_sampling_params_and_bad_maps_are_refused() -> None:
    body = P.CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": -100, "3": 2.5}})
    assert SamplingParams(**body.sampling_kwargs(4)).validate().logit_bias == ((3, 2.5), (7, -100.0))
    for bad in ({"a": 1}, {"-1": 1}, {"5": 101}, {"5": "x"}):
        with pytest.raises(ValidationError):
            P.CompletionRequest.model_validate({"prompt": "x", "logit_bias": bad})
    with pytest.raises(ValidationError, match="only allowed with stream: true"):
        P.CompletionRequest.model_validate({"prompt": "x", "stream_options": {"include_usage": True}})
    P.CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})


def test_a_choice_of_n_samples_with_its_own_seed_kept_in_range() -> None:
    """Choice j of `n` samples with seed + j (vLLM's), wrapped within the signed 64-bit range the engine takes; a
    request without a seed gives its choices its own params."""
    from deployments.ingress import child_params

    plain = SamplingParams(temperature=0.7)
    assert child_params(plain, 3) is plain
    assert child_params(SamplingParams(seed=5), 2).seed == 7
    assert child_params(SamplingParams(seed=2**63 - 1), 1).validate().seed == -(2**63)
    body = P.CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 128})
    assert body.n == 128 and P.CompletionRequest.model_validate({"prompt": "a", "n": None}).n == 1
    with pytest.raises(ValidationError, match="2 prompts x n=129 make 258 choices"):
        P.CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 129})
    with pytest.raises(ValidationError, match="best_of must be at least n"):
        P.CompletionRequest.model_validate({"prompt": "a", "n": 3, "best_of": 1})
    from deployments.ingress import _choice_name

    assert [_choice_name("completion", 1, 3), _choice_name("completion", 2, 3), _choice_name("chat", 2, 1)] == [
        "prompt 3", "prompt 1, choice 1", "choice 1"]


def test_a_schema_error_names_its_field_as_param_without_pydantics_prefix() -> None:
    from deployments.ingress import _validation_message

    with pytest.raises(ValidationError) as e:
        P.CompletionRequest.model_validate({"prompt": "x", "n": 0})
    assert _validation_message(e.value) == ("n must be in [1, 256], got 0", "n")
    with pytest.raises(ValidationError) as e:
        P.CompletionRequest.model_validate({"prompt": "x", "tool_choice": "required"})
    message, param = _validation_message(e.value)
    assert message.startswith("tool_choice is not supported") and param is None
    for bad in ({"type": "json_schema"}, {"type": "bogus"}, {"type": "text", "x": 1}):  # JSON mode's: named
        with pytest.raises(ValidationError) as e:
            P.CompletionRequest.model_validate({"prompt": "x", "response_format": bad})
        assert _validation_message(e.value)[1] == "response_format"
    # a client that writes every field sends the others as null (vLLM's ResponseFormat takes it)
    sent = {"type": "json_object", "json_schema": None}
    assert P.CompletionRequest.model_validate({"prompt": "x", "response_format": sent}).response_format == \
        {"type": "json_object"}


def test_edge_values_get_a_400_that_says_what_is_wrong() -> None:
    """QA pass 11: NaN is no temperature (not "less than 100"); a batch's bad prompt is named, with `param`; an SLO
    header is a number as JSON writes one ("1_000" and "+5" are Python's, not a client's); a user or system turn
    needs a content (an assistant's may have none, as OpenAI); /v1/models' `created` holds still."""
    from deployments.ingress import _validation_message

    def message(body: dict) -> tuple[str, str | None]:
        with pytest.raises(ValidationError) as e:
            P.CompletionRequest.model_validate(body)
        return _validation_message(e.value)

    assert message({"prompt": "x", "temperature": float("nan")}) == \
        ("temperature must be a finite number, got nan", "temperature")  # the field named once
    assert message({"prompt": [[1, 2], [-1]]}) == ("prompt 1: token ids must be non-negative", "prompt")
    assert message({"prompt": ["a", ""]}) == ("prompt 1 must not be empty", "prompt")
    for raw in ("1_000", "+5", "0x10", "five"):
        with pytest.raises(ValueError, match="must be a number"):
            P.parse_slo_header("x-slo-ttft-ms", raw)
    with pytest.raises(ValueError, match="positive finite"):
        P.parse_slo_header("x-slo-ttft-ms", "-5")
    assert P.parse_slo_header("x-slo-ttft-ms", " 1.5e3 ") == 1500.0
    for turn in ({"role": "user"}, {"role": "user", "content": None}, {"role": "system", "content": None}):
        with pytest.raises(ValidationError, match="needs a content"):
            P.ChatCompletionRequest.model_validate({"messages": [turn]})
    P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]})
    # a sampling knob the request leaves out is the model's (its generation_config's), else the server's default
    chat = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5})
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert {k: chat.sampling_kwargs(8, model)[k] for k in model} == {"temperature": 0.6, "top_p": 0.5, "top_k": 20}
    assert {k: chat.sampling_kwargs(8)[k] for k in model} == {"temperature": 1.0, "top_p": 0.5, "top_k": 0}
    model = {"repetition_penalty": 1.05, "min_p": 0.1}  # vLLM takes these from a generation_config too
    assert {k: chat.sampling_kwargs(8, model)[k] for k in model} == model
    pen = P.CompletionRequest.model_validate({"prompt": "a", "repetition_penalty": 1.2, "min_p": 0,
                                              "presence_penalty": 1, "frequency_penalty": -0.5})
    got = SamplingParams(**pen.sampling_kwargs(8, model)).validate()
    assert (got.repetition_penalty, got.min_p, got.presence_penalty, got.frequency_penalty) == (1.2, 0.0, 1.0, -0.5)
    assert SamplingParams(**chat.sampling_kwargs(8)).validate().penalized is False
    parts = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]})
    assert parts.messages[0].text() == "What is\n2+2?"  # text parts joined by newlines, as vLLM renders them
    assert P.ModelCard(id="a").created == P.ModelCard(id="b").created == P.SERVED_SINCE


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("max_tokens", "3"), ("max_tokens", 3.0),
                                         ("stream", "yes"), ("ignore_eos", 1), ("slo_ttft_ms", "2000"),
                                         ("slo_tpot_ms", True), ("temperature", "0.5")])
def test_values_of_the_wrong_type_are_refused_not_coerced(field, value) -> None:
    """As OpenAI: "3" is not 3 and true is not 1 (pydantic's lax mode had made a 1-token reply of max_tokens: true);
    an integer where a number is asked for is a number."""
    with pytest.raises(ValidationError):
        P.CompletionRequest.model_validate({"prompt": "x", field: value})
    assert P.CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "slo_ttft_ms": 2000}).temperature == 0


def test_an_unsupported_field_is_named_as_param_and_refusals_pickle() -> None:
    """The ingress refuses an unsupported field naming it (`P.unsupported_field`, `param` of its 400); a 10-digit
    logit_bias key is no token id; the replica's refusals cross a process boundary intact."""
    import pickle

    from core.messages import ContextLengthExceeded, PromptTooLong

    assert P.unsupported_field({"prompt": "x", "functions": [{"name": "f"}]}) == "functions"
    assert P.unsupported_field({"prompt": "x", "prompt_logprobs": 0, "skip_special_tokens": True,
                                "prediction": {}, "logprobs": 3, "top_logprobs": 2}) is None  # logprobs: honoured
    for field, value in (("echo", True), ("best_of", 2), ("suffix", "!"), ("tools", [{}]),  # (a chat's)
                         ("logits_processors", ["my.module.Processor"])):  # (vLLM's 400 without its pattern)
        assert P.unsupported_field({"prompt": "x", field: value}) == field  # each 400 names its own field
    assert P.unsupported_field({"prompt": "x", "echo": False, "best_of": 1, "suffix": "", "tools": [],
                                "logits_processors": []}) is None
    with pytest.raises(ValidationError, match="allowed_token_ids is empty"):  # (vLLM's 400: no token may come)
        P.CompletionRequest.model_validate({"prompt": "x", "allowed_token_ids": []})
    assert P.unsupported_field({"messages": [], "chat_template": "{{ x }}"}) is None  # (the app trusts it, or a 400)
    assert P.unsupported_field({"messages": [], "documents": [{"text": "d"}]}) is None  # (to the chat template)
    with pytest.raises(ValidationError):
        P.CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1234567890": 1}})
    for e in (PromptTooLong(9000, 8192), ContextLengthExceeded(100, 8192, 8150)):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)
    assert SamplingParams(logit_bias={1: 1.0, "2": 1.0}).logit_bias  # mixed keys: kept for validate to refuse
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={1: 1.0, "2": 1.0}).validate()


def test_prompt_options_reach_the_typed_request_and_contradictions_are_400() -> None:
    """vLLM's tokenization fields: a completion's add_special_tokens (default true), a chat's add_special_tokens
    (unset: none where a template writes its own, the tokenizer's on the plain fallback), add_generation_prompt,
    continue_final_message and chat_template_kwargs, carried to the replica as `PromptOptions`; contradictory ones
    are refused at the edge."""
    from core.messages import PromptOptions

    assert P.CompletionRequest.model_validate({"prompt": "x"}).add_special_tokens is True
    chat = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.prompt_options() == PromptOptions(None, True, False, None)
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    cont = P.ChatCompletionRequest.model_validate({"messages": msgs, "add_generation_prompt": False,
                                                   "continue_final_message": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert cont.prompt_options() == PromptOptions(None, False, True, {"enable_thinking": False})
    # OpenAI's reasoning_effort reaches the template (vLLM's): "none" switches the thinking off unless the request's
    # chat_template_kwargs say otherwise; a value OpenAI does not name is a 400
    def kwargs(**body) -> dict | None:
        return P.ChatCompletionRequest.model_validate({"messages": msgs[:1], **body}).prompt_options() \
            .chat_template_kwargs
    assert kwargs(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert kwargs(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})["enable_thinking"] is True
    assert kwargs(reasoning_effort="high") == {"reasoning_effort": "high"} and kwargs() is None
    with pytest.raises(ValidationError, match="reasoning_effort"):
        kwargs(reasoning_effort="max")
    # vLLM's /tokenize of a chat takes its tools too: the template shows them, and the count is the chat's
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tok = P.TokenizeChatRequest.model_validate({"messages": msgs[:1], "tools": [tool]}).prompt_options()
    assert tok == P.ChatCompletionRequest.model_validate({"messages": msgs[:1], "tools": [tool]}).prompt_options()
    assert json.loads(tok.tools)[0]["function"]["name"] == "f"
    for bad, match in (({"messages": msgs, "continue_final_message": True}, "cannot both be true"),
                       ({"messages": msgs, "chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
                       ({"messages": msgs, "add_generation_prompt": "no"}, "valid boolean")):
        with pytest.raises(ValidationError, match=match):
            P.ChatCompletionRequest.model_validate(bad)


def test_all_or_none_cancels_the_rest_and_closes_what_started() -> None:
    """A batched completion starts a request per prompt together (`ingress._all_or_none`): their results in order,
    or, where one fails or the caller is cancelled, the others cancelled and those already made closed."""
    from deployments.ingress import _all_or_none

    async def ok(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    async def boom(delay: float) -> int:
        await asyncio.sleep(delay)
        raise ValueError("boom")

    async def scenario() -> None:
        assert await _all_or_none([ok(1, 0.02), ok(2, 0.0), ok(3, 0.01)]) == [1, 2, 3]
        closed: list[int] = []
        with pytest.raises(ValueError, match="boom"):
            await _all_or_none([ok(1, 0.0), boom(0.01), ok(3, 5.0)], close=closed.append)
        assert closed == [1]  # the third was cancelled, not waited for
        closed.clear()
        task = asyncio.ensure_future(_all_or_none([ok(1, 0.0), ok(2, 5.0)], close=closed.append))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == [1]

    asyncio.run(asyncio.wait_for(scenario(), 2.0))


def test_a_request_id_names_the_response_only_where_a_header_can_carry_it_as_it_is() -> None:
    """vLLM's X-Request-Id (or body `request_id`) names the response, and the response's x-kairos-request-id
    carries it: one a header cannot carry as it is (beyond Latin-1; a space at either end, which h11 refuses and
    clients strip) is not used, the server names the response."""
    from deployments.ingress import client_request_id

    assert client_request_id("trace-7") == "trace-7" and client_request_id("req-\xe9") == "req-\xe9"
    for bad in ("\u65e5\u672c", "abc ", " abc", "a\tb", "x" * 257, "", None):
        assert client_request_id(bad) is None, bad


def test_a_chat_part_other_than_text_is_named_in_the_400() -> None:
    """An image (or audio, a file) part of a chat message: a 400 that says so, not pydantic's union of errors."""
    from pydantic import ValidationError

    from deployments.ingress import _validation_message
    from deployments.protocol import ChatCompletionRequest

    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": parts}]})
    message, param = _validation_message(e.value, set(ChatCompletionRequest.model_fields))
    assert message == "messages.0.content: content part 1 is of type 'image_url': this server takes text parts only"
    assert param == "messages"
    ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": parts[:1]}]})
    # the parts vLLM reads as text: a plain string, the Responses API's input_text / output_text, an assistant's
    # refusal (OpenAI's schema): each a text part, joined by newlines
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": ["hi", {"type": "input_text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "!"}]}]})
    assert [m.text() for m in body.messages] == ["hi\nthere", "no\n!"]


def test_a_batch_prompt_turned_away_for_the_load_waits_for_its_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch under a TPOT SLO that a replica keeps for only some of its prompts at once: a prompt turned away for
    the load (429 tpot_unattainable) while others of the batch run waits for one of them to end and is sent again,
    streamed or not; the batch fails only where none of its prompts got in, or its TTFT SLO ran out waiting."""
    import json

    from deployments import ingress
    from deployments.direct import LocalStream
    from deployments.ingress import GenerationFastPath, OpenAIFrontend

    seats = {"free": 2, "most": 0, "held": 2, "blip": 0}  # the fake replica keeps the SLO for `free` requests at once
    sent_slos: list[tuple[float | None, float | None]] = []  # (the engine's TTFT SLO, the client's) of each send
    by_prompt: dict[str, list[float | None]] = {}  # the engine's TTFT SLO of each send, by prompt

    async def generate(req: GenerateRequest):
        sent_slos.append((req.engine_slo.ttft_ms, req.slo.ttft_ms))
        by_prompt.setdefault(req.request_id, []).append(req.engine_slo.ttft_ms)
        if seats["free"] == 0 or seats["blip"] == 1:  # blip 1: the first request after one ended is turned away
            seats["blip"] = 2 if seats["blip"] else 0  # (and armed again for the next end)
            yield RequestOutput(req.request_id, finished=True, finish_reason="rejected",
                                reject_reason="tpot_unattainable")
            return
        seats["free"] -= 1
        seats["most"] = max(seats["most"], seats["held"] - seats["free"])
        try:
            yield RequestOutput(req.request_id, text=req.prompt[:1], token_ids=[1])
            await asyncio.sleep(0.02)
        finally:  # ended (or cancelled): its seat is free before its last item goes out, as in a replica
            seats["free"] += 1
            seats["blip"] //= 2
        yield RequestOutput(req.request_id, text="!", token_ids=[2], finished=True, finish_reason="length",
                            num_prompt_tokens=1, num_output_tokens=2)

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:  # no engine has said what it serves
            return None

        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    front = object.__new__(Front)
    front._init_frontend({"model_name": "m", "max_body_bytes": 1 << 16})

    class Api:
        docs_url = None

    app = GenerationFastPath(front, Api())  # type: ignore[arg-type]

    async def post(body: dict, ttft_ms: int | None = None) -> tuple[int, bytes]:
        sent: list[dict] = []
        raw = json.dumps(body).encode()

        async def receive() -> dict:
            if raw:
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.sleep(3600)

        async def send(msg: dict) -> None:
            sent.append(msg)

        headers = [(b"content-type", b"application/json"), (b"x-slo-tpot-ms", b"20")]
        if ttft_ms is not None:
            headers.append((b"x-slo-ttft-ms", str(ttft_ms).encode()))
        await app({"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "headers": headers,
                   "query_string": b""}, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    prompts = ["a", "b", "c", "d", "e", "f", "g"]

    async def scenario() -> None:
        status, body = await post({"prompt": prompts, "max_tokens": 2})
        assert status == 200, body
        assert [c["text"] for c in json.loads(body)["choices"]] == [p + "!" for p in prompts]
        assert seats["most"] == 2 and seats["free"] == 2
        # those waiting go in line: an end sends one again (and one that gets in, the next), not all of them
        assert len(sent_slos) <= 3 * len(prompts), len(sent_slos)
        status, body = await post({"prompt": prompts, "max_tokens": 2, "stream": True})
        assert status == 200
        events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e and e != "data: [DONE]"]
        texts = {i: "" for i in range(len(prompts))}
        for e in events:
            texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
        assert list(texts.values()) == [p + "!" for p in prompts] and body.endswith(b"data: [DONE]\n\n")
        sent_slos.clear()
        by_prompt.clear()
        # (two seats held 20 ms each: the seventh prompt cannot start before 60 ms; a resend has 30 ms of slack)
        status, body = await post({"prompt": prompts, "max_tokens": 2}, ttft_ms=50)
        assert status == 429 and b"tpot_unattainable" in body and b"prompt " in body  # its TTFT ran out waiting
        resent = [ttfts for ttfts in by_prompt.values() if len(ttfts) > 1]
        # sent again with what was left of its TTFT SLO for the engine...
        assert resent and all(t[-1] < t[0] < 50 for t in resent), by_prompt
        assert {client for _, client in sent_slos} == {50}  # ...and the client's own for its labels
        # turned away when none of the batch runs (a replica's steps measured slow lately), after some were served:
        # it waits the refusal's Retry-After (here shortened) and is sent again
        seats.update(free=1, held=1, blip=2)
        monkeypatch.setattr(ingress, "BATCH_PAUSE_MAX_S", 0.01)
        status, body = await post({"prompt": prompts[:3], "max_tokens": 2})
        assert status == 200, body
        seats.update(free=0, held=0, blip=0)
        for stream in (False, True):  # no prompt got in: the batch is turned away, at once
            status, body = await post({"prompt": prompts[:3], "max_tokens": 2, "stream": stream})
            assert status == 429 and b"prompt " in body and b"tpot_unattainable" in body

    asyncio.run(asyncio.wait_for(scenario(), 10.0))


def test_serve_request_context_still_has_the_internal_request_id_a_batch_replaces() -> None:
    """A batched completion's prompts each get an internal request id of their own (`IngressFrontend._own_call`,
    Ray's private request context): the field it replaces must still exist."""
    from ray.serve.context import _RequestContext

    assert dataclasses.replace(_RequestContext(), _internal_request_id="x")._internal_request_id == "x"


def test_a_refusal_names_the_field_its_message_starts_with() -> None:
    """OpenAI's `param` for refusals made past the schema (sampling values, the engine's input checks)."""
    from deployments.errors import param_named

    assert param_named("min_tokens must be in [0, max_tokens], got 9") == "min_tokens"
    assert param_named("prompt token ids must be integers in [0, 512)") == "prompt"
    assert param_named("the chat template cannot render these messages") is None
    assert param_named(None) is None


def test_a_broken_grpc_stream_to_a_replica_is_a_503_to_retry() -> None:
    """`llm_transport=grpc`: a replica's stream that breaks (any gRPC status Serve does not turn into
    ActorUnavailableError) answers as a replica that died, a 503 `replica_failed` with Retry-After, streamed or not;
    a request over the replicas' message limit is a 413."""
    import grpc

    from deployments.errors import APIError, replica_failure
    from deployments.ingress import OpenAIFrontend, _exception_event

    e = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "stream reset")
    failure = replica_failure(e, 2)
    assert (failure.status, failure.code, failure.headers["Retry-After"]) == (503, "replica_failed", "2")
    assert "gRPC INTERNAL" in failure.message
    assert json.loads(_exception_event(e)[6:])["error"]["code"] == "replica_failed"
    # a request over the replicas' message limit: retrying will not help, a 413 that says what to raise. Serve's
    # cancel of such a call (it never reached a replica) raises the failure again: the client still gets the 413
    big = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "Received message larger than max (5000925 vs. 4194304)")

    class Failed:
        def __anext__(self):
            raise big

        def cancel(self):
            raise big

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:  # no engine has said what it serves
            return None

        def _open(self, req: GenerateRequest) -> Failed:
            return Failed()

    f = object.__new__(Front)
    f._init_frontend({"model_name": "m", "max_body_bytes": 4096, "failovers": 2, "llm_transport": "grpc"})
    with pytest.raises(APIError) as err:
        asyncio.run(f._start(GenerateRequest("r1", "x", params=SamplingParams(max_tokens=4)), time.perf_counter()))
    assert (err.value.status, err.value.code) == (413, "body_too_large")
    assert "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH" in err.value.message


def test_llm_replicas_take_the_largest_body_the_api_lets_in_over_grpc() -> None:
    """Over gRPC a request reaches its LLM replica as one message, which Serve's replica limits to 4 MB: an app that
    lets in larger bodies (`max_body_bytes`) raises its replicas' limit; the default app is left as Serve makes it."""
    from deployments import GRPC_MAX_ENV, llm_actor_options

    opts = {"num_cpus": 0, "num_gpus": 1}
    assert llm_actor_options(AppArgs.model_validate({}), opts) == opts
    big = llm_actor_options(AppArgs.model_validate({"max_body_bytes": 16 << 20}), opts)
    assert int(big["runtime_env"]["env_vars"][GRPC_MAX_ENV]) >= 32 << 20 and big["num_gpus"] == 1
    assert llm_actor_options(AppArgs.model_validate({"max_body_bytes": 16 << 20, "llm_transport": "ray"}), opts) == opts


def test_the_server_version_is_the_packages() -> None:
    import tomllib
    from pathlib import Path

    from deployments.ingress import SERVER_VERSION

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert SERVER_VERSION == project["version"]


def test_replica_metrics_count_streamed_tokens_when_their_request_ends_and_on_each_refresh(monkeypatch):
    """Generated tokens are counted per chunk in the replica and handed to their counter in one call per tier: at a
    request's end (its tier's) and on each refresh of the gauges (every tier's); none is lost or counted twice."""
    from types import SimpleNamespace

    from deployments import metrics as Mx

    calls: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(Mx, "Counter", recording_counter(calls))
    m = Mx.ReplicaMetrics("m")
    for _ in range(5):
        m.on_tokens("a", 2)
    m.on_tokens("b", 3)
    m.on_tokens("b", 0)
    assert generated(calls) == []  # nothing per chunk
    final = RequestOutput("r", "", [], num_prompt_tokens=4, num_output_tokens=11, finished=True, finish_reason="stop")
    m.on_finished("a", SLO(), final, streamed=10)  # its stop token, never streamed, counted with the rest
    assert generated(calls) == [(11, "a")]
    m.update_engine(SimpleNamespace(), 0)
    assert generated(calls) == [(11, "a"), (3, "b")]
    m.on_tokens("b", 4)
    m.on_aborted("b")
    m.update_engine(SimpleNamespace(), 0)
    assert generated(calls) == [(11, "a"), (3, "b"), (4, "b")]


def test_replica_metrics_count_admissions_off_the_first_tokens_way_at_its_end_or_the_refresh(monkeypatch):
    """A request's admission (its first token) and its prompt tokens are counted without a counter call on the way
    of that token: summed per tier and handed to `requests_admitted` and `prompt_tokens` at its request's end (its
    tier's) or the next refresh (every tier's), one call per tier and counter; none lost or counted twice."""
    from types import SimpleNamespace

    from deployments import metrics as Mx

    calls: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(Mx, "Counter", recording_counter(calls))
    m = Mx.ReplicaMetrics("m")

    def counted(name: str) -> list[tuple[float, str]]:
        return [(v, t["tier"]) for n, v, t in calls if n == name]
    m.on_admitted("a", 10)
    m.on_admitted("a", 5)
    m.on_admitted("b", 0)  # an empty prompt's count (Ray's Counter refuses an increment of 0)
    assert counted("kairos_requests_admitted") == [] and counted("kairos_prompt_tokens") == []
    final = RequestOutput("r", "", [], num_prompt_tokens=10, num_output_tokens=1, finished=True, finish_reason="stop")
    m.on_finished("a", SLO(), final, streamed=1)
    assert counted("kairos_requests_admitted") == [(2, "a")] and counted("kairos_prompt_tokens") == [(15, "a")]
    m.update_engine(SimpleNamespace(), 0)
    assert counted("kairos_requests_admitted") == [(2, "a"), (1, "b")] and counted("kairos_prompt_tokens") == [(15, "a")]
    m.update_engine(SimpleNamespace(), 0)
    assert len(counted("kairos_requests_admitted")) == 2  # nothing twice

def test_a_reply_that_ended_on_its_own_is_observed_over_its_predicted_length(monkeypatch):
    """`kairos_length_prediction_ratio`: a reply that ended on its own (finish reason stop) with a length predicted at
    its arrival observes its tokens over that length; one its cap ended (length), or with no prediction, does not.
    The usage's `kairos_metrics` carry the predicted length where there is one."""
    from core.messages import RequestMetrics
    from deployments import metrics as Mx

    seen: list[tuple[str, float, dict]] = []

    class Hist:
        def __init__(self, name, description="", boundaries=(), tag_keys=()):
            self.name = name

        def set_default_tags(self, tags):
            pass

        def observe(self, value, tags=None):
            seen.append((self.name, value, dict(tags or {})))

    monkeypatch.setattr(Mx, "Histogram", Hist)
    monkeypatch.setattr(Mx, "Counter", recording_counter([]))
    m = Mx.ReplicaMetrics("m")

    def final(reason: str, n: int, predicted: int | None) -> RequestOutput:
        return RequestOutput("r", "", [], finished=True, finish_reason=reason, num_prompt_tokens=3,
                             num_output_tokens=n, metrics=RequestMetrics(0.0, 0.0, 0.1, 0.5, [0.1, 0.2], predicted))

    m.on_finished("a", SLO(), final("stop", 30, 10), streamed=30)
    m.on_finished("a", SLO(), final("length", 30, 10), streamed=30)
    m.on_finished("b", SLO(), final("stop", 30, None), streamed=30)
    m.on_finished("b", SLO(), final("stop", 5, 20), streamed=5)
    assert [(v, t["tier"]) for n, v, t in seen if n == "kairos_length_prediction_ratio"] == [(3.0, "a"), (0.25, "b")]
    assert P.engine_metrics(final("stop", 30, 10).metrics)["predicted_output_tokens"] == 10
    assert "predicted_output_tokens" not in P.engine_metrics(final("stop", 30, None).metrics)


def test_the_itl_recorder_sends_what_the_metrics_own_call_would_send():
    """`_TierRecorder` records a tier's observations with the tags the metric's own `observe` would build (its
    default tags and the tier), built once per tier, once per token; a metric without that path (discarded, another
    Ray) gets its own `observe`."""
    from deployments.metrics import _TierRecorder

    class Recording:
        def __init__(self):
            self.calls = []

        def record(self, value, tags=None):
            self.calls.append((value, tags))

    class Hist:
        _discard_metric = False

        def __init__(self):
            self._metric, self._default_tags, self.observed = Recording(), {"model": "m", "replica": "x"}, []

        def _get_final_tags(self, tags):
            return {**self._default_tags, **tags}

        def _validate_tags(self, tags):
            assert set(tags) == {"model", "replica", "tier"}

        def observe(self, value, tags=None):
            self.observed.append((value, tags))

    h = Hist()
    r = _TierRecorder(h)
    r.record(0.02, "a", 3)
    r.record(0.5, "b")
    want = {"model": "m", "replica": "x"}
    assert h._metric.calls == [(0.02, {**want, "tier": "a"})] * 3 + [(0.5, {**want, "tier": "b"})]
    assert h.observed == []
    h2 = Hist()
    h2._discard_metric = True
    _TierRecorder(h2).record(0.1, "a", 2)
    assert h2.observed == [(0.1, {"tier": "a"})] * 2 and h2._metric.calls == []

    def refuses(value, tags=None):  # another Ray's recording path: the public call from then on
        raise TypeError("record() got an unexpected keyword argument 'tags'")
    h3 = Hist()
    h3._metric.record = refuses
    r3 = _TierRecorder(h3)
    r3.record(0.1, "a", 2)
    r3.record(0.2, "b")
    assert h3.observed == [(0.1, {"tier": "a"})] * 2 + [(0.2, {"tier": "b"})]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streams_text_chunks_are_the_bytes_of_its_chunk_dicts(kind, include_usage):
    """`TextChunks` (a stream's chunk JSON around the text built once) gives the bytes the chunk's dict gives, for
    any text, and leaves every other item (a finish, an error, a chat item with no text) to the dict path."""
    from deployments.ingress import TextChunks, _sse_item

    rid, model = 'cmpl-"1"', 'a\\model\u00e9'
    fast = TextChunks(kind, rid, model, 1700000000, include_usage)
    assert fast.usable
    items = [RequestOutput("r", t, [5]) for t in ("hi", "", 'q"uo\\te\n\t', "h\u00e9llo \u2603 \U0001F600",
                                                  "\x00kairos-text\x00", "data: [DONE]\n\n")]
    items += [RequestOutput("r", "end", [6], finished=True, finish_reason="stop", stop_reason="x"),
              RequestOutput("r", "", [], finished=True, finish_reason="error", error="boom")]
    for it in items:
        want = _sse_item(it, kind, rid, model, 1700000000, include_usage)
        assert _sse_item(it, kind, rid, model, 1700000000, include_usage, fast=fast) == want
        assert want is None or want.startswith(b"data: ") and want.endswith(b"\n\n")
    if kind == "completion":  # a batched completion's choice i
        it, third = RequestOutput("r", "x", [5]), TextChunks(kind, rid, model, 1, include_usage, 3)
        assert _sse_item(it, kind, rid, model, 1, include_usage, 3, fast=third) == \
            _sse_item(it, kind, rid, model, 1, include_usage, 3)
    odd = TextChunks(kind, rid, "\x00kairos-text\x00", 1, include_usage)  # the mark in the model's name
    assert not odd.usable
    it = RequestOutput("r", "x", [5])
    assert _sse_item(it, kind, rid, "\x00kairos-text\x00", 1, include_usage, fast=odd) == \
        _sse_item(it, kind, rid, "\x00kairos-text\x00", 1, include_usage)


def test_beam_search_keeps_the_best_beams_by_vllm_s_score() -> None:
    """vLLM's beam search (`BeamSearch`): each step every live beam grows by each of its likeliest tokens, the best
    `width` live on, a beam grown by the EOS has ended; beams rank by their summed log-probability over their length
    (the prompt's counted) to the power length_penalty, an ending EOS not counted where it is kept."""
    from deployments.ingress import BeamSearch

    eos = frozenset({0})
    b = BeamSearch((7, 7), 2, eos)
    assert b.grow([[(5, -0.1), (0, -0.2), (6, -1.0)]])  # the EOS ends a beam; 5 and 6 live on
    assert [t for t, _ in b.live] == [(7, 7, 5), (7, 7, 6)] and b.ended == [((7, 7), -0.2)]
    assert b.grow([[(8, -0.1), (9, -3.0)], [(8, -0.05)]])
    assert [t for t, _ in b.live] == [(7, 7, 5, 8), (7, 7, 6, 8)]
    best = b.best()  # scores: -0.2 / 4 = -0.05, the ended -0.2 / 2 = -0.1, then -1.05 / 4
    assert [(t, e) for t, _, e in best] == [((7, 7, 5, 8), False), ((7, 7), True)]
    assert BeamSearch((1,), 1, eos, length_penalty=0.0).score((1, 2, 3), -3.0) == -3.0
    kept = BeamSearch((1,), 1, eos, keep_eos=True)
    kept.grow([[(0, -1.0)]])
    assert kept.ended == [((1, 0), -1.0)] and kept.score((1, 0), -1.0, True) == -1.0 and not kept.live
    assert not kept.grow([])  # no beam left: the search ends
    wide = BeamSearch((1,), 3, eos, ignore_eos=True)
    assert wide.grow([[(0, -0.5), (4, -0.6)]]) and [t for t, _ in wide.live] == [(1, 0), (1, 4)]


def test_a_beam_that_ends_on_its_eos_keeps_its_last_words_text() -> None:
    """A beam grown by the EOS has ended: without include_stop_str_in_output its tokens leave the EOS out, and its
    text is all of them (its last token's text was cut, as if the EOS were there); with it, its tokens keep the EOS
    and its text leaves that out, as vLLM's."""
    from starlette.datastructures import Headers

    from core.messages import TokenLogprob
    from deployments import ingress as I

    EOS, PROMPT, SAT, ON = 0, (3, 4), 5, 6
    words = {SAT: " sat", ON: " on", EOS: "</s>"}

    class Front(I.OpenAIFrontend):
        def __init__(self) -> None:
            self._init_frontend({"model_name": "m", "max_body_bytes": 1 << 20})

        def _ready_info(self) -> dict:
            return {"eos_token_ids": [EOS], "max_tokens_over_context": "clamp"}

        async def _start(self, req, t):
            reply = list(req.prompt[len(PROMPT):])
            top = [(SAT, -0.1), (ON, -5.0)] if not reply else [(EOS, -0.01), (ON, -6.0)]  # " sat", then the end
            lp = TokenLogprob(0, "", 0.0, 1, tuple((t, words[t], v) for t, v in top))
            return req, None, RequestOutput(req.request_id, "", [0], finished=True, finish_reason=FinishReason.LENGTH,
                                            logprobs=[lp], num_prompt_tokens=len(req.prompt), num_output_tokens=1)

        async def _replica_call(self, method: str, *args):
            if method == "prompt_tokens":
                return {"tokens": list(PROMPT), "max_model_len": 64}
            assert method == "token_text"
            return {"prompt": "".join(words[t] for t in args[0])}

    async def run(keep: bool) -> dict:
        f = Front()
        raw = {"model": "m", "prompt": "The cat", "max_tokens": 5, "use_beam_search": True, "n": 1,
               "include_stop_str_in_output": keep, "return_token_ids": True}
        body, reqs = f._build(SimpleNamespace(headers=Headers()), raw, "completion", "cmpl-1")
        return json.loads((await f._beam_search(body, reqs, "completion", "cmpl-1", 0.0, 0.0, 0.0)).body)["choices"][0]

    got = asyncio.run(run(False))
    assert (got["text"], got["finish_reason"], got["token_ids"]) == (" sat", "stop", [SAT])
    got = asyncio.run(run(True))
    assert (got["text"], got["finish_reason"], got["token_ids"]) == (" sat", "stop", [SAT, EOS])


def test_a_request_turned_away_is_rerouted_only_while_a_running_replica_has_not_turned_it_away() -> None:
    """reroute_rejected: each resend goes to a replica that has not turned the request away yet; with as many
    running as have (an autoscaled app at its fewest: one), it is not sent again."""
    import asyncio

    from core.messages import RejectReason, ServedBy
    from deployments.ingress import OpenAIFrontend

    def run(running: int) -> list[tuple[str, ...]]:
        sent: list[tuple[str, ...]] = []
        me = object.__new__(OpenAIFrontend)
        me.reroutes, me.second_opinion = 3, False
        me._running_replicas = lambda: running

        async def first_item(req, waited_ms, t_call):
            sent.append(req.avoid_replicas)
            out = RequestOutput(req.request_id, finished=True, finish_reason="rejected",
                                reject_reason=RejectReason.OVERLOADED,
                                served_by=ServedBy(f"r{len(sent)}", 1.0))
            return req, None, out

        me._first_item_anywhere = first_item
        asyncio.run(me._start(GenerateRequest("x", prompt=(1,), slo=SLO(ttft_ms=60_000.0)), time.perf_counter()))
        return sent

    assert run(1) == [()]
    assert run(2) == [(), ("r1",)]
    assert run(5) == [(), ("r1",), ("r1", "r2"), ("r1", "r2", "r3")]  # (reroute_rejected: 3 at most)


def test_a_request_one_replica_judges_unattainable_is_judged_by_another_before_the_400() -> None:
    """second_opinion: a replica's idle floor is its own measure (one just started, one on a slower host): a request
    it judged unattainable goes to another replica once; one that serves it or turns it away as busy answers (before
    or after the verdict), and where both judge it unattainable, the 400 offers the lower floor. One replica running:
    not sent again."""
    import asyncio

    from core.messages import RejectReason, ServedBy
    from deployments.errors import APIError
    from deployments.ingress import OpenAIFrontend

    def run(verdicts: list[tuple[str, float]], running: int = 2, reroutes: int = 0, slo: SLO = SLO(tpot_ms=2.0)):
        sent: list[tuple[str, ...]] = []
        me = object.__new__(OpenAIFrontend)
        me.reroutes, me.second_opinion = reroutes, True
        me._running_replicas = lambda: running

        async def first_item(req, waited_ms, t_call):
            sent.append(req.avoid_replicas)
            why, floor = verdicts[len(sent) - 1]
            if why == "queue_full":  # (Serve's back pressure: the replicas' queues are full)
                raise APIError(429, "the replicas' queues are full", "server_error", "overloaded")
            sb = ServedBy(f"r{len(sent)}", 1.0, best_ttft_ms=10.0, best_tpot_ms=floor)
            if why == "ok":
                return req, None, RequestOutput(req.request_id, token_ids=[5], served_by=sb)
            return req, None, RequestOutput(req.request_id, finished=True, finish_reason="rejected",
                                            reject_reason=RejectReason(why), served_by=sb)

        me._first_item_anywhere = first_item
        _, _, first = asyncio.run(me._start(GenerateRequest("x", prompt=(1,), slo=slo), time.perf_counter()))
        return sent, first

    sent, first = run([("slo_unattainable", 3.0), ("ok", 1.5)])
    assert sent == [(), ("r1",)] and not first.finished and first.served_by.replica == "r2"
    sent, first = run([("slo_unattainable", 3.0), ("queue_full", 0.0)])  # the second send failed: the first holds
    assert len(sent) == 2 and first.reject_reason is RejectReason.SLO_UNATTAINABLE and first.served_by.replica == "r1"
    sent, first = run([("slo_unattainable", 3.0), ("tpot_unattainable", 1.5)])
    assert first.reject_reason is RejectReason.TPOT_UNATTAINABLE and len(sent) == 2  # busy: a 429 to retry
    sent, first = run([("slo_unattainable", 2.5), ("slo_unattainable", 3.0)])  # (asked once, however many run)
    assert len(sent) == 2 and first.served_by.replica == "r1" and first.served_by.best_tpot_ms == 2.5
    sent, first = run([("slo_unattainable", 3.0), ("slo_unattainable", 2.5)], running=5, reroutes=3)
    assert len(sent) == 2 and first.served_by.replica == "r2"
    sent, _ = run([("slo_unattainable", 3.0)], running=1)
    assert sent == [()]
    # turned away as busy first, then judged unattainable by the other (both asked): the busy one's 429 (by its floor
    # an idle replica meets the SLO), not a 400
    sent, first = run([("tpot_unattainable", 1.5), ("slo_unattainable", 3.0)], reroutes=1)
    assert sent == [(), ("r1",)] and first.reject_reason is RejectReason.TPOT_UNATTAINABLE
    assert first.served_by.replica == "r1"
    sent, first = run([("shed", 1.5), ("slo_unattainable", 3.0), ("slo_unattainable", 2.5)], running=3, reroutes=1)
    assert len(sent) == 3 and first.reject_reason is RejectReason.SHED
    # asked whatever is left of its TTFT SLO (the other replica judges the SLO: one it meets idle is busy, a 429)
    sent, first = run([("slo_unattainable", 3.0), ("ttft_unattainable", 1.5)], slo=SLO(ttft_ms=1e-6))
    assert len(sent) == 2 and first.reject_reason is RejectReason.TTFT_UNATTAINABLE


def test_a_routed_apps_replicas_split_the_ingress_chunk_budget_over_those_running() -> None:
    """Autoscaled, and with a fixed count too: `serve deploy` of the yaml's LLMServer num_replicas changes Serve's
    count in place, and the split made at build time pushed twice the Ingress's budget through it (4 of 2)."""
    from deployments.pacing import StreamPacing

    fixed = StreamPacing.of_app(0.0, 2000.0, 2, ingress_num_replicas=1)
    assert fixed.max_chunks_per_s == 1000.0 and fixed.for_running(4).max_chunks_per_s == 500.0
    assert fixed.for_running(1).max_chunks_per_s == 2000.0
    scaled = StreamPacing.of_app(0.0, 2000.0, 4, ingress_num_replicas=1, autoscaled=True)
    assert scaled.max_chunks_per_s == 500.0  # planned for the most until it hears otherwise
    assert scaled.for_running(1).max_chunks_per_s == 2000.0 and scaled.for_running(2).max_chunks_per_s == 1000.0
    assert scaled.for_running(0) == scaled
    direct = StreamPacing.of_app(0.0, 2000.0, 1, routed=False, direct_max_chunks_s=5000.0, autoscaled=True)
    assert direct.for_running(3).max_chunks_per_s == 5000.0  # a replica's own budget: not shared


def test_a_body_is_json_as_rfc_8259_has_it() -> None:
    """UTF-8 (a BOM allowed), no NaN or Infinity, no lone surrogate (as an escape or as its bytes)."""
    from deployments.ingress import parse_body

    assert parse_body(b'{"a": [1, "\\u00e9", "\xc3\xa9"]}') == {"a": [1, "\u00e9", "\u00e9"]}
    assert parse_body(b"\xef\xbb\xbf{}") == {} and parse_body('{"a": "é"}'.encode("utf-16")) == {"a": "é"}
    for bad, error in ((b'{"a": NaN}', ValueError), (b'{"a": -Infinity}', ValueError),
                       (b'{"a": "\xed\xa0\x80"}', UnicodeDecodeError), (b'{"a": "\\ud800"}', UnicodeEncodeError),
                       (b'{"a": "\xc0\xaf"}', UnicodeDecodeError)):
        with pytest.raises(error):
            parse_body(bad)


def test_a_reply_its_engine_stops_under_is_a_failure_not_an_abort_finish() -> None:
    """A replica shutting down aborts the requests it holds ("engine shut down"): after the first token too, a
    non-streamed request is a 503 (it was a 200 whose reply ended `abort` as if it succeeded) and a stream ends with
    an error event, as where the abort came first or the engine died."""
    import asyncio
    import json

    from deployments.direct import LocalStream
    from deployments.ingress import GenerationFastPath, OpenAIFrontend

    async def generate(req: GenerateRequest):
        yield RequestOutput(req.request_id, text="Hel", token_ids=[1])
        yield RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ABORT, error="engine shut down",
                            num_prompt_tokens=1, num_output_tokens=1)

    class Front(OpenAIFrontend):
        def _ready_info(self) -> None:
            return None

        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    front = object.__new__(Front)
    front._init_frontend({"model_name": "m", "max_body_bytes": 4096})
    app = GenerationFastPath(front, SimpleNamespace(docs_url=None))  # type: ignore[arg-type]

    async def call(path: str, body: dict) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(msg: dict) -> None:
            sent.append(msg)

        await app({"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
                   "headers": [(b"content-type", b"application/json")]}, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def run() -> None:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 5}), ("/v1/chat/completions", chat)):
            status, text = await call(path, body)
            assert status == 503 and json.loads(text)["error"]["message"].startswith("engine stopping"), text
            status, text = await call(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
            events = [e[6:] for e in text.decode().split("\n\n") if e.startswith("data: ")]
            assert status == 200 and events[-1] == "[DONE]", events
            assert "engine stopping" in json.loads(events[-2])["error"]["message"], events
            assert not any('"abort"' in e for e in events) and not any('"usage": {' in e for e in events), events

    asyncio.run(run())


def _front_of(generate):
    """An Ingress front whose replicas answer with the async generator `generate(req)` of RequestOutput items, and
    its ASGI app (the generation routes' fast path)."""
    from deployments.direct import LocalStream
    from deployments.ingress import GenerationFastPath, OpenAIFrontend

    class Front(OpenAIFrontend):
        def _ready_info(self) -> dict:
            return {"model": "m", "max_model_len": 64}

        def _open(self, req: GenerateRequest) -> LocalStream:
            return LocalStream(generate(req))

    front = object.__new__(Front)
    front._init_frontend({"model_name": "m", "max_body_bytes": 1 << 16})
    return front, GenerationFastPath(front, SimpleNamespace(docs_url=None))  # type: ignore[arg-type]


async def _post_chat(app, body: dict) -> tuple[int, str]:
    """POST `body` to /v1/chat/completions of an ASGI `app` in-process: (the status, the body's text)."""
    import json

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await app({"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
               "query_string": b"", "headers": [(b"content-type", b"application/json")]}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]).decode()


def test_a_chats_echo_is_content_before_its_read_reply() -> None:
    """A chat's `echo` (its last assistant message, continued) goes before the reply's content, not through the
    reasoning reader (vLLM reads the reply, then puts the echo before its content): with deepseek_r1's reader the
    echo was read as reasoning ("The answer ist0t1" as reasoning_content, content null)."""
    import asyncio
    import json

    async def generate(req: GenerateRequest):
        for i, text in enumerate((" 4", "</think>", "Four.")):
            last = i == 2
            yield RequestOutput(req.request_id, text=text, token_ids=[10 + i], finished=last,
                                finish_reason=FinishReason.STOP if last else None, num_prompt_tokens=5,
                                num_output_tokens=i + 1)

    front, app = _front_of(generate)
    front.reasoning_parser = "deepseek_r1"

    async def call(body: dict) -> tuple[int, str]:
        return await _post_chat(app, body)

    async def run() -> None:
        body = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is "}],
                "continue_final_message": True, "add_generation_prompt": False, "echo": True, "max_tokens": 3}
        status, text = await call(body)
        message = json.loads(text)["choices"][0]["message"]
        assert status == 200 and (message["reasoning_content"], message["content"]) == (" 4", "The answer is Four.")
        status, text = await call({**body, "n": 2})
        assert [c["message"]["content"] for c in json.loads(text)["choices"]] == ["The answer is Four."] * 2
        status, text = await call({**body, "stream": True})
        deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in text.split("\n\n") if e.startswith("data: {")]
        content = "".join(d.get("content") or "" for d in deltas)
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        assert (reasoning, content) == (" 4", "The answer is Four."), deltas

    asyncio.run(run())


def test_a_reply_is_read_from_where_its_prompt_leaves_the_thinking() -> None:
    """Where the replica says how the rendered prompt leaves the thinking (`RequestOutput.prompt_thinking`), the
    reply is read from there whatever the app's parser: a template that opened `<think>` (Qwen3's thinking-only
    releases, served with qwen3's parser) starts the reply in it (its text up to `</think>` was content); one that
    closed it (the thinking switched off, deepseek_r1's parser) leaves the reply content (it was all reasoning).
    Whole, streamed, and n=2 alike; a chat asks the replica for it (`read_thinking`)."""
    import asyncio
    import json

    asked: list[GenerateRequest] = []
    said: dict[str, tuple[str | None, tuple[str, ...]]] = {}

    async def generate(req: GenerateRequest):
        asked.append(req)
        thinking, texts = said["now"]
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield RequestOutput(req.request_id, text=text, token_ids=[10 + i], finished=last,
                                finish_reason=FinishReason.STOP if last else None, num_prompt_tokens=5,
                                num_output_tokens=i + 1, prompt_thinking=thinking if i == 0 else None)

    front, app = _front_of(generate)

    async def call(body: dict) -> str:
        status, text = await _post_chat(app, body)
        assert status == 200, text
        return text

    async def read(body: dict) -> list[tuple[str | None, str | None]]:
        whole = [(c["message"].get("reasoning_content"), c["message"]["content"])
                 for c in json.loads(await call(body))["choices"]]
        text = await call({**body, "stream": True})
        chunks = [json.loads(e[6:])["choices"][0] for e in text.split("\n\n") if e.startswith("data: {")]
        deltas = [c["delta"] for c in chunks if c["index"] == 0]
        streamed = ("".join(d.get("reasoning_content") or "" for d in deltas) or None,
                    "".join(d.get("content") or "" for d in deltas) or None)
        assert streamed == whole[0], (streamed, whole)
        return whole

    async def run() -> None:
        body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 3}
        front.reasoning_parser = "qwen3"
        said["now"] = ("open", ("Adding", "</think>", "\n\nFour."))
        assert await read(body) == [("Adding", "Four.")]
        assert await read({**body, "n": 2}) == [("Adding", "Four.")] * 2
        assert asked and all(r.read_thinking for r in asked)
        said["now"] = (None, ("Adding", "</think>", "Four."))  # (no word from the replica: as the parser says)
        assert await read(body) == [(None, "Adding</think>Four.")]
        front.reasoning_parser = "deepseek_r1"
        said["now"] = ("closed", ("Four", "."))
        assert await read(body) == [(None, "Four.")]
        said["now"] = (None, ("Four", "."))
        assert await read(body) == [("Four.", None)]

    asyncio.run(run())


def test_structured_outputs_take_vllms_options() -> None:
    """vLLM's StructuredOutputsParams options beside the grammar (disable_any_whitespace was a 400 saying the request
    held no grammar); a grammar still has to be there. Those that would change the reply's whitespace are refused
    unless at their defaults (they were taken and ignored: a reply with newlines and indents where none were
    asked for), vLLM's top-level guided_whitespace_pattern too."""
    body = P.CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {
        "json": {"type": "object"}, "disable_any_whitespace": False, "disable_fallback": True,
        "whitespace_pattern": None}})
    assert body.structured_outputs["json"] == {"type": "object"}
    with pytest.raises(ValidationError, match="structured_outputs must hold one of"):
        P.CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"disable_fallback": True}})
    for option in ({"disable_any_whitespace": True}, {"whitespace_pattern": "[ ]?"}, {"whitespace_pattern": ""}):
        with pytest.raises(ValidationError, match=f"structured_outputs.{next(iter(option))}=.* is not supported"):
            P.CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": {}, **option}})
    assert P.unsupported_field({"guided_whitespace_pattern": "[ ]?"}) == "guided_whitespace_pattern"
    assert P.unsupported_field({"guided_whitespace_pattern": None}) is None


def test_a_chat_beam_searchs_stream_carries_its_replies_as_read() -> None:
    """A chat's beam search: its replies read as any chat's are (a reasoning model's thinking as reasoning_content,
    tool calls), streamed too: each beam's text went out whole as content."""
    import asyncio
    import json

    from deployments.ingress import _beam_chunks
    from deployments.reasoning import ReplyReader, reasoning_reader

    choices = [P.Choice("<think>hmm</think>yes", FinishReason.STOP, 3, 6),
               P.Choice("<think>a</think>no", FinishReason.LENGTH, 3, 5)]
    read = P.read_replies(P.batch_chat_response("r", "m", choices),
                          lambda _=None: ReplyReader(reasoning_reader("qwen3"), None))
    assert [c["message"].get("reasoning_content") for c in read["choices"]] == ["hmm", "a"]

    async def collect() -> list[dict]:
        return [json.loads(e[6:]) for b in [x async for x in _beam_chunks(choices, "chat", "r", "m", 2, False, read)]
                for e in b.decode().split("\n\n") if e.startswith("data: {")]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(collect()) if c["choices"][0]["delta"].get("content")
              or c["choices"][0]["delta"].get("reasoning_content")]
    assert deltas == [{"reasoning_content": "hmm", "content": "yes"}, {"reasoning_content": "a", "content": "no"}]


def test_the_haproxy_launcher_is_never_one_found_in_a_folder_others_may_write(tmp_path, monkeypatch) -> None:
    """Serve runs the launcher as its HTTP front's binary: in a temp folder others may write (made by another user
    first, or open to all), a file planted at its predictable path ran as Serve. The folder must be this user's
    alone, else a fresh one is made; and the file is always written, never reused as found."""
    import hashlib
    import os
    import stat
    import sys
    import tempfile

    from deployments import haproxy_ingress as H

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"kairos-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)  # (as another user would leave it)
    text = (f"#!{sys.executable} -IS\nimport runpy, sys\n"
            f"runpy.run_path({os.path.abspath(H.__file__)!r})['exec_haproxy'](sys.argv[1:])\n")
    planted = shared / f"haproxy-{hashlib.sha1(text.encode()).hexdigest()[:12]}"
    planted.write_text("#!/bin/sh\necho PWNED\n")
    planted.chmod(0o755)
    got = H._write_launcher(sys.executable, os.path.abspath(H.__file__))
    assert os.path.dirname(got) != str(shared) and open(got).read() == text
    folder = os.lstat(os.path.dirname(got))
    assert folder.st_uid == os.getuid() and not folder.st_mode & 0o077 and stat.S_ISDIR(folder.st_mode)
    shared.chmod(0o700)  # this user's own folder: a stale or changed file there is written over
    assert H._write_launcher(sys.executable, os.path.abspath(H.__file__)) == str(planted)
    assert planted.read_text() == text


def test_tokens_a_stream_merged_into_its_failed_item_go_out_before_the_error_event() -> None:
    """A stream held by pacing merges the tokens queued meanwhile into its next item, the failure too (an engine
    that shut down): those tokens were made and go out as a chunk of their own, then the error event (they were
    lost: only the error went)."""
    from deployments.ingress import _sse_item

    failed = RequestOutput("r", text="Hello world", token_ids=[1, 2], finished=True, finish_reason="abort",
                           error="engine shut down", num_prompt_tokens=3, num_output_tokens=2)
    for kind in ("completion", "chat"):
        got = _sse_item(failed, kind, "rid", "m", 1, False).decode()
        events = [e for e in got.split("\n\n") if e]
        assert len(events) == 2, got
        first = json.loads(events[0].removeprefix("data: "))
        text = first["choices"][0]["text"] if kind == "completion" else first["choices"][0]["delta"]["content"]
        assert text == "Hello world" and first["choices"][0]["finish_reason"] is None
        assert "error" in json.loads(events[1].removeprefix("data: "))
    alone = RequestOutput("r", finished=True, finish_reason="abort", error="engine shut down")
    assert len([e for e in _sse_item(alone, "chat", "rid", "m", 1, False).decode().split("\n\n") if e]) == 1


def test_the_priority_header_is_an_int64_as_the_bodys_field_is() -> None:
    """X-Vllm-Priority (vLLM's): an integer wins over the body's priority, text that is none is ignored, and one past
    an int64 is a 400 at the Ingress, as the body's field is (it went through, and the replica refused it after
    routing); Python's int() extras ("1_000") are no integer here."""
    from deployments.errors import APIError
    from deployments.ingress import header_priority

    assert header_priority("-2", 5) == -2 and header_priority(" 7 ", 5) == 7 and header_priority(None, 5) == 5
    assert header_priority("soon", 5) == 5 and header_priority("1_000", 5) == 5
    assert header_priority(str(2**63 - 1), 0) == 2**63 - 1 and header_priority(str(-2**63), 0) == -2**63
    for big in (str(2**63), str(-2**63 - 1)):
        with pytest.raises(APIError) as e:
            header_priority(big, 0)
        assert e.value.status == 400 and e.value.param == "x-vllm-priority"


def test_a_config_that_drops_its_user_config_takes_the_replicas_back_to_their_start_up_knobs() -> None:
    """Serve 2.60 calls a replica's `reconfigure` with a None user_config only where the method takes the replica's
    rank: a `serve deploy` that dropped the user_config left the running replicas on its knobs, and new ones on the
    start-up knobs (a mixed fleet). Driven through Serve's own wrapper."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.config import DeploymentConfig
    from ray.serve._private.replica import UserCallableWrapper

    from deployments.replica import LLMReplica

    class Probe(LLMReplica):  # LLMReplica's reconfigure over an engine stub
        def __init__(self) -> None:
            self._user_config, self.replica_id, self.applied = {}, "probe", []
            self.engine = SimpleNamespace(reconfigure=lambda knobs: self.applied.append(dict(knobs))
                                          or SimpleNamespace(policy=knobs.get("policy", "kairos")))

        def __del__(self) -> None:
            pass

    async def main() -> list[dict]:
        w = UserCallableWrapper(Probe, (), {}, deployment_id=DeploymentID("LLMServer", "app"),
                                run_sync_methods_in_threadpool=False, run_user_code_in_separate_thread=False,
                                local_testing_mode=True, deployment_config=DeploymentConfig(), actor_id="a")
        await w.initialize_callable()
        await w.call_reconfigure({"policy": "scorpio"}, None)
        await w.call_reconfigure(None, None)  # (the config's user_config dropped)
        return w._callable.applied

    assert asyncio.run(main()) == [{"policy": "scorpio"}, {}]


def test_a_direct_replica_with_a_missing_key_file_fails_before_its_model_loads(monkeypatch, tmp_path) -> None:
    """The direct topology's replica reads its front's API keys before the model loads: a key file that is not there
    failed only after a load of minutes on a GPU, and again at each of Serve's restarts."""
    from deployments import direct
    from deployments.replica import LLMReplica

    loaded: list[bool] = []

    async def load(self, *args, **kwargs) -> None:
        loaded.append(True)

    monkeypatch.setattr(LLMReplica, "__init__", load)
    monkeypatch.setattr(direct, "scales_to_zero", lambda: False)

    class Direct(direct.DirectFrontend):
        def __del__(self) -> None:
            pass

    d = object.__new__(Direct)
    with pytest.raises((FileNotFoundError, ValueError)):
        asyncio.run(direct.DirectFrontend.__init__(d, {}, {"model_name": "m", "max_body_bytes": 1 << 20,
                                                           "api_key_file": str(tmp_path / "none")}, 4, 4))
    assert loaded == []


def test_a_long_prompt_is_tokenized_off_the_replicas_event_loop_and_a_caller_gone_meanwhile_aborts_it() -> None:
    """A prompt of more than LONG_TEXT_CHARS characters (its text, messages, tools, documents) is handed to the
    engine on a thread of its own (rendering and tokenizing it on the loop stalled every stream of the replica: a
    second a megabyte); a caller that went away meanwhile has its request aborted once the engine holds it. The long
    text's ids are the tokenizer's own."""
    import threading

    from engine.default_model import build_tokenizer
    from engine.inputs import LONG_TEXT_CHARS, prompt_encoder
    from deployments.replica import LLMReplica, _text_chars

    tok = build_tokenizer(512)
    text = "hello world, " * (LONG_TEXT_CHARS // 10)
    assert prompt_encoder(tok)(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    long_chat = GenerateRequest("c", messages=(ChatTurn("user", "x" * LONG_TEXT_CHARS),),
                                options=P.PromptOptions(tools="[]"))
    assert _text_chars(long_chat) > LONG_TEXT_CHARS >= _text_chars(GenerateRequest("s", prompt="short"))
    threads, aborted = [], []
    release = threading.Event()

    class Engine:
        def generate(self, req):
            threads.append(threading.get_ident())
            release.wait(5)
            return "stream"

        def abort(self, rid):
            aborted.append(rid)

    r = object.__new__(LLMReplica)
    r.engine = Engine()

    async def main() -> None:
        release.set()
        assert await r._generate_off(long_chat) == "stream" and threads[-1] != threading.get_ident()
        release.clear()
        task = asyncio.create_task(r._generate_off(long_chat))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(100):
            if aborted:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert aborted == ["c"]
