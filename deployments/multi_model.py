"""Several models in one app (Ray Serve LLM's `build_openai_app` with several `llm_configs`).

Each model is its own LLM deployment (`LLMServer:<served name>`: its replicas, its SLO router, its scheduler) and
has its own front, an `IngressFrontend` as a one-model app's Ingress is; one Ingress replica holds them all and
sends each request to the front of the model its `model` names (as Ray Serve LLM's: a request that names none is a
400, one that names no model served here a 404, each listing those that are). `GET /v1/models` lists every model
and adapter; `/health` is 200 once every model can serve. The API keys, CORS and body limit are the app's (given on
any model, alike where on several: `deployments._front_args`). What a front owns stays its own: its handle, its
readiness, its LoRA adapters. Adapters loaded at run time (`/v1/load_lora_adapter`) have no model to go to here: those routes
are a 404, as they are where runtime loading is off.
"""
from __future__ import annotations

import re
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from deployments.errors import APIError, model_not_found
from deployments.ingress import (GENERATION_ROUTES, SERVER_VERSION, GenerationFastPath, IngressFrontend, _api_error,
                                 _drain, _http_error, _unexpected, is_json_content_type, named_send, openai_api,
                                 parse_body, route_path)

BODY_ROUTES = ("/tokenize", "/detokenize")  # the other routes whose body names a model


def deployment_name(served: str) -> str:
    """A model's LLM deployment's name in an app of several: `LLMServer:<served name>`, its `/` as `--` and its `.`
    as `_` (Ray Serve LLM's), any other character a name may not hold as `_`."""
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_:-]", "_", served.replace("/", "--").replace(".", "_"))


def model_of(body: bytes) -> tuple[bool, Any]:
    """(whether it is a JSON object, its `model`) of a request's body."""
    try:
        raw = parse_body(body)
    except (ValueError, RecursionError):  # (UnicodeError too: the front's 400 says why)
        return False, None
    if not isinstance(raw, dict):
        return False, None
    model = raw.get("model")
    return True, None if model == "" else model  # ("": no model named, as null)


