"""Queue order (LDF), TTFT guard, credit batching and the VBS gate, on engine Request objects."""
from __future__ import annotations

import math
from collections import deque

import pytest

from core.request import SLO, Request
from core.sampling import SamplingParams
from scheduling.config import SchedulerConfig
from scheduling.queues import order_waiting
from scheduling.tpot_guard import (VBSGate, affordable_step_ms, behind_pace, hold_prefill, min_tpot,
                                   next_token_slack_ms, paced_tpot_ms, select_by_credit, trim_for_catch_up, trp,
                                   vbs)
from scheduling.ttft_guard import MeasuredMargin, find_ttft_unattainable, idle_margin_at, margin_at


def _req(rid: str, *, prompt: int = 10, ttft: float | None = None, tpot: float | None = None,
         arrival: float = 0.0, out_hint: int | None = None, max_tokens: int = 64) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens),
                   slo=SLO(ttft_ms=ttft, tpot_ms=tpot, output_len_hint=out_hint), arrival_s=arrival)


def _ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# --- queue order ---

def test_ldf_sorts_by_deadline_then_arrival_best_effort_last() -> None:
    q = deque([
        _req("be1", arrival=0.0),
        _req("late", ttft=3000, arrival=0.0),      # deadline 3.0
        _req("tie_b", ttft=1000, arrival=1.0),     # deadline 2.0
        _req("tie_a", ttft=1500, arrival=0.5),     # deadline 2.0, earlier arrival
        _req("be0", arrival=-1.0),
        _req("urgent", ttft=500, arrival=1.0),     # deadline 1.5
    ])
    order_waiting(q, "ldf")
    assert _ids(q) == ["urgent", "tie_a", "tie_b", "late", "be0", "be1"]


def test_fifo_order_leaves_queue_alone() -> None:
    q = deque([_req("b", ttft=900, arrival=1.0), _req("a", ttft=100, arrival=0.0)])
    order_waiting(q, "fifo")
    assert _ids(q) == ["b", "a"]
    with pytest.raises(ValueError):
        order_waiting(q, "lifo")  # type: ignore[arg-type]


# --- TTFT guard ---

def _prefill_ms(n: int) -> float:
    return 0.1 * n + 10.0


QUEUE = [  # (id, prompt tokens, deadline in ms from now=0; None = best effort)
    ("r0", 100, 100.0),   # cum 100:  20 + 50 = 70  < 100  ok
    ("r1", 500, 100.0),   # cum 600:  70 + 50 = 120 > 100  unattainable -> cum back to 100
    ("r2", 1000, None),   # cum 1100: best effort, never returned, tokens count
    ("r3", 100, 200.0),   # cum 1200: 130 + 50 = 180 < 200 ok
    ("r4", 100, 185.0),   # cum 1300: 140 + 50 = 190 > 185 unattainable -> cum back to 1200
    ("r5", 50, 186.0),    # cum 1250: 135 + 50 = 185 < 186 ok (would be 195 had r4 stayed)
]


def _ttft_queue() -> list[Request]:
    return [_req(rid, prompt=n, ttft=ms) for rid, n, ms in QUEUE]


def test_ttft_guard_rejects_by_cumulative_prefill() -> None:
    out = find_ttft_unattainable(_ttft_queue(), 0.0, _prefill_ms, 50.0, lambda r: r.num_prompt_tokens)
    assert _ids(out) == ["r1", "r4"]


def test_ttft_guard_base_ms_and_now() -> None:
    def unattainable(now_s: float, base_ms: float = 0.0) -> list[str]:
        return _ids(find_ttft_unattainable(_ttft_queue(), now_s, _prefill_ms, 50.0,
                                           lambda r: r.num_prompt_tokens, base_ms=base_ms))

    # 10 ms of known delay: r3 needs 190 < 200 (ok), r5 needs 195 > 186.
    assert unattainable(0.0, base_ms=10.0) == ["r1", "r4", "r5"]
    # The same queue 0.1 s later: every SLO'd request has lost 100 ms of slack.
    assert unattainable(0.1) == ["r0", "r1", "r3", "r4", "r5"]


# --- credit batching ---

def _run_steps(reqs, steps: int, be: float = 0.5) -> list[list[str]]:
    t_min = min_tpot(reqs)
    return [_ids(select_by_credit(reqs, t_min, be)) for _ in range(steps)]


def test_trp_and_vbs() -> None:
    assert trp(60, 30, 0.5) == 0.5
    assert trp(math.inf, 30, 0.5) == 0.5
    assert trp(math.inf, math.inf, 0.5) == 0.5
    assert trp(30, math.inf, 0.5) == 1.0
    reqs = [_req(str(i), tpot=t) for i, t in enumerate((30, 30, 60, 60))]
    assert vbs(reqs, 30, 0.5) == 3.0
    assert min_tpot([]) == math.inf


def test_credit_schedule_2_4_6() -> None:
    reqs = [_req("R1", tpot=2), _req("R2", tpot=4), _req("R3", tpot=6)]
    assert _run_steps(reqs, 6) == [
        ["R1"], ["R1", "R2"], ["R1", "R3"], ["R1", "R2"], ["R1"], ["R1", "R2", "R3"],
    ]
    assert reqs[0].credit == 0.0  # T == T_min never touches credit


