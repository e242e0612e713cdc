"""Kairos's autoscaling policy (deployments/autoscaling.py): Serve's queue rule, or more where the replicas turn
requests away for their load; the replicas' rates over a window."""
from types import SimpleNamespace

import pytest

from deployments.autoscaling import (ADMITTED, INFLIGHT, TURNED_AWAY, DemandRates, desired_replicas, idle,
                                     slo_autoscaling_policy)


def test_desired_replicas_follow_the_queue_or_the_demand_turned_away_whichever_asks_more():
    assert desired_replicas(2, by_queue=4, admitted_per_s=10, turned_away_per_s=0) == 4  # Serve's rule
    assert desired_replicas(2, by_queue=0.5, admitted_per_s=10, turned_away_per_s=5) == 3  # 15 offered / 10
    assert desired_replicas(2, by_queue=5, admitted_per_s=10, turned_away_per_s=5) == 5  # the queue's more
    assert desired_replicas(1, by_queue=1 / 16, admitted_per_s=0, turned_away_per_s=3) == 2  # none served
    assert desired_replicas(3, by_queue=0, admitted_per_s=0, turned_away_per_s=0) == 0  # idle: down


def test_the_policy_reads_the_replicas_reports_from_serves_context():
    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: 16, get_upscaling_factor=lambda: 1.0)
    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, total_num_requests=8.0, config=cfg,
                          aggregated_metrics={ADMITTED: {"a": 6.0, "b": 4.0}, TURNED_AWAY: {"a": 5.0, "b": 0.0}})
    assert slo_autoscaling_policy(ctx) == (pytest.approx(3.0), {})
    ctx.aggregated_metrics = None  # no report yet: Serve's rule
    assert slo_autoscaling_policy(ctx) == (pytest.approx(0.5), {})
    ctx.current_num_replicas = 0  # (a cold start: Serve's)
    ctx.policy_state = {}
    assert slo_autoscaling_policy(ctx)[0] == 2


def test_demand_rates_are_over_the_last_window():
    d = DemandRates(window_s=10.0)
    assert d.rates(0.0) == {ADMITTED: 0.0, TURNED_AWAY: 0.0}
    d.admitted, d.turned_away = 20, 5
    assert d.rates(5.0) == {ADMITTED: 4.0, TURNED_AWAY: 1.0}
    d.admitted, d.turned_away = 30, 5
    assert d.rates(15.0) == {ADMITTED: 1.0, TURNED_AWAY: 0.0}  # since 5.0: the sample at 0.0 left the window


def test_an_app_that_scales_to_zero_asks_for_none_once_no_replica_has_a_request_in_flight():
    """min_replicas 0: Serve's rule samples the calls at the replicas (short requests missed, the Ingress's probes
    now and then taken); Kairos asks for none where every running replica reports that it had no request in flight
    over the look-back (each report the most since the one before) and none waits at a handle."""
    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: 16, get_upscaling_factor=lambda: 1.0, min_replicas=0)
    ctx = SimpleNamespace(current_num_replicas=1, target_num_replicas=1, total_num_requests=0.01, config=cfg,
                          aggregated_metrics={ADMITTED: {"a": 0.0}, TURNED_AWAY: {"a": 0.0}, INFLIGHT: {"a": 0.0}})
    assert slo_autoscaling_policy(ctx)[0] == 0  # only probes: none
    ctx.aggregated_metrics[INFLIGHT] = {"a": 0.2}  # a request ran within the look-back
    assert slo_autoscaling_policy(ctx)[0] == pytest.approx(0.01 / 16)  # (Serve's rule: rounded up, one)
    ctx.aggregated_metrics[INFLIGHT] = {"a": 0.0}
    ctx.total_queued_requests = 1.0  # a request waits at a handle
    assert slo_autoscaling_policy(ctx)[0] > 0
    ctx.total_queued_requests = 0.0
    ctx.aggregated_metrics[TURNED_AWAY] = {"a": 1.0}  # (turned away: in flight first; its rate asks for more)
    ctx.aggregated_metrics[INFLIGHT] = {"a": 0.5}
    assert slo_autoscaling_policy(ctx)[0] == 2
    ctx.aggregated_metrics[TURNED_AWAY] = {"a": 0.0}
    ctx.aggregated_metrics[INFLIGHT] = {"a": 0.0}
    ctx.current_num_replicas = 2  # a replica that has not reported yet may be serving
    assert slo_autoscaling_policy(ctx)[0] > 0
    ctx.aggregated_metrics[INFLIGHT] = {"a": 0.0, "b": 0.0}
    assert slo_autoscaling_policy(ctx)[0] == 0
    cfg.min_replicas = 1  # (an app that keeps one: Serve's rule)
    assert slo_autoscaling_policy(ctx)[0] == pytest.approx(0.01 / 16)
    assert not idle(None, 1) and idle({}, 0)
