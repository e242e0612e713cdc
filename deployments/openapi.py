"""The OpenAPI description of the generation routes (documentation and schema fuzzing): the JSON body each
route parses itself, the SLO headers, and the error responses."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from core.request import MAX_OUTPUT_LEN_HINT, MAX_SLO_MS

def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` inlined, for an OpenAPI `requestBody` (no shared components)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return resolve({**defs[ref.rsplit("/", 1)[-1]], **rest})
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(x) for x in node]
        return node

    return resolve(schema)


SLO_HEADERS: tuple[tuple[str, str, bool], ...] = (
    ("x-slo-ttft-ms", "time-to-first-token SLO, milliseconds (overrides slo_ttft_ms)", False),
    ("x-slo-tpot-ms", "time-per-output-token SLO, milliseconds (overrides slo_tpot_ms)", False),
    ("x-slo-output-len", "expected output length in tokens (overrides output_len_hint)", True),
)


def openapi_operation(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a generation route: the JSON body the route parses itself, and the SLO headers."""
    params = [{"name": name, "in": "header", "required": False, "description": desc,
               "schema": {"type": "integer" if integer else "number", "exclusiveMinimum": 0,
                          "maximum": MAX_OUTPUT_LEN_HINT if integer else MAX_SLO_MS}}
              for name, desc, integer in SLO_HEADERS]
    return {"parameters": params,
            "requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(model)}}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


REJECTION_HEADERS = {  # the headers of an SLO rejection (400 slo_unattainable, or 429)
    "x-kairos-reject-reason": {"description": "why the SLO admission control turned the request away (see the 400 and "
                                              "429 responses)", "schema": {"type": "string"}},
    "x-kairos-slo-best-ttft-ms": {"description": "with slo_unattainable: the x-slo-ttft-ms this deployment offers "
                                                 "for this request (what an idle replica accepts, with 25% headroom "
                                                 "for its measured steps)", "schema": {"type": "number"}},
    "x-kairos-slo-best-tpot-ms": {"description": "with slo_unattainable: the x-slo-tpot-ms this deployment offers "
                                                 "for this request (what an idle replica accepts, with 25% headroom "
                                                 "for its measured steps)", "schema": {"type": "number"}},
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying (429: predicted from the replica's "
                                              "queue, 1 to 60)", "schema": {"type": "integer"}}}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "a completion (JSON), or with stream=true a text/event-stream of chunks ending in "
                         "`data: [DONE]`", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    400: {"model": ErrorResponse, "headers": REJECTION_HEADERS,
          "description": "invalid JSON or request; `context_length_exceeded` (param `max_tokens`): max_tokens / "
                         "max_completion_tokens beyond the context window the prompt leaves; `slo_unattainable` "
                         "(x-kairos-reject-reason `slo_unattainable`): an SLO no replica can meet for this request "
                         "even when idle, by its latency model: do not retry, relax the SLO to at most the "
                         "x-kairos-slo-best-ttft-ms / x-kairos-slo-best-tpot-ms offered"},
    401: {"model": ErrorResponse, "description": "missing or invalid API key (when auth is configured)"},
    404: {"model": ErrorResponse, "description": "`model_not_found`: `model` names no model this server serves "
                                                 "(GET /v1/models lists the names; an absent `model` is the served one)"},
    413: {"model": ErrorResponse, "description": "request body larger than max_body_bytes"},
    415: {"model": ErrorResponse, "description": "`unsupported_media_type`: the body is not declared as JSON "
                                                 "(content-type: application/json)"},
    429: {"model": ErrorResponse, "headers": {**REJECTION_HEADERS, **RETRY_AFTER},
          "description": "busy: retry after Retry-After seconds. x-kairos-reject-reason: `ttft_unattainable` (the "
                         "queue ahead puts the TTFT SLO out of reach now), `tpot_unattainable` (the running batch, "
                         "or steps as long as measured lately, leave no room for the TPOT SLO now), `shed` (overload: "
                         "the requests with the most work go first), `overloaded` (the replica's queue, or Serve's, "
                         "is full)"},
    500: {"model": ErrorResponse, "description": "generation failed in the engine"},
    503: {"model": ErrorResponse, "description": "no LLM replica available; see Retry-After"},
}