def test_credit_30_30_60_60_alternates_2_and_4() -> None:
    reqs = [_req(str(i), tpot=t) for i, t in enumerate((30, 30, 60, 60))]
    assert [len(b) for b in _run_steps(reqs, 6)] == [2, 4, 2, 4, 2, 4]


def test_credit_best_effort_paced_and_all_best_effort_unpaced() -> None:
    reqs = [_req("slo", tpot=30), _req("be")]
    assert _run_steps(reqs, 4, be=0.5) == [["slo"], ["slo", "be"], ["slo"], ["slo", "be"]]
    be_only = [_req("a"), _req("b")]
    assert _run_steps(be_only, 2) == [["a", "b"], ["a", "b"]]


def test_behind_pace_when_skipping_this_step_would_break_the_mean_tpot() -> None:
    # 4 tokens out, the first at t=1.0 s, TPOT 10 ms: the 5th is due by 1.040 s
    assert not behind_pace(1.0, 4, 10.0, now_s=1.025, this_step_ms=5.0, next_step_ms=5.0)  # skipped: at 1.035
    assert behind_pace(1.0, 4, 10.0, now_s=1.031, this_step_ms=5.0, next_step_ms=5.0)  # skipped: at 1.041
    assert behind_pace(1.0, 4, 10.0, now_s=1.025, this_step_ms=12.0, next_step_ms=5.0)  # a prefill rides along
    assert not behind_pace(None, 0, 10.0, 5.0, 5.0, 5.0)  # no first token yet: nothing to keep
    assert not behind_pace(1.0, 4, math.inf, 9.0, 5.0, 5.0)  # best effort has no pace


def test_credit_due_requests_decode_and_pay_down_to_minus_one() -> None:
    strict, loose = _req("strict", tpot=30), _req("loose", tpot=60)
    reqs = [strict, loose]
    behind = {"loose"}
    due = lambda r, n: r.request_id in behind  # noqa: E731
    assert _ids(select_by_credit(reqs, 30, 0.5, due)) == ["strict", "loose"]  # credit 0.5 -> paid: -0.5
    assert loose.credit == -0.5
    assert _ids(select_by_credit(reqs, 30, 0.5, due)) == ["strict", "loose"]  # 0.0 -> -1.0
    assert _ids(select_by_credit(reqs, 30, 0.5, due)) == ["strict", "loose"]  # -0.5 -> floor -1.0
    assert loose.credit == -1.0
    behind.clear()  # back on pace: its credit decides again, from -1
    assert [_ids(select_by_credit(reqs, 30, 0.5, due)) for _ in range(4)] == \
        [["strict"], ["strict"], ["strict"], ["strict", "loose"]]


def test_paced_tpot_spreads_a_replys_banked_time_over_the_tokens_it_has_left() -> None:
    # 11 tokens expected at 10 ms, the first at t=0: 5 out at t=20 ms, 20 ms ahead of its pace
    # (the 6th is due by 50 ms): 100 - 20 = 80 ms left for 6 tokens
    assert paced_tpot_ms(0.0, 5, 11, 10.0, 0.020) == pytest.approx(80.0 / 6)
    assert paced_tpot_ms(0.0, 5, 11, 10.0, 0.050) == pytest.approx(10.0)  # on its pace
    assert paced_tpot_ms(0.0, 5, 11, 10.0, 0.070) == 10.0  # behind it: its SLO, not less
    assert paced_tpot_ms(None, 0, 11, 10.0, 0.0) == 10.0  # no first token: no banked time
    assert math.isinf(paced_tpot_ms(0.0, 5, 11, math.inf, 0.02))  # best effort


def test_credit_at_a_paced_tpot_decodes_a_reply_ahead_of_its_pace_less_often() -> None:
    reqs = [_req("strict", tpot=30), _req("ahead", tpot=60), _req("on_pace", tpot=60)]
    pace = {"strict": 30.0, "ahead": 120.0, "on_pace": 60.0}
    steps = [_ids(select_by_credit(reqs, 30, 0.5, pace_of=lambda r: pace[r.request_id])) for _ in range(4)]
    assert steps == [["strict"], ["strict", "on_pace"], ["strict"], ["strict", "ahead", "on_pace"]]


def test_vbs_gate_counts_a_running_reply_at_its_paced_tpot() -> None:
    # running: T 32 and T 64 (100 tokens each); candidate: T 64. With SLO TPOTs VBS' = 1 + 0.5 + 0.5 = 2; with the
    # T 64 reply ahead of its pace (needs a token every 128 ms) VBS' = 1 + 0.25 + 0.5 = 1.75.
    seen: list[float] = []

    def itl(batch: float, ctx: float) -> float:
        seen.append(batch)
        return 16.0 * batch

    running = [_req("strict", tpot=32, prompt=100), _req("loose", tpot=64, prompt=100)]
    cand = _req("cand", tpot=64, prompt=100, out_hint=2)
    assert not VBSGate(running, itl, margin=1.0, slack=1.0).check(cand)  # 32 ms is not < 32
    assert seen[-1] == 2.0
    paced = {"strict": 32.0, "loose": 128.0}
    assert VBSGate(running, itl, margin=1.0, slack=1.0, running_tpot=lambda r: paced[r.request_id]).check(cand)
    assert seen[-1] == 1.75


# --- VBS gate ---
# A linear ITL with dyadic coefficients, so the boundary is exact in floating point:
# itl(B, L) = a·B·L + b·B + c·L + d with a = 1/256, b = 1, c = 1/128, d = 2.

