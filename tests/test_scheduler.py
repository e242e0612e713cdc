"""The scheduler's step decisions over plain Request objects and its own real BlockManager (no model)."""
import pytest

from core.request import SLO, FinishReason, Request, Status
from core.sampling import SamplingParams
from scheduling.config import SchedulerConfig
from scheduling.predictor import LatencyModel
from scheduling.scheduler import OVERLOADED, Scheduler


def _req(i, n, tpot=None, ttft=None, arrival=0.0, max_tokens=8):
    """Request i with a prompt of n tokens that no other request's begins with (no prefix cache hit)."""
    return Request(f"r{i}", _prompt(i, n), SamplingParams(max_tokens=max_tokens), SLO(ttft_ms=ttft, tpot_ms=tpot),
                   arrival_s=arrival)


def _prompt(i, n):
    return [100_000 + i] + [1] * (n - 1)


def _sched(policy="fcfs", blocks=64, **kw):
    model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0))  # prefill 1+0.01n, itl 5+0.5B
    return Scheduler(SchedulerConfig(policy=policy, **kw), blocks, 4, max_model_len=256,
                     predictor=model)


def _run(s, plan):
    """Pretend the step ran: every scheduled request gets one token."""
    for r in plan.prefill + plan.decode:
        r.num_computed_tokens = r.num_tokens
        r.token_ids.append(3)


def test_prefill_first_then_decode():
    s = _sched("fcfs")
    a, b = _req(0, 5), _req(1, 5)
    s.add(a)
    p = s.schedule(0.0)
    assert p.prefill == [a] and p.decode == []
    _run(s, p)
    s.add(b)
    p = s.schedule(0.0)
    assert p.prefill == [b] and p.decode == []  # fcfs: a step with admissions runs only prefills
    _run(s, p)
    p = s.schedule(0.0)
    assert p.prefill == [] and p.decode == [a, b]


def test_hybrid_steps_decode_running_requests_alongside_new_prefills():
    s = _sched("kairos")
    a, b = _req(0, 5), _req(1, 5)
    s.add(a)
    _run(s, s.schedule(0.0))
    s.add(b)
    p = s.schedule(0.0)
    assert p.prefill == [b] and p.decode == [a]


def test_kv_exhaustion_makes_admission_wait_then_preempts_on_decode():
    s = _sched("fcfs", blocks=6)  # 24 token slots
    a, b, c = _req(0, 8), _req(1, 8), _req(2, 8)
    for r in (a, b, c):
        s.add(r)
    p = s.schedule(0.0)
    assert p.prefill == [a, b]  # c would leave no headroom: it waits, FIFO order kept
    assert list(s.waiting) == [c] and s.blocks.num_free == 2
    _run(s, p)
    for _ in range(20):  # a and b grow into the 2 free blocks, then one of them must make room
        p = s.schedule(0.0)
        _run(s, p)
        if p.preempted:
            break
    assert p.preempted == [b] and p.decode == [a]  # the most recently admitted is the victim
    assert b.status is Status.WAITING and b.block_table == [] and s.waiting[0] is b  # back at the head of the queue
    assert b.num_computed_tokens == 0  # recomputed from its prompt and the tokens it already produced


def test_hybrid_steps_admit_no_prompt_into_the_blocks_running_decodes_take_in_the_same_step():
    """kairos decodes the running replies in the prefill's step: a fresh prompt fits only in what their decodes leave,
    else that decode preempts the older reply for the newcomer. It waits instead, and runs once blocks free up."""
    s = _sched("kairos", blocks=6, prefill_hold=False)  # 24 token slots
    a = Request("A", [1] * 8, SamplingParams(max_tokens=16), arrival_s=0.0)
    s.add(a)
    p = s.schedule(0.0)
    _run(s, p)  # A: 9 tokens in 2 blocks, its next decode takes a third
    f = Request("F", [1] * 15, SamplingParams(max_tokens=4), arrival_s=0.02)  # needs 4 blocks: all that are free
    s.add(f)
    p = s.schedule(0.02)
    assert p.prefill == [] and p.decode == [a] and not p.preempted and list(s.waiting) == [f]
    s.finish(a, FinishReason.STOP, 0.03)
    p = s.schedule(0.03)
    assert p.prefill == [f] and not p.preempted


def test_waiting_queue_is_bounded():
    s = _sched("fcfs", max_waiting=2)
    assert s.add(_req(0, 4)) is None and s.add(_req(1, 4)) is None
    assert s.add(_req(2, 4)) == OVERLOADED


def test_ldf_admits_the_earliest_deadline_first():
    s = _sched("edf", prefill_max_batch_size=1)
    late, early = _req(0, 4, ttft=5000, arrival=0.0), _req(1, 4, ttft=100, arrival=0.01)
    s.add(late)
    s.add(early)
    assert s.schedule(0.02).prefill == [early]


def test_ttft_guard_rejects_only_unattainable_requests():
    s = _sched("kairos")
    ok, doomed = _req(0, 100, ttft=10_000), _req(1, 100, ttft=1.0)
    s.add(ok)
    s.add(doomed)
    p = s.schedule(0.0)
    assert p.rejected == [(doomed, "ttft_unattainable")] and p.prefill == [ok]


def test_vbs_gate_rejects_a_tpot_it_cannot_meet_even_alone():
    s = _sched("scorpio")
    r = _req(0, 4, tpot=5.0)  # predicted ITL(1) = 5.5 ms: 1.3 * 5.5 > 0.99 * 5
    s.add(r)
    assert s.schedule(0.0).rejected == [(r, "tpot_unattainable")]


def test_gate_context_horizon_counts_a_reply_about_to_end_as_ending():
    """gate_context="horizon": a running reply with one token left grows by at most that over a long candidate's
    reply, so the candidate's steps are predicted at a shorter context than SCORPIO's form predicts (every reply grows
    by half the candidate's), and a TPOT between the two is admitted only with it."""
    for context, admitted in (("batch", False), ("horizon", True)):
        model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.01, 5.0))  # itl 5 + 0.5B + 0.01L
        s = Scheduler(SchedulerConfig(policy="scorpio", gate_context=context), 64, 4, max_model_len=256,
                      predictor=model)
        a = Request("a", [1] * 4, SamplingParams(max_tokens=2))  # best effort: one token left once prefilled
        s.add(a)
        _run(s, s.schedule(0.0))
        c = Request("c", [1] * 4, SamplingParams(max_tokens=200), SLO(tpot_ms=8.6))
        s.add(c)
        # VBS 1.5; L = 4.5 + 100 (batch) or (9 + 0.5 + 100) / 2 (horizon): 1.3 x ITL = 8.83 or 8.19 against 8.51
        p = s.schedule(0.0)
        assert (c in p.prefill) is admitted, context
        assert ((c, "tpot_unattainable") in p.rejected) is (not admitted), context


def test_kairos_gate_scales_the_model_by_the_measured_step_time():
    """Steps measured at 3x the model: kairos's gate (factor capped by what the 1.3 margin already covers)
    rejects a TPOT that scorpio's static gate still admits."""
    def slow_steps(s, now):
        a = _req(0, 4)  # best effort, keeps a decode running
        s.add(a)
        _run(s, s.schedule(now))
        for k in range(40):  # ~40 decode steps at 3x the predicted ITL(1) = 5.5 ms
            p = s.schedule(now + 0.0165 * k)
            _run(s, p)
            s.on_step_done(p, 16.5, now + 0.0165 * (k + 1))
        return now + 0.0165 * 40

    for policy, admitted in (("scorpio", True), ("kairos", False)):
        s = _sched(policy)
        t = slow_steps(s, 0.0)
        r = _req(9, 4, tpot=12.0)  # ITL(2) = 6 ms: 1.3 * 6 < 0.99 * 12 unless the model is scaled up
        s.add(r)
        p = s.schedule(t)
        assert (r in p.prefill) is admitted, policy
        assert ((r, "tpot_unattainable") in p.rejected) is (not admitted), policy
    assert s.last_correction == 2.5  # measured 3x, capped at correction_max


def test_kairos_gate_keeps_the_measured_step_time_after_an_idle_gap():
    """After the batch has drained and the replica idled, kairos's gate still scales the model by what its decode
    steps measured: a TPOT it refused while they ran is refused alone too, and the idle scale it advertises
    (`idle_gate_scale`, the best TPOT's) says so. Scorpio's static gate has no scale."""
    s = _sched("kairos", correction_idle_prior_ms=1e-6)
    a = _req(0, 4)
    s.add(a)
    _run(s, s.schedule(0.0))
    for k in range(40):  # decode-only steps at 2x the predicted ITL(1) = 5.5 ms
        p = s.schedule(0.011 * k)
        _run(s, p)
        s.on_step_done(p, 11.0, 0.011 * (k + 1))
    s.finish(a, FinishReason.ABORT, 0.5)
    assert s.idle_gate_scale() == pytest.approx(2.0 / 1.05, rel=0.02)  # max(k, f) / k over the margin k
    r = _req(9, 4, tpot=8.0)  # alone: 1.05 * 5.5 < 0.99 * 8 by the profile, not at 2x
    s.add(r)
    p = s.schedule(60.0)  # a minute idle
    assert r not in p.prefill and (r, "tpot_unattainable") in p.rejected
    assert _sched("scorpio").idle_gate_scale() == 1.0


def test_an_idle_replica_admits_what_it_offered_just_before_a_burst_slowed_its_steps():
    """kairos's idle gate and the SLO floor it offers take the least idle factor of the last few seconds
    (`offer_gate_scale`): the last requests of a burst decoding alone on a loaded host, their steps at 2x, do not
    make the idle replica refuse a TPOT it offered just before them (a retry would find it refused again: nothing
    decodes alone to bring the factor back). A speed the machine keeps shows after that memory (the test above)."""
    s = _sched("kairos", correction_idle_prior_ms=1e-6)
    a = _req(0, 4)
    s.add(a)
    _run(s, s.schedule(0.0))
    t = 0.0
    for step_ms in [5.5] * 40 + [11.0] * 60:  # alone at the model's ITL(1), then the burst's tail at 2x
        p = s.schedule(t)
        _run(s, p)
        t += step_ms / 1000.0
        s.on_step_done(p, step_ms, t)
    s.finish(a, FinishReason.ABORT, t)
    assert 1.05 * 5.5 * s.idle_gate_scale() > 0.99 * 8.0  # what the steps measure now refuses a TPOT of 8 ms
    assert s.offer_gate_scale(t + 1.0) == pytest.approx(1.0, rel=0.02)  # what they measured before the burst
    r = _req(9, 4, tpot=8.0)  # alone: 1.05 * 5.5 < 0.99 * 8 at the measured 1x, not at 2x
    s.add(r)
    p = s.schedule(t + 1.0)
    assert r in p.prefill


