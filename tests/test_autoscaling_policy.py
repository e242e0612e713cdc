"""Kairos's autoscaling policy (deployments/autoscaling.py): Serve's queue rule, or more where the replicas turn
requests away for their load; the replicas' rates over a window."""
from types import SimpleNamespace

import pytest

from deployments.autoscaling import (ADMITTED, INFLIGHT, TURNED_AWAY, WINDOW_S, DemandRates, desired_replicas, idle,
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
    assert slo_autoscaling_policy(ctx) == (pytest.approx(3.0), {"kairos_replicas_seen": 2})  # (its own state)
    ctx.aggregated_metrics = None  # no report yet: Serve's rule
    assert slo_autoscaling_policy(ctx)[0] == pytest.approx(0.5)
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


def test_the_policy_does_not_scale_up_again_on_what_was_turned_away_before_the_last_scale_up():
    """15 req/s offered, 5 a replica: two replicas turned 5/s away and Serve added a third. The third serves 5/s and
    none is turned away any more, but the old two's rates (a window, then Serve's look-back) still hold the 429s of
    before: times the new count they asked for 4 (then 5, 6: the extra replicas stayed up for the downscale delay).
    Until the window and Serve's look-back over the reports have passed since the scale-up, the target stays;
    after them, the rates are the new replicas'."""
    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: 64, get_upscaling_factor=lambda: 1.0, min_replicas=1,
                          look_back_period_s=30.0)
    ctx = SimpleNamespace(current_num_replicas=3, target_num_replicas=3, total_num_requests=24.0, config=cfg,
                          aggregated_metrics={ADMITTED: {"a": 5.0, "b": 5.0, "c": 5.0},
                                              TURNED_AWAY: {"a": 2.5, "b": 2.5, "c": 0.0}},
                          last_scale_up_time=1000.0, current_time=1010.0)
    assert slo_autoscaling_policy(ctx)[0] == 3
    ctx.current_time = 1000.0 + WINDOW_S + 1  # the reports Serve averages still reach back before the scale-up
    assert slo_autoscaling_policy(ctx)[0] == 3
    ctx.current_time = 1000.0 + WINDOW_S + 31  # rates of the three replicas now: what they still turn away counts
    assert slo_autoscaling_policy(ctx)[0] == 4
    ctx.current_time, ctx.current_num_replicas = 1010.0, 2  # the third still starting: the target (3) stays
    assert slo_autoscaling_policy(ctx)[0] == 3


def test_after_a_cold_start_the_policy_grows_at_once_on_what_the_new_replica_turns_away():
    """A scale-up from zero leaves no rate of before: what the first replica turns away is of it alone, so the hold
    after a scale-up does not apply (it held a cold-started app at one replica for the window and the look-back). A
    scale-up from one still holds. The policy learns the replicas before a scale-up from its own state, which Serve
    hands back each call."""
    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: 64, get_upscaling_factor=lambda: 1.0, min_replicas=0,
                          look_back_period_s=30.0)
    ctx = SimpleNamespace(current_num_replicas=0, target_num_replicas=0, total_num_requests=1.0, config=cfg,
                          total_queued_requests=1.0, aggregated_metrics={}, last_scale_up_time=None,
                          current_time=990.0, policy_state={})

    def ask() -> float:
        got, ctx.policy_state = slo_autoscaling_policy(ctx)
        return got

    assert ask() >= 1  # (Serve's cold start)
    ctx.current_num_replicas = ctx.target_num_replicas = 1
    ctx.last_scale_up_time, ctx.current_time = 1000.0, 1005.0
    ctx.aggregated_metrics = {ADMITTED: {"a": 5.0}, TURNED_AWAY: {"a": 5.0}, INFLIGHT: {"a": 8.0}}
    assert ask() == 2  # (5 admitted, 5 turned away: twice the replicas, at once)
    ctx.current_num_replicas = ctx.target_num_replicas = 2
    ctx.last_scale_up_time, ctx.current_time = 1010.0, 1015.0
    ctx.aggregated_metrics = {ADMITTED: {"a": 5.0, "b": 5.0}, TURNED_AWAY: {"a": 2.5, "b": 0.0},
                              INFLIGHT: {"a": 8.0, "b": 8.0}}
    assert ask() == 2  # a scale-up from one: held while the rates may hold what one replica turned away
    ctx.current_time = 1010.0 + WINDOW_S + 31
    assert ask() == pytest.approx(2.5)  # (12.5 offered over 10 admitted, x 2: Serve rounds it up)