def _itl(batch: float, ctx: float) -> float:
    return batch * ctx / 256 + batch + ctx / 128 + 2


def _gate_case(out_len: int, **kw) -> bool:
    # running: one request (T 64, 100 tokens); candidate: T 64, 140 prompt tokens.
    # T_min' = 64, VBS' = 2 -> itl = L / 64 + 4; L_in = (100 + 140) / 2 = 120; L = 120 + out_len / 2.
    gate = VBSGate([_req("run", tpot=64, prompt=100)], _itl, **kw)
    return gate.check(_req("cand", tpot=64, prompt=140, out_hint=out_len, max_tokens=10_000))


def test_vbs_gate_exact_boundary() -> None:
    # margin 1, slack 1: admit iff L / 64 + 4 < 64  <=>  L < 3840  <=>  out_len < 7440.
    assert _gate_case(7438, margin=1.0, slack=1.0)
    assert not _gate_case(7440, margin=1.0, slack=1.0)


def test_vbs_gate_default_margin_boundary() -> None:
    # k = 1.3, slack 0.99: (L / 64 + 4) * 1.3 < 63.36  <=>  L < 2863.26  <=>  out_len/2 < 2743.26.
    assert _gate_case(5486)
    assert not _gate_case(5488)


def test_vbs_gate_counts_round_admissions_and_tmin() -> None:
    seen: list[tuple[float, float]] = []

    def itl(batch: float, ctx: float) -> float:
        seen.append((batch, ctx))
        return 1.0

    gate = VBSGate([_req("r", tpot=50, prompt=100), _req("be", prompt=300)], itl, best_effort_trp=0.5)
    cand = _req("c", tpot=25, prompt=200, out_hint=40)
    assert gate.check(cand)
    # T_min' = 25: VBS' = 25/50 + 25/25 + 0.5; L = (100 + 300 + 200) / 3 + 40 / 2.
    assert seen[-1] == (2.0, 220.0)
    gate.admit(cand)
    assert gate.admitted == 1
    assert gate.check(_req("d", tpot=50, prompt=400, out_hint=40))
    # T_min stays 25: VBS' = 0.5 + 1 + 0.5 + 0.5; L = (600 + 400) / 4 + 20 (we divide by all 4 sequences).
    assert seen[-1] == (2.5, 270.0)


def test_vbs_gate_horizon_grows_each_reply_until_it_ends() -> None:
    """remaining_of (kairos's gate_context="horizon"): over the candidate's reply of O tokens, a running reply with m
    tokens left grows by min(m, O) / 2 on average; SCORPIO's form grows every reply by O / 2."""
    seen: list[float] = []

    def itl(batch: float, ctx: float) -> float:
        seen.append(ctx)
        return 1.0

    running = [_req("short", tpot=50, prompt=100), _req("long", tpot=50, prompt=300)]
    left = {"short": 10.0, "long": 400.0, "c": 200.0, "d": 20.0}
    gate = VBSGate(running, itl, remaining_of=lambda r: left[r.request_id],
                   output_len_estimate=lambda r: left[r.request_id])
    cand = _req("c", tpot=50, prompt=200)
    assert gate.check(cand)
    # (100 + 300 + 200 + min(10, 200) / 2 + min(400, 200) / 2 + 200 / 2) / 3
    assert seen[-1] == (600 + 5 + 100 + 100) / 3
    gate.admit(cand)
    assert gate.check(_req("d", tpot=50, prompt=100))
    # the admitted candidate's 200 left counts as the others': every reply grows by at most d's 20
    assert seen[-1] == pytest.approx((700 + (10 + 20 + 20) / 2 + 20 / 2) / 4)
    # SCORPIO's (no remaining_of): every context plus half the candidate's reply
    seen.clear()
    assert VBSGate(running, itl, output_len_estimate=lambda r: left[r.request_id]).check(cand)
    assert seen[-1] == 600 / 3 + 100
    # where every reply outlasts the candidate, the two agree
    seen.clear()
    both = [VBSGate(running, itl, output_len_estimate=lambda r: 8.0, **kw).check(_req("e", tpot=50, prompt=200))
            for kw in ({}, {"remaining_of": lambda r: left[r.request_id]})]
    assert all(both) and seen[0] == pytest.approx(seen[1])
    # a reply with exactly the candidate's reply left grows by all of it, as a longer one does
    seen.clear()
    tie = {"short": 8.0, "long": 8.0, "e": 8.0}
    assert VBSGate(running, itl, remaining_of=lambda r: tie[r.request_id],
                   output_len_estimate=lambda r: tie[r.request_id]).check(_req("e", tpot=50, prompt=200))
    assert seen[-1] == pytest.approx((600 + 8 + 8 / 2) / 3)
    # leaves_room's hypothetical request comes with its context over its reply: the horizon does not grow it
    seen.clear()
    gate = VBSGate(running, itl, remaining_of=lambda r: left[r.request_id],
                   output_len_estimate=lambda r: left[r.request_id])
    assert gate.leaves_room(cand, 50.0, 150.0)
    assert seen[-1] == pytest.approx((600 + 150 + 5 + 100 + 100) / 4)
    with pytest.raises(ValueError):
        SchedulerConfig(gate_context="mean")


