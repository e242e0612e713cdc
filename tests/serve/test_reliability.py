"""Reliability and security over real HTTP: client disconnects at random points, injected engine faults, a killed
LLM replica, API-key auth, prompts kept out of logs, trust_remote_code refusal.

Most tests use the session app (2 replicas). Auth, prompt-logging control, the pre-token fault and the replica
kill use a second application on the same Ray/Serve instance (`kairos-rel` at /rel: 1 LLM replica, API keys
from a file, log_prompts on), a side app deployed with the session app and deleted at the end of this module.
The replica kill runs last.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from core.messages import GenerateRequest
from core.request import FinishReason
from core.sampling import SamplingParams
from tests.serve.conftest import TEST_ARGS, SideApp, replica_stats, side_app, wait_idle

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
REL_APP, REL_PREFIX = "kairos-rel", "/rel"
KEYS = ("kairos-test-key-1", "kairos-test-key-2")


# ------------------------------------------------------------------------------------------------ helpers
def sse_data(lines) -> list[str]:
    return [ln[6:] for ln in lines if ln.startswith("data: ")]


def arm_fault(handle, replica: str, count: int = 1) -> None:
    """`inject_fault` is a handle-only test hook; calls land on a random replica, only `replica` arms."""
    for _ in range(200):
        if handle.inject_fault.remote(count, replica=replica).result(timeout_s=10) == replica:
            return
    raise AssertionError(f"could not reach replica {replica}")


def serve_actors(app: str) -> dict[str, list[str]]:
    """Named replica actors of `app`, by deployment."""
    import ray

    out: dict[str, list[str]] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"] if isinstance(a, dict) else a
        if name.startswith("SERVE_REPLICA::") and f"::{app}#" in name:
            out.setdefault(name.split("#")[1], []).append(name)
    return out


# ------------------------------------------------------------------------------------------------ second app
def _rel_app(tmp: Path):
    from deployments import build_app

    key_file = tmp / "api_keys"
    key_file.write_text(f"# Kairos test keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    return build_app({**TEST_ARGS, "num_replicas": 1, "topology": "routed", "api_key_file": str(key_file),
                      "allowed_origins": ORIGIN, "log_prompts": True, "health_check_period_s": 1.0,
                      "health_check_timeout_s": 10.0, "tool_call_parser": "auto", "reasoning_parser": "deepseek_r1",
                      "trust_request_chat_template": True, "enable_prompt_tokens_details": True})


# (tests/serve/conftest.py: before the package's other tests, with the cores to itself: kills and hangs, and how
# soon their requests end)
RUNS_ALONE = True
SIDE_APP = SideApp(REL_APP, REL_PREFIX, _rel_app)
ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def rel_app(serve_app: dict):
    from ray import serve

    try:
        yield {"url": side_app(serve_app, SIDE_APP), "auth": {"Authorization": f"Bearer {KEYS[0]}"},
               "handle": serve.get_deployment_handle("LLMServer", app_name=REL_APP)}
    finally:
        serve.delete(REL_APP, _blocking=False)  # its replicas drain while the next tests run


# ------------------------------------------------------------------------------------------------ security
def test_api_key_auth(rel_app: dict) -> None:
    url = rel_app["url"]
    body = {"prompt": "auth", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").json() == {"status": "ok"}  # health stays open for load balancers
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
                        {"Authorization": KEYS[0]}, {"Authorization": f"Bearer {KEYS[0]}x"},
                        {"Authorization": f"Bearer {KEYS[0][:-1]}"}, {"X-Api-Key": KEYS[0]}):
            for method, path, kw in (("POST", CMPL, {"json": body}), ("POST", CHAT, {"json": {
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}), ("GET", "/v1/models", {})):
                r = c.request(method, path, headers=headers, **kw)
                assert r.status_code == 401, (headers, path, r.text)
                err = r.json()["error"]
                assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        # auth comes before reading the body: an unauthenticated 10 MB upload is never parsed, only read and
        # dropped, so that its client gets the 401 (a server that answered and stopped reading left the upload
        # hanging, and a client timed out on its write)
        r = c.post(CMPL, content=b"x" * (10 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for key in KEYS:  # every key in the file works
            r = c.post(CMPL, json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert c.get("/v1/models", headers={"authorization": f"bearer {KEYS[1]}"}).status_code == 200


def test_tool_choice_auto_is_a_400_where_no_tool_call_format_is_known(rel_app: dict) -> None:
    """This app reads replies in the tool-call format its model's chat template shows (tool_call_parser=auto), and
    kairos-tiny's shows none: a request that leaves the choice to the model (tool_choice auto, OpenAI's default with
    tools) is a 400 naming tool_choice, as vLLM's without --enable-auto-tool-choice; a named tool, "required" and
    "none" are served."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"]}}}
    chat = {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 40, "tools": [tool]}
    with httpx.Client(base_url=rel_app["url"], timeout=60, headers=rel_app["auth"]) as c:
        for extra in ({}, {"tool_choice": "auto"}, {"tool_choice": "auto", "stream": True}):
            r = c.post(CHAT, json={**chat, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert "tool_call_parser" in r.json()["error"]["message"]
        for choice in ("none", "required", {"type": "function", "function": {"name": "pick"}}):
            r = c.post(CHAT, json={**chat, "tool_choice": choice})
            assert r.status_code == 200, (choice, r.text)


def test_a_reasoning_models_thinking_is_its_reasoning_content(rel_app: dict) -> None:
    """This app reads chat replies as DeepSeek-R1's (reasoning_parser=deepseek_r1: thinking from the reply's start
    to a </think> that kairos-tiny never writes): the reply is all `reasoning_content` (content null), streamed as
    whole; vLLM's include_reasoning false leaves it out; a reply held to a format (JSON mode) thinks first, and a
    completion is never read. A prompt whose template closed the thinking leaves the reply content."""
    import json

    chat = {"messages": [{"role": "user", "content": "Think"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=rel_app["url"], timeout=60, headers=rel_app["auth"]) as c:
        r = c.post(CHAT, json=chat)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"], message
        text = c.post(CMPL, json={"prompt": "x", "max_tokens": 3}).json()["choices"][0]["text"]
        assert isinstance(text, str)
        r = c.post(CHAT, json={**chat, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert not "".join(d.get("content") or "" for d in deltas)
        hidden = c.post(CHAT, json={**chat, "include_reasoning": False}).json()["choices"][0]["message"]
        assert hidden["content"] is None and not hidden.get("reasoning_content"), hidden
        # held to a format, it thinks first (vLLM's way): JSON only after a </think> this model never writes
        shaped = c.post(CHAT, json={**chat, "response_format": {"type": "json_object"}}).json()["choices"][0]
        assert shaped["message"]["content"] is None and shaped["message"]["reasoning_content"], shaped
        assert shaped["finish_reason"] == "length"
        # a template that closed the thinking (switched it off): the replica says so, and the reply is content
        closed = {**chat, "chat_template": "{{ messages[0]['content'] }}<think>\n\n</think>\n\n"}
        message = c.post(CHAT, json=closed).json()["choices"][0]["message"]
        assert message["content"] and message["reasoning_content"] is None, message


def test_the_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(rel_app: dict) -> None:
    """This app's usages have OpenAI's prompt_tokens_details (enable_prompt_tokens_details, vLLM's flag): a chat sent
    again (one replica) finds all of its prompt's full blocks cached, whole and streamed; a batch of completions sums
    its prompts'; the Responses API's usage says the same as input_tokens_details."""
    import json
    import uuid

    words = " ".join(uuid.uuid4().hex for _ in range(12))
    chat = {"messages": [{"role": "user", "content": words}], "max_tokens": 2}
    with httpx.Client(base_url=rel_app["url"], timeout=60, headers=rel_app["auth"]) as c:
        first = c.post(CHAT, json=chat).json()["usage"]
        again = c.post(CHAT, json=chat).json()["usage"]
        n = again["prompt_tokens"]
        assert first["prompt_tokens_details"]["cached_tokens"] < n - 16 <= again["prompt_tokens_details"][
            "cached_tokens"] < n, (first, again)
        r = c.post(CHAT, json={**chat, "stream": True, "stream_options": {"include_usage": True}})
        usage = [json.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"][-1]["usage"]
        assert usage["prompt_tokens_details"] == again["prompt_tokens_details"], usage
        assert c.post(CMPL, json={"prompt": words, "max_tokens": 2}).status_code == 200  # (its blocks cached)
        both = c.post(CMPL, json={"prompt": [words, words], "max_tokens": 2}).json()["usage"]
        assert both["prompt_tokens_details"]["cached_tokens"] >= 2 * 64, both
        resp = c.post("/v1/responses", json={"input": words, "max_output_tokens": 2}).json()["usage"]
        assert resp["input_tokens_details"]["cached_tokens"] >= 64, resp


def test_a_trusted_request_chat_template_renders_the_prompt(rel_app: dict) -> None:
    """This app trusts a request's own chat_template (vLLM's --trust-request-chat-template): the prompt is that
    template's (its token count, as /tokenize says), and one the sandbox refuses is a 400."""
    msgs = [{"role": "user", "content": "a b c d e f"}]
    own = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with httpx.Client(base_url=rel_app["url"], timeout=60, headers=rel_app["auth"]) as c:
        r = c.post(CHAT, json={"messages": msgs, "max_tokens": 1, "chat_template": own})
        assert r.status_code == 200, r.text
        plain = c.post("/tokenize", json={"prompt": "a b c d e f", "add_special_tokens": False}).json()["count"]
        assert r.json()["usage"]["prompt_tokens"] == plain
        assert c.post("/tokenize", json={"messages": msgs, "chat_template": own}).json()["count"] == plain
        r = c.post(CHAT, json={"messages": msgs, "max_tokens": 1,
                               "chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
        assert r.status_code == 400 and "cannot render" in r.json()["error"]["message"], r.text


def test_cors_preflight_comes_before_auth_and_only_allowed_origins_may_read(rel_app: dict) -> None:
    """A browser's preflight carries no credentials: it is answered before auth (for `allowed_origins` only); a
    response is readable by an allowed origin and by no other."""
    with httpx.Client(base_url=rel_app["url"], timeout=60) as c:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        pre = c.options(CMPL, headers={"Origin": ORIGIN, **ask})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert c.options(CMPL, headers={"Origin": "https://other.example", **ask}).status_code == 400
        body = {"prompt": "cors", "max_tokens": 2}
        r = c.post(CMPL, json=body, headers={**rel_app["auth"], "Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = c.post(CMPL, json=body, headers={**rel_app["auth"], "Origin": "https://other.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert c.post(CMPL, json=body, headers={"Origin": ORIGIN}).status_code == 401


def _log_files() -> list[Path]:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]


def _grep(marker: str) -> list[str]:
    needle = marker.encode()
    return [str(p) for p in _log_files() if needle in p.read_bytes()]


def test_prompts_are_not_logged(base_url: str, rel_app: dict) -> None:
    secret = f"KAIROS-PRIVATE-{uuid.uuid4().hex}"
    with httpx.Client(base_url=base_url, timeout=60) as c:
        assert c.post(CMPL, json={"prompt": f"{secret} hello", "max_tokens": 3}).status_code == 200
        with c.stream("POST", CMPL, json={"prompt": f"{secret} stream", "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200 and sse_data(r.iter_lines())[-1] == "[DONE]"
        msgs = [{"role": "system", "content": secret}, {"role": "user", "content": f"say {secret}"}]
        assert c.post(CHAT, json={"messages": msgs, "max_tokens": 3}).status_code == 200
        # error paths must not echo the prompt into logs either
        assert c.post(CMPL, json={"prompt": secret, "max_tokens": 0}).status_code == 400
        assert c.post(CMPL, json={"prompt": secret, "max_tokens": 2},
                      headers={"x-slo-ttft-ms": "0.001"}).status_code == 400  # slo_unattainable
        assert c.post(CMPL, json={"prompt": (secret + " ") * 400, "max_tokens": 2}).status_code == 400
    # positive control: the app with log_prompts=True does log it, so we are grepping the right files
    control = f"KAIROS-LOGGED-{uuid.uuid4().hex}"
    r = httpx.post(rel_app["url"] + CMPL, json={"prompt": control, "max_tokens": 2}, headers=rel_app["auth"],
                   timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 20
    while not _grep(control) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _grep(control), "log_prompts=True did not log the prompt: wrong log directory?"
    assert any("/serve/" in f for f in _grep(control))
    assert _grep(secret) == [], "a prompt was written to the logs with log_prompts=False"


# ------------------------------------------------------------------------------------------------ disconnects
async def _drop_client(ac: httpx.AsyncClient, k: int, i: int) -> dict:
    """Stream a long completion and hang up: k < 0 before the first byte, k == 0 right after the headers,
    k > 0 after k SSE events."""
    info = {"k": k, "headers": False, "finished": False, "status": None}
    req = {"prompt": f"client {i}: tell me a very long story", "max_tokens": 400, "ignore_eos": True,
           "stream": True}

    async def go() -> None:
        async with ac.stream("POST", CMPL, json=req) as r:
            info["headers"], info["status"] = True, r.status_code
            if k == 0:
                return
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    info["finished"] |= '"finish_reason":"length"' in line or line == "data: [DONE]"
                    if n >= k:
                        return

    if k < 0:
        try:
            await asyncio.wait_for(go(), timeout=random.uniform(0.0, 0.15))
        except asyncio.TimeoutError:
            pass
    else:
        await asyncio.wait_for(go(), timeout=120)
    return info


def test_100_clients_disconnect_at_random_points(base_url: str, llm_handle) -> None:
    before = sum(s["aborted"] for s in replica_stats(llm_handle).values())
    rng = random.Random(1234)
    plan = [rng.choice([-1, -1, 0]) if rng.random() < 0.3 else rng.randint(1, 40) for _ in range(100)]
    random.seed(99)

    async def main() -> list[dict]:
        out: list[dict] = []
        limits = httpx.Limits(max_connections=40, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as ac:
            for b in range(0, len(plan), 20):  # batches keep the 2-core box responsive
                out += await asyncio.gather(*(_drop_client(ac, k, b + j) for j, k in enumerate(plan[b:b + 20])))
        return out

    t0 = time.monotonic()
    infos = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert all(i["status"] in (None, 200) for i in infos), [i for i in infos if i["status"] not in (None, 200)]
    stats = wait_idle(llm_handle, want=2, timeout_s=30)
    for rid, s in stats.items():
        assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["inflight"] == 0, s
        assert s["kv_blocks_free"] == s["kv_blocks_total"], f"replica {rid} leaked KV blocks: {s}"
    aborted = sum(s["aborted"] for s in stats.values()) - before
    must_abort = sum(1 for i in infos if i["headers"] and not i["finished"])
    early = sum(1 for i in infos if not i["headers"])
    print(f"\n[disconnects] {len(infos)} clients in {elapsed:.1f}s: {early} dropped before the first byte, "
          f"{must_abort} after headers; replicas aborted {aborted}")
    assert must_abort <= aborted <= len(infos)
    assert early >= 5 and must_abort >= 50


# ------------------------------------------------------------------------------------------------ faults
def test_injected_fault_mid_stream_ends_with_error_event(base_url: str, llm_handle) -> None:
    req = {"prompt": "fault injection", "max_tokens": 900, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base_url, timeout=60) as c:
        t0 = time.monotonic()
        with c.stream("POST", CMPL, json=req) as r:
            assert r.status_code == 200
            replica = r.headers["x-kairos-replica"]
            lines = r.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        break
            arm_fault(llm_handle, replica)
            events += sse_data(lines)
        elapsed = time.monotonic() - t0
        assert events[-1] == "[DONE]", events[-3:]
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert len(errors) == 1 and errors[0]["type"] == "server_error", events[-3:]
        assert "injected fault" in errors[0]["message"]
        assert not any('"finish_reason":"length"' in e for e in events), "the stream was not interrupted"
        assert elapsed < 30
        # the replica keeps serving: a request the router must send there (it passes over the replicas a request
        # avoids), its tokens and the replica that served it read from the handle's stream
        (other,) = [r for r in replica_stats(llm_handle, want=2) if r != replica]
        again = GenerateRequest(f"after-fault-{uuid.uuid4().hex[:8]}", prompt="after the fault",
                                params=SamplingParams(max_tokens=16, ignore_eos=True), avoid_replicas=(other,))
        outs = list(llm_handle.options(stream=True).generate.remote(again))
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH, outs[-1]
        assert sum(len(o.token_ids) for o in outs) == 16
        assert [o.served_by.replica for o in outs if o.served_by] == [replica]
    assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in wait_idle(llm_handle, 2).values())


def test_injected_fault_before_first_token_is_500_json(rel_app: dict) -> None:
    handle = rel_app["handle"]
    (replica,) = replica_stats(handle, want=1)
    with httpx.Client(base_url=rel_app["url"], headers=rel_app["auth"], timeout=60) as c:
        for stream in (False, True):
            arm_fault(handle, replica)
            r = c.post(CMPL, json={"prompt": "doomed", "max_tokens": 8, "stream": stream})
            assert r.status_code == 500, r.text
            assert r.headers["content-type"].startswith("application/json")
            err = r.json()["error"]
            assert err["type"] == "server_error" and "injected fault" in err["message"]
        # non-streaming request failing mid-generation
        arm_fault(handle, replica)  # consumed by the first step of the next request (its prefill)
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 8})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        r = c.post(CMPL, json={"prompt": "recovered", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert c.get("/health").status_code == 200
    (st,) = wait_idle(handle, want=1, timeout_s=10).values()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["inflight"] == 0, st


# ------------------------------------------------------------------------------------------------ hung ingress
def test_a_hung_ingress_stalls_only_its_own_streams(rel_app: dict) -> None:
    """An Ingress replica that stops (a pause, a network partition: alive, not reading) must not stall the LLM
    replica it streams from. Over Ray actor calls (`llm_transport=ray`) a stream that ends waits on the replica's
    event loop until its caller acknowledges every item, so the replica answered nothing else while the caller was
    stopped; over gRPC (the default) only that caller's own streams wait."""
    import os
    import signal

    import ray
    from ray._private import state as ray_state

    url, auth, handle = rel_app["url"], rel_app["auth"], rel_app["handle"]
    (ingress,) = serve_actors(REL_APP)["Ingress"]
    actor_id = ray.get_actor(ingress, namespace="serve")._actor_id.hex()
    pid = int(ray_state.actors(actor_id)["Pid"])
    handle.stats.remote().result(timeout_s=10)
    req = {"prompt": "ends while its ingress is stopped", "max_tokens": 24, "ignore_eos": True, "stream": True}
    started, lines = [False], []

    def stream() -> None:
        with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
            with c.stream("POST", CMPL, json=req) as r:
                for line in r.iter_lines():
                    started[0] = started[0] or line.startswith("data: ")
                    lines.append(line)

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        deadline = time.monotonic() + 30
        while not started[0] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert started[0], "the stream did not start"
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(3.0)  # the reply ends in the replica meanwhile (24 tokens)
            t0 = time.monotonic()
            stats = handle.stats.remote().result(timeout_s=8)  # another caller (this process) is served
            answered_s = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        done.result(timeout=60)
    assert answered_s < 8 and stats["inflight"] == 0, (answered_s, stats)
    chunks = sse_data(lines)  # the stopped caller's stream ends whole
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length", chunks[-2:]


# ------------------------------------------------------------------------------------------------ ingress kill
def test_requests_of_a_killed_ingress_are_aborted_in_their_replica(rel_app: dict) -> None:
    """Nothing cancels an LLM replica's generator when the Ingress replica that called it dies: the replica asks Ray
    about its requests' callers every second (`LLMReplica._callers_loop`) and aborts those of a dead one, so their KV
    is freed instead of held to the end of replies no one reads. Serve replaces the Ingress; the app serves again."""
    import ray

    url, auth, handle = rel_app["url"], rel_app["auth"], rel_app["handle"]
    actors = serve_actors(REL_APP)
    aborted = handle.stats.remote().result(timeout_s=10)["aborted"]
    req = {"prompt": "in flight when the ingress dies", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    started = [False, False]

    def stream_one(i: int) -> None:
        try:
            with httpx.Client(base_url=url, headers=auth, timeout=httpx.Timeout(60, read=30)) as c:
                with c.stream("POST", CMPL, json=req) as r:
                    for line in r.iter_lines():
                        started[i] = started[i] or line.startswith("data: ")
        except httpx.HTTPError:
            pass  # cut off with its ingress

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(stream_one, i) for i in range(2)]
        deadline = time.monotonic() + 30
        while not all(started) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(started), "streams did not start"
        # (their next step holds 4 s: they are still running when the replica finds their caller gone, however
        # slowly the kill and that check are scheduled)
        handle.inject_fault.remote(hang_s=4.0).result(timeout_s=10)
        ray.kill(ray.get_actor(actors["Ingress"][0], namespace="serve"), no_restart=False)
        for f in futures:
            f.result(timeout=60)
    st = wait_idle(handle, want=1, timeout_s=30)
    (st,) = st.values()
    assert st["inflight"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"], st
    assert st["aborted"] == aborted + 2, (aborted, st)  # aborted, not generated to their end
    t0, served = time.monotonic(), False  # the replacement Ingress serves (a request may hang while it starts)
    with httpx.Client(base_url=url, headers=auth, timeout=10) as c:
        while not served and time.monotonic() - t0 < 90:
            try:
                r = c.post(CMPL, json={"prompt": "after the ingress", "max_tokens": 3, "ignore_eos": True})
            except httpx.HTTPError:
                time.sleep(0.25)
                continue
            served = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            if not served:
                assert r.status_code in (500, 502, 503, 504), r.text  # while no Ingress is up: a clean error
                time.sleep(0.25)
    assert served, "no replacement Ingress within 90 s"


# ------------------------------------------------------------------------------------------------ replica kill
def test_killed_replica_fails_inflight_cleanly_and_is_replaced(rel_app: dict) -> None:
    import ray

    url, auth, handle = rel_app["url"], rel_app["auth"], rel_app["handle"]
    actors = serve_actors(REL_APP)
    assert len(actors.get("LLMServer", [])) == 1 and len(actors.get("Ingress", [])) == 1, actors
    (old_replica,) = replica_stats(handle, want=1)
    req = {"prompt": "in flight when the replica dies", "max_tokens": 900, "ignore_eos": True}
    started = [False] * 4

    def stream_one(i: int) -> dict:
        t0 = time.monotonic()
        with httpx.Client(base_url=url, headers=auth, timeout=httpx.Timeout(60, read=30)) as c:
            with c.stream("POST", CMPL, json={**req, "stream": True}) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started[i] = True
                return {"status": r.status_code, "events": events, "s": time.monotonic() - t0,
                        "end": time.monotonic()}

    def plain_one() -> dict:
        t0 = time.monotonic()
        try:
            r = httpx.post(url + CMPL, json=req, headers=auth, timeout=60)
            return {"status": r.status_code, "body": r.text, "s": time.monotonic() - t0, "end": time.monotonic()}
        except httpx.HTTPError as e:
            return {"status": None, "body": repr(e), "s": time.monotonic() - t0, "end": time.monotonic()}

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream_one, i) for i in range(4)]
        plains = [pool.submit(plain_one) for _ in range(2)]
        deadline = time.monotonic() + 30
        while not all(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(started), "streams did not start"
        # the plain requests too are in the replica (on a busy box one sent late reached only the replacement: a 200)
        while (inflight := handle.stats.remote().result(timeout_s=10)["inflight"]) < 6 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inflight == 6, f"{inflight} of the 6 requests in the replica"
        handle.inject_fault.remote(hang_s=60.0).result(timeout_s=10)  # (none of them ends before the kill)
        t_kill = time.monotonic()
        ray.kill(ray.get_actor(actors["LLMServer"][0], namespace="serve"), no_restart=False)
        stream_res = [f.result(timeout=90) for f in streams]
        plain_res = [f.result(timeout=90) for f in plains]
    for res in stream_res:  # SSE error event, then [DONE]; no hang
        assert res["status"] == 200 and res["events"][-1] == "[DONE]", res["events"][-3:]
        last = json.loads(res["events"][-2])
        assert last["error"]["type"] == "server_error" and "generation failed" in last["error"]["message"], last
        assert res["s"] < 60
    for res in plain_res:  # a JSON 503 that says what happened, no hang
        assert res["status"] == 503, res
        err = json.loads(res["body"])["error"]
        assert err["code"] == "replica_failed" and "replica serving this request died" in err["message"], err
    failed_within = max(r["end"] for r in stream_res + plain_res) - t_kill
    print(f"\n[kill] every in-flight request failed within {failed_within:.1f}s of the kill: "
          f"{[json.loads(r['body'])['error']['message'] for r in plain_res]}")

    # new requests succeed once Serve has replaced the replica; the ingress survives
    t0, new_replica, tries, health = time.monotonic(), None, 0, []
    with httpx.Client(base_url=url, headers=auth, timeout=15) as c:
        while time.monotonic() - t0 < 90:
            tries += 1
            try:  # what a load balancer's probe sees meanwhile (printed: how soon is a matter of timing)
                h = c.get("/health", timeout=5)
                health.append(f"{h.status_code} {h.json().get('reason', '')}".strip())
            except (httpx.HTTPError, ValueError) as e:
                health.append(type(e).__name__)
            try:
                r = c.post(CMPL, json={"prompt": "after the restart", "max_tokens": 4, "ignore_eos": True})
            except httpx.HTTPError:
                time.sleep(0.25)
                continue
            if r.status_code == 200:
                new_replica = r.headers["x-kairos-replica"]
                assert r.json()["usage"]["completion_tokens"] == 4
                break
            assert r.status_code in (500, 502, 503, 504), r.text  # while no replica is up: a clean error
            assert r.json()["error"]["message"]
            time.sleep(0.25)
    print(f"[kill] replacement served after {time.monotonic() - t0:.1f}s ({tries} tries); /health meanwhile: "
          f"{sorted(set(health))}")
    assert new_replica is not None, "no replacement replica within 90 s"
    assert new_replica != old_replica
    after = serve_actors(REL_APP)
    assert after["Ingress"] == actors["Ingress"], "the ingress replica was restarted"
    assert after["LLMServer"] != actors["LLMServer"]


# ------------------------------------------------------------------------------------------------ remote code
def test_checkpoint_with_custom_code_is_refused(tmp_path: Path) -> None:
    from deployments.args import AppArgs
    from engine.config import EngineConfig
    from engine.loader import load_model

    assert EngineConfig().trust_remote_code is False and AppArgs().engine_config().trust_remote_code is False
    marker = tmp_path / "EXECUTED"
    repo = tmp_path / "custom"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({
        "model_type": "kairos_evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}}))
    (repo / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    with pytest.raises(ValueError) as e:
        load_model(str(repo), trust_remote_code=False)
    assert "custom code" in str(e.value) and str(repo) in str(e.value)
    assert not marker.exists()


def test_known_family_with_auto_map_is_refused_without_running_it(tmp_path: Path) -> None:
    from engine.loader import load_model
    from engine.testing import build_tiny_checkpoint

    repo = build_tiny_checkpoint("llama", tmp_path / "llama")
    marker = tmp_path / "EXECUTED"
    cfg = json.loads((repo / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "modeling_evil.Cfg", "AutoModelForCausalLM": "modeling_evil.Model"}
    (repo / "config.json").write_text(json.dumps(cfg))
    (repo / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_model(str(repo), dtype="float32", device="cpu")
    assert not marker.exists()
