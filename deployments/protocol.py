"""OpenAI-compatible request/response schemas (+ the vLLM extensions we honour) and SSE helpers.

Validation policy: every invalid request is answered 400 `invalid_request_error` (as OpenAI does), including
schema/type errors that FastAPI would answer 422; malformed JSON is 400 too, an oversized body 413.
Unknown fields are ignored (clients send `user`, `metadata`, ...); fields that would change the output and that we
cannot honour are rejected explicitly when given a value other than their default: a chat's best_of, suffix, a
completion's tools and the legacy functions (`UNSUPPORTED`); a request's own chat
template only where the app trusts requests with one. `logit_bias`, the presence / frequency / repetition penalties,
min_p, logprobs (a completion's `logprobs`, a chat's `logprobs` and `top_logprobs`: `Logprobs`, vLLM's
return_tokens_as_token_ids; vLLM's `prompt_logprobs`, `shown_prompt_logprobs`), `echo` (a completion's prompt, a
chat's last assistant message) and a completion's `best_of`, JSON mode (`response_format` json_object or
json_schema, vLLM's guided_json: `core.json_grammar`; guided_regex and guided_choice: `core.regex_grammar`;
guided_grammar: `core.ebnf_grammar`; vLLM's structured_outputs), vLLM's beam search (`use_beam_search`), a chat's
tools and the calls its reply makes, and a reasoning model's thinking (`ChatCompletionRequest.reply_reader`:
`deployments.tool_calls`, `deployments.reasoning`), and vLLM's other sampling and output fields are honoured, and so are vLLM's fields for how a prompt is tokenized
(`core.messages.PromptOptions`).
"""
from __future__ import annotations

import json
import math
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.ebnf_grammar import compile_grammar
from core.json_grammar import compile_schema
from core.regex_grammar import choice_pattern, compile_regex
from core.messages import ChatTurn, PromptOptions, RequestMetrics, TokenLogprob, check_template_kwargs

from core.request import MAX_OUTPUT_LEN_HINT, MAX_SLO_MS, check_slo_value
from core.sampling import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS
from deployments.reasoning import ReplyReader, reasoning_reader
from deployments.tool_calls import (NamedToolReader, RequiredToolReader, ToolCallReader, mistral_call_id,
                                    model_format_reader)


def _documented(schema: dict[str, Any]) -> Any:
    """A Field that documents exactly what is accepted in the JSON schema (OpenAPI, fuzzing), where the Python
    type is broader than the contract; validation itself stays in the validators (same error messages)."""
    def fix(s: dict[str, Any]) -> None:
        title = s.get("title")
        s.clear()
        s.update(schema, **({"title": title} if title else {}))
    return fix


def _opt(schema: dict[str, Any]) -> Any:
    return _documented({"anyOf": [schema, {"type": "null"}]})


_POS_INT = {"type": "integer", "minimum": 1}
# a count of likeliest tokens (logprobs, top_logprobs, prompt_logprobs): the maximum shown is vLLM's default cap
_TOP_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
              "description": "at most the server's max_logprobs (vLLM's; 20 unless the server sets another)"}
MAX_CHOICES = 256  # choices in one response: a completion's prompts x n (each a request of its own)
_SLO_MS = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SLO_MS}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # no coercion: "3" is not 3, true is not 1 (as OpenAI)
    include_usage: bool | None = False  # null: false (vLLM's Optional[bool])
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk carries the usage so far


# fields that change the output, which Kairos does not implement: accepted only at their default (None, or these)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False), "echo": (False,), "suffix": ("",),
    "best_of": (1,), "tools": ([],),
    "logits_processors": ([],),  # vLLM's, where its server allows a pattern of them: code a request names
    "structural_tag": (),  # vLLM's top-level form of the grammar (refused in structured_outputs and response_format)
    "guided_whitespace_pattern": (),  # vLLM's: the whitespace a format allows (capped here: MAX_WHITESPACE)
}


# fields a beam search does not honour (`_Common._beam`): a 400 where one is given beside use_beam_search
BEAM_REFUSED = ("stop", "stop_token_ids", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "min_tokens", "bad_words", "allowed_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
                "best_of", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "tools", "tool_choice")
BEAM_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_tokens": 0,
                "top_logprobs": 0}  # values of those that change nothing (a logprobs of 0 is not one: it asks)


# vLLM's structured_outputs: the grammars this server keeps (and what each takes), and options it takes and ignores
STRUCTURED_KINDS = {"json": "a JSON schema", "regex": "a regular expression (a string)",
                    "choice": "a list of texts", "json_object": "true", "grammar": "an EBNF grammar (a string)"}
STRUCTURED_OPTIONS = frozenset(("disable_fallback", "disable_additional_properties", "whitespace_pattern",
                                "disable_any_whitespace"))
# of those, the ones that would change a reply (a format's whitespace, capped here at MAX_WHITESPACE characters and
# otherwise free): refused where given otherwise than as their defaults
STRUCTURED_WHITESPACE = {"whitespace_pattern": (), "disable_any_whitespace": (False,)}


def unsupported_field(data: Any, honoured: frozenset[str] = frozenset(),
                      table: dict[str, tuple[Any, ...]] | None = None) -> str | None:
    """The first field of a request body (a dict) that `table` (`UNSUPPORTED`) refuses with the value given (null
    is taken), else None; `honoured`: fields of it that the endpoint takes (a completion's `echo`)."""
    if isinstance(data, dict):
        for name, ok in (UNSUPPORTED if table is None else table).items():
            if name in honoured:
                continue
            v = data.get(name)
            if v is not None and not any(v == o and type(v) is type(o) for o in ok):
                return name
    return None


