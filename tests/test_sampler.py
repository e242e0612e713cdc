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


def test_a_tiny_positive_temperature_samples_at_vllms_floor(draw):
    """vLLM raises a positive temperature below 0.01 to 0.01 (0 alone is greedy): two logits 0.01 apart are both
    drawn at 1e-6 (a greedy row would always take the first), in the softmax's share at 0.01."""
    assert SamplingParams(temperature=1e-6).temperature == 0.01 and not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5).temperature == 0.5
    torch.manual_seed(2)
    s = Sampler(vocab_limit=6, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.tensor([[1.01, 1.0, -5.0, -5.0, -5.0, -5.0]])
    n = 4000
    counts = _counts(s, logits, _sampled("tiny", temperature=1e-6), n)
    want = torch.softmax(logits[0] / 0.01, -1) * n
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


def test_a_seeded_rows_draws_do_not_depend_on_its_neighbours_parameters(draw):
    """A seeded top-p row draws the same tokens alone and beside a min_p row or a greedy one: on the CPU kernel's
    path a min_p row sent the whole batch to torch's draw, whose order differs (the same uniform, another token)."""
    s = Sampler(vocab_limit=1000, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))

    def run(*beside: Request) -> list:
        s.release("a")
        return [s.sample(logits[:1 + len(beside)].clone(), [_sampled("a", temperature=1.0, top_p=0.9, seed=42),
                                                            *beside])[0] for _ in range(10)]
    alone = run()
    assert run(_sampled("b", temperature=1.0, min_p=0.01)) == alone
    assert run(_req("g"), _sampled("b", temperature=1.0, min_p=0.01)) == alone


