"""Runs one step (any mix of prefills and decodes) as a single packed forward over the paged cache.

The runner owns the model's forward (our decoder, or the HF modules' forward through `engine.attention`); the
backend owns the step's inputs and attention metadata (`prepare`) and how a step runs (`execute`: eager, or a
captured CUDA graph)."""
from __future__ import annotations

import torch

from core.request import Request
from engine.backends.base import Backend, PreparedStep, StepBatch, resolve_placeholders
from engine.decoder import KairosDecoder
from engine.kv_cache import KVCache


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
    def forward(self, step: PreparedStep, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n_requests, vocab] for the last token of each request, in `prefill + decode` order. Placeholder
        ids read the previous step's tokens from `prev_tokens` (`StepBatch`)."""
        ids = resolve_placeholders(step.input_ids, prev_tokens)
        if self.decoder is not None:
            return self.decoder(ids, step.positions, step.logit_rows, step.meta)
        out = self.model(input_ids=ids[None], position_ids=step.positions[None],
                         logits_to_keep=step.logit_rows, use_cache=False, kairos=step.meta)
        return out.logits[0]

    def execute(self, prefill: list[Request], decode: list[Request], ends: list[int] | None = None,
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.execute(self, StepBatch.of(prefill, decode, ends, prev_tokens))