class _Common(BaseModel):
    """Sampling knobs, vLLM extensions and Kairos SLO fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore", strict=True)  # no coercion: "3" is not 3, true is not 1 (as OpenAI)
    HONOURED: ClassVar[frozenset[str]] = frozenset()  # fields of `UNSUPPORTED` this endpoint takes

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if (name := unsupported_field(data, cls.HONOURED)) is not None:
                raise ValueError(f"{name} is not supported by this server (got {json.dumps(data[name])[:80]})")
            if data.get("stream_options") is not None and not data.get("stream"):
                raise ValueError("stream_options is only allowed with stream: true")
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, json_schema_extra=_opt(_POS_INT))
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0: the most likely token alone (greedy), as OpenAI takes it
    n: int | None = Field(1, json_schema_extra=_opt({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES}))
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the engine's range (SamplingParams.validate)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM extensions
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=1024, json_schema_extra=_opt(
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 1024}))
    # OpenAI: token id (as a string) -> bias in [-100, 100], added to its logit before sampling
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=_opt(
        {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
         "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}))
    # Kairos: SLOs in the body (the x-slo-* headers win when both are given)
    slo_ttft_ms: float | None = Field(None, json_schema_extra=_opt(_SLO_MS))
    slo_tpot_ms: float | None = Field(None, json_schema_extra=_opt(_SLO_MS))
    output_len_hint: int | None = Field(None, json_schema_extra=_opt({**_POS_INT, "maximum": MAX_OUTPUT_LEN_HINT}))
    # OpenAI's: {"type": "json_object"} makes the reply a JSON object, {"type": "json_schema", "json_schema":
    # {"schema": ...}} a JSON value of that schema (`core.json_grammar`); text: as without it. vLLM's guided
    # decoding: guided_json a schema, as json_schema's; guided_regex a regular expression the whole reply matches
    # (`core.regex_grammar`); guided_choice a list of texts the reply is one of; structured_outputs (vLLM's newer
    # form) one of json, regex, choice or json_object. At most one of these (`guide`)
    response_format: dict[str, Any] | None = Field(None, json_schema_extra=_opt({"anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"],
         "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                             "strict": {"type": ["boolean", "null"]}}, "required": ["schema"]}},
         "required": ["type", "json_schema"]}]}))
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, max_length=1 << 20)  # an EBNF grammar (`core.ebnf_grammar`)
    # vLLM's beam search: the n likeliest replies by their tokens' summed log-probabilities over their length (with
    # the prompt's) to the power length_penalty, n beams kept each step (`OpenAIFrontend._beam_search`)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: only these tokens may be drawn; special tokens kept in the text; a stop string kept in it; the prompt's
    # last k tokens only (-1: as many as the context window takes)
    allowed_token_ids: list[int] | None = Field(None, max_length=1 << 17, json_schema_extra=_opt(
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 1 << 17}))
    skip_special_tokens: bool = True
    # vLLM's: words the reply may not write (`SamplingParams.bad_words`)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM's: logprobs name each token "token_id:N", not by its text (for tokens whose text alone is not theirs)
    return_tokens_as_token_ids: bool = False
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, json_schema_extra=_opt(
        {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "const": -1}]}))
    # vLLM's: each prompt token's logprob and its `prompt_logprobs` likeliest tokens' (not streamed)
    prompt_logprobs: int | None = Field(None, json_schema_extra=_opt(_TOP_COUNT))
    # vLLM's: the prompt shares cached KV (prefix caching) only with requests that give the same salt, so that no
    # other client can tell from its TTFT which prompts were sent before
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM's: lower first where the app's scheduling_policy is "priority" (SchedulerConfig.scheduling_policy); no
    # effect elsewhere, as vLLM's (the header X-Vllm-Priority, where it is an integer, wins)
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    # vLLM's: each choice has its reply's token ids (`token_ids`; streamed, each chunk its own) and its prompt's
    # (`prompt_token_ids`: a completion's choice, a chat's response; streamed, in the first chunk)
    return_token_ids: bool | None = False

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v: int | None, info: Any) -> int | None:
        _top_range(info.field_name, v, info)
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return v

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                     mode="before")
    @classmethod
    def _finite(cls, v: Any, info: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{info.field_name} must be a finite number, got {v!r}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int:
        if v is None:
            return 1
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}")
        if v and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens")
        return v

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None, info: Any) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError(f"{info.field_name} must be non-negative token ids")
        if v is not None and not v and info.field_name == "allowed_token_ids":  # (vLLM's 400: no token may come)
            raise ValueError("allowed_token_ids is empty: no token could be drawn")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type")
        # (a client that writes every field sends the others as null: vLLM's ResponseFormat takes them)
        if kind in ("text", "json_object") and all(val is None for k, val in v.items() if k != "type"):
            return {"type": kind}
        if kind != "json_schema":
            raise ValueError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                             f'"json_schema", "json_schema": {{"schema": ...}}}}, got {json.dumps(v)[:80]}')
        schema = _format_schema(v)
        if not isinstance(schema, dict):
            raise ValueError("response_format: a json_schema needs its schema, an object, at json_schema.schema")
        compile_schema(_schema_text(schema))  # (a ValueError naming what it refuses)
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if (k := unsupported_field(v, table=STRUCTURED_WHITESPACE)) is not None:
            raise ValueError(f"structured_outputs.{k}={json.dumps(v[k])[:40]} is not supported here: a format's "
                             "whitespace outside strings is any JSON whitespace, up to 16 characters in a row")
        given = {k for k, x in v.items() if x not in (None, False) and k not in STRUCTURED_OPTIONS}
        if len(given) != 1 or not given <= set(STRUCTURED_KINDS):
            raise ValueError(f"structured_outputs must hold one of {', '.join(STRUCTURED_KINDS)} (structural_tag is "
                             f"not supported here), got {json.dumps(v)[:80]}")
        (kind,) = given
        if kind == "json_object" and v[kind] is not True \
                or kind in ("regex", "grammar") and not isinstance(v[kind], str) \
                or kind == "json" and not isinstance(v[kind], (dict, str)) or kind == "choice" and (
                    not isinstance(v[kind], list) or not v[kind] or any(not isinstance(c, str) for c in v[kind])):
            raise ValueError(f"structured_outputs.{kind} must be {STRUCTURED_KINDS[kind]}")
        return v

    @model_validator(mode="after")
    def _beam(self, info: Any) -> "_Common":
        """Beam search takes its beams' width (n), max_tokens, ignore_eos, include_stop_str_in_output and
        length_penalty (vLLM's BeamSearchParams; without beam search length_penalty has no effect, as vLLM's); a
        field it would not honour is a 400 naming it, where it is given a value that would change the reply (an
        empty list, or the field's default, changes nothing)."""
        if not math.isfinite(self.length_penalty):
            raise ValueError("length_penalty must be a finite number")
        if not self.use_beam_search:
            return self
        cap = logprobs_cap(info)  # (each step asks twice its width's logprobs: vLLM's)
        if cap >= 0 and (self.n or 1) > cap // 2:
            raise ValueError(f"n: a beam search keeps at most {cap // 2} beams (n) here (each step asks the logprobs "
                             f"of twice as many tokens, and this server's max_logprobs is {cap}), got {self.n or 1}")
        for name in BEAM_REFUSED:
            v = getattr(self, name, None)
            default = type(self).model_fields[name].default if name in type(self).model_fields else None
            # (an empty list, or logit_bias {}, changes nothing; an empty schema, guided_json {}, is one: any value)
            if v is None or v is False or (isinstance(v, list) or name == "logit_bias") and not v \
                    or (type(v) is type(default) and v == default) \
                    or (name in BEAM_NEUTRAL and not isinstance(v, bool) and v == BEAM_NEUTRAL[name]):
                continue
            if not (name == "response_format" and v.get("type") == "text") \
                    and not (name == "best_of" and v == (self.n or 1)) \
                    and not (name == "tool_choice" and (v == "none" or (v == "auto" and not self.tools))):
                raise ValueError(f"{name} is not supported with use_beam_search")
        return self

    @model_validator(mode="after")
    def _one_guide(self) -> "_Common":
        """At most one grammar for the reply, and one this server can keep: checked (compiled) here."""
        given = [name for name, on in (
            ("response_format", (self.response_format or {}).get("type", "text") != "text"),
            ("guided_json", self.guided_json is not None), ("guided_regex", self.guided_regex is not None),
            ("guided_choice", self.guided_choice is not None), ("guided_grammar", self.guided_grammar is not None),
            ("structured_outputs", self.structured_outputs is not None)) if on]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: a reply may be held to one format; {given[0]} gives one already")
        if self.guided_json is not None:
            try:
                compile_schema(self.json_schema() or "{}")
            except ValueError as e:
                raise ValueError(f"guided_json: {e}") from None
        if (regex := self.regex()) is not None:
            try:
                compile_regex(regex)
            except ValueError as e:
                raise ValueError(f"{given[0]}: {e}") from None
        elif (grammar := self.grammar()) is not None:
            try:
                compile_grammar(grammar)
            except ValueError as e:
                raise ValueError(f"{given[0]}: {e}") from None
        elif self.structured_outputs and "json" in self.structured_outputs:
            compile_schema(self.json_schema() or "{}")
        return self

    def grammar(self) -> str | None:
        """The EBNF grammar the whole reply must be a text of (vLLM's guided_grammar), where one is given."""
        return self.guided_grammar if self.guided_grammar is not None else \
            (self.structured_outputs or {}).get("grammar")

    def json_schema(self) -> str | None:
        """The schema the reply must be a value of (its JSON text), where one is given."""
        so = (self.structured_outputs or {}).get("json")
        guided = self.guided_json if self.guided_json is not None else so
        if guided is not None:
            return guided if isinstance(guided, str) else _schema_text(guided)
        rf = self.response_format or {}
        if rf.get("type") != "json_schema":
            return None
        return _schema_text(_format_schema(rf))

    def json_object(self) -> bool:
        """Whether the reply must be a JSON object (any)."""
        return (self.response_format or {}).get("type") == "json_object" \
            or (self.structured_outputs or {}).get("json_object") is True

    def regex(self) -> str | None:
        """The regular expression the whole reply must match (vLLM's guided_regex; guided_choice's texts as one),
        where one is given."""
        so = self.structured_outputs or {}
        if self.guided_regex is not None or so.get("regex") is not None:
            return self.guided_regex if self.guided_regex is not None else so["regex"]
        choices = self.guided_choice if self.guided_choice is not None else so.get("choice")
        return None if choices is None else choice_pattern(choices)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v is not None and not (v >= 1 or v == -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {v}")
        return v

    def sampling_kwargs(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments for `core.sampling.SamplingParams` (max_tokens None: fill the context window); a
        temperature, top_p, top_k, min_p or repetition_penalty the request leaves out is the model's (`defaults`:
        what its generation_config recommends, as vLLM applies it), else none of them (temperature 1, top_p 1); its
        max_tokens (the generation_config's max_new_tokens) caps the request's own, as vLLM's (a request that sets
        none is capped by the engine, within the context its prompt leaves: `InputProcessor.default_max_tokens`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        d = defaults or {}
        kw: dict[str, Any] = dict(
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,  # tiny: greedy
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            repetition_penalty=d.get("repetition_penalty", 1.0) if self.repetition_penalty is None
            else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            # (seed -1: vLLM's for no seed)
            seed=None if self.seed == -1 else self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            logit_bias={int(k): float(b) for k, b in (self.logit_bias or {}).items()},
            logprobs=self.top_count(), prompt_logprobs=self.prompt_count(),
            allowed_token_ids=list(self.allowed_token_ids or []), skip_special_tokens=self.skip_special_tokens,
            bad_words=list(self.bad_words or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            json_object=self.json_object(), json_schema=self.json_schema(), regex=self.regex(),
            grammar=self.grammar(),
        )
        cap = d.get("max_tokens")  # (a reply whose request sets none: the engine's, within the context it leaves)
        kw["max_tokens"] = max_tokens if cap is None or max_tokens is None else min(max_tokens, cap)
        return kw

    def top_count(self) -> int | None:
        """How many likeliest tokens each reply token's logprobs list (`SamplingParams.logprobs`): None for no
        logprobs."""
        return None

    def logprobs_shape(self) -> "LogprobShape | None":
        """How the reply's logprobs are shown (`Logprobs`), where it asks for them."""
        top = self.top_count()
        return None if top is None else LogprobShape(top, self.return_tokens_as_token_ids)

    def prompt_count(self) -> int | None:
        """How many likeliest tokens each prompt token's logprobs list (`SamplingParams.prompt_logprobs`): None for
        no prompt logprobs."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """stream_options.continuous_usage_stats (vLLM's): with include_usage, every chunk's usage is the tokens so far
        (not null)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


MAX_BATCH_PROMPTS = 256  # prompts in one completion request (a batch: n choices each)


class CompletionRequest(_Common):
    HONOURED: ClassVar[frozenset[str]] = frozenset({"echo", "best_of"})
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra=_documented({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}]}))
    echo: bool | None = False  # the prompt's text before each choice's (with logprobs: its tokens' before the reply's)
    suffix: str | None = Field(None, json_schema_extra=_opt({"type": "string", "maxLength": 0}))
    # OpenAI's: best_of choices of each prompt made, the n with the highest logprob per token returned (not streamed)
    best_of: int | None = Field(None, json_schema_extra=_opt({"type": "integer", "minimum": 1,
                                                              "maximum": MAX_CHOICES}))
    # each reply token's log-probability and its `logprobs` likeliest tokens' (and the chosen one's)
    logprobs: int | None = Field(None, json_schema_extra=_opt(_TOP_COUNT))
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info: Any) -> int | None:
        return _top_range(info.field_name, v, info)

    def top_count(self) -> int | None:
        return self.logprobs

    def made(self) -> int:
        """The choices made of each prompt: best_of, else n (`n` of them returned)."""
        return max(self.best_of or 1, self.n or 1)

    def prompt_count(self) -> int | None:
        """vLLM's `prompt_logprobs`; with `echo` and logprobs, at least `logprobs` (the echoed prompt's tokens are
        listed with them)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompt_options(self) -> PromptOptions:
        return PromptOptions(add_special_tokens=self.add_special_tokens,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)

    def fields_at_fault(self) -> tuple[str, str]:
        """(the prompt's field, the reply cap's field) for an error's `param`."""
        return "prompt", "max_tokens"

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported")
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if len(p) > MAX_BATCH_PROMPTS and not isinstance(p[0], int):
                raise ValueError(f"prompt: a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(p)}")
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise ValueError(f"best_of must be at least n, got {self.best_of} < {n}")
        if (k := len(self.prompts())) * (m := self.made()) > MAX_CHOICES:
            name = "n" if m == n else "best_of"
            raise ValueError(f"{name}: {k} prompts x {name}={m} make {k * m} choices, more than {MAX_CHOICES}")
        if m > n and self.stream:
            raise ValueError("best_of above n cannot be streamed (the best are known once all have ended)")
        if isinstance(p, list) and isinstance(p[0], str) and len(p) == 1:
            self.prompt = p[0]
        return self

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p: Any) -> Any:
        batch = _prompt_list(p)
        for i, one in enumerate(batch):
            which = f"prompt {i}" if len(batch) > 1 else "prompt"
            if not one:
                raise ValueError(f"{which} must not be empty")
            if isinstance(one, list) and any(t < 0 for t in one):
                raise ValueError(f"{which}: token ids must be non-negative")
        return p

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one (text or token ids), or a batch's (vLLM's list of texts or of token id
        lists), each answered by a choice of its own."""
        return _prompt_list(self.prompt)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"max_tokens must be a positive integer, got {v}")
        return v

    @model_validator(mode="after")
    def _prompt_alone(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be a positive integer, got 0 (0 only with echo: the prompt alone)")
        return self

    @property
    def prompt_only(self) -> bool:
        """`echo` with max_tokens 0 (vLLM's, OpenAI's): the prompt's text (and its tokens' logprobs) without a reply.
        Its requests make one token, which the response leaves out (`ingress._prompt_only`)."""
        return bool(self.echo) and self.max_tokens == 0

    def default_max_tokens(self) -> int | None:
        if self.prompt_only:
            return 1
        if self.max_tokens is None and "max_tokens" in self.model_fields_set:
            return None  # an explicit null: the context left (vLLM's), not the default of a field left out
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions


def logprobs_cap(info: Any) -> int:
    """The most likely tokens a request may ask the logprobs of: the validation context's `max_logprobs` (the served
    engine's, once the front knows it; -1: none known yet, the engine checks), else vLLM's default."""
    cap = (getattr(info, "context", None) or {}).get("max_logprobs") if info is not None else None
    return MAX_LOGPROBS if cap is None else cap


def _top_range(name: str, v: int | None, info: Any = None) -> int | None:
    """A count of likeliest tokens (logprobs, top_logprobs, prompt_logprobs): ValueError outside [0, the cap]
    (`logprobs_cap`)."""
    cap = logprobs_cap(info)
    if v is not None and (v < 0 or 0 <= cap < v):
        raise ValueError(f"{name} must be in [0, {cap}], got {v}" if cap >= 0 else f"{name} must be >= 0, got {v}")
    return v


def _format_schema(response_format: dict[str, Any]) -> Any:
    """A json_schema response_format's schema (at json_schema.schema, or pydantic's alias schema_), None if none."""
    spec = response_format.get("json_schema")
    return spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None


def _schema_text(schema: Any) -> str:
    """A JSON schema's text; ValueError (a 400) for one nested too deeply to write."""
    try:
        return json.dumps(schema)
    except RecursionError:
        raise ValueError("json_schema: the schema is nested too deeply") from None