def test_seeds_that_share_their_low_32_bits_draw_different_tokens(draw):
    """Torch's CPU generator keys on a seed's low 32 bits: -1 and 2**63 - 1 (or s and s + 2**32) drew alike."""
    from engine.sampler import generator_seed

    s = Sampler(vocab_limit=1000, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.zeros(1, 1000)

    def tokens(rid: str, seed: int) -> list:
        s.release(rid)
        return [s.sample(logits.clone(), [_sampled(rid, temperature=1.0, seed=seed)])[0] for _ in range(8)]
    for a, b in ((-2, 2**63 - 2), (-5, 2**63 - 5), (-(2**63), 0), (7, 2**32 + 7)):
        assert tokens("a", a) != tokens("b", b), (a, b)
    assert tokens("c", -2) == tokens("d", -2)  # still a seed: the same one draws the same
    assert [generator_seed(x) for x in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]  # the usual seeds keep their streams
    assert all(0 <= generator_seed(x) < 2**32 for x in (-1, -(2**63), 2**32, 2**63 - 1))


def test_a_seed_of_minus_one_asks_for_none_as_in_vllm():
    """vLLM's API reads seed -1 as no seed (clients send it for "random"): each request draws anew. A seeded
    request's choices keep seed + j, -1 among them, through the engine's own copies of their params."""
    import dataclasses

    from deployments import protocol as P
    from deployments.ingress import child_params

    def params(body: dict) -> SamplingParams:
        req = P.CompletionRequest.model_validate({"prompt": "hi", **body})
        return SamplingParams(**req.sampling_kwargs(req.default_max_tokens(), {}))

    assert params({"seed": -1}).seed is None and params({"seed": -2}).seed == -2
    assert [child_params(params({"seed": -2}), j).seed for j in range(3)] == [-2, -1, 0]
    assert dataclasses.replace(child_params(params({"seed": -2}), 1), max_tokens=5).seed == -1
    s = Sampler(vocab_limit=1000, eos_token_ids=[EOS], device=torch.device("cpu"))
    logits = torch.zeros(1, 1000)
    draws = [[s.sample(logits.clone(), [Request(rid, [1, 2, 3], params({"seed": -1, "temperature": 1.0}))])[0]
              for _ in range(12)] for rid in ("a", "b")]
    assert draws[0] != draws[1]  # (one in 1000**12 alike by chance)


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


def _penalized_ref(logits: torch.Tensor, prompt: list[int], reply: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties, one token at a time: repetition over the prompt and the reply, then frequency and presence
    over the reply."""
    x = logits.clone()
    for t in (set(prompt) | set(reply)) & set(range(len(x))):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(reply):
        x[t] -= p.frequency_penalty * reply.count(t) + p.presence_penalty
    return x


@pytest.mark.parametrize("sparse", [True, False])
def test_penalties_are_vllms_on_their_rows_only_and_count_each_token_once(sparse):
    """Presence, frequency and repetition penalties change exactly the logits vLLM's formula does, for their rows
    only (greedy ones too; tokens past the vocabulary count for nothing); the counts a request's slot keeps across
    steps hold each reply token once, whether a plan was drawn twice (a step re-drawn request by request), planned
    again before the last draw, or never drawn (a step that failed); a released slot starts clean for its next
    request. On the seen tokens alone (a CPU's way) and on whole rows (a GPU's)."""
    from engine.sampler import PenaltyCounts

    g = torch.Generator().manual_seed(3)
    s = Sampler(vocab_limit=12, eos_token_ids=[EOS], device=torch.device("cpu"))
    s._penalties.sparse = sparse
    pen = SamplingParams(temperature=0.0, max_tokens=50, repetition_penalty=1.7, presence_penalty=0.6,
                         frequency_penalty=-0.4)
    a = Request("a", [1, 2, 2, 13], pen)  # 13: past the vocabulary
    b = Request("b", [3, 4], SamplingParams(temperature=0.0, max_tokens=50))  # no penalty
    c = Request("c", [7], SamplingParams(temperature=1.0, seed=1, max_tokens=50, presence_penalty=2.0))
    for step in range(6):
        logits = torch.randn(3, 14, generator=g)
        want = logits.clone()[:, :12]
        for i, r in ((0, a), (2, c)):
            want[i] = _penalized_ref(logits[i, :12], r.prompt_token_ids, r.token_ids[r.num_prompt_tokens:], r.params)
        d = s.plan([a, b, c])
        if step == 2:
            s.plan([a, b, c])  # planned again before it is drawn: nothing counted twice
        if step == 3:
            continue  # never drawn: the next step's draw counts what this one would have
        got = logits.clone()[:, :12]
        s._penalties.apply(got, d.reqs, d.penalized, None)
        assert torch.allclose(got, want), (step, got, want)
        again = logits.clone()[:, :12]
        s._penalties.apply(again, d.reqs, d.penalized, None)  # drawn again: the same logits
        assert torch.allclose(again, want)
        for r in (a, b, c):
            r.token_ids.append(int(torch.randint(0, 12, (1,), generator=g)) if step % 2 else 2)
    # greedy on the penalized logits: a negative frequency penalty draws the reply's most frequent token back
    want = _penalized_ref(torch.zeros(12), a.prompt_token_ids, a.token_ids[a.num_prompt_tokens:], pen)
    assert s.sample(torch.zeros(1, 12), [a]) == [int(want.argmax())] == [2]
    s.release("a")
    fresh = Request("d", [5], pen)
    logits = torch.randn(1, 12, generator=g)
    got = logits.clone()
    d = s.plan([fresh])
    assert d.penalized[0].slot == 0  # a's slot, reused
    s._penalties.apply(got, d.reqs, d.penalized, None)
    assert torch.allclose(got[0], _penalized_ref(logits[0], [5], [], pen))
    assert isinstance(s._penalties, PenaltyCounts)


@pytest.mark.parametrize("sparse", [True, False])
def test_a_repetition_penalty_near_zero_leaves_finite_logits_and_a_draw(sparse):
    """A repetition penalty of the smallest positive float divides a seen token's positive logit past float32's
    range: it stays the largest finite logit (found by a fuzzer: its infinity made the row's probabilities NaN and
    failed the whole step), so the row draws that token, greedy or sampled."""
    s = Sampler(vocab_limit=8, eos_token_ids=[EOS], device=torch.device("cpu"))
    s._penalties.sparse = sparse
    for temperature in (0.0, 1.0, 0.7, 2e-5):
        r = Request("r", [3, 5], SamplingParams(temperature=temperature, seed=1, max_tokens=4,
                                                repetition_penalty=5e-324))
        logits = torch.full((1, 8), -1.0)
        logits[0, 3] = 2.0
        assert s.sample(logits, [r]) == [3]
        s.release("r")


@pytest.mark.parametrize("sparse", [True, False])
def test_a_penalized_rows_token_still_on_its_way_counts_from_the_step_befores_tokens(sparse):
    """Overlap scheduling: a reply's last token is a placeholder (-(its row + 1) in the step before) when the next
    step is planned; the draw counts it from that step's tokens, and the next plan, which sees it, not again."""
    from engine.sampler import SampledTokens

    s = Sampler(vocab_limit=10, eos_token_ids=[EOS], device=torch.device("cpu"))
    s._penalties.sparse = sparse
    p = SamplingParams(temperature=0.0, max_tokens=50, frequency_penalty=1.0)
    r = Request("r", [1], p)
    r.token_ids += [4, -2]  # its second reply token is row 1 of the step in flight
    prev = SampledTokens([8, 6, 9])
    d = s.plan([r], prev=prev)
    assert d.penalized[0].pending_row == 1 and d.penalized[0].tokens == (4,)
    got = torch.zeros(1, 10)
    s._penalties.apply(got, d.reqs, d.penalized, d.prev)
    assert got[0].tolist() == [0, 0, 0, 0, -1, 0, -1, 0, 0, 0]
    r.token_ids[-1] = 6  # resolved
    d = s.plan([r])
    got = torch.zeros(1, 10)
    s._penalties.apply(got, d.reqs, d.penalized, d.prev)
    assert got[0].tolist() == [0, 0, 0, 0, -1, 0, -1, 0, 0, 0]
    assert d.row(0).penalized == d.penalized


def test_min_p_keeps_the_tokens_near_the_likeliest(draw):
    """min_p (vLLM's): only tokens with at least min_p x the likeliest one's probability are drawn, after the
    temperature; 0 keeps them all. The CPU kernel, which has no min_p, leaves those rows to torch's ops."""
    torch.manual_seed(2)
    s = Sampler(vocab_limit=6, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.04, 0.01]]))
    n = 4000
    counts = _counts(s, logits, _sampled("m", temperature=1.0, min_p=0.3), n)
    assert counts[3:].sum() == 0 and counts[:3].sum() == n  # 0.1 < 0.3 x 0.4
    want = torch.tensor([0.4, 0.3, 0.15]) / 0.85 * n
    assert torch.all((counts[:3] - want).abs() <= 5 * want.sqrt() + 1), (counts, want)
    counts = _counts(s, logits, _sampled("h", temperature=2.0, min_p=0.35), n)  # flatter: 0.1 kept, 0.04 not
    assert counts[4:].sum() == 0 and counts[3] > 0
    assert (_counts(s, logits, _sampled("z", temperature=1.0, min_p=0.0), n) > 0).all()  # 0: every token stays


