"""Overlap scheduling (`EngineConfig.overlap`): step N+1 is planned and launched before the host reads step N's
tokens, which reach N+1's inputs as placeholders resolved on the device. On the CPU the steps run on the host stream
(`engine.host_stream`), a thread of their own, with the same bookkeeping as on a GPU: every reply must be token for
token, and end for end, what the engine gives without it (data-dependent stops, length limits, preemption, chunked
prefill, seeded sampling, aborts, a request whose forward fails)."""
import dataclasses

import pytest
import torch

from core.request import FinishReason, Request, Status
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from scheduling.config import SchedulerConfig
from scheduling.scheduler import Scheduler
from tests.test_backends import _triton_interpreted, break_inputs_of

PROMPTS = [list(range(3, 5)), list(range(7, 30)), list(range(11, 70)), list(range(2, 9)) * 3, list(range(40, 52))]


PREEMPTED: list[bool] = []  # per preemption: whether a token of the request was still on its way


def _serve(path, prompts, params, overlap, device_path=False, logprobs=None, **cfg):
    """Per request: (tokens, finish reason, error, the num_output_tokens its stream items reported). `device_path`:
    overlap as on a GPU (the step launched and drawn on the engine's thread, the step before in flight) instead of
    the host stream. `logprobs`: a list that gets each request's logprobs, one (logprob, rank, top ids) per token
    (None where its items had none)."""
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, overlap=overlap, **cfg))
    if device_path:
        eng._stream = None  # (no request yet: the worker has not stepped)
    try:
        assert eng.overlap is (overlap == "on")
        preempt = eng.scheduler._preempt

        def counted(r, plan):
            PREEMPTED.append(r.token_ids[-1] < 0)
            preempt(r, plan)
        eng.scheduler._preempt = counted
        params = params if isinstance(params, list) else [params] * len(prompts)
        streams = [eng.add_request(p, q) for p, q in zip(prompts, params)]
        out = []
        for s in streams:
            toks, counts, last, lps = [], [], None, []
            for item in s:  # (a consumer that falls behind gets items merged: counts may skip)
                toks.extend(item.token_ids or [])
                counts.append(item.num_output_tokens)
                last = item
                if item.logprobs is None:
                    assert not item.token_ids or lps is None or not lps
                    lps = None
                else:
                    assert lps is not None and len(item.logprobs) == len(item.token_ids)
                    lps.extend((x.logprob, x.rank, [i for i, _, _ in x.top]) for x in item.logprobs)
            out.append((toks, last.finish_reason, last.error, counts))
            if logprobs is not None:
                logprobs.append(lps)
        return out
    finally:
        eng.shutdown()


def _replies(streams, logprobs=None):
    """Per request id: (its tokens, its last stream item). `logprobs`: a dict that gets each request's logprobs, as
    `_serve` lists them."""
    got = {}
    for s in streams:
        toks, last, lps = [], None, []
        for item in s:
            toks.extend(item.token_ids or [])
            last = item
            lps.extend((x.logprob, x.rank, [i for i, _, _ in x.top]) for x in item.logprobs or ())
        got[s.request_id] = (toks, last)
        if logprobs is not None:
            logprobs[s.request_id] = lps
    return got


def _both(path, prompts, params, **cfg):
    """Both engines' replies, without the item counts (how items merge depends on the consumer's pace)."""
    off = _serve(path, prompts, params, "off", **cfg)
    on = _serve(path, prompts, params, "on", **cfg)
    for toks, _, err, counts in on:
        assert err is not None or (counts == sorted(counts) and counts[-1] == len(toks))
    return [x[:3] for x in off], [x[:3] for x in on]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_replies_with_data_dependent_stops_are_token_exact(tiny_checkpoints, backend):
    """Stop token ids end replies at steps the host learns one step late; max_tokens ends others: the same tokens,
    the same finish reasons, and stream items that count the tokens so far (never one still on its way)."""
    path = tiny_checkpoints["llama"]
    free = _serve(path, PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), "off",
                  backend=backend)
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    for i, (toks, *_rest) in enumerate(free[1:]):  # stop each other reply on a token it produces, at various steps
        params.append(SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[toks[i]]))
    off, on = _both(path, PROMPTS, params, backend=backend)
    assert on == off
    assert {r for _, r, _ in off} == {FinishReason.STOP, FinishReason.LENGTH}
    assert all(err is None for _, _, err in on)


