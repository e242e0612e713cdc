"""The typed messages between `EngineCoreClient` and its engine process (`engine.core_proc`), pickled over
one socket. Their own module, so that both sides name them the same (the child runs `engine.core_proc` as
`__main__`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.messages import RequestOutput, TokenLogprob
from core.request import Request
from engine.lora import LoraServing
from engine.stats import EngineStats
from scheduling.predictor import LatencyModel


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the child tells the client once its engine is up."""

    model_name: str
    max_model_len: int
    tokenizer_path: str
    trust_remote_code: bool
    vocab_limit: int
    eos_token_ids: list[int]
    kv_capacity_tokens: int
    latency_model: LatencyModel | None
    stats: EngineStats
    step_timeout_s: float = 0.0  # the engine's watchdog limit (0: none): also how long the child may be silent
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)  # LLMEngine.sampling_defaults
    device_type: str = "cpu"  # the engine's device (cpu, cuda): its scheduler defaults (`engine.config.for_device`)
    lora: LoraServing | None = None  # the LoRA adapters it serves (`InputProcessor.lora`)
    tokenizer_class: str = ""  # the class of the engine's tokenizer (`engine.tokenizer_files.class_name`)


@dataclass(frozen=True, slots=True)
class SetupFailed:
    """Loading failed: `bad_input` (a ValueError: bad settings) or not, and the message."""

    bad_input: bool
    message: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent by a thread of the child every `core_proc.HEARTBEAT_S` (a child stuck holding its interpreter, or
    stopped, sends none)."""


@dataclass(frozen=True, slots=True)
class Died:
    """The child's last message before it hangs up: why its engine stopped (its worker died, or hung)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Add:
    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class InjectFault:
    count: int
    fatal: bool = False
    hang_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """`LLMEngine.reconfigure`'s scheduler knobs, checked by the client before it sends them."""
    scheduler: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class TokenDeltas:
    """A loop turn's token items (`OutputSink.put_token`: a request's next token and the text it adds) as columns,
    one item at the same index of each list, in the order they were put. A running request makes one a step, so a
    GPU replica makes hundreds a step: as columns they cost a list append each to collect and next to nothing to
    pickle, where a `RequestOutput` each cost more to build and pickle than to detokenize. The client makes each
    its stream's `RequestOutput`."""

    request_ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by index, the items that carry them
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # by index, likewise


@dataclass(frozen=True, slots=True)
class Outputs:
    """One loop turn of the child's engine: its token items, then its other stream items (each request's last, and
    failures) in order, and its latest stats. A request's tokens all come before its last item: it makes none
    after it, and a request id is used again only once the client has had that item (the client refuses a
    duplicate of an open one)."""

    items: list[RequestOutput] = field(default_factory=list)
    stats: EngineStats | None = None
    tokens: TokenDeltas | None = None
    # the child's time.monotonic() as it sent them (the host's one clock): when the engine gave them, however late
    # the client reads them (`RequestStream.put`'s `at`)
    sent_s: float | None = None