@pytest.mark.parametrize("bad,match", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=True), "presence_penalty")])
def test_penalties_and_min_p_out_of_range_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad).validate()
    assert not SamplingParams(repetition_penalty=1.0, min_p=0.5).penalized
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=3.0).validate().penalized


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_logprobs_are_the_raw_distributions_of_their_rows_only(path):
    """Rows that ask for logprobs get, for the token drawn, its log-probability under the logits as given (before
    min_tokens' bans, logit_bias, penalties or temperature), its rank, and the k likeliest tokens; other rows get
    none. On both paths: torch's ops on the logits' device (a GPU's), and the CPU kernels' host calls."""
    from engine.backends.cpu import kernels as cpu_kernels

    kw = {}
    if path == "kernels":
        try:
            k = cpu_kernels.load()
        except cpu_kernels.KernelsUnavailable as e:
            pytest.skip(str(e))
        kw = dict(argmax=k.argmax_rows, draw=k.sample_rows)
    s = Sampler(vocab_limit=40, eos_token_ids=[EOS], device=torch.device("cpu"), **kw)
    logits = torch.randn(5, 48, generator=torch.Generator().manual_seed(5))
    logits[:, 9] = 4.0  # every row's favourite...
    logits[:, 44] = 5.0  # ...past the tokenizer's vocabulary: never drawn or named, counted (the model's, as vLLM's)
    reqs = [_req("greedy", logprobs=3),
            _req("biased", logprobs=0, logit_bias={9: -100.0}),  # draws another token: rank > 1
            _sampled("sampled", temperature=1.5, seed=3, logprobs=40),  # the whole vocabulary
            _req("none"),
            _req("penalized", logprobs=2, repetition_penalty=3.0, min_tokens=1, max_tokens=4)]
    ref = torch.log_softmax(logits.float(), dim=-1)[:, :40]
    plan = s.plan(reqs)
    out = s.draw(logits.clone(), plan)
    toks, lps = out.result(), out.logprobs()
    assert sorted(lps) == [0, 1, 2, 4] and toks[0] == 9 and toks[1] != 9
    for i, k in ((0, 3), (1, 0), (2, 40), (4, 2)):
        v, rank, top = lps[i]
        assert v == pytest.approx(ref[i, toks[i]].item(), abs=1e-6)
        assert rank == int((ref[i] >= ref[i, toks[i]]).sum())
        want = torch.topk(ref[i], k)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [x for _, x in top] == pytest.approx(want.values.tolist(), abs=1e-6)
    assert lps[0][1] == 1 and lps[1][1] > 1
    alone = s.draw(logits[2:3].clone(), plan.row(2))  # a row drawn again alone (its step failed): the same
    assert alone.result() == [toks[2]] and alone.logprobs() == {0: lps[2]}