class MultiModelFrontend:
    """The Ingress of an app of several models: a front per model (`IngressFrontend`), and the ASGI app that sends
    each request to the front of the model it names."""

    async def __init__(self, llms: list[Any], settings: list[dict[str, Any]]) -> None:
        self.fronts: list[IngressFrontend] = []
        for llm, s in zip(llms, settings, strict=True):
            front = IngressFrontend.__new__(IngressFrontend)
            await front.__init__(llm, s)  # type: ignore[misc] - (its constructor is a coroutine, as Serve runs it)
            self.fronts.append(front)
        # each model's other names (its checkpoint's, their aliases), known before its replicas answer
        self._aliases = [set(s.get("aliases", ())) for s in settings]
        self.max_body_bytes: int = settings[0]["max_body_bytes"]
        self._cors: dict[str, Any] = settings[0].get("cors") or {}

    def front_for(self, model: Any) -> IngressFrontend | None:
        """The front of the model (or adapter) a request's `model` names: by its served name first (a model named
        `tiny:x` is not the adapter `x` of model `tiny`'s folder), then an adapter's, then by another name it is
        known by (its checkpoint's: the first model's where several share one)."""
        if not isinstance(model, str):
            return None
        for front in self.fronts:
            if model == front.served_model_name:
                return front
        for front in self.fronts:
            if front._lora_of(model) is not None:
                return front
        return next((f for f, aliases in zip(self.fronts, self._aliases)
                     if model in aliases or model in f._served_names()), None)

    def _names(self) -> list[str]:
        return list(dict.fromkeys(n for f in self.fronts for n in f._model_names()))

    @property
    def docs_path(self) -> str | None:
        """Where Serve's status and dashboard point for the API docs (the FastAPI app's: `_api`)."""
        return getattr(getattr(self, "app", None), "docs_url", None)

    def __serve_build_asgi_app__(self) -> "_Routes":
        """Serve runs this ASGI app (`OpenAIFrontend.__serve_build_asgi_app__`'s counterpart)."""
        return _Routes(self, self.app, self._cors.get("origins", ()),  # type: ignore[arg-type,attr-defined]
                       self._cors.get("credentials", False))

    async def route(self, scope: Scope, receive: Receive, send: Send, fallback: Callable) -> None:
        path, method = route_path(scope), scope["method"]
        if method == "POST" and (path in GENERATION_ROUTES or path in BODY_ROUTES):
            await self._by_body(scope, receive, send, path)
            return
        request = Request(scope, receive)
        if method == "GET" and path == "/v1/models":
            response = await _answer(self._models, request)
        elif method == "GET" and path.startswith("/v1/models/"):
            response = await _answer(self._model, request, path[len("/v1/models/"):])
        elif (method in ("GET", "HEAD") and path == "/health") or (method in ("GET", "POST") and path == "/ping"):
            response = await _answer(self._health)
        elif method == "GET" and path == "/version":
            response = JSONResponse({"version": SERVER_VERSION})
        elif method == "GET" and path == "/metrics":
            response = await _answer(self.fronts[0].prometheus_metrics)
        elif (allowed := _allowed(path)) is not None:  # a route of the app's, another method (as a one-model app's)
            response = await _api_error(request, APIError(405, "Method Not Allowed",
                                                          headers={"Allow": ", ".join(allowed)}))
        else:
            await fallback(scope, receive, named_send(send))  # (FastAPI's: the docs, a 404 in OpenAI's shape)
            return
        await response(scope, receive, named_send(send))

    async def _by_body(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """A request whose body names its model: read here (up to the body limit), then given whole to that model's
        front, which reads, checks and answers it as a one-model app's Ingress does."""
        request = Request(scope, receive)
        try:
            self.fronts[0]._auth(request)  # (before the body is read, as a one-model app's: no model named)
        except APIError as e:
            await _drain(request.stream())
            await (await _api_error(request, e))(scope, receive, named_send(send))
            return
        body, whole = await _read(receive, self.max_body_bytes)
        is_object, model = model_of(body) if whole and is_json_content_type(request.headers.get("content-type")) \
            else (False, None)
        # (the first front refuses what is not JSON, or a `model` that is not a string)
        front = self.front_for(model) if is_object and (model is None or isinstance(model, str)) else self.fronts[0]
        if front is None and model is None and path in BODY_ROUTES:
            front = self.fronts[0]  # (vLLM's /tokenize takes no model: the first's tokenizer)
        if front is None:  # (Ray Serve LLM's answers)
            e = APIError(400, "Model parameter is required when multiple models are configured. Available models: "
                         f"{self._names()}", param="model") if model is None else \
                model_not_found(str(model), self._names())
            await (await _api_error(request, e))(scope, receive, named_send(send))
            return
        replay = _replay(body, whole, receive)
        if path in GENERATION_ROUTES:
            await front._serve_generation(scope, replay, send, GENERATION_ROUTES[path])
            return
        handler = front.tokenize if path == "/tokenize" else front.detokenize
        response = await _answer(handler, Request(scope, replay))
        await response(scope, replay, named_send(send))

    async def _models(self, request: Request) -> dict[str, Any]:
        """Every model's cards: first each one's own (its served name, its adapters: what `front_for` routes to it
        first), then the other names they are known by (a checkpoint's) that no model has as its own."""
        lists = [(await front.models(request))["data"] for front in self.fronts]
        own = [[c for c in data if c["id"] == front.served_model_name or front._lora_of(c["id"]) is not None]
               for front, data in zip(self.fronts, lists)]
        served = {front.served_model_name for front in self.fronts}  # (a model's own name over another's adapter)
        own = [[c for c in data if c["id"] == front.served_model_name or c["id"] not in served]
               for front, data in zip(self.fronts, own)]
        cards: list[dict[str, Any]] = []
        seen: set[str] = set()
        for data in own + lists:
            for card in data:
                if card["id"] not in seen:
                    seen.add(card["id"])
                    cards.append(card)
        return {"object": "list", "data": cards}

    async def _model(self, request: Request, model_id: str) -> dict[str, Any]:
        front = self.front_for(model_id)
        if front is None:
            self.fronts[0]._auth(request)  # (an unknown model is no answer to a request without a key)
            raise model_not_found(model_id, self._names())
        return await front.model(request, model_id)

    async def _health(self) -> Any:
        """200 once every model can serve; else the first one's 503 that cannot (`starting`, `unavailable`)."""
        for front in self.fronts:
            got = await front.health()
            if isinstance(got, Response):
                return got
        return {"status": "ok"}


class _Routes(GenerationFastPath):
    """The ASGI app Serve runs for `MultiModelFrontend`: `GenerationFastPath`'s CORS and Serve hooks, the routing
    by model behind them."""

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.frontend.route(scope, receive, send, self.api)  # type: ignore[attr-defined]


async def _read(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """A request's body up to `limit` bytes, and whether that is all of it (else the front answers the 413)."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(body), False
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body), True
        if len(body) > limit:
            return bytes(body), False


def _replay(body: bytes, whole: bool, receive: Receive) -> Receive:
    """A `receive` that gives `body` first (as one message; the rest of the client's after it where it was not
    whole), then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not whole}
        return await receive()
    return replay


async def _answer(handler: Callable[..., Awaitable[Any]], *args: Any) -> Response:
    """A front's route handler's answer as a response: a dict as JSON, an APIError as OpenAI's error."""
    try:
        got = await handler(*args)
    except APIError as e:
        return await _api_error(None, e)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - as the one-model app's FastAPI handler: logged, a 500
        return await _unexpected(None, e)  # type: ignore[arg-type]
    return got if isinstance(got, Response) else JSONResponse(got)


def _api() -> FastAPI:
    """The FastAPI app behind the routes (`serve.ingress` needs one): lifespan, a 404 in OpenAI's shape, and the
    OpenAPI description (/openapi.json, /docs) of the routes the app answers: a one-model app's, less runtime LoRA
    loading."""
    api = FastAPI(title="Kairos", version=SERVER_VERSION, description="SLO-aware OpenAI-compatible LLM server")
    api.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = openai_api().openapi()
            schema["paths"] = {path: ops for path, ops in schema["paths"].items()
                               if _allowed(path.replace("{model_id}", "x")) is not None}
            api.openapi_schema = schema
        return api.openapi_schema
    api.openapi = openapi  # type: ignore[method-assign]
    return api


MultiModelIngress = serve.deployment(serve.ingress(_api())(MultiModelFrontend), name="Ingress",
                                     ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1_000_000)


# the app's routes other than those whose body names a model, and the methods each takes; `route` answers them
OWN_ROUTES: dict[str, tuple[str, ...]] = {"/v1/models": ("GET",), "/version": ("GET",), "/metrics": ("GET",),
                                          "/health": ("GET", "HEAD"), "/ping": ("GET", "POST")}


def _allowed(path: str) -> tuple[str, ...] | None:
    """The methods the app answers `path` with (None: no route of its own: FastAPI's fallback)."""
    if path in GENERATION_ROUTES or path in BODY_ROUTES:
        return ("POST",)
    return ("GET",) if path.startswith("/v1/models/") else OWN_ROUTES.get(path)
