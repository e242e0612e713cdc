"""Happy paths over real HTTP: completions and chat, streaming and not, plus the official openai client."""
from __future__ import annotations

import json
import os

import httpx
import pytest

MODEL = "kairos-tiny"


def sse_events(resp: httpx.Response) -> list[str]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def test_health_and_models(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.head("/health").status_code == 200
    assert client.get("/ping").json() == client.post("/ping").json() == {"status": "ok"}  # vLLM's routes
    assert client.get("/version").json() == {"version": "0.1.0"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] > 0
    one = client.get(f"/v1/models/{MODEL}")  # OpenAI's retrieve model
    assert one.status_code == 200 and one.json() == models["data"][0]
    missing = client.get("/v1/models/no/such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert missing.headers["x-kairos-request-id"].startswith("req-")  # every answer names its request


def test_cors_lets_any_origin_call_by_default(client: httpx.Client) -> None:
    """As vLLM's defaults: a browser's preflight from any origin is answered, and each response to a request with an
    Origin (a generation's, streamed or not, and FastAPI's routes) says that origin may read it."""
    origin = {"Origin": "https://chat.example"}
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type,authorization,x-slo-ttft-ms"}
    pre = client.options("/v1/completions", headers={**origin, **ask})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "x-slo-ttft-ms" in pre.headers["access-control-allow-headers"].lower()
    body = {"model": MODEL, "prompt": "cors", "max_tokens": 2}
    for stream in (False, True):
        r = client.post("/v1/completions", json={**body, "stream": stream}, headers=origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.text
        assert "x-kairos-request-id" in r.headers["access-control-expose-headers"]
    assert client.get("/v1/models", headers=origin).headers["access-control-allow-origin"] == "*"
    plain = client.post("/v1/completions", json=body)  # no Origin: not a browser's call
    assert "access-control-allow-origin" not in plain.headers


def test_completion(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello, Kairos", "max_tokens": 6,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert isinstance(body["choices"][0]["text"], str) and body["choices"][0]["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 6 and u["total_tokens"] == u["prompt_tokens"] + 6
    assert r.headers["x-kairos-replica"]
    timing = r.headers["server-timing"]  # where the time to the first token went
    assert all(f"{hop};dur=" in timing for hop in ("parse", "route", "replica")), timing
    # behind Serve's HAProxy (the default where its binary is found) HAProxy stamps each request, and its wait for the
    # Ingress is off its TTFT SLO (`haproxy_ingress.received_rule`): the stamp reached the Ingress, on its clock
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        assert timing.startswith("proxy;dur="), timing


def test_completion_token_ids_seed_and_stop_extensions(client: httpx.Client) -> None:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 5, "seed": 7, "top_k": 5, "min_tokens": 2, "stop": ["zzz"],
            "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()
    b = client.post("/v1/completions", json=body).json()
    assert a["usage"]["prompt_tokens"] == 4 and a["usage"]["completion_tokens"] == 5
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # same seed -> same sample
    one = client.post("/v1/completions", json={"prompt": ["just one string"], "max_tokens": 2})
    assert one.status_code == 200, one.text
    assert a["choices"][0]["stop_reason"] is None  # vLLM's: none where the reply ran to its length
    text = client.post("/v1/completions", json={**body, "stop": None}).json()["choices"][0]["text"]
    assert len(text) > 2, text  # seeded: the same on every box
    # vLLM's stop_reason: the stop string that ended the reply, streamed or not
    stop = text[1:3]
    c = client.post("/v1/completions", json={**body, "min_tokens": 0, "stop": [stop, "zzz"]}).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop) and stop not in c["text"]
    with client.stream("POST", "/v1/completions", json={**body, "min_tokens": 0, "stop": [stop], "stream": True}) \
            as s:
        last = [json.loads(e) for e in sse_events(s)[:-1]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


def test_a_batch_of_prompts_gets_a_choice_each_streamed_or_not(client: httpx.Client) -> None:
    """vLLM's batched `prompt` (texts, or token id lists): a choice per prompt, in order, each the text its prompt
    gets alone, and the usage summed; streamed, every chunk names its choice. One bad prompt fails the request."""
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for prompts in (["Hello, Kairos", "The sky is", "Once"], [[5, 6, 7], [8, 9]]):
        alone = [client.post("/v1/completions", json={**base, "prompt": p}).json() for p in prompts]
        r = client.post("/v1/completions", json={**base, "prompt": prompts})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
        assert [c["text"] for c in body["choices"]] == [a["choices"][0]["text"] for a in alone]
        assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert body["usage"]["completion_tokens"] == 5 * len(prompts)
        with client.stream("POST", "/v1/completions", json={**base, "prompt": prompts, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [""] * len(prompts)
        for c in chunks[:-1]:
            for choice in c["choices"]:
                texts[choice["index"]] += choice["text"]
        assert texts == [a["choices"][0]["text"] for a in alone]
        assert chunks[-1]["usage"] == body["usage"] and chunks[-1]["choices"] == []
    # more prompts than the replicas run at once (2 x max_num_seqs 16): they go in waves, none turned away as full
    many = [[5 + i % 50, 6] for i in range(40)]
    r = client.post("/v1/completions", json={**base, "max_tokens": 2, "prompt": many})
    assert r.status_code == 200 and len(r.json()["choices"]) == 40, r.text
    replicas = r.headers["x-kairos-replica"].split(",")  # every replica that served one of its prompts
    assert 1 <= len(replicas) == len(set(replicas)) <= 2 and all(replicas), replicas
    with client.stream("POST", "/v1/completions", json={**base, "max_tokens": 2, "prompt": many, "stream": True}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    assert sorted({c["index"] for e in events[:-1] for c in json.loads(e)["choices"]}) == list(range(40))
    bad = client.post("/v1/completions", json={**base, "prompt": [[5, 6], [10 ** 9]]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
    assert bad.json()["error"]["param"] == "prompt" and bad.json()["error"]["message"].startswith("prompt 1: ")
    empty = client.post("/v1/completions", json={**base, "prompt": [[5, 6], []]})
    assert empty.status_code == 400, empty.text


def test_n_choices_of_a_completion_and_a_chat_streamed_or_not(client: httpx.Client) -> None:
    """OpenAI's `n`: n choices of each prompt (a batch's prompt i's j-th at index i x n + j), of a chat too; with a
    seed, choice j samples as a request of seed + j alone (vLLM's), so the choices differ and repeat; greedy ones
    are alike; the usage counts each prompt once; streamed, every chunk names its choice, and a chat's choices each
    open with their role."""
    base = {"max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 11}
    r = client.post("/v1/completions", json={**base, "prompt": "Once upon a time", "n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    alone = [client.post("/v1/completions", json={**base, "prompt": "Once upon a time", "seed": 11 + j}).json()
             for j in range(3)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert len({c["text"] for c in body["choices"]}) > 1
    assert body["usage"] == {"prompt_tokens": alone[0]["usage"]["prompt_tokens"], "completion_tokens": 18,
                             "total_tokens": alone[0]["usage"]["prompt_tokens"] + 18}
    greedy = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
    batch = client.post("/v1/completions", json={**greedy, "prompt": [[5, 6, 7], [8, 9]], "n": 2}).json()
    texts = [c["text"] for c in batch["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3] and batch["usage"]["prompt_tokens"] == 5
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "ignore_eos": True, "temperature": 1.0,
            "seed": 3, "n": 2}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in body["choices"])
    alone = client.post("/v1/chat/completions", json={**chat, "n": 1, "seed": 4}).json()
    assert body["choices"][1]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 10
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    texts, roles = ["", ""], [[], []]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        if "role" in choice["delta"]:
            roles[choice["index"]].append(len(texts[choice["index"]]))
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert roles == [[0], [0]]  # each choice's first chunk says its role, once
    assert texts == [ch["message"]["content"] for ch in body["choices"]]
    assert chunks[-1]["usage"] == body["usage"] and chunks[-1]["choices"] == []


def test_best_of_returns_the_choices_with_the_highest_logprob_per_token(client: httpx.Client) -> None:
    """OpenAI's best_of: best_of choices of each prompt are made (choice j with seed + j), and the n whose tokens
    have the highest mean logprob come back, best first; the usage counts every choice made; logprobs only where
    asked; streamed, or on a chat, a 400 naming it."""
    base = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 21}
    made = [client.post("/v1/completions", json={**base, "seed": 21 + j, "logprobs": 0}).json()["choices"][0]
            for j in range(4)]
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) / 6 for c in made}
    ranked = sorted(score, key=score.get, reverse=True)
    r = client.post("/v1/completions", json={**base, "best_of": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ranked[:1] and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 24
    two = client.post("/v1/completions", json={**base, "prompt": [base["prompt"]] * 2, "best_of": 4, "n": 2,
                                               "logprobs": 1}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two["choices"]] == ranked[:2] * 2 and two["usage"]["completion_tokens"] == 48
    assert all(len(c["logprobs"]["tokens"]) == 6 for c in two["choices"])
    r = client.post("/v1/completions", json={**base, "best_of": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_logit_bias_forces_and_bans_tokens_and_the_model_is_named_as_asked(client: httpx.Client) -> None:
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    forced = client.post("/v1/completions", json={**body, "logit_bias": {"42": 100}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == tok.decode([42, 42, 42])
    plain = client.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]["text"]
    first = tok.encode(plain, add_special_tokens=False)[0]
    banned = client.post("/v1/completions", json={**body, "max_tokens": 1, "logit_bias": {str(first): -100}})
    assert banned.json()["choices"][0]["text"] != plain
    r = client.post("/v1/completions", json={**body, "logit_bias": {"99999999": 1}})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    for card in client.get("/v1/models").json()["data"]:  # every served name answers as itself, as vLLM does
        r = client.post("/v1/completions", json={**body, "model": card["id"], "max_tokens": 1})
        assert r.json()["model"] == card["id"]


def test_penalties_and_min_p_are_honoured_and_bad_values_named(client: httpx.Client) -> None:
    """vLLM's sampling extras: a greedy reply under a repetition penalty (and a min_p, which greedy ignores) is HF
    generate's with that penalty; OpenAI's presence and frequency penalties are taken on both endpoints; a value out
    of range is a 400 naming its field."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.driver import resolve_model_path

    path = resolve_model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "repetition_penalty": 1.5, "min_p": 0.1})
    assert r.status_code == 200, r.text
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    beyond = list(range(len(tok), model.get_output_embeddings().weight.shape[0]))  # rows no token decodes to
    with torch.inference_mode():
        want = model.generate(torch.tensor([[1, 2, 3, 4]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                              pad_token_id=0, suppress_tokens=beyond)
        plain = model.generate(torch.tensor([[1, 2, 3, 4]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                               suppress_tokens=beyond)
    assert want[0, 4:].tolist() != plain[0, 4:].tolist()
    assert r.json()["choices"][0]["text"] == tok.decode(want[0, 4:].tolist())
    for path_, extra in (("/v1/completions", {"prompt": "Hello"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        r = client.post(path_, json={**extra, "max_tokens": 8, "presence_penalty": 1.5, "frequency_penalty": -0.5,
                                     "min_p": 0.2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.2), ("repetition_penalty", "high")):
        r = client.post("/v1/completions", json={**body, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field, r.json()


def test_logprobs_are_the_models_own_streamed_or_not(client: httpx.Client) -> None:
    """logprobs as OpenAI and vLLM show them: a completion's tokens, token_logprobs (the model's own, its raw
    distribution over the tokens it can say), top_logprobs (the chosen token and the `logprobs` likeliest) and
    text_offset; a chat's content entries with their bytes and `top_logprobs` likeliest; streamed, each chunk has
    its tokens', and together they are the whole reply's; every choice of `n` has its own; bad values are 400s
    naming their field."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.driver import resolve_model_path

    path = resolve_model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = [1, 2, 3, 4]
        for _ in range(8):  # greedy over the tokens the tokenizer has (the sampler never draws past them)
            ids.append(int(model(torch.tensor([ids])).logits[0, -1, :len(tok)].argmax()))
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, 3:-1].float(), dim=-1)[:, :len(tok)]
    out = ids[4:]
    assert lp["tokens"] == [tok.decode([t]) for t in out]
    assert lp["token_logprobs"] == pytest.approx([ref[j, t].item() for j, t in enumerate(out)], abs=1e-3)
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:j]) for j in range(8)]
    for j, top in enumerate(lp["top_logprobs"]):
        want = ref[j].topk(3)
        assert lp["tokens"][j] in top and len(top) <= 4
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(want.values.tolist(), abs=1e-3)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(e) for e in sse_events(s)[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for x in streamed for t in x["tokens"]] == lp["tokens"]
    assert [v for x in streamed for v in x["token_logprobs"]] == lp["token_logprobs"]
    assert [o for x in streamed for o in x["text_offset"]] == lp["text_offset"]
    # a chat: content entries, streamed or not
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for x in content:
        assert x["bytes"] == list(x["token"].encode()) and len(x["top_logprobs"]) == 2
        assert x["top_logprobs"][0]["logprob"] >= x["top_logprobs"][1]["logprob"]
        assert x["logprob"] == pytest.approx(x["top_logprobs"][0]["logprob"])  # greedy: the likeliest
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        chunks = [json.loads(e) for e in sse_events(s)[:-1]]
    assert [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["content"]] \
        == content
    alone = client.post("/v1/chat/completions", json={**chat, "logprobs": False, "top_logprobs": None}).json()
    assert alone["choices"][0]["logprobs"] is None
    # n choices each with their own
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "seed": 5,
                                             "ignore_eos": True, "logprobs": 0, "n": 2})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert len(c["logprobs"]["tokens"]) == 4 and all(len(t) == 1 for t in c["logprobs"]["top_logprobs"])
    for path_, extra, field, value in (
            ("/v1/completions", {"prompt": "x"}, "logprobs", 21),
            ("/v1/completions", {"prompt": "x"}, "logprobs", True),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "top_logprobs", 2),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
             "top_logprobs", 21)):
        r = client.post(path_, json={**extra, "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)


def test_echo_puts_the_prompt_before_each_choice_streamed_or_not(client: httpx.Client) -> None:
    """A completion's `echo`: each choice's text opens with its prompt's (a text prompt as sent, token ids as the
    tokenizer decodes them), streamed in its first chunk; the usage is as without it; a chat whose last message is
    the user's has nothing to echo."""
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json={**base, "prompt": "Once upon a time"}).json()
    r = client.post("/v1/completions", json={**base, "prompt": "Once upon a time", "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Once upon a time" + plain["choices"][0]["text"]
    assert r.json()["usage"] == plain["usage"]
    ids = client.post("/tokenize", json={"prompt": "Once upon a time", "add_special_tokens": False}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    both = client.post("/v1/completions", json={**base, "prompt": [ids, ids[:2]], "n": 2, "echo": True})
    assert both.status_code == 200, both.text
    texts = [c["text"] for c in both.json()["choices"]]
    short = client.post("/detokenize", json={"tokens": ids[:2]}).json()["prompt"]
    assert texts[0] == texts[1] and texts[0].startswith(text) and texts[2].startswith(short)
    alone = client.post("/v1/completions", json={**base, "prompt": ids}).json()["choices"][0]["text"]
    assert texts[0] == text + alone
    with client.stream("POST", "/v1/completions", json={**base, "prompt": "Once upon a time", "echo": True,
                                                        "stream": True}) as s:
        chunks = [json.loads(e) for e in sse_events(s)[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith("Once upon a time")
    assert "".join(c["choices"][0]["text"] for c in chunks) == r.json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**base, "prompt": ["a b", "c d"], "echo": True,
                                                        "stream": True}) as s:
        chunks = [json.loads(e) for e in sse_events(s)[:-1]]
    got = ["", ""]
    for c in chunks:
        got[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert got[0].startswith("a b") and got[1].startswith("c d")
    r = client.post("/v1/chat/completions", json={**base, "messages": [{"role": "user", "content": "x"}],
                                                  "echo": True})
    assert r.status_code == 200, r.text  # a chat's echo (vLLM's): its last message where the assistant's, else none
    # with truncate_prompt_tokens, the tokens the engine keeps of a prompt it cuts (their logprobs are what it
    # scores: the echo and its tokens' text agree), token ids or text alike; a prompt it does not cut, as sent
    kept = client.post("/detokenize", json={"tokens": ids[-2:]}).json()["prompt"]
    for prompt in (ids, "Once upon a time"):
        cut = client.post("/v1/completions", json={**base, "prompt": prompt, "echo": True, "logprobs": 0,
                                                   "truncate_prompt_tokens": 2})
        assert cut.status_code == 200, cut.text
        choice = cut.json()["choices"][0]
        assert choice["text"].startswith(kept) and "".join(choice["logprobs"]["tokens"][:2]) == kept
        assert choice["logprobs"]["text_offset"][2] == len(kept)  # (the reply's first token after the echo)
    whole = client.post("/v1/completions", json={**base, "prompt": "Once upon a time", "echo": True,
                                                 "truncate_prompt_tokens": 100})
    assert whole.json()["choices"][0]["text"].startswith("Once upon a time")


def test_echo_with_logprobs_and_prompt_logprobs_are_the_models_own(client: httpx.Client) -> None:
    """lm-eval-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1): the prompt's tokens'
    logprobs (the first null: nothing predicts it) then the reply's, the model's own given the tokens before; streamed,
    the echoed prompt's come in the first chunk; vLLM's prompt_logprobs on a completion (per choice) and a chat (the
    response's), and a 400 with a stream."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.driver import resolve_model_path

    path = resolve_model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [11, 42, 7, 300, 5, 19]
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    out = lp["tokens"][6:]
    assert len(lp["tokens"]) == 7 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        first = int(model(torch.tensor([ids])).logits[0, -1, :len(tok)].argmax())
        ref = torch.log_softmax(model(torch.tensor([ids + [first]])).logits[0].float(), dim=-1)[:, :len(tok)]
    assert lp["tokens"] == [tok.decode([t]) for t in ids + [first]] and out == [tok.decode([first])]
    want = [ref[j - 1, t].item() for j, t in enumerate(ids + [first]) if j]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3)
    assert all(lp["tokens"][j] in lp["top_logprobs"][j] for j in range(1, 7))
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:j]) for j in range(7)]
    echoed = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert choice["text"] == echoed + tok.decode([first]) and "prompt_logprobs" not in choice
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as st:
        chunks = [json.loads(e) for e in sse_events(st)[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert streamed[0]["tokens"][:6] == lp["tokens"][:6]
    assert [t for x in streamed for t in x["tokens"]] == lp["tokens"]
    assert [v for x in streamed for v in x["token_logprobs"]] == lp["token_logprobs"]
    # max_tokens 0 with echo (vLLM's, OpenAI's): the prompt alone, scored, without a reply; streamed alike
    r = client.post("/v1/completions", json={**body, "max_tokens": 0})
    assert r.status_code == 200, r.text
    alone = r.json()["choices"][0]
    assert alone["text"] == echoed and alone["logprobs"]["tokens"] == lp["tokens"][:6]
    assert alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][:6]
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == 6
    with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 0, "stream": True}) as st:
        chunks = [json.loads(e) for e in sse_events(st)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed
    assert [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]] == \
        lp["tokens"][:6]
    err = client.post("/v1/completions", json={**body, "max_tokens": 0, "echo": False}).json()["error"]
    assert err["param"] == "max_tokens" and "only with echo" in err["message"]
    # vLLM's prompt_logprobs: per prompt token a map of token id to {logprob, rank, decoded_token}
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "n": 2,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        plp = c["prompt_logprobs"]
        assert len(plp) == 6 and plp[0] is None and c["logprobs"] is None
        for j in range(1, 6):
            entry = plp[j][str(ids[j])]
            assert entry["logprob"] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-3)
            assert entry["decoded_token"] == tok.decode([ids[j]]) and 2 <= len(plp[j]) <= 3
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert len(r.json()["prompt_logprobs"]) == n_prompt and r.json()["prompt_logprobs"][0] is None
    assert all(len(d) == 1 for d in r.json()["prompt_logprobs"][1:])
    for path_, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
        r = client.post(path_, json={**extra, "max_tokens": 2, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_vllms_output_knobs_allowed_ids_special_tokens_stop_strings_and_truncation(client: httpx.Client) -> None:
    """vLLM's allowed_token_ids (only those drawn, greedy or sampled), skip_special_tokens false (a special token's
    text kept), include_stop_str_in_output (the stop string kept, streamed too) and truncate_prompt_tokens (the
    prompt's last k tokens: the reply of those alone); bad values are 400s naming their field."""
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    base = {"prompt": [1, 2, 3, 4], "max_tokens": 8, "ignore_eos": True}
    for temperature in (0, 1.0):
        r = client.post("/v1/completions", json={**base, "temperature": temperature, "seed": 3,
                                                 "allowed_token_ids": [42, 300], "logprobs": 0})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert set(lp["tokens"]) <= {tok.decode([42]), tok.decode([300])} and len(lp["tokens"]) == 8
    special = tok.all_special_ids[0]
    forced = {**base, "max_tokens": 3, "temperature": 0, "logit_bias": {str(special): 100}}
    shown = client.post("/v1/completions", json={**forced, "skip_special_tokens": False}).json()
    hidden = client.post("/v1/completions", json=forced).json()
    assert shown["choices"][0]["text"] == tok.decode([special]) * 3 and hidden["choices"][0]["text"] == ""
    reply = client.post("/v1/completions", json={**base, "max_tokens": 12, "temperature": 0}).json()
    text = reply["choices"][0]["text"]
    stop = text[3:6]
    assert stop.strip(), text
    kept = client.post("/v1/completions", json={**base, "max_tokens": 12, "temperature": 0, "stop": [stop],
                                                "include_stop_str_in_output": True}).json()["choices"][0]
    cut = client.post("/v1/completions", json={**base, "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert kept["text"] == text[:text.index(stop) + len(stop)] and kept["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    with client.stream("POST", "/v1/completions", json={**base, "max_tokens": 12, "temperature": 0, "stop": [stop],
                                                        "include_stop_str_in_output": True, "stream": True}) as st:
        chunks = [json.loads(e) for e in sse_events(st)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == kept["text"]
    long = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**long, "truncate_prompt_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"] == client.post("/v1/completions", json={**long, "prompt": [10, 11, 12]}).json()[
        "choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2, "truncate_prompt_tokens": 4}
    assert client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 4
    r = client.post("/v1/completions", json={**base, "bad_words": ["the", " sky"]})  # (tests/test_engine.py: kept out)
    assert r.status_code == 200, r.text
    for field, value in (("allowed_token_ids", [-1]), ("allowed_token_ids", [10**8]), ("truncate_prompt_tokens", 0),
                         ("skip_special_tokens", "no"), ("include_stop_str_in_output", 1), ("bad_words", [" "]),
                         ("bad_words", ["w"] * 300), ("bad_words", "word")):
        r = client.post("/v1/completions", json={**base, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field or field in r.json()["error"]["message"], r.json()


def test_json_mode_replies_are_json_objects(client: httpx.Client) -> None:
    """OpenAI's response_format json_object, on a chat and a completion, streamed or not: the reply is a JSON object
    where it ends by a stop token (forced here: "{", then "}", then the EOS) and a prefix of one where its cap ends
    it; json_schema and vLLM's guided_json: a value of the schema (one of few values here, which the tiny model
    cannot but write); a schema that is no schema, or holds what is not enforced, is a 400 naming the field."""
    import json as json_

    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path
    from core.json_grammar import START, advance

    tok = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    braces = [tok.convert_tokens_to_ids("{"), tok.convert_tokens_to_ids("}"), tok.eos_token_id]
    chat = {"messages": [{"role": "user", "content": "Reply in JSON"}], "max_tokens": 24, "temperature": 1.0,
            "seed": 2, "response_format": {"type": "json_object"}}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert advance(START, content) is not None, content
    forced = client.post("/v1/chat/completions", json={**chat, "allowed_token_ids": braces}).json()["choices"][0]
    assert json_.loads(forced["message"]["content"]) == {} and forced["finish_reason"] == "stop"
    cmpl = {"prompt": "JSON:", "max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}}
    with client.stream("POST", "/v1/completions", json={**cmpl, "stream": True}) as st:
        chunks = [json_.loads(e) for e in sse_events(st)[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == client.post("/v1/completions", json=cmpl).json()["choices"][0]["text"]
    assert advance(START, streamed) is not None, streamed
    # json_schema (OpenAI's, the openai client's parse of a pydantic model) and vLLM's guided_json: a value of it
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    for body in ({**chat, "max_tokens": 400, "response_format": fmt},
                 {**chat, "max_tokens": 400, "response_format": None, "guided_json": schema}):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        obj = json_.loads(r.json()["choices"][0]["message"]["content"])
        assert obj["answer"] in ("yes", "no") and isinstance(obj["sure"], bool) and set(obj) == {"answer", "sure"}
    for bad in ({"type": "json_schema", "json_schema": {}}, {"type": "json_schema", "json_schema": {"schema": {
            "type": "string", "pattern": "(?=a)"}}}, {"type": "xml"}):
        r = client.post("/v1/completions", json={**cmpl, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = client.post("/v1/completions", json={**cmpl, "response_format": fmt, "guided_json": schema})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text


SQL_GRAMMAR = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""  # vLLM's documentation's example of guided_grammar


def test_guided_regex_and_choice_replies_match(client: httpx.Client) -> None:
    """vLLM's guided_regex (the whole reply matches it), guided_choice (the reply is one of the texts),
    guided_grammar (the reply is a text of an EBNF grammar) and their structured_outputs forms, streamed as whole,
    sampled or greedy: the reply ends, by the EOS, once it matches and nothing more could; a regex or grammar this
    server cannot keep, or two formats at once, is a 400 naming the field."""
    import json as json_
    import re

    cmpl = {"prompt": "Code:", "max_tokens": 40, "temperature": 1.0, "seed": 3}
    for seed in range(3):
        for body in ({"guided_regex": r"[A-Z]{2}-\d{3}"}, {"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}}):
            r = client.post("/v1/completions", json={**cmpl, **body, "seed": seed})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert re.fullmatch(r"[A-Z]{2}-\d{3}", choice["text"]) and choice["finish_reason"] == "stop", choice
    choices = ["yes", "no", "maybe later"]
    chat = {"messages": [{"role": "user", "content": "Well?"}], "max_tokens": 40, "temperature": 0}
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = client.post("/v1/chat/completions", json={**chat, **body})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in choices, r.text
        with client.stream("POST", "/v1/chat/completions", json={**chat, **body, "stream": True}) as st:
            chunks = [json_.loads(e) for e in sse_events(st)[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
            r.json()["choices"][0]["message"]["content"]
    r = client.post("/v1/completions", json={**cmpl, "structured_outputs": {"json": {"enum": [1, 22]}}})
    assert r.status_code == 200 and json_.loads(r.json()["choices"][0]["text"]) in (1, 22), r.text
    from core.ebnf_grammar import compile_grammar
    from core.regex_grammar import matches, walk

    sql = SQL_GRAMMAR
    g = compile_grammar(sql)
    for seed, body in enumerate(({"guided_grammar": sql}, {"structured_outputs": {"grammar": sql}})):
        r = client.post("/v1/completions", json={**cmpl, **body, "max_tokens": 120, "seed": seed})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and matches(g, choice["text"]), choice
        with client.stream("POST", "/v1/chat/completions", json={**chat, **body, "max_tokens": 120,
                                                                   "stream": True}) as st:
            chunks = [json_.loads(e) for e in sse_events(st)[:-1]]
        assert matches(g, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks))
    lark = 'start: items "."\nitems: items "," ITEM | ITEM\nITEM: "a" | "b"'  # left-recursive, as Lark writes lists
    r = client.post("/v1/completions", json={**cmpl, "guided_grammar": lark, "max_tokens": 12})
    choice, g = r.json()["choices"][0], compile_grammar(lark)
    assert matches(g, choice["text"]) if choice["finish_reason"] == "stop" else walk(g, choice["text"]), choice
    for bad, param in (({"guided_regex": "(?<=a)b"}, "guided_regex"), ({"guided_regex": r"\1"}, "guided_regex"),
                       ({"guided_grammar": "root ::= b root \"a\" | \"c\"\nb ::= \"\" | \"b\""}, "guided_grammar"),
                       ({"guided_grammar": "start: /a+/"}, "guided_grammar"),
                       ({"guided_grammar": "root ::= \"a\"", "guided_regex": "a"}, "guided_grammar"),
                       ({"guided_choice": []}, "guided_choice"), ({"guided_choice": [1]}, "guided_choice"),
                       ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
                       ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
                       ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
                       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")):
        r = client.post("/v1/completions", json={**cmpl, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_tool_choice_naming_or_requiring_a_tool_returns_tool_calls(client: httpx.Client) -> None:
    """OpenAI's tools: shown to the model by its chat template; tool_choice naming a tool makes the reply that tool's
    call (its arguments a value of its parameters' schema), "required" a list of calls of the tools (finish reason
    tool_calls), streamed as `tool_calls` deltas that add up to the same calls; "none" a text reply; "auto" (the
    default with tools) the reply read in the app's tool-call format (this app's: hermes), streamed as it is whole;
    a conversation with an assistant's tool calls and a tool's reply is taken."""
    import json as json_

    from deployments.tool_calls import merge_calls

    weather = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}}}
    chat = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 400, "temperature": 0,
            "tools": [weather, clock]}

    def streamed(body: dict) -> tuple[str, list[dict], str]:
        """A streamed reply's content, its calls (their deltas merged) and its finish reason."""
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200, r.text
        chunks = [json_.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        calls = merge_calls([e for d in deltas for e in d.get("tool_calls", [])])
        return "".join(d.get("content") or "" for d in deltas), calls, chunks[-1]["choices"][0]["finish_reason"]

    named = {**chat, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.post("/v1/chat/completions", json=named)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and call["type"] == "function" and call["id"]
    args = json_.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and args["city"] in ("Paris", "Oslo") and args["unit"] in "CF"
    content, calls, finish = streamed(named)
    assert content == "" and finish == choice["finish_reason"] == "stop"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json_.loads(calls[0]["function"]["arguments"]) == args
    required = {**chat, "tool_choice": "required", "parallel_tool_calls": False}
    r = client.post("/v1/chat/completions", json=required)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert choice["message"]["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")
    content, calls, finish = streamed(required)
    assert (content, finish) == ("", "tool_calls")
    assert [c["function"] for c in calls] == [c["function"] for c in choice["message"]["tool_calls"]]
    for auto in ({}, {"tool_choice": "auto"}):  # the model's own calls, if any, in hermes's format
        r = client.post("/v1/chat/completions", json={**chat, **auto, "max_tokens": 12})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        content, calls, finish = streamed({**chat, **auto, "max_tokens": 12})
        assert (content or None, [c["function"] for c in calls], finish) == (
            message["content"], [c["function"] for c in message.get("tool_calls", [])],
            r.json()["choices"][0]["finish_reason"])
    r = client.post("/v1/chat/completions", json={**chat, "max_tokens": 4, "tool_choice": "none"})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"], r.text
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    r = client.post("/v1/chat/completions", json={**chat, "messages": history, "max_tokens": 4, "tool_choice": "none"})
    assert r.status_code in (200, 400), r.text  # (400: a template that cannot show a tool's turn says so)
    for extra in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, {"tool_choice": "maybe"},
                  {"tool_choice": "required", "response_format": {"type": "json_object"}}):
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", (extra, r.text)
    r = client.post("/v1/completions", json={"prompt": "x", "tools": [weather]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_completion_stream(client: httpx.Client) -> None:
    req = {"prompt": "Once upon a time", "max_tokens": 128, "stream": True, "ignore_eos": True,
           "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    # streamed as produced, not one blob (a replica whose loop falls behind merges what queued meanwhile: 128
    # tokens, so that only a stall of about the whole reply's time merges all)
    assert len(text_chunks) >= 2
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert all("usage" in c and c["usage"] is None for c in text_chunks)  # OpenAI: null on all but the usage chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 128
    em = chunks[-1]["kairos_metrics"]  # extension: the engine's own TTFT/TPOT for this request
    assert em["ttft_ms"] > 0 and em["tpot_ms"] > 0 and em["e2e_ms"] >= em["ttft_ms"]


def test_a_prompt_sent_again_finds_its_blocks_in_the_prefix_cache(client: httpx.Client) -> None:
    """Prefix caching over HTTP: a prompt sent three times (two of them reach the same one of this app's two
    replicas). The `kairos_metrics` of one sent again count its prompt tokens found cached (every full block of it,
    short of its last token, which is computed for its logits)."""
    import uuid

    prompt = " ".join(uuid.uuid4().hex for _ in range(12))  # no other request's prompt begins so
    req = {"prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    got = []
    for _ in range(3):
        with client.stream("POST", "/v1/completions", json=req) as r:
            assert r.status_code == 200
            last = json.loads(sse_events(r)[-2])
        got.append((last["usage"]["prompt_tokens"], last["kairos_metrics"].get("cached_prompt_tokens", 0)))
    n = got[0][0]
    again = max(c for _, c in got[1:])
    assert n > 64 and got[0][1] == 0 and n - 16 <= again < n, got  # (blocks of 16 tokens)


def test_chat(client: httpx.Client) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 5,
                                                  "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5



def test_chat_template_options_change_the_prompt(client: httpx.Client) -> None:
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs reach the template: the prompt
    the reply counts is the template's without the assistant's opening, or with its last message left open; a
    request's own chat_template is refused by name."""
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]

    def prompt_tokens(**extra) -> int:
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    opened = prompt_tokens()
    closed = prompt_tokens(add_generation_prompt=False)
    continued = prompt_tokens(add_generation_prompt=False, continue_final_message=True)
    assert opened > closed > continued  # the assistant's opening, then the last message's end, left out
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == opened  # a variable it does not read
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                         ({"chat_template": "{{ 1 }}"}, "chat_template")):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/tokenize", json={"messages": msgs, "chat_template": "{{ 1 }}"})  # (not trusted by this app)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    # vLLM's echo for a chat: the assistant's last message, which the reply continues, opens each choice's content
    cont = {"messages": msgs, "max_tokens": 4, "add_generation_prompt": False, "continue_final_message": True,
            "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]["content"]
    for n in (1, 2):
        r = client.post("/v1/chat/completions", json={**cont, "echo": True, "n": n})
        assert [c["message"]["content"] for c in r.json()["choices"]] == ["Hi" + plain] * n, r.text
    r = client.post("/v1/chat/completions", json={**cont, "echo": True, "logprobs": True, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text  # the reply's logprobs alone (the prompt's are vLLM's prompt_logprobs)
    assert len(r.json()["choices"][0]["logprobs"]["content"]) == 4 and r.json()["prompt_logprobs"][0] is None
    with client.stream("POST", "/v1/chat/completions", json={**cont, "echo": True, "stream": True}) as st:
        import json as json_
        chunks = [json_.loads(e) for e in sse_events(st)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi" + plain
    r = client.post("/v1/chat/completions", json={**cont, "messages": msgs[:1], "echo": True,
                                                  "add_generation_prompt": True, "continue_final_message": False})
    assert r.status_code == 200, r.text  # the last message is the user's: nothing to echo


def test_logprobs_name_tokens_by_id_where_asked(client: httpx.Client) -> None:
    """vLLM's return_tokens_as_token_ids: every token in the logprobs (chosen and top) is "token_id:N", the same
    tokens and values as by text, streamed or whole."""
    cmpl = {"prompt": "The sky", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    by_text = client.post("/v1/completions", json=cmpl).json()["choices"][0]["logprobs"]
    by_id = client.post("/v1/completions", json={**cmpl, "return_tokens_as_token_ids": True}).json()
    lp = by_id["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in lp["tokens"]), lp
    assert lp["token_logprobs"] == by_text["token_logprobs"]
    assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert all(x["token"].startswith("token_id:") and all(t["token"].startswith("token_id:")
                                                        for t in x["top_logprobs"]) for x in content), content

def test_tokenize_and_detokenize_as_vllm(client: httpx.Client) -> None:
    """vLLM's /tokenize: the ids a completion or a chat completion takes (their count is its usage's prompt_tokens),
    the window, each token's text when asked; /detokenize reads ids back. Bad input is a 400 naming the field."""
    def usage(path: str, **body) -> int:
        r = client.post(path, json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello, Kairos", "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) == usage("/v1/completions",
                                                                                  prompt="Hello, Kairos")
    assert got["max_model_len"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"messages": msgs}).json()
    assert chat["count"] == usage("/v1/chat/completions", messages=msgs) and chat["token_strs"] is None
    back = client.post("/detokenize", json={"tokens": chat["tokens"]})
    assert back.status_code == 200 and "Be brief." in back.json()["prompt"] and "Hi" in back.json()["prompt"]
    empty = client.post("/tokenize", json={"prompt": "", "add_special_tokens": False})  # (vLLM's: no ids)
    assert empty.status_code == 200 and empty.json()["tokens"] == [] and empty.json()["count"] == 0, empty.text
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": []}, "messages"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert client.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_chat_stream_and_content_parts(client: httpx.Client) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " a story"}]}]
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": msgs, "max_completion_tokens": 6, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage
    # vLLM's continuous_usage_stats: every chunk carries the tokens so far, then the usage chunk as always
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": msgs, "max_completion_tokens": 6, "stream": True, "ignore_eos": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    usages = [c["usage"] for c in chunks]
    assert chunks[-1]["choices"] == [] and usages[-1]["completion_tokens"] == 6
    assert all(u is not None and u["prompt_tokens"] == usages[-1]["prompt_tokens"] for u in usages)
    assert usages[0]["completion_tokens"] == 0 and usages[-2]["completion_tokens"] == 6
    assert [u["completion_tokens"] for u in usages] == sorted(u["completion_tokens"] for u in usages)


def test_the_responses_api_answers_as_the_chat_it_amounts_to(base_url: str) -> None:
    """OpenAI's Responses API, through the openai client: a response's text is the chat's reply to the same turn
    (greedy), its cap makes it incomplete; streamed, the client's event reader gets the same response; a required
    tool's call is a function_call item; text.format holds the reply to a schema; a conversation with an earlier
    call and its output is taken; what this server does not keep (previous_response_id) is a 400 naming it, and an
    SLO it cannot meet the same 400 as a chat's."""
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    knobs = {"model": MODEL, "max_output_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = oa.responses.create(input="Hello there", **knobs)
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                      max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.output_text == chat.choices[0].message.content and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens == chat.usage.prompt_tokens
    with oa.responses.stream(input="Hello there", **knobs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text and final.usage.output_tokens == 6
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.status == "incomplete"
    assert "response.output_text.delta" in kinds
    tool = {"type": "function", "name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"]}}
    called = oa.responses.create(model=MODEL, input="pick", max_output_tokens=400, tools=[tool],
                                 tool_choice="required", parallel_tool_calls=False)
    (call,) = [o for o in called.output if o.type == "function_call"]
    assert call.name == "pick" and json.loads(call.arguments)["side"] in ("left", "right") and call.call_id
    shaped = oa.responses.create(model=MODEL, input="ok?", max_output_tokens=300, text={"format": {
        "type": "json_schema", "name": "v", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                       "required": ["ok"], "additionalProperties": False}}})
    assert isinstance(json.loads(shaped.output_text)["ok"], bool)
    turn = [{"role": "user", "content": "pick"}, {"type": "function_call", "call_id": call.call_id, "name": "pick",
                                                  "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    assert oa.responses.create(input=turn, tools=[tool], tool_choice="none", **knobs).usage.output_tokens == 6
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(input="x", previous_response_id="resp_0", **knobs)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(input="x", extra_headers={"x-slo-ttft-ms": "0.001"}, **knobs)
    assert e.value.code == "slo_unattainable"
    for cap in (0, 10**9):  # its errors name its own fields, not those of the chat it runs as
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(model=MODEL, input="x", max_output_tokens=cap)
        assert e.value.body["param"] == "max_output_tokens" and "max_completion_tokens" not in e.value.body["message"]


def test_openai_client(base_url: str) -> None:
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in oa.models.list()][0] == MODEL

    c = oa.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 4 and c.choices[0].finish_reason == "length"
    chunks = list(oa.completions.create(model=MODEL, prompt="The sky is", max_tokens=16, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices]
    # every token arrives, the last chunk says why it ended; how many chunks carry them is the server's to choose
    # (a replica whose event loop fell behind the engine merges the tokens queued meanwhile into one delta)
    assert pieces and chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    stream = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)

    two = oa.completions.create(model=MODEL, prompt="x", max_tokens=4, n=2, extra_body={"ignore_eos": True})
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.completion_tokens == 8
    lp = oa.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.tokens) == 4 and len(lp.choices[0].logprobs.top_logprobs[0]) in (2, 3)
    lp = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.content) == 3 and len(lp.choices[0].logprobs.content[0].top_logprobs) == 2
    echoed = oa.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("The sky is")
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=MODEL, prompt="x", max_tokens=4, suffix="!")
    best = oa.completions.create(model=MODEL, prompt="x", max_tokens=4, best_of=3, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.usage.completion_tokens == 12
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):  # the client's structured outputs: its strict json_schema of the model
        answer: Literal["yes", "no"]
        sure: bool
        score: int = Field(ge=-3, le=12)  # constrained fields: kept, not refused
        why: str = Field(min_length=1, max_length=8)
    parsed = oa.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "ok?"}], max_tokens=600,
                                       response_format=Verdict)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"]}}}
    called = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=400,
                                        tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}})
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments)["side"] in ("left", "right")
    with oa.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=400,
                                    tools=[tool], tool_choice="required", parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
    assert json.loads(call.function.arguments)["side"] in ("left", "right")
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="gpt-4o", prompt="x", max_tokens=4)
    assert e.value.code == "model_not_found"
    # an SLO no replica can meet is not retried (a 400), even by a client that retries 429s and 5xx
    retrying = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=3, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        retrying.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_headers={"x-slo-ttft-ms": "0.001"})
    assert e.value.code == "slo_unattainable" and "x-kairos-slo-best-ttft-ms" in e.value.response.headers


def test_a_clients_x_request_id_names_its_response_and_is_echoed(client: httpx.Client) -> None:
    """vLLM's: `X-Request-Id` names the response (`chatcmpl-<id>`, `cmpl-<id>`) and comes back as a header; two
    requests of one id at once are both served (the engine's ids stay unique)."""
    import concurrent.futures

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda _: client.post("/v1/chat/completions", json=chat,
                                                 headers={"x-request-id": "trace-7"}), range(2)))
    for r in rs:
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "chatcmpl-trace-7" and r.headers["x-request-id"] == "trace-7"
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 2, "stream": True},
                    headers={"x-request-id": "trace-8"})
    events = [json.loads(e) for e in sse_events(r)[:-1]]
    assert events and all(e["id"] == "cmpl-trace-8" for e in events) and r.headers["x-request-id"] == "trace-8"
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 0}, headers={"x-request-id": "trace-9"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-9"  # (a refusal too)
    assert client.get("/v1/models", headers={"x-request-id": "trace-10"}).headers["x-request-id"] == "trace-10"
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 2}, headers={"x-request-id": "x" * 300})
    assert r.json()["id"].startswith("cmpl-") and "x" * 300 not in r.json()["id"]  # too long: the server names it
    # the body's request_id (vLLM's) names it where no header does; the header wins
    r = client.post("/v1/chat/completions", json={**chat, "request_id": "body-1"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-body-1", r.text
    for sent in ({**chat, "request_id": "日本"}, {**chat, "request_id": "日本", "max_tokens": 0},
                 {**chat, "request_id": "日本", "stream": True}):  # one no header can carry: the server names it
        r = client.post("/v1/chat/completions", json=sent)  # (was a 500: the id is in x-kairos-request-id)
        assert r.status_code == (400 if sent.get("max_tokens") == 0 else 200), r.text
        assert r.headers["x-kairos-request-id"].startswith("chatcmpl-") and "日本" not in r.text
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 2, "request_id": "body-2"},
                    headers={"x-request-id": "trace-11"})
    assert r.json()["id"] == "cmpl-trace-11"
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 0, "request_id": "body-3"})
    assert r.status_code == 400 and r.headers["x-kairos-request-id"] == "cmpl-body-3"  # (a refusal too)
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "request_id": "resp_body-4"})
    assert r.json()["id"] == "resp_body-4", r.text  # (vLLM's Responses API: the body's id as it is)
    # a value that is not UTF-8 (python-requests sends a Latin-1 "é" as one byte) in a header Serve reads: HAProxy
    # drops it, and the server names the request (was a plain-text 500 from Serve's replica, /health's too)
    latin1 = {"x-request-id": b"req-\xe9", "x-session-id": b"\xff\xfe", "serve_multiplexed_model_id": b"\xe9"}
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 2}, headers=latin1)
    assert r.status_code == 200 and r.json()["id"].startswith("cmpl-") and "req-" not in r.json()["id"], r.text
    assert client.get("/health", headers=latin1).status_code == 200
    twice = [("x-request-id", "ok"), ("x-request-id", b"\xe9")]  # (Serve reads the last)
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 2}, headers=twice)
    assert r.status_code == 200 and not r.json()["id"].startswith("cmpl-ok"), r.text
    r = client.post("/v1/completions", json={"prompt": "m", "max_tokens": 2},
                    headers={"x-request-id": "req-é".encode()})
    assert r.status_code == 200 and r.json()["id"].startswith("cmpl-req-")  # (UTF-8: kept, read as Latin-1 as vLLM's)


def test_a_priority_without_priority_scheduling_is_accepted(client: httpx.Client) -> None:
    """vLLM's (0.32): under the default scheduling_policy fcfs a request's priority, in its body or vLLM's
    X-Vllm-Priority header (ignored where it is not an integer), has no effect and is no error."""
    body = {"prompt": "m", "max_tokens": 2}
    assert client.post("/v1/completions", json={**body, "priority": 3}).status_code == 200
    assert client.post("/v1/completions", json=body, headers={"x-vllm-priority": "-2"}).status_code == 200
    assert client.post("/v1/completions", json=body, headers={"x-vllm-priority": "soon"}).status_code == 200


def test_metrics_on_the_serving_port(client: httpx.Client) -> None:
    """/metrics on the serving port (through Serve's HAProxy): the Ray metrics agent's kairos and Serve series, and
    vLLM's series under vLLM's own names (`vllm:*`, tagged model_name), in Prometheus text format, as a vLLM user's
    scraper and dashboards expect them."""
    import time

    assert client.post("/v1/completions", json={"prompt": "m", "max_tokens": 3}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "m", "max_tokens": 3},
                       headers={"x-slo-ttft-ms": "0.001"}).status_code == 400
    want = {"ray_kairos_ttft_s_bucket", "ray_kairos_generation_tokens_total", "ray_kairos_kv_blocks_free",
            "ray_kairos_requests_rejected_total", "ray_kairos_decode_steps_total",
            "ray_kairos_decode_step_over_model_sum_total", "ray_kairos_scheduler_policy",
            "ray_kairos_event_loop_lag_s_bucket", "ray_kairos_prefix_cache_queries_total",
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:request_time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:generation_tokens_total",
            "vllm:prompt_tokens_total", "vllm:request_success_total", "vllm:request_prompt_tokens_sum"}
    deadline, names, text = time.monotonic() + 30, set(), ""
    while time.monotonic() < deadline:  # the agent takes what the replicas report every second (conftest)
        r = client.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
        names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
        if want <= names and 'reason="slo_unattainable"' in text:
            break
        time.sleep(0.5)
    assert want <= names, want - names
    assert all(n.startswith(("ray_kairos_", "ray_serve_", "vllm:")) for n in names), names
    assert not any("_exact_sum" in n for n in names)  # (the exact totals stand in for vLLM's histograms' _sum)
    assert 'vllm:request_success_total{' in text and 'finished_reason="length"' in text
    assert 'model_name="kairos-tiny"' in text
    assert 'reason="slo_unattainable"' in text and 'deployment="LLMServer"' in text
    # the latency model against the replicas' decode-only steps, by decode rows, as bench.slo reads it
    from bench.driver import server_decode_over_model

    by_rows = server_decode_over_model(str(client.base_url), settle_s=0.5, limit_s=5.0)
    assert by_rows and all(v["steps"] >= 1 and v["mean"] > 0 for v in by_rows.values()), by_rows
    # the replica's event loop, as slo_gpu reads it between runs
    from bench.driver import lag_between, loop_lag, server_metrics

    lag = lag_between(server_metrics(str(client.base_url), loop_lag, limit_s=0.0), None)
    assert lag and lag["wakeups"] >= 1 and lag["mean_ms"] >= 0 and lag["p99_le_ms"] > 0, lag


def test_beam_search_returns_the_best_beams(client: httpx.Client) -> None:
    """vLLM's use_beam_search: n beams, best first; one beam over a reply that cannot end early is the greedy reply;
    the beams of a wider search are distinct replies of max_tokens tokens; streamed, each beam in one chunk; what a
    beam search does not honour is a 400 naming it."""
    import json as json_

    cmpl = {"prompt": "The quick brown fox", "max_tokens": 6, "ignore_eos": True}
    greedy = client.post("/v1/completions", json={**cmpl, "temperature": 0}).json()["choices"][0]["text"]
    one = client.post("/v1/completions", json={**cmpl, "use_beam_search": True})
    assert one.status_code == 200 and one.json()["choices"][0]["text"] == greedy, one.text
    greedy_beams = [c["text"] for c in client.post("/v1/completions", json={
        **cmpl, "use_beam_search": True, "n": 2}).json()["choices"]]
    r = client.post("/v1/completions", json={**cmpl, "use_beam_search": True, "n": 3, "length_penalty": 0.5,
                                              "prompt": ["The quick brown fox", "Once upon a time"]})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6)) and all(c["finish_reason"] == "length" for c in choices)
    assert len({c["text"] for c in choices[:3]}) == 3 and len({c["text"] for c in choices[3:]}) == 3
    assert r.json()["usage"]["completion_tokens"] == 36
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                     "use_beam_search": True, "n": 2, "return_token_ids": True})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text
    # (vLLM's return_token_ids: each beam's tokens, and the prompt's)
    assert chat.json()["prompt_token_ids"] and all(len(c["token_ids"]) == 4 for c in chat.json()["choices"])
    with client.stream("POST", "/v1/completions", json={**cmpl, "use_beam_search": True, "n": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as st:
        events = sse_events(st)
    assert events[-1] == "[DONE]"
    chunks = [json_.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1] and chunks[2]["usage"]["completion_tokens"] == 12
    assert chunks[0]["choices"][0]["text"] == greedy_beams[0]
    for bad, param in (({"stop": ["x"]}, "stop"), ({"n": 11}, "n"), ({"logprobs": 2}, "logprobs"),
                       ({"logprobs": 0}, "logprobs")):
        r = client.post("/v1/completions", json={**cmpl, "use_beam_search": True, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    # (without beam search length_penalty has no effect, as vLLM's)
    r = client.post("/v1/completions", json={**cmpl, "use_beam_search": False, "length_penalty": 2.0})
    assert r.status_code == 200, r.text


def test_a_beam_searchs_reply_is_capped_by_the_context_the_prompt_leaves(client: httpx.Client) -> None:
    """A beam search's steps are requests of one token each, so its reply's cap is checked as a generation's is
    (vLLM's): a chat without max_tokens searches to the end of the context (was: 1 token), a max_tokens beyond the
    context left is a 400 before any step (was: a 400 on the prompt once the beams reached the end), and a prompt
    that fills the context is a 400."""
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    beam = {"use_beam_search": True, "n": 2, "ignore_eos": True, "return_token_ids": True}
    r = client.post("/v1/completions", json={"prompt": [5] * (limit - 3), "max_tokens": 10, **beam})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens"), err
    assert err["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 10.")
    r = client.post("/v1/completions", json={"prompt": [5] * limit, "max_tokens": 1, **beam})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    words = 50  # a chat whose template leaves 3 tokens of the context
    for _ in range(4):
        turns = [{"role": "user", "content": "a " * words}]
        count = client.post("/tokenize", json={"messages": turns}).json()["count"]
        if count == limit - 3:
            break
        words += limit - 3 - count
    assert count == limit - 3, count
    r = client.post("/v1/chat/completions", json={"messages": turns, **beam})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(len(c["token_ids"]) == 3 and c["finish_reason"] == "length" for c in choices)


def test_return_token_ids_gives_the_reply_and_prompt_token_ids(client: httpx.Client) -> None:
    """vLLM's `return_token_ids`: a completion's choice has its reply's `token_ids` and its prompt's
    `prompt_token_ids`, a chat's response the prompt's (the template rendered) and each choice its reply's; streamed,
    each chunk its tokens' ids and the first the prompt's. The ids are the reply's: /detokenize makes its text, and
    /tokenize gives the prompt's."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    assert c["prompt_token_ids"] == [5, 6, 7] and len(c["token_ids"]) == 6
    assert client.post("/detokenize", json={"tokens": c["token_ids"]}).json()["prompt"] == c["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(e)["choices"][0] for e in sse_events(s)[:-1]]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7] and all("prompt_token_ids" not in x for x in chunks[1:])
    assert [t for x in chunks for t in x["token_ids"]] == c["token_ids"]
    two = client.post("/v1/completions", json={**body, "prompt": [[5, 6], [7]]}).json()["choices"]
    assert [x["prompt_token_ids"] for x in two] == [[5, 6], [7]]  # a batch: each choice its own prompt's
    assert "token_ids" not in client.post("/v1/completions", json={**body, "return_token_ids": False}).json()[
        "choices"][0]  # not asked: not given

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    prompt = client.post("/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    r = client.post("/v1/chat/completions", json={**chat, "n": 2}).json()
    assert r["prompt_token_ids"] == prompt and all(len(x["token_ids"]) == 5 for x in r["choices"])
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        events = [json.loads(e) for e in sse_events(s)[:-1]]
    assert events[0]["prompt_token_ids"] == prompt and "token_ids" not in events[0]["choices"][0]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == r["choices"][0]["token_ids"]