def test_logprobs_out_of_range_are_refused():
    for bad in (-1, True, 2.0):  # (above the engine's max_logprobs: `engine.inputs`)
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad).validate()
    assert SamplingParams(logprobs=20).validate().logprobs == 20


def test_prompt_logprobs_of_spans_in_passes(monkeypatch):
    """`Sampler.prompt_logprobs` over a step's prompt rows, span by span and a few rows a pass: each row's next prompt
    token's raw log-probability, rank and its span's top k; a token past the tokenizer's vocabulary is -inf."""
    import engine.sampler as S

    monkeypatch.setattr(S, "PROMPT_ROWS", 3)  # passes that cut through the spans
    s = Sampler(vocab_limit=30, eos_token_ids=[EOS], device=torch.device("cpu"))
    logits = torch.randn(7, 32, generator=torch.Generator().manual_seed(9))
    spans = [("a", 0, [4, 8, 15, 16], 2), ("b", 5, [23, 31, 0], 0)]  # 31: past the vocabulary
    got = s.prompt_logprobs(lambda a, b: logits[a:b], spans)
    ref = torch.log_softmax(logits, dim=-1)[:, :30]  # (over the head's every row, as vLLM's)
    targets = [4, 8, 15, 16, 23, 31, 0]
    rows = got["a"][1] + got["b"][1]
    assert (got["a"][0], got["b"][0]) == (0, 5) and len(rows) == 7
    for j, (t, (v, rank, top)) in enumerate(zip(targets, rows)):
        if t >= 30:
            assert v == float("-inf") and rank == 31  # below every token it can say
            continue
        assert v == pytest.approx(ref[j, t].item(), abs=1e-6)
        assert rank == int((ref[j] >= ref[j, t]).sum())
        k = 2 if j < 4 else 0
        assert [i for i, _ in top] == torch.topk(ref[j], k).indices.tolist()
    # a k above vLLM's default cap (a server's max_logprobs of -1: the vocabulary) takes fewer rows a pass, the same
    # figures: a pass's top tokens no more than PROMPT_ROWS rows' at the default cap
    monkeypatch.setattr(S, "PROMPT_ROWS", 4)
    passes = []
    wide = s.prompt_logprobs(lambda a, b: passes.append(b - a) or logits[a:b], [("a", 0, targets, 29)])
    assert max(passes) == 4 * (S.MAX_LOGPROBS + 1) // 30 and sum(passes) == 7
    assert [r[:2] for r in wide["a"][1]] == [r[:2] for r in rows] and all(len(r[2]) == 29 for r in wide["a"][1])


