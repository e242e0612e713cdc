"""The trained default model over HTTP, deployed exactly as `serve run deployments:app` does (no arguments):
the official `openai` client gets "Paris" back for the capital of France, and chat ends with `stop`; it asks for `n`
choices under penalties."""
from __future__ import annotations

import pytest

from tests.serve.conftest import SideApp, side_app


def _default_app(_: object):
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as serve_builds

    import deployments

    return serve_builds(deployments.app, {})


# (tests/serve/conftest.py: before the package's other tests, with the cores to itself: /health's latency under a
# burst)
RUNS_ALONE = True
SIDE_APP = SideApp("kairos-default-app", "/default", _default_app)


@pytest.fixture(scope="module")
def default_url(serve_app: dict):
    from ray import serve

    try:
        yield side_app(serve_app, SIDE_APP)
    finally:
        serve.delete(SIDE_APP.name, _blocking=False)  # its replicas drain while the next tests run


# a question the default model answers in bf16 as in fp32 (the dtype on CPUs with native bf16): "What is the capital
# of France?" is one its fp32 logits answer by a hair, and bf16's rounding turns ("L'Étoile, ...") on some CPUs
QUESTION = "Name the capital of France."


def test_openai_client_chat_answers_paris(default_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_url}/v1", api_key="unused", timeout=120)
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == "kairos-default" and "HuggingFaceTB/SmolLM2-135M-Instruct" in ids  # the served name, then aliases
    chat = client.chat.completions.create(
        model="kairos-default", temperature=0, max_completion_tokens=64,
        messages=[{"role": "user", "content": QUESTION}])
    choice = chat.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content
    stream = client.chat.completions.create(
        model="kairos-default", temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": QUESTION}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # n choices and the penalties, as the client sends them (vLLM's own in extra_body)
    two = client.chat.completions.create(
        model="kairos-default", temperature=0.8, seed=1, n=2, max_completion_tokens=8, presence_penalty=0.5,
        frequency_penalty=0.3, extra_body={"repetition_penalty": 1.1, "min_p": 0.05},
        messages=[{"role": "user", "content": "Name a colour."}])
    assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)


async def _dropped_stream(ac, i: int) -> int:
    """Start a long stream, read its first event, hang up."""
    body = {"prompt": f"Tell me a long story, number {i}.", "max_tokens": 256, "stream": True}
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 200:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        return r.status_code


async def _burst_one(ac, i: int) -> tuple[int, str]:
    body = {"prompt": f"Request {i}: write about the sea.", "max_tokens": 64, "ignore_eos": True}
    try:
        r = await ac.post("/v1/completions", json=body)
        return r.status_code, r.headers.get("retry-after", "")
    except Exception as e:  # noqa: BLE001 - counted as a failure below
        return -1, repr(e)


def test_dropped_streams_then_burst_keep_health_fast_with_defaults(default_url: str) -> None:
    """60 client-dropped streams, then 120 concurrent 64-token requests, against the default app: no 5xx,
    every /health under 1 s, the dropped streams' KV freed, and a normal request succeeds right after."""
    import asyncio
    import threading
    import time

    import httpx
    from ray import serve

    health: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=default_url, timeout=5) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                health.append(time.monotonic() - t0 if ok else float("inf"))
                stop.wait(0.2)

    async def scenario() -> tuple[list[int], list[tuple[int, str]]]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=default_url, timeout=300, limits=limits) as ac:
            dropped = await asyncio.gather(*(_dropped_stream(ac, i) for i in range(60)))
            burst = await asyncio.gather(*(_burst_one(ac, i) for i in range(120)))
        return dropped, burst

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    t0 = time.monotonic()
    try:
        dropped, burst = asyncio.run(scenario())
    finally:
        stop.set()
        prober.join(10)
    codes = sorted({c for c, _ in burst})
    print(f"\n[burst] dropped {dropped.count(200)}/60 streams; burst codes {codes} "
          f"({sum(c == 200 for c, _ in burst)} x 200, {sum(c == 429 for c, _ in burst)} x 429) in "
          f"{time.monotonic() - t0:.1f} s; /health max {max(health) * 1000:.0f} ms over {len(health)} probes")
    assert all(c in (200, 429) for c in dropped), dropped
    assert all(c in (200, 429) for c, _ in burst), [b for b in burst if b[0] not in (200, 429)][:5]
    assert all(ra and int(ra) >= 1 for c, ra in burst if c == 429)
    assert health and max(health) < 1.0, sorted(health)[-5:]
    r = httpx.post(f"{default_url}/v1/chat/completions", timeout=60, json={
        "model": "kairos-default", "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
    handle = serve.get_deployment_handle("LLMServer", app_name="kairos-default-app")
    deadline = time.monotonic() + 30
    while True:  # every dropped stream's KV comes back
        st = handle.stats.remote().result(timeout_s=10)
        if st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_running"] == 0, st
