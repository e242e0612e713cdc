"""How the ingress answers failures: `APIError` (status, OpenAI-shaped body, headers) and the mapping from
replica failures and typed stream items to it."""
from __future__ import annotations

import logging
import math
from typing import Any

from fastapi.responses import JSONResponse
from grpc.aio import AioRpcError
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from core.messages import ErrorKind, ProtocolError, RejectReason, RequestOutput
from core.request import FinishReason
from deployments import protocol as P

log = logging.getLogger("ray.serve")


class APIError(Exception):
    # set where the request failed before its first item and no longer runs on that replica (`_first_item`): its
    # actor died, or over gRPC its stream's connection is gone; it may be sent to another replica
    resendable = False

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers
        self.param = param


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: Any = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type_, code, param), status_code=status, headers=headers)


# the request fields an engine-side or sampling refusal may name first (`param_named`)
NAMED_PARAMS = frozenset(("prompt", "messages", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logit_bias",
                          "seed", "temperature", "top_p", "top_k", "priority"))


def param_named(message: str | None) -> str | None:
    """The request field a refusal's message starts with (`NAMED_PARAMS`: "prompt token ids must be ...",
    "min_tokens must be ..."), OpenAI's `param` of the 400; None where it names none."""
    first = (message or "").split(" ", 1)[0].strip(":,")
    return first if first in NAMED_PARAMS else None


def model_not_found(model: str, served: list[str]) -> APIError:
    """404 for a `model` this deployment does not serve, as OpenAI answers (vLLM: the same status and message)."""
    return APIError(404, f"The model `{model}` does not exist. This server serves: {', '.join(served)}",
                    code="model_not_found", param="model")


def unsupported_media_type(content_type: str | None) -> APIError:
    """415 for a body not declared as JSON (no content-type, or another type), as FastAPI's JSON body parsing does."""
    got = f"content-type {content_type!r}" if content_type else "no content-type header"
    return APIError(415, f"Unsupported Media Type: the body must be JSON (content-type: application/json); got {got}",
                    code="unsupported_media_type")


def overloaded(retry_after_s: int) -> APIError:
    """429 for a request that found the replicas' queue full (Serve's `max_queued_requests`, or the direct
    replica's own cap)."""
    return APIError(429, "server overloaded: request queue is full", "rate_limit_error", "overloaded",
                    {"Retry-After": str(retry_after_s), "x-kairos-reject-reason": "overloaded"})


def replica_died(detail: str, retry_after_s: int, headers: dict[str, str] | None = None) -> APIError:
    """503 for a request whose LLM replica died under it, or whose replica's engine did (an engine process that
    exited, or an engine found dead): either way Serve replaces that replica, so the client should retry. Which of
    the two a killed replica shows first is a race, so both answer alike."""
    return APIError(503, f"generation failed: the LLM replica serving this request died ({detail}); retry",
                    "server_error", "replica_failed", {**(headers or {}), "Retry-After": str(retry_after_s)})


# What a handle call to an LLM replica raises when the replica fails under it: through Ray, its actor died, is
# unreachable or raised; through gRPC (`llm_transport`), a stream that broke otherwise than UNAVAILABLE (which Serve
# turns into ActorUnavailableError)
REPLICA_ERRORS = (RayActorError, ActorUnavailableError, RayTaskError, AioRpcError)


def replica_failure(e: BaseException, retry_after_s: int, headers: dict[str, str] | None = None) -> APIError:
    """A request lost to its LLM replica: the actor died / is unreachable, or its stream broke (503, retry), or it
    raised (500)."""
    if isinstance(e, (RayActorError, ActorUnavailableError)):
        return replica_died(type(e).__name__, retry_after_s, headers)
    if isinstance(e, AioRpcError):
        if "larger than max" in (e.debug_error_string() or "") + (e.details() or ""):  # retrying will not help
            return APIError(413, f"request too large for the LLM replicas' gRPC transport ({e.details()}): raise "
                            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH in their environment, or serve with "
                            "llm_transport=ray", "invalid_request_error", "body_too_large", headers)
        return replica_died(f"gRPC {e.code().name}", retry_after_s, headers)
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else e
    return APIError(500, f"generation failed: replica error {type(cause or e).__name__}", "server_error",
                    "replica_error", headers)


def protocol_failure(rid: str, e: ProtocolError) -> APIError:
    """A stream item that breaks the contract: a loud 500, never a success."""
    log.error("request %s: malformed stream item from the replica: %s", rid, e)
    return APIError(500, f"internal error: malformed reply from the LLM replica ({e})", "server_error",
                    "protocol_error")


