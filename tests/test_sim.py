"""bench.sim: bench.slo's workload through the real Scheduler on a virtual clock."""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import pytest

from bench import metrics as M
from bench import sim
from bench import slo
from bench import workload as W
from scheduling.config import SchedulerConfig
from scheduling.length_predictor import bucket_of
from scheduling.predictor import LatencyModel

MODEL = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0))  # prefill 1+0.01n, itl 5+0.5B


def _items(rate, n=60, seed=0, lengths="exact"):
    base = W.WorkloadSpec(num_requests=n, rate_rps=rate, seed=seed, max_model_len=2048, lengths=lengths)
    return W.generate(base, W.slo_scale(MODEL, 512, base).tiers)


def _run(policy, items, **kw):
    machine = sim.Machine(MODEL, factor=1.0, jitter=0.1, host_ms=0.1, seed=0)
    return sim.simulate(SchedulerConfig(policy=policy, **kw), items, machine, MODEL)


def test_a_light_load_is_served_whole_each_reply_at_its_length_in_virtual_time():
    items = _items(rate=0.5)
    recs = _run("fcfs", items)
    assert len(recs) == len(items) and all(r.completed for r in recs)
    assert [r.n_out for r in recs] == [w.output_len for w in items]
    for r, w in zip(recs, items):
        assert r.ttft_s > 0 and r.token_times[0] >= w.arrival_s and r.token_times == sorted(r.token_times)
    s = M.summarize(recs, warmup_frac=0.0)
    assert s["adherence"] > 0.9


def test_the_same_workload_and_seed_replay_the_same_run():
    items = _items(rate=40.0)
    a, b = _run("kairos", items), _run("kairos", items)
    assert [(r.finish_reason, r.reject_reason, r.token_times) for r in a] == \
        [(r.finish_reason, r.reject_reason, r.token_times) for r in b]
    assert any(r.rejected for r in a)  # overloaded: kairos turns requests away


def test_rejections_made_with_every_seat_taken_are_told_apart():
    items = _items(rate=40.0)
    machine = lambda: sim.Machine(MODEL, factor=1.0, jitter=0.1, host_ms=0.1, seed=0)  # noqa: E731
    few: set[int] = set()
    recs = sim.simulate(SchedulerConfig(policy="kairos", max_num_seqs=2), items, machine(), MODEL, seats_full=few)
    rejected = {r.index for r in recs if r.rejected}
    assert few and few <= rejected  # two seats under overload: requests turned away while both are taken
    ample: set[int] = set()
    recs = sim.simulate(SchedulerConfig(policy="kairos", max_num_seqs=512), items, machine(), MODEL, seats_full=ample)
    assert any(r.rejected for r in recs) and not ample  # turned away by the SLOs alone, never with seats taken


def test_hidden_lengths_end_at_the_benchmark_stop_which_only_the_run_reads():
    items = _items(rate=0.5, lengths="hidden")
    assert all(w.stop_after is not None and w.max_tokens > w.stop_after for w in items)
    recs = _run("kairos", items, bench_stop=True, length_predictor=False)
    assert [r.n_out for r in recs if r.completed] == [w.stop_after for w, r in zip(items, recs) if r.completed]


