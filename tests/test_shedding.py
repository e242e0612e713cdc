"""Work shedding (kairos): under overload, the fresh requests asking for the most output tokens are shed first;
pinned on hand-made arrivals and queues (scheduling/shedding.py)."""
import math

import pytest

from core.messages import RejectReason
from core.request import SLO, Request
from core.sampling import SamplingParams
from scheduling.shedding import PaceCost, WorkShedder, sheds
from tests.test_scheduler import _run, _sched


def _saturated_capacity(s: WorkShedder, tok_s: float, now: float = 0.0) -> None:
    """One second of saturated steps at `tok_s` tokens per second."""
    s.saturated(now)
    s.step(now, int(tok_s), 1000.0)


def test_no_threshold_before_capacity_is_measured_or_with_few_arrivals():
    s = WorkShedder(min_arrivals=4)
    for i in range(10):
        s.arrived(1000, i * 0.1)
    assert s.capacity_per_s is None and s.threshold(1.0) == math.inf
    s2 = WorkShedder(min_arrivals=4)
    _saturated_capacity(s2, 10.0)
    for i in range(3):
        s2.arrived(1000, i * 0.1)
    assert s2.threshold(1.0) == math.inf  # three arrivals are too few to judge


def test_capacity_counts_only_the_steps_near_a_capacity_rejection():
    s = WorkShedder(hold_s=1.0, tau_s=10.0)
    s.step(0.0, 100, 10.0)  # never saturated: not measured
    assert s.capacity_per_s is None
    s.saturated(1.0)
    s.step(1.5, 10, 10.0)  # within hold_s: 1,000 tok/s
    assert s.capacity_per_s == pytest.approx(1000.0)
    s.step(3.0, 100, 10.0)  # 2 s after the rejection: an unsaturated step, ignored
    assert s.capacity_per_s == pytest.approx(1000.0)


def _arrivals(s: WorkShedder) -> None:
    """10 s of arrivals: 60 of 100 tokens, 30 of 300, 10 of 1,000 (25,000 tokens; the median work is 100)."""
    works = [100] * 60 + [300] * 30 + [1000] * 10
    for i, w in enumerate(works):
        s.arrived(w, i * 0.1)


@pytest.mark.parametrize("tok_s, theta", [(3000.0, math.inf),  # all 25,000 fit in 10 s
                                          (1600.0, 300.0),  # 6,000 + 9,000 fit, not one more long one
                                          (1000.0, 100.0)])  # 13 of the 300s would fit: all of them count
def test_threshold_keeps_the_shortest_arrivals_that_fit_the_capacity(tok_s, theta):
    s = WorkShedder(target=1.0, window_s=20.0, min_arrivals=4)
    _arrivals(s)
    _saturated_capacity(s, tok_s, now=10.0)
    assert s.threshold(10.0) == theta
    t = WorkShedder(target=2.0, window_s=20.0, min_arrivals=4)
    _arrivals(t)
    _saturated_capacity(t, tok_s / 2.0, now=10.0)  # the target scales the budget
    assert t.threshold(10.0) == theta


def test_threshold_is_inf_when_everything_fits_and_never_below_the_median():
    s = WorkShedder(min_arrivals=4)
    for i in range(40):
        s.arrived(50 + i, i * 0.25)
    _saturated_capacity(s, 1e6, now=10.0)
    assert s.threshold(10.0) == math.inf  # arrivals offer less than the capacity
    t = WorkShedder(min_arrivals=4)
    for i in range(40):
        t.arrived(1000 + i, i * 0.25)
    _saturated_capacity(t, 1.0, now=10.0)  # nothing would fit: the median still passes
    assert t.threshold(10.0) == 1019.0
    u = WorkShedder(min_arrivals=4)
    for i in range(40):
        u.arrived(500, i * 0.25)
    _saturated_capacity(u, 1.0, now=10.0)
    assert u.threshold(10.0) == 500.0  # all alike (e.g. no max_tokens anywhere): nobody exceeds it


