"""A request's plain state and its SLO. The scheduler owns every `Request` it holds and is the only party that
changes one: queue state, KV blocks, tokens, timestamps. The engine keeps its own per-request helpers (stream,
detokenizer, sampler RNG) in its own tables, keyed by request id."""
from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field

from core.sampling import SamplingParams

MAX_SLO_MS = 3_600_000.0  # an SLO above one hour is a client bug, not best effort
MAX_OUTPUT_LEN_HINT = 1_000_000


OUTLOOK_RATIO = 1.15  # the grid of a predicted length outlook: entry i is E[len | len > OUTLOOK_RATIO ** i]
_OUTLOOK_GRID = tuple(OUTLOOK_RATIO ** i for i in range(200))  # past any reply length


def outlook_entry(outlook: tuple[float, ...], num_output_tokens: int) -> tuple[float, float]:
    """For a reply k >= 1 tokens long: its outlook's entry of the largest grid length below k, and the longest reply
    that entry holds for (+inf past the outlook's last entry)."""
    j = bisect.bisect_left(_OUTLOOK_GRID, num_output_tokens)  # grid[j - 1] < k <= grid[j]
    i = max(0, j - 1)
    if i >= len(outlook) - 1 or j >= len(_OUTLOOK_GRID):
        return outlook[-1], math.inf
    return outlook[i], float(math.floor(_OUTLOOK_GRID[j]))


def outlook_at(outlook: tuple[float, ...], num_output_tokens: int) -> float:
    """The expected length of a reply `num_output_tokens` long by now, from its predicted outlook (scheduling.
    length_predictor.LengthPredictor.outlook): the entry of the largest grid length below it, at least one more
    token."""
    k = num_output_tokens
    if k < 1:
        return outlook[0]
    return max(outlook_entry(outlook, k)[0], k + 1.0)


def outlook_from(outlook: tuple[float, ...], min_tokens: int) -> tuple[float, ...]:
    """The outlook of a reply that will be at least `min_tokens` long (its request's min_tokens): the entries for
    fewer tokens out take that length's (`outlook_at`), the others stay."""
    if min_tokens < 1:
        return outlook
    at = outlook_at(outlook, min_tokens)
    return tuple(at if g < min_tokens else e for g, e in zip(_OUTLOOK_GRID, outlook))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    REJECTED = "rejected"
    ERROR = "error"


