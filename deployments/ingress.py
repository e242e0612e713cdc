"""OpenAI-compatible HTTP front (FastAPI on Ray Serve): /v1/completions, /v1/chat/completions, /v1/responses,
/v1/models (and /v1/models/{id}), /health, /metrics; vLLM's /ping, /version, /tokenize, /detokenize and
/v1/load_lora_adapter, /v1/unload_lora_adapter.

`OpenAIFrontend` reads every request with a byte cap (413), parses (400) and validates it (400), waits (bounded:
503) where no engine can serve it yet, then starts it and awaits its first item *before* any status is sent, so SLO
rejections, bad prompts and backpressure become proper 4xx/5xx answers and a 200 stream never turns into a 429. A
client that disconnects cancels the stream, which aborts the request in the engine (see replica.py). Where a request
goes is the subclass's part: `Ingress` (the routed topology) sends it to an `LLMServer` replica through a streaming
handle; `deployments.direct` serves HTTP from the LLM replica itself.
"""
# NB: no `from __future__ import annotations`: FastAPI must see real annotations (Request) on Serve methods.

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, NamedTuple, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from core.messages import (ContextLengthExceeded, ErrorKind, GenerateRequest, PromptOptions, PromptTooLong,
                           ProtocolError, RejectReason, RequestOutput, TokenLogprob, chat_texts, check_output, clock_id,
                           waited_since_ms)
from core.request import SLO, FinishReason, LoraSource
from core.sampling import SamplingParams
from deployments import protocol as P
from deployments import responses as R
from deployments.args import load_api_keys
from deployments.errors import (REPLICA_ERRORS, APIError, error_response, item_failure, model_not_found, overloaded,
                                param_named, protocol_failure, replica_failure, unsupported_media_type)
from deployments.haproxy_ingress import RECEIVED_HEADER
from deployments.metrics import PROMETHEUS_CONTENT_TYPE, AgentScraper, replica_wait_histogram
from deployments.openapi import ERROR_RESPONSES, openapi_operation
from deployments.refusals import note_refusal
from deployments.reasoning import ReplyReader
from deployments.tool_calls import KEEPS_SPECIAL_TOKENS
from engine.lora import dynamic_adapter_dir

log = logging.getLogger("ray.serve")
MAX_FOLDER_ADAPTERS = 1000  # the most of dynamic_lora_loading_path's adapters /v1/models lists
SERVER_VERSION = "0.1.0"  # /version, the OpenAPI document (pyproject.toml's)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff: valid JSON, but not encodable text
# the finish reasons of a reply that failed: an error, or its engine stopping under it (a replica shut down aborts the
# requests it holds), a 503 or an error event wherever they come, not a reply that ends `abort` as if it succeeded
FAILED = (FinishReason.ERROR, FinishReason.ABORT)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def parse_body(body: bytes | bytearray) -> Any:
    """A request body's JSON value. Its text decoded strictly (json.loads lets the bytes of a lone surrogate through,
    which no answer naming them could encode: UnicodeDecodeError), no NaN or Infinity (no JSON has them, and an
    answer echoing one would be no JSON: ValueError), and no lone surrogate escape (UnicodeEncodeError: the
    tokenizer would raise TypeError)."""
    data = bytes(body)
    obj = json.loads(data.decode(json.detect_encoding(data)), parse_constant=_no_constant)
    if _SURROGATE_ESCAPE.search(data):
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    return obj


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.code, e.headers, e.param)


# Other names a model is known by, accepted as `model` and listed in /v1/models beside the served name
MODEL_ALIASES: dict[str, tuple[str, ...]] = {
    "kairos-default": ("HuggingFaceTB/SmolLM2-135M-Instruct",),  # what engine/trained_model.py converts
}


def served_names(served: str, model: str | None) -> list[str]:
    """Every name a request's `model` may give, the served name first: the served name, the model the engine
    loaded (`model=`: a kairos name, a hub id or a path), and their aliases (`MODEL_ALIASES`)."""
    names = [served]
    for name in (model, *MODEL_ALIASES.get(served, ()), *MODEL_ALIASES.get(model or "", ())):
        if name and name not in names:
            names.append(name)
    return names