def _prompt_list(p: Any) -> list[str | list[int]]:
    """A completion's `prompt` as its prompts: one (text or token ids), or a batch's list."""
    if isinstance(p, str) or not p or isinstance(p[0], int):
        return [p]
    return list(p)


# the content parts read as text (vLLM's), by type: the key that holds their text
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # no coercion: "3" is not 3, true is not 1 (as OpenAI)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # no coercion: "3" is not 3, true is not 1 (as OpenAI); the schema says what `_content` checks: only an assistant's
    # turn may have no content
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}, "required": ["role"]},
        {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array"}]}}, "required": ["content"]}]})
    # OpenAI's roles (system, developer, user, assistant, tool) or any other a model's chat template reads
    # (Llama 3's ipython, ...): passed to the template as they are, as vLLM's
    role: str = Field(..., min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's (OpenAI's shape), for the chat template
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    # an assistant's thinking, sent back (vLLM's reasoning_content, or its newer name): for the chat template
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """The text parts vLLM reads as text: `text`, the Responses API's `input_text` / `output_text`, an assistant's
        `refusal` (OpenAI's schema), and a plain string, each as a text part. A part other than text (an image,
        audio, a file) is named, not lost in the union's errors."""
        if not isinstance(content, list):
            return content
        out = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PART_KEYS:
                key = _TEXT_PART_KEYS[kind]
                if key not in part:
                    raise ValueError(f"content part {k} of type {kind!r} has no {key!r}")
                part = {"type": "text", "text": part[key]}
            elif isinstance(kind, str):
                raise ValueError(f"content part {k} is of type {kind!r}: this server takes text parts only")
            out.append(part)
        return out

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":  # OpenAI: only an assistant's turn may have none
            raise ValueError(f"a {self.role} message needs a content")
        return self

    def text(self) -> str:
        """The message's text: a list of text parts joined by newlines, as vLLM renders them."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class _ChatPrompt(BaseModel):
    """A chat's messages, and vLLM's fields for how they become the prompt (core.messages.PromptOptions)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # None: none where a chat template writes its own, the tokenizer's (a BOS) on the plain fallback, which writes none
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # a template of the request's own (vLLM's): run only where the app trusts requests with one (the ingress checks)
    chat_template: str | None = Field(None, max_length=1 << 16)
    # vLLM's: documents a RAG model's chat template shows it (Command R's, Granite's); other templates ignore them
    documents: list[dict[str, str]] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v: bool, info: Any) -> bool:  # a 400 naming the field (PromptOptions.check's own test)
        PromptOptions(add_generation_prompt=info.data.get("add_generation_prompt", True),
                      continue_final_message=v).check()
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        check_template_kwargs(v)
        return v

    def prompt_options(self) -> PromptOptions:
        tools = getattr(self, "tools", None)
        kwargs = self.chat_template_kwargs
        effort = getattr(self, "reasoning_effort", None)
        if effort is not None:  # (vLLM's: the template reads it; "none" switches the thinking off unless told)
            kwargs = {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {}),
                      **(kwargs or {})}
        return PromptOptions(self.add_special_tokens, self.add_generation_prompt, self.continue_final_message,
                             kwargs, getattr(self, "truncate_prompt_tokens", None),
                             json.dumps([t.model_dump(exclude_none=True) for t in tools]) if tools else None,
                             self.chat_template, json.dumps(self.documents) if self.documents else None)

    def turns(self) -> tuple[ChatTurn, ...]:
        return tuple(ChatTurn(m.role, m.text(), json.dumps(m.tool_calls) if m.tool_calls else None,
                              m.tool_call_id, m.name, m.reasoning_content if m.reasoning_content is not None
                              else m.reasoning) for m in self.messages)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