def test_the_gate_plans_over_the_horizon_where_a_config_asks() -> None:
    assert SchedulerConfig(policy="kairos").flags().gate_context == "batch"
    assert SchedulerConfig(policy="scorpio").flags().gate_context == "batch"
    assert SchedulerConfig(policy="kairos", gate_context="horizon").flags().gate_context == "horizon"


def test_vbs_gate_output_len_estimate_overrides_hint() -> None:
    seen: list[float] = []
    gate = VBSGate([], lambda b, ctx: seen.append(ctx) or 1.0, output_len_estimate=lambda r: 10.0)
    assert gate.check(_req("c", tpot=50, prompt=100, out_hint=500))
    assert seen == [105.0]


def _skip_scenario(monotone_skip: bool) -> tuple[list[bool], int, VBSGate]:
    calls = []

    def itl(batch: float, ctx: float) -> float:
        calls.append(batch)
        return 40.0 * batch

    gate = VBSGate([_req("run", tpot=200)], itl, monotone_skip=monotone_skip)
    # A (T 50): VBS' 1.25 -> 50 * 1.3 > 49.5 fails.  B (T 40) and B2 (T 50) are no looser.
    # C (T 400): T_min' 200, VBS' 1.5 -> 60 * 1.3 < 198 passes.
    cands = [_req("A", tpot=50), _req("B", tpot=40), _req("B2", tpot=50), _req("C", tpot=400)]
    return [gate.check(c) for c in cands], len(calls), gate


def test_monotone_skip_skips_tighter_but_tries_looser() -> None:
    results, n_calls, gate = _skip_scenario(monotone_skip=True)
    assert results == [False, False, False, True]
    assert n_calls == 2  # B and B2 failed without evaluating the predictor
    assert not gate.stopped


def test_scorpio_head_of_line_stop() -> None:
    results, n_calls, gate = _skip_scenario(monotone_skip=False)
    assert results == [False, False, False, False]
    assert n_calls == 1
    assert gate.stopped
    assert not gate.check(_req("be"))  # SCORPIO breaks: nobody else is considered this step


def test_best_effort_never_rejected_but_counts_once_admitted() -> None:
    seen: list[float] = []

    def itl(batch: float, ctx: float) -> float:
        seen.append(batch)
        return 1e9

    gate = VBSGate([_req("run", tpot=64)], itl, best_effort_trp=0.25)
    for i in range(3):
        be = _req(f"be{i}")
        assert gate.check(be)
        gate.admit(be)
    assert seen == []
    assert not gate.check(_req("slo", tpot=64))
    assert seen == [1 + 1 + 3 * 0.25]


def test_itl_correction_is_bounded_windowed_and_neutral_when_idle():
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection(tau_ms=1000.0, lo=0.8, hi=2.5, min_pred_ms=50.0)
    assert c.factor(0.0) == 1.0  # nothing seen
    for k in range(20):  # steps take 1.5x the model
        c.observe(k * 0.015, 15.0, 10.0)
    assert c.factor(0.3) == pytest.approx(1.5)
    for k in range(20):  # a prefill-only step stalls decodes: its time counts, its prediction is 0
        c.observe(0.3 + k * 0.01, 10.0, 0.0 if k % 2 else 10.0)
    assert c.factor(0.5) > 1.5
    c2 = ItlCorrection(tau_ms=100.0, hi=2.5, min_pred_ms=10.0)
    for k in range(50):
        c2.observe(k * 0.01, 100.0, 10.0)
    assert c2.factor(0.5) == 2.5  # bounded above
    for k in range(50):
        c2.observe(1 + k * 0.01, 1.0, 10.0)
    assert c2.factor(1.5) == pytest.approx(0.8, abs=0.05)  # and below
    assert c2.factor(60.0) == 1.0  # a long idle gap forgets the window (no decode-only step: the profile)
    with pytest.raises(ValueError):
        ItlCorrection(lo=1.2)


def test_itl_correction_holds_the_decode_steps_factor_while_idle():
    """An idle engine's factor is what its decode-only steps measured, not the profile's 1: the gate then refuses
    after an idle gap what it refused a moment before (and what the machine's steps would miss). Prefill stalls,
    which a request decoding alone on an idle replica does not meet, are left out of it, and it averages over the
    last idle_horizon_ms of decoding, so a short request moves it little."""
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection(tau_ms=100.0, lo=0.8, hi=2.5, min_pred_ms=10.0, idle_horizon_ms=100.0, idle_prior_ms=1e-6)
    assert c.idle_factor() == 1.0 and c.factor(0.0) == 1.0  # nothing measured yet: the profile
    for k in range(10):  # decode-only steps at 1.4x the model, each followed by a prefill-only stall
        c.observe(k * 0.02, 14.0, 10.0, alone=True)
        c.observe(k * 0.02 + 0.01, 6.0, 0.0)
    assert c.factor(0.2) == pytest.approx((14.0 + 6.0) / 10.0, rel=0.05)  # busy: the stalls count
    assert c.idle_factor() == pytest.approx(1.4)
    assert c.factor(60.0) == pytest.approx(1.4)  # a long idle gap keeps the decode steps' factor
    for k in range(10):  # hybrid steps (prefill and decode in one) do not move it
        c.observe(61 + k * 0.01, 30.0, 10.0)
    assert c.idle_factor() == pytest.approx(1.4)
    c.observe(70.0, 9.0, 10.0, alone=True)  # one step of another speed: a tenth of the horizon
    assert 1.3 < c.factor(80.0) < 1.4
    for k in range(100):  # many: they replace it
        c.observe(81 + k * 0.01, 9.0, 10.0, alone=True)
    assert c.factor(120.0) == pytest.approx(0.9, abs=0.01)
    for k in range(100):
        c.observe(121 + k * 0.01, 90.0, 10.0, alone=True)
    assert c.factor(200.0) == pytest.approx(2.5, rel=1e-3)  # bounded
    # by default the profile's 1 weighs as 1000 ms of steps at first: 100 ms of them at 1.4x move it by degrees
    d = ItlCorrection()
    for k in range(10):
        d.observe(k * 0.01, 14.0, 10.0, alone=True)
    assert d.idle_factor() == pytest.approx((1000 * math.exp(-100 / 5000) + 140) / (1000 * math.exp(-100 / 5000) + 100),
                                            rel=0.01)
    for k in range(2000):  # and far more replace it
        d.observe(1 + k * 0.01, 14.0, 10.0, alone=True)
    assert d.idle_factor() == pytest.approx(1.4, rel=0.01)