def test_preemption_chunked_prefill_and_seeded_sampling_are_exact(tiny_checkpoints):
    """A cache too small for every reply at once (requests preempted and recomputed, some while a token of theirs is
    still on its way), prompts prefilled in chunks, and seeded sampling: the same replies as without overlap."""
    path = tiny_checkpoints["qwen2"]
    sched = SchedulerConfig(chunked_prefill=True, prefill_max_tokens=16)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=5, min_tokens=4)]
    PREEMPTED.clear()
    off, on = _both(path, PROMPTS, params, scheduler=sched, num_kv_blocks=24, max_model_len=96)
    assert on == off
    assert PREEMPTED  # the cache is too small for every reply at once
    assert all(err is None for _, _, err in on)


@pytest.mark.parametrize("device_path", [False, True])
def test_penalized_replies_are_exact_with_a_step_in_flight(tiny_checkpoints, device_path):
    """A penalized row's last token is still on its way when the next step is planned: counted from the step
    before's tokens, the replies are those of an engine without overlap, and the penalties change them."""
    path = tiny_checkpoints["llama"]
    plain = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=0.7),
              SamplingParams(max_tokens=14, temperature=0.9, seed=4, ignore_eos=True, repetition_penalty=1.3,
                             min_p=0.05),
              plain, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=-1.0,
                                    logprobs=4)]
    params[2] = dataclasses.replace(params[2], logprobs=0)
    lp_off, lp_on = [], []
    off = _serve(path, PROMPTS, params, "off", logprobs=lp_off)
    on = _serve(path, PROMPTS, params, "on", device_path=device_path, logprobs=lp_on)
    assert [x[:3] for x in on] == [x[:3] for x in off]
    assert all(err is None for _, _, err, _ in on)
    # the logprobs too, every token's (the step in flight's own, drawn beside a placeholder)
    assert [x is None for x in lp_on] == [True, True, False, True, False] and lp_on == lp_off
    assert all(len(lp_on[i]) == len(on[i][0]) for i in (2, 4)) and all(len(t) == 4 for _, _, t in lp_on[4])
    unpenalized = _serve(path, PROMPTS, plain, "off")
    assert [off[i][0] != unpenalized[i][0] for i in (0, 1, 4)] == [True, True, True]


def test_abort_and_a_failing_request_with_a_step_in_flight(tiny_checkpoints):
    """An abort lands between a step's launch and its tokens, and a request whose forward raises fails alone: the
    other replies are those of an engine without overlap."""
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = _serve(path, [PROMPTS[0], PROMPTS[2]], params, "off")
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, overlap="on",
                                 backend="torch"))
    try:
        break_inputs_of(eng, "bad")
        # ("gone" is long: its abort lands mid-reply however late this thread runs on a loaded box)
        long = dataclasses.replace(params, max_tokens=400)
        streams = [eng.add_request(PROMPTS[i], long if rid == "gone" else params, request_id=rid)
                   for i, rid in zip([0, 1, 2, 3], ["a", "bad", "c", "gone"])]
        eng.abort("gone")
        got = _replies(streams)
        assert got["a"][0] == want[0][0] and got["c"][0] == want[1][0]
        assert got["bad"][1].error and "model step failed" in got["bad"][1].error
        assert got["gone"][1].finish_reason is FinishReason.ABORT
        assert eng.scheduler.blocks.num_used == 0 and not eng.scheduler.running
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_forward_that_fails_on_the_host_stream_fails_its_request_alone(tiny_checkpoints, backend):
    """On the CPU a step runs on the host stream: a forward that raises there (its inputs were prepared) is found
    when the step lands, after the next step was planned over its placeholders. Its requests are re-run one by one
    as they were launched, each drawing the numbers planned for it: only the bad request fails, and the others'
    replies, greedy and seeded, are those of an engine without overlap."""
    path = tiny_checkpoints["llama"]
    good = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, logprobs=3)]
    lps = []
    want = _serve(path, PROMPTS[:2], good, "off", backend=backend, logprobs=lps)
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, overlap="on",
                                 backend=backend))
    try:
        assert eng._stream is not None
        forward = eng.runner.forward
        failed = []

        def breaks_past_60(step, prev=None):  # only "bad" reaches position 60, at its 6th token
            if int(step.positions.max()) >= 60:
                failed.append(step.positions.numel())
                raise RuntimeError("this request's position breaks the kernel")
            return forward(step, prev)
        eng.runner.forward = breaks_past_60
        streams = [eng.add_request(p, q, request_id=rid) for p, q, rid in
                   zip([*PROMPTS[:2], list(range(3, 59))], [*good, SamplingParams(max_tokens=20, temperature=0.0,
                                                                                   ignore_eos=True)],
                       ["a", "b", "bad"])]
        seen = {}
        got = _replies(streams, seen)
        assert failed and max(failed) > 1  # a step of several requests failed on the stream
        assert got["a"][0] == want[0][0] and got["b"][0] == want[1][0]
        assert got["a"][1].error is None and got["b"][1].error is None
        # the re-run's draw has them too (each token's rank and top ids; its log-probability as a batch of another
        # size computes it, within fp32 rounding)
        assert [x[1:] for x in seen["b"]] == [x[1:] for x in lps[1]] and len(lps[1]) == 8
        assert [x[0] for x in seen["b"]] == pytest.approx([x[0] for x in lps[1]], rel=1e-5, abs=1e-5)
        assert got["bad"][1].error and "model step failed" in got["bad"][1].error and len(got["bad"][0]) == 5
        assert eng.scheduler.blocks.num_used == 0 and not eng.scheduler.running
    finally:
        eng.shutdown()


