"""`python -m bench.engine --quick` end to end: a checkpoint (kairos-tiny) and a shape built from a config, on the
CPU; the JSON and the summary have every figure (no timing asserts)."""
from __future__ import annotations

import json
import math

import pytest

from bench import metrics, report


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_ladders(doc: dict, contexts: dict[str, dict[int, list[int]]]) -> None:
    for key, want in contexts.items():
        assert {d["batch"]: d["contexts"] for d in doc[key]} == want, key
        for d in doc[key]:
            for k in ("ms_step", "tok_s", "bound_ms", "ratio_to_bound", "probe_ms", "kv_bytes_per_step"):
                assert _num(d[k]) and d[k] > 0, (key, d["batch"], k)
            assert d["steps"] == 4 and d["ratio_to_bound"] == pytest.approx(d["ms_step"] / d["bound_ms"])
    [p] = doc["prefill"]
    assert p["shape"] == "2x64" and _num(p["tflops"]) and _num(p["tok_s"]) and p["peak_tflops"] is None
    assert [h["batch"] for h in doc["hf"]] == [1, 4] and all(_num(h["ms_step"]) for h in doc["hf"])
    for k in ("bandwidth_gb_s", "weight_bytes", "params", "total_s"):
        assert _num(doc[k]) and doc[k] > 0, k
    assert _num(doc["startup"]["engine_init_s"]) and not doc["skipped"]
    [d] = doc["sampling"]  # greedy beside top-p, back to back
    assert d["batch"] == 4 and all(_num(d[k]) and d[k] > 0 for k in ("ms_step", "top_p_ms_step", "ratio"))
    [d] = doc["penalties"]  # greedy beside penalized greedy
    assert d["batch"] == 4 and all(_num(d[k]) and d[k] > 0 for k in ("ms_step", "penalized_ms_step", "ratio"))
    [d] = doc["logprobs"]  # greedy beside greedy with logprobs
    assert d["batch"] == 4 and all(_num(d[k]) and d[k] > 0 for k in ("ms_step", "logprobs_ms_step", "ratio"))
    [d] = doc["json"]  # greedy beside greedy in JSON mode
    assert d["batch"] == 4 and all(_num(d[k]) and d[k] > 0 for k in ("ms_step", "json_ms_step", "ratio"))


def test_a_checkpoint(tmp_path, monkeypatch):
    """`--model kairos-tiny`: the ladders, prefill and HF generate of a checkpoint; its summary by name."""
    from bench.engine import main

    monkeypatch.setattr(report, "SUMMARIES", tmp_path / "summaries")  # --summary NAME writes to bench/summaries/
    assert main(["--model", "kairos-tiny", "--dtype", "float32", "--quick", "--json", str(tmp_path / "e.json"),
                 "--summary", "engine-tiny"]) == 0
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["model"] == "kairos-tiny" and doc["shape"] is None and doc["dtype"] == "float32"
    assert doc["overlap"] == []  # the CPU engine does not overlap scheduling by default
    assert doc["threads"] == 2 and doc["quick"] is True and doc["model_path"]
    assert doc["command"].startswith("python -m bench.engine") and "--quick" in doc["command"]
    _check_ladders(doc, {"decode": {1: [32, 32], 4: [32, 32]}, "spread": {1: [56, 56], 4: [16, 96]}})
    s = json.loads((tmp_path / "summaries" / "engine-tiny.json").read_text())
    assert s["name"] == "engine-tiny" and s["command"] == doc["command"] and "--summary engine-tiny" in s["command"]
    assert s["headline"].startswith("kairos-tiny float32 on cpu: bw ") and "B=4 " in s["headline"]
    assert "HF generate" in s["headline"] and "\n" not in s["headline"]
    assert s["figures"]["decode"] == doc["decode"]