_VALUE_KEYS = frozenset(("const", "enum", "default", "examples"))  # a schema's values, not schemas: no $ref in them
# a schema's maps of names to schemas (a property named `default` is a schema)
_SCHEMA_MAPS = frozenset(("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"))


def _rooted(schema: Any, name: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters schema as a part of tool_choice required's schema of calls: as it is where it refers to
    nothing; else under `name` in `defs` (the calls' schema's $defs), its own $defs and definitions beside it there,
    and its local $refs rewritten to point where they pointed from its root (vLLM's: a tool's `#` and `#/$defs/X`
    are its own, not the list of calls'), a $ref to it in its place."""
    if not isinstance(schema, dict) or '"$ref"' not in json.dumps(schema):
        return schema

    def ref(target: str) -> str:
        if not target.startswith("#"):
            return target  # (not local: compile_schema refuses it)
        parts = target[1:].split("/")
        if len(parts) > 2 and parts[0] == "" and urllib.parse.unquote(parts[1]) in ("$defs", "definitions"):
            holder = urllib.parse.unquote(parts[1]).strip("$")
            return f"#/$defs/{name}_{holder}_" + "/".join(parts[2:])
        return f"#/$defs/{name}" + target[1:]

    def walk(node: Any, names: bool = False) -> Any:
        """A schema with its $refs rewritten (`names`: a map of names to schemas, such as `properties`)."""
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        if names:
            return {k: walk(v) for k, v in node.items()}
        return {k: ref(v) if k == "$ref" and isinstance(v, str) else v if k in _VALUE_KEYS
                else walk(v, k in _SCHEMA_MAPS) for k, v in node.items()}

    own = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    defs[name] = walk(own)
    for holder in ("$defs", "definitions"):
        for k, sub in (schema.get(holder) or {}).items() if isinstance(schema.get(holder), dict) else ():
            defs[f"{name}_{holder.strip('$')}_{k}"] = walk(sub)
    return {"$ref": f"#/$defs/{name}"}


class ChatCompletionRequest(_Common, _ChatPrompt):
    HONOURED: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice", "echo"})
    max_completion_tokens: int | None = Field(None, json_schema_extra=_opt(_POS_INT))
    # each reply token's log-probability, and its `top_logprobs` likeliest tokens' (with logprobs only)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, json_schema_extra=_opt(_TOP_COUNT))
    # OpenAI's tools, shown to the model by its chat template; with tool_choice a tool's name or "required" the reply
    # is that tool's call (its arguments a value of its parameters' schema: JSON mode) or a list of calls, returned
    # as `tool_calls`; with "auto" (the default with tools) the model's own calls are read from its reply, in the
    # format the app's `tool_call_parser` names (`deployments.tool_calls`)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's: a reasoning model's thinking is given as `reasoning_content` (where the app reads it:
    # `deployments.reasoning`); false: left out
    include_reasoning: bool = True
    # OpenAI's: how much a reasoning model thinks, passed to the chat template as vLLM passes it ("none": Qwen3's
    # enable_thinking false, unless chat_template_kwargs says otherwise)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: the reply continues the conversation's last message, an assistant's (continue_final_message), whose
    # text goes first in each choice's content
    echo: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: Any) -> int | None:
        _top_range(info.field_name, v, info)
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None and self.max_completion_tokens <= 0:
            raise ValueError("max_completion_tokens must be a positive integer")
        choice = self.tool_choice
        if choice is None:  # OpenAI's default: "auto" where there are tools
            choice = "auto" if self.tools else "none"
        if choice == "auto" and not self.tools:
            return self
        if choice not in ("none", "auto", "required") and not (
                isinstance(choice, dict) and choice.get("type") == "function"
                and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}')
        if choice in ("none", "auto"):  # "auto": the model's own format, where the server reads one (the ingress)
            return self
        if not self.tools:
            raise ValueError("tool_choice names a tool, or requires one, but the request has no tools")
        if isinstance(choice, dict) and choice["function"]["name"] not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names a tool the request does not have: {choice['function']['name']!r}")
        if self.guided_json is not None or (self.response_format or {}).get("type", "text") != "text" \
                or self.guided_regex is not None or self.guided_choice is not None or self.structured_outputs \
                or self.guided_grammar is not None:
            raise ValueError("tool_choice naming or requiring a tool and a response_format or guided format "
                             "cannot both be given")
        try:
            compile_schema(self.json_schema() or "{}")
        except ValueError as e:
            raise ValueError(f"tool_choice: a tool's parameters: {e}") from None
        return self

    def echoed(self) -> list[str] | None:
        """The text each choice's content opens with (`echo`: the last message's, where it is the assistant's, as
        vLLM's), else None."""
        last = self.messages[-1]
        return [last.text()] if self.echo and last.role == "assistant" else None

    def auto_tools(self) -> bool:
        """Whether the model chooses whether to call a tool (tool_choice "auto", OpenAI's default where there are
        tools): its reply is read in its own tool-call format (`tool_reader`)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def reply_reader(self, tool_parser: str | None, reasoning_parser: str | None,
                     prompt_thinking: str | None = None, model_format: str | None = None) -> ReplyReader | None:
        """A reader of the reply (`deployments.reasoning.ReplyReader`): its reasoning, where the app reads it
        (`reasoning_parser`, and where the prompt leaves the thinking, `prompt_thinking`; a reply held to a format
        thinks first, `thinking`), and its tool calls (`tool_reader`); None where it is read for neither."""
        tools = self.tool_reader(tool_parser, model_format)
        reasoning = reasoning_reader(reasoning_parser, prompt_thinking) if reasoning_parser else None
        if tools is None and reasoning is None:
            return None
        return ReplyReader(reasoning, tools, self.include_reasoning, one_call=self.parallel_tool_calls is False)

    def thinking(self, reasoning_parser: str | None) -> str | None:
        """`SamplingParams.thinking` for a reply held to a format where the app reads a reasoning model's thinking:
        its format holds from the end of the thinking (deepseek_r1's: from the reply's start; qwen3's: where the
        reply opens with <think>)."""
        guided = self.json_object() or self.json_schema() is not None or self.regex() is not None \
            or self.grammar() is not None
        if not reasoning_parser or not guided:
            return None
        return "open" if reasoning_parser == "deepseek_r1" else "tagged"

    def tool_reader(self, parser: str | None, model_format: str | None = None) -> ToolCallReader | None:
        """A reader of the reply's tool calls (`deployments.tool_calls`): a named tool's arguments, "required"'s
        list of calls, or with "auto" the model's own format (`parser`, which the ingress checked there is); None
        where the reply is text. `model_format`: the format the model's chat template shows (`tool_calls.detect`):
        a Mistral model's calls get ids of its own shape, whatever reads them (its templates take back no other on
        the next turn)."""
        tools = self.called_tools()
        if tools is not None:
            reader: ToolCallReader = NamedToolReader(tools[0].name) if isinstance(self.tool_choice, dict) \
                else RequiredToolReader()
        elif self.auto_tools() and parser:
            reader = model_format_reader(parser, [t.function.model_dump() for t in self.tools or ()])
        else:
            return None
        if "mistral" in (parser, model_format):
            reader.new_id = mistral_call_id  # type: ignore[method-assign]
        return reader

    def called_tools(self) -> list[FunctionDef] | None:
        """The tools the reply calls (tool_choice a tool's name: that one; "required": any of them), else None."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        if choice == "required":
            return [t.function for t in self.tools]
        return [t.function for t in self.tools if t.function.name == choice["function"]["name"]]

    def json_schema(self) -> str | None:
        """The schema the reply keeps to: a named tool's parameters, or (required) a list of calls, each a tool's
        name and parameters; else `_Common.json_schema`'s."""
        tools = self.called_tools()
        if tools is None:
            return super().json_schema()
        if isinstance(self.tool_choice, dict):
            return _schema_text(tools[0].parameters or {"type": "object"})
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                                   "parameters": _rooted(t.parameters or {"type": "object"},
                                                                         f"tool{i}", defs)},
                  "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}
        if self.parallel_tool_calls is False:
            array["maxItems"] = 1
        return _schema_text(array)

    def top_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def default_max_tokens(self) -> int | None:
        """None means "the rest of the context window" (OpenAI's chat default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def fields_at_fault(self) -> tuple[str, str]:
        """(the prompt's field, the reply cap's field as sent) for an error's `param`."""
        return "messages", "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API body (`POST /v1/responses`) as this server reads it: the route's documentation (its
    OpenAPI schema); `deployments.responses.chat_request` reads the body itself, into the chat it amounts to, whose
    other fields (SLOs, vLLM's sampling fields) it takes too."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, json_schema_extra=_opt(_POS_INT))
    temperature: float | None = Field(None, json_schema_extra=_opt({"type": "number", "minimum": 0, "maximum": 2}))
    top_p: float | None = Field(None, json_schema_extra=_opt({"type": "number", "minimum": 0, "maximum": 1}))
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    slo_ttft_ms: float | None = Field(None, json_schema_extra=_opt(_SLO_MS))
    slo_tpot_ms: float | None = Field(None, json_schema_extra=_opt(_SLO_MS))
    priority: int = 0  # vLLM's (a chat's)


# vLLM's /tokenize and /detokenize
class TokenizeCompletionRequest(BaseModel):
    """A text prompt's token ids, as a completion would take them."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str  # ("": its special tokens alone, as vLLM's)
    add_special_tokens: bool = True
    return_token_strs: bool | None = False  # (None: false, as vLLM's)

    def prompt_options(self) -> PromptOptions:
        return PromptOptions(add_special_tokens=self.add_special_tokens)


class TokenizeChatRequest(_ChatPrompt):
    """A chat's token ids, as a chat completion would take them (its template rendered, with the `tools` the template
    shows, as vLLM's)."""

    model: str | None = None
    return_token_strs: bool | None = False  # (None: false, as vLLM's)
    tools: list[Tool] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING: the app's
    allow_runtime_lora_updating)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # an adapter of that name loaded already: replaced (else a 400)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter (its `lora_int_id` is read as vLLM's ids are not: by name only)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = ""