def test_the_gate_counts_its_share_of_the_measured_stalls_a_step_plans_with_the_decode_only_error():
    """correction_stall_share: kairos's VBS gate scales the model by its error on the decode-only steps plus that
    share of what the steps that carried a prefill added (a CPU replica's 1: all of it; a GPU replica's 0.5,
    `for_device`; 0: none), while a step's own plan (pace guard, fill, catch-up) scales it by the decode-only error
    alone, whatever the share."""
    from engine.config import EngineConfig, for_device

    assert for_device(EngineConfig(), "cuda").scheduler.correction_stall_share == 0.5
    assert for_device(EngineConfig(), "cpu").scheduler.correction_stall_share == 1.0
    every = 25.5 / 11.0  # (5.5 + 20) ms a pair of steps over the 2 x 5.5 ms of decode the model predicts for them
    for share, admitted in ((1.0, False), (0.5, False), (0.0, True)):
        s = _sched("kairos", correction_stall_share=share, impatient_reserve=False)
        a = _req(0, 4)  # best effort, keeps a decode running
        s.add(a)
        _run(s, s.schedule(0.0))
        t = 0.0
        for k in range(40):
            p = s.schedule(t)  # a decode-only step, at the model's ITL(1) = 5.5 ms
            assert p.decode == [a] and not p.prefill
            _run(s, p)
            t += 0.0055
            s.on_step_done(p, 5.5, t)
            b = _req(100 + k, 4)  # a prompt riding in a hybrid step that takes 20 ms
            s.add(b)
            p = s.schedule(t)
            assert p.prefill == [b] and p.decode == [a]
            _run(s, p)
            t += 0.02
            s.on_step_done(p, 20.0, t)
            s.finish(b, FinishReason.STOP, t)
        r = _req(9, 4, tpot=9.0)  # ITL(2) = 6 ms: 1.05 * 6 < 0.99 * 9 unless the stalls scale the model by > 1.41
        s.add(r)
        p = s.schedule(t)
        assert (r in p.prefill) is admitted, share
        assert s.last_correction == pytest.approx(1.0 + share * (every - 1.0), rel=0.05)
        assert s.last_step_correction == pytest.approx(1.0)


def test_the_stall_share_follows_the_paced_replies_that_end_over_their_tpot():
    """stall_share_target (a GPU replica's 0.01, `for_device`; none on a CPU): each paced reply that ends over its
    TPOT SLO raises the share of the stalls the gate counts by step x (1 - target), each within lowers it by
    step x target, between correction_stall_share and 1; a reply without a TPOT SLO, or one cut short (an abort),
    moves nothing."""
    from engine.config import EngineConfig, for_device

    assert for_device(EngineConfig(), "cuda").scheduler.stall_share_target == 0.01
    assert for_device(EngineConfig(), "cpu").scheduler.stall_share_target is None

    def ended(s, i, tpot, ms_per_token, reason=FinishReason.LENGTH):
        r = _req(i, 4, tpot=tpot)
        s.add(r)
        r.first_token_s = 1.0
        r.token_ids.extend([3] * 8)  # 8 tokens out: 7 intervals after the first
        s.finish(r, reason, 1.0 + 7 * ms_per_token / 1000.0)

    s = _sched("kairos", correction_stall_share=0.5, stall_share_target=0.1, stall_share_step=0.1)
    ended(s, 0, 10.0, 12.0)  # over its TPOT
    assert s.stall_share == pytest.approx(0.5 + 0.1 * 0.9)
    ended(s, 1, 10.0, 8.0)  # within
    assert s.stall_share == pytest.approx(0.59 - 0.1 * 0.1)
    ended(s, 2, None, 50.0)  # best effort
    ended(s, 3, 10.0, 50.0, FinishReason.ABORT)
    assert s.stall_share == pytest.approx(0.58)
    for i in range(20):
        ended(s, 10 + i, 10.0, 50.0)
    assert s.stall_share == 1.0  # bounded
    for i in range(120):
        ended(s, 40 + i, 10.0, 8.0)
    assert s.stall_share == 0.5  # and not below the share set
    fixed = _sched("kairos", correction_stall_share=0.5)
    ended(fixed, 0, 10.0, 12.0)
    assert fixed.stall_share == 0.5


def test_kairos_gate_on_an_empty_replica_uses_the_decode_steps_factor_not_the_last_stalls():
    """Right after the last request ended, the step window still holds the stalls its neighbours' prefills made;
    a request admitted now decodes alone, without them. So a replica with nothing running gates with the
    decode-only steps' factor (the one its advertised best TPOT is drawn with), while a busy one keeps the window's."""
    def measured(s, keep_running: bool):
        a = _req(0, 4)
        s.add(a)
        _run(s, s.schedule(0.0))
        for k in range(40):  # decode-only steps at 1.2x the predicted ITL(1) = 5.5 ms, each after a 20 ms stall
            p = s.schedule(0.03 * k)
            _run(s, p)
            s.on_step_done(p, 6.6, 0.03 * k + 0.01)
            s.correction.observe(0.03 * k + 0.03, 20.0, 0.0)  # a prefill-only step of other requests
        if not keep_running:
            s.finish(a, FinishReason.STOP, 1.2)
        return 1.2

    for keep_running, admitted in ((False, True), (True, False)):
        s = _sched("kairos", correction_idle_prior_ms=1e-6)
        t = measured(s, keep_running)
        r = _req(9, 4, tpot=9.0)  # alone at 1.2x: 6.6 ms < 0.99 * 9; at the window's factor (> 2): far over
        s.add(r)
        p = s.schedule(t)
        assert (r in p.prefill) is admitted, keep_running
    assert s.idle_gate_scale() == pytest.approx(1.2 / 1.05, rel=0.02)
    # a burst into the empty replica: the first decodes alone (the decode steps' factor), the second would share
    # steps with its prefill (the window's factor, stalls included): refused
    s = _sched("kairos", correction_idle_prior_ms=1e-6)
    t = measured(s, False)
    r1, r2 = _req(8, 4, tpot=9.0), _req(9, 4, tpot=9.0)
    s.add(r1)
    s.add(r2)
    p = s.schedule(t)
    assert r1 in p.prefill and r2 not in p.prefill


def test_kairos_idle_scale_comes_from_steps_decoding_alone_not_from_big_batches():
    """The best TPOT a replica advertises is for one request decoding alone: a burst's big decode batches, where the
    model errs otherwise, leave the idle scale as it was; the steps of the last request, alone, set it."""
    s = _sched("kairos", correction_idle_prior_ms=1e-6)
    reqs = [_req(i, 4) for i in range(6)]
    for r in reqs:
        s.add(r)
    _run(s, s.schedule(0.0))
    t = 0.0
    for k in range(20):  # several rows decoding at 3x the model
        p = s.schedule(t)
        assert len(p.decode) > 2
        _run(s, p)
        t += 0.03
        s.on_step_done(p, 3.0 * s.predictor.itl_ms(6, p.decode_mean_len), t)
    assert s.idle_gate_scale() == 1.0  # nothing measured alone yet: the profile
    for r in reqs[1:]:
        s.finish(r, FinishReason.STOP, t)
    for k in range(20):  # the last one alone at 1.2x
        p = s.schedule(t)
        assert len(p.decode) == 1
        _run(s, p)
        t += 0.01
        s.on_step_done(p, 1.2 * s.predictor.itl_ms(1, p.decode_mean_len), t)
    assert s.idle_gate_scale() == pytest.approx(1.2 / 1.05, rel=0.01)


def test_plan_keeps_its_prefill_token_count_after_the_step():
    """Step feedback (online refit, bench calibration) reads the count after the step has run."""
    s = _sched("fcfs")
    a, b = _req(0, 5), _req(1, 7)
    s.add(a)
    s.add(b)
    p = s.schedule(0.0)
    assert p.prefill == [a, b] and p.num_prefill_tokens == 12
    _run(s, p)
    assert p.num_prefill_tokens == 12


def test_kairos_gate_trusts_steps_measured_faster_than_the_model():
    """A fit taken while the machine stalled over-predicts: kairos's measured factor (< 1) scales the gate's
    model down, the 1.3 margin kept, and admits a TPOT that the static gate (scorpio) refuses."""
    for policy, admitted in (("scorpio", False), ("kairos", True)):
        s = _sched(policy)
        a = _req(0, 4)
        s.add(a)
        _run(s, s.schedule(0.0))
        for k in range(40):  # decode steps of ITL(1) = 5.5 ms predicted, measured 4.4 ms (0.8x)
            p = s.schedule(0.0044 * k)
            _run(s, p)
            s.on_step_done(p, 4.4, 0.0044 * (k + 1))
        r = _req(9, 4, tpot=7.0)  # ITL(2) = 6 ms: 1.3 * 6 > 0.99 * 7, but 1.3 * 0.8 * 6 < 0.99 * 7
        s.add(r)
        p = s.schedule(0.0044 * 40)
        assert (r in p.prefill) is admitted, policy
    assert s.last_correction == pytest.approx(0.8)


def _pace_case(policy: str, strict_tpot: float = 10.0, loose_credit: float = -0.5, missed_at: float | None = None,
               **kw) -> list[str]:
    """A strict request (TPOT `strict_tpot`, 10 ms) paces the batch; a loose one (TPOT 20 ms, TRP 0.5 at 10 ms)
    has had 4 tokens since t=0 and so is due by t = 80 ms; its credit (`loose_credit`) says skip. The model's
    step: 5 + 0.5 B ms, so a step of both takes 6 ms. With `missed_at`, a third reply (TPOT 10 ms) ended then,
    its 8 tokens 100 ms after its first one: over its TPOT. Returns who decodes at t = 75 ms."""
    s = _sched(policy, **kw)
    if missed_at is not None:
        late = _req(2, 4, tpot=10.0)
        s.add(late)
        late.first_token_s = missed_at - 0.1
        late.token_ids.extend([3] * 8)
        s.finish(late, FinishReason.LENGTH, missed_at)
    strict, loose = _req(0, 4, tpot=strict_tpot), _req(1, 4, tpot=20.0)
    for r in (strict, loose):
        s.add(r)
    _run(s, s.schedule(0.0))  # both prefilled: their first token
    for r in (strict, loose):
        r.first_token_s = 0.0
        r.token_ids.extend([3, 3, 3])  # 4 tokens out
        r.num_computed_tokens = r.num_tokens
    loose.credit = loose_credit  # its credit says: skip this step
    return [r.request_id for r in s.schedule(0.075).decode]  # skipped, its next token would come at ~87 ms


def test_pace_guard_decodes_a_request_its_credit_would_skip_when_it_is_behind():
    assert _pace_case("kairos", fill_steps=False) == ["r0", "r1"]
    assert _pace_case("kairos", pace_guard=False, fill_steps=False) == ["r0"]
    assert _pace_case("scorpio") == ["r0"]  # as published: credit alone