def test_the_command_line_compares_policies_on_paired_seeds(tmp_path, capsys):
    tiers = tmp_path / "tiers.json"
    MODEL.save(tiers)
    out = tmp_path / "sim.json"
    assert sim.main(["--tiers", str(tiers), "--dataset", "synthetic", "--policies", "scorpio,fcfs", "--seeds", "0-1",
                     "--num-requests", "60", "--lambda-star", "20", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [p["policy"] for p in doc["points"]] == ["scorpio", "fcfs"]
    assert all(len(p["goodput_rps"]) == 2 for p in doc["points"])
    assert all(p["scheduler_us_per_step"] > 0 for p in doc["points"])  # the host time its calls took, per step
    text = capsys.readouterr().out
    assert "scorpio / fcfs" in text and "us/step on this host" in text


def test_host_time_is_given_per_policy_label_for_a_replay_of_a_run(tmp_path):
    """--host-ms LABEL=MS (a label may hold '='; the last one splits) with a bare number for the other labels: each
    label's steps take its own host time (a slower host serves less), and the run's JSON records each one's."""
    assert sim.host_ms_of("0.2") == {None: 0.2}
    assert sim.host_ms_of("kairos+lengths=hidden=0.3, fcfs=0") == {None: 0.15, "kairos+lengths=hidden": 0.3,
                                                                   "fcfs": 0.0}
    for bad in ("fcfs=x", "0.1,0.2", "fcfs=-1", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            sim.host_ms_of(bad)
    tiers = tmp_path / "tiers.json"
    MODEL.save(tiers)
    out = tmp_path / "sim.json"
    assert sim.main(["--tiers", str(tiers), "--dataset", "synthetic", "--policies", "fcfs,fcfs+max_waiting=128",
                     "--seeds", "0", "--num-requests", "60", "--lambda-star", "20", "--host-ms",
                     "fcfs+max_waiting=128=40,0.1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [p["host_ms"] for p in doc["points"]] == [0.1, 40.0]
    assert doc["args"]["host_ms"] == {"*": 0.1, "fcfs+max_waiting=128": 40.0}
    slow, fast = doc["points"][1]["goodput_rps"][0], doc["points"][0]["goodput_rps"][0]
    assert slow < fast


def test_the_lambda_search_starts_where_the_device_run_does_and_records_its_probes(tmp_path, capsys):
    tiers = tmp_path / "tiers.json"
    MODEL.save(tiers)
    out = tmp_path / "sim.json"
    args = ["--tiers", str(tiers), "--dataset", "synthetic", "--policies", "fcfs", "--seeds", "0",
            "--num-requests", "40", "--probe-requests", "40", "--lambda-def", "adherence", "--lambda-refine", "1",
            "--strict-batch", "8", "--json", str(out)]
    assert sim.main(args + ["--lambda-guess", "seats"]) == 0
    doc = json.loads(out.read_text())
    probes = [p for p in doc["lambda_search"] if "rate_rps" in p]
    base = W.WorkloadSpec(max_model_len=2048)
    seats = slo.capacity_guess(MODEL, W.slo_scale(MODEL, 512, base, strict_batch=8), 8)
    assert probes[0]["rate_rps"] == pytest.approx(seats)  # bench.slo --lambda-guess seats: slo_gpu.sh's start
    assert all(0.0 <= p["adherence"] <= 1.0 for p in probes)
    adherent = [p["rate_rps"] for p in probes if p["adherence"] >= 0.9]
    assert doc["lambda_star_rps"] == pytest.approx(max(adherent) if adherent else min(p["rate_rps"] for p in probes))
    assert "lambda* search" in capsys.readouterr().out


def test_timing_the_scheduler_leaves_its_decisions_unchanged():
    items = _items(rate=30.0, n=80, seed=3)
    cfg = SchedulerConfig(policy="kairos", max_num_seqs=16)
    plain = sim.simulate(cfg, items, sim.Machine(MODEL, factor=1.0, jitter=0.1, host_ms=0.1, seed=0), MODEL)
    clock: dict[str, float] = {}
    timed = sim.simulate(cfg, items, sim.Machine(MODEL, factor=1.0, jitter=0.1, host_ms=0.1, seed=0), MODEL,
                         clock=clock)
    assert [(r.finish_reason, r.n_out, r.ttft_s) for r in plain] == [(r.finish_reason, r.n_out, r.ttft_s)
                                                                      for r in timed]
    assert clock["steps"] > 0 and clock["s"] > 0


@pytest.mark.parametrize("text, seeds", [("0-3", [0, 1, 2, 3]), ("0,2,5-6", [0, 2, 5, 6])])
def test_seed_ranges(text, seeds):
    assert sim.parse_seeds(text) == seeds


def test_a_synthetic_prediction_is_the_true_length_give_or_take_its_noise():
    rng = random.Random(0)
    for true_len in (20, 100, 400, 1500):  # nearly no noise: within the length's bucket (the predictor's resolution)
        assert bucket_of(sim.noisy_outlook(true_len, 0.05, rng)[0]) == bucket_of(true_len)
    wide = [sim.noisy_outlook(100, 1.5, rng)[0] for _ in range(200)]
    assert min(wide) < 60 and max(wide) > 200  # much noise: the estimates scatter
    # with the lengths' spread as a prior, noisy estimates are shrunk toward their typical length, as a calibrated
    # predictor's would be: the expected lengths scatter less than the noise alone would make them (same draws)
    lens = [int(math.exp(random.Random(k).gauss(math.log(200.0), 1.0))) + 4 for k in range(200)]
    prior = (statistics.fmean(math.log(n) for n in lens), statistics.pstdev(math.log(n) for n in lens))
    shrunk = [math.log(sim.noisy_outlook(n, 1.0, random.Random(k), prior)[0]) for k, n in enumerate(lens)]
    raw = [math.log(sim.noisy_outlook(n, 1.0, random.Random(k))[0]) for k, n in enumerate(lens)]
    assert statistics.pstdev(shrunk) < 0.85 * statistics.pstdev(raw)


def test_the_noise_arm_plans_with_synthetic_lengths_and_reports_how_they_rank(tmp_path, capsys):
    tiers = tmp_path / "tiers.json"
    MODEL.save(tiers)
    out = tmp_path / "sim.json"
    assert sim.main(["--tiers", str(tiers), "--dataset", "synthetic", "--policies",
                     "kairos+noise=0.05,kairos+noise=2,kairos+lengths=hidden", "--seeds", "0", "--num-requests", "60",
                     "--lambda-star", "20", "--json", str(out)]) == 0
    rank = {p["policy"]: p["length_spearman"] for p in json.loads(out.read_text())["points"]}
    assert rank["kairos+noise=0.05"] > 0.95 > rank["kairos+noise=2"]
    assert rank["kairos+lengths=hidden"] is None  # every request planned for its cap: no ranking
    assert "lengths' Spearman" in capsys.readouterr().out


@pytest.mark.parametrize("label", ["kairos+noise=-1", "kairos+noise=x", "kairos+noise=0.5+lengths=exact"])
def test_a_noise_arm_needs_a_spread_and_hidden_lengths(tmp_path, label):
    tiers = tmp_path / "tiers.json"
    MODEL.save(tiers)
    with pytest.raises(SystemExit, match="noise takes"):
        sim.main(["--tiers", str(tiers), "--dataset", "synthetic", "--policies", label, "--seeds", "0",
                  "--num-requests", "20", "--lambda-star", "20"])


def test_a_drifting_box_is_slow_or_fast_for_a_while_and_no_drift_changes_nothing():
    d = sim.Drift(0.2, 1.0, seed=3)
    steady = sim.Drift(0.0, 1.0, seed=3)
    assert [steady.at(t) for t in (0.0, 0.5, 9.0)] == [1.0, 1.0, 1.0]
    near = [math.log(d.at(i * 0.001)) for i in range(4000)]  # steps 1 ms apart: about the same speed
    assert max(abs(a - b) for a, b in zip(near, near[1:])) < 0.05
    assert 0.1 < statistics.pstdev(near) < 0.3  # over 4 s it wanders about its spread
    far = sim.Drift(0.2, 1.0, seed=3)
    apart = [math.log(far.at(i * 50.0)) for i in range(2000)]  # 50 time constants apart: independent
    assert abs(statistics.correlation(apart[:-1], apart[1:])) < 0.1
    assert statistics.pstdev(apart) == pytest.approx(0.2, rel=0.1)
    for bad in ((-0.1, 1.0), (math.nan, 1.0), (0.1, 0.0)):
        with pytest.raises(ValueError):
            sim.Drift(*bad, seed=0)
    assert sim.Drift(0.0, 0.0, seed=0).at(1.0) == 1.0  # no drift needs no time
    # the drift only scales each step: the jitter draws a step makes are those it makes without one
    machine = sim.Machine(MODEL, factor=1.0, jitter=0.1, host_ms=0.1, seed=0)
    plain_rng, drift_rng, wander = random.Random(5), random.Random(5), sim.Drift(0.3, 1.0, seed=0)
    for k in range(50):
        speed = wander.at(0.01 * k)
        plain = machine.step_ms(0, 4, 100.0, plain_rng) - 0.1
        assert machine.step_ms(0, 4, 100.0, drift_rng, speed=speed) - 0.1 == pytest.approx(plain * speed)
    items = _items(rate=2.0)
    plain = sim.simulate(SchedulerConfig(policy="kairos"), items, machine, MODEL)
    drifting = sim.simulate(SchedulerConfig(policy="kairos"), items,
                            sim.Machine(MODEL, factor=1.0, jitter=0.1, host_ms=0.1, seed=0, drift=0.3), MODEL)
    assert [r.token_times for r in drifting] != [r.token_times for r in plain]


def test_a_hybrid_step_saves_at_most_its_smaller_part():
    m = sim.Machine(MODEL, factor=1.0, jitter=0.0, host_ms=0.0, seed=0, hybrid_saving_ms=1e9)
    rng = random.Random(0)
    prefill, decode = MODEL.prefill_ms(64), MODEL.itl_ms(4.0, 100.0)
    assert m.step_ms(64, 4, 100.0, rng) == pytest.approx(max(prefill, decode))
    assert m.step_ms(64, 0, 0.0, rng) == pytest.approx(prefill)  # a step of one kind saves nothing
    assert m.step_ms(0, 4, 100.0, rng) == pytest.approx(decode)
    plain = sim.Machine(MODEL, factor=1.0, jitter=0.0, host_ms=0.0, seed=0)
    assert plain.step_ms(64, 4, 100.0, rng) == pytest.approx(prefill + decode)


def test_host_time_per_step_and_per_decode_row():
    m = sim.Machine(MODEL, factor=1.0, jitter=0.0, host_ms=0.2, seed=0, host_row_ms=0.01)
    rng = random.Random(0)
    assert m.step_ms(0, 16, 100.0, rng) == pytest.approx(MODEL.itl_ms(16.0, 100.0) + 0.2 + 16 * 0.01)
    assert m.step_ms(64, 0, 0.0, rng) == pytest.approx(MODEL.prefill_ms(64) + 0.2)  # a prefill alone: no row


def test_a_gpu_fitted_model_runs_the_scheduler_with_a_gpu_replicas_defaults(tmp_path):
    """The scheduler gets the defaults of the device the --tiers model was fitted on where the run leaves a knob
    unset, as the engine applies them (engine.config.for_device): on a GPU's, kairos's gate counts half the prefill
    stalls its ITL correction measures (correction_stall_share=0.5); on a CPU's all of them."""
    def goodputs(device: str) -> dict[str, list[float]]:
        model = LatencyModel(prefill_coef=(0.01, 1.0), decode_coef=(0.0, 0.5, 0.0, 5.0), meta={"device": device})
        tiers, out = tmp_path / f"tiers-{device}.json", tmp_path / f"sim-{device}.json"
        model.save(tiers)
        assert sim.main(["--tiers", str(tiers), "--dataset", "synthetic", "--policies",
                         "kairos,kairos+correction_stall_share=0.5,kairos+correction_stall_share=1", "--seeds", "0-1",
                         "--num-requests", "80", "--lambda-star", "25", "--loads", "1.5", "--json", str(out)]) == 0
        return {p["policy"]: (p["goodput_rps"], p["run_s"]) for p in json.loads(out.read_text())["points"]}

    gpu, cpu = goodputs("cuda:0"), goodputs("cpu")
    assert gpu["kairos"] == gpu["kairos+correction_stall_share=0.5"] != gpu["kairos+correction_stall_share=1"]
    assert cpu["kairos"] == cpu["kairos+correction_stall_share=1"] != cpu["kairos+correction_stall_share=0.5"]


def test_reply_scale_stretches_each_reply_within_its_cap_and_the_window():
    """--reply-scale: a hidden reply's stop moves within its cap; a forced one's max_tokens (and its hint) within the
    window; never below one token."""
    from bench import workload as W

    hidden = W.WorkItem(0.0, [5] * 10, 300, "relaxed", 3000.0, 50.0, None, stop_after=200)
    forced = W.WorkItem(0.0, [5] * 10, 200, "relaxed", 3000.0, 50.0, 200)
    short = W.WorkItem(0.0, [5] * 10, 300, "relaxed", 3000.0, 50.0, None, stop_after=1)
    a, b, c = sim.scaled_replies([hidden, forced, short], 2.0, 256)
    assert a.stop_after == 300 and a.max_tokens == 300  # its cap
    assert b.max_tokens == 256 - 10 - 1 and b.output_len_hint == b.max_tokens  # the window
    assert c.stop_after == 2
    a, b, c = sim.scaled_replies([hidden, forced, short], 0.25, 256)
    assert (a.stop_after, b.max_tokens, b.output_len_hint, c.stop_after) == (50, 50, 50, 1)
    # the exact arm's reply within the hidden arms' cap too (300 here, its own: a reply of 400 it was, 300 theirs)
    (b,) = sim.scaled_replies([forced], 2.0, 4096, cap=lambda prompt_len: 300)
    assert b.max_tokens == b.output_len_hint == 300


def test_over_oracle_counts_good_requests_against_shortest_first_with_the_same_tokens():
    """The GPU experiment's oracle check in the simulator: good requests over how many a shortest-first chooser
    completes with the decoded tokens of the admitted (bench.bound's "own tokens")."""
    from bench import driver as D

    def rec(out_len: int, good: bool, rejected: bool = False) -> D.Record:
        r = D.Record("relaxed", 1000.0, 100.0, 0.0, output_len=out_len, max_tokens=out_len)
        if rejected:
            r.rejected, r.finish_reason = True, "rejected"
        else:
            r.finish_reason, r.ttft_s = "length", 0.01 if good else 5.0
            r.token_times, r.n_out = [0.01 + 0.001 * i for i in range(out_len)], out_len
        return r

    # decoded 10 + 30 = 40 tokens; shortest first, 40 tokens complete the 5, 10 and 20 long replies: 3
    recs = [rec(10, True), rec(30, False), rec(5, False, rejected=True), rec(20, False, rejected=True)]
    assert sim.over_oracle(recs) == pytest.approx(1 / 3)
    assert math.isnan(sim.over_oracle([rec(5, False, rejected=True)]))


def test_a_runs_length_is_its_first_arrival_to_its_last_end():
    """`bench.sim.run_span_s`: what a point takes on the virtual clock (a rejected request ends where it ends, one
    with no end at its arrival); none: 0."""
    from bench.driver import Record
    from bench.sim import run_span_s

    recs = [Record("t", 1.0, 1.0, arrival_s=2.0, finished_s=9.5), Record("t", 1.0, 1.0, arrival_s=3.0,
                                                                            rejected=True, finished_s=3.1),
            Record("t", 1.0, 1.0, arrival_s=11.0)]
    assert run_span_s(recs) == 9.0 and run_span_s([]) == 0.0


def test_host_from_reads_each_policys_host_phases(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": [
        {"policy": "kairos", "phase_ms_per_step": {"forward": 2, "schedule": 0.1, "sample": 0.05, "postprocess": 0.1}},
        {"policy": "kairos", "phase_ms_per_step": {"forward": 2, "schedule": 9, "sample": 9, "postprocess": 9}},
        {"policy": "scorpio", "phase_ms_per_step": {"schedule": 0.02, "sample": 0.04, "postprocess": 0.06}},
        {"policy": "fcfs"},  # an HTTP run's point: no phases
    ]}))
    got = sim.host_ms_from(str(results))
    assert got == pytest.approx({"kairos": 0.25, "scorpio": 0.12})  # each label's first point
    summary = tmp_path / "summary.json"  # bench.slo's summary: the figures by policy
    summary.write_text(json.dumps({"figures": {"policies": {
        "kairos": {"phase_ms_per_step": {"schedule": 0.1, "sample": 0.05, "postprocess": 0.1}}, "fcfs": {}}}}))
    assert sim.host_ms_from(str(summary)) == pytest.approx({"kairos": 0.25})
