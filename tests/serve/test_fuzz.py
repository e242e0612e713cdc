"""Hostile input over HTTP, part 2 (part 1: test_errors.py): the cases test_errors.py lacks, the whole bad-input
matrix run *while* well-formed streams are being generated (they must finish with their exact token count), and
property-based fuzzing of both generation endpoints from the app's own OpenAPI schema (schemathesis strategies,
positive and negative generation modes; bounded by KAIROS_FUZZ_EXAMPLES, default 50 per endpoint and mode).

Unknown-field policy (documented in deployments/protocol.py): unknown request fields are *ignored* (200), as
OpenAI clients send fields such as `user` or `metadata`; fields we cannot honour with a non-default value are
rejected with 400 (a chat's echo or best_of, response_format, ...).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import httpx
import pytest

from tests.serve.conftest import MAX_BODY
from tests.serve.test_errors import BAD_BODIES, CHAT, CMPL, OK_CHAT, OK_CMPL, assert_error

TEN_MB = 10 * 1024 * 1024
FUZZ_EXAMPLES = int(os.environ.get("KAIROS_FUZZ_EXAMPLES", "50"))
FUZZ_MAX_TOKENS = 16  # generated bodies may ask for 10**9 tokens: cap the work, not the validation
FUZZ_MAX_CHOICES = 4  # ... and for 256 choices (`n`, `best_of`)
RESP = "/v1/responses"


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def _raw(client: httpx.Client, path: str, body: bytes, **headers: str) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json", **headers})


# ----------------------------------------------------------------------------------------------- new bad inputs
# (name, path, body: dict (sent as JSON) | bytes (sent raw), status, error code or None)
NEW_BAD: list[tuple[str, str, Any, int, str | None]] = [
    # non-UTF-8 / invalid Unicode (test_errors.py covers invalid bytes inside a completion prompt only)
    ("latin1_chat_body", CHAT, '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"), 400,
     "invalid_json"),
    ("overlong_utf8", CMPL, b'{"prompt": "\xc0\xaf", "max_tokens": 2}', 400, "invalid_json"),
    ("truncated_utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xe2\x82"}]}', 400, "invalid_json"),
    ("lone_surrogate_prompt", CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "invalid_unicode"),
    ("lone_surrogate_chat", CHAT, b'{"messages": [{"role": "user", "content": "\\uDC00"}], "max_tokens": 2}', 400,
     "invalid_unicode"),
    ("lone_surrogate_stop", CMPL, b'{"prompt": "hi", "stop": ["\\udbff"], "max_tokens": 2}', 400, "invalid_unicode"),
    ("nul_byte_raw", CMPL, b'{"prompt": "a\x00b", "max_tokens": 2}', 400, "invalid_json"),
    # sampling values that used to fail the whole engine step (every co-batched request) instead of one request
    ("stop_token_id_negative", CMPL, {**OK_CMPL, "min_tokens": 1, "stop_token_ids": [-1000000000]}, 400, None),
    ("stop_token_id_out_of_vocab", CMPL, {**OK_CMPL, "min_tokens": 1, "stop_token_ids": [10**9]}, 400, None),
    ("too_many_stop_token_ids", CMPL, {**OK_CMPL, "stop_token_ids": list(range(2000))}, 400, None),
    # more wrong types / empties
    ("empty_prompt", CMPL, {"prompt": "", "max_tokens": 2}, 400, None),
    ("empty_token_list", CMPL, {"prompt": [], "max_tokens": 2}, 400, None),
    ("prompt_null", CMPL, {"prompt": None}, 400, None),
    ("stream_not_bool", CMPL, {**OK_CMPL, "stream": "yes please"}, 400, None),
    ("max_tokens_float", CMPL, {**OK_CMPL, "max_tokens": 2.5}, 400, None),
    ("max_tokens_list", CHAT, {**OK_CHAT, "max_tokens": [True]}, 400, None),
    ("max_completion_tokens_zero", CHAT, {**OK_CHAT, "max_completion_tokens": 0}, 400, None),
    ("message_not_object", CHAT, {"messages": ["hi"]}, 400, None),
    ("content_number", CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, None),
    ("body_string", CHAT, b'"just a string"', 400, None),
    ("body_null", CMPL, b"null", 400, None),
    ("nan_literal", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("temperature_inf", CMPL, b'{"prompt": "hi", "temperature": Infinity}', 400, None),
    ("body_slo_absurd", CHAT, {**OK_CHAT, "slo_tpot_ms": 1e300}, 400, "invalid_slo"),
    ("body_slo_string", CMPL, {**OK_CMPL, "slo_ttft_ms": "soon"}, 400, None),
]


@pytest.mark.parametrize("path,body,status,code", [c[1:] for c in NEW_BAD], ids=[c[0] for c in NEW_BAD])
def test_new_bad_bodies(client: httpx.Client, path: str, body: Any, status: int, code: str | None) -> None:
    r = _raw(client, path, body) if isinstance(body, bytes) else client.post(path, json=body)
    err = assert_error(r, status)
    if code is not None:
        assert err["code"] == code, err


@pytest.mark.parametrize("value", [b"\xff\xfe", "\u00e9".encode("latin-1"), b"12\x80"])
def test_non_utf8_slo_header(client: httpx.Client, value: bytes) -> None:
    r = client.post(CMPL, json=OK_CMPL, headers=[(b"x-slo-ttft-ms", value)])
    err = assert_error(r, 400)
    assert err["code"] == "invalid_slo"


def test_ten_megabyte_prompt_is_413_before_tokenizing(client: httpx.Client, llm_handle) -> None:
    from tests.serve.conftest import replica_stats

    steps = {k: v["steps"] for k, v in replica_stats(llm_handle).items()}
    prompt = "a" * TEN_MB
    t0 = time.monotonic()
    err = assert_error(client.post(CMPL, json={"prompt": prompt, "max_tokens": 2}), 413)  # with content-length
    assert err["code"] == "body_too_large" and str(MAX_BODY) in err["message"]

    def chunks():  # chunked transfer (no content-length): the cap applies while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(TEN_MB // 65536):
            yield b"b" * 65536
        yield b'"}]}'

    assert_error(_raw(client, CHAT, chunks()), 413)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"413 took {elapsed:.1f}s"
    after = {k: v["steps"] for k, v in replica_stats(llm_handle).items()}
    assert after == steps  # nothing reached an engine (no tokenizing, no model step)


def test_unknown_fields_are_ignored(client: httpx.Client) -> None:
    extra = {"user": "u-1", "frobnicate": [1, {"x": None}], "metadata": {"a": "b"}, "logit_bias": None}
    r = client.post(CMPL, json={**OK_CMPL, **extra, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == OK_CMPL["max_tokens"]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
             "weird": 1}]
    r = client.post(CHAT, json={"messages": msgs, "max_tokens": 2, "parallel_tool_calls": False, **extra})
    assert r.status_code == 200, r.text
    r = client.post(CMPL, json={**OK_CMPL, "stream": True, "stream_options": {"include_usage": True, "x": 1}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_huge_max_tokens_is_refused_naming_the_context_window(client: httpx.Client) -> None:
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [5] * (limit - 6)
    for mt in (10**12, 2**63 + 1):  # as vLLM: a 400 naming the limit, not a reply clamped to the window
        err = assert_error(client.post(CMPL, json={"prompt": prompt, "max_tokens": mt, "ignore_eos": True}), 400)
        assert err["code"] == "context_length_exceeded" and f"({mt} > {limit} - {limit - 6})" in err["message"]
    r = client.post(CMPL, json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True})  # what the window leaves
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-6])
def test_tiny_temperature_is_greedy_not_nan(client: httpx.Client, temperature: float) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}
    r = client.post(CMPL, json={**body, "temperature": temperature})
    assert r.status_code == 200, r.text
    greedy = client.post(CMPL, json={**body, "temperature": 0}).json()
    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


# ---------------------------------------------------------------------- the whole matrix vs. concurrent streams
SLO_HEADER_CASES = [("x-slo-ttft-ms", "-5"), ("x-slo-ttft-ms", "0"), ("x-slo-ttft-ms", "fast"),
                    ("x-slo-ttft-ms", "1e308"), ("x-slo-tpot-ms", "nan"), ("x-slo-output-len", "-3"),
                    ("x-slo-output-len", "99999999999")]


async def _well_formed_stream(ac: httpx.AsyncClient, n: int, out: dict) -> None:
    req = {"prompt": "A long and well-formed story:", "max_tokens": n, "ignore_eos": True, "stream": True,
           "temperature": 0.7, "stream_options": {"include_usage": True}}
    events: list[str] = []
    async with ac.stream("POST", CMPL, json=req) as r:
        out["status"] = r.status_code
        out["replica"] = r.headers.get("x-kairos-replica")
        out["started"].set()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out["done_at"] = time.monotonic()
    out["events"] = events


async def _matrix(ac: httpx.AsyncClient, limit: int) -> list[tuple[str, int, str]]:
    """Every bad input we know, 4 at a time; returns (name, status, body) per request."""
    calls: list[tuple[str, Any]] = []
    for name, path, body, *_ in BAD_BODIES + [(c[0], c[1], c[2]) for c in NEW_BAD]:
        if isinstance(body, bytes):
            calls.append((name, dict(url=path, content=body, headers={"content-type": "application/json"})))
        else:
            calls.append((name, dict(url=path, json=body)))
    for h, v in SLO_HEADER_CASES:
        calls.append((f"slo:{h}={v}", dict(url=CMPL, json=OK_CMPL, headers={h: v})))
    calls += [
        ("over_context", dict(url=CMPL, json={"prompt": [5] * (limit + 10), "max_tokens": 2})),
        ("ten_mb", dict(url=CMPL, json={"prompt": "z" * TEN_MB})),
        ("huge_max_tokens", dict(url=CMPL, json={"prompt": [7] * (limit - 3), "max_tokens": 10**12})),
        ("tiny_temperature", dict(url=CHAT, json={**OK_CHAT, "temperature": 1e-45, "max_tokens": 3})),
        ("unknown_fields", dict(url=CMPL, json={**OK_CMPL, "zzz": {"deep": [1, 2]}})),
        ("unattainable_slo", dict(url=CMPL, json=OK_CMPL, headers={"x-slo-ttft-ms": "0.001"})),
    ]
    sem = asyncio.Semaphore(4)
    results: list[tuple[str, int, str]] = []

    async def one(name: str, kw: dict) -> None:
        async with sem:
            r = await ac.request("POST", **kw)
            results.append((name, r.status_code, r.text))  # whole: a long JSON error cut short is not JSON

    await asyncio.gather(*(one(n, kw) for n, kw in calls))
    return results


def test_bad_input_matrix_does_not_hurt_concurrent_streams(base_url: str, client: httpx.Client) -> None:
    """Long well-formed streams (one per replica at the start, so that bad requests share engine steps with them,
    and one after another through the whole matrix) run while every bad input is thrown at the server; they must
    end normally with exactly N tokens."""
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    n = 900

    async def main() -> tuple[list[dict], list[tuple[str, int, str]], float]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as ac:
            streams: list[dict] = []
            tasks = []
            for _ in range(6):  # the router spreads by load: 2-4 streams cover both replicas
                st: dict = {"started": asyncio.Event()}
                streams.append(st)
                tasks.append(asyncio.create_task(_well_formed_stream(ac, n, st)))
                await asyncio.wait_for(st["started"].wait(), 60)
                if len({s.get("replica") for s in streams}) >= 2:
                    break
                # each ingress replica's router counts only its own calls between the replicas' routing-stats
                # reports (every second): the next stream goes after one has landed
                await asyncio.sleep(1.1)
            ended = asyncio.Event()

            async def relay() -> None:  # one more stream whenever its last ended, until the matrix has: one runs
                while not ended.is_set():  # through it, whatever the matrix's and the replies' times
                    st = {"started": asyncio.Event()}
                    streams.append(st)
                    await _well_formed_stream(ac, n, st)

            tasks.append(asyncio.create_task(relay()))
            matrix_start = time.monotonic()
            results = await _matrix(ac, limit)
            matrix_done = time.monotonic()
            ended.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 180)
            return streams, results, (matrix_start, matrix_done)

    streams, results, (matrix_start, matrix_done) = asyncio.run(main())
    bad = [(name, status, text) for name, status, text in results
           if status >= 500 or (status != 200 and not _is_json_error(text))]
    assert not bad, bad
    assert len({s["replica"] for s in streams}) == 2, "the well-formed streams did not cover both replicas"
    # a stream outlived the matrix (the relay's last); the first ones, started while the router looked for the
    # other replica, may end before the matrix does: every one is checked
    assert max(s["done_at"] for s in streams) > matrix_done, "no stream outlived the matrix"
    for s in streams:
        assert s["status"] == 200
        events = s["events"]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
        assert chunks[-1]["usage"]["completion_tokens"] == n
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def _is_json_error(text: str) -> bool:
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


# ---------------------------------------------------------------------------------------- property-based fuzzing
def _check_response(r: httpx.Response, body: Any) -> None:
    """No 5xx; a JSON error, or a valid completion (JSON or SSE)."""
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    ctype = r.headers.get("content-type", "")
    if r.status_code != 200:
        assert ctype.startswith("application/json"), (r.status_code, ctype, r.text[:300])
        assert _is_json_error(r.text), r.text[:300]
        return
    if ctype.startswith("text/event-stream") and r.text.startswith("event: "):  # the Responses API's events
        events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed", events[-2:]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        return
    if ctype.startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), chunks[-2:]
        return
    out = r.json()
    if out.get("object") == "response":
        assert out["status"] in ("completed", "incomplete") and out["usage"]["total_tokens"] == \
            out["usage"]["input_tokens"] + out["usage"]["output_tokens"], out
        return
    assert out["object"] in ("text_completion", "chat.completion"), out
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), out
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


def _bounded(body: Any, path: str) -> Any:
    """Cap the *work* a generated body asks for (tokens to generate); validation-relevant shapes are kept."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for k in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        v = body.get(k)  # JSON Schema integers include 5012.0; pydantic (lax) also takes "5012"
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > FUZZ_MAX_TOKENS:
            body[k] = FUZZ_MAX_TOKENS
    if path == CHAT and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = FUZZ_MAX_TOKENS  # the chat default fills the context window
    if path == RESP and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = FUZZ_MAX_TOKENS  # (as a chat's)
    for k in ("n", "best_of"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > FUZZ_MAX_CHOICES:
            body[k] = FUZZ_MAX_CHOICES  # each choice is a request of its own
    if isinstance(body.get("model"), str):
        body["model"] = "kairos-tiny"  # a random name is a 404 (test_errors covers it): reach the engine
    return body


def _headers(case_headers: dict | None) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in (case_headers or {}).items():
        key = str(k).encode("utf-8", "surrogatepass")
        if not key or any(c in key for c in b" \t\r\n:\x00") or key.lower() in (b"content-length", b"host",
                                                                               b"transfer-encoding"):
            continue  # not a sendable header name (a client-side error, not a server test)
        val = str(v).encode("utf-8", "surrogatepass").replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b"")
        out.append((key, val))
    return out


