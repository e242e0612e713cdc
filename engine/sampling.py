"""Sampling parameters (plain data, validated) — the per-request knobs of an OpenAI/vLLM request."""
from __future__ import annotations

from dataclasses import dataclass, field


GREEDY_BELOW = 1e-5  # temperatures this small are greedy (dividing logits by them overflows)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature is None or not (self.temperature >= 0.0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is None or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1