def test_one_stalled_step_alone_does_not_hold_the_idle_factor_at_its_bound():
    """A step decoding alone that a pause stretched far past its prediction (a host's hiccup, a first call's
    compile) counts as `hi` times its prediction: one such step moves the idle factor by its share of the horizon,
    not to the bound for the horizon's whole predicted time (thousands of steps on an idle replica)."""
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection()
    for k in range(50):
        c.observe(k * 0.01, 5.0, 5.0, alone=True)
    c.observe(1.0, 1500.0, 5.0, alone=True)
    assert c.idle_factor() < 1.02
    for k in range(4000):  # a machine that is slower than its profile still shows so
        c.observe(2 + k * 0.01, 10.0, 5.0, alone=True)
    assert c.idle_factor() == pytest.approx(2.0, rel=0.02)


def test_itl_correction_offer_factor_is_the_least_idle_factor_of_its_memory():
    """The SLO floor's factor: a burst that slows the steps of requests decoding alone raises the idle factor, but
    not the offer factor while the lower one it measured before is within `offer_memory_s`; after that it follows
    the idle factor, down at once."""
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection(idle_horizon_ms=100.0, idle_prior_ms=1e-6, offer_memory_s=60.0)
    assert ItlCorrection().offer_memory_s == 10.0
    assert c.offer_factor(0.0) == c.idle_factor() == 1.0  # nothing measured: the profile
    for k in range(60):  # steps decoding alone at 1.2x the model
        c.observe(k * 0.01, 12.0, 10.0, alone=True)
    assert c.offer_factor(1.0) == pytest.approx(1.2)
    for k in range(60):  # a burst on a loaded host: the same steps at 2x
        c.observe(10 + k * 0.01, 20.0, 10.0, alone=True)
    assert c.idle_factor() == pytest.approx(2.0, rel=0.01)
    assert c.offer_factor(11.0) == pytest.approx(1.2)  # the floor offered before the burst still holds
    assert c.offer_factor(61.0) == pytest.approx(1.2)  # 1.2 still held at the window's start, until the burst
    assert 1.2 < c.offer_factor(70.0) < 1.4  # then the burst's first step's, which moved it little
    assert c.offer_factor(70.7) == pytest.approx(2.0, rel=0.01)  # all forgotten: what the steps measure now
    assert c.judge_factor(70.7) == pytest.approx(1.2)  # the verdict's memory is twice the offer's
    assert c.judge_factor(130.7) == pytest.approx(2.0, rel=0.01)
    assert len(c._lows) == 1  # what no window can need is dropped
    for k in range(60):  # quiet again: down at once
        c.observe(71 + k * 0.01, 11.0, 10.0, alone=True)
    assert c.offer_factor(72.0) == pytest.approx(1.1, rel=0.01)
    with pytest.raises(ValueError):
        ItlCorrection(offer_memory_s=-1.0)


def test_itl_correction_judges_with_every_floor_it_offered_within_its_memory():
    """An offer stands on the least idle factor of the offer memory, which may be a low measured most of a memory
    before, the factor up since: the factor an SLO is judged unattainable with (`judge_factor`) holds that low for
    a whole memory after the offer, where the offer factor has moved up a moment later."""
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection(idle_horizon_ms=100.0, idle_prior_ms=1e-6, offer_memory_s=10.0)
    for k in range(60):  # alone at the model's ITL
        c.observe(k * 0.01, 10.0, 10.0, alone=True)
    for k in range(60):  # then slower, a while later
        c.observe(1.0 + k * 0.01, 15.0, 10.0, alone=True)
    assert c.offer_factor(10.9) == pytest.approx(1.0)  # offered at 10.9 s: the low still in the offer's memory
    for t in (11.1, 12.0, 20.8):  # moments and a memory later, the offer factor has moved up; the verdict has not
        assert c.offer_factor(t) > 1.2 and c.judge_factor(t) == pytest.approx(1.0), t
    assert c.judge_factor(21.1) > 1.2 and c.judge_factor(21.7) == pytest.approx(c.idle_factor())
    # a low that a higher factor followed, which a lower one then replaced: it ended with the higher one's start
    c = ItlCorrection(idle_horizon_ms=1.0, idle_prior_ms=1e-6, offer_memory_s=10.0)
    for t, step_ms in ((0.0, 10.0), (1.0, 20.0), (15.0, 12.0)):  # 1.0 until 1 s, 2.0 until 15 s, then 1.2
        c.observe(t, step_ms, 10.0, alone=True)
    assert c.offer_factor(16.0) == pytest.approx(1.2, rel=0.01)  # 1.0 ended before the window
    assert c.judge_factor(16.0) == pytest.approx(1.0) and c.judge_factor(30.0) == pytest.approx(1.2, rel=0.01)