@pytest.fixture(scope="module")
def openapi_schema(base_url: str, client: httpx.Client):
    schemathesis = pytest.importorskip("schemathesis")
    spec = client.get("/openapi.json").json()
    for path in (CMPL, CHAT, RESP):  # the generation routes document their JSON body and SLO headers
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["properties"], op
        assert {p["name"] for p in op["parameters"]} >= {"x-slo-ttft-ms", "x-slo-tpot-ms"}
    return schemathesis.openapi.from_dict(spec)


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", [CMPL, CHAT, RESP])
def test_fuzz_from_openapi_schema(openapi_schema, client: httpx.Client, path: str, mode: str) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.core import NOT_SET

    op = openapi_schema[path]["POST"]
    strategy = op.as_strategy(generation_mode=GenerationMode.POSITIVE if mode == "positive"
                              else GenerationMode.NEGATIVE)
    statuses: dict[int, int] = {}
    slowest: list[tuple[float, int]] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        headers = _headers(case.headers)
        body = getattr(case, "body", NOT_SET)
        kw: dict[str, Any] = {}
        if body is not NOT_SET:
            body = _bounded(body, path)
            if isinstance(body, (bytes, bytearray)):
                kw["content"] = bytes(body)
            else:
                kw["content"] = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
            if not any(k.lower() == b"content-type" for k, _ in headers):
                headers.append((b"content-type", (case.media_type or "application/json").encode()))
        t0 = time.monotonic()
        r = client.post(path, headers=headers, **kw)
        slowest[:] = sorted(slowest + [(time.monotonic() - t0, r.status_code)], reverse=True)[:3]
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        _check_response(r, body)

    run()
    print(f"\n[fuzz {path} {mode}] statuses: {dict(sorted(statuses.items()))}; slowest (s, status): "
          f"{[(round(t, 2), st) for t, st in slowest]}")
    assert sum(statuses.values()) >= min(FUZZ_EXAMPLES, 10)
    if mode == "positive":
        assert statuses.get(200, 0) > 0, statuses  # schema-valid bodies do generate
