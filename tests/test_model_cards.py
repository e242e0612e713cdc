"""/v1/models of a one-model and a several-model front, in-process (stand-in replicas, no Ray): the cards a request's
`model` reaches, each with its checkpoint as its root, the adapters of dynamic_lora_loading_path among them."""
import asyncio
import json

from deployments.ingress import IngressFrontend
from deployments.multi_model import MultiModelFrontend, _api, _Routes


class _Front(IngressFrontend):
    info: dict | None = None

    def _ready_info(self):
        return self.info

    def _unavailable(self):
        return None


def _front(name: str, checkpoint: str, max_len: int, **settings) -> _Front:
    f = object.__new__(_Front)
    f._init_frontend({"model_name": name, "max_body_bytes": 1 << 20, **settings})
    f.info = {"model": checkpoint, "max_model_len": max_len}
    return f


def _get(app, path: str, method: str = "GET") -> tuple[int, dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_model_cards_name_their_checkpoint_and_list_the_adapters_of_the_folder(tmp_path) -> None:
    """A card's root is the checkpoint (vLLM's model path: clients find the tokenizer by it; it was the served
    name); the folders of dynamic_lora_loading_path that hold an adapter are listed as `<model>:<folder>` (Ray
    Serve LLM's list; they were served but never listed)."""
    for name in ("foo", "bar"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "not-an-adapter").mkdir()
    f = _front("tiny-b", "kairos-tiny", 256, dynamic_lora_loading_path=str(tmp_path))
    m = object.__new__(MultiModelFrontend)
    m.fronts, m._aliases, m.max_body_bytes, m._cors = [f], [set()], 1 << 20, {}
    status, body = _get(_Routes(m, _api()), "/v1/models")
    cards = {c["id"]: c for c in body["data"]}
    assert status == 200 and cards["tiny-b"]["root"] == "kairos-tiny" and cards["tiny-b"]["parent"] is None
    assert cards["tiny-b:bar"]["parent"] == "tiny-b" and cards["tiny-b:bar"]["root"] == str(tmp_path / "bar")
    assert "tiny-b:foo" in cards and not any("not-an-adapter" in c for c in cards)


def test_several_models_each_list_their_own_card_before_names_they_share() -> None:
    """Model b is served as `kairos-tiny`, model a's checkpoint: requests for that name go to b (served names come
    first), and the list now says so (it gave a's card under b's name: a's root and context window); a name in
    an error's list of models comes once."""
    a, b = _front("a", "kairos-tiny", 512), _front("kairos-tiny", "kairos-tiny", 256)
    m = object.__new__(MultiModelFrontend)
    m.fronts, m._aliases, m.max_body_bytes, m._cors = [a, b], [{"a", "kairos-tiny"}, {"kairos-tiny"}], 1 << 20, {}
    status, body = _get(_Routes(m, _api()), "/v1/models")
    assert [(c["id"], c["max_model_len"]) for c in body["data"]] == [("a", 512), ("kairos-tiny", 256)]
    assert m.front_for("kairos-tiny") is b
    assert m._names() == ["a", "kairos-tiny"]


def test_tokenize_takes_return_token_strs_null_as_vllm_does() -> None:
    from deployments import protocol as P

    assert not P.TokenizeCompletionRequest.model_validate({"prompt": "hi", "return_token_strs": None}).return_token_strs
    assert not P.TokenizeChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                     "return_token_strs": None}).return_token_strs


def test_a_route_of_several_models_asked_with_another_method_is_a_405() -> None:
    """As a one-model app answers (FastAPI's routes) and vLLM's: 405 with the methods it takes, not a 404."""
    m = object.__new__(MultiModelFrontend)
    m.fronts, m._aliases, m.max_body_bytes, m._cors = [_front("a", "kairos-tiny", 512)], [set()], 1 << 20, {}
    app = _Routes(m, _api())
    for method, path in (("GET", "/v1/completions"), ("POST", "/v1/models"), ("DELETE", "/health")):
        status, body = _get(app, path, method)
        assert status == 405 and body["error"]["message"] == "Method Not Allowed", (method, path, body)
    assert _get(app, "/v1/embeddings", "POST")[0] == 404


def test_several_models_describe_their_routes_in_openapi() -> None:
    """/openapi.json (and so /docs) of an app of several models describes the routes it answers, as a one-model app's
    does (it described none): the generation routes with their bodies and SLO headers; no runtime LoRA loading, which
    such an app answers with a 404."""
    m = object.__new__(MultiModelFrontend)
    m.fronts, m._aliases, m.max_body_bytes, m._cors = [_front("a", "kairos-tiny", 512)], [set()], 1 << 20, {}
    status, spec = _get(_Routes(m, _api()), "/openapi.json")
    assert status == 200
    assert set(spec["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize", "/v1/models", "/v1/models/{model_id}", "/health", "/ping",
                                  "/version", "/metrics"}
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert "messages" in chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {p["name"] for p in chat["parameters"]} >= {"x-slo-ttft-ms", "x-slo-tpot-ms"}
    assert set(spec["paths"]["/health"]) == {"get", "head"}
    m.app = _api()  # (Serve sets it)
    assert m.docs_path == "/docs"


def test_a_model_named_like_another_models_adapter_is_that_model(tmp_path) -> None:
    """Model `tiny` reads adapters from a folder holding `x`; model `tiny:x` is served too: a request for `tiny:x`
    is that model's (it went to tiny's adapter x, and `/v1/models` aside, the model could not be reached by its
    name); `tiny:fr` stays tiny's adapter."""
    for name in ("x", "fr"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    tiny = _front("tiny", "kairos-tiny", 1024, dynamic_lora_loading_path=str(tmp_path))
    other = _front("tiny:x", "/ckpt/qwen", 128)
    m = object.__new__(MultiModelFrontend)
    m.fronts, m._aliases, m.max_body_bytes, m._cors = [tiny, other], [set(), set()], 1 << 20, {}
    assert m.front_for("tiny:x") is other and m.front_for("tiny:fr") is tiny and m.front_for("tiny") is tiny
    status, body = _get(_Routes(m, _api()), "/v1/models")
    cards = [c for c in body["data"] if c["id"] == "tiny:x"]
    assert status == 200 and len(cards) == 1 and cards[0]["parent"] is None and cards[0]["root"] == "/ckpt/qwen"
    status, card = _get(_Routes(m, _api()), "/v1/models/tiny:x")
    assert status == 200 and card["parent"] is None and card["root"] == "/ckpt/qwen"