def test_itl_correction_step_factor_is_the_models_error_on_the_decode_only_steps():
    """`step_factor` leaves out every step that carried a prefill (prefill-only and hybrid alike), which `factor`
    counts as stall; with too few decode-only steps in the window it is the idle factor, as `factor` is."""
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection(tau_ms=1000.0, min_pred_ms=50.0, idle_prior_ms=1e-6)
    assert c.step_factor(0.0) == 1.0  # nothing measured: the profile
    for k in range(20):  # decode-only steps at 1.2x the model, hybrid steps of 30 ms, prefill-only stalls of 5 ms
        c.observe(k * 0.03, 12.0, 10.0, alone=True)
        c.observe(k * 0.03 + 0.01, 30.0, 10.0, prefill=True)
        c.observe(k * 0.03 + 0.02, 5.0, 0.0, prefill=True)
    assert c.step_factor(0.6) == pytest.approx(1.2)
    assert c.factor(0.6) == pytest.approx((12.0 + 30.0 + 5.0) / 20.0, rel=0.02)
    d = ItlCorrection(tau_ms=1000.0, min_pred_ms=50.0, idle_prior_ms=1e-6)
    for k in range(20):  # a decode-only step alone at 1.4x, then only steps with a prefill
        d.observe(k * 0.02, 14.0, 10.0, alone=True) if k == 0 else d.observe(k * 0.02, 30.0, 10.0, prefill=True)
    assert d.step_factor(0.4) == pytest.approx(d.idle_factor()) == pytest.approx(1.4)


def test_itl_correction_by_rows_keeps_a_factor_per_batch_size_bucket():
    from scheduling.tpot_guard import ItlCorrection

    c = ItlCorrection(tau_ms=1000.0, min_pred_ms=50.0)
    for k in range(20):  # one-row steps take 1.3x the model, 16-row steps 0.9x; every other step a stall of 5 ms
        c.observe(k * 0.02, 13.0, 10.0, 1)
        c.observe(k * 0.02 + 0.005, 9.0, 10.0, 16)
        c.observe(k * 0.02 + 0.01, 5.0, 0.0, 0)
    stalls = (13.0 + 9.0 + 5.0) / (13.0 + 9.0)  # the prefill-only share every bucket bears
    assert c.factor(0.4, 1) == pytest.approx(1.3 * stalls, rel=0.02)
    assert c.factor(0.4, 11) == pytest.approx(0.9 * stalls, rel=0.02)  # 11 rows: the (8, 16] bucket
    assert c.factor(0.4) == pytest.approx(1.35, rel=0.02)  # all steps: 27 ms per 20 predicted
    assert c.factor(0.4, 100) == c.factor(0.4)  # a bucket with no steps: the factor over all of them
    assert [ItlCorrection.bucket(n) for n in (0, 1, 2, 3, 4, 5, 200)] == [1, 1, 2, 4, 4, 8, 256]


def test_vbs_margin_is_the_policys_unless_set():
    from scheduling.config import SchedulerConfig

    assert SchedulerConfig(policy="scorpio").flags().vbs_margin == 1.3  # as published
    assert SchedulerConfig(policy="tpot_guard").flags().vbs_margin == 1.3
    assert SchedulerConfig(policy="kairos").flags().vbs_margin == 1.05  # its measured ITL correction covers the rest
    assert SchedulerConfig(policy="kairos", vbs_margin=1.3).flags().vbs_margin == 1.3
    assert SchedulerConfig(policy="scorpio", vbs_margin=1.2).flags().vbs_margin == 1.2


def test_affordable_step_is_what_keeps_the_mean_tpot_of_all_tokens() -> None:
    # 10 tokens expected at 4 ms, the first at t=0, 5 out at t=20 ms: 16 ms left of (10-1)*4 = 36 for 5 steps
    assert affordable_step_ms(0.0, 5, 10, 4.0, 0.020) == pytest.approx(16.0 / 5)
    assert affordable_step_ms(0.0, 5, 10, 4.0, 0.020, extra_steps=1) == pytest.approx(16.0 / 6)
    assert affordable_step_ms(0.0, 5, 3, 4.0, 0.020) == pytest.approx((5 * 4.0 - 20.0) / 1)  # n >= k + 1
    assert math.isinf(affordable_step_ms(None, 0, 10, 4.0, 0.0))  # no first token yet
    assert math.isinf(affordable_step_ms(0.0, 5, 10, math.inf, 0.02))  # best effort


