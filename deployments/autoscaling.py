"""Autoscaling the LLM replicas on what their SLOs turn away, not only on their queues.

Serve's own rule scales on ongoing requests per replica over a target. A Kairos replica under SLO load does not
queue much: its TTFT guard, VBS gate and work shedding answer the requests it cannot serve in time with a 429 at
once, so its ongoing requests stay near what it can serve while the demand it turns away grows. Each replica reports
the requests it admitted and those it turned away for its load, a second each over the last `WINDOW_S`
(`DemandRates`, Serve's `record_autoscaling_stats`), and `slo_autoscaling_policy` asks for as many replicas as
would have admitted them too (the offered over the admitted), or as Serve's rule asks, whichever is more; for a
window and Serve's look-back after a scale-up (not one from zero: no rate holds anything of before), the target it
made (the rates then still hold what the fewer replicas turned away). Serve
applies the config's bounds, delays and factors around it. `AppArgs.autoscaling` makes it the default policy of an
app's `autoscaling_config`.

Scale to zero (min_replicas 0): Serve's rule reads the calls at the replicas by samples, which miss most short
requests and now and then take the Ingress's probes (it asks a replica whether it can serve every few seconds,
`ingress.Readiness`): a light load could stop the last replica, and a probe sampled holds it and starts the delay
again. The replicas report the most requests they had in flight since their last report (`INFLIGHT`, generate calls
only, counted from their arrival: a request turned away at once counts too); where every one reports none over the
look-back and no request waits at a handle, the policy asks for none (Serve then waits `downscale_to_zero_delay_s`, else
`downscale_delay_s`). A request that finds none running is held by the Ingress, which asks for one with a call
through the handle: Serve's cold start.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

POLICY_PATH = "deployments.autoscaling:slo_autoscaling_policy"
WINDOW_S = 30.0  # the rates' window: about Serve's default look-back
ADMITTED, TURNED_AWAY = "kairos_admitted_per_s", "kairos_turned_away_per_s"
# a replica's most requests in flight (generate calls) since its last report: what a scale to zero must wait out
INFLIGHT = "kairos_inflight"
# the policy's own state between calls (Serve keeps what it returns): the replicas the last call saw, and the last
# scale-up's time and the replicas before it
_SEEN, _UP_AT, _UP_FROM = "kairos_replicas_seen", "kairos_scale_up_at", "kairos_scale_up_from"


class DemandRates:
    """A replica's requests admitted and turned away for its load (counted by its request path), as rates over
    the last `window_s` (read by Serve through `record_autoscaling_stats`)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.admitted = 0
        self.turned_away = 0
        self._samples: deque[tuple[float, int, int]] = deque()

    def rates(self, now: float) -> dict[str, float]:
        """{ADMITTED: ..., TURNED_AWAY: ...} per second since the oldest sample within the window (0 at first)."""
        self._samples.append((now, self.admitted, self.turned_away))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, a0, r0 = self._samples[0]
        span = now - t0
        if span <= 0:
            return {ADMITTED: 0.0, TURNED_AWAY: 0.0}
        return {ADMITTED: (self.admitted - a0) / span, TURNED_AWAY: (self.turned_away - r0) / span}


def desired_replicas(current: int, by_queue: float, admitted_per_s: float, turned_away_per_s: float) -> float:
    """The replicas to ask for: Serve's rule's (`by_queue`: the ongoing requests over the target a replica), or
    where the `current` replicas turned requests away for their load, `current` x (admitted + turned away) /
    admitted (the offered load over what they served), whichever is more. With nothing admitted but requests
    turned away, one more replica than now."""
    if turned_away_per_s <= 0:
        return by_queue
    if admitted_per_s <= 0:
        return max(by_queue, current + 1.0)
    return max(by_queue, current * (admitted_per_s + turned_away_per_s) / admitted_per_s)


def slo_autoscaling_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's custom autoscaling policy (its AutoscalingContext): Serve's own rule's replicas, raised by
    `desired_replicas` from the replicas' reports."""
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    by_queue, state = replica_queue_length_autoscaling_policy(ctx)
    # the replicas before the last scale-up: those of the call before it was made (none: a cold start, whose rates
    # hold nothing of before; unknown where no call saw them), kept in the policy's state, which Serve hands back
    before = getattr(ctx, "policy_state", None) or {}
    state = {**(state or {}), **{k: before[k] for k in (_UP_AT, _UP_FROM) if k in before},
             _SEEN: ctx.current_num_replicas}
    up = getattr(ctx, "last_scale_up_time", None)
    if up is not None and state.get(_UP_AT) != up:
        state[_UP_AT], state[_UP_FROM] = up, before.get(_SEEN)
    if ctx.current_num_replicas == 0:
        return by_queue, state
    metrics = ctx.aggregated_metrics or {}
    admitted = sum(v for v in (metrics.get(ADMITTED) or {}).values() if math.isfinite(v))
    turned = sum(v for v in (metrics.get(TURNED_AWAY) or {}).values() if math.isfinite(v))
    if getattr(ctx.config, "min_replicas", 1) == 0 and not getattr(ctx, "total_queued_requests", 0) \
            and idle(metrics.get(INFLIGHT), ctx.current_num_replicas):
        return 0.0, state
    now = getattr(ctx, "current_time", None)
    look_back = getattr(ctx.config, "look_back_period_s", None)
    hold = WINDOW_S + (look_back if isinstance(look_back, (int, float)) and look_back > 0 else WINDOW_S)
    if turned > 0 and up is not None and now is not None and now - up < hold and state.get(_UP_FROM) != 0:
        # the rates still hold what the replicas turned away before the last scale-up (their window, then Serve's
        # look-back over their reports): times the new count, they asked for more again and again. Until they are
        # of the replicas now: the target stays (or Serve's rule's, where more)
        return max(by_queue, float(getattr(ctx, "target_num_replicas", ctx.current_num_replicas))), state
    return desired_replicas(ctx.current_num_replicas, by_queue, admitted, turned), state


def idle(inflight: dict[Any, float] | None, replicas: int) -> bool:
    """Whether the replicas' reports say none had a request in flight over the look-back: one from each of the
    `replicas` running (a replica that has not reported yet may be serving), each 0 (each report is the most in
    flight since the one before)."""
    return inflight is not None and len(inflight) >= replicas and all(v == 0 for v in inflight.values())