def test_old_arrivals_leave_the_window():
    s = WorkShedder(window_s=5.0, min_arrivals=4)
    for i in range(10):
        s.arrived(1000, i * 0.1)
    for i in range(10):
        s.arrived(10, 20.0 + i * 0.1)
    _saturated_capacity(s, 1.0, now=21.0)
    assert s.threshold(21.0) == 10.0  # the old long arrivals no longer count
    with pytest.raises(ValueError):
        WorkShedder(target=0.0)


TPOT = 40.0  # the requests below: work = output tokens / 40 ms


def test_threshold_is_reused_for_refresh_s_and_the_window_is_bounded_in_count():
    s = WorkShedder(min_arrivals=4, refresh_s=0.05)
    _arrivals(s)
    _saturated_capacity(s, 1600.0, now=10.0)
    assert s.threshold(10.0) == 300.0
    s.step(10.0, 0, 1000.0)  # a saturated second with nothing decoded: C halves to 800 tok/s
    assert s.threshold(10.01) == 300.0  # within refresh_s: the last θ
    assert s.threshold(10.1) == 100.0
    t = WorkShedder(min_arrivals=4, max_arrivals=10)
    for i in range(100):
        t.arrived(100 if i < 90 else 1000, i * 0.1)  # only the last 10 (1,000 each, 0.9 s) are kept
    _saturated_capacity(t, 5000.0, now=10.0)
    assert t.threshold(10.0) == 1000.0  # the median of what is kept; the 100s no longer count
    _saturated_capacity(t, 1e5, now=10.0)
    assert t.threshold(10.1) == math.inf  # 10,000 tokens over the kept span (1.0 s) fit
    with pytest.raises(ValueError):
        WorkShedder(min_arrivals=10, max_arrivals=5)


def _req(i, max_tokens, tpot=TPOT, arrival=0.0):
    return Request(f"r{i}", [1] * 5, SamplingParams(max_tokens=max_tokens), SLO(tpot_ms=tpot), arrival_s=arrival)


def _prime(s: WorkShedder) -> None:
    """10 s of arrivals (30 of 10 tokens, 10 of 200) and a saturated second at 20 tok/s: not even the short
    ones all fit, so θ is the median work, 10 tokens' at 40 ms."""
    for i in range(40):
        s.arrived((10 if i % 4 else 200) / TPOT, i * 0.25)
    s.saturated(10.0)
    s.step(10.0, 20 / TPOT, 1000.0)


def _primed(**kw):
    """A kairos scheduler with one request running and a primed shedder."""
    s = _sched("kairos", blocks=256, **{"work_shedding": True, "pace_work": False, **kw})
    first = _req(0, 10)
    s.add(first)
    _run(s, s.schedule(0.0))
    assert s.running == [first]
    if s.shedder is not None:
        _prime(s.shedder)
    return s


def test_kairos_sheds_a_long_request_under_overload_and_admits_a_short_one():
    s = _primed()
    assert s.shedder.threshold(10.0) == pytest.approx(10 / TPOT)
    long_, short = _req(1, 200, arrival=10.0), _req(2, 10, arrival=10.0)
    s.add(long_)
    s.add(short)
    plan = s.schedule(10.0)
    assert plan.rejected == [(long_, RejectReason.SHED)] and plan.prefill == [short]
    assert long_ not in s.waiting and long_ not in s.running and s.last_shed_threshold == pytest.approx(10 / TPOT)


def test_with_priority_scheduling_a_request_is_shed_only_where_none_of_a_higher_value_waits():
    s = _primed(scheduling_policy="priority")
    urgent, short_low = _req(1, 200, arrival=10.0), _req(2, 10, arrival=10.0)
    urgent.priority, short_low.priority = -1, 3
    s.add(urgent)
    s.add(short_low)
    plan = s.schedule(10.0)
    assert plan.rejected == [] and plan.prefill[0] is urgent  # the long one, first and not shed
    long_low = _req(3, 200, arrival=10.1)
    long_low.priority = 3
    s.add(long_low)
    assert (long_low, RejectReason.SHED) in s.schedule(10.1).rejected  # the least urgent: shed as ever