def test_fill_steps_decodes_a_request_its_credit_would_skip_while_the_step_stays_short_enough():
    # a step of both takes 6 ms, within what the gate plans a step at the strict 10 ms to take (0.99 x 10 / 1.05)
    assert _pace_case("kairos", pace_guard=False) == ["r0", "r1"]  # on in the kairos preset
    assert _pace_case("kairos", pace_guard=False, fill_steps=False) == ["r0"]  # off: the credit decides
    assert _pace_case("scorpio", fill_steps=True) == ["r0", "r1"]
    # at a 6.2 ms strict TPOT a step of both (6 ms) is over 0.99 x 6.2 / 1.05: the loose one keeps to its credit
    assert _pace_case("kairos", strict_tpot=6.2, pace_guard=False) == ["r0"]


def test_fill_steps_pause_after_a_paced_reply_misses_its_tpot():
    assert _pace_case("kairos", pace_guard=False, missed_at=0.07) == ["r0"]  # within fill_pause_s (10 s) of it
    assert _pace_case("kairos", pace_guard=False, missed_at=0.07, fill_pause_s=0.004) == ["r0", "r1"]  # over


def test_pace_guard_adds_no_decode_that_would_push_the_step_past_t_min():
    # strict TPOT 6.05 ms: the gate (margin 1) admits both, at VBS 1.3 a step is 5.65 ms < 0.99 x 6.05 = 5.99;
    # but a step of both is 6 ms, over 5.99: the loose request keeps to its credit
    assert _pace_case("kairos", strict_tpot=6.05, loose_credit=-0.9, vbs_margin=1.0) == ["r0"]  # fill_steps too


def _banked_case(**kw) -> bool:
    """A strict reply (TPOT 6.2 ms) and two loose ones (20 ms), 40 tokens expected each, have had 30 tokens since
    t=0 by t=50 ms: the loose ones are far ahead of their pace. Whether a fresh loose request is admitted then. The
    step is 5 + 0.5 B ms; kairos's gate admits while 1.05 x step < 0.99 x 6.2 ms, i.e. B < 1.69. At their SLO's
    TPOT the batch with it is at 1 + 3 x 0.31 = 1.93; at the TPOT the loose ones still need (73 ms for their 10
    tokens left), half of that bank spent (pace_slack_share 0.5: 46.5 ms), 1 + 2 x 0.133 + 0.31 = 1.58."""
    s = _sched("kairos", **kw)
    run = [Request(f"r{i}", [1] * 4, SamplingParams(max_tokens=100), SLO(tpot_ms=t, output_len_hint=40))
           for i, t in enumerate((6.2, 20.0, 20.0))]
    for r in run:
        s.add(r)
    assert len(s.schedule(0.0).prefill) == 3
    for r in run:
        r.first_token_s = 0.0
        r.token_ids.extend([3] * 30)
        r.num_computed_tokens = r.num_tokens - 1  # the last token is the next step's input
    fresh = Request("fresh", [1] * 4, SamplingParams(max_tokens=100), SLO(tpot_ms=20.0, output_len_hint=40),
                    arrival_s=0.05)
    s.add(fresh)
    return fresh in s.schedule(0.05).prefill


def test_pace_slack_gives_a_fresh_request_the_room_replies_ahead_of_their_pace_leave():
    assert _banked_case(pace_slack=True)
    assert not _banked_case()  # opt-in: kairos counts every reply at its SLO's TPOT, as SCORPIO


def test_the_gate_a_router_copies_counts_replies_ahead_of_their_pace_as_the_replica_does(monkeypatch):
    """EngineStats.tpot_inv_sum (the router's copy of the VBS gate) sums 1 / the TPOT the gate counts each running
    reply at: with pace_slack, a loose reply far ahead of its pace counts less than its SLO says."""
    import time
    import types

    from engine import stats
    from engine.stats import snapshot

    now = time.monotonic()  # (one clock for the reply's first token and the snapshot: a stall between is no drift)
    monkeypatch.setattr(stats, "time", types.SimpleNamespace(monotonic=lambda: now))

    def inv_sum(**kw) -> float:
        s = _sched("kairos", **kw)
        r = Request("r0", [1] * 4, SamplingParams(max_tokens=100), SLO(tpot_ms=20.0, output_len_hint=40))
        s.add(r)
        s.schedule(0.0)
        r.first_token_s = now - 0.05  # 30 tokens in 50 ms: 730 ms left for its last 10
        r.token_ids.extend([3] * 30)
        return snapshot(s, alive=True, steps=0, rejected={}, phase_s={}, predictor_mape=None, last=(0, 0),
                        step=(None, None)).tpot_inv_sum

    assert inv_sum() == pytest.approx(1 / 20.0)
    assert inv_sum(pace_slack=True, pace_slack_share=1.0) == pytest.approx(1 / 73.0, rel=0.01)
    assert inv_sum(pace_slack=True) == pytest.approx(1 / (20.0 + 0.5 * 53.0), rel=0.01)  # half the bank kept


def test_the_stats_say_how_many_tokens_the_running_request_nearest_its_end_has_left():
    """EngineStats.nearest_end (a busy rejection's Retry-After): the least expected length less tokens out over the
    running requests, as the scheduler plans them (a hint, else max_tokens here); None with none running."""
    from engine.stats import snapshot

    def nearest(s):
        return snapshot(s, alive=True, steps=0, rejected={}, phase_s={}, predictor_mape=None, last=(0, 0),
                        step=(None, None)).nearest_end

    s = _sched("scorpio")
    assert nearest(s) is None
    a = Request("a", [1] * 4, SamplingParams(max_tokens=100), SLO(tpot_ms=50.0, output_len_hint=40))
    b = Request("b", [1] * 4, SamplingParams(max_tokens=60), SLO(tpot_ms=50.0))
    for r in (a, b):
        s.add(r)
    s.schedule(0.0)
    a.token_ids.extend([3] * 30)
    b.token_ids.extend([3] * 5)
    assert nearest(s) == 10  # a: 40 hinted, 30 out; b: 60, 5 out


def _step(s, plan):
    """Pretend the step ran through the scheduler's own bookkeeping (chunks advance, rows get one token)."""
    s.postprocess(plan, [3] * len(plan.requests), 0.0)


def test_chunked_prefill_splits_a_long_prompt_and_continues_it_first():
    s = _sched("kairos", prefill_max_tokens=64, chunked_prefill=True)
    long, short = _req(0, 150), _req(1, 10)
    s.add(long)
    s.add(short)
    p = s.schedule(0.0)
    assert p.prefill == [long] and p.prefill_ends == [64] and p.num_prefill_tokens == 64
    assert p.requests == []  # a chunk samples nothing
    _step(s, p)
    assert long.num_computed_tokens == 64 and long.num_output_tokens == 0
    p = s.schedule(0.0)  # the prompt in progress goes first and takes the whole budget
    assert p.prefill == [long] and p.prefill_ends == [128] and list(s.waiting) == [short]
    _step(s, p)
    p = s.schedule(0.0)  # its last 22 tokens, then the short prompt in what is left; nothing decodes yet
    assert p.prefill == [long, short] and p.prefill_ends == [150, 10] and p.decode == []
    assert p.requests == [long, short]
    _step(s, p)
    assert long.num_output_tokens == 1 and short.num_output_tokens == 1
    p = s.schedule(0.0)
    assert p.prefill == [] and p.decode == [long, short]


def test_chunked_prefill_never_decodes_a_prompt_in_progress():
    s = _sched("kairos", prefill_max_tokens=32, chunked_prefill=True)
    a = _req(0, 8)
    s.add(a)
    _step(s, s.schedule(0.0))
    b = _req(1, 100)
    s.add(b)
    p = s.schedule(0.0)
    assert p.prefill == [b] and p.prefill_ends == [32] and p.decode == [a]  # hybrid: a decodes beside the chunk
    _step(s, p)
    p = s.schedule(0.0)
    assert p.prefill == [b] and p.prefill_ends == [64] and p.decode == [a]


def test_without_chunked_prefill_a_long_prompt_is_prefilled_whole():
    s = _sched("kairos", prefill_max_tokens=64)
    long = _req(0, 150)
    s.add(long)
    p = s.schedule(0.0)
    assert p.prefill == [long] and p.prefill_ends == [150] and p.requests == [long]


@pytest.mark.parametrize("catch_up", [True, False])
def test_catch_up_gives_a_reply_behind_its_pace_a_shorter_step(catch_up):
    s = _sched("kairos", catch_up=catch_up, prefill_hold=False)  # predicted step: 5 + 0.5 * decodes ms
    a = Request("a", [1] * 5, SamplingParams(max_tokens=8), SLO(tpot_ms=8.0))  # 8 tokens expected
    b = Request("b", [1] * 5, SamplingParams(max_tokens=100), SLO(tpot_ms=8.0))  # 100: far from its end
    for r in (a, b):
        s.add(r)
    p = s.schedule(0.0)
    assert p.prefill == [a, b]
    _run(s, p)
    for r, k in ((a, 4), (b, 9)):  # a has 5 tokens out, b 10, both from t=0
        r.token_ids.extend([3] * k)
        r.num_computed_tokens = r.num_tokens - 1
    a.first_token_s = b.first_token_s = 0.0
    # at 39 ms a can afford (7 * 8 - 39) / 3 = 5.67 ms a step: both decoding take 6.0, a alone 5.5. b, ahead of
    # its pace, can sit one out and still take its 8 ms per token after: (99 * 8 - 39) / 91 = 8.27 ms
    p = s.schedule(0.039)
    assert p.decode == ([a] if catch_up else [a, b])


def test_catch_up_does_not_skip_a_reply_that_is_only_on_pace():
    s = _sched("kairos", prefill_hold=False)
    a = Request("a", [1] * 5, SamplingParams(max_tokens=8), SLO(tpot_ms=8.0))
    b = Request("b", [1] * 5, SamplingParams(max_tokens=100), SLO(tpot_ms=8.0))
    for r in (a, b):
        s.add(r)
    _run(s, s.schedule(0.0))
    a.token_ids.extend([3] * 4)
    a.num_computed_tokens = a.num_tokens - 1
    a.first_token_s, b.first_token_s = 0.0, 0.038
    # b has its first token only: skipped now, its 99 later tokens would have to beat 8 ms (791 / 100 = 7.91),
    # though the steps it decodes in are no shorter than a's pace needs: it stays
    assert s.schedule(0.039).decode == [a, b]


