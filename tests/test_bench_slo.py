"""The heterogeneous-SLO goodput benchmark, pure units: workload generator, metrics, lambda* search, reports, step
accounting (the end-to-end runs are in test_bench_slo_smoke.py)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from bench import metrics as M
from bench import workload as W

TIERS = (W.Tier("interactive", 100.0, 50.0), W.Tier("strict_tpot", 600.0, 30.0), W.Tier("relaxed", 3000.0, 50.0))


# --------------------------------------------------------------------------- workload

def test_same_seed_same_items_different_seed_differs():
    spec = W.WorkloadSpec(num_requests=200, rate_rps=2.0, seed=7)
    a, b = W.generate(spec, TIERS), W.generate(spec, TIERS)
    assert a == b
    c = W.generate(replace(spec, seed=8), TIERS)
    assert [w.prompt_ids for w in a] != [w.prompt_ids for w in c]
    assert [w.arrival_s for w in a] != [w.arrival_s for w in c]


def test_rate_only_scales_arrivals():
    spec = W.WorkloadSpec(num_requests=100, rate_rps=1.0, seed=3)
    a, b = W.generate(spec, TIERS), W.generate(replace(spec, rate_rps=4.0), TIERS)
    assert [w.prompt_ids for w in a] == [w.prompt_ids for w in b]
    assert [w.tier for w in a] == [w.tier for w in b]
    np.testing.assert_allclose([w.arrival_s / 4.0 for w in a], [w.arrival_s for w in b])


def test_length_distributions_medians_and_caps():
    items = W.generate(W.WorkloadSpec(num_requests=5000, rate_rps=10.0, seed=1, vocab_size=500), TIERS)
    p = np.array([len(w.prompt_ids) for w in items])
    o = np.array([w.max_tokens for w in items])
    assert abs(np.median(p) - 100) <= 6
    assert abs(np.median(o) - 60) <= 4
    assert p.min() >= 4 and p.max() <= 512 and (p == 512).any()
    assert o.min() >= 2 and o.max() <= 256
    ids = np.concatenate([w.prompt_ids for w in items[:200]])
    assert ids.min() >= W.FIRST_TOKEN_ID and ids.max() < 500


def test_max_model_len_shortens_outputs():
    spec = W.WorkloadSpec(num_requests=500, seed=2, max_model_len=300, prompt=W.LengthDist(100, 0.8, 200, 4))
    assert all(len(w.prompt_ids) + w.max_tokens <= 299 for w in W.generate(spec, TIERS))


@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
def test_arrival_mean_gap(arrival):
    rate = 4.0
    items = W.generate(W.WorkloadSpec(num_requests=5000, rate_rps=rate, seed=5, arrival=arrival), TIERS)
    gaps = np.diff([0.0] + [w.arrival_s for w in items])
    assert abs(gaps.mean() - 1 / rate) < 0.06 / rate * (2 if arrival == "gamma" else 1)
    cv = gaps.std() / gaps.mean()
    assert abs(cv - (1.0 if arrival == "poisson" else math.sqrt(2))) < 0.12  # gamma shape 0.5: CV = sqrt(2)
    assert all(b >= a for a, b in zip([w.arrival_s for w in items], [w.arrival_s for w in items][1:]))


@pytest.mark.parametrize("mix", ["equal", "60-30-10"])
def test_tier_mix_proportions(mix):
    items = W.generate(W.WorkloadSpec(num_requests=5000, seed=9, mix=W.parse_mix(mix)), TIERS)
    want = W.MIXES[mix]
    for t, p in zip(TIERS, want):
        got = sum(w.tier == t.name for w in items) / len(items)
        assert abs(got - p) < 0.025, (t.name, got, p)
        assert all((w.ttft_ms, w.tpot_ms) == (t.ttft_ms, t.tpot_ms) for w in items if w.tier == t.name)


def test_parse_mix():
    assert W.parse_mix("equal") == pytest.approx((1 / 3,) * 3)
    assert W.parse_mix("6-3-1") == pytest.approx((0.6, 0.3, 0.1))
    with pytest.raises(ValueError):
        W.parse_mix("1-2")


def test_exact_lengths_are_hinted():
    exact = W.generate(W.WorkloadSpec(num_requests=200, seed=4), TIERS)
    assert all(w.output_len_hint == w.max_tokens == w.output_len and w.stop_after is None for w in exact)


class _FakePredictor:
    def prefill_ms(self, n, q=None):
        return 0.5 * n + 10.0

    def itl_ms(self, b, length):
        return 0.01 * b * length + 2.0 * b + 0.02 * length + 20.0


def test_slo_scale_follows_the_protocol():
    spec = W.WorkloadSpec()
    sc = W.slo_scale(_FakePredictor(), 512, spec)
    p = _FakePredictor()
    assert sc.p_budget_ms == pytest.approx(p.prefill_ms(512))
    assert sc.u_ms == pytest.approx(2 * p.prefill_ms(512))
    assert sc.l_bar == pytest.approx(spec.prompt.mean() + spec.output.mean() / 2)
    assert 120 < sc.mean_prompt < 160 and 70 < sc.mean_output < 95  # lognormal(0.8) means, capped
    t = {x.name: x for x in sc.tiers}
    h = W.GATE_HEADROOM  # TPOT tiers carry the VBS gate's margin: the strict tier admits ~4 requests
    assert (t["interactive"].ttft_ms, t["interactive"].tpot_ms) == pytest.approx((sc.u_ms, h * p.itl_ms(12, sc.l_bar)))
    assert (t["strict_tpot"].ttft_ms, t["strict_tpot"].tpot_ms) == pytest.approx((6 * sc.u_ms, h * p.itl_ms(4, sc.l_bar)))
    assert (t["relaxed"].ttft_ms, t["relaxed"].tpot_ms) == pytest.approx((30 * sc.u_ms, h * p.itl_ms(12, sc.l_bar)))
    raw = W.slo_scale(p, 512, spec, headroom=1.0)
    assert {x.name: x.tpot_ms for x in raw.tiers}["strict_tpot"] == pytest.approx(p.itl_ms(4, sc.l_bar))
    assert set(sc.to_dict()["tiers"]) == set(W.TIER_NAMES)


def test_a_sharegpt_subset_gives_the_same_samples_from_a_smaller_file(tmp_path):
    class Words:  # a whitespace tokenizer: enough for the length filters
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    records = [{"conversations": [{"from": "human", "value": "a b c d " * (i % 7 + 1)},
                                  {"from": "gpt", "value": "x y z w " * (i % 5 + 1)}]} for i in range(60)]
    records[3:3] = [{"conversations": [{"from": "gpt", "value": "no human turn first"}]}, {"id": "empty"}]
    full, sub = tmp_path / "full.json", tmp_path / "sub.json"
    full.write_text(json.dumps(records))
    sub.write_text(json.dumps(W.sharegpt_subset(records, keep=20, seed=0)))
    assert W.sharegpt(Words(), 15, path=str(sub)).samples == W.sharegpt(Words(), 15, path=str(full)).samples
    # beyond the kept candidates the subset has nothing: the emptied turns fail the length filter
    assert len(W.sharegpt(Words(), 60, path=str(sub)).samples) == 20
    assert len(W.sharegpt(Words(), 60, path=str(full)).samples) == 60


def test_a_chat_corpus_sends_each_first_turn_as_one_user_message(tmp_path):
    """--api chat: the same first turns in the same order, each sent as a chat request of its text; the ids (and so
    the length filters, the prompt length and the cap) are the rendered chat's."""
    from bench.driver import request_body

    class Words:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    records = [{"conversations": [{"from": "human", "value": f"q{i} " * (i % 7 + 4)},
                                  {"from": "gpt", "value": "x y z w " * (i % 5 + 1)}]} for i in range(30)]
    f = tmp_path / "c.json"
    f.write_text(json.dumps(records))
    plain = W.sharegpt(Words(), 10, path=str(f))
    chat = W.sharegpt(Words(), 10, path=str(f), chat=lambda t: f"<user> {t} <assistant>")
    assert chat.chat and not plain.chat
    assert [s.text for s in chat.samples] == [s.text for s in plain.samples]
    assert all(len(c.prompt_ids) == len(p.prompt_ids) + 2 for c, p in zip(chat.samples, plain.samples))
    tiers = [W.Tier("t", 1000.0, 50.0)]
    spec = W.WorkloadSpec(num_requests=5, corpus=chat, lengths="hidden", mix=(1.0,))
    items = W.generate(spec, tiers)
    texts = {s.text for s in chat.samples}
    assert all(w.chat and w.prompt in texts and w.stop_after is not None for w in items)
    path, body, _ = request_body(items[0], "m")
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": items[0].prompt}]
    same = W.generate(replace(spec, corpus=plain), tiers)
    assert [w.stop_after for w in same] == [w.stop_after for w in items] and not any(w.chat for w in same)