def test_a_shape_on_cpu(tmp_path):
    """`--device cpu --shape tiny --quick --overlap on`: the GPU check's whole run at a tiny shape (a model built from a
    config; overlap scheduling on, as on a GPU, so its steps are also timed without it), its summary at a path (as
    `--summary $OUT/...` on a GPU host)."""
    from bench.engine import main

    assert main(["--device", "cpu", "--shape", "tiny", "--quick", "--dtype", "float32", "--overlap", "on", "--json",
                 str(tmp_path / "shape.json"), "--summary", str(tmp_path / "out" / "engine-shape.json")]) == 0
    doc = json.loads((tmp_path / "shape.json").read_text())
    assert doc["shape"] == "tiny" and doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert doc["config"]["vocab_size"] == 512 and doc["config"]["num_key_value_heads"] == 2
    assert all(_num(doc["startup"][k]) for k in ("build_s", "save_s"))
    [o] = doc["overlap"]
    assert o["batch"] == 1 and all(_num(o[k]) and o[k] > 0 for k in ("ms_step", "no_overlap_ms_step", "ratio"))
    _check_ladders(doc, {"decode": {1: [32, 32], 4: [32, 32]}, "spread": {1: [56, 56], 4: [16, 96]}})
    s = json.loads((tmp_path / "out" / "engine-shape.json").read_text())
    assert s["name"] == "engine-shape" and "--shape tiny" in s["command"] and s["headline"].startswith("tiny ")
    assert s["figures"]["decode"] == doc["decode"] and "machine" in s and "date" in s
    assert "top-p 0.9 at B=4" in s["headline"] and "without overlap B=1" in s["headline"]


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


def test_prefill_model_measures_shapes_beside_the_fits(tmp_path, monkeypatch):
    """`python -m bench.prefill_model` on kairos-tiny: single prompts past the fitted range and rounds of short
    prompts, each beside the model with the attention term, the linear one and the engine's own fit, fitted on the
    same steps."""
    from bench.prefill_model import main

    monkeypatch.setattr(report, "SUMMARIES", tmp_path / "summaries")
    assert main(["--model", "kairos-tiny", "--dtype", "float32", "--max-model-len", "512", "--long", "500",
                 "--round", "256", "--profile-max", "128", "--reps", "1", "--hybrid-prompts", "32,128",
                 "--hybrid-rows", "8,32,128", "--skew-rows", "8,6", "--skew-context", "90",
                 "--summary", "prefill-tiny"]) == 0
    s = json.loads((tmp_path / "summaries" / "prefill-tiny.json").read_text())
    shapes = {r["prompts"]: r for r in s["figures"]["shapes"]}
    assert set(shapes) == {"1 x 128", "1 x 500", "4 x 64", "8 x 32", "16 x 16"}
    assert shapes["1 x 128"]["fitted_on"] and not shapes["1 x 500"]["fitted_on"]
    assert all(r["measured_ms"] > 0 and r["model_ms"] > 0 and r["linear_ms"] > 0 and r["engine_fit_ms"] > 0
               for r in shapes.values())
    assert set(s["figures"]["engine_fit"]) == {"theta", "c0", "coef"} and "engine's fit" in s["headline"]
    hybrid = s["figures"]["hybrid_steps"]  # a prompt prefilled beside decodes, each part alone, and as one forward
    assert {(h["prompt"], h["decode_rows"]) for h in hybrid} == {(p, b) for p in (32, 128) for b in (8, 32, 128)}
    assert all(h["hybrid_ms"] > 0 and h["prefill_ms"] > 0 and h["decode_ms"] > 0 and h["merged_ms"] > 0
               and abs(h["hybrid_over_merged"] - h["hybrid_ms"] / h["merged_ms"]) < 0.01 * h["hybrid_over_merged"]
               for h in hybrid)
    assert s["figures"]["coef_with_attention"][2] >= 0 and "worst error" in s["headline"]
    skew = s["figures"]["decode_skew"]  # one mean context, alike and skewed (6 rows: not a multiple of 4, left out)
    assert [(k["rows"], k["mean_context"], k["skewed_lengths"]) for k in skew] == [(8, 90, [30, 270])]
    assert skew[0]["even_ms"] > 0 and skew[0]["profile_spread_ms"] > 0 and skew[0]["skewed_ms"] > 0
