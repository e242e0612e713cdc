"""The typed messages that cross a process boundary (vLLM v1's engine-core messages, in spirit).

Each is defined once, here, and used by both ends:
- `GenerateRequest`: ingress -> replica (validated at the edge, the HTTP ingress or an in-process caller);
- `RequestOutput`: one stream item, engine -> replica -> ingress; an error or a rejection is a typed field;
- `RoutingStats`: replica -> router (through Serve's `record_routing_stats`, which carries a plain dict).
A receiver checks what it got with `check_output` / `RoutingStats.from_dict`: anything unknown or malformed
raises `ProtocolError` instead of passing for a success.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from core.request import SLO, FinishReason, LoraSource
from core.sampling import SamplingParams


class ProtocolError(ValueError):
    """A message that does not match its contract."""


class RejectReason(enum.StrEnum):
    """Why a request was turned away. The scheduler gives the first four; the replica relabels a TTFT or TPOT
    rejection that an idle replica would have made too (by its latency model) as `SLO_UNATTAINABLE`."""

    TTFT_UNATTAINABLE = "ttft_unattainable"  # busy: the queue ahead puts its TTFT SLO out of reach now (429)
    TPOT_UNATTAINABLE = "tpot_unattainable"  # busy: no room for its TPOT SLO now (429)
    OVERLOADED = "overloaded"  # busy: the replica's waiting queue is full (429)
    SHED = "shed"  # overload: a request asking for more work than the replica's shedding threshold (429)
    SLO_UNATTAINABLE = "slo_unattainable"  # not even an idle replica could meet it: retrying cannot help (400)


class ContextLengthExceeded(ValueError):
    """`max_tokens` beyond what the context window leaves after the prompt (raised where the prompt is tokenized;
    the message is vLLM's)."""

    def __init__(self, max_tokens: int, max_model_len: int, prompt_tokens: int) -> None:
        self.args_ = (max_tokens, max_model_len, prompt_tokens)
        super().__init__(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                         f"context length is {max_model_len} tokens and your request has {prompt_tokens} input "
                         f"tokens ({max_tokens} > {max_model_len} - {prompt_tokens}).")

    def __reduce__(self) -> tuple:
        return type(self), self.args_


class PromptTooLong(ValueError):
    """A prompt that leaves no room in the context window for a generated token (raised where it is tokenized)."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        self.args_ = (prompt_tokens, max_model_len)
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                         f"{prompt_tokens} input tokens (the prompt and at least 1 generated token must fit). Please "
                         f"reduce the length of the input.")

    def __reduce__(self) -> tuple:
        return type(self), self.args_


class ErrorKind(enum.StrEnum):
    """What failed, for a final item with finish_reason `error`: the HTTP status follows from it."""

    INVALID_REQUEST = "invalid_request"  # 400: the replica refused the input (bad ids, over the KV cache, ...)
    CONTEXT_LENGTH = "context_length"  # 400: max_tokens beyond the context the prompt leaves (`ContextLengthExceeded`)
    PROMPT_TOO_LONG = "prompt_too_long"  # 400: a prompt that fills the context window (`PromptTooLong`)
    UNAVAILABLE = "unavailable"  # 503: the engine is dead or shutting down
    ENGINE = "engine"  # 500: the model step or sampling failed


def _enum(cls: type[enum.Enum], v: Any, name: str) -> Any:
    if v is None or isinstance(v, cls):
        return v
    try:
        return cls(v)
    except ValueError:
        raise ProtocolError(f"unknown {name} {v!r}") from None


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One message of a chat: its role and text; an assistant's tool calls (OpenAI's `tool_calls`, as JSON text), a
    tool's reply's call id (`tool_call_id`), the speaker's `name` (OpenAI's, where the client gives one) and an
    assistant's thinking (`reasoning`: vLLM's reasoning_content, sent back), for the chat template."""

    role: str
    content: str
    tool_calls: str | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


# apply_chat_template's own arguments, which chat_template_kwargs may not set
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"))


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """ValueError (a client's 400) where chat_template_kwargs would set one of apply_chat_template's own arguments."""
    bad = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)} (a request field of its own, or the "
                         "server's)")


