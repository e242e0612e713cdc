"""Our attention function over the paged KV cache, registered with transformers' AttentionInterface, for models that
run through the HF forward (`model_impl=hf`, or families our decoder does not cover).

The model is called on one packed sequence [1, T]: first the tokens of every prefill (or chunk), then one token per
decoding request. Each layer hands its query and new K/V to the backend's `attend` (`engine.backends.base.Backend`),
which writes the K/V into the cache and attends over it, as it does for our own decoder.

Registered with transformers (`register`) only where a model is loaded with `from_pretrained`: importing its
attention interface imports its modeling code, which a model our decoder runs never needs (`engine.own_model`).
"""
from __future__ import annotations

import torch

from engine.backends.base import AttnMetadata

ATTN_NAME = "kairos_paged"


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    kairos: AttnMetadata | None = None, softcap: float | None = None,
                    **_: object) -> tuple[torch.Tensor, None]:
    """The HF attention interface over the backend's `attend`: query [1, H, T, hd], key/value [1, kvh, T, hd]. A
    logit softcap (Gemma 2's) is refused, not dropped: the kernels do not cap (a sliding window HF passes is the
    loader's, which caps the context at it)."""
    if softcap is not None:
        raise NotImplementedError(f"kairos_paged attention has no logit softcapping (the model asks {softcap})")
    if kairos is None:
        raise RuntimeError("kairos_paged attention needs the `kairos` metadata kwarg (use the engine's runner)")
    out = kairos.backend.attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                value[0].transpose(0, 1), kairos, scaling)
    return out.unsqueeze(0), None


def register() -> None:
    """`ATTN_NAME` known to transformers' attention interface (before a model naming it is built)."""
    from transformers import AttentionInterface  # noqa: PLC0415 - imports transformers' modeling code

    AttentionInterface.register(ATTN_NAME, paged_attention)
