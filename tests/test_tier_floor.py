"""The tier floor (kairos): a starved TPOT tier whose SLO is feasible on an idle replica is held, not rejected,
and the batch drains for it; pinned on hand-made queues with a linear latency model (ITL = 5 + 0.5·B ms)."""
import math

import pytest

from core.request import FinishReason, Status
from scheduling.tier_floor import TierFloor, tpot_class
from tests.test_scheduler import _req, _run, _sched

LOOSE, STRICT = 40.0, 8.0  # strict alone: 1.3·ITL(1) = 7.15 < 0.99·8; with 6 loose running VBS' = 2.2: 7.93 > 7.92


def _starve(s, n=4):
    for _ in range(n):  # the strict tier was rejected lately, never admitted
        s.floor.rejected(STRICT, 0.0)


def _loaded(floor: bool):
    """Six loose requests running, then four strict (a starved tier, with the floor) and one more loose arriving."""
    s = _sched("kairos", vbs_margin=1.3, tier_floor=floor)
    loose = [_req(i, 5, tpot=LOOSE) for i in range(6)]
    for r in loose:
        s.add(r)
    _run(s, s.schedule(0.0))
    assert s.running == loose
    strict = [_req(10 + i, 5, tpot=STRICT) for i in range(4)]
    late = _req(20, 5, tpot=LOOSE)
    for r in (*strict, late):
        s.add(r)
    if floor:
        _starve(s)
    return s, loose, strict, late


def test_tpot_classes_are_25_percent_wide_and_best_effort_has_none():
    assert tpot_class(10.0) == tpot_class(10.5) != tpot_class(13.0)
    assert tpot_class(math.inf) is None and tpot_class(0.0) is None


def test_share_and_starvation_over_a_decaying_window():
    f = TierFloor(floor=0.3, tau_s=10.0, min_decided=3)
    for _ in range(5):
        f.arrived(STRICT, 0.0, length=100.0)
    assert not f.starved(STRICT, 0.0) and f.share(STRICT, 0.0) == 1.0  # waiting requests are not decisions
    for _ in range(2):
        f.rejected(STRICT, 0.0)
    assert not f.starved(STRICT, 0.0)  # too few decisions to judge
    for _ in range(2):
        f.rejected(STRICT, 0.0)
    assert f.share(STRICT, 0.0) == 0.0 and f.starved(STRICT, 0.0)
    assert f.reservation(0.0) == (STRICT, pytest.approx(100.0))
    for _ in range(4):
        f.admitted(STRICT, 0.0)
    assert f.share(STRICT, 0.0) == pytest.approx(0.5) and not f.starved(STRICT, 0.0)
    assert f.reservation(0.0) is None
    assert f.share(LOOSE, 0.0) == 1.0 and not f.starved(math.inf, 0.0)  # no decisions / best effort
    assert f.share(STRICT, 100.0) == pytest.approx(0.5)  # the ratio survives the decay ...
    f.rejected(STRICT, 100.0)
    assert f.share(STRICT, 100.0) < 0.3 and not f.starved(STRICT, 100.0)  # ... old decisions no longer count
    with pytest.raises(ValueError):
        TierFloor(floor=1.5)


def test_without_the_floor_the_strict_tier_is_rejected_and_loose_requests_keep_the_batch_full():
    s, loose, strict, late = _loaded(floor=False)
    plan = s.schedule(0.1)
    assert [r for r, _ in plan.rejected] == strict  # every strict request fails the gate behind 6 loose ones
    assert plan.prefill == [late]


def test_the_floor_holds_a_starved_feasible_tier_and_drains_the_batch_for_it():
    s, loose, strict, late = _loaded(floor=True)
    plan = s.schedule(0.1)
    assert plan.rejected == [] and plan.prefill == []  # held, and the loose arrival waits instead of joining
    assert list(s.waiting) == [*strict, late] and all(r.status is Status.WAITING for r in s.waiting)
    assert plan.decode  # the running batch keeps decoding meanwhile
    _run(s, plan)
    for r in loose[:4]:  # four loose requests finish: VBS' with 2 loose running is 1.4 -> 1.3 x 5.7 = 7.41 ms
        s.finish(r, FinishReason.LENGTH, 0.2)
    plan = s.schedule(0.2)
    assert plan.prefill == [strict[0]] and plan.rejected == []  # the first strict request gets in
    assert late in s.waiting and all(r in s.waiting for r in strict[1:])  # the next strict one is held again
    assert s.floor.share(STRICT, 0.2) == pytest.approx(0.2, rel=0.05)  # 1 admitted, 4 rejected before


def test_the_floor_does_not_hold_a_tier_that_is_infeasible_even_alone():
    s = _sched("kairos", vbs_margin=1.3, tier_floor=True)
    hopeless = [_req(i, 5, tpot=6.0) for i in range(5)]  # 1.3 x ITL(1) = 7.15 > 0.99 x 6
    for r in hopeless:
        s.add(r)
        s.floor.rejected(6.0, 0.0)
    plan = s.schedule(0.0)
    assert [r for r, _ in plan.rejected] == hopeless and s.waiting == type(s.waiting)()


def test_a_tier_at_its_floor_is_not_held():
    s, loose, strict, late = _loaded(floor=True)
    for _ in range(12):
        s.floor.admitted(STRICT, 0.0)  # the strict tier was served recently too: share 0.75
    plan = s.schedule(0.1)
    assert [r for r, _ in plan.rejected] == strict and plan.prefill == [late]


@pytest.mark.parametrize("mode", ["reserve", "both"])
def test_reserve_keeps_vbs_room_for_a_starved_tier_so_its_next_request_gets_in(mode):
    s = _sched("kairos", vbs_margin=1.3, tier_floor=True, tier_floor_mode=mode)
    running = [_req(i, 5, tpot=LOOSE) for i in range(3)]
    for r in running:
        s.add(r)
    _run(s, s.schedule(0.0))
    for _ in range(4):  # the strict tier arrived and was rejected: starved
        s.floor.arrived(STRICT, 0.0, length=9.0)
        s.floor.rejected(STRICT, 0.0)
    assert s.floor.reservation(0.0) == (STRICT, pytest.approx(9.0))
    loose = [_req(10 + i, 5, tpot=LOOSE) for i in range(4)]
    for r in loose:
        s.add(r)
    plan = s.schedule(0.1)
    # with k loose running plus one strict, 1.3 x ITL(1 + 0.2k) < 7.92 holds up to k = 5: two more loose get in,
    # the other two wait (not rejected) so that a strict request still fits
    assert plan.prefill == loose[:2] and plan.rejected == [] and list(s.waiting) == loose[2:]
    _run(s, plan)
    strict = _req(20, 5, tpot=STRICT)
    s.add(strict)
    plan = s.schedule(0.2)
    assert plan.prefill == [strict] and plan.rejected == []


def test_without_a_starved_tier_nothing_is_reserved():
    s = _sched("kairos", vbs_margin=1.3, tier_floor=True, tier_floor_mode="reserve")
    loose = [_req(i, 5, tpot=LOOSE) for i in range(7)]
    for r in loose:
        s.add(r)
    assert s.floor.reservation(0.0) is None
    assert s.schedule(0.0).prefill == loose