def is_json_content_type(value: str | None) -> bool:
    """`application/json` (any parameters, e.g. charset) or a `+json` type, as FastAPI reads a JSON body."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(400, f"invalid request: {e.errors()}")


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    # an unknown route or method is a request error, as OpenAI types its "Invalid URL" 404
    return error_response(e.status_code, str(e.detail), "invalid_request_error", headers=getattr(e, "headers", None))


async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error in ingress")
    return error_response(500, f"internal error: {type(e).__name__}", "server_error")


def proxy_wait_ms(stamp: str | None, now_s: float | None = None) -> float:
    """The ms between HAProxy reading a request and now (`now_s`, epoch; default the wall clock's), from the stamp
    it set (`haproxy_ingress.received_rule`: `t=<epoch us>,h=<its machine's clock id>`); 0 where there is none, it
    is malformed, or `waited_since_ms` does not count it (another machine's clock, the future, too old)."""
    if not stamp:
        return 0.0
    try:
        fields = dict(part.split("=", 1) for part in stamp.split(","))
        t_s = float(fields["t"]) / 1e6
    except (KeyError, ValueError):
        return 0.0
    return waited_since_ms(fields.get("h"), t_s, time.time() if now_s is None else now_s)


def server_timing(t_in: float, t_call: float, t_first: float, replica_ms: float | None, proxy_ms: float = 0.0) -> str:
    """W3C Server-Timing for the way to the first output: `proxy` (where HAProxy stamped the request on this
    machine's clock: its wait between HAProxy and this handler), `parse` (read, validate), `route` (the handle call: routing plus
    transport both ways, i.e. the rest), `replica` (tokenize, queue, prefill in the replica). Each is measured on one
    clock (the machine's, the ingress's or the replica's), so they hold across machines."""
    wait = (t_first - t_call) * 1000.0
    parts = [f"proxy;dur={proxy_ms:.1f}"] if proxy_ms > 0 else []
    parts.append(f"parse;dur={(t_call - t_in) * 1000.0:.1f}")
    if replica_ms is not None:
        parts += [f"route;dur={max(0.0, wait - replica_ms):.1f}", f"replica;dur={replica_ms:.1f}"]
    else:
        parts.append(f"route;dur={wait:.1f}")
    return ", ".join(parts)


def _validation_message(e: ValidationError, fields: Collection[str] = ()) -> tuple[str, str | None]:
    """A schema error as OpenAI words one: each failing field and why (pydantic's "Value error, " prefix dropped;
    the field named once where its validator's message names it already), and the first failing field as `param`:
    where the body as a whole failed, the field of `fields` its message starts with (None if none)."""
    parts, param = [], None
    for err in e.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("function-after", "function-before")]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        first = msg.split(" ", 1)[0].strip(":,")  # the word a message naming its field starts with
        parts.append(f"{'.'.join(loc)}: {msg}" if loc and first != loc[0] else msg)
        if param is None:
            param = loc[0] if loc else (first if first in fields else None)
    return "; ".join(parts), param


REQUEST_ID_HEADER = "x-request-id"
MAX_CLIENT_REQUEST_ID = 256


def client_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id (or its body's `request_id`) where it can name a response (vLLM's: `chatcmpl-<id>`;
    at most MAX_CLIENT_REQUEST_ID printable characters, each one a header may carry, no space at either end: the
    response's x-kairos-request-id names it), else None (the server names it)."""
    if value and len(value) <= MAX_CLIENT_REQUEST_ID and value.isprintable() and value == value.strip():
        try:
            value.encode("latin-1")  # (a header's value: one a header came with always is)
        except UnicodeEncodeError:
            return None
        return value
    return None


PRIORITY_HEADER = "x-vllm-priority"


def header_priority(value: str | None, given: int) -> int:
    """vLLM's: the X-Vllm-Priority header's integer, where it is one (else it is ignored), wins over the body's
    `priority` (`given`); one past an int64 is a 400, as the body's is."""
    if value is not None and re.fullmatch(r"[+-]?[0-9]+", value.strip()):
        got = int(value)
        if not -2**63 <= got < 2**63:
            raise APIError(400, f"X-Vllm-Priority must be an int64, got {value[:40]}", param="x-vllm-priority")
        return got
    return given


# the X-Request-Id Serve's replica gives a request that came without one (a version 4 UUID: its `RequestIdMiddleware`)
_SERVE_MADE_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


class ResponseIds:
    """A response's id (`rid`) and its requests' ids in the engine (`eid`). As vLLM's, a client's X-Request-Id, else
    its body's `request_id`, names the response (`chatcmpl-<id>`; Serve echoes the header); the engine's ids then
    get a suffix, unique where a client sends one id twice at once. Serve gives every request without the header
    one (a UUID): a body's `request_id` wins over a header that may be Serve's."""

    PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}

    def __init__(self, kind: str, given: str | None) -> None:
        self.prefix = self.PREFIX[kind]
        self._name(given)

    def _name(self, given: str | None, as_given: bool = False) -> None:
        self.given = given
        self.rid = given if as_given and given else self.prefix + (given or uuid.uuid4().hex)
        self.eid = self.rid if given is None else f"{self.rid}.{uuid.uuid4().hex[:8]}"

    def name_by_body(self, value: Any) -> None:
        """The body's `request_id`, where no client's header named the response (one that cannot name it is left
        unused)."""
        if (self.given is None or _SERVE_MADE_ID.fullmatch(self.given)) and isinstance(value, str) \
                and (value := client_request_id(value)) is not None:
            self._name(value, as_given=self.prefix == "resp_")  # (vLLM's Responses API: as given)


IDLE_LOOK_S = 0.5  # a request waiting for an LLM replica looks this often whether the app scaled to zero meanwhile
WAKE_LOG_S = 10.0  # a wake that fails at once (the handle refusing) is logged at most this often
# where an app that scales to zero is down (Serve says its deployment failed), a request waits at most this long
DOWN_WAIT_S = 30.0


class Readiness:
    """Whether the app can serve yet: the Ingress answers HTTP as soon as it is up, often long before an LLM replica
    has loaded its model (12 s for the default model on a 2-core CPU), and a load balancer that sent traffic on the
    Ingress's first 200 would hold every request that long. `watch` calls `probe` (an LLM replica's `model_info`)
    until one call returns, each call bounded by `timeout_s` and retried `retry_s` later; after that `info` holds
    its answer and `ready` stays true. `monitor` then asks again every `period_s` whether an LLM replica can serve:
    `running` (Serve's controller: how many LLM replicas run) says none, or the replica that answers `probe` has a
    dead engine (the router asks a live one first), `failures` times in a row. `down` then says why (the Ingress's
    /health is 503 `unavailable`: Serve is replacing the replicas, and requests meanwhile wait for one or get 503s of
    their own). A probe that times out or meets back pressure proves nothing: it waits behind generate calls on busy
    replicas (Serve's `max_ongoing_requests` counts every method), and an overloaded app must not look dead to a
    load balancer.

    An app that scales to zero (`may_idle`) is `idle` instead where no LLM replica runs: not down (/health 200, the
    app takes requests), and not probed, since a call through the handle is demand that Serve's autoscaler answers
    with a replica. A request that finds the app idle asks for one (`wake`: one probe at a time, which waits in the
    handle until Serve has started a replica and it answers); the app serves again once it has. A count of none
    taken before a probe's latest answer is stale (a replica answers only once the controller counts it running).
    Where Serve says the deployment failed (its replicas fail to start, or cannot be placed), the app is down.
    `running` returns the count, or the count and why the deployment failed (`running_replicas`). There, too,
    `monitor` probes running replicas only where a request was `sent` since its last look (or the app is down): a
    count of one taken as Serve stops the last idle replica sent the probe to none, and the handle's queued call
    started a replica that no request asked for."""

    def __init__(self, may_idle: bool = False) -> None:
        self._info: dict[str, Any] | None = None
        self._down: str | None = None
        self.may_idle = may_idle
        self._idle = False
        self._answered = -math.inf  # (monotonic) when a probe or a wake last got an answer
        self._waking: asyncio.Task | None = None
        self._failed_logged = -math.inf  # when a wake's failure was last logged
        self.serving = asyncio.Event()  # set while an LLM replica can serve: ready, not down and not idle
        self.running: int | None = None  # the LLM replicas running, as the controller last said (None: not heard)
        self.sent = -math.inf  # (monotonic) when this Ingress last sent a request to an LLM replica

    @property
    def info(self) -> dict[str, Any] | None:
        """The model's info (`model_info`) once an LLM replica has answered, the latest answer since."""
        return self._info

    @info.setter
    def info(self, info: dict[str, Any] | None) -> None:
        self._info = info
        self._sync()

    @property
    def down(self) -> str | None:
        """Why no LLM replica can serve now (`monitor`), None while one can."""
        return self._down

    @down.setter
    def down(self, why: str | None) -> None:
        self._down = why
        self._sync()

    @property
    def idle(self) -> bool:
        """Whether the app scaled to zero: no LLM replica runs, and none is down."""
        return self._idle

    @idle.setter
    def idle(self, idle: bool) -> None:
        if idle != self._idle:
            log.info("ingress: %s", "no LLM replica runs (scaled to zero): the next request starts one" if idle
                     else "an LLM replica serves")
        self._idle = idle
        self._sync()

    def _sync(self) -> None:
        if self._info is not None and self._down is None and not self._idle:
            self.serving.set()
        else:
            self.serving.clear()

    @property
    def ready(self) -> bool:
        return self.info is not None

    def _heard(self, info: dict[str, Any]) -> None:
        """A replica answered a probe: it runs (how many, the controller's next count says). It says whether its
        deployment may scale to zero as Serve runs it (a Serve config's `deployments:` may say so, where the app's
        arguments did not)."""
        if info.get("scales_to_zero") is not None:
            self.may_idle = bool(info["scales_to_zero"])
        self._answered = time.monotonic()
        self._info = info
        self.idle = False  # (and serving)

    def wake(self, probe: Callable[[], Awaitable[dict[str, Any]]], timeout_s: float) -> None:
        """Ask Serve for an LLM replica while the app is idle: one probe at a time, bounded by `timeout_s`."""
        if self._waking is None or self._waking.done():
            log.info("ingress: a request asks for an LLM replica (the app scaled to zero)")
            self._waking = asyncio.get_running_loop().create_task(self._wake(probe, timeout_s))

    async def _wake(self, probe: Callable[[], Awaitable[dict[str, Any]]], timeout_s: float) -> None:
        try:
            self._heard(await asyncio.wait_for(probe(), timeout_s))
        except asyncio.CancelledError:
            raise
        except TimeoutError:  # (the next request asks again)
            log.warning("ingress: no LLM replica answered within %.0f s of a request that asked for one", timeout_s)
        except Exception as e:  # noqa: BLE001 - (asked again by each waiting request: logged once a while)
            if time.monotonic() - self._failed_logged > WAKE_LOG_S:
                self._failed_logged = time.monotonic()
                log.warning("ingress: asking for an LLM replica failed: %r", e)

    async def _count(self, running: Callable[[], Awaitable[Any]] | None, timeout_s: float) -> int | None:
        """The controller's count of LLM replicas running (None: no news). Where none runs in an app that may scale
        to zero: down where the deployment failed, else idle unless a replica answered since the count began."""
        t0 = time.monotonic()
        try:
            got = await asyncio.wait_for(running(), timeout_s) if running is not None else None
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the controller busy: no news
            got = None
        n, failed = got if isinstance(got, tuple) else (got, None)
        if n is not None:
            self.running = n
        if n == 0 and self.may_idle and self._answered < t0:
            self.down = failed
            self.idle = failed is None
        return n

    async def watch(self, probe: Callable[[], Awaitable[dict[str, Any]]], timeout_s: float = 60.0,
                    retry_s: float = 1.0, running: Callable[[], Awaitable[Any]] | None = None,
                    period_s: float = 2.0) -> None:
        while self.info is None:
            if self.may_idle and running is not None and await self._count(running, timeout_s) in (0, None):
                await asyncio.sleep(period_s)  # (none asked for yet: no probe, which would start one)
                continue
            try:
                self._heard(await asyncio.wait_for(probe(), timeout_s))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a replica still starting, or one that died: ask again
                log.info("ingress: no LLM replica ready yet (%s); asking again in %.0f s", type(e).__name__, retry_s)
                await asyncio.sleep(retry_s)

    async def monitor(self, probe: Callable[[], Awaitable[dict[str, Any]]],
                      running: Callable[[], Awaitable[Any]] | None = None, period_s: float = 2.0,
                      timeout_s: float = 2.0, failures: int = 2) -> None:
        failed = 0
        while True:
            since = time.monotonic()
            await asyncio.sleep(period_s)
            why = None
            n = await self._count(running, timeout_s)
            if n == 0 and self.may_idle:  # (idle, or down where the deployment failed: `_count`)
                failed = 0
                continue
            if n is None and self.idle:
                continue  # (no news; a probe would start a replica)
            if n == 0:
                why = "no LLM replica is running"
            elif self.may_idle and self.sent < since and self.down is None:
                continue  # (no request since the last look: the replicas may be stopping, and a probe is demand)
            else:
                try:
                    info = await asyncio.wait_for(probe(), timeout_s)
                    why = None if info.get("alive", True) else "the LLM replicas' engines exited"
                    if why is None:
                        self._heard(info)  # the latest (a redeployed LLM deployment may serve otherwise)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - busy replicas, or one being replaced: no news
                    continue
            failed = 0 if why is None else failed + 1
            if (why if failed >= failures else None) != self.down:
                log.warning("ingress: %s", why or "an LLM replica can serve again")
            self.down = why if failed >= failures else None


class GenerateStream(Protocol):
    """What `OpenAIFrontend` reads a request's outputs from: Serve's `DeploymentResponseGenerator`, or
    `deployments.direct.LocalStream` where the engine is in the same replica."""

    def __anext__(self) -> Awaitable[RequestOutput]: ...

    def cancel(self) -> None: ...


class OpenAIFrontend:
    """The OpenAI HTTP surface (routes, auth, validation, SSE, error mapping), apart from where requests go.

    A subclass says that with `_open(req)` (start a request's stream), `_ready_info()` (the model's info once an
    engine can serve, None before), `_unavailable()`, `_until_ready()` (wait, bounded, for an engine that can
    serve) and `_replica_call` (an LLM replica's other methods: /tokenize). `Ingress` sends requests to LLM
    replicas through a Serve handle; `deployments.direct.DirectLLMServer` is an LLM replica that serves HTTP
    itself. `openai_api()` builds the FastAPI app whose routes are this class's methods; `serve.ingress` binds
    them to the replica's instance, and the replica serves that app behind `GenerationFastPath`, which takes the
    two generation routes itself."""

    def _init_frontend(self, settings: dict[str, Any]) -> None:
        self.served_model_name: str = settings["model_name"]
        self.max_body_bytes: int = settings["max_body_bytes"]
        self.retry_after_s: int = settings.get("retry_after_s", 1)
        self.log_prompts: bool = settings.get("log_prompts", False)
        self.reroutes: int = settings.get("reroutes", 0)
        # a request one replica judged `slo_unattainable` goes to another once (where the router can avoid one)
        self.second_opinion: bool = settings.get("second_opinion", False)
        # a request whose replica failed before its first item is sent again, to another replica, this many times
        self.failovers: int = settings.get("failovers", 0)
        # a request that finds no LLM replica able to serve waits this long for one, then gets a 503 (`_until_ready`)
        self.unready_wait_s: float = settings.get("unready_wait_s", 30.0)
        # that wait where the LLM replicas say they scale to zero (`Readiness.may_idle`): a cold start's
        self.cold_start_wait_s: float = settings.get("cold_start_wait_s", self.unready_wait_s)
        # the LLM replicas' streams come over gRPC (`llm_transport`; else Ray actor calls)
        self.grpc: bool = settings.get("llm_transport", "ray") == "grpc"
        self.batch_concurrency: int = settings.get("batch_concurrency", 64)  # a batch's prompts in flight at once
        # how a reply's own tool calls are read (tool_choice auto): a format, "auto" (the model's chat template's,
        # which its replica says), or "none"
        self.tool_call_parser: str = settings.get("tool_call_parser", "auto")
        # how a reasoning model's thinking is read out of a chat reply (`deployments.reasoning`), or "none"
        self.reasoning_parser: str = settings.get("reasoning_parser", "none")
        self.trust_request_chat_template: bool = settings.get("trust_request_chat_template", False)
        # each usage says how many prompt tokens the prefix cache held (enable_prompt_tokens_details)
        self.prompt_tokens_details: bool = settings.get("prompt_tokens_details", False)
        # the LoRA adapters the replicas serve (`lora_modules`): a request that names one as its model runs through it
        self.lora_modules: dict[str, str] = dict(settings.get("lora_modules") or {})
        # and the folder of adapters loaded on demand: a request's model `<served name>:<folder>` names one
        self.lora_dir: str | None = settings.get("dynamic_lora_loading_path")
        # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (allow_runtime_lora_updating): the adapters loaded
        # so, by name (each request that names one brings its folder and its load's version, and the replicas load
        # it at the first); the last version given (a clock's ns: a front started again gives later ones, which the
        # replicas that kept running take as loads after theirs)
        self.runtime_lora: bool = settings.get("allow_runtime_lora_updating", False)
        self.lora_loaded: dict[str, LoraSource] = {}
        self._lora_version = 0
        self._names: list[str] = served_names(self.served_model_name, None)
        self._names_final = False  # set once an engine has said which model it loaded
        self._scraper = AgentScraper()
        keys = load_api_keys(settings.get("api_keys_env"), settings.get("api_key_file"))
        self._keys = [k.encode() for k in keys]
        self._cors: dict[str, Any] = settings.get("cors") or {}

    def _open(self, req: GenerateRequest) -> GenerateStream:
        raise NotImplementedError

    def _own_call(self) -> None:
        """Called in the task of each prompt of a batch, before its request starts: whatever a call made from that
        task needs to be a call of its own (nothing here)."""

    def __serve_build_asgi_app__(self) -> "GenerationFastPath":
        """Serve calls this once the replica is built, after `serve.ingress` bound the FastAPI routes to it, and runs
        the ASGI app it returns: the generation routes' fast path in front of that FastAPI app."""
        return GenerationFastPath(self, self.app,  # type: ignore[attr-defined] - `app`: Serve's ASGI wrapper
                                  self._cors.get("origins", ()), self._cors.get("credentials", False))

    @property
    def docs_path(self) -> str | None:
        """Where Serve's status and dashboard point for the API docs (it looks for a FastAPI app)."""
        return getattr(getattr(self, "app", None), "docs_url", None)

    async def _serve_generation(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """A generation request as plain ASGI: the same handler and error mapping as the FastAPI route, without
        FastAPI's routing and middleware, and without `StreamingResponse`'s per-request task group that waits for a
        disconnect: Serve's ingress watches for that already, and cancels the request's task, which closes the
        stream and aborts the request in its engine (`_sse`)."""
        request = Request(scope, receive)
        try:
            response = await self._handle(request, kind)
        except APIError as e:
            response = await _api_error(request, e)
        except Exception as e:  # noqa: BLE001 - as FastAPI's handler for Exception: logged, a 500
            response = await _unexpected(request, e)
            response.headers["x-kairos-request-id"] = getattr(e, "kairos_request_id", None) or f"req-{uuid.uuid4().hex}"
        if not isinstance(response, StreamingResponse):
            await response(scope, receive, send)
            return
        body = response.body_iterator
        started = False
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": response.raw_headers})
            started = True
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:  # also where sending failed: closing the stream aborts its request in the engine
            await body.aclose()  # type: ignore[attr-defined]
            if not started:  # its generator never ran: closing it ran no `finally`
                _drop(response)

    def _ready_info(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def _running_replicas(self) -> int | None:
        """The LLM replicas running now, where this front knows (None: it does not)."""
        return None

    def _unavailable(self) -> str | None:
        """Why this frontend cannot serve now although it was ready (its engine died; Serve will replace the
        replica), else None."""
        return None

    def _idle(self) -> bool:
        """Whether the app scaled to zero (routed, `autoscaling_config` min_replicas 0): no LLM replica runs, and a
        request starts one (`_until_ready`)."""
        return False

    async def _until_ready(self) -> None:
        """Before a parsed request is sent: wait while nothing could serve it (the routed Ingress, `IngressFrontend`;
        a replica serving HTTP itself is ready from its first request)."""

    # ------------------------------------------------------------------ routes (registered by `openai_api`)
    async def health(self) -> Any:
        """200 once an engine can serve, 503 `starting` before and `unavailable` once it cannot (its engine died,
        until Serve replaces the replica): what a load balancer's readiness probe needs. Answered from the
        replica's own state: it never waits on an engine. An app scaled to zero is 200: it takes requests (the first
        starts an LLM replica)."""
        if self._idle():
            return {"status": "ok"}
        if self._ready_info() is None:
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "1"})
        if (why := self._unavailable()) is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503,
                                headers={"Retry-After": "1"})
        return {"status": "ok"}

    async def version(self) -> dict[str, str]:
        """`GET /version` (vLLM's): the server's version."""
        return {"version": SERVER_VERSION}

    async def models(self, request: Request) -> dict[str, Any]:
        self._auth(request)
        info = self._ready_info()  # the list works without it while no engine has answered yet
        max_len = info["max_model_len"] if info else None
        cards = [P.ModelCard(id=name, max_model_len=max_len, root=self._root(info))
                 for name in self._served_names()]
        cards += [self._lora_card(name, max_len) for name in self._lora_names()]
        listed = {c.id for c in cards}
        cards += [self._lora_card(name, max_len, name) for name in self._folder_names() if name not in listed]
        return P.ModelList(data=cards).model_dump()

    def _root(self, info: dict[str, Any] | None) -> str:
        """A base model card's `root`: the checkpoint it was loaded from (vLLM's model path), where known."""
        return str((info or {}).get("model") or self.served_model_name)

    def _lora_names(self) -> list[str]:
        """The adapters served by name: those of lora_modules, then those loaded at run time."""
        return [*self.lora_modules, *(n for n in self.lora_loaded if n not in self.lora_modules)]

    def _folder_names(self) -> list[str]:
        """The adapters of dynamic_lora_loading_path as a request names them, `<served name>:<folder>` (Ray Serve
        LLM's list of them): its folders that hold an adapter config, by name (the first MAX_FOLDER_ADAPTERS)."""
        if not self.lora_dir:
            return []
        try:
            entries = sorted(p.name for p in Path(self.lora_dir).expanduser().iterdir())
        except OSError:
            return []
        names: list[str] = []
        for n in entries:
            if len(names) >= MAX_FOLDER_ADAPTERS:
                break
            if dynamic_adapter_dir(self.lora_dir, n):
                names.append(f"{self.served_model_name}:{n}")
        return names

    def _lora_card(self, model: str, max_len: int | None, name: str | None = None) -> P.ModelCard:
        """The card of adapter `name` (`_lora_of`), asked for as `model`."""
        name = name or model
        loaded = self.lora_loaded.get(name)
        root = loaded.path if loaded else self.lora_modules.get(name) or str(dynamic_adapter_dir(self.lora_dir, name))
        return P.ModelCard(id=model, max_model_len=max_len, root=root, parent=self.served_model_name)

    async def load_lora_adapter(self, request: Request) -> Any:
        """vLLM's `POST /v1/load_lora_adapter` (the app's allow_runtime_lora_updating, vLLM's
        VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapter `lora_name` is served from the folder `lora_path` from now on, once
        a replica has checked that its engine can serve it (its config, its tensors' names and shapes). Each replica
        loads it at the first request that names it. `load_inplace` replaces an adapter of that name: requests that
        arrive after run through the folder as it is now (read again), those running finish on the earlier load."""
        self._auth(request)
        self._runtime_lora_on()
        raw = await self._read_json(request)
        body = self._validated(P.LoadLoRAAdapterRequest, raw, check_model=False)
        name, path = body.lora_name.strip(), body.lora_path.strip()
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_name" if not name else "lora_path")
        await self._until_ready()
        self._check_lora_name(name, body.load_inplace)
        path = os.path.abspath(os.path.expanduser(path))
        got = await self._replica_call("check_lora", name, path)
        if "error" in got:
            raise APIError(404 if got.get("not_found") else 400, got["error"],
                           "NotFoundError" if got.get("not_found") else "invalid_request_error", param="lora_path")
        self._check_lora_name(name, body.load_inplace)  # (another load of the name may have ended meanwhile)
        self._lora_version = max(self._lora_version + 1, time.time_ns())
        self.lora_loaded[name] = LoraSource(path, self._lora_version)
        log.info("LoRA adapter %r loaded at run time from %s (rank %s)", name, path, got.get("rank"))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    def _check_lora_name(self, name: str, inplace: bool) -> None:
        if name in self._served_names():
            raise APIError(400, f"lora_name {name!r} is the served model's name: name the adapter otherwise",
                           param="lora_name")
        if not inplace and (name in self.lora_loaded or name in self.lora_modules):
            raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                           "in place, set 'load_inplace' to True.", param="lora_name")

    async def unload_lora_adapter(self, request: Request) -> Any:
        """vLLM's `POST /v1/unload_lora_adapter`: adapter `lora_name` (loaded at run time, or of lora_modules) is no
        longer served; a request naming it is a 404 from now on. The replicas' copies go as they unload idle adapters
        (past max_loras, least recently used first; one of lora_modules stays loaded until the replica restarts)."""
        self._auth(request)
        self._runtime_lora_on()
        raw = await self._read_json(request)
        body = self._validated(P.UnloadLoRAAdapterRequest, raw, check_model=False)
        name = body.lora_name.strip()
        if not name:
            raise APIError(400, "'lora_name' must be provided.", param="lora_name")
        if name not in self.lora_loaded and name not in self.lora_modules:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", param="lora_name")
        self.lora_loaded.pop(name, None)
        self.lora_modules.pop(name, None)
        log.info("LoRA adapter %r unloaded at run time", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _runtime_lora_on(self) -> None:
        if not self.runtime_lora:  # (vLLM has no such routes then)
            raise APIError(404, "Not Found: loading LoRA adapters at run time is off (the app's "
                           "allow_runtime_lora_updating, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)", code="not_found")

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        """`GET /v1/models/{model}`: one served name's card (OpenAI's retrieve model), else 404 model_not_found."""
        self._auth(request)
        lora = self._lora_of(model_id)
        if model_id not in self._served_names() and lora is None:
            raise model_not_found(model_id, self._model_names())
        info = self._ready_info()
        max_len = info["max_model_len"] if info else None
        if lora is not None:
            return self._lora_card(model_id, max_len, lora).model_dump()
        return P.ModelCard(id=model_id, max_model_len=max_len, root=self._root(info)).model_dump()

    async def prometheus_metrics(self) -> Any:
        """Prometheus text: the `ray_kairos_*` and `ray_serve_*` series of this node's Ray metrics agent (where
        vLLM users look: /metrics on the serving port). Unauthenticated, as vLLM's."""
        try:
            text = await self._scraper.scrape()
        except Exception as e:  # noqa: BLE001 - the agent is out of reach: say where the series are
            log.warning("/metrics: the Ray metrics agent is out of reach: %r", e)
            raise APIError(503, "metrics unavailable: this node's Ray metrics agent did not answer "
                           f"({type(e).__name__}); the series are exported by the agent's Prometheus endpoint "
                           "(ray.nodes()[i]['MetricsExportPort'], /tmp/ray/prom_metrics_service_discovery.json)",
                           "server_error", "metrics_unavailable", {"Retry-After": "1"}) from None
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """`POST /tokenize` (vLLM's): the token ids a completion (`prompt`) or a chat completion (`messages`, its
        template rendered) would take, their count and the window; `return_token_strs` adds each token's text."""
        self._auth(request)
        raw = await self._read_json(request)
        chat = isinstance(raw, dict) and "messages" in raw
        schema = P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest
        body, _ = await self._parsed_when_ready(request, lambda known: self._validated(schema, raw, known))
        got = await self._replica_call("prompt_tokens", None if chat else body.prompt, body.turns() if chat else None,
                                       body.prompt_options(), body.return_token_strs)
        if "error" in got:
            raise APIError(400, got["error"], param="messages" if chat else "prompt")
        got.pop("thinking", None)  # (the beam search's)
        return got

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """`POST /detokenize` (vLLM's): the text of `tokens`."""
        self._auth(request)
        raw = await self._read_json(request)
        body, _ = await self._parsed_when_ready(request, lambda known: self._validated(P.DetokenizeRequest, raw, known))
        got = await self._replica_call("token_text", body.tokens)
        if "error" in got:
            raise APIError(400, got["error"], param="tokens")
        return got

    async def _parsed_when_ready(self, request: Request, parse: Callable[[bool], Any]) -> tuple[Any, float]:
        """`parse(check_model)` of a request's body at once (a bad body is a 400 whether an engine is ready or not),
        then, where none can serve it yet, a wait for one (`_until_ready`; a client that leaves ends it), and the
        body parsed again once one has said its model and sampling defaults. Returns the parse and when the first
        ended (the end of Server-Timing's `parse`)."""
        known = self._ready_info() is not None
        got = parse(known)
        t_parsed = time.perf_counter()
        if not known or self._unavailable() is not None or self._idle():
            await until_disconnected(request.receive, self._until_ready())
            if not known:
                got = parse(True)
        return got, t_parsed

    async def _replica_call(self, method: str, *args: Any) -> dict[str, Any]:
        """A unary call to an LLM replica's `LLMReplica` method (the routed Ingress's handle, or this replica)."""
        raise NotImplementedError

    async def completions(self, request: Request) -> Any:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Any:
        return await self._handle(request, "chat")

    async def responses(self, request: Request) -> Any:
        """OpenAI's Responses API (`deployments.responses`): the chat completion it amounts to, answered as a
        response."""
        return await self._handle(request, "responses")

    # ------------------------------------------------------------------ request handling
    def _served_names(self) -> list[str]:
        if not self._names_final:
            info = self._ready_info()
            if info is not None:
                self._names = served_names(self.served_model_name, info.get("model"))
                self._names_final = True
        return self._names

    def _model_names(self) -> list[str]:
        """Every name a request's `model` may give: the served model's, then its LoRA adapters'."""
        return self._served_names() + [n for n in self._lora_names() if n not in self._served_names()]

    def _lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names: one of `lora_modules` by its name, or one of the folder of
        adapters loaded on demand as `<served name>:<folder>` (Ray Serve LLM's form); None: the base model, or no
        model served here."""
        if model is None or model in self._served_names():
            return None
        if model in self.lora_loaded or model in self.lora_modules:
            return model
        base, sep, name = model.rpartition(":")
        if sep and base in self._served_names() and dynamic_adapter_dir(self.lora_dir, name) is not None:
            return f"{self.served_model_name}:{name}"  # (one name a folder, whichever served name asked for it)
        return None

    def _tool_parser(self) -> str | None:
        """The tool-call format replies are read in with tool_choice "auto" (`tool_calls.PARSERS`), or None."""
        if self.tool_call_parser != "auto":
            return None if self.tool_call_parser == "none" else self.tool_call_parser
        return (self._ready_info() or {}).get("tool_call_parser")

    def _reply_readers(self, body: P._Common | None) -> Callable[[str | None], ReplyReader | None] | None:
        """A new reader of a choice's reply per call (`P.ChatCompletionRequest.reply_reader`: its reasoning and
        tool calls; its argument: where the prompt leaves the thinking, `RequestOutput.prompt_thinking`), where
        `body`'s replies are read for them; else None."""
        if not isinstance(body, P.ChatCompletionRequest):
            return None
        made = functools.partial(body.reply_reader, self._tool_parser(),
                                 None if self.reasoning_parser == "none" else self.reasoning_parser,
                                 model_format=(self._ready_info() or {}).get("tool_call_parser"))
        return None if made() is None else made

    def _auth(self, request: Request) -> None:
        if not self._keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # (the header's bytes as sent: Starlette decodes them as Latin-1, the keys are UTF-8)
        given = token.strip().encode("latin-1", "replace")
        ok = False
        for key in self._keys:  # compare against every key: no early exit
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not ok:
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", "authentication_error",
                           "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    async def _read_json(self, request: Request) -> Any:
        ctype = request.headers.get("content-type")
        if not is_json_content_type(ctype):
            raise unsupported_media_type(ctype)
        cl = request.headers.get("content-length")
        too_big = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body_bytes:
            await _drain(request.stream())
            raise too_big
        body = bytearray()
        chunks = request.stream()
        async for chunk in chunks:
            body += chunk
            if len(body) > self.max_body_bytes:
                await _drain(chunks)
                raise too_big
        try:
            return parse_body(body)
        except UnicodeEncodeError:
            raise APIError(400, "request body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                           "strings must be valid Unicode", code="invalid_unicode") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: absurdly deep nesting
            raise APIError(400, f"request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}",
                           code="invalid_json") from None

    def _slo(self, request: Request, body: P._Common) -> SLO:
        """The request's SLO: each from its header where sent (headers win), else the body's field. Every value
        sent is checked, a body field a header overrides too, and a header sent twice must say the same both times;
        a bad one is a 400 `invalid_slo` naming it (`param`)."""
        h = request.headers
        got = []
        for header, field, integer in (("x-slo-ttft-ms", "slo_ttft_ms", False), ("x-slo-tpot-ms", "slo_tpot_ms", False),
                                       ("x-slo-output-len", "output_len_hint", True)):
            try:
                values = {P.parse_slo_header(header, v, integer) for v in h.getlist(header)} or {None}
                if len(values) > 1:
                    raise ValueError(f"header {header} is given {len(h.getlist(header))} times with different values")
                value = values.pop()
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_slo", param=header) from None
            try:
                in_body = P.check_slo_value(field, getattr(body, field), integer)
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_slo", param=field) from None
            got.append(value if value is not None else in_body)
        return SLO(ttft_ms=got[0], tpot_ms=got[1], output_len_hint=got[2])

    def _validated(self, schema: type[BaseModel], raw: Any, check_model: bool = True) -> Any:
        """`raw` (a parsed JSON body) as a request of `schema`, for a model this server serves (`check_model`: once
        an engine has said which it loaded); else a 400 (a 404 for another model) naming the field."""
        if not isinstance(raw, dict):
            raise APIError(400, "request body must be a JSON object")
        if raw.get("model") == "":  # no model named (vLLM's: the served one)
            raw = {**raw, "model": None}
        # a count of logprobs up to what the served engine takes, once it has said (before, any: parsed again then)
        info = self._ready_info()
        try:
            body = schema.model_validate(raw, context={"max_logprobs": info.get("max_logprobs") if info else -1})
        except ValidationError as e:
            message, param = _validation_message(e, schema.model_fields)
            raise APIError(400, message, param=param) from None
        if check_model and body.model is not None and body.model not in self._served_names() \
                and self._lora_of(body.model) is None:  # absent: the served model
            raise model_not_found(body.model, self._model_names())
        if getattr(body, "chat_template", None) is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template: this server renders chats with its model's own template (the app's "
                           "trust_request_chat_template lets a request bring its own)", param="chat_template",
                           code="unsupported_parameter")
        return body

    def _build(self, request: Request, raw: Any, kind: str, rid: str, check_model: bool = True
               ) -> tuple[P._Common, list[GenerateRequest]]:
        """Validate once, here at the edge: the typed requests the replicas get need no further checks (one, or a
        batched completion's, one per prompt: `rid-i`). `check_model`: see `_validated`."""
        schema = P.CompletionRequest if kind == "completion" else P.ChatCompletionRequest
        if isinstance(raw, dict) and (name := P.unsupported_field(raw, schema.HONOURED)) is not None:
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        body = self._validated(schema, raw, check_model)
        slo = self._slo(request, body)
        info = self._ready_info() or {}
        # (where the replicas schedule without priorities, a client's has no effect: the router weighs none either)
        priority = header_priority(request.headers.get(PRIORITY_HEADER), body.priority) \
            if info.get("priority_scheduling") else 0
        defaults = info.get("sampling_defaults")  # the model's (its generation_config)
        try:
            params = SamplingParams(**body.sampling_kwargs(body.default_max_tokens(), defaults)).validate()
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=param_named(str(e))) from None
        if isinstance(body, P.ChatCompletionRequest) and body.auto_tools() and check_model:
            parser = self._tool_parser()
            if parser is None:
                raise APIError(400, 'tool_choice "auto" (the default with tools) reads the model\'s own tool calls '
                               "from its reply, but this model's chat template shows no format this server reads "
                               "(the app's tool_call_parser names one): name a tool, or ask for \"required\" or "
                               '"none"', param="tool_choice")
            if parser in KEEPS_SPECIAL_TOKENS and "skip_special_tokens" not in body.model_fields_set:
                params = dataclasses.replace(params, skip_special_tokens=False)  # its marks may be special tokens
        if isinstance(body, P.ChatCompletionRequest) and self.reasoning_parser != "none":
            params = dataclasses.replace(params, thinking=body.thinking(self.reasoning_parser))
            if not body.include_reasoning:  # (vLLM's: the reasoning left out, its token ids are too)
                body.return_token_ids = False
        n = _made(body)
        if n > (body.n or 1) and params.logprobs is None:  # best_of: the choices' logprobs rank them
            params = dataclasses.replace(params, logprobs=0)
        each = [params] + [child_params(params, j) for j in range(1, n)]  # a prompt's n choices (best_of)
        lora = self._lora_of(body.model)
        source = self.lora_loaded.get(lora) if lora is not None else None  # (loaded at run time: its folder)
        if isinstance(body, P.CompletionRequest):
            prompts = body.prompts()
            one = len(prompts) * n == 1
            return body, [GenerateRequest(rid if one else f"{rid}-{i * n + j}", prompt=prompt, params=sp, slo=slo,
                                          options=body.prompt_options(), prompt_len_hint=_len_hint(prompt),
                                          lora=lora, cache_salt=body.cache_salt, lora_source=source,
                                          priority=priority, return_token_ids=bool(body.return_token_ids))
                          for i, prompt in enumerate(prompts) for j, sp in enumerate(each)]
        turns = body.turns()
        options = body.prompt_options()
        hint = _len_hint("".join(chat_texts(turns, options))) + _TURN_TOKENS * len(turns)
        return body, [GenerateRequest(rid if n == 1 else f"{rid}-{j}", messages=turns, params=sp, slo=slo,
                                      options=body.prompt_options(), prompt_len_hint=hint, lora=lora,
                                      cache_salt=body.cache_salt, lora_source=source, priority=priority,
                                      return_token_ids=bool(body.return_token_ids),
                                      read_thinking=self.reasoning_parser != "none")
                      for j, sp in enumerate(each)]

    async def _handle(self, request: Request, kind: str) -> Any:
        t_in = time.perf_counter()
        ids = ResponseIds(kind, client_request_id(request.headers.get(REQUEST_ID_HEADER)))
        try:
            return await self._generate(request, kind, ids, t_in)
        except APIError as e:  # every answer names its request, a refusal at parse time too (as vLLM's X-Request-Id)
            e.headers = {**(e.headers or {}), "x-kairos-request-id": ids.rid}
            if kind == "responses":  # (its errors name its own fields, not the chat's it ran as)
                e.param, e.message = R.responses_param(e.param), R.responses_message(e.message)
            raise
        except Exception as e:  # a 500 names it too (_serve_generation)
            e.kairos_request_id = ids.rid  # type: ignore[attr-defined]
            raise

    async def _generate(self, request: Request, kind: str, ids: "ResponseIds", t_in: float) -> Any:
        try:
            self._auth(request)
        except APIError:
            # refused before its body is read: the body is read and dropped, never parsed (`_drain`, as for a 413),
            # so that the client gets its 401 instead of a reset or an upload left hanging
            await _drain(request.stream())
            raise
        raw = await self._read_json(request)
        if isinstance(raw, dict):
            ids.name_by_body(raw.get("request_id"))
        rid = ids.rid
        echoed = None  # a Responses API request's fields its response repeats (it runs as the chat it amounts to)
        if kind == "responses":
            try:
                raw, echoed = R.chat_request(raw)
            except R.ResponsesError as e:
                raise APIError(400, str(e), param=e.param) from None
            kind = "chat"
        (body, reqs), t_call = await self._parsed_when_ready(
            request, lambda known: self._build(request, raw, kind, ids.eid, known))
        # the time it waited between HAProxy and this handler (this event loop busy) is off its TTFT SLO too
        proxy_ms = max(0.0, proxy_wait_ms(request.headers.get(RECEIVED_HEADER)) - (t_call - t_in) * 1000.0)
        if proxy_ms > 0:
            reqs = [dataclasses.replace(r, waited_ms=r.waited_ms + proxy_ms) for r in reqs]
        if self.log_prompts:
            for req in reqs:
                log.info("%s %r", req.request_id, req.prompt if req.messages is None else req.messages)
        if isinstance(body, P.ChatCompletionRequest):
            echo = body.echoed()
        else:
            echo = await until_disconnected(request.receive, self._echoed(body)) \
                if isinstance(body, P.CompletionRequest) and body.echo else None
        if body.use_beam_search:
            work = self._beam_search(body, reqs[::body.n or 1], kind, rid, t_in, t_call, proxy_ms)
        elif len(reqs) == 1:
            work = self._respond(body, reqs[0], kind, rid, t_in, t_call, proxy_ms, echo[0] if echo else None)
        else:
            work = self._respond_batch(body, reqs, kind, rid, t_in, proxy_ms, echo)
        got = await until_disconnected(request.receive, work)
        return got if echoed is None else _as_response(got, rid, echoed)

    async def _echoed(self, body: P.CompletionRequest) -> list[str]:
        """A completion's prompts as text, to go before their choices' (`echo`): a text prompt as sent, token ids
        as the model's tokenizer decodes them (vLLM's); with truncate_prompt_tokens, the tokens the engine keeps of
        one it cuts, as decoded (the prompt's logprobs are of those)."""
        prompts = body.prompts()
        options = body.prompt_options()

        async def text(i: int, prompt: str | list[int]) -> str:
            def refused(got: dict[str, Any]) -> APIError:
                return APIError(400, f"prompt {i}: {got['error']}" if len(prompts) > 1 else got["error"],
                                param="prompt")
            self._own_call()  # in this prompt's own task: its call's own id (concurrent calls under one hang)
            keep = options.truncate_prompt_tokens
            if keep == -1:  # (the window less a token of reply)
                info = self._ready_info()
                keep = info["max_model_len"] - 1 if info else None
            if keep is not None and (isinstance(prompt, list) and len(prompt) > keep or isinstance(prompt, str)):
                whole = prompt
                if isinstance(prompt, str):  # (its tokens, to know whether it is cut)
                    got = await self._replica_call("prompt_tokens", prompt, None,
                                                   dataclasses.replace(options, truncate_prompt_tokens=None))
                    if "error" in got:
                        raise refused(got)
                    whole = got["tokens"]
                if len(whole) > keep:
                    prompt = list(whole[-keep:])
            if isinstance(prompt, str):
                return prompt
            got = await self._replica_call("token_text", prompt)
            if "error" in got:
                raise refused(got)
            return got["prompt"]
        return list(await asyncio.gather(*(text(i, p) for i, p in enumerate(prompts))))

    async def _start(self, req: GenerateRequest, t_call: float
                     ) -> tuple[GenerateRequest, GenerateStream, RequestOutput]:
        """Start `req` and wait for its first item; where a replica turns it away for its load, on another one
        (`reroutes` times at most, with what is left of its TTFT SLO); where one judges its SLO unattainable, on
        another once (`second_opinion`), the 400 offering the lower floor of the two; where one turned it away as busy
        before another judged it unattainable, the busy one's answer (a 429). `req.waited_ms` is the time of
        its TTFT SLO spent up to `t_call` (`_respond`: its wait between HAProxy and this Ingress, up to its arrival
        here; a batch's prompt: all its wait so far), and every send, the first too, tells the engine what is left at
        the send (what this Ingress took to read and parse it counted). Returns the request as last sent."""
        waited_ms = req.waited_ms
        first_send = dataclasses.replace(req, waited_ms=waited_ms + (time.perf_counter() - t_call) * 1000.0)
        req, gen, first = await self._first_item_anywhere(first_send, waited_ms, t_call)
        _note_refusal(first, req)
        reroutes, asked = self.reroutes, not self.second_opinion
        # the first replica's `slo_unattainable` (the request as sent, its stream, the verdict), where another is asked
        judged: tuple[GenerateRequest, GenerateStream, RequestOutput] | None = None
        # the last replica that turned it away for its load (it did not judge the SLO unattainable: a 429 to retry)
        busy: tuple[GenerateRequest, GenerateStream, RequestOutput] | None = None
        while True:
            sb = first.served_by
            if not (first.finish_reason is FinishReason.REJECTED and sb is not None and sb.replica):
                break
            opinion = first.reject_reason is RejectReason.SLO_UNATTAINABLE
            if opinion:
                # a replica's idle floor is drawn from what its own steps measured (a replica just started, one on
                # a slower or busier host): another replica is asked once before the client hears no replica can
                if asked:
                    break
                asked, judged = True, (req, gen, first)
            else:
                busy = (req, gen, first)
                if reroutes <= 0:
                    break
                reroutes -= 1  # a replica turned it away: another one may have room (router=slo)
            # (a second opinion is asked whatever is left of the TTFT SLO: the other replica judges the SLO, not the
            # time left, and a request it would serve when idle is a 429 to retry there, not a 400)
            if (again := _resent(req, waited_ms, t_call, sb.replica, any_time=opinion)) is None:
                break
            if len(set(again.avoid_replicas)) >= (self._running_replicas() or 0) > 0:
                break  # every replica running turned it away (an autoscaled app with its fewest)
            try:
                req, gen, first = await self._first_item_anywhere(again, waited_ms, t_call)
            except APIError:
                if opinion and judged is not None:  # (the second opinion failed: the first verdict holds)
                    return judged
                raise
            _note_refusal(first, req)
        if first.reject_reason is RejectReason.SLO_UNATTAINABLE and busy is not None:
            # a replica asked before turned it away only for its load (every running one asked): by its own floor
            # an idle replica meets the SLO, so the client hears that one's 429, not that no replica can
            return busy
        if judged is not None and first is not judged[2] and first.reject_reason is RejectReason.SLO_UNATTAINABLE \
                and _offer(judged[2]) <= _offer(first):
            return req, judged[1], judged[2]  # (both refused it: the 400 offers the lower of their floors; sent twice)
        return req, gen, first

    async def _first_item_anywhere(self, req: GenerateRequest, waited_ms: float, t_call: float
                                   ) -> tuple[GenerateRequest, GenerateStream, RequestOutput]:
        """`_first_item`, and where the replica it landed on failed before it (the replica's engine had died, or the
        replica did: nothing went out to the client yet), again on another replica, `failovers` times at most and
        while its TTFT SLO lasts. Serve routes to a failed replica until its health checks fail, seconds; a load
        balancer's client expects the request to be served by a replica that works meanwhile. Returns the request as
        last sent (the failed replicas in its `avoid_replicas`)."""
        for attempt in range(self.failovers + 1):
            more = attempt < self.failovers
            try:
                gen, first = await self._first_item(req)
            except APIError as e:
                # Serve's router drops a dead actor (an unreachable one may still run the call: not sent again)
                if (again := _resent(req, waited_ms, t_call) if more and e.resendable else None) is None:
                    raise
                log.warning("request %s: its replica died before its first token (%s); sent to another one",
                            req.request_id, e.message)
                req = again
                continue
            sb = first.served_by
            lost = sb.replica if sb is not None else None
            if (again := _resent(req, waited_ms, t_call, lost, failed=True) if more and _engine_lost(first)
                    else None) is None:
                return req, gen, first
            gen.cancel()
            log.warning("request %s: the engine of replica %s had died; sent to another one", req.request_id, lost)
            req = again
        raise AssertionError("unreachable")  # the last attempt returns or raises

    @staticmethod
    def _headers(rid: str, req: GenerateRequest, first: RequestOutput, t_in: float, t_call: float,
                 proxy_ms: float = 0.0) -> dict[str, str]:
        sb = first.served_by
        headers = {"x-kairos-request-id": rid, "x-kairos-replica": sb.replica if sb else "",
                   "Server-Timing": server_timing(t_in, t_call, time.perf_counter(), sb.replica_ms if sb else None,
                                                  proxy_ms)}
        if req.avoid_replicas:
            headers["x-kairos-rerouted"] = str(len(req.avoid_replicas))
        return headers

    async def _respond(self, body: P._Common, req: GenerateRequest, kind: str, rid: str, t_in: float,
                       t_call: float, proxy_ms: float = 0.0, echo: str | None = None) -> Any:
        """The response to a parsed request: a whole completion, or the stream once its first item is in. Its TTFT
        SLO counts from when the request reached this server (vLLM's arrival time): HAProxy's stamp, else `t_in`
        (`req.waited_ms` holds what it spent before `t_in`), not from the end of its parsing. `echo`: text that goes
        before the reply's (a completion's prompt)."""
        req, gen, first = await self._start(req, t_in)
        gen, first = _prompt_only(gen, first, body)
        headers = self._headers(rid, req, first, t_in, t_call, proxy_ms)
        model = body.model or self.served_model_name  # the name the client asked for, as vLLM answers
        if first.finished:
            failure = item_failure(first, headers, self.retry_after_s, body.fields_at_fault())
            if failure is not None:
                raise failure
        if body.stream:
            response = StreamingResponse(self._sse(gen, first, kind, rid, body.include_usage, model,
                                                   body.continuous_usage, body.logprobs_shape(), echo,
                                                   self._reply_readers(body), bool(body.return_token_ids)),
                                         media_type="text/event-stream",
                                         headers={**headers, "Cache-Control": "no-cache"})
            # a response never sent never starts its SSE generator, whose `finally` cancels the stream: whoever
            # drops it unsent calls this (`_drop`)
            response.kairos_cancel = gen.cancel  # type: ignore[attr-defined]
            return response
        return await self._collect(gen, first, kind, rid, headers, model, body, echo)

    async def _beam_search(self, body: P._Common, reqs: list[GenerateRequest], kind: str, rid: str, t_in: float,
                           t_call: float, proxy_ms: float) -> JSONResponse:
        """vLLM's beam search (`use_beam_search`), as vLLM's OpenAI server runs it over its engine: for each prompt,
        `n` beams (the prompt, at first); each step, each beam's next-token log-probabilities (a request of one token
        over the beam's tokens, its 2n likeliest: the prefix cache holds the beam's KV), every beam grown by each of
        them, and the n likeliest kept, ranked by their summed log-probability over their length (the prompt's
        tokens counted) to the power `length_penalty`. A beam grown by an EOS (unless `ignore_eos`) has ended (with
        the EOS where `include_stop_str_in_output`); after `max_tokens` steps, or once no beam goes on, the n best of
        the ended and the living beams are the choices, best first (finish reason stop where ended by an EOS, else
        length). Each step's requests carry no SLO (their pace is the search's); one turned away or failed fails the
        response with its status. Streamed, the choices come once the search has ended, each in one chunk (vLLM's
        way)."""
        width = body.n or 1
        info = self._ready_info() or {}
        eos, over_context = frozenset(info.get("eos_token_ids") or ()), info.get("max_tokens_over_context", "reject")
        model = body.model or self.served_model_name
        first_headers: list[dict[str, str]] = []

        async def step(req: GenerateRequest, tokens: tuple[int, ...], tag: str) -> list[tuple[int, float]]:
            self._own_call()  # in this call's own task
            one = dataclasses.replace(req, request_id=tag, prompt=tokens, messages=None, slo=SLO(),
                                      prompt_len_hint=len(tokens), params=dataclasses.replace(
                                          req.params, max_tokens=1, min_tokens=0, temperature=0.0, ignore_eos=True,
                                          logprobs=2 * width, seed=None),  # (n <= max_logprobs / 2: _beam)
                                      options=PromptOptions(add_special_tokens=False), return_token_ids=False)
            sent, gen, first = await self._start(one, time.perf_counter())
            headers = self._headers(rid, sent, first, t_in, t_call, proxy_ms)
            if first.finished:
                failure = item_failure(first, headers, self.retry_after_s, body.fields_at_fault())
                if failure is not None:
                    raise failure
            whole = await self._rest(gen, first, rid, headers)
            if not first_headers:
                first_headers.append(headers)
            lp = (whole.logprobs or [None])[0]
            return [] if lp is None else [(t, v) for t, _, v in lp.top if v != float("-inf")]

        async def search(req: GenerateRequest) -> list[P.Choice]:
            self._own_call()
            got = await self._replica_call("prompt_tokens", req.prompt if req.messages is None else None,
                                           req.messages, req.options)
            if "error" in got:
                raise APIError(400, got["error"], param=body.fields_at_fault()[0])
            prompt = tuple(got["tokens"])
            thinking.append(got.get("thinking"))
            # each step is a request of one token: the reply's cap is checked here, against the context the prompt
            # leaves, as the engine checks a generation's (a chat's default: the rest of the context)
            limit, fields = got["max_model_len"], body.fields_at_fault()
            room, cap = limit - len(prompt), req.params.max_tokens
            if room < 1:
                raise APIError(400, str(PromptTooLong(len(prompt), limit)), param=fields[0],
                               code="context_length_exceeded")
            if cap is not None and cap > room and over_context == "reject":
                raise APIError(400, str(ContextLengthExceeded(cap, limit, len(prompt))), param=fields[1],
                               code="context_length_exceeded")
            beams = BeamSearch(prompt, width, eos, req.params.ignore_eos, req.params.include_stop_str_in_output,
                               body.length_penalty)
            for k in range(room if cap is None else min(cap, room)):
                tops = await _all_or_none([step(req, toks, f"{req.request_id}-beam{k}.{j}")
                                           for j, (toks, _) in enumerate(beams.live)])
                if not beams.grow(tops):
                    break
            best = beams.best()

            async def text_of(reply: list[int]) -> dict[str, Any]:
                self._own_call()  # (calls at once: each its own id, as `step`'s)
                return await self._replica_call("token_text", reply) if reply else {"prompt": ""}

            replies = [list(toks[len(prompt):]) for toks, _, _ in best]
            # (a beam that stopped keeps its stop token where include_stop_str_in_output says so: in its token ids,
            # not in its text, as vLLM's; else its last token is the reply's own)
            texts = await _all_or_none([text_of(reply[:-1] if stopped and reply and reply[-1] in eos else reply)
                                        for (_, _, stopped), reply in zip(best, replies)])
            ids = body.return_token_ids  # (vLLM's: the beam's tokens, and its prompt's)
            out = []
            for (_, _, stopped), reply, text in zip(best, replies, texts):
                if "error" in text:
                    raise APIError(500, text["error"], "server_error", "replica_error")
                out.append(P.Choice(text["prompt"], FinishReason.STOP if stopped else FinishReason.LENGTH,
                                    len(prompt), len(reply), token_ids=reply if ids else None,
                                    prompt_token_ids=list(prompt) if ids else None))
            return out

        thinking: list[str | None] = []  # where the prompt leaves the thinking (`RequestOutput.prompt_thinking`)
        done = await _all_or_none([search(r) for r in reqs])
        choices = [c for group in done for c in group]
        headers = first_headers[0] if first_headers else {"x-kairos-request-id": rid}
        # a chat's replies read as any chat's are (reasoning, tool calls: `P.read_replies`)
        whole = P.read_replies(P.batch_chat_response(rid, model, choices), self._reply_readers(body) or _no_reader,
                               None, thinking[0] if thinking else None) if kind == "chat" else None
        if body.stream:  # (as vLLM's: each beam's text in one chunk, once the search has ended)
            return StreamingResponse(_beam_chunks(choices, kind, rid, model, width, body.include_usage, whole),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        if kind == "completion":
            return JSONResponse(P.batch_completion_response(rid, model, choices, width), headers=headers)
        return JSONResponse(whole, headers=headers)

    async def _first_item(self, req: GenerateRequest) -> tuple[GenerateStream, RequestOutput]:
        """Start the request (on a replica the router picks, or on this replica's engine) and wait for its first
        item: a token, or its end."""
        rid = req.request_id
        gen = self._open(req)
        try:
            first = await gen.__anext__()
        except BackPressureError as e:
            raise overloaded(max(self.retry_after_s, int(getattr(e, "retry_after_s", None) or 0))) from None
        except (DeploymentUnavailableError, RayServeException, StopAsyncIteration) as e:
            _cancel_quietly(gen)
            raise APIError(503, f"no LLM replica available: {type(e).__name__}", "server_error", "unavailable",
                           {"Retry-After": str(self.retry_after_s)}) from None
        except REPLICA_ERRORS as e:
            _cancel_quietly(gen)
            log.warning("request %s failed in its replica: %r", rid, e)
            failure = replica_failure(e, self.retry_after_s)
            # an unreachable actor may still run it through Ray; over gRPC its call was cancelled with the connection
            unreachable = isinstance(e, ActorUnavailableError)
            failure.resendable = isinstance(e, RayActorError) and (self.grpc or not unreachable)
            raise failure from None
        except BaseException:
            _cancel_quietly(gen)
            raise
        try:
            return gen, check_output(first)
        except ProtocolError as e:
            _cancel_quietly(gen)
            raise protocol_failure(rid, e) from None

    async def _respond_batch(self, body: P._Common, reqs: list[GenerateRequest], kind: str, rid: str, t_in: float,
                             proxy_ms: float = 0.0, echo: list[str] | None = None) -> Any:
        """A response of several choices: a completion of several prompts (vLLM's batched `prompt`), `n` choices of
        each prompt, or `n` choices of a chat. A request per choice, each routed, admitted or turned away on its own;
        the response has every choice (`index`: prompt i's j-th at i x n + j) and their usage summed (each prompt
        counted once), or streams every choice's chunks as they come, each naming its choice. At most
        `batch_concurrency` prompts are in flight at once (what the replicas run at once): the rest wait here, not
        in a replica's queue, which would turn a large batch away as full. A prompt turned away for the load (a 429)
        while others of its batch run waits here for one of them to end and is sent again, with what is left of its
        TTFT SLO: a batch under a TPOT SLO the replicas can keep for some of its prompts at once, not all, runs as
        many at a time as they take. Turned away while none runs, after some were served, it waits the refusal's
        Retry-After and is sent again (`BATCH_PAUSES` times at most). One that fails otherwise fails the response
        with its status (the others are cancelled); streamed, one that fails after the stream has started (a prompt
        of a later wave) ends it with an error event. The headers are the first prompt's, `x-kairos-replica` naming
        every replica that served the batch (streamed: its first wave). `echo`: each prompt's text, to go before its
        choices' (a completion's `echo`)."""
        model = body.model or self.served_model_name
        batch = _BatchFlight(self.batch_concurrency)
        n = _made(body)  # each prompt's choices (a completion's best_of; `body.n` of them returned)

        async def start(i: int, req: GenerateRequest, wait: bool = True
                        ) -> tuple[GenerateStream, RequestOutput, dict[str, str]] | None:
            """Prompt i's request started, holding a slot (released by whoever ends it, `batch.end`); its refusal, an
            APIError. Turned away for the load while another prompt of the batch runs or starts: with `wait`, sent
            again once one of them ends (its turn in line); without, None (its slot released: the caller starts it
            later)."""
            await batch.slots.acquire()
            tries, pauses = 0, 0
            try:
                while True:
                    self._own_call()  # in this prompt's own task
                    # its TTFT SLO counts from the batch's arrival: less what it waited here (reading and parsing
                    # the batch, for a slot, in line)
                    t0 = time.perf_counter()
                    sent = dataclasses.replace(req, waited_ms=req.waited_ms + (t0 - t_in) * 1000.0)
                    seen = batch.sending()
                    try:
                        sent, gen, first = await self._start(sent, t0)
                        gen, first = _prompt_only(gen, first, body)
                    except APIError as e:
                        batch.answered(False, tries > 0)
                        if e.status != 429:
                            raise
                        gen, first, failure = None, None, e  # the replicas' queues are full (Serve's back pressure)
                    except BaseException:
                        batch.answered(False, tries > 0)
                        raise
                    else:
                        headers = self._headers(rid, sent, first, t_in, t0, proxy_ms)
                        failure = item_failure(first, headers, self.retry_after_s, body.fields_at_fault()) \
                            if first.finished else None
                        batch.answered(failure is None, tries > 0)
                    if failure is None:
                        return gen, first, headers
                    if gen is not None:
                        gen.cancel()
                    if failure.status == 429:
                        ttft = req.slo.ttft_ms
                        left_s = None if ttft is None else \
                            (ttft - req.waited_ms) / 1000.0 - (time.perf_counter() - t_in)
                        if batch.may_make_room(seen):
                            if not wait:
                                batch.slots.release()
                                return None
                            again = (left_s is None or left_s > 0) and await batch.wait_turn(seen, tries > 0, left_s)
                        else:  # none of the batch runs: where some were served, the replicas turn it away for their
                            # steps measured lately or others' load; it waits the refusal's Retry-After, a few times
                            pause_s = min(float((failure.headers or {}).get("Retry-After", 1)), BATCH_PAUSE_MAX_S)
                            again = wait and batch.ended > 0 and pauses < BATCH_PAUSES \
                                and (left_s is None or left_s > pause_s)
                            if again:
                                pauses += 1
                                await asyncio.sleep(pause_s)
                        if again and (ttft is None or req.waited_ms + (time.perf_counter() - t_in) * 1000.0 < ttft):
                            tries += 1
                            continue  # sent again with what is left of its TTFT SLO
                    failure.message = f"{_choice_name(kind, n, i)}: {failure.message}"
                    raise failure
            except BaseException:
                batch.slots.release()
                raise

        if not body.stream:
            async def whole(i: int, req: GenerateRequest) -> tuple[dict[str, str], _Whole]:
                gen, first, headers = await start(i, req)  # type: ignore[misc]
                try:
                    return headers, await self._rest(gen, first, req.request_id, headers)
                finally:
                    batch.end()

            done = await _all_or_none([whole(i, r) for i, r in enumerate(reqs)])
            choices = [_choice(kind, body, w, echo[i // n] if echo else None) for i, (_, w) in enumerate(done)]
            made = sum(c.completion_tokens for c in choices)  # every choice made counts, returned or not (OpenAI's)
            if n > (body.n or 1):
                choices = _best_of(choices, [w for _, w in done], n, body.n or 1)
            whole_body = P.batch_completion_response(rid, model, choices, body.n or 1, made) \
                if kind == "completion" else P.read_replies(P.batch_chat_response(rid, model, choices),
                                                               self._reply_readers(body) or _no_reader,
                                                               echo[0] if echo else None, done[0][1].prompt_thinking)
            # (each prompt once, as its tokens are counted: its first choice's)
            cached = self._cached([w.last for _, w in done[::n]])
            return JSONResponse(P.with_cached_tokens(whole_body, cached), headers=_batch_headers([h for h, _ in done]))
        wave = min(len(reqs), self.batch_concurrency)  # started before the response: its failures are its status

        def close(s: tuple[GenerateStream, RequestOutput, dict[str, str]] | None) -> None:
            if s is not None:
                s[0].cancel()
                batch.end()

        first_wave = await _all_or_none([start(i, r, wait=False) for i, r in enumerate(reqs[:wave])], close=close)
        started = [(i, s) for i, s in enumerate(first_wave) if s is not None]
        later = [(i, reqs[i]) for i, s in enumerate(first_wave) if s is None] + list(enumerate(reqs))[wave:]
        response = StreamingResponse(
            self._sse_batch(started, later, start, rid, body.include_usage, model, batch, body.continuous_usage,
                            kind, n, body.logprobs_shape(), echo, self._reply_readers(body),
                            bool(body.return_token_ids)),
            media_type="text/event-stream",
            headers={**_batch_headers([h for _, (_, _, h) in started]), "Cache-Control": "no-cache"})
        response.kairos_cancel = lambda: [s[0].cancel() for _, s in started]  # type: ignore[attr-defined]
        return response

    async def _sse_batch(self, started: list[tuple[int, tuple[GenerateStream, RequestOutput, dict[str, str]]]],
                         later: list[tuple[int, GenerateRequest]], start: Callable[..., Awaitable[Any]], rid: str,
                         include_usage: bool, model: str, batch: "_BatchFlight", continuous: bool = False,
                         kind: str = "completion", n: int = 1, top: P.LogprobShape | None = None,
                         echo: list[str] | None = None, tools: Callable[[], ReplyReader | None] | None = None,
                         ids: bool = False) -> AsyncIterator[bytes]:
        """A batched response's SSE stream: every choice's chunks as its items arrive, each naming its choice (the
        `started` ones', then the `later` ones' as slots free up), (index, started stream) and (index, request);
        (chat) a choice's first chunk says its role; then the summed usage (each prompt counted once, of `n`
        choices each; with include_usage; `continuous`: each chunk its choice's so far too) and [DONE]. `top`: each
        chunk has its tokens' logprobs, shown so (`P.LogprobShape`). `echo`: each prompt's text, which its
        choices' first chunks open with. `tools`: each choice's reader of its reply (a chat's reasoning and tool
        calls, `ReplyReader`), whose reading its chunks carry instead of that text. `ids`: vLLM's return_token_ids
        (`_sse`). A choice that fails ends the stream with an error event, and the others are cancelled."""
        created = int(time.time())
        total = len(started) + len(later)
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue(maxsize=total)

        async def pump(i: int, gen: GenerateStream | None, item: RequestOutput | None,
                       req: GenerateRequest | None = None) -> None:
            """Prompt i's items into the queue (a later prompt, `req`, is started here first); it owns its stream and
            its slot: cancelled (or failed), it cancels the stream."""
            finished = False
            try:
                if gen is None:
                    gen, item, _ = await start(i, req)
                try:
                    while True:
                        await queue.put((i, item, None))
                        if item.finished:  # type: ignore[union-attr]
                            finished = True
                            return
                        item = check_output(await gen.__anext__())
                finally:
                    if not finished:
                        gen.cancel()
                    batch.end()
            except (Exception, StopAsyncIteration) as e:  # noqa: BLE001 - the stream reports it
                await queue.put((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, gen, first)) for i, (gen, first, _) in started]
        tasks += [asyncio.ensure_future(pump(i, None, None, req)) for i, req in later]
        left, pt, ct = total, 0, 0
        finals: list[RequestOutput] = []  # each prompt's first choice's last item (its prompt counted once)
        fasts: dict[int, TextChunks | None] = {}  # each choice's text chunks (None with `continuous` or logprobs)
        shown: dict[int, P.Logprobs] = {}  # each choice's logprobs (with `top`)
        readers: dict[int, ReplyReader | None] = {}  # each choice's reader of its reply (with `tools`)
        try:
            while left:
                i, item, err = await queue.get()
                if item is None:
                    log.warning("stream %s-%d failed: %r", rid, i, err)
                    yield _exception_event(err, "" if isinstance(err, APIError)
                                           and err.message.startswith(("prompt ", "choice ")) else
                                           f"{_choice_name(kind, n, i)}: ")
                    break
                if item.finish_reason in FAILED:  # as a choice failing before the stream: ends it
                    log.warning("stream %s-%d failed: %s", rid, i, item.error)
                    yield _error_event(item, f"{_choice_name(kind, n, i)}: ")
                    break
                lead, echoed = None, ""  # an echoed prompt's logprobs and text, before its choice's first tokens'
                if i not in fasts:  # the choice's first item
                    readers[i] = tools(item.prompt_thinking) if tools is not None else None
                    fasts[i] = None if continuous or top is not None or readers[i] is not None or ids else \
                        TextChunks(kind, rid, model, created, include_usage, i)
                    if top is not None:
                        shown[i] = P.Logprobs(kind, top)
                    if echo:
                        echoed = echo[i // n]
                        item = dataclasses.replace(item, text=echoed + item.text)
                        lead = item.prompt_logprobs if top is not None else None
                    if kind == "chat":
                        yield _chunk(_role_chunk(rid, model, created, i, item.prompt_token_ids if ids else None),
                                     include_usage, P.usage(item.num_prompt_tokens, 0) if continuous else None)
                if (out := _sse_item(item, kind, rid, model, created, include_usage, i, continuous,
                                     fasts[i], shown.get(i), lead, readers[i], ids, echoed)) is not None:
                    yield out
                if item.finished:
                    left, ct = left - 1, ct + item.num_output_tokens
                    if i % n == 0:
                        pt += item.num_prompt_tokens
                        finals.append(item)
            if not left and include_usage:
                yield P.sse(P.usage_chunk(rid, model, created, obj, pt, ct, cached_tokens=self._cached(finals)))
            yield P.SSE_DONE
        finally:  # also on client disconnect: each pump cancelled cancels its stream
            for task in tasks:
                task.cancel()

    def _cached(self, finals: list[RequestOutput]) -> int | None:
        """The prompt tokens the prefix cache held for these requests (their final items), where the usage says so
        (enable_prompt_tokens_details)."""
        if not self.prompt_tokens_details:
            return None
        return sum([f.metrics.num_cached_tokens for f in finals if f.metrics is not None])

    async def _rest(self, gen: Any, first: RequestOutput, rid: str, headers: dict[str, str]) -> "_Whole":
        """A non-streaming request's reply from its first item on (`_Whole`); an APIError where it failed."""
        # (the reply's token ids where the request asked for them: the replica then gave its prompt's)
        parts, item, ids = [first.text], first, None if first.prompt_token_ids is None else list(first.token_ids)
        lps = None if first.logprobs is None else list(first.logprobs)
        prompt = first.prompt_logprobs
        try:
            while not item.finished:
                item = check_output(await gen.__anext__())
                parts.append(item.text)
                if ids is not None:
                    ids += item.token_ids
                if item.logprobs is not None:
                    if lps is None:
                        lps = []
                    lps.extend(item.logprobs)
                if item.prompt_logprobs is not None:
                    prompt = item.prompt_logprobs
        except ProtocolError as e:
            gen.cancel()
            raise protocol_failure(rid, e) from None
        except (*REPLICA_ERRORS, StopAsyncIteration) as e:  # replica failed
            gen.cancel()
            log.warning("request %s failed in its replica: %r", rid, e)
            raise replica_failure(e, self.retry_after_s, headers) from None
        except BaseException:  # client gone (CancelledError): stop generating
            gen.cancel()
            raise
        if item.finish_reason in FAILED:  # 503 where the engine died or stopped under it, else 500
            raise item_failure(item, headers, self.retry_after_s)  # type: ignore[misc]
        return _Whole("".join(parts), item, lps, prompt, ids, first.prompt_token_ids, first.prompt_thinking)

    async def _collect(self, gen: Any, first: RequestOutput, kind: str, rid: str, headers: dict[str, str],
                       model: str, body: P._Common | None = None, echo: str | None = None) -> JSONResponse:
        """A non-streaming request's response: its reply, with what `body` asks (logprobs), after `echo`."""
        whole = await self._rest(gen, first, rid, headers)
        choice, cached = _choice(kind, body, whole, echo), self._cached([whole.last])
        if kind == "completion":
            return JSONResponse(P.with_cached_tokens(P.batch_completion_response(rid, model, [choice]), cached),
                                headers=headers)
        return JSONResponse(P.with_cached_tokens(P.read_replies(P.batch_chat_response(rid, model, [choice]),
                                                                self._reply_readers(body) or _no_reader, echo,
                                                                whole.prompt_thinking),
                                                 cached),
                            headers=headers)

    async def _sse(self, gen: Any, first: RequestOutput, kind: str, rid: str,
                   include_usage: bool, model: str, continuous: bool = False,
                   top: P.LogprobShape | None = None, echo: str | None = None,
                   tools: Callable[[], ReplyReader | None] | None = None, ids: bool = False) -> AsyncIterator[bytes]:
        """A request's SSE stream from its `first` item: (chat) the role's chunk, a chunk per item, the usage (with
        include_usage; `continuous`: in every chunk too, the tokens so far) and [DONE]. `top`: each chunk has its
        tokens' logprobs, shown so (`P.LogprobShape`). `echo`: text the first chunk opens with. `tools`:
        the reader of a chat reply (its reasoning and tool calls), whose reading its chunks carry instead of that
        text. `ids`: vLLM's return_token_ids, each chunk its tokens' ids and the first its prompt's."""
        created, item, lead, echoed = int(time.time()), first, None, echo or ""
        if echo is not None:
            item = dataclasses.replace(first, text=echo + first.text)
            lead = first.prompt_logprobs if top is not None else None  # the echoed prompt's, before the reply's
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        reader = tools(first.prompt_thinking) if tools is not None else None
        fast = None if continuous or top is not None or reader is not None or ids else \
            TextChunks(kind, rid, model, created, include_usage)
        shown = P.Logprobs(kind, top) if top is not None else None
        done = False
        try:
            if kind == "chat":
                yield _chunk(_role_chunk(rid, model, created, 0, first.prompt_token_ids if ids else None),
                             include_usage, P.usage(first.num_prompt_tokens, 0) if continuous else None)
            while True:
                if (out := _sse_item(item, kind, rid, model, created, include_usage, 0, continuous, fast, shown,
                                     lead, reader, ids, echoed)) is not None:
                    yield out
                lead, echoed = None, ""
                if item.finished:
                    done = True
                    break
                item = check_output(await gen.__anext__())
            if include_usage and item.finish_reason not in FAILED:  # a failed stream ends at its error
                yield P.sse(P.usage_chunk(rid, model, created, obj, item.num_prompt_tokens,
                                          item.num_output_tokens, P.engine_metrics(item.metrics),
                                          self._cached([item])))
            yield P.SSE_DONE
        except (Exception, StopAsyncIteration) as e:  # replica died mid-stream or broke the contract: tell the
            log.warning("stream %s failed: %r", rid, e)  # client with an error event, end cleanly
            yield _exception_event(e)
            yield P.SSE_DONE
        finally:  # also on client disconnect (CancelledError / GeneratorExit): abort in the engine
            if not done:
                gen.cancel()


def _cancel_quietly(gen: GenerateStream) -> None:
    """Cancel a stream that failed before its first item. Serve's cancel raises the call's own failure again where
    the call never reached a replica (e.g. a gRPC message over the replica's limit), and the request has failed
    with it already."""
    try:
        gen.cancel()
    except Exception as e:  # noqa: BLE001 - nothing runs to cancel
        log.debug("cancel of a failed call: %r", e)


def _choice_name(kind: str, n: int, k: int) -> str:
    """What a failure's message names for the k-th request of a response of several: a batched completion's prompt
    (and its choice, with `n`), or a chat's choice."""
    if kind != "completion":
        return f"choice {k}"
    return f"prompt {k}" if n == 1 else f"prompt {k // n}, choice {k % n}"


def child_params(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling of a request's j-th choice (`n`): its own seed, seed + j (as vLLM's, kept a signed 64-bit
    integer), where the request has one; the same params otherwise (each choice draws from its own numbers)."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)


_TURN_TOKENS = 4  # a chat turn's markers (its role, its start and end), as a router guesses them


def _len_hint(prompt: str | list[int]) -> int:
    """A prompt's length in tokens as a router guesses it before the replica counts: its ids, or 4 ASCII characters
    each and a token for each other character (CJK text takes about one a character)."""
    if isinstance(prompt, list):
        return max(1, len(prompt))
    ascii_chars = len(prompt.encode("ascii", "ignore"))
    return max(1, ascii_chars // 4 + len(prompt) - ascii_chars)


def running_replicas(app: str, deployment: str) -> tuple[int, str | None] | None:
    """How many replicas of `deployment` in `app` Serve's controller counts as RUNNING (None if it does not know),
    with why the deployment failed where Serve says it did (replicas that fail to start, or cannot be placed)."""
    status = serve.status().applications.get(app)
    d = status.deployments.get(deployment) if status is not None else None
    if d is None:
        return None
    failed = str(getattr(d.status, "value", d.status)) in ("UNHEALTHY", "DEPLOY_FAILED")
    return int(d.replica_states.get("RUNNING", 0)), (d.message or "the LLM deployment failed") if failed else None


def _engine_lost(item: RequestOutput) -> bool:
    """Whether a stream's item says its replica's engine is gone (the request never ran there)."""
    return item.finish_reason is FinishReason.ERROR and item.error_kind is ErrorKind.UNAVAILABLE


def _resent(req: GenerateRequest, waited_ms: float, t_call: float, avoid: str | None = None,
            any_time: bool = False, failed: bool = False) -> GenerateRequest | None:
    """`req` to send again: the time it spent (`waited_ms` before `t_call`, and since) taken off its TTFT SLO, and
    replica `avoid` (one that turned it away, or that `failed` it: its engine died) added to those it avoids; None
    once its TTFT SLO ran out (unless `any_time`: a second opinion on an SLO judged unattainable)."""
    spent_ms = waited_ms + (time.perf_counter() - t_call) * 1000.0
    if req.slo.ttft_ms is not None and spent_ms >= req.slo.ttft_ms and not any_time:
        return None
    return dataclasses.replace(req, waited_ms=spent_ms,
                               avoid_replicas=(*req.avoid_replicas, avoid) if avoid else req.avoid_replicas,
                               failed_replicas=(*req.failed_replicas, avoid) if avoid and failed
                               else req.failed_replicas)


def _offer(item: RequestOutput) -> tuple[float, float]:
    """The idle floor a replica's `slo_unattainable` gave (TPOT, then TTFT), to pick the lower offer of two."""
    sb = item.served_by
    if sb is None or sb.best_tpot_ms is None or sb.best_ttft_ms is None:
        return math.inf, math.inf
    return sb.best_tpot_ms, sb.best_ttft_ms


def _note_refusal(first: RequestOutput, req: GenerateRequest) -> None:
    """Tell this process's SLO routers (refusals.note_refusal) that a replica turned `req` away for its load: at
    the SLO it was sent with (`engine_slo`: a TTFT SLO spent before the send, here or on an earlier replica, says
    nothing of the load of this one about requests with more of theirs left; the replica judged it less its way
    there too, `GenerateRequest.arrived`, which this side does not know)."""
    sb = first.served_by
    if first.finish_reason is FinishReason.REJECTED and sb is not None and sb.replica \
            and first.reject_reason is not RejectReason.SLO_UNATTAINABLE:  # that one says nothing about load
        note_refusal(sb.replica, req.engine_slo, (first.reject_reason or RejectReason.OVERLOADED).value, req.priority)


def _chunk(body: dict, include_usage: bool, usage: dict | None = None) -> bytes:
    """An SSE chunk; with include_usage every chunk but the usage one says "usage": null (OpenAI), or with vLLM's
    continuous_usage_stats the `usage` so far."""
    if include_usage:
        body["usage"] = usage
    return P.sse(body)


class TextChunks:
    """A stream's chunks that carry text and nothing else (neither a finish reason nor the usage so far: all but
    the last of a stream; a chat chunk only with some text), as bytes: the chunk `_sse_item` would build, with only
    the text encoded per chunk. Every other field is the stream's own, so the chunk's JSON around the text is built
    once, at the stream's start (a GPU replica streams tens of thousands of chunks a second from one event loop)."""

    _MARK = "\x00kairos-text\x00"

    def __init__(self, kind: str, rid: str, model: str, created: int, include_usage: bool, index: int = 0) -> None:
        if kind == "completion":
            body = P.completion_chunk(rid, model, created, self._MARK, None, index)
        else:
            body = P.chat_chunk(rid, model, created, {"content": self._MARK}, None, index=index)
        whole = _chunk(body, include_usage)
        mark = json.dumps(self._MARK).encode()
        self.usable = whole.count(mark) == 1  # (a model name or id holding the mark itself: the dict path)
        self.empty_ok = kind == "completion"  # a chat chunk with no text has an empty delta, not an empty content
        self.head, _, self.tail = whole.partition(mark)

    def chunk(self, text: str) -> bytes:
        return self.head + json.dumps(text).encode() + self.tail


def _sse_item(item: RequestOutput, kind: str, rid: str, model: str, created: int, include_usage: bool,
              index: int = 0, continuous: bool = False, fast: TextChunks | None = None,
              shown: P.Logprobs | None = None, lead: list[TokenLogprob] | None = None,
              tools: ReplyReader | None = None, ids: bool = False, echoed: str = "") -> bytes | None:
    """One stream item as SSE: an error event for a failed generation, else the choice's chunk (`index`), or None
    for an item with nothing to say. A token with no text yet (a partial UTF-8 character) still gets its chunk, as
    in vLLM: clients time tokens by chunk arrival. `fast`: the stream's `TextChunks` (not with `continuous` or
    logprobs), which builds an unfinished item's chunk with text. `shown`: the choice's logprobs so far, where its
    request asks for them: the chunk has its tokens', after `lead`'s (an echoed prompt's tokens, in its text).
    `ids`: vLLM's return_token_ids: the chunk has its tokens' ids (a completion's first, its prompt's too).
    `echoed`: the text the item's opens with that is a chat's echoed last message: content, not read by `tools`
    (vLLM reads the reply, then puts the echo before its content)."""
    fin = item.finish_reason
    if fin in FAILED:  # (its tokens first, where the stream merged some into it: they were made, and streamed)
        made = _sse_item(dataclasses.replace(item, finished=False, finish_reason=None, error=None, error_kind=None,
                                             metrics=None), kind, rid, model, created, include_usage, index,
                         continuous, fast, shown, lead, tools, ids, echoed) if item.text or item.token_ids else None
        return (made or b"") + _error_event(item)
    if not (item.text or item.token_ids or item.finished):
        return None
    if fast is not None and fin is None and (item.text or fast.empty_ok) and fast.usable:
        return fast.chunk(item.text)
    usage = P.usage(item.num_prompt_tokens, item.num_output_tokens) if continuous else None
    lps = (lead or []) + (item.logprobs or [])
    lp = shown.render(lps, item.text) if shown is not None and lps else None
    if shown is not None and not lps:
        shown.offset += len(item.text)
    if kind == "completion":
        body = P.completion_chunk(rid, model, created, item.text, fin, index, item.stop_reason, lp)
        if ids:
            P.with_token_ids(body["choices"][0], item.token_ids, item.prompt_token_ids)
        return _chunk(body, include_usage, usage)
    delta = {"content": item.text} if item.text else {}
    if tools is not None:  # the reply's text as reasoning, content and tool calls
        read = tools.feed(item.text[len(echoed):])
        read.content = echoed + read.content
        if item.finished:
            read.add(tools.end())
            if tools.calls and tools.as_calls and fin == FinishReason.STOP:  # (cut by its cap: `length`)
                fin = "tool_calls"  # type: ignore[assignment]
        delta = read.delta()
    body = P.chat_chunk(rid, model, created, delta, fin, item.stop_reason, index, lp)
    if ids:
        P.with_token_ids(body["choices"][0], item.token_ids)
    return _chunk(body, include_usage, usage)


def _role_chunk(rid: str, model: str, created: int, index: int, prompt_token_ids: list[int] | None) -> dict:
    """A chat choice's first chunk, which says its role (and, with vLLM's return_token_ids, the prompt's ids)."""
    return P.with_token_ids(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None, index=index),
                            None, prompt_token_ids)


class BeamSearch:
    """vLLM's beam search over next-token log-probabilities (`OpenAIFrontend._beam_search` asks the model for them):
    the `live` beams (token ids, the prompt's first; summed log-probability of the reply's tokens) and those `ended`
    by an EOS. A beam's score is its sum over its length (the prompt counted, an ending EOS not) to the power
    `length_penalty`, vLLM's `get_beam_search_score`."""

    def __init__(self, prompt: tuple[int, ...], width: int, eos: frozenset[int], ignore_eos: bool = False,
                 keep_eos: bool = False, length_penalty: float = 1.0) -> None:
        self.width, self.eos, self.ignore_eos, self.keep_eos = width, eos, ignore_eos, keep_eos
        self.length_penalty = length_penalty
        self.live: list[tuple[tuple[int, ...], float]] = [(prompt, 0.0)]
        self.ended: list[tuple[tuple[int, ...], float]] = []

    def score(self, tokens: tuple[int, ...], cum: float, ended: bool = False) -> float:
        n = len(tokens) - (1 if ended and self.keep_eos else 0)
        return cum / (max(n, 1) ** self.length_penalty)

    def grow(self, tops: list[list[tuple[int, float]]]) -> bool:
        """One step: each live beam's likeliest next tokens (id, log-probability), in `live`'s order. Each beam grown
        by each; one grown by an EOS has ended (unless `ignore_eos`; its EOS kept with `keep_eos`); the `width` best
        of the others live on. False once none does."""
        grown = []
        for (toks, cum), top in zip(self.live, tops):
            for t, v in top:
                if t in self.eos and not self.ignore_eos:
                    self.ended.append((toks + (t,) if self.keep_eos else toks, cum + v))
                else:
                    grown.append((toks + (t,), cum + v))
        self.live = sorted(grown, key=lambda b: self.score(*b), reverse=True)[:self.width]
        return bool(self.live)

    def best(self) -> list[tuple[tuple[int, ...], float, bool]]:
        """The `width` best beams, ended and live, best first: (tokens, summed log-probability, ended)."""
        every = [(t, c, True) for t, c in self.ended] + [(t, c, False) for t, c in self.live]
        return sorted(every, key=lambda b: self.score(*b), reverse=True)[:self.width]


async def _beam_chunks(choices: list[P.Choice], kind: str, rid: str, model: str, n: int,
                       include_usage: bool, read: dict | None = None) -> AsyncIterator[bytes]:
    """A beam search's choices as an SSE stream: each its text in one chunk (a chat's: its role first, then its reply
    as `read` has it: its reasoning, content and tool calls; with their token ids where asked), its usage (each prompt
    counted once) where asked, and [DONE]."""
    created = int(time.time())
    for i, c in enumerate(choices):
        if kind == "completion":
            chunk = P.completion_chunk(rid, model, created, c.text, c.finish.value, i)
            P.with_token_ids(chunk["choices"][0], c.token_ids, c.prompt_token_ids)
            yield _chunk(chunk, include_usage)
            continue
        yield _chunk(_role_chunk(rid, model, created, i, c.prompt_token_ids), include_usage)
        got = read["choices"][i]  # (`read_replies`'s: every chat beam search's)
        message = got["message"]
        delta = {k: message[k] for k in ("reasoning_content", "content") if message.get(k)}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        yield _chunk(P.with_token_ids(P.chat_chunk(rid, model, created, delta, got["finish_reason"], index=i),
                                      c.token_ids), include_usage)
    if include_usage:
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        yield P.sse(P.usage_chunk(rid, model, created, obj, sum(c.prompt_tokens for c in choices[::n]),
                                  sum(c.completion_tokens for c in choices)))
    yield P.SSE_DONE


class _Whole(NamedTuple):
    """A reply read to its end: its text, its last item, its tokens' logprobs (None where its items carry none) and
    its prompt's (`RequestOutput.prompt_logprobs`, where asked), its token ids and its prompt's (where asked:
    `RequestOutput.prompt_token_ids`)."""
    text: str
    last: RequestOutput
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob] | None
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    prompt_thinking: str | None = None  # where its prompt leaves the thinking (`RequestOutput.prompt_thinking`)


def _as_response(got: Any, rid: str, echoed: dict[str, Any]) -> Any:
    """A chat's answer (a whole response, or its SSE stream) as the Responses API's (`deployments.responses`)."""
    if isinstance(got, StreamingResponse):
        events, inner = R.ResponseEvents(rid, "", echoed), got.body_iterator

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in inner:
                    for event in events.feed(chunk):
                        yield event
            finally:  # (closed: the chat stream is closed, which aborts its request)
                await inner.aclose()  # type: ignore[attr-defined]
        got.body_iterator = stream()
        return got
    headers = {k: v for k, v in got.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(R.from_chat(rid, json.loads(got.body), echoed), status_code=got.status_code,
                        headers=headers)


def _prompt_only(gen: GenerateStream, first: RequestOutput, body: P._Common
                 ) -> tuple[GenerateStream, RequestOutput]:
    """A completion's stream, or where it asks for its prompt alone (`echo` with max_tokens 0, vLLM's: a prompt's
    text and logprobs, scored without a reply), that stream without the one token its request made."""
    if not (isinstance(body, P.CompletionRequest) and body.prompt_only):
        return gen, first
    return _PromptOnly(gen), _without_reply(first)


def _without_reply(item: RequestOutput) -> RequestOutput:
    return dataclasses.replace(item, text="", token_ids=[], num_output_tokens=0,
                               logprobs=None if item.logprobs is None else [])


class _PromptOnly:
    """A stream whose items carry no reply (`_prompt_only`)."""

    def __init__(self, gen: GenerateStream) -> None:
        self._gen = gen

    def __aiter__(self) -> "_PromptOnly":
        return self

    async def __anext__(self) -> RequestOutput:
        return _without_reply(await self._gen.__anext__())

    def cancel(self) -> None:
        self._gen.cancel()


def _no_reader(prompt_thinking: str | None = None) -> None:
    """No reply is read (`P.read_replies`)."""
    return None


def _made(body: P._Common) -> int:
    """The choices made of each prompt: a completion's best_of (`P.CompletionRequest.made`), else n."""
    return body.made() if isinstance(body, P.CompletionRequest) else body.n or 1


def _best_of(choices: list[P.Choice], wholes: list[_Whole], made: int, n: int) -> list[P.Choice]:
    """Of each prompt's `made` choices (in order), the `n` whose tokens have the highest mean logprob, best first
    (OpenAI's best_of)."""
    def score(w: _Whole) -> float:
        lps = [x.logprob for x in w.logprobs or () if x.logprob is not None]
        return sum(lps) / len(lps) if lps else float("-inf")
    out: list[P.Choice] = []
    for g in range(0, len(choices), made):
        ranked = sorted(range(g, g + made), key=lambda i: score(wholes[i]), reverse=True)
        out.extend(choices[i] for i in ranked[:n])
    return out


def _choice(kind: str, body: P._Common | None, w: _Whole, echo: str | None) -> P.Choice:
    """A whole reply as a response's choice (`P.Choice`): its text after `echo`; its logprobs where `body` asks for
    them (with `echo`, the prompt's tokens' first); vLLM's `prompt_logprobs` and token ids where it asks for those."""
    top = body.logprobs_shape() if body is not None else None
    text, lps = (echo or "") + w.text, w.logprobs
    if kind == "completion" and echo is not None and top is not None and w.prompt_logprobs is not None:
        lps = w.prompt_logprobs + (lps or [])
    shown = None if top is None or lps is None else P.Logprobs(kind, top).render(lps, text)
    asked = body.prompt_logprobs if body is not None else None
    prompt = None if asked is None or w.prompt_logprobs is None else P.shown_prompt_logprobs(w.prompt_logprobs, asked)
    item, ids = w.last, body is not None and body.return_token_ids
    return P.Choice(text, item.finish_reason, item.num_prompt_tokens, item.num_output_tokens, item.stop_reason, shown,
                    prompt, w.token_ids if ids else None, w.prompt_token_ids if ids else None)


def _error_event(item: RequestOutput, prefix: str = "") -> bytes:
    """The SSE error event of a stream that failed at `item` (a finish reason in `FAILED`): the message, type and
    code a request failing so before its response would get (`item_failure`: `replica_failed` where the engine died,
    a 503 where it stopped)."""
    failure = item_failure(item, {}, 1)
    assert failure is not None  # a failed item always maps to a failure
    return _failure_event(failure, prefix)


def _exception_event(e: BaseException, prefix: str = "") -> bytes:
    """The SSE error event of a stream that failed with `e` (its replica died, or broke the stream's contract)."""
    if isinstance(e, APIError):
        failure = e
    elif isinstance(e, REPLICA_ERRORS):
        failure = replica_failure(e, 1)
    else:
        failure = APIError(500, f"generation failed: {type(e).__name__}", "server_error", "replica_error")
    return _failure_event(failure, prefix)


def _failure_event(failure: APIError, prefix: str) -> bytes:
    return P.sse(P.error_body(prefix + failure.message, failure.type, failure.code, failure.param))


def _batch_headers(each: list[dict[str, str]]) -> dict[str, str]:
    """A batch's response headers: its first prompt's, with `x-kairos-replica` the replicas of all, in order."""
    replicas = dict.fromkeys(h["x-kairos-replica"] for h in each if h.get("x-kairos-replica"))
    return {**each[0], "x-kairos-replica": ",".join(replicas)}


# a batch's prompt turned away while none of its batch runs (but some were served): how often it waits the refusal's
# Retry-After (at most BATCH_PAUSE_MAX_S) and is sent again (`_respond_batch`)
BATCH_PAUSES, BATCH_PAUSE_MAX_S = 3, 10.0
DRAIN_LIMIT_BYTES = 64 << 20  # the most of a refused body read and dropped before the 413 or 401 (`_drain`)
DRAIN_TIMEOUT_S = 10.0  # and the longest the answer waits for it (a slow upload does not hold the handler)


async def _drain(chunks: AsyncIterator[bytes], limit: int = DRAIN_LIMIT_BYTES,
                 timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Read and drop the rest of a body refused before it was read (too large: 413; no valid API key: 401), up to
    `limit` bytes and for at most `timeout_s`: a server that answers before the body is in closes a connection with
    unread data, which the kernel resets, and the client (through HAProxy too) may get a reset instead of the answer
    sent before it, or its upload may stall."""
    async def read() -> None:
        seen = 0
        async for chunk in chunks:
            seen += len(chunk)
            if seen > limit:
                return

    try:
        await asyncio.wait_for(read(), timeout_s)
    except Exception:  # noqa: BLE001 - the client went away meanwhile, or is too slow: nothing more to read
        return


class _BatchFlight:
    """A batched completion's prompts in flight: at most `limit` at once (`slots`), and how many are starting (sent,
    no first item yet, or called to be sent again), running (admitted, not yet ended) and have ended. A prompt
    turned away for the load waits in line (`wait_turn`); each prompt that ends calls the first in line to be sent
    again, and each one sent again that gets in, the next: as many go as the replicas take, without every waiting
    prompt sent again at each end. One event loop owns it: no locks."""

    def __init__(self, limit: int) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.starting = self.running = self.ended = 0
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()

    def sending(self) -> int:
        """A prompt is sent: returns `ended` as it is now, for `may_make_room` and `wait_turn`."""
        self.starting += 1
        return self.ended

    def answered(self, admitted: bool, again: bool) -> None:
        """The prompt last sent got its answer (`again`: a prompt sent again): admitted, it runs, and, sent again,
        the next in line goes too (there may be room for it as well)."""
        self.starting -= 1
        if admitted:
            self.running += 1
            if again:
                self._call_next()

    def end(self) -> None:
        """A running prompt ended (finished, failed or cancelled): its slot is free, and the first in line goes."""
        self.running -= 1
        self.ended += 1
        self.slots.release()
        self._call_next()

    def may_make_room(self, seen: int) -> bool:
        """Whether a prompt turned away (sent when `ended` was `seen`) may get in later: another prompt of the batch
        ended since, runs or starts."""
        return self.ended != seen or self.running > 0 or self.starting > 0

    async def wait_turn(self, seen: int, front: bool, timeout_s: float | None) -> bool:
        """Wait until a prompt turned away for the load should be sent again: at once where a prompt ended since it
        was sent (`seen`), else at its turn in line (`front` for one turned away again). False where `timeout_s`
        passed first (it left the line)."""
        if self.ended != seen:
            return True
        turn = asyncio.get_running_loop().create_future()
        (self._line.appendleft if front else self._line.append)(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout_s)
        except asyncio.TimeoutError:
            turn.cancel()
            if turn.cancelled():
                return False
        except BaseException:
            turn.cancel()
            raise
        self.starting -= 1  # its call (counted as starting by `_call_next`) is answered by the send
        return True

    def _call_next(self) -> None:
        while self._line:
            turn = self._line.popleft()
            if not turn.done():  # not left meanwhile
                self.starting += 1  # counted until it is sent (`wait_turn`), so the batch is not left for idle
                turn.set_result(None)
                return


async def _all_or_none(works: list[Awaitable[Any]], close: Callable[[Any], None] | None = None) -> list[Any]:
    """Every one of `works`' results, in order, run together. Where one raises, or this call is cancelled, the
    others are cancelled, `close` is called on each result already made (a started stream: cancel it), and the
    first exception is raised."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
            if close is not None:  # as each ends, even where this call is cancelled again while it waits below
                t.add_done_callback(lambda t: None if t.cancelled() or t.exception() is not None else close(t.result()))
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _drop(response: Any) -> None:
    """A response that will not be sent: cancel the stream it holds (`kairos_cancel`), if any."""
    cancel = getattr(response, "kairos_cancel", None)
    if cancel is not None:
        cancel()


async def _disconnect(receive: Receive) -> None:
    """Return once the client has disconnected. The request's body is read already, so the server's next message is
    the disconnect; where another comes instead (a server that repeats the body), or the server cannot be asked
    again, it never returns: no watch is better than a request cancelled for nothing."""
    try:
        message = await receive()
    except Exception:  # noqa: BLE001
        message = {}
    if message.get("type") != "http.disconnect":
        await asyncio.Event().wait()


async def until_disconnected(receive: Receive, work: Awaitable[Any]) -> Any:
    """`work` (a request's generation up to its response: a whole completion, or a stream's first item) unless the
    client disconnects first: then it is cancelled, which cancels its stream and so aborts the request in its engine
    and frees its KV blocks, and so is this call (the client is gone: nothing is sent). A stream's later chunks go
    out in `_serve_generation`, whose task Serve cancels when the client goes away.

    `work` runs in this task, at once: its way to the engine (tokenizing, the send to the engine process) waits for
    no turn of the event loop, where a task of its own would start only after every callback ready before it (under
    load, the chunks of every stream). The watch for the disconnect is the task beside it, and cancels this one."""
    me = asyncio.current_task()
    if me is None:  # not in a task (never under ASGI): nothing to cancel on a disconnect
        return await work
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnect(receive)
        gone = True
        me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if gone:
            raise asyncio.CancelledError("client disconnected") from None
        raise
    finally:
        watcher.cancel()
    if gone:  # the work went on through the cancellation: its response is never sent
        _drop(result)
        raise asyncio.CancelledError("client disconnected")
    return result


GENERATION_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "responses"}


def route_path(scope: Scope) -> str:
    """The request's path below the app's mount point (`root_path`), as Starlette's router matches it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


class GenerationFastPath:
    """The ASGI app a frontend replica runs. `POST /v1/completions`, `/v1/chat/completions` and `/v1/responses` go
    straight to the frontend (`OpenAIFrontend._serve_generation`); everything else (health, models, the docs, lifespan, unknown
    paths and methods) to the FastAPI app, whose routes stay the API's reference (OpenAPI schema, docs).

    FastAPI's routing, middleware and `StreamingResponse` were a sizeable share of a replica's CPU for one-token
    requests, spent while the engine steps on the same cores; without them HTTP adds less TTFT.

    CORS (`allowed_origins`, as vLLM's): in front of both, so a browser's preflight is answered before any auth and
    every response to an allowed origin says so; a request without an Origin header passes straight through."""

    def __init__(self, frontend: OpenAIFrontend, api: FastAPI, allowed_origins: Collection[str] = (),
                 allow_credentials: bool = False) -> None:
        self.frontend, self.api = frontend, api
        self.docs_url = api.docs_url
        self._app: Callable[[Scope, Receive, Send], Awaitable[None]] = self._route
        if allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            self._app = CORSMiddleware(self._route, allow_origins=list(allowed_origins), allow_methods=["*"],
                                       allow_headers=["*"], allow_credentials=allow_credentials,
                                       expose_headers=["x-kairos-request-id", "x-request-id", "retry-after"])

    def add_exception_handler(self, exc: Any, handler: Callable) -> None:
        """Serve registers its handlers (e.g. for BackPressureError) on the app it runs: they belong to FastAPI's."""
        self.api.add_exception_handler(exc, handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        await self._app(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            kind = GENERATION_ROUTES.get(route_path(scope))
            if kind is not None:
                await self.frontend._serve_generation(scope, receive, send, kind)
                return
        await self.api(scope, receive, named_send(send))


def named_send(send: Send) -> Send:
    """`send`, its response naming its request (`x-kairos-request-id`: a new id; a generation names its own)."""
    rid = f"req-{uuid.uuid4().hex}".encode()

    async def named(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"x-kairos-request-id", rid)]}
        await send(message)
    return named


def openai_api() -> FastAPI:
    """A FastAPI app whose routes are `OpenAIFrontend`'s methods; each deployment class gets its own
    (`serve.ingress` rewrites the app's routes for the class it decorates)."""
    api = FastAPI(title="Kairos", version=SERVER_VERSION, description="SLO-aware OpenAI-compatible LLM server")
    api.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    api.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    api.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    api.add_exception_handler(Exception, _unexpected)
    api.add_api_route("/health", OpenAIFrontend.health, methods=["GET", "HEAD"])  # HEAD: load balancers probe so
    api.add_api_route("/ping", OpenAIFrontend.health, methods=["GET", "POST"])  # vLLM's (SageMaker's probe)
    api.add_api_route("/version", OpenAIFrontend.version, methods=["GET"])
    api.add_api_route("/tokenize", OpenAIFrontend.tokenize, methods=["POST"])
    api.add_api_route("/detokenize", OpenAIFrontend.detokenize, methods=["POST"])
    api.add_api_route("/v1/models", OpenAIFrontend.models, methods=["GET"])
    api.add_api_route("/v1/models/{model_id:path}", OpenAIFrontend.model, methods=["GET"])  # ids may hold a slash
    api.add_api_route("/v1/load_lora_adapter", OpenAIFrontend.load_lora_adapter, methods=["POST"],
                      response_class=PlainTextResponse)
    api.add_api_route("/v1/unload_lora_adapter", OpenAIFrontend.unload_lora_adapter, methods=["POST"],
                      response_class=PlainTextResponse)
    api.add_api_route("/metrics", OpenAIFrontend.prometheus_metrics, methods=["GET"],
                      response_class=PlainTextResponse)
    for path, fn, schema in (("/v1/completions", OpenAIFrontend.completions, P.CompletionRequest),
                             ("/v1/chat/completions", OpenAIFrontend.chat_completions, P.ChatCompletionRequest)):
        api.add_api_route(path, fn, methods=["POST"], openapi_extra=openapi_operation(schema),
                          responses=ERROR_RESPONSES)
    api.add_api_route("/v1/responses", OpenAIFrontend.responses, methods=["POST"],
                      openapi_extra=openapi_operation(P.ResponsesRequest), responses=ERROR_RESPONSES)
    return api


class IngressFrontend(OpenAIFrontend):
    """The routed topology's front: requests go to `LLMServer` replicas through a streaming handle, each to the
    replica the router picks (`router=slo`: by SLO slack, deployments/router.py)."""

    _replica_wait: Any = None  # the requests that waited for an LLM replica (`replica_wait_histogram`)

    async def __init__(self, llm: DeploymentHandle, settings: dict[str, Any]) -> None:
        self._init_frontend(settings)
        # every call to the LLM replicas over the same transport (the private option selects it): Serve sends even a
        # unary call as a streaming one that first says whether the replica took it, and over Ray its end waits on
        # the replica's event loop for this caller
        llm = llm.options(_by_reference=not self.grpc)
        self.llm = llm.options(stream=True)
        self._unary = llm  # the replicas' other methods (`_replica_call`)
        import ray

        self._actor_id: str | None = ray.get_runtime_context().get_actor_id()  # the LLM replicas watch it (caller)
        self._readiness = Readiness(may_idle=settings.get("scale_to_zero", False))
        self._probe = lambda: llm.model_info.remote()
        self._replica_wait = replica_wait_histogram(self.served_model_name)

        async def readiness() -> None:
            running = lambda: asyncio.to_thread(running_replicas, llm.app_name, llm.deployment_name)  # noqa: E731
            await self._readiness.watch(self._probe, running=running)
            await self._readiness.monitor(self._probe, running)
        self._ready_task = asyncio.get_running_loop().create_task(readiness())

    async def _replica_call(self, method: str, *args: Any) -> dict[str, Any]:
        try:
            return await getattr(self._unary, method).remote(*args)
        except BackPressureError as e:
            raise overloaded(max(self.retry_after_s, int(getattr(e, "retry_after_s", None) or 0))) from None
        except Exception as e:  # noqa: BLE001 - no replica could answer: the client may retry
            log.warning("%s on an LLM replica failed: %r", method, e)
            raise APIError(503, f"no LLM replica available: {type(e).__name__}", "server_error", "unavailable",
                           {"Retry-After": str(self.retry_after_s)}) from None

    def _open(self, req: GenerateRequest) -> GenerateStream:
        self._readiness.sent = time.monotonic()
        return self.llm.generate.remote(dataclasses.replace(req, caller=self._actor_id,
                                                            sent_at=(clock_id(), time.monotonic()),
                                                            replicas_running=self._running_replicas()))

    def _own_call(self) -> None:
        """A handle call takes its internal request id from the HTTP request's Serve context, and Serve's router
        (and `SLORouter`'s bookkeeping) match pending calls by that id: a batch's concurrent calls, all under one
        id, were never all assigned. Each prompt's task gets an id of its own (the context variable is the task's
        copy; Ray's private API, pinned with Ray). Serve then no longer cancels these calls with the HTTP request:
        the batch cancels them itself (`_respond_batch`)."""
        from ray.serve._private.utils import generate_request_id
        from ray.serve.context import _get_serve_request_context, _serve_request_context

        ctx = _get_serve_request_context()
        _serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))

    def _ready_info(self) -> dict[str, Any] | None:
        return self._readiness.info  # an LLM replica has answered: the app can serve

    def _running_replicas(self) -> int | None:
        return self._readiness.running

    def _unavailable(self) -> str | None:
        return self._readiness.down  # no LLM replica can serve now

    def _idle(self) -> bool:
        return self._readiness.idle

    async def _until_ready(self) -> None:
        """While no LLM replica can serve (none has loaded its model yet, `Readiness.monitor` says none can now, or
        the app scaled to zero: the request asks for one, `Readiness.wake`), a request waits for one at most
        `unready_wait_s` (`cold_start_wait_s` where the replicas scale to zero, `DOWN_WAIT_S` at most where Serve
        says their deployment failed), then gets a 503 `unavailable` with Retry-After: Serve's handle would hold it
        with no limit (an LLM replica that cannot be placed never comes up). The wait counts against its TTFT SLO,
        whose time runs from its arrival."""
        r = self._readiness
        if r.serving.is_set():
            return
        t0 = time.monotonic()
        reason = "scaled_to_zero" if r.idle else "not_ready"
        try:
            if not r.may_idle:  # (replicas that never scale to zero: Serve starts or replaces them by itself)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(r.serving.wait(), self.unready_wait_s)
            while r.may_idle and not r.serving.is_set():
                # (a deployment Serve says failed is down: not a cold start's wait)
                left = t0 + (min(self.cold_start_wait_s, DOWN_WAIT_S) if r.down else self.cold_start_wait_s) \
                    - time.monotonic()
                if r.idle:  # asked for as long as this request waits (a later one asks again for its own wait), a
                    r.wake(self._probe, max(left, IDLE_LOOK_S))  # moment at least: Serve starts one on the ask
                    reason = "scaled_to_zero"
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):  # (and looks again whether the app went idle meanwhile)
                    await asyncio.wait_for(r.serving.wait(), min(left, IDLE_LOOK_S))
            if not r.serving.is_set():
                why = r.down or "no LLM replica is ready yet"
                raise APIError(503, f"no LLM replica available: {why}", "server_error", "unavailable",
                               {"Retry-After": str(self.retry_after_s)})
        finally:
            if self._replica_wait is not None:
                self._replica_wait.observe(time.monotonic() - t0, tags={"reason": reason})


Ingress = serve.deployment(serve.ingress(openai_api())(IngressFrontend), name="Ingress",
                           ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1_000_000)