def test_kairos_sheds_only_while_the_replica_is_saturated():
    """θ stays what the window says, but 1.5 s after the last capacity rejection (the shedder's hold is 1 s) the
    batch has had room: the long request goes to the gate instead, and is admitted."""
    s = _primed()  # saturated at 10.0
    long_ = _req(1, 200, arrival=11.5)
    s.add(long_)
    plan = s.schedule(11.5)
    assert plan.rejected == [] and plan.prefill == [long_] and s.last_shed_threshold == math.inf
    assert s.shedder.threshold(11.5) == pytest.approx(10 / TPOT)


def test_an_idle_replica_never_sheds():
    s = _sched("kairos", blocks=256, work_shedding=True)
    _prime(s.shedder)
    long_ = _req(1, 200, arrival=10.0)
    s.add(long_)
    assert s.schedule(10.0).prefill == [long_]


def test_without_work_shedding_the_long_request_is_offered_to_the_gate():
    s = _primed(work_shedding=False)
    assert s.shedder is None
    long_ = _req(1, 200, arrival=10.0)
    s.add(long_)
    plan = s.schedule(10.0)
    assert plan.prefill == [long_] and plan.rejected == []
    assert _sched("scorpio").shedder is None  # SCORPIO as published has no shedding
    assert _sched("kairos").shedder is None  # kairos sheds only with its length predictor on


def test_a_full_queue_marks_saturation_but_a_shed_does_not():
    s = _primed(max_waiting=1)
    before = s.shedder._saturated_s
    s.add(_req(1, 200, arrival=11.0))
    assert s.add(_req(2, 10, arrival=11.5)) == RejectReason.OVERLOADED
    assert s.shedder._saturated_s == 11.5
    plan = s.schedule(12.0)  # the long request is shed: no new saturation mark
    assert [reason for _, reason in plan.rejected] == [RejectReason.SHED]
    assert s.shedder._saturated_s == 11.5 > before


def test_a_stricter_tpot_weighs_more_and_best_effort_is_never_shed():
    s = _primed()  # θ = 10 tokens at 40 ms
    loose, strict, best_effort = _req(1, 10, arrival=10.0), _req(2, 10, tpot=20.0, arrival=10.0), \
        Request("r3", [1] * 5, SamplingParams(max_tokens=500), SLO(), arrival_s=10.0)
    for r in (loose, strict, best_effort):
        s.add(r)
    plan = s.schedule(10.0)
    assert plan.rejected == [(strict, RejectReason.SHED)]  # 10 tokens at 20 ms: the work of 20 at 40 ms
    assert set(plan.prefill) == {loose, best_effort}


def test_a_rejection_on_an_idle_replica_does_not_mark_saturation():
    s = _sched("kairos", blocks=256, work_shedding=True)
    hopeless = _req(1, 10, tpot=1.0)  # 1 ms TPOT: infeasible even alone (ITL(1) = 5.5 ms)
    s.add(hopeless)
    plan = s.schedule(1.0)
    assert plan.rejected == [(hopeless, RejectReason.TPOT_UNATTAINABLE)]
    assert s.shedder._saturated_s == -math.inf


