"""engine.backends.cuda.sampling (top-p draws on the device with no host sync) on CPU tensors through Triton's
interpreter: every draw lies in the row's nucleus as `engine.sampler`'s exact search defines it (ties at the cut kept
in), draws follow the renormalised nucleus, zero-probability tokens are never drawn, flat rows with a small top_p
still end (tests/test_cuda_fused.py compiles it for Hopper with the fused ops). The CUDA backend's sampler uses it (the end-to-end
sampled tests of tests/test_backends.py and tests/gpu run through it)."""
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a GPU is present: tests/gpu runs the sampler compiled", allow_module_level=True)
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton); the CUDA backend's kernels need it")
import triton.language as tl  # noqa: E402

if type(tl.cdiv).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

from tests.paged_attention_reference import patch_interpreter_for_numpy  # noqa: E402

patch_interpreter_for_numpy()
from engine.backends.cuda import sampling  # noqa: E402
from engine.sampler import _nucleus_keys  # noqa: E402


def _draw(probs, top_p, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(probs.shape[0], sampling.ROUNDS, generator=g)
    return sampling.top_p_draw(probs, top_p, u, probs.sum(-1))


def _nucleus(probs, top_p):
    """The exact nucleus masks of `engine.sampler` (float-bit bisection)."""
    return probs.view(torch.int32) >= _nucleus_keys(probs, top_p)


def test_every_draw_lies_in_the_exact_nucleus():
    torch.manual_seed(0)
    scales = torch.tensor([0.05, 0.5, 1.0, 3.0, 8.0, 0.2, 2.0, 1.0])
    probs = torch.softmax(torch.randn(8, 700) * scales.unsqueeze(1), -1)
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95, 0.9, 0.05, 0.3, 0.999])
    mask = _nucleus(probs, top_p)
    for seed in range(4):
        tok = _draw(probs, top_p, seed)
        assert mask[torch.arange(8), tok].all(), tok


def test_draws_follow_the_renormalised_nucleus_and_ties_at_the_cut_stay_in():
    """Many rows of one distribution (one draw each): the frequencies are the nucleus's renormalised probabilities.
    The cut falls inside a tie (p = 0.1 x 4, top_p = 0.75: 0.3 + 0.2 + 0.1 = 0.6 < 0.75, so every 0.1 token is in),
    tokens of zero probability (a top-k cut) are never drawn."""
    p = torch.tensor([0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])
    n = 300
    probs = p.repeat(n, 1)
    tok = _draw(probs, torch.full((n,), 0.75), seed=1)
    counts = torch.bincount(tok, minlength=10).double()
    want = torch.where(torch.arange(10) < 6, p.double(), 0.0)
    want = want / want.sum() * n
    assert counts[6:].sum() == 0
    sigma = (want * (1 - want / n)).sqrt().clamp(min=1.0)
    assert ((counts - want).abs() <= 4 * sigma).all(), (counts, want)


def test_a_flat_row_with_a_small_top_p_ends_in_its_nucleus():
    """A random-weight model's rows are nearly flat: the nucleus of top_p 0.05 is a few hundred of thousands of
    tokens, found in a few rounds (each rejection raises the pivot)."""
    torch.manual_seed(2)
    probs = torch.softmax(torch.randn(3, 6000) * 0.02, -1)
    top_p = torch.tensor([0.05, 0.5, 0.9])
    tok = _draw(probs, top_p, seed=3)
    assert _nucleus(probs, top_p)[torch.arange(3), tok].all()


def test_no_rounds_left_takes_the_most_likely_token():
    probs = torch.softmax(torch.randn(4, 300) * 0.01, -1)
    u = torch.full((4, 1), 0.999)  # one round, a draw far down a flat row: rejected for top_p 0.01
    tok = sampling.top_p_draw(probs, torch.full((4,), 0.01), u, probs.sum(-1))
    assert torch.equal(tok, probs.max(-1).indices)


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """The API takes any top_p > 0: one below fp32's smallest number is 0 there, and keeps the most likely token (the
    kernel never reads before its row)."""
    probs = torch.softmax(torch.randn(3, 400), -1)
    tok = _draw(probs, torch.tensor([1e-46, 1e-46, 1e-46], dtype=torch.float64).float())
    assert torch.equal(tok, probs.max(-1).indices)
