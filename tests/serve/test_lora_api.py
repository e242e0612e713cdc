"""LoRA adapters over HTTP, as vLLM's `--lora-modules` serves them: a request's `model` names the adapter, /v1/models
lists it with its parent, its reply is PEFT's, and the prefix cache keeps each adapter's and each cache_salt's KV
apart."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import TEST_ARGS, SideApp, side_app_url

LORA_APP, LORA_PREFIX, ADAPTER = "kairos-lora", "/lora", "tiny-sql"
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog runs after the fox into the woods."


def _adapter(tmp: Path) -> Path:
    from engine.default_model import ensure_default_model
    from engine.testing import build_tiny_lora

    return build_tiny_lora(ensure_default_model("kairos-tiny"), tmp / ADAPTER, seed=3, scale=4.0)


def _lora_app(tmp: Path):
    import shutil

    from deployments import build_app

    adapter = _adapter(tmp)
    shutil.copytree(adapter, tmp / "on-demand" / "dyn")  # the same adapter, loaded at its first request
    return build_app({**TEST_ARGS, "num_replicas": 1, "lora_modules": f"{ADAPTER}={adapter}",
                      "dynamic_lora_loading_path": str(tmp / "on-demand"), "enable_prompt_tokens_details": True,
                      "allow_runtime_lora_updating": True})


SIDE_APP = SideApp(LORA_APP, LORA_PREFIX, _lora_app)


@pytest.fixture(scope="module")
def lora_url(serve_app: dict):
    yield from side_app_url(serve_app, SIDE_APP, blocking=False)


def _peft_greedy(adapter: Path | None, ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.default_model import ensure_default_model

    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model("kairos-tiny"), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    model = model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    vocab = len(AutoTokenizer.from_pretrained(ensure_default_model("kairos-tiny")))
    beyond = list(range(vocab, model.get_output_embeddings().weight.shape[0]))  # rows no token decodes to
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             suppress_tokens=beyond)
    return out[0, len(ids):].tolist()


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True, "logprobs": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(resp: dict) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in resp["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_the_adapter_with_its_parent(lora_url):
    cards = {c["id"]: c for c in httpx.get(lora_url + "/v1/models", timeout=10).json()["data"]}
    assert cards[ADAPTER]["parent"] == "kairos-tiny" and cards[ADAPTER]["root"].endswith(ADAPTER)
    assert cards["kairos-tiny"]["parent"] is None
    assert cards["kairos-tiny:dyn"]["parent"] == "kairos-tiny"  # (the folder's adapter, loaded on demand)
    one = httpx.get(lora_url + f"/v1/models/{ADAPTER}", timeout=10)
    assert one.status_code == 200 and one.json()["parent"] == "kairos-tiny"
    for missing in ("nope", "kairos-tiny:nope", "other:dyn", "kairos-tiny:../on-demand/dyn"):
        r = httpx.post(lora_url + "/v1/completions", json={"model": missing, "prompt": "hi"}, timeout=10)
        assert r.status_code == 404 and ADAPTER in r.json()["error"]["message"], missing
    one = httpx.get(lora_url + "/v1/models/kairos-tiny:dyn", timeout=10).json()
    assert one["parent"] == "kairos-tiny" and one["root"].endswith("dyn")


def test_a_request_naming_the_adapter_gets_peft_s_reply(lora_url, tmp_path):
    """The same prompt through the base model and through the adapter: each reply is its model's, token for token
    (PEFT's own forward with the adapter's files, built again here from the same seed)."""
    adapter = _adapter(tmp_path)
    tok = httpx.post(lora_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    base = _complete(lora_url, model="kairos-tiny", return_tokens_as_token_ids=True)
    lora = _complete(lora_url, model=ADAPTER, return_tokens_as_token_ids=True)
    assert lora["model"] == ADAPTER
    assert _ids(base) == _peft_greedy(None, tok, 8)
    assert _ids(lora) == _peft_greedy(adapter, tok, 8) != _ids(base)
    dyn = _complete(lora_url, model="kairos-tiny:dyn", return_tokens_as_token_ids=True)  # Ray Serve LLM's form
    assert _ids(dyn) == _ids(lora) and dyn["model"] == "kairos-tiny:dyn"
    chat = httpx.post(lora_url + "/v1/chat/completions", json={
        "model": ADAPTER, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "stream": True,
        "temperature": 0}, timeout=60)
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")


def test_the_prefix_cache_is_the_adapter_s_and_the_salt_s_own(lora_url):
    prompt = "A prompt of its own, long enough for a block or two of the cache: " + PROMPT  # nothing cached it yet

    def cached(**body) -> int:
        return _complete(lora_url, prompt=prompt, **body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(model="kairos-tiny")
    assert cached(model="kairos-tiny") > 0
    assert cached(model=ADAPTER) == 0  # the base model's KV is not the adapter's
    assert cached(model=ADAPTER) > 0
    assert cached(model=ADAPTER, cache_salt="user-1") == 0
    assert cached(model=ADAPTER, cache_salt="user-1") > 0
    assert cached(model=ADAPTER, cache_salt="user-2") == 0
    r = httpx.post(lora_url + "/v1/completions", json={"prompt": "hi", "cache_salt": ""}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_adapters_load_and_unload_at_run_time(lora_url, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter
    loaded at run time serves PEFT's reply; loaded again in place (the folder written again), the new one; once
    unloaded, its name is a 404. Bad loads get vLLM's statuses, and the served app without the knob has no such
    routes."""
    import shutil

    from engine.default_model import ensure_default_model
    from engine.testing import build_tiny_lora

    def load(**body) -> httpx.Response:
        return httpx.post(lora_url + "/v1/load_lora_adapter", json=body, timeout=60)

    def unload(**body) -> httpx.Response:
        return httpx.post(lora_url + "/v1/unload_lora_adapter", json=body, timeout=60)

    first = _adapter(tmp_path)
    other = build_tiny_lora(ensure_default_model("kairos-tiny"), tmp_path / "other", seed=11, scale=4.0)
    folder = tmp_path / "rt"
    shutil.copytree(first, folder)
    tok = httpx.post(lora_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]

    r = load(lora_name="rt", lora_path=str(folder))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt' added successfully.", r.text
    cards = {c["id"]: c for c in httpx.get(lora_url + "/v1/models", timeout=10).json()["data"]}
    assert cards["rt"]["root"] == str(folder) and cards["rt"]["parent"] == "kairos-tiny"
    got = _complete(lora_url, model="rt", return_tokens_as_token_ids=True)
    assert got["model"] == "rt" and _ids(got) == _peft_greedy(first, tok, 8)

    again = load(lora_name="rt", lora_path=str(folder))
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    shutil.rmtree(folder)
    shutil.copytree(other, folder)
    assert load(lora_name="rt", lora_path=str(folder), load_inplace=True).status_code == 200
    assert _ids(_complete(lora_url, model="rt", return_tokens_as_token_ids=True)) == _peft_greedy(other, tok, 8)

    for body, status, param in [({"lora_name": "x"}, 400, "lora_path"), ({"lora_path": str(folder)}, 400, "lora_name"),
                                ({"lora_name": "kairos-tiny", "lora_path": str(folder)}, 400, "lora_name"),
                                ({"lora_name": ADAPTER, "lora_path": str(folder)}, 400, "lora_name"),
                                ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, 404, "lora_path")]:
        r = load(**body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
    dora = tmp_path / "dora"
    shutil.copytree(first, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    r = load(lora_name="x", lora_path=str(dora))
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]
    assert httpx.post(lora_url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=10).status_code == 404

    r = unload(lora_name="rt")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt' removed successfully."
    r = httpx.post(lora_url + "/v1/completions", json={"model": "rt", "prompt": "hi"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "rt" not in {c["id"] for c in httpx.get(lora_url + "/v1/models", timeout=10).json()["data"]}
    r = unload(lora_name="rt")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'rt' cannot be found."
    assert unload().status_code == 400
    assert _complete(lora_url, model=ADAPTER)["model"] == ADAPTER  # the others serve on


def test_run_time_loading_is_off_unless_asked_for(serve_app):
    from tests.serve.conftest import BASE_URL

    r = httpx.post(BASE_URL + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}, timeout=10)
    assert r.status_code == 404 and "allow_runtime_lora_updating" in r.json()["error"]["message"]


def test_run_time_loading_needs_one_front_replica():
    from deployments import build_app

    with pytest.raises(ValueError, match="front replica"):
        build_app({**TEST_ARGS, "num_replicas": 2, "ingress_num_replicas": 2, "allow_runtime_lora_updating": True})