def _pressed_reply(mixed: str = "sum", **kw):
    """kairos over a model whose prefill costs 1 + 0.1 n ms (decode: 5 + 0.5 B), with one short reply running:
    8 ms TPOT, 5 tokens out, the first at t=0, so its 6th is due at 40 ms. At 30 ms a step may take 10 ms;
    steps are predicted with the gate's margin, 1.1 (`mixed`: how the model adds a hybrid step up)."""
    model = LatencyModel(prefill_coef=(0.1, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0), mixed=mixed)
    s = Scheduler(SchedulerConfig(policy="kairos", **{"vbs_margin": 1.1, **kw}), 256, 4, max_model_len=256,
                  predictor=model)
    a = Request("a", [1] * 5, SamplingParams(max_tokens=8), SLO(tpot_ms=8.0))
    s.add(a)
    _run(s, s.schedule(0.0))
    a.token_ids.extend([3] * 4)
    a.num_computed_tokens = a.num_tokens - 1
    a.first_token_s = 0.0
    return s, a


@pytest.mark.parametrize("hold", [True, False])
def test_prefill_hold_keeps_a_long_prompt_waiting_while_a_short_reply_cannot_absorb_its_step(hold):
    s, a = _pressed_reply(prefill_hold=hold)
    long = _req(1, 200, tpot=50.0, ttft=1000.0, arrival=0.03)  # its step: (21 ms prefill + 5.5 decode) x 1.1
    short = _req(2, 20, tpot=50.0, ttft=1000.0, arrival=0.03)  # (3 + 5.5) x 1.1 = 9.35 ms: absorbed
    for r in (long, short):
        s.add(r)
    p = s.schedule(0.030)
    assert p.prefill == ([short] if hold else [long, short]) and p.decode == [a]
    assert (long in s.waiting) == hold


@pytest.mark.parametrize("mixed,held", [("sum", True), ("shared", False)])
def test_prefill_hold_judges_a_step_as_the_fit_adds_its_prefill_and_decodes_up(mixed, held):
    """A 60-token prompt beside the pressed reply: its own prefill step and the decode step, (7 + 5.5) x 1.1 ms, is
    past the reply's 10 ms; where the fit found a hybrid step one forward (a GPU), its tokens beside the decode row
    cost (0.1 x 61 + 1) x 1.1 = 7.8 ms, within them."""
    s, a = _pressed_reply(mixed)
    mid = _req(1, 60, tpot=50.0, ttft=1000.0, arrival=0.03)
    s.add(mid)
    p = s.schedule(0.030)
    assert p.prefill == ([] if held else [mid]) and p.decode == [a] and (mid in s.waiting) == held


def test_prefill_hold_admits_a_long_prompt_whose_deadline_draws_near():
    s, a = _pressed_reply()
    # 90 ms to its deadline: more than its 21 ms prefill and the TTFT guard's 50 ms margin, less than twice
    # the prefill plus the margin (92 ms), so it waits no longer
    late = _req(1, 200, tpot=50.0, ttft=90.0, arrival=0.03)
    s.add(late)
    assert s.schedule(0.030).prefill == [late]


@pytest.mark.parametrize("replies,knob,kw,held", [
    (3, 3, {}, True), (2, 3, {}, False), (3, 0, {}, False), (3, 4, {}, False),
    # without the TTFT guard nothing would bound the wait: its deadline wins
    (3, 3, {"ttft_reject": False}, False),
    # chunked prefill: the step computes a 15-token chunk, (2.5 + 6.5) x 1.1 = 9.9 ms, within the replies' 10 ms
    (3, 3, {"chunked_prefill": True, "prefill_max_tokens": 15}, False)])
def test_a_prompt_whose_deadline_draws_near_is_held_anyway_when_its_step_would_make_enough_replies_late(
        replies, knob, kw, held):
    """prefill_hold_replies: a prompt whose TTFT deadline leaves no room to wait is still held when its step would
    bring at least that many running paced replies' next tokens late: more replies behind their TPOT than the one
    prompt it serves (0: its deadline always wins, as on a CPU replica by default)."""
    model = LatencyModel(prefill_coef=(0.1, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0))
    s = Scheduler(SchedulerConfig(policy="kairos", vbs_margin=1.1, prefill_hold_replies=knob, **kw), 256, 4,
                  max_model_len=256, predictor=model)
    running = [Request(f"r{i}", [1] * 5, SamplingParams(max_tokens=8), SLO(tpot_ms=8.0)) for i in range(replies)]
    for r in running:
        s.add(r)
    _run(s, s.schedule(0.0))
    for r in running:  # 5 tokens out, the first at 0: the 6th is due at 40 ms, 10 ms after the step below starts
        r.token_ids.extend([3] * 4)
        r.num_computed_tokens = r.num_tokens - 1
        r.first_token_s = 0.0
    late = _req(9, 200, tpot=50.0, ttft=90.0, arrival=0.03)  # its step: (21 + decode) x 1.1 ms, past 10 ms
    s.add(late)
    plan = s.schedule(0.030)
    assert (plan.prefill == []) == held and (late in s.waiting) == held
    assert plan.decode == running
    if kw.get("chunked_prefill"):
        assert plan.prefill_ends == [15]  # its first chunk


def test_a_gpu_replica_holds_such_a_prompt_for_three_late_replies():
    from engine.config import EngineConfig, for_device

    assert for_device(EngineConfig(), "cuda").scheduler.prefill_hold_replies == 3
    assert for_device(EngineConfig(), "cpu").scheduler.prefill_hold_replies == 0


@pytest.mark.parametrize("hold", [True, False])
def test_a_best_effort_prompt_goes_in_chunks_that_its_paced_replies_can_take(hold):
    """prefill_hold: a prompt with no TTFT deadline has none to wait against, so it is never held; where its whole
    prefill would make a paced reply late, it is computed in chunks that each step's slack allows (at least a
    block), decoding nothing until its last, and whole once no reply sets a limit."""
    s, a = _pressed_reply(prefill_hold=hold)
    long = _req(1, 200, arrival=0.03)  # best effort; the whole prompt: (21 + 5.5) x 1.1 ms, past the 10 ms left
    s.add(long)
    p = s.schedule(0.030)
    assert p.prefill == [long] and p.decode == [a]
    if not hold:
        assert p.prefill_ends == [200] and p.requests == [long, a]
        return
    # (1 + 0.1 x 25 + 5.5) x 1.1 = 9.9 ms fits the reply's 10 ms, 26 tokens would not
    assert p.prefill_ends == [25] and p.requests == [a] and p.num_prefill_tokens == 25
    _step(s, p)
    assert long.num_computed_tokens == 25 and long.first_token_s is None and a.num_output_tokens == 6
    # at 40 ms the reply's 7th token is due in 8 ms: not even a block fits beside its 6 ms decode; a block goes anyway
    p = s.schedule(0.040)
    assert p.prefill == [long] and p.prefill_ends == [29] and p.decode == [a] and p.requests == [a]
    _step(s, p)
    s.finish(a, FinishReason.STOP, 0.045)
    p = s.schedule(0.045)  # no paced reply: the rest of the prompt, and its first token
    assert p.prefill == [long] and p.prefill_ends == [200] and p.decode == [] and p.requests == [long]


@pytest.mark.parametrize("policy,ends", [("kairos", [64, 128, 150]), ("fcfs", [150])])
def test_a_best_effort_prompt_beside_running_replies_goes_in_chunks_of_the_budget(policy, ends):
    """With no paced reply to mind, a long best-effort prompt admitted while others decode still takes at most the
    prompt budget a step (kairos), so that the replies' streams go on beside it; alone it is prefilled whole."""
    s = _sched(policy, prefill_max_tokens=64)
    a = _req(0, 5)
    s.add(a)
    _step(s, s.schedule(0.0))
    long = _req(1, 150)
    s.add(long)
    got = []
    for _ in ends:
        p = s.schedule(0.0)
        assert p.prefill == [long] and (a in p.decode) == (policy == "kairos")
        got += p.prefill_ends
        _step(s, p)
    assert got == ends and long.num_output_tokens == 1


def _long_prompt_beside_a_reply(model: LatencyModel) -> tuple[Scheduler, Request, Request]:
    """kairos (prefill_max_tokens 64) over `model`, a reply without SLOs decoding throughout, and a best-effort prompt
    of 400 tokens just added."""
    s = Scheduler(SchedulerConfig(policy="kairos", prefill_max_tokens=64), 256, 4, max_model_len=512, predictor=model)
    a = Request("a", [1] * 5, SamplingParams(max_tokens=400))
    return s, a, _prompt_beside(s, a, 400)


def _prompt_beside(s: Scheduler, reply: Request, n: int) -> Request:
    """`reply` admitted and through its first step, then a best-effort prompt of `n` tokens added (returned)."""
    s.add(reply)
    _step(s, s.schedule(0.0))
    long = _req(1, n)
    s.add(long)
    return long


def test_a_best_effort_chunk_deep_in_a_long_prompt_takes_no_longer_than_a_fresh_prompt_of_the_budget():
    """Beside running replies a chunk's time, not only its tokens, is capped: deep in a long prompt each token attends
    to all before it, so the later chunks are shorter, each predicted at most as long as a fresh prompt of
    prefill_max_tokens."""
    model = LatencyModel(prefill_coef=(0.01, 1.0, 1e-4), decode_coef=(0.0, 0.5, 0.0, 5.0))  # + 1e-4 ms a token pair
    s, a, long = _long_prompt_beside_a_reply(model)
    cap = model.prefill_ms(64, 64 * 64)
    ends = []
    while long.num_output_tokens == 0:
        p = s.schedule(0.0)
        assert p.prefill == [long] and p.decode == [a]
        start, end = long.num_computed_tokens, p.prefill_ends[0]
        assert end - start <= 64 and model.prefill_ms(end - start, end * end - start * start) <= cap
        ends.append(end)
        _step(s, p)
    chunks = [e - b for b, e in zip([0] + ends, ends)]
    assert ends[-1] == 400 and chunks[0] == 64 and max(chunks[-3:]) < 20  # the later chunks far shorter


def test_best_effort_prompts_in_chunks_go_after_the_rounds_admissions_and_none_starves():
    """Without chunked_prefill, best-effort prompts in chunks take their step's chunk after this round's admissions,
    so a prompt with a deadline is judged (and admitted) as if they were not there, in what is left of the budget;
    each still moves at least a block a step, and none is decoded while its prompt is partly computed."""
    s, a = _pressed_reply()
    one, two = _req(1, 200, arrival=0.03), _req(2, 200, arrival=0.03)
    for r in (one, two):
        s.add(r)
    p = s.schedule(0.030)  # one: 25 tokens, as alone; two beside it: (1 + 0.1 x 29 + 5.5) x 1.1 > 10 ms, a block
    assert p.prefill == [one, two] and p.prefill_ends == [25, 4] and p.decode == [a]
    _step(s, p)
    s.config.prefill_max_tokens = 4
    slo = _req(3, 20, tpot=50.0, ttft=1000.0, arrival=0.031)  # (1 + 0.1 x 20 + 6) x 1.1 = 9.9 ms: it fits alone
    s.add(slo)
    p = s.schedule(0.031)
    assert p.prefill == [slo, one, two] and p.prefill_ends == [20, 29, 8] and p.decode == [a]
    assert p.requests == [slo, a]
    _step(s, p)
    assert (one.num_computed_tokens, two.num_computed_tokens) == (29, 8) and one.num_output_tokens == 0


