"""`python -m bench.engine --quick` end to end on kairos-tiny: the JSON has every figure (no timing asserts)."""
from __future__ import annotations

import json
import math

import pytest

from bench import metrics, report


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    from bench.engine import main

    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:  # --summary writes to bench/summaries/: keep it in the temp dir
        mp.setattr(report, "SUMMARIES", out / "summaries")
        assert main(["--model", "kairos-tiny", "--dtype", "float32", "--quick", "--json", str(out / "engine.json"),
                     "--summary", "engine-tiny"]) == 0
    return out


@pytest.fixture(scope="module")
def doc(out):
    return json.loads((out / "engine.json").read_text())


def test_top_level(doc):
    assert doc["model"] == "kairos-tiny"
    assert doc["dtype"] == "float32"
    assert doc["threads"] == 2 and doc["quick"] is True
    for k in ("bandwidth_gb_s", "overhead_pct_b32", "weight_bytes", "params", "bound_ms_step", "engine_startup_s"):
        assert _num(doc[k]) and doc[k] > 0, k
    for k in ("cpu", "date", "command"):
        assert isinstance(doc[k], str) and doc[k], k
    assert doc["command"].startswith("python -m bench.engine") and "--quick" in doc["command"]
    assert isinstance(doc["loadavg"], dict) and isinstance(doc["loadavg"]["start"], str)
    assert doc["loadavg"]["samples"]


def test_decode(doc):
    rows = doc["decode"]
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


def test_prefill(doc):
    rows = doc["prefill"]
    assert [r["shape"] for r in rows] == ["1x512", "8x128"]
    for r in rows:
        for k in ("engine_tok_s", "hf_tok_s", "engine_ms", "hf_ms"):
            assert _num(r[k]) and r[k] > 0, (r["shape"], k)


def test_mixed_and_overhead(doc):
    m = doc["mixed"]
    for k in ("engine_tok_s", "hf_tok_s", "engine_wall_s", "hf_wall_s"):
        assert _num(m[k]) and m[k] > 0, k
    assert isinstance(m["useful_tokens"], int) and m["useful_tokens"] > 0
    assert m["hf_generated_tokens_incl_waste"] >= m["useful_tokens"]
    o = doc["overhead"]
    assert o["batch"] == 32
    for k in ("schedule_ms", "prepare_ms", "sample_ms", "postprocess_ms", "overhead_ms", "step_ms"):
        assert _num(o[k]) and o[k] >= 0, k
    assert doc["overhead_pct_b32"] == pytest.approx(o["overhead_ms"] / o["step_ms"] * 100)


def test_report_and_metrics_helpers(tmp_path):
    assert metrics.percentile([3, 1, 2], 50) == 2
    assert metrics.percentile([1, 2, 3, 4], 25) == pytest.approx(1.75)
    assert math.isnan(metrics.percentile([], 50))
    s = metrics.distribution([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["p50"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0
    best, all_ = report.best_of(iter([0.3, 0.1, 0.2]).__next__, 3)
    assert best == 0.1 and all_ == [0.3, 0.1, 0.2]
    table = report.format_table(["a", "b"], [["x", 1.234], ["yy", None]], digits=2)
    lines = table.splitlines()
    assert len(lines) == 4 and "1.23" in lines[2] and "-" in lines[3]
    assert len({len(line) for line in lines}) == 1
    p = report.write_json(tmp_path / "sub" / "x.json", {"a": float("nan"), "b": (1, 2)})
    assert json.loads(p.read_text()) == {"a": None, "b": [1, 2]}
    assert isinstance(report.loadavg(), str) and report.cpu_model()


def test_summary(out, doc):
    s = json.loads((out / "summaries" / "engine-tiny.json").read_text())
    assert s["name"] == "engine-tiny" and s["command"] == doc["command"]
    assert "--summary engine-tiny" in s["command"]
    assert s["headline"].startswith("decode tok/s engine vs HF generate: B=1 ") and "B=32 " in s["headline"]
    assert "\n" not in s["headline"]
    f = s["figures"]
    assert f["model"] == "kairos-tiny" and f["dtype"] == "float32"
    assert f["decode"] == {str(r["batch"]): {"engine_tok_s": r["engine_tok_s"], "hf_tok_s": r["hf_tok_s"]}
                           for r in doc["decode"]}
    assert set(f["prefill_tok_s"]) == {"1x512", "8x128"} and _num(f["mixed_wall_s"]["engine"])


def test_shape_mode_on_cpu(tmp_path):
    """`--device cpu --shape tiny --quick`: the GPU benchmark's whole run at a tiny shape (a model built from a
    config, the decode ladders at equal and spread contexts, prefill, HF generate, start-up), its JSON and its
    summary at a path (as `--summary $OUT/...` on a GPU host)."""
    from bench.engine import main

    assert main(["--device", "cpu", "--shape", "tiny", "--quick", "--dtype", "float32", "--json",
                 str(tmp_path / "shape.json"), "--summary", str(tmp_path / "out" / "engine-shape.json")]) == 0
    doc = json.loads((tmp_path / "shape.json").read_text())
    assert doc["shape"] == "tiny" and doc["device"] == "cpu" and doc["dtype"] == "float32" and not doc["skipped"]
    assert doc["config"]["vocab_size"] == 512 and doc["config"]["num_key_value_heads"] == 2
    for k in ("bandwidth_gb_s", "weight_bytes", "params", "total_s"):
        assert _num(doc[k]) and doc[k] > 0, k
    for key, contexts in (("decode", {1: [32, 32], 4: [32, 32]}), ("spread", {1: [56, 56], 4: [16, 96]})):
        assert {d["batch"]: d["contexts"] for d in doc[key]} == contexts, key
        for d in doc[key]:
            for k in ("ms_step", "tok_s", "bound_ms", "ratio_to_bound", "probe_ms", "kv_bytes_per_step"):
                assert _num(d[k]) and d[k] > 0, (key, d["batch"], k)
            assert d["steps"] == 4 and d["ratio_to_bound"] == pytest.approx(d["ms_step"] / d["bound_ms"])
    p = doc["prefill"]
    assert p["shape"] == "2x64" and _num(p["tflops"]) and p["peak_tflops"] is None
    assert [h["batch"] for h in doc["hf"]] == [1, 4] and all(_num(h["ms_step"]) for h in doc["hf"])
    st = doc["startup"]
    assert all(_num(st[k]) for k in ("build_s", "save_s", "engine_init_s"))
    s = json.loads((tmp_path / "out" / "engine-shape.json").read_text())
    assert s["name"] == "engine-shape" and "--shape tiny" in s["command"] and s["headline"].startswith("tiny ")
    assert s["figures"]["decode"] == doc["decode"] and "machine" in s and "date" in s
