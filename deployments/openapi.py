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


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "a completion (JSON), or with stream=true a text/event-stream of chunks ending in "
                         "`data: [DONE]`", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    400: {"model": ErrorResponse, "description": "invalid JSON or request"},
    401: {"model": ErrorResponse, "description": "missing or invalid API key (when auth is configured)"},
    413: {"model": ErrorResponse, "description": "request body larger than max_body_bytes"},
    429: {"model": ErrorResponse, "description": "overloaded or SLO unattainable; see Retry-After"},
    500: {"model": ErrorResponse, "description": "generation failed in the engine"},
    503: {"model": ErrorResponse, "description": "no LLM replica available; see Retry-After"},
}
