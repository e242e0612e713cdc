"""`python -m bench.engine --quick` end to end on kairos-tiny: the JSON has every figure (no timing asserts)."""
from __future__ import annotations

import json
import math

import pytest

from bench import common


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from bench.engine import main

    path = tmp_path_factory.mktemp("bench") / "engine.json"
    assert main(["--model", "kairos-tiny", "--dtype", "float32", "--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_top_level(report):
    assert report["model"] == "kairos-tiny"
    assert report["dtype"] == "float32"
    assert report["threads"] == 2 and report["quick"] is True
    for k in ("bandwidth_gb_s", "overhead_pct_b32", "weight_bytes", "params", "bound_ms_step", "engine_startup_s"):
        assert _num(report[k]) and report[k] > 0, k
    for k in ("cpu", "date", "command"):
        assert isinstance(report[k], str) and report[k], k
    assert report["command"].startswith("python -m bench.engine") and "--quick" in report["command"]
    assert isinstance(report["loadavg"], dict) and isinstance(report["loadavg"]["start"], str)
    assert report["loadavg"]["samples"]


def test_decode(report):
    rows = report["decode"]
    assert isinstance(rows, list) and [r["batch"] for r in rows] == sorted(r["batch"] for r in rows)
    assert 1 in [r["batch"] for r in rows] and 32 in [r["batch"] for r in rows]
    for r in rows:
        for k in ("engine_tok_s", "hf_tok_s", "engine_ms_step", "hf_ms_step", "bound_tok_s"):
            assert _num(r[k]) and r[k] > 0, (r["batch"], k)
        assert isinstance(r["batch"], int)
        assert r["engine_tokens"] == r["batch"] * r["engine_steps"] or not r["engine_prefill_aligned"]
    b1 = next(r for r in rows if r["batch"] == 1)
    b32 = next(r for r in rows if r["batch"] == 32)
    assert b32["bound_tok_s"] == pytest.approx(32 * b1["bound_tok_s"])


def test_prefill(report):
    rows = report["prefill"]
    assert [r["shape"] for r in rows] == ["1x512", "8x128"]
    for r in rows:
        for k in ("engine_tok_s", "hf_tok_s", "engine_ms", "hf_ms"):
            assert _num(r[k]) and r[k] > 0, (r["shape"], k)


def test_mixed_and_overhead(report):
    m = report["mixed"]
    for k in ("engine_tok_s", "hf_tok_s", "engine_wall_s", "hf_wall_s"):
        assert _num(m[k]) and m[k] > 0, k
    assert isinstance(m["useful_tokens"], int) and m["useful_tokens"] > 0
    assert m["hf_generated_tokens_incl_waste"] >= m["useful_tokens"]
    o = report["overhead"]
    assert o["batch"] == 32
    for k in ("schedule_ms", "prepare_ms", "sample_ms", "postprocess_ms", "overhead_ms", "step_ms"):
        assert _num(o[k]) and o[k] >= 0, k
    assert report["overhead_pct_b32"] == pytest.approx(o["overhead_ms"] / o["step_ms"] * 100)


def test_common_helpers(tmp_path):
    assert common.percentile([3, 1, 2], 50) == 2
    assert common.percentile([1, 2, 3, 4], 25) == pytest.approx(1.75)
    assert math.isnan(common.percentile([], 50))
    s = common.summarize([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["p50"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0
    best, all_ = common.best_of(iter([0.3, 0.1, 0.2]).__next__, 3)
    assert best == 0.1 and all_ == [0.3, 0.1, 0.2]
    table = common.format_table(["a", "b"], [["x", 1.234], ["yy", None]], digits=2)
    lines = table.splitlines()
    assert len(lines) == 4 and "1.23" in lines[2] and "-" in lines[3]
    assert len({len(line) for line in lines}) == 1
    p = common.write_json(tmp_path / "sub" / "x.json", {"a": float("nan"), "b": (1, 2)})
    assert json.loads(p.read_text()) == {"a": None, "b": [1, 2]}
    assert isinstance(common.loadavg(), str) and common.cpu_model()