# --------------------------------------------------------------------------- metrics on hand-made timelines

def rec(tier="t", ttft_slo=100.0, tpot_slo=20.0, arrival=0.0, first=None, n=0, gap=0.01, reason="length",
        rejected=False, end=None):
    """A request that arrives at `arrival`, gets its first token `first` s later, then n-1 more every `gap` s."""
    times = [] if first is None else [arrival + first + i * gap for i in range(n)]
    return M.Record(tier=tier, ttft_slo_ms=ttft_slo, tpot_slo_ms=tpot_slo, arrival_s=arrival,
                    rejected=rejected, finish_reason="rejected" if rejected else reason,
                    ttft_s=first, token_times=times, n_out=len(times),
                    finished_s=end if end is not None else (times[-1] if times else arrival + 0.001))


def test_tpot_is_e2e_minus_ttft_over_n_minus_1():
    r = rec(arrival=1.0, first=0.05, n=11, gap=0.02)
    assert r.e2e_s == pytest.approx(0.05 + 10 * 0.02)
    assert M.tpot_s(r) == pytest.approx((r.e2e_s - r.ttft_s) / 10)
    assert M.tpot_s(rec(first=0.05, n=1)) == 0.0
    assert M.tpot_s(rec(first=None, n=0)) is None
    # HTTP mode: chunk times may be fewer than tokens; n_out still divides
    r2 = M.Record("t", 100, 20, 0.0, finish_reason="length", ttft_s=0.1, token_times=[0.1, 0.5], n_out=5)
    assert M.tpot_s(r2) == pytest.approx(0.4 / 4)