def check_slo_value(name: str, v: float | int | None, integer: bool = False) -> float | int | None:
    """Validate one SLO value (ms, or the output-length hint with `integer`); ValueError with a client-facing
    message. Returns it as float (int for the hint)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    limit = MAX_OUTPUT_LEN_HINT if integer else MAX_SLO_MS
    if v > limit:
        raise ValueError(f"{name} must be <= {limit:g}, got {v!r}")
    if integer:
        if int(v) != v:
            raise ValueError(f"{name} must be an integer, got {v!r}")
        return int(v)
    return float(v)


@dataclass(frozen=True, slots=True)
class LoraSource:
    """Where a LoRA adapter loaded at run time (vLLM's /v1/load_lora_adapter) is, and which load of it: the engine
    loads the folder at the first request that brings it, and again for a later `version` (`load_inplace`)."""
    path: str
    version: int = 1


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency objectives. None means best effort (never rejected for SLO reasons)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    output_len_hint: int | None = None

    def validate(self) -> "SLO":
        """The one set of limits, wherever an SLO enters (HTTP header, body, in-process call)."""
        check_slo_value("ttft_ms", self.ttft_ms)
        check_slo_value("tpot_ms", self.tpot_ms)
        check_slo_value("output_len_hint", self.output_len_hint, integer=True)
        return self

    @property
    def tier(self) -> str:
        """A label for metrics: the SLOs the request carries, e.g. `ttft500_tpot50`, `ttft80_tpot1.5`, `tpot20` (an SLO
        it does not carry is left out), or `best_effort`."""
        parts = [f"{name}{v:g}" for name, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms)) if v is not None]
        return "_".join(parts) or "best_effort"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    slo: SLO = field(default_factory=SLO)
    arrival_s: float = 0.0
    # token state: token_ids = prompt + output; KV of the first num_computed_tokens is cached
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # prefix caching (the scheduler's BlockManager): while it waits, the cached blocks it could start with, the tokens
    # they spare it and the cache's count of blocks ever cached when they were looked up; once admitted, how many it
    # found cached, the cached block its next full block follows (None: it caches no more) and how many of its blocks
    # are cached or were shared; and the prompt tokens its first admission found cached (usage)
    prefix_nodes: list = field(default_factory=list, repr=False)
    prefix_hit: int = 0
    prefix_seen: int | None = None
    num_shared: int = 0
    cache_tail: object | None = field(default=None, repr=False)
    num_registered: int = 0
    num_cached_tokens: int = 0
    # scheduling state
    credit: float = 0.0
    num_preemptions: int = 0
    # what the length predictor reads where it is not the prompt: a chat request's last user message alone (its
    # prompt is the conversation in the chat template, the predictor was trained on a turn's own text); set by the
    # input processor
    question_ids: list[int] | None = None
    # where asked (`GenerateRequest.read_thinking`), where its prompt leaves a reasoning model's thinking
    # (`InputProcessor.prompt_thinking`), for its stream's first item
    prompt_thinking: str | None = None
    # the reply length the scheduler's length predictor expects (scheduling/length_predictor.py; set at add)
    predicted_len: int | None = None
    # with it, the length expected once the reply has output some tokens (`outlook_at`: the predicted distribution's
    # mean above them, of the reply its max_tokens may cut); None: predicted_len throughout, and once outlived, one
    # more token
    length_outlook: tuple[float, ...] | None = None
    # the reply length the VBS gate admits a fresh request against where it is not the expected one: a conservative
    # quantile of the predicted distribution (SchedulerConfig.length_gate_quantile; set at add)
    gate_len: int | None = None
    # the predicted mean (within max_tokens) over the served replies' calibration scale (scheduling.length_predictor.
    # LengthCalibration, which compares the reply with it when it ends; set at add)
    length_base: float | None = None
    # vLLM's bad_words as token ids (`SamplingParams.bad_words`, tokenized by the input processor): each sequence's
    # last token may not be drawn where the reply ends with the rest of it
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # the LoRA adapter its tokens run through (engine.lora): its name (None: the base model) and the id of its load,
    # which the engine sets as it takes the request; and vLLM's cache_salt. A prompt's cached prefix is shared only
    # between requests of the same adapter load and salt
    lora: str | None = None
    lora_id: int = 0
    cache_salt: str | None = None
    lora_source: LoraSource | None = None  # a run-time adapter's (None: one of lora_modules or on demand)
    # vLLM's request priority: with SchedulerConfig.scheduling_policy "priority" a lower value is served first
    # (waiting order, admission, and the last preempted); 0 elsewhere
    priority: int = 0
    # BENCHMARK ONLY: end the reply after this many tokens (finish reason "length"), as a reply of that length
    # would end. Honoured only by the scheduler's finish check and only with SchedulerConfig.bench_stop (off in
    # serving), and settable only in-process (no HTTP field reaches it); no policy reads it, so it hides the
    # reply's length from the scheduler (bench.slo --lengths hidden|predicted)
    bench_stop_after: int | None = None
    # while it has no token: when it was last admitted, the prefill time the TTFT guard predicted for it then (ms;
    # ttft_guard.MeasuredMargin measures the difference to its first token), and whether it was admitted alone (first
    # of its round, nothing running)
    ttft_estimate: tuple[float, float, bool] | None = None
    # expected_output_len's last answer and what it was computed from: (tokens, predicted_len, length_outlook, length,
    # and with an outlook its entry and the most tokens it holds for: `outlook_entry`)
    _expected: tuple[int, int | None, tuple[float, ...] | None, int, float, float] | None = field(default=None,
                                                                                                   repr=False)
    # timestamps (time.monotonic seconds)
    admitted_s: float | None = None
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    # the TPOT SLO in ms, +inf for best effort: `slo.tpot_ms` as the scheduler reads it, many times a step (the SLO
    # is frozen and a request's own from construction, so it is kept as a plain value)
    tpot_slo_ms: float = field(init=False, default=math.inf)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.tpot_slo_ms = math.inf if self.slo.tpot_ms is None else self.slo.tpot_ms

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def deadline_s(self) -> float:
        """Absolute TTFT deadline (arrival + TTFT SLO); +inf for best effort."""
        return math.inf if self.slo.ttft_ms is None else self.arrival_s + self.slo.ttft_ms / 1000.0

    @property
    def gate_output_len(self) -> int:
        """The reply length admission (the VBS gate) plans for: `gate_len` where set and no hint is given (a
        conservative quantile: never below `expected_output_len`, which follows the reply as it outlives the
        quantile; capped by max_tokens), else `expected_output_len`."""
        expected = self.expected_output_len
        if self.gate_len is not None and not self.slo.output_len_hint:
            return min(max(self.gate_len, expected), self.params.max_tokens)
        return expected

    @property
    def expected_output_len(self) -> int:
        """The reply length the scheduler plans for: the client's hint (at least min_tokens and one more token than
        out so far; max_tokens where only that ends the reply), else the predicted length (with an outlook,
        the predicted distribution's mean above what the reply has output so far; without, at least one more
        token than that), else max_tokens; never above max_tokens. Kept until its inputs change (the scheduler
        reads it many times a step: ordering, shedding, the gate, catch-up)."""
        n, memo = len(self.token_ids), self._expected
        if memo is not None and memo[1] == self.predicted_len and memo[2] is self.length_outlook:
            if memo[0] == n:
                return memo[3]
            k = n - len(self.prompt_token_ids)
            if memo[0] < n and k <= memo[5]:  # more tokens, the same outlook entry (a reply's tokens only grow)
                out = min(int(max(memo[4], k + 1.0)), self.params.max_tokens)
                self._expected = (n, memo[1], memo[2], out, memo[4], memo[5])
                return out
        cap = self.params.max_tokens
        hint = self.slo.output_len_hint
        entry, upto = 0.0, -math.inf  # the outlook entry in use, and the most tokens out it holds for
        if hint:  # (a reply that only its cap ends is that long whatever the hint; none ends before min_tokens)
            k = n - len(self.prompt_token_ids)
            out = cap if self.params.runs_to_cap else min(max(hint, self.params.min_tokens, k + 1), cap)
        elif self.predicted_len is not None:
            k = n - len(self.prompt_token_ids)
            if self.length_outlook is not None and k > 0:
                entry, upto = outlook_entry(self.length_outlook, k)
                out = min(int(max(entry, k + 1.0)), cap)  # outlook_at
            else:
                out = min(max(self.predicted_len, k + 1), cap)
        else:
            out = cap
        self._expected = (n, self.predicted_len, self.length_outlook, out, entry, upto)
        return out