def test_a_draw_that_fails_is_redrawn_with_the_numbers_planned_for_it(tiny_checkpoints):
    """Without overlap (a GPU's path: the step's draw is planned, then drawn on the device) a draw that raises for the
    whole batch is redone request by request with the numbers its plan took: a seeded reply is the one it would
    have been (its generator gives its numbers once), and no request fails."""
    path = tiny_checkpoints["llama"]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)]
    lps = []
    want = _serve(path, PROMPTS[:2], params, "off", logprobs=lps)
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, overlap="off"))
    try:
        draw, failed = eng.sampler.draw, []

        def fails_once(logits, d):
            if len(d.reqs) > 1 and not failed:
                failed.append(len(d.reqs))
                raise RuntimeError("the batch's draw failed")
            return draw(logits, d)
        eng.sampler.draw = fails_once
        streams = [eng.add_request(p, q, request_id=rid) for p, q, rid in zip(PROMPTS[:2], params, "ab")]
        seen = {}
        got = _replies(streams, seen)
        assert failed == [2]
        assert got["a"][0] == want[0][0] and got["b"][0] == want[1][0]
        assert seen["a"] == lps[0] and len(lps[0]) == 8 and lps[1] is None
        assert got["a"][1].error is None and got["b"][1].error is None
    finally:
        eng.shutdown()


def test_a_cpu_engine_runs_its_steps_on_the_host_stream_only_when_asked(tiny_checkpoints):
    """`overlap="auto"` on the CPU: no overlap (the SLO protocol's engine); `on`: the host stream."""
    for overlap, stream in (("auto", False), ("on", True)):
        eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", dtype="float32", num_threads=1,
                                     overlap=overlap))
        try:
            assert eng.overlap is stream and (eng._stream is not None) is stream
            out = list(eng.add_request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
            assert sum(len(o.token_ids or []) for o in out) == 4 and out[-1].finish_reason is FinishReason.LENGTH
        finally:
            eng.shutdown()


def test_the_cuda_backends_inputs_read_placeholders_on_the_device(tiny_checkpoints):
    """The CUDA backend's packed inputs (Triton kernels interpreted on the CPU) with overlap: the same tokens."""
    if not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    off, on = _both(tiny_checkpoints["llama"], PROMPTS[:3], params, backend="cuda")
    assert on == off


def test_the_scheduler_keeps_placeholders_until_resolved_and_skips_ended_requests():
    """`launched` appends a placeholder per sampling row; a request whose last token is on its way and ends it by
    length is not planned again; `finish` drops placeholders it will never get; `resolved` skips ended requests."""
    s = Scheduler(SchedulerConfig(policy="fcfs"), num_blocks=64, block_size=4, max_model_len=64)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))
    b = Request("b", [4, 5], SamplingParams(max_tokens=5, temperature=0.0))
    s.add(a)
    s.add(b)
    plan = s.schedule(0.0)
    reqs = plan.requests
    index = s.launched(plan, reqs)
    assert index == [3, 2] and a.token_ids == [1, 2, 3, -1] and b.token_ids == [4, 5, -2]
    nxt = s.schedule(0.0)  # a's one token is launched: only b decodes, over its placeholder
    assert nxt.decode == [b] and not nxt.prefill
    index2 = s.launched(nxt, nxt.requests)
    assert b.token_ids == [4, 5, -2, -1]
    out = s.resolved(reqs, index, [9, 7], 0.0)
    assert [(r.request_id, t, why) for r, t, why in out] == [("a", 9, FinishReason.LENGTH), ("b", 7, None)]
    assert s.finish(a, FinishReason.LENGTH, 0.0) and a.token_ids == [1, 2, 3, 9]
    assert s.finish(b, FinishReason.ABORT, 0.0) and b.token_ids == [4, 5, 7] and b.status is Status.FINISHED
    assert s.resolved([b], index2, [8], 0.0) == []
    assert s.blocks.num_used == 0


