"""One state object per request, owned by the engine's worker thread (no torch here)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    REJECTED = "rejected"
    ERROR = "error"


@dataclass(slots=True)
class SLO:
    """Per-request latency objectives. None means best effort (never rejected for SLO reasons)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    output_len_hint: int | None = None

    def validate(self) -> "SLO":
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if v is not None and not (0.0 < v < 1e9):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {v!r}")
        if self.output_len_hint is not None and not (0 < self.output_len_hint < 10_000_000):
            raise ValueError(f"output_len_hint must be a positive integer, got {self.output_len_hint!r}")
        return self

    @property
    def tier(self) -> str:
        """A coarse label for metrics: which SLOs the request carries."""
        if self.ttft_ms is None and self.tpot_ms is None:
            return "best_effort"
        return f"ttft{'' if self.ttft_ms is None else int(self.ttft_ms)}_tpot{'' if self.tpot_ms is None else int(self.tpot_ms)}"


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
    # scheduling state
    credit: float = 0.0
    num_preemptions: int = 0
    # timestamps (time.monotonic seconds)
    admitted_s: float | None = None
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # per-request helpers owned by the engine (stream sink, detokenizer, sampler RNG)
    stream: Any = None
    detok: Any = None
    generator: Any = None
    text: str = ""
    emitted_chars: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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
    def tpot_slo_ms(self) -> float:
        return math.inf if self.slo.tpot_ms is None else self.slo.tpot_ms

    @property
    def expected_output_len(self) -> int:
        hint = self.slo.output_len_hint
        return min(hint, self.params.max_tokens) if hint else self.params.max_tokens