def test_allowed_token_ids_keep_their_rows_to_those_tokens(draw):
    """vLLM's allowed_token_ids: a row draws only among its own (greedy: the likeliest of them); other rows and ids
    past the width are untouched."""
    s = Sampler(vocab_limit=20, eos_token_ids=[EOS], device=torch.device("cpu"), draw=draw)
    logits = torch.zeros(3, 20)
    logits[:, 9] = 8.0
    logits[:, 3] = 1.0
    reqs = [_req("greedy", allowed_token_ids=(3, 4)), _req("plain"),
            Request("drawn", [1, 2, 3], SamplingParams(temperature=1.0, seed=2, allowed_token_ids=(6, 7, 99)))]
    seen = set()
    for _ in range(30):
        toks = s.sample(logits.clone(), reqs)
        assert toks[:2] == [3, 9]
        seen.add(toks[2])
    assert seen == {6, 7}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(-1,)).validate()


def test_bad_words_ban_a_words_last_token_where_the_reply_holds_the_rest():
    """vLLM's bad_words (as token ids, `Request.bad_words_ids`): a one-token word is never drawn; a longer word's
    last token only where the reply ends with the rest of it, its last token read from the step before's tokens
    where it is still on its way (overlap scheduling); other rows are untouched."""
    from engine.sampler import SampledTokens

    s = Sampler(vocab_limit=12, eos_token_ids=[EOS], device=torch.device("cpu"))
    logits = torch.zeros(3, 12)
    logits[:, 7] = 9.0  # each row's likeliest ...
    logits[:, 4] = 8.0  # ... then this one
    a = Request("a", [1, 2], SamplingParams(temperature=0.0), bad_words_ids=((7,),))
    b = Request("b", [1, 2], SamplingParams(temperature=0.0), bad_words_ids=((2, 3, 7), (9, 4)))
    c = _req("c")
    a.token_ids += [7, 1]
    b.token_ids += [2, 3]
    assert s.sample(logits.clone(), [a, b, c]) == [4, 4, 7]  # "2 3 7" banned its 7; "9 4" not begun
    b.token_ids += [9]
    assert s.sample(logits[:1].clone(), [b]) == [7]
    b.token_ids[-1] = -2  # row 1 of the step in flight, which drew 9: "9 4" banned its 4 ...
    logits[:, 7] = -9.0
    d = s.plan([b], prev=SampledTokens([0, 9, 0]))
    assert s.draw(logits[1:2].clone(), d).result() == [0]  # ... (the next likeliest is 0)
    only = Request("o", [1, 2], SamplingParams(temperature=0.0, allowed_token_ids=(4,)), bad_words_ids=((7, 4),))
    only.token_ids += [7]
    assert s.sample(logits[:1].clone(), [only]) == [4]  # the ban would leave it nothing: its one allowed token
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=("",)).validate()


def test_a_logprobs_rank_counts_the_tokens_it_ties_as_vllm_does():
    """vLLM's rank: how many tokens are at least as likely as the one drawn, itself and its ties counted (bf16
    logits tie often): a greedy token tied for the top is rank 2."""
    from engine.sampler import _logprob_columns

    raw = torch.log_softmax(torch.tensor([[2.0, 2.0, 1.0, 0.5], [2.0, 2.0, 1.0, 0.5]]), dim=-1)
    _, ids = _logprob_columns(raw, torch.tensor([1, 3]), 0)
    assert ids[:, 0].tolist() == [2, 4]
    _, ids = _logprob_columns(raw, torch.tensor([2, 9]), 1)
    assert ids[:, 0].tolist() == [3, 5] and ids[0, 1] in (0, 1)  # (9: past the vocabulary, below all; a top tie)
