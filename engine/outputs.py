"""What a request's stream yields: plain dataclasses, picklable across Ray."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_s: float
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float | None
    token_times: list[float] = field(default_factory=list)

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


@dataclass(slots=True)
class RequestOutput:
    """One stream item. `text`/`token_ids` are the delta since the previous item."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | rejected | error
    reject_reason: str | None = None  # ttft_unattainable | tpot_unattainable | overloaded
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None  # set on the final item