def test_sheds_holds_a_request_that_sets_a_faster_pace_to_a_share_of_the_threshold():
    assert not sheds(0.2, 0.25, tpot_ms=40.0, pace_ms=40.0, pace_factor=0.5)  # the batch's own pace: θ
    assert sheds(0.3, 0.25, tpot_ms=40.0, pace_ms=40.0, pace_factor=0.5)
    assert sheds(0.2, 0.25, tpot_ms=20.0, pace_ms=40.0, pace_factor=0.5)  # faster pace: 0.5 θ
    assert not sheds(0.1, 0.25, tpot_ms=20.0, pace_ms=40.0, pace_factor=0.5)
    assert not sheds(0.2, 0.25, tpot_ms=20.0, pace_ms=40.0)  # factor 1: as any request
    assert not sheds(0.2, 0.25, tpot_ms=39.0, pace_ms=40.0, pace_factor=0.5)  # within the tolerance: same pace
    assert sheds(0.2, 0.25, tpot_ms=20.0, pace_ms=math.inf, pace_factor=0.5)  # the first to set the batch's pace
    assert not sheds(1e9, math.inf, tpot_ms=20.0, pace_ms=40.0, pace_factor=0.5)  # no threshold: nothing shed


def test_kairos_sheds_a_pace_setting_request_sooner_than_one_of_the_batch_pace():
    s = _primed(shed_pace_factor=0.5)  # a 40 ms request runs; θ = 10 tokens at 40 ms (0.25)
    strict, loose = _req(1, 4, tpot=20.0, arrival=10.0), _req(2, 8, arrival=10.0)  # works 0.2 and 0.2
    s.add(strict)
    s.add(loose)
    plan = s.schedule(10.0)
    assert plan.rejected == [(strict, RejectReason.SHED)] and plan.prefill == [loose]


def test_a_strict_request_joins_a_batch_already_at_its_pace():
    s = _sched("kairos", blocks=256, work_shedding=True, shed_pace_factor=0.5, pace_work=False)
    first = _req(0, 10, tpot=20.0)
    s.add(first)
    _run(s, s.schedule(0.0))
    _prime(s.shedder)
    strict = _req(1, 4, tpot=20.0, arrival=10.0)  # work 0.2 <= θ: the batch's pace is already 20 ms
    s.add(strict)
    plan = s.schedule(10.0)
    assert plan.rejected == [] and plan.prefill == [strict]


# --- pace_work: work in machine time (PaceCost) ---

def _linear(b, length):  # the tests' latency model (tests.test_scheduler._sched): ITL = 5 + 0.5 B ms
    return 5.0 + 0.5 * b


def test_pace_cost_is_the_step_of_the_largest_batch_the_gate_fits_per_request():
    pc = PaceCost(_linear, margin=1.05, slack=0.99, max_batch=64)
    # 40 ms: 5 + 0.5 b <= 0.99 * 40 / 1.05 -> b <= 65, capped at 64: a step of 37 ms for 64 tokens
    assert pc.token_ms(40.0, 100) == pytest.approx(37.0 / 64)
    assert pc.token_ms(20.0, 100) == pytest.approx(18.5 / 27)  # b <= 27.7
    assert pc.token_ms(math.inf, 100) == pytest.approx(37.0 / 64)
    assert pc.token_ms(5.0, 100) == pytest.approx(5.5)  # not even one request fits: its step alone
    pc.set_scale(2.0)  # the gate's correction: the machine runs twice the model
    assert pc.token_ms(40.0, 100) == pytest.approx(2 * 18.5 / 27)  # 2 (5 + 0.5 b) <= 37.71 -> b <= 27


def test_pace_work_charges_a_faster_pace_to_the_request_that_sets_it():
    pc = PaceCost(_linear, margin=1.05, slack=0.99, max_batch=64)
    loose, strict = pc.token_ms(40.0, 100), pc.token_ms(20.0, 100)
    assert pc.work(10, 40.0, 40.0, 100) == pytest.approx(10 * loose)
    assert pc.work(10, 40.0, 20.0, 100) == pytest.approx(10 * strict)  # a loose request in a strict batch
    assert pc.work(10, 20.0, 20.0, 100) == pytest.approx(10 * strict)  # joins a batch already at its pace
    # sets a faster pace: over its 10 x 20 ms the batch decodes at 1 / strict instead of 1 / loose tokens per ms
    assert pc.work(10, 20.0, 40.0, 100) == pytest.approx(10 * (strict + 20.0 * (1 - loose / strict)))
    assert pc.work(10, math.inf, 40.0, 100) == 0.0 and pc.work(0, 20.0, 40.0, 100) == 0.0  # best effort, done