def test_a_best_effort_chunk_takes_only_what_the_rounds_admissions_left_of_the_budget():
    """A best-effort prompt in progress computes its next chunk in what this round's admissions left of
    prefill_max_tokens (at least a block), not in a whole budget beside them: the step stays within the budget the
    admitted prompt's TTFT was predicted with."""
    s, _, long = _long_prompt_beside_a_reply(LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0)))
    p = s.schedule(0.0)
    assert p.prefill == [long] and p.prefill_ends == [64]
    _step(s, p)
    slo = _req(2, 60, tpot=50.0, ttft=10_000.0)
    s.add(slo)
    p = s.schedule(0.0)
    assert p.prefill == [slo, long] and p.prefill_ends == [60, 68] and p.num_prefill_tokens == 64
    _step(s, p)
    big = _req(3, 64, tpot=50.0, ttft=10_000.0)  # the whole budget: the prompt in progress still moves a block
    s.add(big)
    p = s.schedule(0.0)
    assert p.prefill == [big, long] and p.prefill_ends == [64, 72]


def test_a_best_effort_prompt_left_running_alone_finishes_whole():
    """Once the replies beside a best-effort prompt in progress have ended, the rest of it is prefilled in one step,
    as a prompt admitted alone is."""
    s, a = _sched("kairos", blocks=128, prefill_max_tokens=64), _req(0, 5)
    long = _prompt_beside(s, a, 200)
    p = s.schedule(0.0)
    assert p.prefill_ends == [64] and p.decode == [a]
    _step(s, p)
    s.finish(a, FinishReason.STOP, 0.0)
    p = s.schedule(0.0)
    assert p.prefill == [long] and p.prefill_ends == [200] and p.requests == [long]


def test_prefill_hold_lets_a_reply_past_saving_set_no_limit():
    s, a = _pressed_reply()
    long = _req(1, 200, tpot=50.0, ttft=1000.0, arrival=0.03)
    s.add(long)
    # at 60 ms the reply is 20 ms late for its 6th token: behind its pace whatever the step, it holds no prompt back
    assert s.schedule(0.060).prefill == [long]



def test_work_shedding_measures_capacity_only_on_rejections_that_mean_the_replica_is_full():
    s = _sched("kairos", prefill_hold=False, work_shedding=True)  # TTFT guard margin 50 ms; prefill 1 + 0.01 n ms
    a = _req(0, 5, tpot=50.0)
    s.add(a)
    _run(s, s.schedule(0.0))
    a.first_token_s = 0.0
    hopeless = _req(1, 5, ttft=40.0, arrival=0.01)  # 40 ms: less than its prefill plus the margin, even alone
    s.add(hopeless)
    p = s.schedule(0.01)
    assert [r for r, _ in p.rejected] == [hopeless]
    assert not s.shedder.saturated_now(0.01)  # says nothing about this replica's load
    late = _req(2, 5, ttft=100.0, arrival=0.01)  # feasible alone, but 80 ms of it went waiting
    s.add(late)
    p = s.schedule(0.09)
    assert [r for r, _ in p.rejected] == [late]
    assert s.shedder.saturated_now(0.09)


def _reply(name, prompt, out, tpot=10.0, ttft=None, arrival=0.0):
    return Request(name, [1] * prompt, SamplingParams(max_tokens=out), SLO(ttft_ms=ttft, tpot_ms=tpot),
                   arrival_s=arrival)


def _full_batch(**kw):
    """kairos (margin 1.1) with 6 running replies of TPOT 10 ms: the gate, (5 + 0.5 VBS) x 1.1 < 0.99 x 10, has room
    for one more."""
    s = _sched("kairos", prefill_hold=False, vbs_margin=1.1, **kw)
    for i in range(6):
        s.add(_reply(f"a{i}", 4, 50))
    _run(s, s.schedule(0.0))
    assert len(s.running) == 6
    return s


@pytest.mark.parametrize("short_first", [False, True])
def test_short_first_gives_the_room_to_the_least_work_and_keeps_the_rest_waiting(short_first):
    s = _full_batch(short_first=short_first)
    long = _reply("long", 4, 100, ttft=1000.0, arrival=0.001)  # the earlier deadline
    short = _reply("short", 4, 5, ttft=1000.0, arrival=0.002)
    s.add(long)
    s.add(short)
    p = s.schedule(0.01)
    if short_first:
        assert p.prefill == [short] and p.rejected == [] and list(s.waiting) == [long]
    else:  # least deadline first, and a request the gate turns away is rejected at once
        assert p.prefill == [long] and p.rejected == [(short, "tpot_unattainable")] and not s.waiting


def test_a_request_short_first_keeps_waiting_for_room_tells_work_shedding_the_replica_is_full():
    s = _full_batch(short_first=True, work_shedding=True)
    s.add(_reply("short", 4, 5, ttft=1000.0, arrival=0.001))
    _run(s, s.schedule(0.01))  # the batch's last room
    assert not s.shedder.saturated_now(0.02)
    s.add(_reply("long", 4, 100, ttft=1000.0, arrival=0.02))
    p = s.schedule(0.02)
    assert p.prefill == [] and not p.rejected and len(s.waiting) == 1  # kept waiting, not rejected...
    assert s.shedder.saturated_now(0.02)  # ...but turned away for capacity all the same


def test_short_first_admits_a_waiting_request_once_the_batch_makes_room():
    s = _full_batch(short_first=True)
    s.add(_reply("short", 4, 5, ttft=1000.0, arrival=0.001))
    _run(s, s.schedule(0.01))
    long = _reply("long", 4, 100, ttft=1000.0, arrival=0.002)
    s.add(long)
    assert s.schedule(0.02).prefill == [] and list(s.waiting) == [long]
    s.finish(s.running[0], "length", 0.03)
    assert s.schedule(0.03).prefill == [long]


def test_short_first_waits_only_within_the_ttft_slo():
    s = _full_batch(short_first=True)
    s.add(_reply("short", 4, 5, ttft=1000.0, arrival=0.0))
    _run(s, s.schedule(0.0))
    no_ttft = _reply("no_ttft", 4, 100, arrival=0.001)  # no deadline: waiting for room would be unbounded
    timed = _reply("timed", 4, 100, ttft=200.0, arrival=0.001)
    s.add(no_ttft)
    s.add(timed)
    p = s.schedule(0.01)
    assert p.rejected == [(no_ttft, "tpot_unattainable")] and list(s.waiting) == [timed]
    # 49 ms before its deadline: less than its prefill (1.04 ms) plus the TTFT guard's 50 ms margin is left
    p = s.schedule(0.001 + 0.2 - 0.049)
    assert p.rejected == [(timed, "ttft_unattainable")] and not s.waiting


def test_order_least_work_puts_started_replies_first_then_the_least_work():
    from collections import deque

    from scheduling.queues import order_least_work

    started = _reply("started", 4, 50, ttft=5000.0)
    started.first_token_s = 0.0
    heavy, light = _reply("heavy", 4, 40, ttft=100.0), _reply("light", 4, 20, ttft=900.0)
    tie_late, tie_early = _reply("tie_late", 4, 20, ttft=950.0), _reply("tie_early", 4, 20, ttft=800.0)
    q = deque([heavy, tie_late, light, started, tie_early])
    order_least_work(q, lambda r: r.expected_output_len)
    assert list(q) == [started, tie_early, light, tie_late, heavy]
    # those whose TTFT deadline falls before the next room (heavy's, 100 ms) go before the fresh ones that can wait
    order_least_work(q, lambda r: r.expected_output_len, urgent_before=0.5)
    assert list(q) == [started, heavy, tie_early, light, tie_late]


@pytest.mark.parametrize("policy", ["kairos", "scorpio"])
def test_kairos_measures_its_ttft_margin_on_its_own_admissions(policy):
    """kairos's TTFT guard keeps a request the fixed 50 ms margin would reject, once its admissions show first tokens
    coming within a few ms of the predicted prefill; scorpio keeps SCORPIO's fixed margin."""
    from core.request import FinishReason
    s = _sched(policy)
    t = 0.0
    for i in range(40):  # one request at a time: its first token 2 ms after its predicted prefill (1 + 0.01 * 100)
        r = _req(i, 100, ttft=1_000.0, arrival=t)
        s.add(r)
        plan = s.schedule(t)
        assert plan.prefill == [r]
        t += (2.0 + 2.0) / 1000.0
        s.postprocess(plan, [3] * len(plan.requests), t)
        s.finish(r, FinishReason.STOP, t)
    late = _req(99, 100, ttft=30.0, arrival=t)  # 30 ms: 2 ms of prefill + 2 measured fit, + 50 fixed does not
    s.add(late)
    plan = s.schedule(t)
    if policy == "kairos":
        assert s.ttft_margin_ms() == pytest.approx(2.0) and plan.prefill == [late] and not plan.rejected
    else:
        assert s.ttft_margin_ms() == 50.0 and plan.rejected == [(late, "ttft_unattainable")]


def test_one_long_prompt_the_model_underestimated_does_not_turn_away_short_requests():
    """kairos: after short admissions whose first tokens came 2 ms past their predicted prefill, one long prompt's
    came 16 s late (the model extrapolated to it). A short request with a 100 ms TTFT SLO is still admitted at
    once; a prompt as long as that one, with a 10 s SLO, is turned away by what that one measured."""
    from core.request import FinishReason
    s = Scheduler(SchedulerConfig(policy="kairos"), 4096, 4, max_model_len=10_000,
                  predictor=LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0)))
    t = 0.0

    def admit(r, took_s):
        nonlocal t
        s.add(r)
        plan = s.schedule(t)
        assert plan.prefill == [r] and not plan.rejected
        t += took_s
        s.postprocess(plan, [3] * len(plan.requests), t)
        s.finish(r, FinishReason.STOP, t)

    for i in range(40):
        admit(_req(i, 100, ttft=1_000.0, arrival=t), (2.0 + 2.0) / 1000.0)  # predicted 2 ms, took 4
    admit(_req(50, 8000, ttft=60_000.0, arrival=t), (81.0 + 16_000.0) / 1000.0)  # predicted 81 ms
    short = _req(51, 100, ttft=100.0, arrival=t)
    s.add(short)
    plan = s.schedule(t)
    assert plan.prefill == [short] and not plan.rejected and s.ttft_margin_ms(2.0) == pytest.approx(2.0)
    _run(s, plan)
    s.finish(short, FinishReason.STOP, t)
    long = _req(52, 8000, ttft=10_000.0, arrival=t)
    s.add(long)
    assert s.schedule(t).rejected == [(long, "ttft_unattainable")]


