"""Runs one step (any mix of prefills and decodes) as a single packed forward over the paged cache.

The runner owns the model's forward (our decoder, or the HF modules' forward through `engine.attention`); the
backend owns the step's inputs and attention metadata (`prepare`) and how a step runs (`execute`: eager, or a
captured CUDA graph)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from core.request import Request
from engine.backends.base import Backend, PreparedStep, StepBatch, resolve_placeholders
from engine.decoder import KairosDecoder
from engine.kv_cache import KVCache


@dataclass(slots=True)
class PromptLogits:
    """A step's output where it has prompt rows (`PreparedStep.prompt_rows`): the sampled rows' logits, and the
    prompt rows as their logits or, with our decoder, as their last hidden states with the head that makes their
    logits, so that a long prompt's logits are made a few rows at a time (`rows`), not all at once."""
    sampled: torch.Tensor
    prompt: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.sampled.device

    def rows(self, a: int, b: int) -> torch.Tensor:
        """The logits of prompt rows [a, b)."""
        return self.prompt[a:b] if self.head is None else self.head(self.prompt[a:b])


class ModelRunner:
    """Runs a step with `KairosDecoder` when given one (Llama-family models), else with the HF forward."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: Backend,
                 decoder: KairosDecoder | None = None) -> None:
        self.model = model
        self.decoder = decoder
        self.backend = backend
        self.cache = cache
        self.device = backend.device
        self.block_size = cache.block_size

    def prepare(self, prefill: list[Request], decode: list[Request], ends: list[int] | None = None) -> PreparedStep:
        """The step's inputs: each prefill computes its positions [num_computed_tokens, end) (`ends`, default its
        num_tokens) and has an output row only if it reaches its num_tokens; each decode its last token."""
        return self.backend.prepare(StepBatch.of(prefill, decode, ends))

    @torch.inference_mode()
    def forward(self, step: PreparedStep, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | PromptLogits:
        """Logits [n_requests, vocab] for the last token of each request, in `prefill + decode` order (a step with
        prompt rows: `PromptLogits`). Placeholder ids read the previous step's tokens from `prev_tokens`
        (`StepBatch`)."""
        ids = resolve_placeholders(step.input_ids, prev_tokens)
        k = step.prompt_rows
        if self.decoder is not None:
            if not k:
                return self.decoder(ids, step.positions, step.logit_rows, step.meta)
            h, rows = self.decoder(ids, step.positions, None, step.meta), step.logit_rows
            n = rows.numel() - k
            return PromptLogits(self.decoder.head(h.index_select(0, rows[:n])), h.index_select(0, rows[n:]),
                                self.decoder.head)
        out = self.model(input_ids=ids[None], position_ids=step.positions[None],
                         logits_to_keep=step.logit_rows, use_cache=False, kairos=step.meta)
        logits = out.logits[0]
        return PromptLogits(logits[:-k], logits[-k:]) if k else logits

    def execute(self, prefill: list[Request], decode: list[Request], ends: list[int] | None = None,
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.execute(self, StepBatch.of(prefill, decode, ends, prev_tokens))