def test_good_requires_both_slos_and_completion():
    assert M.is_good(rec(first=0.05, n=5, gap=0.01))
    assert not M.is_good(rec(first=0.15, n=5, gap=0.01))  # TTFT 150 > 100 ms
    assert not M.is_good(rec(first=0.05, n=5, gap=0.03))  # TPOT 30 > 20 ms
    assert M.is_good(rec(first=0.1, n=5, gap=0.02))  # boundaries are inclusive
    assert not M.is_good(rec(first=0.05, n=5, gap=0.01, reason="timeout"))
    assert not M.is_good(rec(rejected=True))
    assert M.is_good(rec(first=0.05, n=1))  # n = 1: TPOT 0


def test_goodput_is_over_the_arrivals_as_they_were_due_not_as_a_lagging_client_sent_them():
    """Two policies offered the same arrivals: where the HTTP client fell behind under one's load, its sends are late
    (0.4 s at the end here), and a span of the sends gave it a longer window, a lower goodput for the same good
    requests. The span of the due times (`Record.scheduled_s`) is the same for both; records without them (the
    simulator's, whose sends are never late) keep their sends' span."""
    due = [0.0, 1.0, 2.0, 3.0]
    on_time = [replace(rec("a", arrival=t, first=0.05, n=2, gap=0.01), scheduled_s=t) for t in due]
    late = [replace(r, arrival_s=r.arrival_s + 0.1 * i) for i, r in enumerate(on_time)]
    assert M.window_of(on_time) == M.window_of(late) == 3.0
    assert M.window_of([replace(r, scheduled_s=None) for r in late]) == pytest.approx(3.3)
    assert M.summarize(late)["goodput_rps"] == M.summarize(on_time)["goodput_rps"]


def test_summary_goodput_adherence_rejections_and_violations():
    recs = [
        rec("a", arrival=0.0, first=0.05, n=5, gap=0.01),  # good
        rec("a", arrival=1.0, first=0.20, n=5, gap=0.01),  # TTFT violation
        rec("b", arrival=2.0, first=0.05, n=5, gap=0.05),  # TPOT violation
        rec("b", arrival=3.0, first=0.50, n=5, gap=0.05),  # both
        rec("b", arrival=4.0, rejected=True, end=4.01),  # rejected: a miss, not a violation
        rec("a", arrival=5.0, first=0.05, n=3, gap=0.01, reason="timeout", end=9.0),  # incomplete
        rec("a", arrival=6.0, first=0.01, n=2, gap=0.01),  # good, ends at 6.02
    ]
    s = M.summarize(recs, warmup_frac=0.0)
    assert s["n"] == 7 and s["good"] == 2
    assert s["adherence"] == pytest.approx(2 / 7)
    assert s["rejected"] == 1 and s["rejection_rate"] == pytest.approx(1 / 7)
    assert s["ttft_violations"] == 2 and s["tpot_violations"] == 2
    assert s["incomplete"] == 1
    assert s["wall_s"] == pytest.approx(9.0)  # first arrival 0 -> last end (the give-up at 9.0)
    # goodput over the arrivals' span (0 -> 6), the same for every policy offered them: over the run's own last end
    # it moved with the harness's drain (the give-up at 9.0) and with each policy's tail
    assert s["window_s"] == pytest.approx(6.0) and s["goodput_rps"] == pytest.approx(2 / 6.0)
    assert s["output_tokens"] == 5 * 4 + 3 + 2
    assert s["token_throughput"] == pytest.approx(25 / 9.0)
    a, b = s["per_tier"]["a"], s["per_tier"]["b"]
    assert (a["n"], a["good"], a["ttft_violations"], a["incomplete"]) == (4, 2, 1, 1)
    assert (b["n"], b["good"], b["rejected"], b["tpot_violations"]) == (3, 0, 1, 2)
    assert b["adherence"] == 0.0
    assert b["ttft_p50_ms"] == pytest.approx(275.0)  # served b: 50 and 500 ms
    assert b["tpot_p50_ms"] == pytest.approx(50.0)
    assert s["reject_reasons"] == {"rejected": 1}
    assert M.summarize(recs, warmup_frac=0.0, window_s=18.0)["goodput_rps"] == pytest.approx(2 / 18.0)


