"""The sampler's masks, greedy choice and draws on hand-made logits, on torch's ops and on the CPU kernel's
`sample_rows`."""
import pytest
import torch

from core.request import Request
from core.sampling import SamplingParams
from engine.sampler import Sampler

EOS = 5


def _req(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=0.0, **params))


def test_min_tokens_masks_eos_and_stop_ids_of_its_rows_only():
    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"))
    logits = torch.zeros(4, 12)
    logits[:, EOS] = 3.0  # EOS is every row's favourite...
    logits[:, 7] = 2.0  # ...then a stop token id...
    logits[:, 2] = 1.0  # ...then a plain token
    logits[:, 11] = 9.0  # past the tokenizer's vocabulary: never drawn
    reqs = [
        _req("plain"),  # no min_tokens: EOS stays
        _req("min", min_tokens=2, max_tokens=4),  # EOS banned
        _req("min-stop", min_tokens=2, max_tokens=4, stop_token_ids=(7, 99)),  # EOS and 7 banned, 99 out of range
        _req("min-ignore-eos", min_tokens=2, max_tokens=4, ignore_eos=True),  # EOS banned too, as in vLLM
    ]
    assert s.sample(logits, reqs) == [EOS, 7, 2, 7]


def test_min_tokens_mask_lifts_once_reached():
    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"))
    r = _req("r", min_tokens=1, max_tokens=4)
    r.token_ids = [1, 2, 3, 4]  # one output token already
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 1.0
    assert s.sample(logits, [r]) == [EOS]


def test_logit_bias_moves_its_rows_tokens_greedy_and_sampled(draw):
    """OpenAI's logit_bias is added to the logits of its request's row only, before every path: -100 bans the
    favourite, +100 makes a token the greedy choice and, sampled, the only one drawn in practice."""
    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.zeros(4, 10)
    logits[:, 4] = 5.0
    logits[:, 2] = 4.0
    reqs = [_req("plain"), _req("ban", logit_bias={4: -100.0}), _req("force", logit_bias=((8, 100.0),)),
            Request("drawn", [1, 2, 3], SamplingParams(temperature=1.0, seed=7, logit_bias={3: 100.0, 4: -100}))]
    assert s.sample(logits, reqs) == [4, 2, 8, 3]
    assert reqs[1].params.logit_bias == ((4, -100.0),)  # a mapping is kept as sorted pairs
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101.0}).validate()
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 1.0}).validate()


def test_a_small_logit_bias_counts_on_bf16_logits():
    """bf16 logits (a GPU's) near 20 are 0.125 apart: a bias of 0.05 added in their dtype would round away; it is
    added in float32, so it breaks the tie it is meant to break (and the other rows keep their choice)."""
    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"))
    logits = torch.zeros(2, 10, dtype=torch.bfloat16)
    logits[:, 1] = logits[:, 2] = 20.0
    assert s.sample(logits.clone(), [_req("plain"), _req("nudged", logit_bias={2: 0.05})]) == [1, 2]


def _sampled(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params))


@pytest.fixture(params=["torch", "kernel"])
def draw(request):
    """The draw path: torch's ops, or the compiled CPU kernel (where it builds)."""
    if request.param == "torch":
        return None
    from engine.backends.cpu import kernels as cpu_kernels

    try:
        return cpu_kernels.load().sample_rows
    except cpu_kernels.KernelsUnavailable as e:
        pytest.skip(str(e))


