"""Room for the impatient (scheduling/reserve.py): the patience it measures and the room it keeps."""
import math

import pytest

from scheduling.reserve import ImpatientReserve


def test_patience_is_the_mean_time_between_finishes_over_the_window():
    r = ImpatientReserve(window_s=10.0, min_finished=4)
    for t in (1.0, 1.2, 1.4):
        r.finished(t)
    assert r.patience_ms(1.5) is None  # 3 < min_finished: not measured yet
    r.finished(1.6)
    assert r.patience_ms(2.0) == pytest.approx(1000.0 * (2.0 - 1.0) / 4)
    # 20 s later the window holds none of them
    assert r.patience_ms(22.0) is None


def test_room_is_a_typical_arrival_whose_ttft_slo_is_shorter_than_the_patience():
    r = ImpatientReserve(window_s=10.0, min_finished=2)
    for t in (0.0, 0.25, 0.5, 0.75):  # patience: 250 ms at t = 1
        r.finished(t)
    r.arrived(0.1, ttft_ms=80.0, tpot_ms=40.0, mid_len=100.0)
    r.arrived(0.2, ttft_ms=60.0, tpot_ms=20.0, mid_len=300.0)
    r.arrived(0.3, ttft_ms=90.0, tpot_ms=50.0, mid_len=200.0)
    r.arrived(0.4, ttft_ms=2000.0, tpot_ms=5.0, mid_len=900.0)  # patient: not the room's
    r.arrived(0.5, ttft_ms=math.inf, tpot_ms=5.0, mid_len=900.0)  # no TTFT SLO: never needs room at once
    assert r.patience_ms(1.0) == pytest.approx(250.0)
    assert r.room(1.0) == (40.0, pytest.approx(200.0))  # median TPOT, mean context


def test_no_room_without_impatient_arrivals_or_where_replies_finish_faster_than_any_ttft_runs_out():
    r = ImpatientReserve(window_s=10.0, min_finished=2)
    r.arrived(0.0, ttft_ms=80.0, tpot_ms=40.0, mid_len=100.0)
    assert r.room(0.1) is None  # no finishes measured
    for k in range(100):  # a finish every 10 ms: an 80 ms TTFT SLO can wait for room
        r.finished(0.01 * k)
    assert r.room(1.0) is None
    with pytest.raises(ValueError):
        ImpatientReserve(window_s=0.0)


def test_room_is_not_kept_for_arrivals_no_replica_state_could_serve():
    """Arrivals whose TPOT SLO fails the gate even on an idle replica are rejected whatever room is kept: the typical
    arrival is taken among the others, and none is kept for where all of them are such."""
    r = ImpatientReserve(window_s=10.0, min_finished=2)
    for t in (0.0, 0.25, 0.5, 0.75):
        r.finished(t)
    r.arrived(0.1, ttft_ms=80.0, tpot_ms=1.0, mid_len=100.0)
    r.arrived(0.2, ttft_ms=80.0, tpot_ms=1.0, mid_len=100.0)
    r.arrived(0.3, ttft_ms=80.0, tpot_ms=40.0, mid_len=200.0)
    feasible = lambda tpot, mid: tpot >= 10.0  # noqa: E731
    assert r.room(1.0) == (1.0, pytest.approx(400.0 / 3))
    assert r.room(1.0, feasible=feasible) == (40.0, pytest.approx(200.0))
    assert r.room(1.0, feasible=lambda tpot, mid: False) is None