def test_warmup_drop_by_arrival():
    recs = [rec(arrival=float(t), first=0.05 if t >= 2 else 5.0, n=3) for t in (9, 3, 0, 7, 1, 5, 2, 8, 4, 6)]
    kept = M.drop_warmup(recs, 0.2)
    assert [r.arrival_s for r in kept] == [float(t) for t in range(2, 10)]
    s = M.summarize(recs, warmup_frac=0.2)
    assert s["n"] == 8 and s["n_dropped_warmup"] == 2 and s["adherence"] == 1.0  # the two late ones were dropped
    assert M.summarize(recs, warmup_frac=0.0)["adherence"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        M.drop_warmup(recs, 1.0)


def test_empty_summary_is_nan_not_error():
    s = M.summarize([], warmup_frac=0.1)
    assert s["n"] == 0 and math.isnan(s["adherence"]) and math.isnan(s["goodput_rps"])


# --------------------------------------------------------------------------- capacity search and reporting

def test_the_reference_protocols_lambda_star_is_the_highest_rate_fcfs_keeps_its_adherence():
    from bench.slo import find_adherent_rate

    def fcfs(rate):  # adherence falls past 10 req/s
        return 1.0 if rate <= 10.0 else 0.5

    probed = []
    lam, probes = find_adherent_rate(lambda r: probed.append(r) or fcfs(r), 4.0, target=0.9, refine=2)
    assert probed[:3] == [4.0, 8.0, 16.0]  # doubled until it fails, then two geometric bisections of (8, 16)
    assert probed[3] == pytest.approx(8 * 2 ** 0.5) and lam == pytest.approx(8 * 2 ** 0.25) and 8.0 < lam <= 10.0
    lam, _ = find_adherent_rate(fcfs, 40.0, refine=0)  # from above: halved until adherent
    assert lam == 10.0
    lam, probes = find_adherent_rate(lambda r: 0.0, 1.0, max_tries=2)  # never adherent: the lowest probed, flagged
    assert lam == 0.5 and "not bracketed" in probes[-1]["note"]
    lam, _ = find_adherent_rate(lambda r: None if r > 3 else 1.0, 2.0, refine=0)  # no figure counts as a miss
    assert lam == 2.0


def test_the_seats_guess_starts_where_fcfs_holds_the_strict_batch():
    """--lambda-guess seats: Little's law at --strict-batch seats (a GPU replica's batches are in the hundreds,
    where the B=4 guess would start the search far below its capacity)."""
    from types import SimpleNamespace

    from bench.slo import capacity_guess
    from scheduling.predictor import LatencyModel

    gpu = LatencyModel(prefill_coef=(0.025, 2.0, 0.0), decode_coef=(0.0, 0.03, 0.0, 5.0))  # ITL(32) = 5.96 ms
    scale = SimpleNamespace(mean_prompt=132.0, mean_output=500.0, l_bar=380.0)
    seats = capacity_guess(gpu, scale, seats=32)
    assert seats == pytest.approx(32 / (500 * 5.96e-3))  # 32 requests decoding 500 tokens each at 5.96 ms
    b4 = capacity_guess(gpu, scale)
    assert b4 == pytest.approx(0.4 * 1000 / (0.025 * 132 + 2.0 + 500 * 5.12 / 4))  # unchanged without seats
    assert seats > 10 * b4


def test_completion_rate_and_capacity_search():
    from bench.slo import completion_rate, find_capacity

    recs = [M.Record(tier="t", ttft_slo_ms=1, tpot_slo_ms=1, arrival_s=0.0, finish_reason="length",
                     finished_s=0.1 * i, n_out=2) for i in range(100)]
    assert completion_rate(recs) == pytest.approx(10.0)  # one every 100 ms, ramp and drain trimmed
    assert completion_rate(recs[:4]) is None

    served = []

    def measure(rate):  # an engine that completes at most 12 req/s
        served.append(rate)
        return min(rate, 12.0)

    cap, probes = find_capacity(measure, 5.0)
    assert cap == 12.0 and served == [5.0, 10.0, 20.0, 40.0]  # 10 -> 10 is not saturated, 20 and 40 -> 12 are
    cap, probes = find_capacity(lambda r: r, 1.0, max_tries=3)
    assert cap == 4.0 and "never saturated" in probes[-1]["note"]

    def ramping(rate):  # just past capacity the batch is not full for much of a run: the first saturated probe
        return {4.0: 3.3, 8.0: 4.6, 16.0: 4.5}[rate]  # reads low, the next one finds the plateau

    cap, probes = find_capacity(ramping, 4.0)
    assert cap == 4.6 and [p["rate_rps"] for p in probes] == [4.0, 8.0, 16.0]
    cap, probes = find_capacity(ramping, 8.0, max_tries=1)  # saturated once, no room to confirm: flagged
    assert cap == 4.6 and "no second probe" in probes[-1]["note"]

    def noisy(rate):  # saturated, then a probe that reads as not (or reads nothing), then saturated once more:
        return {2.0: 1.5, 4.0: 3.9, 8.0: 1.6, 16.0: 1.7}[rate]  # not twice in a row until the last

    cap, probes = find_capacity(noisy, 2.0)
    assert cap == 1.7 and [p["rate_rps"] for p in probes] == [2.0, 4.0, 8.0, 16.0]
    cap, probes = find_capacity(lambda r: {2.0: 1.5, 4.0: None, 8.0: 1.6, 16.0: 1.7}[r], 2.0)
    assert cap == 1.7 and len(probes) == 4


def test_acceptance_checks():
    from bench.slo import acceptance

    def row(policy, load, goodput, adh, ttft=0, tpot=0):
        return {"policy": policy, "load_multiple": load, "goodput_rps": goodput, "adherence": adh,
                "ttft_violations": ttft, "tpot_violations": tpot}

    res = [row("fcfs", 1.5, 1.0, 0.4, 30, 40), row("scorpio", 1.5, 2.0, 0.7), row("kairos", 1.5, 2.2, 0.75),
           row("edf_reject", 1.5, 1.2, 0.5, 5, 40), row("tpot_guard", 1.5, 1.1, 0.45, 30, 3),
           row("fcfs", 2.0, 0.5, 0.2)]
    acc = acceptance(res)
    assert acc["load_multiple"] == 1.5
    assert acc["scorpio_over_fcfs_goodput"] == pytest.approx(2.0)
    assert acc["scorpio_minus_fcfs_adherence_pts"] == pytest.approx(30.0)
    assert acc["kairos_goodput_ge_scorpio"] is True
    assert acc["ttft_violations_fcfs_vs_edf_reject"] == [30, 5]
    assert acc["tpot_violations_fcfs_vs_tpot_guard"] == [40, 3]
    assert acceptance([row("fcfs", 1.25, 1, 1), row("fcfs", 2.0, 1, 1)])["load_multiple"] == 1.25  # nearest


def test_policy_labels_with_overrides():
    from bench.slo import policy_spec

    assert policy_spec("kairos") == ("kairos", {})
    assert policy_spec("kairos+monotone_skip=false+vbs_margin=1.2") == (
        "kairos", {"monotone_skip": False, "vbs_margin": 1.2})


# --------------------------------------------------------------------------- step accounting

def test_step_tap_splits_prefill_stalls_and_decode_vs_model():
    """StepTap, an engine step observer: prefill-only share of engine time, decode wall / model ITL."""
    from types import SimpleNamespace as NS

    from bench.slo import StepTap, factors, step_figures
    from engine.stats import StepEvent

    subscribed = []
    model = NS(itl_ms=lambda b, length: 2.0 * b, step_prefill_ms=lambda n, q=None: 2.0 * n)  # 2 ms per request/token
    eng = NS(latency_model=model, add_step_observer=lambda fn: subscribed.append(fn) or (lambda: subscribed.remove(fn)))
    tap = StepTap(eng)
    assert subscribed == [tap]
    for n_pre, n_dec, wall in ((1, 0, 30.0), (0, 2, 5.0), (0, 2, 4.0), (1, 1, 11.0)):  # a hybrid: total only
        subscribed[0](StepEvent(0.0, n_pre, 10 * n_pre, n_dec, 10.0 if n_dec else 0.0, wall - 1.0, wall))  # 1 ms host
    raw = tap.close()
    assert subscribed == []  # unsubscribed
    figs = step_figures([raw, {"total_ms": 0.0, "prefill_only_ms": 0.0, "decode_ratios": []}])
    assert figs["prefill_only_pct"] == pytest.approx(60.0)  # 30 of 50 ms
    assert figs["decode_wall_over_model_p50"] == pytest.approx((1.25 + 1.0) / 2)  # 5/4 and 4/4
    assert figs["decode_wall_over_model_by_rows"] == {"2": pytest.approx(1.125)}  # both had 2 rows
    assert figs["decode_forward_over_model_by_rows"] == {"2": pytest.approx(0.875)}  # 4/4 and 3/4
    assert figs["decode_host_ms_by_rows"] == {"2": pytest.approx(1.0)}
    assert step_figures([]) == {"prefill_only_pct": None, "decode_wall_over_model_p50": None,
                                "decode_wall_over_model_by_rows": {}, "decode_forward_over_model_by_rows": {},
                                "decode_host_ms_by_rows": {}}
    rows = step_figures([{"total_ms": 1.0, "prefill_only_ms": 0.0, "decode_ratios": [1.0, 2.0, 3.0, 0.5],
                          "decode_rows": [1, 3, 4, 5]}])["decode_wall_over_model_by_rows"]
    assert rows == {"1": 1.0, "4": 2.5, "8": 0.5}  # rows in (k/2, k]
    cal = factors([raw])  # the calibration: medians of the same ratios
    assert cal["decode"] == pytest.approx(1.125) and cal["prefill"] == pytest.approx(1.5)  # 30 ms / (2 ms x 10)
    assert (cal["n_decode_steps"], cal["n_prefill_steps"]) == (2, 1)
    assert factors([{"decode_ratios": [], "prefill_ratios": []}])["decode"] == 1.0  # nothing seen: no change


def test_per_replica_split_counts_what_each_replica_answered():
    recs = [M.Record("t", 1e9, 1e9, float(i), finish_reason="length", ttft_s=0.1, token_times=[i + 0.1], n_out=4,
                     replica=rid) for i, rid in enumerate(["a", "b", "a", None])]
    recs.append(M.Record("t", 1e9, 1e9, 9.0, rejected=True, finish_reason="rejected", replica="b"))
    assert M.per_replica(recs) == {"a": {"requests": 2, "completed": 2, "output_tokens": 8},
                                   "b": {"requests": 2, "completed": 1, "output_tokens": 4}}
    assert M.summarize(recs, warmup_frac=0)["per_replica"] == M.per_replica(recs)


def test_rerouted_requests_are_counted_with_what_became_of_them():
    ok = M.Record("t", 1e9, 1e9, 0.0, finish_reason="length", ttft_s=0.1, token_times=[0.1], n_out=4, rerouted=1)
    late = M.Record("t", 1.0, 1e9, 1.0, finish_reason="length", ttft_s=0.5, token_times=[1.5], n_out=4, rerouted=1)
    turned_away = M.Record("t", 1e9, 1e9, 2.0, rejected=True, finish_reason="rejected", rerouted=1)
    plain = M.Record("t", 1e9, 1e9, 3.0, finish_reason="length", ttft_s=0.1, token_times=[3.1], n_out=4)
    recs = [ok, late, turned_away, plain]
    assert M.rerouted(recs) == {"requests": 3, "served": 2, "good": 1}  # `late` missed its 1 ms TTFT SLO
    assert M.summarize(recs, warmup_frac=0)["rerouted"] == M.rerouted(recs)


def test_slo_gpu_starts_a_labels_server_with_its_knobs():
    """bench/device/slo_gpu.py: a policy label's server runs its policy with the length predictor on and the label's
    knobs as app arguments, each of which the app accepts."""
    import importlib.util
    from pathlib import Path

    from deployments.args import AppArgs

    path = Path(__file__).resolve().parents[1] / "bench" / "device" / "slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    assert g.arm_server_args("scorpio") == "policy=scorpio length_predictor=true"
    got = g.arm_server_args("kairos+credit_batching=false+correction_stall_share=1")
    assert got == "policy=kairos length_predictor=true credit_batching=false correction_stall_share=1"
    cfg = AppArgs.model_validate(dict(t.split("=", 1) for t in got.split())).engine_config().scheduler
    assert (cfg.policy, cfg.length_predictor) == ("kairos", True)
    assert (cfg.credit_batching, cfg.correction_stall_share) == (False, 1.0)


def test_slo_gpu_gives_the_running_server_the_next_policy_in_place():
    """bench/device/slo_gpu.py: a label of scheduler knobs only goes to the running server as its LLM deployment's
    user_config (one the engine fixed at start, or an engine knob, gets a server of its own); the knobs validate
    as the replica's `reconfigure` takes them; each policy's decode steps are its own on the shared server."""
    import importlib.util
    from pathlib import Path

    from bench.driver import app_config
    from engine.config import EngineConfig, for_device, reconfigured
    from scheduling.config import SchedulerConfig

    path = Path(__file__).resolve().parents[1] / "bench" / "device" / "slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    assert g.arm_knobs("fcfs") == {"policy": "fcfs"}
    knobs = g.arm_knobs("kairos+credit_batching=false")
    assert knobs == {"policy": "kairos", "length_predictor": "true", "credit_batching": "false"} and g.in_place(knobs)
    assert not g.in_place({"policy": "kairos", "num_threads": "1"})  # an engine knob
    assert not g.in_place({"policy": "kairos", "max_num_seqs": "128"})  # fixed at start
    given = SchedulerConfig(policy="fcfs", max_num_seqs=256, prefill_max_tokens=2048)
    cfg = reconfigured(given, for_device(EngineConfig(scheduler=given), "cuda").scheduler, knobs, "cuda")
    assert (cfg.policy, cfg.length_predictor, cfg.credit_batching, cfg.vbs_margin) == ("kairos", True, False, 1.0)
    doc = app_config(["model=/m", "max_num_seqs=256"], 8123, {"policy": "fcfs"})
    app = doc["applications"][0]
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert app["args"] == {"model": "/m", "max_num_seqs": "256"} and app["import_path"] == "deployments:app"
    assert app["deployments"] == [{"name": "LLMServer", "user_config": {"policy": "fcfs"}}]
    before = {"1": {"steps": 10, "mean": 1.0}}
    now = {"1": {"steps": 30, "mean": 1.5}, "2": {"steps": 5, "mean": 2.0}}
    assert g.steps_between(now, before) == {"1": {"steps": 20, "mean": 1.75}, "2": {"steps": 5, "mean": 2.0}}
    assert g.steps_between(now, None) == now


def test_a_replica_takes_its_user_config_as_scheduler_knobs_and_keeps_serving_on_a_bad_one():
    """`LLMReplica.reconfigure` (Serve's user_config): the knobs go to its engine once per change; a bad one is
    logged and changes nothing, where raising would have Serve replace the replica with one that fails the same."""
    from types import SimpleNamespace

    from deployments.replica import LLMReplica
    from scheduling.config import SchedulerConfig

    asked = []

    def reconfigure(knobs):
        asked.append(knobs)
        if "max_num_seqs" in knobs:
            raise ValueError("max_num_seqs cannot change")
        return SchedulerConfig(**knobs)

    start = SchedulerConfig()
    rep = SimpleNamespace(engine=SimpleNamespace(reconfigure=reconfigure), _user_config={}, _sched=start,
                          replica_id="r")
    LLMReplica.reconfigure(rep, None)  # none given: nothing to change
    LLMReplica.reconfigure(rep, {"policy": "edf"})
    LLMReplica.reconfigure(rep, {"policy": "edf"})  # the same again: nothing
    assert asked == [{"policy": "edf"}] and rep._sched.policy == "edf" and rep._user_config == {"policy": "edf"}
    LLMReplica.reconfigure(rep, {"max_num_seqs": 3})
    assert rep._sched.policy == "edf" and rep._user_config == {"policy": "edf"}
    LLMReplica.reconfigure(rep, {})  # back to the start's knobs
    assert asked[-1] == {} and rep._user_config == {}


def test_slo_gpu_leaves_a_server_that_would_not_fit_to_a_resumed_call():
    """bench/device/slo_gpu.py: a server's expected time is the longest start so far plus its points at the time per
    point of the last server that ran (fcfs's with its probes); nothing before any ran."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "device" / "slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    assert g.expected_s({"built_s": 27.0}, 4) is None
    assert g.expected_s({"fcfs_start_s": 40.0, "fcfs_s": 300.0, "fcfs_points": 4}, 2, start_s=5.0) == \
        5.0 + 2 * 65.0 + 20.0  # taken in place: its own short start, not a fresh server's
    fcfs = {"built_s": 27.0, "fcfs_start_s": 40.0, "fcfs_s": 300.0, "fcfs_points": 4}
    assert g.expected_s(fcfs, 2) == 40.0 + 2 * 65.0 + 20.0
    both = fcfs | {"scorpio_start_s": 45.0, "scorpio_s": 105.0, "scorpio_points": 2}
    assert g.expected_s(both, 4) == 45.0 + 4 * 30.0 + 20.0
    assert g.expected_s(both | {"kairos_start_s": 50.0, "kairos_s": 50.0, "kairos_points": 0}, 4) == 50.0 + 120.0 + 20.0
    # fcfs's lambda* search is a phase of its own, not its points' time
    assert g.expected_s(fcfs | {"fcfs_probe_s": 100.0}, 2) == 40.0 + 2 * 40.0 + 20.0
    # an arm at a lower load: the last arm's time per point less its arrivals, plus this one's
    hi = {"kairos@1.5x_start_s": 5.0, "kairos@1.5x_s": 85.0, "kairos@1.5x_points": 2, "kairos@1.5x_arrivals_s": 20.0}
    assert g.expected_s(hi, 2, start_s=0.0, arrivals_s=30.0) == 0.0 + 2 * (40.0 - 20.0 + 30.0) + 20.0


def test_slo_gpu_sizes_its_points_to_the_time_left():
    """bench/device/slo_gpu.py: once lambda* is known, a point's requests are such that every point left fits the
    time: arrivals of N / (load x lambda*) each, plus each point's and each policy's overheads; within the floor and
    the cap."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "device" / "slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    loads = [1.0, 1.0, 2.0, 2.0]  # two seeds at two loads
    kw = dict(cap=1000, floor=100, point_overhead_s=10.0, run_overhead_s=20.0, margin_s=20.0)
    # 100 s: 20 margin, 20 for the run, 40 for the points: 20 s of arrivals at 2/20 + 2/40 s a request
    n = g.size_points(100.0, 20.0, loads, 1, **kw)
    assert n == 133
    assert sum(n / (m * 20.0) + 10.0 for m in loads) + 20.0 + 20.0 <= 100.0
    assert g.size_points(10_000.0, 20.0, loads, 1, **kw) == 1000  # the cap
    assert g.size_points(50.0, 20.0, loads, 1, **kw) == 100  # the floor: the rest to a resumed call


def test_slo_gpu_runs_every_policy_at_the_highest_load_first():
    """bench/device/slo_gpu.py: the arms in the order they run: the issue's main checks (every policy at the highest
    load) first, then the lower loads of the policies run there (the last at a load first at the next: one policy
    swap fewer), the exact arms last."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "device" / "slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    plan = g.arm_plan(["fcfs", "scorpio", "kairos"], [1.0, 1.5], ["fcfs", "kairos"], ["kairos"])
    assert plan == [("fcfs", "predicted", 1.5), ("scorpio", "predicted", 1.5), ("kairos", "predicted", 1.5),
                    ("kairos", "predicted", 1.0), ("fcfs", "predicted", 1.0), ("kairos", "exact", 1.5)]
    assert [g.arm_key(*a) for a in plan[-2:]] == ["fcfs@1x", "kairos-exact@1.5x"]
    assert g.arm_plan(["fcfs"], [1.5], ["fcfs"], []) == [("fcfs", "predicted", 1.5)]


def test_slo_gpu_checks_from_its_rows():
    """bench/device/slo_gpu.py: the issue's acceptance checks from the rows of its bench.slo runs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "device" / "slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu", path)
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)

    def res(load, goodput, adh, seeds):
        return {"load_multiple": load, "rate_rps": 10.0 * load, "goodput_rps": goodput, "adherence": adh, "n": 100,
                "per_seed": [{"seed": s, "goodput_rps": x} for s, x in seeds], "rejection_rate": 0.1,
                "ttft_violations": 0, "tpot_violations": 1, "per_tier": {"a": {"adherence": adh}, "b": {"adherence": 0.3},
                                                         "c": {"adherence": None}}}  # (c: no request of the run)

    recs = [{"load_multiple": 1.5, "warmup": False, "rejected": False, "n_out": 9, "tpot_ms": t, "tpot_slo_ms": 10.0}
            for t in (5.0,) * 99 + (11.0,)] + [{"load_multiple": 1.5, "warmup": False, "rejected": True, "n_out": 0,
                                                  "tpot_ms": None, "tpot_slo_ms": 10.0}]
    rows = [g.point_row("fcfs", "predicted", res(1.5, 0.0, 0.0, [(0, 0.0), (1, 0.0)]), []),
            g.point_row("scorpio", "predicted", res(1.5, 4.0, 0.5, [(0, 4.0), (1, 4.0)]), []),
            g.point_row("kairos", "predicted", res(1.5, 5.0, 0.6, [(0, 5.0), (1, 4.4)]), recs),
            g.point_row("fcfs", "predicted", res(1.0, 8.0, 0.9, [(0, 8.0)]), []),
            g.point_row("kairos", "predicted", res(1.0, 9.0, 0.96, [(0, 9.0)]), []),
            g.point_row("kairos", "exact", res(1.5, 6.0, 0.7, [(0, 6.0)]), [])]
    assert rows[2]["tpot_met_admitted"] == pytest.approx(0.99) and rows[2]["admitted_with_tpot"] == 100
    hops = {"replica": {"n": 9, "min": 1.0, "mean": 3.0, "p50": 2.0, "p90": 5.0, "p99": 9.0, "max": 9.5}}
    assert g.point_row("kairos", "predicted", {**res(1.5, 5.0, 0.6, []), "http_hops_ms": hops}, [])[
        "http_hops_ms"] == {"replica": {"p50": 2.0, "p90": 5.0, "p99": 9.0, "max": 9.5}}  # where the TTFT went
    assert rows[0]["http_hops_ms"] == {}
    oracle = [{"load_multiple": 1.5, "oracle_best_own_tokens": 60,  # (one bound for all: kairos's own is less)
               "policies": {"kairos": {"good": 50, "oracle_own_tokens": 52}}}]
    acc = g.acceptance(rows, oracle, [1.0, 1.5])
    assert acc["kairos_over_scorpio_goodput"] == pytest.approx(1.25)
    assert acc["kairos_over_scorpio_per_seed"] == pytest.approx({0: 1.25, 1: 1.1})
    assert acc["kairos_predicted_over_exact_goodput"] == pytest.approx(5 / 6)
    assert acc["kairos_over_scorpio_min_seed"] == pytest.approx(1.1)
    assert acc["checks"] == {"scorpio_2x_fcfs": True, "kairos_1.15x_scorpio_each_seed": False, "kairos_tpot_99": True,
                             "kairos_every_tier_25": True, "kairos_90pct_oracle": False,
                             "kairos_low_load_adherence_95": True, "kairos_low_load_goodput_ge_fcfs": True}