@dataclass(frozen=True, slots=True)
class PromptOptions:
    """How a prompt becomes token ids, as vLLM's request fields say:
    - `add_special_tokens`: the tokenizer's special tokens around the text (a BOS, ...); None: the default of the
      prompt's kind, True for a text prompt (as HF's `tokenizer(text)` and vLLM's completions) and False for a chat
      prompt, whose template writes its own (True on the plain fallback of a tokenizer without one, which writes
      none);
    - chat only: `add_generation_prompt` (open the assistant's turn), `continue_final_message` (the last message
      is left open for the reply to continue; not with `add_generation_prompt`), and `chat_template_kwargs`, more
      variables for the template (e.g. Qwen3's `enable_thinking`; not apply_chat_template's own arguments), and
      `chat_template`, a template of the request's own (where the app trusts requests with one).
    Not hashable where `chat_template_kwargs` is set (a dict)."""

    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: only the prompt's last k tokens are kept (-1: as many as the context window takes with a reply token)
    truncate_prompt_tokens: int | None = None
    tools: str | None = None  # chat only: OpenAI's `tools` (their JSON text), which the chat template shows the model
    chat_template: str | None = None  # chat only: a request's own template (vLLM's), in place of the tokenizer's
    documents: str | None = None  # chat only: vLLM's `documents` (their JSON text), for a RAG model's template

    def check(self) -> "PromptOptions":
        """ValueError (a client's 400) for options that contradict each other or are out of range."""
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
        check_template_kwargs(self.chat_template_kwargs)
        return self


MAX_SEND_WAIT_MS = 60_000.0  # a stamp older than this is a clock's error (a step of the wall clock), not a wait


@functools.cache
def clock_id() -> str | None:
    """Whose clocks this process reads: the kernel's boot id, the same in every process and container on this
    kernel (whose monotonic and wall clocks they share) and different on another machine, even one of the same
    name. A stamp of time is compared with this process's clock only where it carries this id (`GenerateRequest.
    arrived`, `ingress.proxy_wait_ms`); clients cannot read it, so they cannot forge one. None where the kernel has
    none (not Linux): then no stamp counts."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def waited_since_ms(stamp_clock: str | None, stamp_s: float, now_s: float) -> float:
    """The ms from a stamp of time (`stamp_s`, read on the clocks of `stamp_clock`) to `now_s` on this machine's
    clock: 0 unless the stamp is of this machine's clocks (`clock_id`) and between 0 and MAX_SEND_WAIT_MS old."""
    wait = (now_s - stamp_s) * 1000.0
    mine = clock_id()
    return wait if mine is not None and stamp_clock == mine and 0.0 < wait <= MAX_SEND_WAIT_MS else 0.0



def chat_texts(turns: Sequence[ChatTurn], options: PromptOptions | None) -> list[str]:
    """The texts a chat's prompt is rendered from (its tools, documents, turns and their tool calls): what rendering
    and tokenizing it costs, and what its tokens are guessed from before they are counted."""
    texts = [options.tools or "", options.documents or ""] if options is not None else []
    return texts + [f"{t.content or ''}{t.tool_calls or ''}" for t in turns]