def test_catch_up_leaves_out_requests_ahead_of_pace_until_the_step_fits() -> None:
    afford = {"behind": (3.0, 2.5), "ahead1": (9.0, 8.0), "ahead2": (7.0, 6.0), "tight": (3.5, 2.9)}

    def step(n: int) -> float:
        return 2.0 + 0.5 * n  # 4 decodes: 4.0 ms, 3: 3.5, 2: 3.0

    batch = ["behind", "ahead1", "tight", "ahead2"]
    kept = trim_for_catch_up(batch, step, lambda r, extra: afford[r][extra])
    # the most room sits out first, then the next, until the step (3.0 ms) fits the pressed request's 3.0 ms;
    # "tight" could not afford a skip at 3.0 ms, so it would have stayed
    assert kept == ["behind", "tight"]
    # a step that already fits is left alone
    assert trim_for_catch_up(batch, lambda n: 2.9, lambda r, extra: afford[r][extra]) == batch
    # nobody can wait: nothing is trimmed, even though the step stays too long
    assert trim_for_catch_up(["behind", "tight"], step, lambda r, extra: afford[r][extra]) == ["behind", "tight"]
    # with each request's own pace after the skip: "ahead2" (6.0 ms after a skip) cannot take 7 ms per token, so
    # only "ahead1" sits out and the step stays at 3.5 ms, over what "behind" affords: nobody else can wait
    pace = {"behind": 3.0, "ahead1": 7.0, "ahead2": 7.0, "tight": 3.5}
    assert trim_for_catch_up(batch, step, lambda r, extra: afford[r][extra], pace=pace.get) == [
        "behind", "tight", "ahead2"]
    # a request past saving (it cannot afford even a step alone, 2.5 ms) costs nobody a step
    afford["lost"] = (2.2, 2.0)
    assert trim_for_catch_up(["lost", "ahead1", "ahead2"], step, lambda r, extra: afford[r][extra]) == [
        "lost", "ahead1", "ahead2"]


def test_next_token_slack_is_the_time_until_the_next_token_is_due_at_the_slo() -> None:
    # 4 ms TPOT, the first token at t=0, 5 out: the 6th is due by 5 x 4 = 20 ms, 8 ms after t=12 ms
    assert next_token_slack_ms(0.0, 5, 4.0, 0.012) == pytest.approx(8.0)
    assert next_token_slack_ms(0.0, 5, 4.0, 0.025) == pytest.approx(-5.0)  # late: behind its pace
    assert math.isinf(next_token_slack_ms(None, 0, 4.0, 0.0))
    assert math.isinf(next_token_slack_ms(0.0, 5, math.inf, 0.02))


def test_hold_prefill_only_while_the_step_is_too_long_and_the_deadline_far() -> None:
    assert hold_prefill(85.0, 50.0, 2000.0, 80.0, 50.0)  # a step of 85 ms where 50 is absorbed; 2 s to spare
    assert not hold_prefill(45.0, 50.0, 2000.0, 40.0, 50.0)  # absorbed
    assert not hold_prefill(85.0, 50.0, 210.0, 80.0, 50.0)  # 210 ms left: no more than 2 x 80 + 50, so it goes
    assert hold_prefill(85.0, 50.0, 211.0, 80.0, 50.0)


def test_measured_margin_is_the_configured_one_until_measured_then_a_high_quantile_of_the_window() -> None:
    m = MeasuredMargin(50.0, quantile=0.9, window=20, min_samples=10)
    for e in range(9):
        m.observe(float(e))
    assert m.margin_ms() == 50.0  # 9 < min_samples: the configured margin
    m.observe(9.0)
    assert m.margin_ms() == 8.0  # 0..9: the 0.9 quantile is the 9th smallest
    for _ in range(20):
        m.observe(-3.0)  # early tokens count as no error; the window forgets the old ones
    assert m.margin_ms() == 0.0
    with pytest.raises(ValueError):
        MeasuredMargin(50.0, min_samples=0)


def test_measured_errors_age_out_and_an_idle_replica_uses_the_admissions_made_alone() -> None:
    m = MeasuredMargin(50.0, quantile=1.0, window=64, min_samples=4, window_s=60.0)
    for i in range(6):
        m.observe(400.0, predicted_ms=10.0, now_s=float(i))  # admitted in a busy round: 400 ms late
    assert m.margin_ms(10.0) == 400.0
    assert m.margin_ms(10.0, idle=True) == 50.0  # none admitted alone: the busy margin, at most the configured
    for i in range(4):
        m.observe(3.0, predicted_ms=10.0, now_s=10.0 + i, alone=True)
    assert m.margin_ms(10.0, idle=True) == 3.0 and m.margin_ms(10.0) == 400.0
    m.expire(62.0)  # the first two are over a minute old: 4 busy ones and the 4 made alone are left
    assert m.margin_ms(10.0) == 400.0 and m.table(idle=True)
    m.expire(80.0)  # all over a minute old: the configured margin again
    assert m.margin_ms(10.0) == 50.0 and m.margin_ms(10.0, idle=True) == 50.0
    assert idle_margin_at((), ((64.0, 5.0),), 10.0, 50.0) == 5.0  # a measured margin under the configured is kept