def _counts(s: Sampler, logits: torch.Tensor, req: Request, n: int) -> torch.Tensor:
    """How often each token was drawn in n steps of a batch of 8 copies of one row."""
    counts = torch.zeros(logits.shape[-1])
    reqs = [req] * 8
    for _ in range(n // 8):
        for t in s.sample(logits.repeat(8, 1), reqs):
            counts[t] += 1
    return counts


def test_temperature_draws_follow_the_softmax(draw):
    torch.manual_seed(0)
    s = Sampler(vocab_limit=6, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    n = 16000
    for temp in (1.0, 0.5):
        counts = _counts(s, logits, _sampled("t", temperature=temp), n)
        want = torch.softmax(logits[0] / temp, -1) * n
        assert counts[4] == 0  # probability 0 (a banned or masked token) is never drawn
        assert torch.all((counts - want).abs() <= 5 * want.sqrt() + 1), (counts, want)


def test_top_p_keeps_the_smallest_nucleus_and_top_k_the_k_best(draw):
    torch.manual_seed(1)
    s = Sampler(vocab_limit=200, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    probs = torch.full((200,), 0.3 / 196)
    probs[[10, 20, 30, 40]] = torch.tensor([0.4, 0.2, 0.05, 0.05])  # 0.4, then 0.6, then 0.65
    logits = probs.log().unsqueeze(0)
    counts = _counts(s, logits, _sampled("p", temperature=1.0, top_p=0.58), 4000)
    assert set(counts.nonzero().flatten().tolist()) == {10, 20}  # 0.4 alone is short of 0.58: 20 completes it
    assert abs(counts[10] / counts.sum() - 2 / 3) < 0.04
    counts = _counts(s, logits, _sampled("p2", temperature=1.0, top_p=0.62), 4000)
    assert set(counts.nonzero().flatten().tolist()) <= {10, 20, 30, 40} and counts[30] + counts[40] > 0
    counts = _counts(s, logits, _sampled("k", temperature=1.0, top_k=2), 4000)
    assert set(counts.nonzero().flatten().tolist()) == {10, 20}
    counts = _counts(s, logits, _sampled("k3", temperature=1.0, top_k=3), 4000)  # a tie at the k-th: both stay
    assert set(counts.nonzero().flatten().tolist()) == {10, 20, 30, 40}
    # a nucleus larger than the first candidates (a flat row: top_p 0.85 needs 170 of 200 tokens)
    flat = torch.zeros(1, 200)
    counts = _counts(s, flat, _sampled("flat", temperature=1.0, top_p=0.85), 4000)
    assert int((counts > 0).sum()) in (170, 171)


def test_a_top_k_of_the_width_or_beyond_keeps_every_token(draw):
    """A client's top_k may be any integer (OpenAI-style clients send what they like; vLLM takes it): one at or past
    the vocabulary, however large, filters nothing, on every path, seeded draws the same as with top_k off."""
    s = Sampler(vocab_limit=50, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    wide = [_sampled(f"k{i}", temperature=1.0, seed=11, top_k=k) for i, k in enumerate((50, 10**6, 2**70))]
    off = [_sampled(f"o{i}", temperature=1.0, seed=11) for i in range(3)]
    assert s.sample(logits, wide) == s.sample(logits, off)


def test_seeded_rows_repeat_and_a_bad_row_fails_alone(draw):
    s = Sampler(vocab_limit=50, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    logits[2, 7] = float("nan")

    def run():
        s.release("a"), s.release("b"), s.release("c")
        reqs = [_sampled("a", temperature=1.0, seed=11), _sampled("b", temperature=0.7, top_p=0.8, seed=12),
                _sampled("c", temperature=1.0, seed=13)]
        return [s.sample(logits.clone(), reqs) for _ in range(20)]
    first, again = run(), run()
    assert [o[:2] for o in first] == [o[:2] for o in again]
    assert len({o[0] for o in first}) > 1  # it does draw, not take the maximum
    assert all(isinstance(o[2], RuntimeError) for o in first)  # the NaN row fails, the others do not


def test_seeds_that_share_their_low_32_bits_draw_different_tokens(draw):
    """Torch's CPU generator keys on a seed's low 32 bits: -1 and 2**63 - 1 (or s and s + 2**32) drew alike."""
    from engine.sampler import generator_seed

    s = Sampler(vocab_limit=1000, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.zeros(1, 1000)

    def tokens(rid: str, seed: int) -> list:
        s.release(rid)
        return [s.sample(logits.clone(), [_sampled(rid, temperature=1.0, seed=seed)])[0] for _ in range(8)]
    for a, b in ((-1, 2**63 - 1), (-5, 2**63 - 5), (-(2**63), 0), (7, 2**32 + 7)):
        assert tokens("a", a) != tokens("b", b), (a, b)
    assert tokens("c", -1) == tokens("d", -1)  # still a seed: the same one draws the same
    assert [generator_seed(x) for x in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]  # the usual seeds keep their streams
    assert all(0 <= generator_seed(x) < 2**32 for x in (-1, -(2**63), 2**32, 2**63 - 1))


def test_nucleus_of_a_flat_row_is_the_sorted_prefix():
    """`_nucleus` (a row whose nucleus is too wide for the top-k candidates) keeps what a full sort would."""
    from engine.sampler import _nucleus

    g = torch.Generator().manual_seed(5)
    for top_p in (0.3, 0.9, 0.999):
        p = torch.softmax(torch.randn(5000, generator=g) * 0.2, -1)
        vals, idx = torch.sort(p, descending=True)
        cum = torch.cumsum(vals.double(), 0)
        ref = torch.zeros(5000, dtype=torch.bool)
        ref[idx[(cum - vals.double()) < top_p]] = True
        assert torch.equal(_nucleus(p, top_p), ref), top_p
