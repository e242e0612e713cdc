"""engine.backends.cuda.sampling compiled on a GPU at the Llama-3 vocabulary (128,256) and batch 128: flat rows (a
random-weight model's) and peaked ones, every draw in the exact nucleus of `engine.sampler`, and the draw captured in
a CUDA graph (it reads no value on the host). Skipped without CUDA; `KAIROS_GPU_TESTS_ON_CPU=1` with
`TRITON_INTERPRET=1` dry-runs it on the CPU at a reduced size."""
from __future__ import annotations

import pytest
import torch

from tests.paged_attention_reference import triton_device_or_skip

ON_CUDA, DEV = triton_device_or_skip("top-p sampling kernel")

from engine.backends.cuda import sampling  # noqa: E402
from engine.sampler import _nucleus_keys  # noqa: E402

VOCAB, BATCH = (128256, 128) if ON_CUDA else (3000, 8)


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = torch.linspace(0.01, 6.0, BATCH, device=DEV).unsqueeze(1)  # flat rows first, peaked last
    probs = torch.softmax(torch.randn(BATCH, VOCAB, device=DEV, generator=g) * scale, -1)
    top_p = torch.rand(BATCH, device=DEV, generator=g) * 0.95 + 0.04
    return probs, top_p


def test_draws_lie_in_the_exact_nucleus_at_the_8b_vocabulary():
    probs, top_p = _rows(0)
    mask = probs.view(torch.int32) >= _nucleus_keys(probs, top_p)
    for seed in range(3):
        u = torch.rand(BATCH, sampling.ROUNDS, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
        tok = sampling.top_p_draw(probs, top_p, u, probs.sum(-1))
        assert bool(mask[torch.arange(BATCH, device=DEV), tok].all())


def test_the_draw_replays_from_a_cuda_graph():
    if not ON_CUDA:
        pytest.skip("CUDA graphs need a GPU")
    probs, top_p = _rows(1)
    u = torch.rand(BATCH, sampling.ROUNDS, device=DEV)
    total = probs.sum(-1)
    want = sampling.top_p_draw(probs, top_p, u, total)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.top_p_draw(probs, top_p, u, total)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