@pytest.mark.parametrize("reserve", [True, False])
def test_a_request_that_can_wait_leaves_room_for_one_that_cannot(reserve):
    """kairos (impatient_reserve): with replies finishing every ~250 ms and arrivals whose TTFT SLO (100 ms) is shorter
    than that, a fresh request with seconds of TTFT slack is admitted only if the gate keeps room for one of them."""
    s = _sched("kairos", prefill_hold=False, vbs_margin=1.1, impatient_reserve=reserve)
    for k in range(8):  # one impatient request at a time, finished 10 ms after it arrived
        w = _reply(f"w{k}", 4, 50, ttft=100.0, arrival=0.25 * k)
        s.add(w)
        assert s.schedule(0.25 * k).prefill == [w]
        s.finish(w, "length", 0.25 * k + 0.01)
    for i in range(6):  # no TTFT SLO: they can wait, and leave room for one more: (5 + 0.5 x 7) x 1.1 < 9.9
        s.add(_reply(f"a{i}", 4, 50, arrival=2.0))
    _run(s, s.schedule(2.0))
    assert len(s.running) == 6
    patient = _reply("patient", 4, 50, ttft=5000.0, arrival=2.01)
    s.add(patient)
    p = s.schedule(2.01)
    if not reserve:
        assert p.prefill == [patient]
        return
    assert s.reserve.patience_ms(2.01) == pytest.approx(1000.0 * 2.0 / 8) and p.prefill == [] \
        and list(s.waiting) == [patient]
    urgent = _reply("urgent", 4, 50, ttft=100.0, arrival=2.02)
    s.add(urgent)
    p = s.schedule(2.02)
    assert p.prefill == [urgent]  # the room it was kept (the patient one now fails the gate)


def test_no_room_is_kept_for_impatient_arrivals_that_fail_the_gate_even_alone():
    """kairos (impatient_reserve): impatient arrivals whose TPOT SLO (1 ms) is below one request's ITL alone are
    rejected; room kept for them would keep a patient request waiting on an idle replica until its deadline."""
    s = _sched("kairos", prefill_hold=False, vbs_margin=1.1, impatient_reserve=True)
    for k in range(8):  # a finish every 250 ms (patient arrivals)
        w = _reply(f"w{k}", 4, 50, ttft=10_000.0, arrival=0.25 * k)
        s.add(w)
        assert s.schedule(0.25 * k).prefill == [w]
        s.finish(w, "length", 0.25 * k + 0.01)
    for k in range(3):
        bad = _reply(f"bad{k}", 4, 50, tpot=1.0, ttft=100.0, arrival=2.0)
        s.add(bad)
        p = s.schedule(2.0)
        assert p.rejected == [(bad, "tpot_unattainable")]
        s.finish(bad, "rejected", 2.0)
    patient = _reply("patient", 4, 50, ttft=5000.0, arrival=2.01)
    s.add(patient)
    assert s.schedule(2.01).prefill == [patient]


@pytest.mark.parametrize("urgent_first", [True, False])
def test_room_goes_first_to_the_request_that_cannot_wait_for_the_next(urgent_first):
    """kairos (short_first, urgent_first): replies finish every ~250 ms. Room for one request opens; a short reply
    that can wait seconds and a longer one whose TTFT SLO (100 ms) runs out before the next room both wait. Least
    work first gives the room to the short one and loses the other; urgent_first gives it to the one that cannot
    wait, and the short one takes the next room."""
    s = _sched("kairos", prefill_hold=False, vbs_margin=1.1, impatient_reserve=False, urgent_first=urgent_first,
               work_shedding=False, length_predictor=False, short_first=True)
    for k in range(8):  # finishes every 250 ms
        w = _reply(f"w{k}", 4, 50, ttft=100.0, arrival=0.25 * k)
        s.add(w)
        assert s.schedule(0.25 * k).prefill == [w]
        s.finish(w, "length", 0.25 * k + 0.01)
    full = [_reply(f"a{i}", 4, 50, arrival=2.0) for i in range(7)]
    for r in full:
        s.add(r)
    _run(s, s.schedule(2.0))
    assert len(s.running) == 7  # the gate fits no eighth
    patient, urgent = _reply("patient", 4, 10, ttft=5000.0, arrival=2.01), _reply("urgent", 4, 40, ttft=100.0,
                                                                                   arrival=2.01)
    s.add(patient)
    s.add(urgent)
    assert s.schedule(2.01).prefill == [] and set(s.waiting) == {patient, urgent}  # both wait for room
    s.finish(full[0], "length", 2.02)
    p = s.schedule(2.02)
    assert p.prefill == ([urgent] if urgent_first else [patient])


def test_block_manager_holds_a_sequence_whose_blocks_have_its_slots_and_grows_one_that_needs_more():
    from core.kv import BlockManager

    bm = BlockManager(num_blocks=4, block_size=16)
    r = _req(0, 16)
    assert not bm.holds(r, 16) and bm.can_fit(r, 16)
    bm.ensure(r, 16)
    assert bm.holds(r, 16) and bm.extra_blocks_for(r, 16) == 0  # a full block: nothing more for these tokens
    assert not bm.holds(r, 17) and bm.extra_blocks_for(r, 17) == 1
    bm.ensure(r, 17)
    assert bm.holds(r, 32) and bm.num_free == 2


def test_block_manager_hands_out_the_lowest_free_blocks_so_the_running_kv_stays_compact():
    from core.kv import BlockManager

    bm = BlockManager(num_blocks=8, block_size=4)
    a, b, c = _req(0, 8), _req(1, 8), _req(2, 4)
    for r in (a, b):
        bm.ensure(r, 8)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(a)
    bm.ensure(c, 4)
    assert c.block_table == [0]  # the freed low blocks again, not the never-used high ones
    bm.ensure(b, 12)
    bm.ensure(c, 8)
    assert b.block_table == [2, 3, 1] and c.block_table == [0, 4] and bm.num_free == 3
    for r in (b, c):
        bm.free(r)
    assert bm.num_free == 8
    d = _req(3, 32)
    bm.ensure(d, 32)
    assert d.block_table == list(range(8)) and bm.num_free == 0


def test_the_gate_line_a_router_reads_is_the_vbs_gates_own_test():
    """Scheduler.gate_line (reported to the router): a request of TPOT T joining passes the VBS gate exactly where
    base + row x VBS' < T_min', VBS' counting each request at T_min' / its TPOT."""
    from scheduling.tpot_guard import VBSGate

    s = _sched("kairos")
    a = _req(0, 5, tpot=10.0)
    s.add(a)
    _run(s, s.schedule(0.0))
    base, row = s.gate_line(0.0)
    verdicts = []
    for tpot in (6.0, 6.2, 6.5, 8.0, 12.0, 40.0):
        gate = VBSGate(s.running, s.predictor.itl_ms, margin=s.flags.vbs_margin, slack=s.config.vbs_slack)
        t_min = min(10.0, tpot)
        verdicts.append(gate.check(_req(1, 5, tpot=tpot)))
        assert verdicts[-1] == (base + row * (t_min / 10.0 + t_min / tpot) < t_min)
    assert verdicts == [False, True, True, True, True, True]
    assert _sched("fcfs").gate_line(0.0) is None  # no gate: nothing to report


def test_a_bursts_margin_does_not_turn_away_requests_on_the_idle_replica_after_it():
    """kairos: 40 requests admitted in rounds of 8 had their first tokens 500 ms past their predicted prefill (a
    burst: a queue of prefills, on a CPU the HTTP work on the same cores). On the replica idle afterwards, a short
    request with a 100 ms TTFT SLO is admitted: the margin of admissions made under load does not apply where nothing
    runs (an idle replica's margin is of the admissions made alone, or at most the configured one). A busy replica
    still uses it, until its errors are older than ttft_margin_window_s."""
    from core.request import FinishReason
    s = Scheduler(SchedulerConfig(policy="kairos"), 4096, 4, max_model_len=2048,
                  predictor=LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0)))
    t = 0.0
    for k in range(5):
        burst = [_req(8 * k + i, 100, ttft=5_000.0, arrival=t) for i in range(8)]
        for r in burst:
            s.add(r)
        plan = s.schedule(t)
        assert plan.prefill == burst
        t += 0.5 + 0.009  # the round's 8 x 100 tokens predicted at 9 ms; its first tokens came 500 ms later
        s.postprocess(plan, [3] * len(plan.requests), t)
        for r in burst:
            s.finish(r, FinishReason.STOP, t)
    assert s.ttft_margin_ms(2.0, idle=False) > 400.0 and s.ttft_margin_ms(2.0, idle=True) <= 50.0
    short = _req(99, 100, ttft=100.0, arrival=t)
    s.add(short)
    plan = s.schedule(t)
    assert plan.prefill == [short] and not plan.rejected
    s.finish(short, FinishReason.STOP, t)
    s.schedule(t + s.config.ttft_margin_window_s + 1.0)  # a minute later the burst's errors are gone
    assert s.ttft_margin_ms(2.0, idle=False) == s.config.ttft_margin_ms


def test_only_a_round_of_one_counts_as_admitted_alone():
    """The first request of a round of 8 on an idle replica waits for the whole round's prefill: its error is the
    burst's, and must not enter the idle replica's margin (measured on 40 requests admitted one at a time)."""
    from core.request import FinishReason
    s = Scheduler(SchedulerConfig(policy="kairos"), 4096, 4, max_model_len=2048,
                  predictor=LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0)))
    t = 0.0
    for i in range(40):
        r = _req(i, 100, ttft=5_000.0, arrival=t)
        s.add(r)
        plan = s.schedule(t)
        t += 0.004  # predicted 2 ms, took 4
        s.postprocess(plan, [3] * len(plan.requests), t)
        s.finish(r, FinishReason.STOP, t)
    burst = [_req(100 + i, 100, ttft=5_000.0, arrival=t) for i in range(8)]
    for r in burst:
        s.add(r)
    plan = s.schedule(t)
    assert plan.prefill == burst and not any(r.ttft_estimate[2] for r in burst)
    t += 0.509
    s.postprocess(plan, [3] * len(plan.requests), t)
    for r in burst:
        s.finish(r, FinishReason.STOP, t)
    assert s.ttft_margin_ms(2.0, idle=True) == pytest.approx(2.0)


def test_the_virtual_batch_size_is_zero_once_the_last_request_ends():
    """An idle engine does not step: the VBS its stats (and the SLO router) read must not keep the last batch's."""
    s = _sched("scorpio")
    a, b = _req(0, 5, tpot=20.0), _req(1, 5, tpot=40.0)
    for r in (a, b):
        s.add(r)
    for _ in range(3):
        p = s.schedule(0.0)
        _run(s, p)
    assert s.last_vbs > 0
    s.finish(a, FinishReason.STOP, 0.1)
    assert s.last_vbs > 0  # b still runs
    s.finish(b, FinishReason.STOP, 0.1)
    assert s.last_vbs == 0.0