# ---------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


SERVED_SINCE = int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: SERVED_SINCE)  # when this process started serving (as vLLM)
    owned_by: str = "kairos"
    root: str | None = None  # the served model this name stands for (vLLM's field; a LoRA adapter: its folder)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with `cached_tokens` (the app's enable_prompt_tokens_details), its `prompt_tokens_details`:
    the prompt tokens found in the prefix cache."""
    out: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def with_cached_tokens(response: dict, cached_tokens: int | None) -> dict:
    """A whole response whose usage says its prompts' tokens found cached (None: says nothing)."""
    if cached_tokens is not None:
        response["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return response


def error_body(message: str, type_: str = "invalid_request_error", code: str | int | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# A choice's `stop_reason` (vLLM's extension): the stop string or stop token id that ended it, None otherwise (EOS,
# length, or not ended yet).
StopReason = str | int | None


class Choice(NamedTuple):
    """A choice of a whole response."""

    text: str
    finish: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: StopReason = None
    logprobs: dict | None = None  # as the response shows them (`Logprobs`)
    prompt_logprobs: list | None = None  # as vLLM shows them (`shown_prompt_logprobs`)
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the reply's
    prompt_token_ids: list[int] | None = None  # and its prompt's

# a logprob below it (-inf: a token the model rules out) is shown as it (vLLM's: JSON has no infinity)
LOGPROB_FLOOR = -9999.0


def _shown(v: float) -> float:
    return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN too)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class LogprobShape(NamedTuple):
    """How a reply's logprobs are shown: `top` likeliest tokens each; `as_ids`: tokens named "token_id:N" (vLLM's
    return_tokens_as_token_ids), not by their text."""
    top: int
    as_ids: bool = False


class Logprobs:
    """A choice's logprobs in OpenAI's shapes, built from its items' `TokenLogprob`s as they come (a stream's chunks,
    or a whole reply's at once): a completion's {text_offset, token_logprobs, tokens, top_logprobs}, each token's
    top a map of text to logprob holding the chosen token and the `top` likeliest ("up to logprobs + 1", as OpenAI
    and vLLM); a chat's {content: [{token, logprob, bytes, top_logprobs}]}, top_logprobs the `top` likeliest. A
    completion's text offsets count from the start of the choice's text: within an item by its tokens' texts, from
    one item to the next by the text that went out (vLLM's)."""

    __slots__ = ("kind", "top", "as_ids", "offset")

    def __init__(self, kind: str, shape: LogprobShape) -> None:
        self.kind, (self.top, self.as_ids) = kind, shape
        self.offset = 0

    def _name(self, token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if self.as_ids else text

    def render(self, lps: list[TokenLogprob], text: str) -> dict:
        """The logprobs of an item's tokens (`lps`; an echoed prompt's first, whose first token has no logprob: null
        there), the item carrying `text`."""
        k = self.top
        if self.kind == "completion":
            offsets, at = [], self.offset
            for x in lps:
                offsets.append(at)
                at += len(x.token)
            self.offset += len(text)
            return {"text_offset": offsets,
                    "token_logprobs": [None if x.logprob is None else _shown(x.logprob) for x in lps],
                    "tokens": [self._name(x.id, x.token) for x in lps],
                    "top_logprobs": [None if x.logprob is None else
                                     {self._name(x.id, x.token): _shown(x.logprob),
                                      **{self._name(i, t): _shown(v) for i, t, v in x.top[:k]}}
                                     for x in lps]}
        name = self._name
        return {"content": [{"token": name(x.id, x.token), "logprob": _shown(x.logprob), "bytes": _bytes(x.token),
                             "top_logprobs": [{"token": name(i, t), "logprob": _shown(v), "bytes": _bytes(t)}
                                              for i, t, v in x.top[:k]]} for x in lps]}


def shown_prompt_logprobs(lps: list[TokenLogprob], top: int) -> list[dict | None]:
    """Prompt logprobs as vLLM shows them (its `prompt_logprobs`): per prompt token, None for the first, else a map
    of token id (a string, in JSON) to {logprob, rank, decoded_token}, the prompt's token first, then the `top`
    likeliest."""
    out: list[dict | None] = []
    for x in lps:
        if x.logprob is None:
            out.append(None)
            continue
        d = {str(x.id): {"logprob": _shown(x.logprob), "rank": x.rank, "decoded_token": x.token}}
        for rank, (t, text, v) in enumerate(x.top[:top], 1):
            d.setdefault(str(t), {"logprob": _shown(v), "rank": rank, "decoded_token": text})
        out.append(d)
    return out


def read_replies(resp: dict, reader: Callable[[str | None], ReplyReader | None], echo: str | None = None,
                 prompt_thinking: str | None = None) -> dict:
    """A chat response whose replies are read (`reader(prompt_thinking)`: a `ChatCompletionRequest.reply_reader`
    per choice, or None: text; `prompt_thinking`: where the prompt the choices share leaves the thinking,
    `RequestOutput.prompt_thinking`): a reasoning model's thinking as the message's `reasoning_content`; tool calls
    as its `tool_calls`
    (content: the text beside them, or null), finish reason `tool_calls` where it stopped on its own, unless a named
    tool was called (OpenAI's); a reply with no calls (or whose cap cut them) keeps its text. `echo`: the echoed last
    message each content opens with: not read, put back before the reply's content (vLLM's)."""
    for c in resp["choices"]:
        r = reader(prompt_thinking)
        if r is None:
            return resp
        text = c["message"]["content"]
        if echo and text.startswith(echo):
            text = text[len(echo):]
        reasoning, content, calls = r.whole(text)
        if echo:
            content = echo + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if r.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            if r.as_calls and c["finish_reason"] == "stop":
                c["finish_reason"] = "tool_calls"
        c["message"] = message
    return resp


def completion_response(rid: str, model: str, text: str, finish: str | None, pt: int, ct: int,
                        stop_reason: StopReason = None, logprobs: dict | None = None,
                        prompt_logprobs: list | None = None) -> dict:
    return batch_completion_response(rid, model, [Choice(text, finish, pt, ct, stop_reason, logprobs,
                                                         prompt_logprobs)])


def _with_prompt_logprobs(d: dict, shown: list | None) -> dict:
    if shown is not None:
        d["prompt_logprobs"] = shown
    return d


def with_token_ids(d: dict, token_ids: list[int] | None, prompt_token_ids: list[int] | None = None) -> dict:
    """vLLM's return_token_ids: a choice's reply token ids and (a completion's) its prompt's, where asked."""
    if token_ids is not None:
        d["token_ids"] = token_ids
    if prompt_token_ids is not None:
        d["prompt_token_ids"] = prompt_token_ids
    return d


def batch_completion_response(rid: str, model: str, choices: list[Choice], n: int = 1,
                              completion_tokens: int | None = None) -> dict:
    """A completion of one or more prompts: n choices per prompt (`Choice`s), in order (prompt i's j-th at index
    i x n + j); the usage is their sum, each prompt's tokens counted once (as vLLM's), or `completion_tokens` (with
    best_of: the choices not returned too). A choice has vLLM's `prompt_logprobs` where its request asked for
    them."""
    ct = sum(c.completion_tokens for c in choices) if completion_tokens is None else completion_tokens
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [with_token_ids(_with_prompt_logprobs(
                {"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish,
                 "stop_reason": c.stop_reason}, c.prompt_logprobs), c.token_ids, c.prompt_token_ids)
                for i, c in enumerate(choices)],
            "usage": usage(sum(c.prompt_tokens for c in choices[::n]), ct)}


def chat_response(rid: str, model: str, text: str, finish: str | None, pt: int, ct: int,
                  stop_reason: StopReason = None, logprobs: dict | None = None,
                  prompt_logprobs: list | None = None) -> dict:
    return batch_chat_response(rid, model, [Choice(text, finish, pt, ct, stop_reason, logprobs, prompt_logprobs)])


def batch_chat_response(rid: str, model: str, choices: list[Choice]) -> dict:
    """A chat completion's n choices (`Choice`s), in order; the usage counts the prompt once (as vLLM's); vLLM's
    `prompt_logprobs` (of the prompt the choices share) where the request asked for them, and its return_token_ids'
    `prompt_token_ids`."""
    return with_token_ids(_with_prompt_logprobs(
        {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
         "choices": [with_token_ids({"index": i, "message": {"role": "assistant", "content": c.text},
                                      "logprobs": c.logprobs, "finish_reason": c.finish,
                                      "stop_reason": c.stop_reason}, c.token_ids)
                     for i, c in enumerate(choices)],
         "usage": usage(choices[0].prompt_tokens, sum(c.completion_tokens for c in choices))},
        choices[0].prompt_logprobs), None, choices[0].prompt_token_ids)


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None, index: int = 0,
                     stop_reason: StopReason = None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": stop_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None,
               stop_reason: StopReason = None, index: int = 0, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": stop_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, pt: int, ct: int,
                metrics: dict | None = None, cached_tokens: int | None = None) -> dict:
    """The final usage chunk; `metrics` (Kairos extension, ignored by OpenAI clients): the engine's own view."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
           "usage": usage(pt, ct, cached_tokens)}
    if metrics:
        out["kairos_metrics"] = metrics
    return out


def engine_metrics(m: RequestMetrics | None) -> dict | None:
    """TTFT / TPOT / end-to-end as the engine measured them (ms), from the final item's metrics, and the reply
    length its length predictor expected (`predicted_output_tokens`, where it predicted one), and the prompt tokens
    found in the prefix cache (`cached_prompt_tokens`, where there were any)."""
    if m is None:
        return None
    ms = {"ttft": m.ttft_s, "tpot": m.tpot_s, "e2e": m.e2e_s}
    out: dict = {f"{k}_ms": round(v * 1000.0, 3) for k, v in ms.items() if v is not None}
    if m.predicted_output_len is not None:
        out["predicted_output_tokens"] = m.predicted_output_len
    if m.num_cached_tokens:
        out["cached_prompt_tokens"] = m.num_cached_tokens
    return out or None


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def parse_slo_header(name: str, raw: str | None, integer: bool = False) -> float | int | None:
    """An SLO header's value: a number, validated as the body's (not the "1_000" and "+5" Python's float() also
    takes)."""
    if raw is None:
        return None
    text = raw.strip()
    try:
        if "_" in text or text.startswith("+"):
            raise ValueError
        v: float = float(text)
    except ValueError:
        raise ValueError(f"header {name} must be a number, got {raw!r}") from None
    return check_slo_value(f"header {name}", v, integer)
