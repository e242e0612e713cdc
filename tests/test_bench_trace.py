"""bench.trace's reading of a --trace run (pure: hand-made records and steps)."""
import json

import pytest

from bench import trace


def _rec(**kw):
    base = {"policy": "kairos", "load_multiple": 1.5, "seed": 0, "tier": "relaxed", "warmup": False,
            "rejected": False, "arrival_s": 0.99, "prompt_len": 11, "tpot_slo_ms": 5.0}
    return {**base, **kw}


STEPS = {("kairos", 1.5, 0): [[1.0, 3.0, 1, 11, 2, 40.0], [1.003, 3.0, 0, 0, 3, 41.0], [1.090, 87.0, 1, 800, 3, 42.0],
                         [1.093, 3.0, 0, 0, 3, 43.0]]}


def test_a_miss_gets_its_longest_gap_and_the_step_that_ended_it():
    late = _rec(n_out=4, tpot_ms=31.0, token_times_s=[1.0, 1.003, 1.090, 1.093])
    fine = _rec(n_out=2, tpot_ms=3.0, token_times_s=[1.0, 1.003])
    shed = _rec(rejected=True, n_out=0, tpot_ms=None, token_times_s=[])
    warm = _rec(warmup=True, n_out=4, tpot_ms=31.0, token_times_s=[1.0, 1.003, 1.090, 1.093])
    (m,) = trace.misses([late, fine, shed, warm], STEPS, top=2)
    assert m.record is late
    assert [g.index for g in m.gaps] == [1, 0] and m.gaps[0].ms == pytest.approx(87.0)
    assert m.gaps[0].step[3] == 800 and m.gaps[0].steps == 1  # its own step prefilled an 800-token prompt
    assert "800 prompt tokens" in trace.describe(m)
    other_load = {**late, "load_multiple": 1.0}  # another run of the engine: none of these steps are its
    (m,) = trace.misses([other_load], STEPS)
    assert all(g.step is None and g.steps == 0 for g in m.gaps)


def test_a_prefill_step_of_its_own_inside_a_gap_is_found():
    """Without hybrid steps the prefill runs alone and the reply's token comes from the decode step after it."""
    steps = {("scorpio", 1.5, 0): [[1.0, 3.0, 0, 0, 2, 40.0], [1.085, 85.0, 1, 800, 0, 0.0],
                                   [1.089, 4.0, 0, 0, 3, 41.0]]}
    late = _rec(policy="scorpio", n_out=2, tpot_ms=89.0, token_times_s=[1.0, 1.089])
    (m,) = trace.misses([late], steps)
    assert m.gaps[0].steps == 2 and m.gaps[0].step[3] == 800


def test_main_reads_a_run_directory(tmp_path, capsys):
    rec = _rec(n_out=4, tpot_ms=31.0, token_times_s=[1.0, 1.003, 1.090, 1.093])
    (tmp_path / "records.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "steps.jsonl").write_text(json.dumps({"policy": "kairos", "seed": 0, "load_multiple": 1.5,
                                                      "steps": STEPS[("kairos", 1.5, 0)]}) + "\n")
    assert trace.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gap after token 1: 87.0 ms, 1 steps" in out and "1 TPOT misses" in out