def test_where_the_step_hardly_grows_with_the_batch_every_pace_costs_alike():
    """A memory-bound GPU step: the largest batch fits every tier's pace, so tiers weigh by their tokens only."""
    pc = PaceCost(lambda b, length: 8.0 + 0.001 * b, margin=1.05, slack=0.99, max_batch=256)
    assert pc.token_ms(10.0, 500) == pytest.approx(pc.token_ms(40.0, 500))
    assert pc.work(100, 10.0, 40.0, 500) == pytest.approx(pc.work(100, 40.0, 40.0, 500))


def test_kairos_sheds_a_request_that_would_set_a_faster_pace_and_admits_one_that_joins_it():
    """pace_work (kairos's default): θ is 10 loose tokens' machine time. A 20 ms request of 4 tokens into a 40 ms
    batch costs its tokens at the strict pace and what the batch loses meanwhile: shed. Into a batch already at
    20 ms it costs only its tokens: admitted."""
    for pace, shed in ((40.0, True), (20.0, False)):
        s = _sched("kairos", blocks=256, work_shedding=True)
        assert s.pace_cost is not None
        unit = s.pace_cost.token_ms(40.0, 100)
        first = _req(0, 10, tpot=pace)
        s.add(first)
        _run(s, s.schedule(0.0))
        for i in range(40):  # 30 arrivals of 10 loose tokens, 10 of 200; a saturated second of 20 tokens
            s.shedder.arrived((10 if i % 4 else 200) * unit, i * 0.25)
        s.shedder.saturated(10.0)
        s.shedder.step(10.0, 20 * unit, 1000.0)
        assert s.shedder.threshold(10.0) == pytest.approx(10 * unit)
        strict, loose = _req(1, 4, tpot=20.0, arrival=10.0), _req(2, 8, arrival=10.0)
        s.add(strict)
        s.add(loose)
        plan = s.schedule(10.0)
        assert (plan.rejected == [(strict, RejectReason.SHED)]) is shed
        assert loose in plan.prefill and (strict in plan.prefill) is not shed


@pytest.mark.parametrize("pace_work", [True, False])
def test_a_steps_work_is_one_token_of_each_paced_row_at_the_steps_pace(pace_work):
    """What on_step_done reports to the shedder: one token of each row at the strictest TPOT among them (each row's
    own `_work(r, 1, pace)`); a row without a TPOT weighs nothing, and a step of such rows did no work."""
    s = _sched("kairos", blocks=256, work_shedding=True, pace_work=pace_work)
    rows = [_req(0, 50, tpot=20.0), _req(1, 400, tpot=40.0), _req(2, 8, tpot=40.0),
            Request("be", [1] * 5, SamplingParams(max_tokens=30))]
    for r in rows:
        r.token_ids += [7] * 3  # mid-reply
    assert s._step_work(rows) == pytest.approx(sum(s._work(r, 1, 20.0) for r in rows))
    if not pace_work:
        assert s._step_work(rows) == pytest.approx(1 / 20.0 + 2 / 40.0)
    assert s._step_work(rows[3:]) == 0.0


def test_pace_cost_of_a_step_s_rows_is_the_sum_of_their_token_costs() -> None:
    """`tokens_ms` (the work a step did, one lookup a row) sums what `token_ms` gives each row, lengths not yet
    solved included."""
    pc = PaceCost(_linear, margin=1.05, slack=0.99, max_batch=64)
    lengths = [10.0, 700.5, 64.0, 63.9, 2000.0, 700.5]
    expected = sum(PaceCost(_linear, margin=1.05, slack=0.99, max_batch=64).token_ms(20.0, x) for x in lengths)
    assert pc.tokens_ms(20.0, lengths) == pytest.approx(expected, rel=1e-12)
    assert pc.tokens_ms(20.0, []) == 0.0