def test_a_long_prompts_error_raises_the_margin_of_prompts_as_long_not_of_short_ones() -> None:
    """The margin for a predicted prefill P is measured on the admissions predicted at most twice the power of two at
    or above P (at least min_samples of them): one long prompt whose prefill took 16 s more than predicted (the
    model extrapolated to it) leaves the margin of short requests as they measured it."""
    m = MeasuredMargin(50.0, quantile=0.99, window=64, min_samples=8)
    for i in range(40):
        m.observe(10.0 + i % 5, predicted_ms=5.0 + i % 3)  # short prompts: errors 10..14 ms, predicted 5..7 ms
    assert m.margin_ms(6.0) == m.margin_ms() == 14.0
    m.observe(16_000.0, predicted_ms=4_000.0)
    assert m.margin_ms(6.0) == 14.0 and m.margin_ms(20.0) == 14.0 and m.margin_ms() == 14.0
    assert m.margin_ms(3_000.0) == m.margin_ms(50_000.0) == 16_000.0  # prompts as long get its error
    assert m.table()[0] == (8.0, 14.0) and m.table()[-1] == (4096.0, 16_000.0)
    assert margin_at(m.table(), 1.0, 50.0) == 14.0 and margin_at((), 1.0, 50.0) == 50.0
    # below the smallest prediction measured: the min_samples smallest predicted
    m2 = MeasuredMargin(50.0, quantile=1.0, window=64, min_samples=4)
    for pred, err in [(100.0, 1.0), (100.0, 2.0), (100.0, 3.0), (200.0, 9.0), (3000.0, 500.0)]:
        m2.observe(err, pred)
    assert m2.margin_ms(0.5) == 9.0 and m2.margin_ms(300.0) == 9.0 and m2.margin_ms(2500.0) == 500.0


def test_the_ttft_guard_sums_each_prompts_attention_not_the_queues() -> None:
    """With an attention term (gamma per token pair), eight queued prompts of 200 tokens cost 1600 tokens and
    8 x 200² pairs: 1 + 16 + 32 = 49 ms, which a 100 ms SLO at the queue's end still meets; read as one 1600-token
    prompt (1600² pairs: 273 ms) the last would be turned away."""
    from types import SimpleNamespace

    from scheduling.predictor import LatencyModel, prefill_sq

    model = LatencyModel(prefill_coef=(0.01, 1.0, 1e-4))
    queue = [SimpleNamespace(deadline_s=0.1, n=200) for _ in range(8)]
    cost = lambda r: r.n  # noqa: E731
    assert find_ttft_unattainable(queue, 0.0, model.prefill_ms, 0.0, cost, cost_sq=lambda r: prefill_sq(0, r.n)) == []
    assert find_ttft_unattainable(queue, 0.0, model.prefill_ms, 0.0, cost) == queue[4:]


def test_a_lone_stall_does_not_become_the_ttft_margin() -> None:
    """Under 1 / (1 - quantile) errors a row takes its largest; one 1.5 s stall (a collection, a compile) among
    admissions 8 ms late made the margin 1.5 s, and a request of a 1 s TTFT SLO with a 12 ms prefill was turned away
    until the stall aged out. A lone error far above the rest and its own prefill is left out; two such set it."""
    m = MeasuredMargin(50.0, quantile=0.99, window=256, min_samples=32, window_s=60.0)
    for i in range(60):
        m.observe(8.0, predicted_ms=12.0, now_s=float(i))
    m.observe(1500.0, predicted_ms=12.0, now_s=60.0)
    assert m.margin_ms(12.0) == 8.0 and m.margin_ms(12.0, idle=False) == 8.0
    m.observe(1400.0, predicted_ms=12.0, now_s=61.0)  # a second: a tail, not a lone stall
    assert m.margin_ms(12.0) == 1500.0


def test_a_running_replys_mid_context_stays_within_the_context_it_can_reach():
    """The gate's context for a reply over the rest of it (`Scheduler._mid_len`, the router's gate line, work
    shedding's paced work): its prompt and the middle of the output still to come. Its tokens out were counted
    twice: 1,599 tokens for a reply of 100 + 1,000 at its 999th token."""
    from core.request import SLO, Request
    from core.sampling import SamplingParams
    from scheduling.scheduler import Scheduler

    r = Request("r", [1] * 100, SamplingParams(max_tokens=1000), SLO(tpot_ms=50))
    r.predicted_len = 1000
    got = []
    for k in (0, 500, 900, 999):
        r.token_ids = r.prompt_token_ids + [7] * k
        got.append(Scheduler._mid_len(r))
    assert got == [600.0, 850.0, 1050.0, 1099.5] and all(x <= 1100 for x in got)


def test_the_gate_length_never_falls_below_the_expected_one_as_the_reply_outlives_its_quantile():
    """length_gate_quantile (opt-in): the gate plans for a conservative quantile of the reply's length; once the
    reply outlives it, the plan follows the expected length (the outlook above what is out), not one more token
    (it fell to k + 1: one token left, where the distribution said hundreds)."""
    from core.request import SLO, Request
    from core.sampling import SamplingParams
    from scheduling.config import SchedulerConfig
    from scheduling.predictor import LatencyModel
    from scheduling.scheduler import Scheduler

    model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.0, 0.01, 5.0))
    s = Scheduler(SchedulerConfig(policy="kairos", length_predictor=True, length_gate_quantile=0.5), 512, 4,
                  max_model_len=4096, predictor=model)
    r = Request("r", list(range(3, 13)), SamplingParams(max_tokens=3000), SLO(tpot_ms=50))
    s.add(r)
    assert r.gate_len is not None
    for k in (0, r.gate_len + 1, 800, 1200):
        r.token_ids = r.prompt_token_ids + [7] * k
        assert r.gate_output_len >= r.expected_output_len > k, k