def test_the_replicas_event_loop_lag_is_read_from_prometheus_text_and_taken_between_two_readings():
    from bench.driver import lag_between, loop_lag

    def text(counts, n, total):
        lines = [f'ray_kairos_event_loop_lag_s_bucket{{le="{b}",model="m",replica="{r}"}} {c}'
                 for r in ("a", "b") for b, c in counts.items()]
        lines += [f'ray_kairos_event_loop_lag_s_count{{model="m",replica="{r}"}} {n}' for r in ("a", "b")]
        lines += [f'ray_kairos_event_loop_lag_s_sum{{model="m",replica="{r}"}} {total}' for r in ("a", "b")]
        return "\n".join(lines + ['ray_kairos_vbs{model="m"} 3.0'])

    before = loop_lag(text({"0.001": 10, "0.1": 10, "+Inf": 10}, 10, 0.005))
    assert before == {"count": 20.0, "sum": 0.01, "le": {"0.001": 20.0, "0.1": 20.0, "inf": 20.0}}
    now = loop_lag(text({"0.001": 15, "0.1": 55, "+Inf": 60}, 60, 2.005))
    got = lag_between(now, before)  # 100 wake-ups: 10 within 1 ms, 80 within 100 ms, 10 past it
    assert got == {"wakeups": 100, "mean_ms": 40.0, "p50_le_ms": 100.0, "p90_le_ms": 100.0, "p99_le_ms": None,
                   "over_100ms": 10}
    assert lag_between(now, None)["wakeups"] == 120 and lag_between(now, now) is None
    assert loop_lag('ray_kairos_vbs{model="m"} 3.0') == {} and lag_between({}, before) is None
