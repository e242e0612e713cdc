"""Bad input never yields a 500: each case maps to its status code and an OpenAI-style JSON error."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import MAX_BODY

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CMPL = {"prompt": "hi", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err
    return err


BAD_BODIES = [
    ("invalid_json", CMPL, b'{"prompt": "hi", "max_tokens": ', 400),
    ("not_an_object", CMPL, b"[1, 2, 3]", 400),
    ("deeply_nested_json", CMPL, b"[" * 20000 + b"]" * 20000, 400),
    ("not_utf8", CMPL, b'{"prompt": "\xff\xfe"}', 400),
    ("empty_body", CHAT, b"", 400),
    ("missing_prompt", CMPL, {"max_tokens": 2}, 400),
    ("missing_messages", CHAT, {"max_tokens": 2}, 400),
    ("empty_messages", CHAT, {"messages": []}, 400),
    ("prompt_wrong_type", CMPL, {"prompt": 123}, 400),
    ("messages_wrong_type", CHAT, {"messages": "hi"}, 400),
    ("role_not_a_string", CHAT, {"messages": [{"role": 5, "content": "hi"}]}, 400),
    ("role_empty", CHAT, {"messages": [{"role": "", "content": "hi"}]}, 400),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    ("max_tokens_str", CMPL, {**OK_CMPL, "max_tokens": "many"}, 400),
    ("max_tokens_zero", CMPL, {**OK_CMPL, "max_tokens": 0}, 400),
    ("max_tokens_negative", CHAT, {**OK_CHAT, "max_tokens": -5}, 400),
    ("n_0", CMPL, {**OK_CMPL, "n": 0}, 400),
    ("n_over_the_cap_chat", CHAT, {**OK_CHAT, "n": 257}, 400),
    ("n_times_prompts_over_the_cap", CMPL, {"prompt": ["a", "b"], "n": 129, "max_tokens": 2}, 400),
    ("n_str", CMPL, {**OK_CMPL, "n": "2"}, 400),
    ("temperature_negative", CMPL, {**OK_CMPL, "temperature": -1}, 400),
    ("top_p_over_one", CMPL, {**OK_CMPL, "top_p": 1.5}, 400),
    ("stop_not_str", CMPL, {**OK_CMPL, "stop": [1]}, 400),
    ("min_gt_max", CMPL, {**OK_CMPL, "min_tokens": 5}, 400),
    ("negative_token_id", CMPL, {"prompt": [1, -2], "max_tokens": 2}, 400),
    ("token_id_out_of_vocab", CMPL, {"prompt": [10**9], "max_tokens": 2}, 400),
    ("batched_prompts_over_the_cap", CMPL, {"prompt": ["a"] * 257, "max_tokens": 2}, 400),
    ("seed_out_of_range", CMPL, {**OK_CMPL, "seed": 2**70}, 400),
    ("body_slo_negative", CMPL, {**OK_CMPL, "slo_ttft_ms": -1}, 400),
    ("stream_bad_input", CMPL, {**OK_CMPL, "stream": True, "max_tokens": 0}, 400),
]


@pytest.mark.parametrize("path,body,status", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_body(client: httpx.Client, path: str, body, status: int) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert_error(r, status)


@pytest.mark.parametrize("header,value", [
    ("x-slo-ttft-ms", "-5"), ("x-slo-ttft-ms", "0"), ("x-slo-ttft-ms", "fast"), ("x-slo-ttft-ms", "nan"),
    ("x-slo-ttft-ms", "inf"), ("x-slo-ttft-ms", "1e12"), ("x-slo-tpot-ms", "-1"), ("x-slo-tpot-ms", ""),
    ("x-slo-output-len", "1.5"), ("x-slo-output-len", "0"), ("x-slo-output-len", "1e9"),
])
def test_bad_slo_headers(client: httpx.Client, header: str, value: str) -> None:
    err = assert_error(client.post(CMPL, json=OK_CMPL, headers={header: value}), 400)
    assert err["code"] == "invalid_slo" and header in err["message"] and err["param"] == header


def test_every_slo_value_sent_is_checked_where_a_header_wins(client: httpx.Client) -> None:
    """Headers win over the body's SLO fields, but a bad body field is a 400 all the same, and so is a header sent
    twice with two values (which one would win is not the client's to guess); each names what is wrong."""
    err = assert_error(client.post(CMPL, json={**OK_CMPL, "slo_ttft_ms": -1}, headers={"x-slo-ttft-ms": "2000"}), 400)
    assert (err["code"], err["param"]) == ("invalid_slo", "slo_ttft_ms")
    r = client.post(CMPL, json=OK_CMPL, headers=[("x-slo-ttft-ms", "2000"), ("x-slo-ttft-ms", "1")])
    err = assert_error(r, 400)
    assert (err["code"], err["param"]) == ("invalid_slo", "x-slo-ttft-ms")
    r = client.post(CMPL, json=OK_CMPL, headers=[("x-slo-ttft-ms", "2000"), ("x-slo-ttft-ms", "2000.0")])
    assert r.status_code == 200, r.text  # the same value twice (a proxy that copied it) says one thing


@pytest.mark.parametrize("body,param,says", [
    ({**OK_CMPL, "stop": [f"s{i}" for i in range(257)]}, "stop", "stop may hold at most 256"),
    ({"prompt": ["x"] * 257, "max_tokens": 1}, "prompt", "prompt: a batch holds at most 256 prompts"),
    ({**OK_CMPL, "stream_options": {"include_usage": True}}, "stream_options", "stream_options is only allowed"),
    ({"prompt": [5, -1], "max_tokens": 1}, "prompt", "prompt: token ids must be non-negative"),
    ({**OK_CMPL, "priority": 1.5}, "priority", "priority: Input should be a valid integer")])
def test_a_refusal_names_the_field_at_fault(client: httpx.Client, body, param: str, says: str) -> None:
    err = assert_error(client.post(CMPL, json=body), 400)
    assert err["param"] == param and err["message"].startswith(says), err


def test_prompt_over_context_window(client: httpx.Client) -> None:
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    err = assert_error(client.post(CMPL, json={"prompt": [5] * (limit + 10), "max_tokens": 2}), 400)
    assert str(limit) in err["message"] and (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    err = assert_error(client.post(CHAT, json={"messages": [{"role": "user", "content": "word " * (limit + 10)}]}),
                       400)
    assert str(limit) in err["message"] and (err["code"], err["param"]) == ("context_length_exceeded", "messages")


def test_a_chat_min_tokens_beyond_the_context_left_is_a_400_without_max_tokens(client: httpx.Client) -> None:
    """With no max_tokens a chat's cap is the context left (OpenAI's default): a min_tokens past it cannot be kept
    (vLLM: 400), not served to the window's end."""
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    for n in (limit, 2 ** 70):
        err = assert_error(client.post(CHAT, json={"messages": OK_CHAT["messages"], "min_tokens": n}), 400)
        assert err["param"] == "min_tokens" and f"maximum context length is {limit}" in err["message"], err


def test_nulls_and_zeros_openai_takes(client: httpx.Client) -> None:
    """Fields a client sends as null where OpenAI's and vLLM's schemas allow it, and top_p 0 (OpenAI's range is
    [0, 1]: the most likely token alone, so greedy whatever the temperature and seed)."""
    r = client.post(CMPL, json={**OK_CMPL, "echo": None})
    assert r.status_code == 200, r.text
    r = client.post(CMPL, json={**OK_CMPL, "stream": True, "stream_options": {"include_usage": None,
                                                                             "continuous_usage_stats": None}})
    assert r.status_code == 200 and '"usage"' not in r.text and r.text.rstrip().endswith("data: [DONE]"), r.text
    body = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True}
    greedy = client.post(CMPL, json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2):
        r = client.post(CMPL, json={**body, "temperature": 1.5, "top_p": 0, "seed": seed})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, r.text


def test_body_too_large(client: httpx.Client) -> None:
    big = {"prompt": "x" * (MAX_BODY + 10), "max_tokens": 2}
    err = assert_error(client.post(CMPL, json=big), 413)
    assert err["code"] == "body_too_large"

    def chunks():  # no content-length: the cap applies while streaming the body in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    assert_error(client.post(CMPL, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_unknown_route_and_method(client: httpx.Client) -> None:
    for r, status in ((client.post("/v1/embeddings", json={}), 404), (client.get(CMPL), 405)):
        assert assert_error(r, status)["type"] == "invalid_request_error"  # OpenAI's type for an invalid URL


@pytest.mark.parametrize("stream", [False, True])
def test_an_slo_no_idle_replica_meets_is_a_400_saying_what_is_attainable(client: httpx.Client, stream: bool) -> None:
    r = client.post(CMPL, json={**OK_CMPL, "stream": stream}, headers={"x-slo-ttft-ms": "0.001"})
    err = assert_error(r, 400)  # not retryable: the openai client does not retry a 400
    assert err["code"] == "slo_unattainable" and err["type"] == "invalid_request_error"
    assert r.headers["x-kairos-reject-reason"] == "slo_unattainable" and "retry-after" not in r.headers
    best_ttft, best_tpot = float(r.headers["x-kairos-slo-best-ttft-ms"]), float(r.headers["x-kairos-slo-best-tpot-ms"])
    assert 0.001 < best_ttft and 0 < best_tpot and f"{best_ttft:.1f} ms" in err["message"]
    assert r.headers["x-kairos-rerouted"] == "1"  # judged by the other replica too, its TTFT SLO long spent
    # what the deployment offers is served (with room for the hops before the engine's clock starts)
    r = client.post(CMPL, json={**OK_CMPL, "stream": stream},
                    headers={"x-slo-ttft-ms": f"{2 * best_ttft + 1000:.1f}", "x-slo-tpot-ms": f"{2 * best_tpot:.1f}"})
    assert r.status_code == 200, r.text


def test_a_tpot_no_replica_decodes_at_is_unattainable_judged_by_a_second_replica_once(client: httpx.Client) -> None:
    """A replica's idle floor is its own measure: the other replica of the two judges it too, once, before the 400."""
    r = client.post(CMPL, json=OK_CMPL, headers={"x-slo-tpot-ms": "0.01"})  # no replica decodes that fast
    err = assert_error(r, 400)
    assert err["code"] == "slo_unattainable" and float(r.headers["x-kairos-slo-best-tpot-ms"]) > 0.01
    assert r.headers["x-kairos-rerouted"] == "1"


def test_a_burst_at_the_offered_slo_is_served_or_told_to_retry_never_told_it_is_unattainable(base_url: str) -> None:
    """SLOs at what the deployment offers (x-kairos-slo-best-*) are attainable on an idle replica: under a burst a
    request may find the replicas busy (429, a busy reason, Retry-After from the queue), never 400."""
    import asyncio

    body = {**OK_CMPL, "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=60) as c:
        r = c.post(CMPL, json=body, headers={"x-slo-tpot-ms": "0.001"})
    assert r.status_code == 400
    slo = {"x-slo-ttft-ms": f"{float(r.headers['x-kairos-slo-best-ttft-ms']) + 2000:.1f}",
           "x-slo-tpot-ms": r.headers["x-kairos-slo-best-tpot-ms"]}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as ac:
            return await asyncio.gather(*(ac.post(CMPL, json=body, headers=slo) for _ in range(24)))

    for r in asyncio.run(burst()):
        if r.status_code == 200:
            continue
        # (what a 400 here came from: the SLO asked, the replica that answered, the resends)
        assert r.status_code == 429, (slo, {k: v for k, v in r.headers.items() if k.startswith("x-kairos")}, r.text)
        err = assert_error(r, 429)
        assert err["code"] in ("tpot_unattainable", "ttft_unattainable", "shed", "overloaded"), err
        assert r.headers["x-kairos-reject-reason"] == err["code"] and 1 <= int(r.headers["retry-after"]) <= 60


def test_an_unknown_model_is_404_and_the_served_names_are_listed(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()["data"]
    names = [m["id"] for m in models]
    assert names[0] == "kairos-tiny" and all(m["root"] == "kairos-tiny" for m in models)
    for path, body in ((CMPL, OK_CMPL), (CHAT, OK_CHAT)):
        for name in names:  # every listed name is served
            assert client.post(path, json={**body, "model": name}).status_code == 200
        assert client.post(path, json=body).status_code == 200  # no model: the served one (as vLLM)
        for stream in (False, True):
            r = client.post(path, json={**body, "model": "gpt-4o", "stream": stream})
            err = assert_error(r, 404)
            assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error")
            assert "gpt-4o" in err["message"] and "kairos-tiny" in err["message"]


def test_max_tokens_beyond_the_context_left_is_a_400_naming_the_limit(client: httpx.Client) -> None:
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [5] * 10
    err = assert_error(client.post(CMPL, json={"prompt": prompt, "max_tokens": 1_000_000_000}), 400)
    assert err["message"] == (f"'max_tokens' or 'max_completion_tokens' is too large: 1000000000. This model's "
                              f"maximum context length is {limit} tokens and your request has 10 input tokens "
                              f"(1000000000 > {limit} - 10).")
    assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")
    for key in ("max_tokens", "max_completion_tokens"):
        err = assert_error(client.post(CHAT, json={"messages": OK_CHAT["messages"], key: limit, "stream": True}), 400)
        assert f"is too large: {limit}." in err["message"] and f"maximum context length is {limit}" in err["message"]
        assert err["param"] == key, err  # the field the client sent
    r = client.post(CMPL, json={"prompt": [5] * (limit - 8), "max_tokens": 8, "ignore_eos": True})  # exactly fits
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_415(client: httpx.Client, ctype: str | None) -> None:
    raw = b'{"prompt": "hi", "max_tokens": 2}'
    for path in (CMPL, CHAT):
        headers = {} if ctype is None else {"content-type": ctype}
        err = assert_error(client.post(path, content=raw, headers=headers), 415)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    r = client.post(CMPL, content=raw, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_valid_slo_is_served(client: httpx.Client) -> None:
    r = client.post(CMPL, json=OK_CMPL, headers={"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "10000",
                                                 "x-slo-output-len": "2"})
    assert r.status_code == 200, r.text
    r = client.post(CHAT, json={**OK_CHAT, "slo_ttft_ms": 60000, "output_len_hint": 2})
    assert r.status_code == 200, r.text