def test_the_gate_prices_the_lora_adapters_the_batch_would_run_through():
    """A model fitted on an engine that serves LoRA adapters prices a decode step's adapters (`lora_coef`): a strict
    request that fits beside a base-model reply is turned away beside a reply that runs through an adapter, and so is
    one that would bring an adapter of its own into the batch."""
    reasons = []
    for running_lora, own_lora in ((0, 0), (7, 0), (0, 9)):
        model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0), lora_coef=(10.0, 0.0, 0.0))
        s = Scheduler(SchedulerConfig(policy="scorpio"), 64, 4, max_model_len=256, predictor=model)
        assert s.latency is model and s.predictor is not model
        first = _req(0, 4, tpot=100.0)
        first.lora_id = running_lora
        s.add(first)
        _run(s, s.schedule(0.0))
        strict = _req(1, 4, tpot=15.0)  # itl(2) = 6 ms; with an adapter's 10 ms more, 16 ms: past 15 / 1.3
        strict.lora_id = own_lora
        s.add(strict)
        plan = s.schedule(0.01)
        reasons.append([why for _, why in plan.rejected])
        assert s.predictor.itl_ms(2, 8) == model.itl_ms(2, 8) + (10.0 if running_lora else 0.0)  # (the batch's)
    assert reasons == [[], ["tpot_unattainable"], ["tpot_unattainable"]]


# --- vLLM's priority scheduling (SchedulerConfig.scheduling_policy) ---
def _ranked(r, priority):
    r.priority = priority
    return r


@pytest.mark.parametrize("policy", ["fcfs", "scorpio", "kairos"])
def test_priority_scheduling_admits_the_lowest_priority_value_first_within_the_policys_order(policy):
    s = _sched(policy, max_num_seqs=2, prefill_hold=False, scheduling_policy="priority")
    late = [_ranked(_req(i, 4, ttft=1000.0, arrival=0.001 * i), 5) for i in range(3)]
    urgent = _ranked(_req(9, 40, ttft=5000.0, arrival=0.01), -1)  # the most work, the latest deadline, the last
    zero = _ranked(_req(8, 4, ttft=1000.0, arrival=0.009), 0)
    for r in (*late, zero, urgent):
        s.add(r)
    p = s.schedule(0.02)
    assert p.prefill == [urgent, zero]
    assert list(s.waiting) == late  # the policy's order among equals (arrival, deadline, work: all alike)


def test_without_priority_scheduling_the_priority_is_not_read():
    s = _sched("fcfs", max_num_seqs=1)
    a, b = _ranked(_req(0, 4), 5), _ranked(_req(1, 4, arrival=0.001), -5)
    s.add(a)
    s.add(b)
    assert s.schedule(0.01).prefill == [a]


@pytest.mark.parametrize("admission", ["fifo", "pack"])
def test_a_request_that_waits_for_room_keeps_every_higher_priority_value_waiting(admission):
    """kairos with short_first keeps a request the gate has no room for waiting, and admits one behind it that
    fits; with priority scheduling one of a higher priority value waits behind it, and one of the same does not."""
    s = _full_batch(short_first=True, scheduling_policy="priority", prefill_admission_policy=admission)
    s.add(_reply("short", 4, 5, ttft=1000.0, arrival=0.001))
    _run(s, s.schedule(0.01))  # the batch's last room
    s.finish(s.running[-1], "length", 0.02)  # room for one more of TPOT 10 ms
    strict = _ranked(_reply("strict", 4, 5, tpot=8.0, ttft=1000.0, arrival=0.02), 0)  # no room for its 8 ms
    light_low = _ranked(_reply("light_low", 4, 5, ttft=1000.0, arrival=0.021), 1)
    s.add(strict)
    s.add(light_low)
    p = s.schedule(0.03)
    assert p.prefill == [] and not p.rejected and list(s.waiting) == [strict, light_low]
    light_same = _ranked(_reply("light_same", 4, 5, ttft=1000.0, arrival=0.031), 0)
    s.add(light_same)
    p = s.schedule(0.031)
    assert p.prefill == [light_same] and list(s.waiting) == [strict, light_low]
    # without priority scheduling light_low takes the room at once
    s = _full_batch(short_first=True, prefill_admission_policy=admission)
    s.add(_reply("short", 4, 5, ttft=1000.0, arrival=0.001))
    _run(s, s.schedule(0.01))
    s.finish(s.running[-1], "length", 0.02)
    strict = _ranked(_reply("strict", 4, 5, tpot=8.0, ttft=1000.0, arrival=0.02), 0)
    light_low = _ranked(_reply("light_low", 4, 5, ttft=1000.0, arrival=0.021), 1)
    s.add(strict)
    s.add(light_low)
    assert s.schedule(0.03).prefill == [light_low]


def test_pack_admission_by_priority_leaves_no_lower_priority_ahead_of_one_over_the_budget():
    s = _sched("pack", max_num_seqs=8, prefill_max_tokens=16, scheduling_policy="priority")
    big = _ranked(_req(0, 16), 0)
    small_same, small_low = _ranked(_req(1, 4, arrival=0.001), 0), _ranked(_req(2, 4, arrival=0.002), 1)
    small_low2 = _ranked(_req(3, 4, arrival=0.003), 1)
    for r in (small_low, big, small_low2, small_same):
        s.add(r)
    p = s.schedule(0.01)
    # priority 0 first, smallest first: small_same (4), then big (16) would pass the budget of 16: the priority-1
    # ones wait behind it, though they would fit
    assert p.prefill == [small_same] and list(s.waiting) == [big, small_low, small_low2]
    _run(s, p)
    assert s.schedule(0.02).prefill == [big]


def test_priority_scheduling_preempts_the_lowest_priority_first():
    s = _sched("fcfs", blocks=6, scheduling_policy="priority")  # 24 token slots
    a, b = _ranked(_req(0, 8), 0), _ranked(_req(1, 8, arrival=0.001), -1)
    s.add(a)
    s.add(b)
    p = s.schedule(0.0)
    assert p.prefill == [b, a]  # b first by its priority; both admitted
    _run(s, p)
    for _ in range(20):  # both grow into the 2 free blocks, then one must make room
        p = s.schedule(0.0)
        _run(s, p)
        if p.preempted:
            break
    # a was admitted first (vLLM's choice would take b, the most recent): its priority value is the higher
    assert p.preempted == [a] and p.decode == [b]
    assert a.status is Status.WAITING and s.waiting[0] is a


@pytest.mark.parametrize("policy,knobs", [("fcfs", {"chunked_prefill": True, "hybrid_steps": True,
                                                     "prefill_max_tokens": 4}), ("kairos", {"prefill_max_tokens": 4})])
def test_priority_scheduling_preempts_a_lower_priority_prompt_in_the_step_before_a_higher_reply(policy, knobs):
    """A reply of priority 0 needs a block while a prompt of priority 5 is being computed in chunks beside it (chunked
    prefill with hybrid steps; kairos's default sends a best-effort prompt so): the prompt leaves the step and is
    preempted, as vLLM chooses over every running request; the reply preempted itself, the prompt kept its blocks."""
    s = _sched(policy, blocks=7, scheduling_policy="priority", **knobs)
    hi = _ranked(_req(0, 7), 0)
    s.add(hi)
    _run(s, s.schedule(0.0))
    lo = _ranked(_req(1, 19, arrival=0.001), 5)  # 5 blocks, prefilled 4 tokens at a time
    s.add(lo)
    for step in range(6):
        p = s.schedule(0.01 * (step + 1))
        for r, e in zip(p.prefill, p.prefill_ends):
            r.num_computed_tokens = e
            if e >= r.num_tokens:
                r.token_ids.append(3)
        for r in p.decode:
            r.num_computed_tokens = r.num_tokens
            r.token_ids.append(3)
        if p.preempted:
            break
    assert p.preempted == [lo] and p.decode == [hi] and lo not in p.prefill
    assert hi.status is Status.RUNNING and lo.status is Status.WAITING and s.waiting[0] is lo


def test_with_the_queue_full_a_more_urgent_arrival_takes_the_place_of_the_least_urgent():
    """vLLM's priority queue has no bound; Kairos's has (max_waiting): there a request of a lower priority value
    turns the one of the highest value (the latest of them) away as overloaded, not itself."""
    s = _sched("fcfs", max_num_seqs=1, max_waiting=2, scheduling_policy="priority")
    running = _req(0, 4)
    s.add(running)
    _run(s, s.schedule(0.0))
    low_early, low_late = _ranked(_req(1, 4, arrival=0.001), 5), _ranked(_req(2, 4, arrival=0.002), 5)
    assert s.add(low_early) is None and s.add(low_late) is None
    assert s.add(_ranked(_req(3, 4, arrival=0.003), 5)) == "overloaded"  # none below it: itself
    urgent = _ranked(_req(4, 4, arrival=0.004), -1)
    assert s.add(urgent) is None
    p = s.schedule(0.01)
    assert p.rejected == [(low_late, "overloaded")] and list(s.waiting) == [urgent, low_early]


def test_a_request_evicted_for_a_more_urgent_one_and_aborted_before_the_next_round_is_not_rejected():
    """A request `_evict_for` turned away is reported at the next schedule; one that ended before it (its client
    aborted) is ended once, not reported as rejected too."""
    from core.request import FinishReason

    s = _sched("fcfs", max_num_seqs=1, max_waiting=1, scheduling_policy="priority")
    s.add(_req(0, 4))
    _run(s, s.schedule(0.0))
    evicted = _ranked(_req(1, 4, arrival=0.001), 5)
    assert s.add(evicted) is None and s.add(_ranked(_req(2, 4, arrival=0.002), -1)) is None
    assert s.finish(evicted, FinishReason.ABORT, 0.005)
    assert s.schedule(0.01).rejected == []