_REJECT_HINTS = {  # what a client can do about a rejection, after its reason
    RejectReason.SHED.value: " (the replica is overloaded and turns away the requests with the most work, output "
                             "tokens at their TPOT SLO, first; a smaller max_tokens may be admitted)",
    RejectReason.TTFT_UNATTAINABLE.value: " (the queue ahead puts the TTFT SLO out of reach now; retry after "
                                          "Retry-After seconds)",
    RejectReason.TPOT_UNATTAINABLE.value: " (the replica cannot keep the TPOT SLO now: its running batch, or its "
                                          "steps as long as measured lately, leave no room; retry after "
                                          "Retry-After seconds)",
    RejectReason.OVERLOADED.value: " (the replica's queue is full; retry after Retry-After seconds)",
}
BEST_TTFT_HEADER, BEST_TPOT_HEADER = "x-kairos-slo-best-ttft-ms", "x-kairos-slo-best-tpot-ms"


# The SLOs offered with a 400 slo_unattainable sit this far above the idle floor the rejection was judged against: the
# floor follows what the replica measures (the gate's idle ITL correction, the TTFT margin), so it moves from one
# request to the next, and an SLO taken from the offer should still be accepted after it has. A burst on a busy host
# slows the steps of its last requests, which decode alone, and so raises the idle correction: a burst at the offer
# was refused as unattainable in CI with a tenth of headroom, and once with a quarter. So the TPOT floor offered takes
# the least correction of the last few seconds (`Scheduler.offer_gate_scale`), which a burst does not raise, and an
# idle replica's gate and the unattainable verdict the least over twice that memory (`Scheduler.judge_gate_scale`),
# which holds the floor of every offer made within the last memory.
OFFER_HEADROOM = 1.25


def _ms_up(v: float) -> str:
    """A bound in ms for a header or message, rounded up to 0.1 ms (the TPOT bound is strict: one step above)."""
    return f"{math.floor(v * 10.0 + 1.0) / 10.0:.1f}"


def unattainable(item: RequestOutput, headers: dict[str, str]) -> APIError:
    """400 `slo_unattainable`: an SLO stricter than an idle replica could meet for this request, by the latency
    model. Not retryable; the message and the `x-kairos-slo-best-*` headers give what the deployment offers (the
    idle floor with `OFFER_HEADROOM`)."""
    sb = item.served_by
    best = {}
    if sb is not None and sb.best_ttft_ms is not None and sb.best_tpot_ms is not None:
        best = {BEST_TTFT_HEADER: _ms_up(sb.best_ttft_ms * OFFER_HEADROOM),
                BEST_TPOT_HEADER: _ms_up(sb.best_tpot_ms * OFFER_HEADROOM)}
    offer = (f"; the best this deployment offers for this request is a TTFT SLO of {best[BEST_TTFT_HEADER]} ms and "
             f"a TPOT SLO of {best[BEST_TPOT_HEADER]} ms (x-kairos-slo-best-ttft-ms / -tpot-ms)") if best else ""
    return APIError(400, "SLO unattainable: no replica of this deployment can meet the requested x-slo-ttft-ms / "
                    f"x-slo-tpot-ms for this request even when idle{offer}; relax the SLO (retrying will not help)",
                    "invalid_request_error", RejectReason.SLO_UNATTAINABLE.value,
                    {**headers, **best, "x-kairos-reject-reason": RejectReason.SLO_UNATTAINABLE.value})


def item_failure(item: RequestOutput, headers: dict[str, str], retry_after_s: int,
                 fields: tuple[str, str] = ("prompt", "max_tokens")) -> APIError | None:
    """The error response for a stream that ended at this item without success, None if it succeeded: its first item
    (before any response went out), or, for a non-streaming request, whichever item ended it. `fields`: the request's
    prompt field and reply cap field (`fields_at_fault`), named as the `param` of a context-length error."""
    reason, retry = item.finish_reason, {"Retry-After": str(retry_after_s)}
    if reason is FinishReason.REJECTED:
        why = item.reject_reason
        if why is RejectReason.SLO_UNATTAINABLE:
            return unattainable(item, headers)
        sb = item.served_by
        wait = str(max(retry_after_s, (sb.retry_after_s if sb else None) or 1))
        hint = _REJECT_HINTS.get(why or "", "")
        return APIError(429, f"request rejected by SLO admission control: {why}{hint}", "rate_limit_error", why,
                        {**headers, "Retry-After": wait, "x-kairos-reject-reason": why})
    if reason is FinishReason.ABORT:
        return APIError(503, f"engine stopping: {item.error}", "server_error", headers={**headers, **retry})
    if reason is not FinishReason.ERROR:
        return None
    if item.error_kind is ErrorKind.CONTEXT_LENGTH:
        return APIError(400, item.error or "max_tokens is too large", headers=headers, param=fields[1],
                        code="context_length_exceeded")
    if item.error_kind is ErrorKind.PROMPT_TOO_LONG:
        return APIError(400, item.error or "the prompt is too long", headers=headers, param=fields[0],
                        code="context_length_exceeded")
    if item.error_kind is ErrorKind.INVALID_REQUEST:
        return APIError(400, item.error or "invalid request", headers=headers, param=param_named(item.error))
    if item.error_kind is ErrorKind.UNAVAILABLE:
        return replica_died(item.error or "engine unavailable", retry_after_s, headers)
    return APIError(500, f"generation failed: {item.error}", "server_error", "engine_error",
                    headers={**headers, **retry})