class _Spy:
    """The decoder, recording the smallest token id each forward feeds it."""

    def __init__(self, inner, seen):
        self._inner, self._seen = inner, seen

    def __call__(self, ids, *args, **kwargs):
        self._seen.append(int(ids.min()) if ids.numel() else 0)
        return self._inner(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_not_finite_row_never_feeds_a_negative_id_to_the_next_step(tiny_checkpoints):
    """A sampled row whose probabilities are not finite comes back as -1; the next step's inputs read that row on the
    device before the host has seen it. No id below 0 may reach the model (on a GPU an out-of-range embedding index
    is a device-side assert: every request lost): the request fails alone, its neighbour is served."""
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", dtype="float32", block_size=4,
                                 overlap="on", backend="torch"))
    try:
        assert eng.runner.decoder is not None
        seen: list[int] = []
        eng.runner.decoder = _Spy(eng.runner.decoder, seen)
        draw = eng.sampler.draw
        count = {"n": 0}

        def poisoned(logits, draws):  # the "nan" request's second sampled row holds a NaN
            for i, r in enumerate(draws.reqs):
                if r.request_id == "nan":
                    count["n"] += 1
                    if count["n"] == 2:
                        with torch.inference_mode():
                            logits[i, 3] = float("nan")
            return draw(logits, draws)
        eng.sampler.draw = poisoned
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        a = eng.add_request(list(range(7, 30)), greedy, request_id="a")
        bad = eng.add_request(list(range(11, 40)), SamplingParams(max_tokens=8, temperature=1.0, seed=1,
                                                                  ignore_eos=True), request_id="nan")
        last_bad = list(bad)[-1]
        toks = [t for item in a for t in (item.token_ids or [])]
        assert last_bad.finish_reason is FinishReason.ERROR and "not finite" in last_bad.error
        assert len(toks) == 8
        assert min(seen) >= 0, f"a forward was fed token id {min(seen)}"
    finally:
        eng.shutdown()


def test_a_request_preempted_while_its_failed_step_was_in_flight_runs_again_and_is_not_failed(tiny_checkpoints):
    """On the host stream the next step is planned before this one lands: where it preempts a request of this step
    for blocks, and this step then fails (another request's forward breaks it), the preempted request cannot be re-run
    alone (its KV went with the preemption). That is not its failure: its token is drawn again once it runs again,
    and its reply is the one it gets without the fault; the request that broke the step fails alone."""
    import random

    path = tiny_checkpoints["llama"]
    g = random.Random(3)
    pa, px = [g.randrange(1, 500) for _ in range(16)], [g.randrange(1, 500) for _ in range(16)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _serve(path, [px], [greedy], "off", max_model_len=40)[0][0]
    for t in (17, 19):  # A's reply breaks the step at its t-th token; 10 blocks of 4 preempt X on the way
        eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, overlap="on",
                                     num_kv_blocks=10, max_model_len=40,
                                     scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256)))
        try:
            assert eng._stream is not None
            prepare, forward, breaks = eng.runner.prepare, eng.runner.forward, set()

            def marked(prefill, decode, ends=None):
                p = prepare(prefill, decode, ends)
                if any(r.request_id == "A" and r.num_tokens >= t for r in decode):
                    breaks.add(id(p))
                return p

            def failing(p, ids=None):
                out = forward(p, ids)
                if id(p) in breaks:
                    raise RuntimeError("A's step fails")
                return out
            eng.runner.prepare, eng.runner.forward = marked, failing
            sa = eng.add_request(pa, greedy, request_id="A")
            sx = eng.add_request(px, greedy, request_id="X")
            got = _replies([sa, sx], {})
            assert got["A"][1].error and "model step failed" in got["A"][1].error
            assert got["X"][1].error is None and got["X"][0] == want, t
            assert eng.stats().preemptions >= 1 and eng.scheduler.blocks.num_used == 0
        finally:
            eng.shutdown()