@pytest.mark.parametrize("policy", ["scorpio", "tpot_guard"])
def test_a_request_the_vbs_gate_turns_away_leaves_the_ones_after_it_to_be_judged_on_their_own(policy):
    """Ten requests at TPOT 20 decode; one at TPOT 8 fails the gate (ITL(11) = 10.5 ms x 1.3 > 0.99 x 8) and is turned
    away; the twenty at TPOT 1000 behind it each pass, and are admitted. The gate's head-of-line stop after a
    failure made every one of them fail too: all 21 were turned away as tpot_unattainable. (Held instead, SCORPIO's
    way, the failing request stops the round, and all wait.)"""
    s = _sched(policy, blocks=256)
    for i in range(10):
        s.add(_req(i, 4, tpot=20.0, ttft=10_000))
    _run(s, s.schedule(0.0))
    strict = _req(100, 4, tpot=8.0, ttft=10_000)
    loose = [_req(200 + j, 4, tpot=1000.0, ttft=10_000) for j in range(20)]
    for r in [strict, *loose]:
        s.add(r)
    p = s.schedule(0.01)
    assert [r for r, _ in p.rejected] == [strict] and p.prefill == loose
    held = _sched(policy, blocks=256, tpot_on_fail="hold")
    for i in range(10):
        held.add(_req(i, 4, tpot=20.0, ttft=10_000))
    _run(held, held.schedule(0.0))
    for r in [_req(100, 4, tpot=8.0, ttft=10_000), *(_req(200 + j, 4, tpot=1000.0, ttft=10_000) for j in range(20))]:
        held.add(r)
    p = held.schedule(0.01)
    assert p.prefill == [] and p.rejected == [] and len(held.waiting) == 21


@pytest.mark.parametrize("policy", ["scorpio", "tpot_guard", "kairos"])
def test_a_reply_of_one_token_has_no_tpot_to_keep(policy):
    """max_tokens 1: the reply ends at its prefill, with no inter-token latency (the scheduler never counts it a TPOT
    miss); a TPOT SLO no step could keep does not turn it away, nor set the batch's pace."""
    s = _sched(policy)
    one = Request("r0", _prompt(0, 4), SamplingParams(max_tokens=1), SLO(ttft_ms=10_000, tpot_ms=5.0))
    s.add(one)
    p = s.schedule(0.0)
    assert p.prefill == [one] and p.rejected == []


@pytest.mark.parametrize("policy", ["edf", "edf_reject", "scorpio", "kairos"])
def test_a_reply_preempted_without_a_ttft_slo_resumes_before_fresh_requests(policy):
    """Least-deadline-first put a preempted reply with no TTFT SLO (deadline +inf) behind every fresh request with
    one: under a steady stream of them it never resumed. Started replies resume first, as vLLM's (and FIFO's)."""
    s = _sched(policy, blocks=16)
    first = Request("b", _prompt(0, 8), SamplingParams(max_tokens=40), SLO(ttft_ms=60_000))
    reply = Request("a", _prompt(1, 8), SamplingParams(max_tokens=50), SLO(tpot_ms=200.0))
    s.add(first)
    s.add(reply)
    now, i, waited = 0.0, 2, 0
    for _ in range(300):
        now += 0.01
        s.add(Request(f"r{i}", _prompt(i, 4), SamplingParams(max_tokens=8), SLO(ttft_ms=60_000), arrival_s=now))
        i += 1
        p = s.schedule(now)
        waited += reply.status is Status.WAITING and reply.first_token_s is not None
        for r, _ in p.rejected:
            s.finish(r, FinishReason.REJECTED, now)
        for r, _, reason in s.postprocess(p, [3] * len(p.requests), now):
            if reason:
                s.finish(r, reason, now)
    assert reply.num_preemptions >= 1 and reply.status is Status.FINISHED and reply.num_output_tokens == 50
    assert waited < 60, waited


def _loop(s, until_s, arrive, dt=0.005):
    """Steps every `dt` s up to `until_s`, each step's requests one token (`arrive(now)`: what arrives then);
    finishes by length and rejections as the engine does."""
    now = 0.0
    while now < until_s:
        for r in arrive(now):
            s.add(r)
        plan = s.schedule(now)
        for r, _ in plan.rejected:
            s.finish(r, FinishReason.REJECTED, now)
        for r, _, reason in s.postprocess(plan, [3] * len(plan.requests), now):
            if reason is not None:
                s.finish(r, reason, now)
        now = round(now + dt, 6)


@pytest.mark.parametrize("policy", ["edf_reject", "kairos"])
def test_the_ttft_guard_counts_a_preempted_replys_recompute_ahead_of_a_fresh_request(policy):
    """A reply preempted back to the queue goes first and recomputes its prompt and output: a fresh request behind
    it whose TTFT SLO fits its own prefill but not that one is unattainable (the guard counted only fresh prompts,
    admitted it and let it miss); the preempted reply is never turned away."""
    from scheduling.scheduler import TTFT_UNATTAINABLE, StepPlan

    model = LatencyModel(prefill_coef=(0.5, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0))  # prefill 1 + 0.5n ms
    s = Scheduler(SchedulerConfig(policy=policy), 512, 4, max_model_len=512, predictor=model)
    p = _req(0, 200, ttft=10_000, max_tokens=50)
    s.add(p)
    _run(s, s.schedule(0.0))
    p.first_token_s = 0.0
    s._preempt(p, StepPlan())
    f = _req(1, 8, ttft=75.0, arrival=20.0)  # alone: 5 ms of prefill and the 50 ms margin
    s.add(f)
    plan = s.schedule(20.0)  # (p's TTFT deadline long past: started, it is never turned away)
    assert plan.rejected == [(f, TTFT_UNATTAINABLE)] and plan.prefill == [p]


def test_a_request_waits_for_room_if_an_idle_replica_would_take_it_whatever_the_busy_steps_measured():
    """short_first: a request the gate turns away on a busy replica waits in the queue where an idle replica would
    admit it, judged with the idle factor (as a rejection's capacity is), not with the busy batch's measured
    prefill stalls, which turned it away as unattainable though an idle replica takes it."""
    s = _sched("kairos", short_first=True)
    loose = _req(0, 8, tpot=1000.0, ttft=10_000, max_tokens=200)
    s.add(loose)
    _run(s, s.schedule(0.0))
    loose.first_token_s = 0.0
    for k in range(40):  # steps slowed by prefill stalls; none of a reply decoding alone
        s.correction.observe(0.5 + k * 0.001, 25.0, 5.5, rows=1, alone=False, prefill=True)
    cand = _req(1, 8, tpot=10.0, ttft=10_000, max_tokens=20, arrival=0.6)
    s.add(cand)
    plan = s.schedule(0.6)
    assert s._gate_scale(s._window_factor(0.6)) > 2 and s.judge_gate_scale(0.6) == 1.0
    assert plan.rejected == [] and cand in s.waiting


def test_least_work_order_sends_a_request_without_a_tpot_slo_after_the_paced_ones():
    """short_first orders by work, and a reply without a TPOT SLO weighs nothing to shedding: it went first
    whatever its length (a 2000-token best-effort reply ahead of a 4-token paced one in a one-seat batch); it goes
    after the paced ones, as LDF sends best effort last."""
    s = Scheduler(SchedulerConfig(policy="kairos", short_first=True, max_num_seqs=1), 2048, 4, max_model_len=4096,
                  predictor=LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0)))
    paced = _req(0, 8, tpot=50.0, ttft=2000.0, max_tokens=4)
    best_effort = _req(1, 8, max_tokens=2000, arrival=0.001)
    s.add(paced)
    s.add(best_effort)
    assert s.schedule(0.002).prefill == [paced]


def _reserved(**kw):
    return _sched("kairos", blocks=256, vbs_margin=1.3, impatient_reserve=True, short_first=True, urgent_first=True,
                  itl_correction=False, ttft_margin_ms=5.0, **kw)


def _strict_stream(extra: dict):
    """A strict request (TPOT 8 ms, TTFT 20 ms) every 30 ms, and `extra`'s requests at their times."""
    n = [0]

    def arrive(now):
        out = []
        if abs(now / 0.03 - round(now / 0.03)) < 1e-6:
            out.append(_req(n[0], 8, tpot=8.0, ttft=20.0, arrival=now))
            n[0] += 1
        return out + extra.pop(now, [])
    return arrive


def test_the_impatient_reserve_never_holds_a_request_without_a_ttft_deadline():
    """The reserve keeps a patient request waiting while impatient ones arrive; one without a TTFT deadline was
    patient for ever, so nothing ended its wait (still waiting after 28 s of strict arrivals); it is admitted."""
    s = _reserved()
    be, tpot_only = _req(999, 8, arrival=2.0), _req(998, 8, tpot=200.0, arrival=2.0)
    _loop(s, 4.0, _strict_stream({2.0: [be, tpot_only]}))
    assert be.admitted_s == 2.0 and tpot_only.admitted_s == 2.0


def test_a_one_token_reply_takes_no_room_the_reserve_keeps():
    """A reply of one token leaves the batch at its prefill: the reserve's room check let it wait until its TTFT
    deadline drew near (admitted about 5 s late); it is admitted at once."""
    s = _reserved()
    one = Request("one", _prompt(999, 8), SamplingParams(max_tokens=1), SLO(ttft_ms=5000.0, tpot_ms=8.0),
                  arrival_s=2.0)
    _loop(s, 2.5, _strict_stream({2.0: [one]}))
    assert one.admitted_s == 2.0


@pytest.mark.parametrize("mixed", ["sum", "shared"])
def test_every_prediction_of_a_hybrid_step_adds_its_prefill_as_the_fit_does(mixed):
    """The step the catch-up trim and the pace guard weigh (`_step_ms_for`, `_pace_guard`), the engine's allowance
    for a step (`LLMEngine._allow`) and bench.sim's truth all add a step's prefill to its decodes as the fit says
    (`LatencyModel.beside_ms`): their sum, or one forward (a GPU)."""
    import types

    from bench.sim import Machine
    from engine.engine import STEP_TIMEOUT_FACTOR, LLMEngine
    from scheduling.scheduler import StepPlan

    model = LatencyModel(prefill_coef=(0.1, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0), mixed=mixed)
    s = Scheduler(SchedulerConfig(policy="kairos"), 256, 4, max_model_len=256, predictor=model)
    rows = [Request(f"r{i}", [1] * 9, SamplingParams(max_tokens=8), SLO(tpot_ms=8.0)) for i in range(4)]
    prompt = Request("p", [1] * 60, SamplingParams(max_tokens=8), SLO(tpot_ms=50.0))
    plan = StepPlan(prefill=[prompt], prefill_ends=[60], decode=rows, num_prefill_tokens=60,
                    num_prefill_sq=3600.0, decode_mean_len=9.0)
    want = model.mixed_ms(60, 3600.0, 4, 9.0)  # sum: 7 + 7; shared: 0.1 x 64 + 1 = 7.4
    assert want == pytest.approx(14.0 if mixed == "sum" else 7.4)
    assert s._step_ms_for(plan, rows, 0.0)(4) == pytest.approx(want)
    engine = types.SimpleNamespace(scheduler=s, _turn=(0.0, 0.0))
    LLMEngine._allow(engine, plan)
    assert engine._turn[1] == pytest.approx(STEP_TIMEOUT_FACTOR * want / 1000.0)
    machine = Machine(model, factor=1.0, jitter=0.0, host_ms=0.0, hybrid_saving_ms=1.0)
    assert machine.step_ms(60, 4, 9.0, None, 3600.0) == pytest.approx(want - (1.0 if mixed == "sum" else 0.0))