@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation call. Exactly one of `prompt` (text or token ids) and `messages` (chat) is set; `options` say
    how it is tokenized."""

    request_id: str
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[ChatTurn, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    slo: SLO = field(default_factory=SLO)
    options: PromptOptions = field(default_factory=PromptOptions)
    prompt_len_hint: int = 1  # the caller's estimate, for routing only; the engine counts tokens itself
    avoid_replicas: tuple[str, ...] = ()  # replicas that already turned this request away (routing only)
    # of those, the ones whose engine failed it (died): never again while another replica can take it (routing only)
    failed_replicas: tuple[str, ...] = ()
    # the LLM replicas running as the sending Ingress last heard (None: not known): an autoscaled app's replica
    # splits the Ingress's chunk budget over them (`StreamPacing.for_running`)
    replicas_running: int | None = None
    # ms of its TTFT SLO spent before this send (since HAProxy read it: its wait for the Ingress, reading, parsing,
    # earlier sends turned away; and at the replica its way there, `arrived`): the engine's TTFT deadline is that much
    # nearer (`engine_slo`); its metrics labels and the test of an SLO no idle replica meets keep `slo`
    waited_ms: float = 0.0
    # the Ray actor id of the caller (an Ingress replica), None in-process: a replica aborts the request once that
    # actor is dead (nothing else cancels a replica's generator when its caller dies)
    caller: str | None = None
    # (clock_id(), time.monotonic()) where and when an Ingress sent it to an LLM replica: the replica counts the time
    # since as spent too (`arrived`: routing, Serve's queue, transport), where the two share a clock
    sent_at: tuple[str | None, float] | None = None
    # the LoRA adapter (its served name) the request runs through, None: the base model; and vLLM's cache_salt
    lora: str | None = None
    cache_salt: str | None = None
    lora_source: LoraSource | None = None  # the folder of an adapter loaded at run time (/v1/load_lora_adapter)
    priority: int = 0  # vLLM's: lower first, where the engine's scheduling_policy is "priority" (else no effect)
    # vLLM's return_token_ids: the first item carries the prompt's token ids (`RequestOutput.prompt_token_ids`)
    return_token_ids: bool = False
    # the app reads a reasoning model's thinking out of the reply: the first item says where the prompt leaves the
    # thinking (`RequestOutput.prompt_thinking`)
    read_thinking: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("a GenerateRequest has exactly one of prompt and messages")
        if isinstance(self.prompt, list):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "avoid_replicas", tuple(self.avoid_replicas))
        object.__setattr__(self, "failed_replicas", tuple(self.failed_replicas))

    def arrived(self, now_s: float) -> "GenerateRequest":
        """This request as a replica got it at `now_s` (its monotonic clock): the time since it was sent (`sent_at`)
        added to `waited_ms` where it was sent on this machine's clocks (`waited_since_ms`), and `sent_at` cleared,
        so that it counts once."""
        if self.sent_at is None:
            return self
        spent_ms = waited_since_ms(self.sent_at[0], self.sent_at[1], now_s)
        return dataclasses.replace(self, waited_ms=self.waited_ms + spent_ms, sent_at=None)

    @property
    def engine_slo(self) -> SLO:
        """The SLO the engine schedules by: the client's, its TTFT less what was spent before this send."""
        ttft = self.slo.ttft_ms
        if ttft is None or not self.waited_ms > 0:
            return self.slo
        return dataclasses.replace(self.slo, ttft_ms=max(ttft - self.waited_ms, 1e-3))


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    arrival_s: float
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float | None
    token_times: list[float] = field(default_factory=list)
    # the reply length the scheduler's length predictor expected at the request's arrival, within its max_tokens (in
    # served tokens, at the calibration of that time: what it planned with then); None where it predicted none (no
    # predictor, an output-length hint, a reply only its cap ends)
    predicted_output_len: int | None = None
    num_cached_tokens: int = 0  # the prompt tokens its admission found in the prefix cache (not computed again)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (n - 1): the SCORPIO / DistServe definition."""
        t = self.token_times
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None or self.first_token_s is None else self.finished_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class ServedBy:
    """Set by the replica on a stream's first item: who served it and how long the replica took to answer."""

    replica: str
    replica_ms: float  # call received -> first item (tokenize, queue, prefill)
    retry_after_s: int | None = None  # on a rejection
    # on a rejection: the strictest TTFT / TPOT SLO (ms) an idle replica would accept for this request
    best_ttft_ms: float | None = None
    best_tpot_ms: float | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model (its raw logits: vLLM's default `raw_logprobs`), with the token's id
    and text (`decode([id])`, vLLM's), its rank among the vocabulary (1: the likeliest), and the `top` most likely
    tokens (id, text, log-probability), likeliest first, as many as its request asked for (`SamplingParams.logprobs`
    or `prompt_logprobs`). A logprob may be -inf (a token the model rules out); it is None, with rank 0, for a
    prompt's first token, which nothing predicts."""

    id: int
    token: str
    logprob: float | None
    rank: int
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One stream item. `text`/`token_ids` are the delta since the previous item; the last has finished=True."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    reject_reason: RejectReason | None = None  # with finish_reason `rejected`
    # with finish_reason `rejected`: the reply length the scheduler planned the request's admission for (its hint,
    # its max_tokens, or a predicted length), which the replica's idle floor for the request plans for too
    planned_output_len: int | None = None
    error: str | None = None  # a message, with finish_reason `error` (or `abort` when the engine stopped)
    stop_reason: str | int | None = None  # with finish_reason `stop`: the stop string or stop token id (None: EOS)
    error_kind: ErrorKind | None = None  # with finish_reason `error`
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None  # set on the final item
    served_by: ServedBy | None = None
    # with `SamplingParams.logprobs`: one per token of `token_ids`, in order (the last token of a reply that a stop
    # token ended too, whose text is left out); None otherwise
    logprobs: list[TokenLogprob] | None = None
    # with `SamplingParams.prompt_logprobs`, on the item of the reply's first token: one per prompt token (the first's
    # logprob None: nothing predicts it)
    prompt_logprobs: list[TokenLogprob] | None = None
    # with `GenerateRequest.return_token_ids`, on a replica's first item of an admitted request: the prompt's token
    # ids as the engine took them (its chat template rendered, truncated where asked)
    prompt_token_ids: list[int] | None = None
    # with `GenerateRequest.read_thinking`, on a replica's first item of an admitted request: where the prompt (its
    # chat template rendered) leaves a reasoning model's thinking: "open" (it ends inside a `<think>`: the reply
    # starts in the thinking), "closed" (a template that switched the thinking off closed it), None (neither)
    prompt_thinking: str | None = None

    def __post_init__(self) -> None:
        if not self.finished and self.finish_reason is None and self.reject_reason is None \
                and self.error_kind is None:
            return  # a token's delta (the item a step makes per request): nothing to convert, and it holds `check`
        object.__setattr__(self, "finish_reason", _enum(FinishReason, self.finish_reason, "finish_reason"))
        object.__setattr__(self, "reject_reason", _enum(RejectReason, self.reject_reason, "reject_reason"))
        kind = self.error_kind
        if kind is None and self.finish_reason is FinishReason.ERROR:
            kind = ErrorKind.ENGINE
        object.__setattr__(self, "error_kind", _enum(ErrorKind, kind, "error_kind"))
        self.check()

    @classmethod
    def failed(cls, request_id: str, error: str, kind: ErrorKind) -> "RequestOutput":
        """The final item of a request that failed (finish_reason `error`) for `kind` of reason."""
        return cls(request_id, finished=True, finish_reason=FinishReason.ERROR, error=error, error_kind=kind)

    def check(self) -> "RequestOutput":
        """Raise ProtocolError unless the item is consistent (also for items that arrived pickled)."""
        if self.finished != (self.finish_reason is not None):
            raise ProtocolError(f"item of {self.request_id!r}: finished={self.finished} with "
                                f"finish_reason={self.finish_reason!r}")
        if self.finish_reason is not None and not isinstance(self.finish_reason, FinishReason):
            raise ProtocolError(f"unknown finish_reason {self.finish_reason!r}")
        if (self.finish_reason is FinishReason.REJECTED) != isinstance(self.reject_reason, RejectReason):
            raise ProtocolError(f"item of {self.request_id!r}: a rejection needs a reject_reason, and only a rejection")
        if self.finish_reason is FinishReason.ERROR and not isinstance(self.error_kind, ErrorKind):
            raise ProtocolError(f"item of {self.request_id!r}: an error needs an error_kind")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ProtocolError(f"item of {self.request_id!r}: {len(self.logprobs)} logprobs for "
                                f"{len(self.token_ids)} tokens")
        return self


def check_output(item: Any) -> RequestOutput:
    """The receiving end's check: a `RequestOutput` that holds its invariants, else ProtocolError."""
    if not isinstance(item, RequestOutput):
        raise ProtocolError(f"expected a RequestOutput stream item, got {type(item).__name__}")
    return item.check()


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """What a replica reports to the router every `request_routing_stats_period_s`."""

    num_waiting: int
    num_running: int
    inflight: int  # generate calls in progress in the replica (includes the engine's waiting + running)
    vbs: float
    strictest_tpot_ms: float | None
    kv_blocks_free: int
    kv_blocks_total: int
    predicted_ttft_ms: float | None  # for a ~median prompt, queue included; None before the model is fitted
    predicted_queue_ms: float | None  # for a 1-token prompt: the queue ahead
    median_prompt_tokens: int
    # ms per token pair of a prompt's attention (the latency model's gamma, `LatencyModel.prefill_ms`): the router's
    # TTFT for a prompt of another length grows with its square beyond the line through the two points above
    prefill_sq_ms: float
    itl_ms: float | None  # EWMA of the decode step time (what a request decoding every step sees); paced
    # requests' gaps are longer by design, so they say nothing about room for a stricter TPOT
    step_batch: float | None  # EWMA of the decode batch sizes behind `itl_ms` (None with it)
    alive: bool
    ts: float
    # the replica's VBS gate as a line (Scheduler.gate_line): a request joining passes where
    # gate_base_ms + gate_row_ms * VBS' < T_min'; None where the replica has no gate or no latency model. VBS' is
    # T_min' x (tpot_inv_sum + 1 / its TPOT) + best_effort_share (+ what is queued), as the gate counts it
    gate_base_ms: float | None = None
    gate_row_ms: float | None = None
    tpot_inv_sum: float = 0.0  # sum of 1 / TPOT (ms) over the running requests with a TPOT SLO, as the gate counts
    best_effort_share: float = 0.0  # the running best-effort requests' share of the batch (best_effort_trp each)
    # the replica's prefill model (`scheduling.predictor.prefill_time_ms`: c0, theta, alpha, beta; gamma is
    # `prefill_sq_ms`) and the prompt tokens waiting there (and their token pairs): the router predicts a prompt's
    # TTFT with the model itself (the two points above miss a GPU fit's knee: a line through them read any prompt on
    # an idle replica as the knee's flat cost); None where the replica has no model
    prefill_c0_ms: float | None = None
    prefill_theta: float | None = None
    prefill_alpha_ms: float | None = None
    prefill_beta_ms: float | None = None
    waiting_tokens: int = 0
    waiting_sq: float = 0.0

    @property
    def queue_len(self) -> int:
        return self.num_waiting + self.num_running

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, unknown_ok: bool = False) -> "RoutingStats":
        """The stats a replica reported, checked: ProtocolError for a key missing, of the wrong type, or unknown.
        `unknown_ok`: keys this version does not know are left out instead (a replica of a newer version, during a
        rolling upgrade: the router reads what it knows)."""
        if not isinstance(d, dict):
            raise ProtocolError(f"routing stats must be a dict, got {type(d).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        # a field with a default may be missing: a replica of the version before it was added (a rolling upgrade)
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        unknown = set(d) - names
        if not required <= set(d) or (unknown and not unknown_ok):
            raise ProtocolError(f"routing stats keys differ: missing {sorted(required - set(d))}, "
                                f"unknown {sorted(unknown)}")
        for f in fields:  # (annotations are strings here: `from __future__ import annotations`)
            if f.name not in d:
                continue
            v, kind = d[f.name], str(f.type)
            ok = (v is None and kind.endswith("| None")) or (
                isinstance(v, bool) if kind == "bool" else
                not isinstance(v, bool) and isinstance(v, numbers.Integral if kind == "int" else numbers.Real))
            if not ok:
                raise ProtocolError(f"routing stats field {f.name} is {v!r}, not of type {kind}")
        return cls(**{k: v for k, v in d.items() if k in names})
