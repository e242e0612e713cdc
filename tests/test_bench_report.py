"""bench.report's generated tables: the summaries table of bench/README.md and the README's headline rows, each
written between its markers and nowhere else (pure: hand-made summaries in a temporary folder)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report

AMX = {"cpu": "Some Xeon", "cores": 2, "cpu_flags": ["avx512f", "amx_tile"]}


def _summary(root: Path, name: str, headline: str, figures: dict, machine: dict = AMX) -> None:
    doc = {"name": name, "command": f"python -m bench.x --summary {name}", "commit": "abc1234",
           "date": "2026-11-28T08:00:00+00:00", "machine": machine, "headline": headline, "figures": figures}
    (root / f"{name}.json").write_text(json.dumps(doc))


def test_summaries_table_has_a_row_per_summary(tmp_path: Path) -> None:
    _summary(tmp_path, "b-run", "B headline", {})
    _summary(tmp_path, "a-run", "A headline", {}, {"cpu": "EPYC", "cores": 2, "cpu_flags": ["avx2"],
                                                    "gpu": "Some GPU"})
    rows = report.summaries_table(tmp_path).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["[a-run](summaries/a-run.json)",
                                                       "[b-run](summaries/b-run.json)"]
    assert "EPYC, 2 cores, AVX2; GPU Some GPU" in rows[0] and "Some Xeon, 2 cores, AMX" in rows[1]
    assert "2026-11-28" in rows[1] and "B headline" in rows[1]


def test_summaries_table_shows_the_newest_of_each_group_and_counts_the_rest(tmp_path: Path) -> None:
    for i in range(4):
        _summary(tmp_path, f"slo-run{i}", f"slo {i}", {})
        doc = json.loads((tmp_path / f"slo-run{i}.json").read_text())
        doc["date"] = f"2026-11-2{i}T08:00:00+00:00"
        (tmp_path / f"slo-run{i}.json").write_text(json.dumps(doc))
    _summary(tmp_path, "peer-x", "peer", {})
    rows = [r.split("|")[1].strip() for r in report.summaries_table(tmp_path, per_group=2).splitlines()[2:]]
    assert rows == ["[peer-x](summaries/peer-x.json)", "[slo-run3](summaries/slo-run3.json)",
                    "[slo-run2](summaries/slo-run2.json)", "slo-*: 2 older"]


def test_headline_rows_come_from_the_named_summaries_only(tmp_path: Path, monkeypatch) -> None:
    table = {"headers": ["B", "kairos", "vllm", "ratio, median of rounds", "range"],
             "rows": [[1, 100.0, 40.0, "2.50", "2.4-2.6"], [8, 400.0, 200.0, "2.00", "1.9-2.1"]]}
    _summary(tmp_path, "peer-x", "peer", {"table": table})
    _summary(tmp_path, "http-x", "http", {"added_ttft_itl_ms": {"http[defaults]": {"in_process": [8.06, 2.72]}}})
    _summary(tmp_path, "unlisted", "not a headline", {})
    monkeypatch.setattr(report, "HEADLINES", (
        ("against vLLM", "peer-x", report._peer_ratios), ("HTTP adds", "http-x", report._http_added),
        ("a summary that is not committed", "missing", report._http_added)))
    rows = report.headline_table(tmp_path).splitlines()[2:]
    assert len(rows) == 2
    assert "2.50× / 2.00× tok/s (B=1 / 8)" in rows[0] and "[peer-x](bench/summaries/peer-x.json)" in rows[0]
    assert "TTFT +8.1 ms, ITL +2.7 ms (p50)" in rows[1]


def test_update_block_replaces_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- headline:begin -->\nold\n<!-- headline:end -->\nSecurity: kept\n")
    assert report.update_block(readme, "| new |", *report._HEADLINE)
    assert readme.read_text() == "intro\n<!-- headline:begin -->\n| new |\n<!-- headline:end -->\nSecurity: kept\n"
    assert not report.update_block(readme, "| new |", *report._HEADLINE)  # unchanged the second time
    readme.write_text("no markers\n")
    with pytest.raises(ValueError):
        report.update_block(readme, "| new |", *report._HEADLINE)


def test_the_committed_readme_tables_are_generated_from_the_committed_summaries() -> None:
    """Every headline row names a summary that exists, and README.md holds the table they generate."""
    # (a pattern's summaries come from a device's lease: its row appears once one is committed)
    assert all(report.newest(name) is not None for _, name, _ in report.HEADLINES if "*" not in name)
    assert report.headline_table() in report.TOP_README.read_text(encoding="utf-8")


def test_a_headline_pattern_means_its_newest_summary(tmp_path: Path) -> None:
    for name, date in (("http-h200-a", "2026-11-30"), ("http-h200-a-20261202", "2026-12-02"),
                       ("http-cpu", "2026-12-05")):
        _summary(tmp_path, name, name, {})
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(doc, date=f"{date}T08:00:00+00:00")))
    assert report.newest("http-h*-a*", tmp_path) == "http-h200-a-20261202"
    assert report.newest("http-cpu", tmp_path) == "http-cpu" and report.newest("http-x*", tmp_path) is None


def _slo_gpu_doc() -> dict:
    def row(policy, lengths, load, goodput, adherence):
        return {"policy": policy, "lengths": lengths, "load": load, "rate_rps": 10.0 * load, "goodput_rps": goodput,
                "adherence": adherence, "per_seed": [{"seed": 0, "goodput_rps": goodput}],
                "per_tier_adherence": {"interactive": adherence, "strict_tpot": 0.5, "relaxed": 1.0},
                "tpot_met_admitted": 1.0}
    return {"benchmark": "slo_gpu", "shape": "llama-8b", "dtype": "bfloat16", "device": "cuda", "gpu": "NVIDIA H200",
            "run": {"cpu": "Xeon", "cpu_count": 16, "cpu_flags": ["avx2"], "date": "2026-12-01T10:00:00+00:00",
                    "command": "python bench/device/slo_gpu.py --loads 1,1.5", "commit": "", "torch": "2.11"},
            "rows": [row("fcfs", "predicted", 1.0, 6.0, 0.9), row("kairos", "predicted", 1.0, 6.2, 0.96),
                     row("fcfs", "predicted", 1.5, 2.0, 0.2), row("kairos", "predicted", 1.5, 6.5, 0.6),
                     row("scorpio", "predicted", 1.5, 5.0, 0.5), row("kairos", "exact", 1.5, 7.0, 0.7)],
            "lambda_star_rps": 10.86, "acceptance": {"checks": {"scorpio_2x_fcfs": True, "kairos_tpot_99": True,
                                                                "kairos_90pct_oracle": False}}}


def _ingest_module():
    """bench/device/ingest.py, a script, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ingest", report.SUMMARIES.parents[1] / "bench/device/ingest.py")
    ingest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ingest)
    return ingest


def _lease_dirs(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """Two calls' folders and the summaries' (made), and the replica profiles' (not)."""
    call1, call2, sums, models = (tmp_path / n for n in ("call1", "call2", "summaries", "sim_models"))
    for d in (call1, call2, sums):
        d.mkdir()
    return call1, call2, sums, models


def test_ingest_keeps_call_1s_rows_over_a_fresh_call_2_and_goes_on_past_a_cut_archive(tmp_path: Path) -> None:
    """Call 2 on a fresh host (call 1's went back) starts the SLO run afresh and holds fewer rows: call 1's document
    is kept. A replica-profile archive cut off mid-write is noted, and the other results are still kept."""
    ingest, (call1, call2, sums, models) = _ingest_module(), _lease_dirs(tmp_path)
    slo = _slo_gpu_doc()
    (call1 / "slo-gpu.json").write_text(json.dumps(slo))
    (call2 / "slo-gpu.json").write_text(json.dumps(dict(slo, rows=slo["rows"][:1])))  # a fresh run, cut off
    (call1 / "slo_gpu-out.tgz").write_bytes(b"\x1f\x8b\x08\x00cut")  # (a gzip's head, then nothing)
    (call2 / "gpu-check.json").write_text(json.dumps({
        "name": "gpu-check", "command": "bash bench/device/gpu_check.sh", "commit": "", "date": "2026-12-01T10:09:00",
        "device": {"name": "NVIDIA H200"}, "tests": {"counts": {"passed": 3}, "results": []}}))
    written, note = ingest.ingest([call1, call2], commit="abc1234", summaries=sums, sim_models=models)
    assert sorted(p.name for p in written) == ["gpu-check-h200.json", "slo-gpu-h200-llama8b.json"]
    assert len(json.loads((sums / "slo-gpu-h200-llama8b.json").read_text())["figures"]["rows"]) == len(slo["rows"])
    assert any("WARNING: no replica profile" in line for line in note)


def test_ingest_takes_the_profile_beside_a_cut_off_summary_and_says_why_a_run_has_no_rows(tmp_path: Path,
                                                                                           capsys) -> None:
    """A call cut off before its archive: the replica profile slo_gpu.py keeps beside its summary is taken. A run
    that wrote no summary (its server never came up) prints its log's last lines, and one that ended on an error
    says so; a summary that records no commit gets the one given (main: this checkout's)."""
    ingest, (call1, call2, sums, models) = _ingest_module(), _lease_dirs(tmp_path)
    (call1 / "slo-gpu.json").write_text(json.dumps(dict(_slo_gpu_doc(), error="RuntimeError: cut")))
    (call1 / "replica-profile.json").write_text(json.dumps({"format": 2, "meta": {}}))
    (call1 / "slo_gpu.log").write_text("building\nRuntimeError: cut\n")
    written, note = ingest.ingest([call1], commit="abc1234", summaries=sums, sim_models=models)
    assert any(p.parent == models and "measured" in p.name for p in written)
    assert any("ended on an error: RuntimeError: cut" in line for line in note)
    assert json.loads((sums / "slo-gpu-h200-llama8b.json").read_text())["commit"] == "abc1234"
    (call2 / "slo_gpu.log").write_text("starting the server\nRuntimeError: the server did not come up\n")
    (call2 / "mixed-check.log").write_text("1 failed\n")
    assert ingest.main([str(call2), "--no-readme"]) == 1
    out = capsys.readouterr().out
    assert "nothing to ingest" in out and "the server did not come up" in out and "1 failed" in out


def test_ingest_keeps_a_leases_results_as_summaries(tmp_path: Path) -> None:
    """bench/device/ingest.py: a lease's files (two calls, the later one's wins) become summaries and a profile,
    and the SLO summary feeds its headline row."""
    import io
    import tarfile

    ingest, (call1, call2, sums, models) = _ingest_module(), _lease_dirs(tmp_path)
    slo = _slo_gpu_doc()
    (call1 / "slo-gpu.json").write_text(json.dumps(dict(slo, rows=slo["rows"][:2])))  # cut off: call 2 resumed it
    hops = {"client_proxy": {"p50": 1.0, "p99": 9.0}, "replica": {"p50": 12.0, "p99": 80.0},
            "engine_ttft": {"p50": 10.0, "p99": 30.0}}  # where the TTFT went (a row from before them has none)
    rows = [dict(slo["rows"][0], ttft_p50_ms=20.0, ttft_p99_ms=None, http_hops_ms=hops), *slo["rows"][1:]]
    (call2 / "slo-gpu.json").write_text(json.dumps(dict(slo, rows=rows,
                                                        http_front={"fcfs": "haproxy", "kairos": "serve-proxy"})))
    with tarfile.open(call1 / "slo_gpu-out.tgz", "w:gz") as tf:
        data = json.dumps({"format": 2, "meta": {}}).encode()
        info = tarfile.TarInfo("slo_gpu/replica-profile.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    _summary(call2, "overhead-http-gpu", "HTTP adds", {"added_ttft_itl_ms": {"http[defaults]": {"in_process":
                                                                                             [1.5, 0.7]}}})
    doc = json.loads((call2 / "overhead-http-gpu.json").read_text())
    (call2 / "overhead-http-gpu.json").write_text(json.dumps(dict(doc, commit="", command="x --model /tmp/kairos-llama-8b-bfloat16")))
    _summary(call2, "prefill-model-llama-8b-cuda", "prefill", {"hybrid_steps": [
        {"prompt": 128, "decode_rows": 32, "hybrid_over_sum": 0.68, "hybrid_over_merged": 1.02},
        {"prompt": 512, "decode_rows": 128, "hybrid_over_sum": 1.03, "hybrid_over_merged": 1.1}]})
    (call2 / "gpu-check.json").write_text(json.dumps({
        "name": "gpu-check", "command": "bash bench/device/gpu_check.sh", "commit": "", "date": "2026-12-01T10:09:00",
        "device": {"name": "NVIDIA H200"}, "versions": {"torch": "2.11"},
        "host": {"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 16, "cpu_flags": ["avx2", "amx_tile"]},
        "tests": {"counts": {"passed": 3, "failed": 1}, "results": [
            {"test": "tests/gpu/x.py::test_a", "outcome": "failed", "message": "boom"}]}}))
    (call1 / "mixed-check.log").write_text("...\n4 passed in 90s\n")
    written, note = ingest.ingest([call1, call2], commit="abc1234", summaries=sums, sim_models=models)
    names = sorted(p.name for p in written)
    assert names == ["gpu-check-h200.json", "h200-llama8b-measured-20261201.json", "http-overhead-h200-llama8b.json",
                     "prefill-model-llama8b-h200.json", "slo-gpu-h200-llama8b.json"]
    s = json.loads((sums / "slo-gpu-h200-llama8b.json").read_text())
    assert s["commit"] == "abc1234" and s["machine"]["gpu"] == "NVIDIA H200" and len(s["figures"]["rows"]) == 6
    assert "lambda* 10.86 rps" in s["headline"] and "kairos 6.50" in s["headline"]
    assert "1x kairos adherence 96.0%" in s["headline"] and "not met: kairos_90pct_oracle" in s["headline"]
    http = json.loads((sums / "http-overhead-h200-llama8b.json").read_text())
    assert http["commit"] == "abc1234" and http["name"] == "http-overhead-h200-llama8b"
    assert http["figures"]["issue_checks"]["checks"] == {"http_ttft_le_2ms": True, "http_itl_le_0.5ms": False}
    assert any("failed tests/gpu/x.py::test_a: boom" in line for line in note)
    assert any("4 passed in 90s" in line for line in note)
    table = next(line for line in note if line.startswith("time to first token by hop")).splitlines()
    assert len(table) == 4 and "20.0 / - |" in table[3] and "1.0 / 9.0" in table[3] and "12.0 / 80.0" in table[3]
    assert any("2 hybrid steps at 0.68-1.03 of prefill + decode, 1.02-1.10 of one forward" in line for line in note)
    # the HTTP front each server ran behind: a run behind Serve's Python proxy is flagged
    assert any("WARNING" in line and "Python proxy" in line for line in note)
    assert report.where(json.loads((sums / "gpu-check-h200.json").read_text())) == \
        "Intel(R) Xeon(R) Processor, 16 cores, AMX; GPU NVIDIA H200"
    cell = report._slo_gpu(s["figures"])
    assert cell.startswith("1.5× λ*: fcfs 2.00 req/s (20% met), kairos 6.50") and cell.endswith("1×: kairos 96% met")
    assert report._slo_gpu(dict(s["figures"], setup={"num_requests": 240})).endswith("96% met (240 requests a point)")
    # an earlier lease's summary of the same name stays; ingesting the same files again replaces this run's own
    doc = json.loads((sums / "slo-gpu-h200-llama8b.json").read_text())
    (sums / "slo-gpu-h200-llama8b.json").write_text(json.dumps(dict(doc, date="2026-11-30T00:00:00+00:00")))
    written, _ = ingest.ingest([call2], summaries=sums, sim_models=models)
    assert "slo-gpu-h200-llama8b-20261201.json" in {p.name for p in written}
    assert ingest.ingest([call2], summaries=sums, sim_models=models)[0] == written
    # another lease that day keeps both: its summary and its replica profile get the time as well
    call3 = tmp_path / "call3"
    call3.mkdir()
    (call3 / "slo-gpu.json").write_text(json.dumps(dict(slo, run=dict(slo["run"], date="2026-12-01T15:30:00+00:00"))))
    with tarfile.open(call3 / "slo_gpu-out.tgz", "w:gz") as tf:
        data = json.dumps({"format": 2, "meta": {"lease": 3}}).encode()
        info = tarfile.TarInfo("slo_gpu/replica-profile.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    names = {p.name for p in ingest.ingest([call3], summaries=sums, sim_models=models)[0]}
    assert names == {"slo-gpu-h200-llama8b-20261201-1530.json", "h200-llama8b-measured-20261201-1530.json"}
    assert json.loads((sums / "slo-gpu-h200-llama8b-20261201-1530.json").read_text())["name"] == \
        "slo-gpu-h200-llama8b-20261201-1530"
    assert json.loads((models / "h200-llama8b-measured-20261201.json").read_text())["meta"] == {}  # the first's


def test_the_pooled_row_reads_bench_pools_figures() -> None:
    from bench import pool

    def run(name: str, k: float) -> tuple[str, dict]:
        seeds = lambda g: [{"seed": 0, "goodput_rps": g, "wall_s": 10.0}]  # noqa: E731
        return name, {"name": name, "figures": {"policies": {"kairos": {"per_seed": seeds(k)},
                                                             "scorpio": {"per_seed": seeds(5.0)},
                                                             "fcfs": {"per_seed": []}}}}
    figs = pool.pool([run("a", 6.0), run("b", 5.0)], "kairos", ["scorpio", "fcfs"], [1.1, None])
    cell = report._pooled(json.loads(json.dumps(figs)))  # as a summary keeps it
    assert cell.startswith("kairos / scorpio 1.10× (")
    assert cell.endswith(", 1/2 runs ≥ 1.1×")
    assert "fcfs" not in cell  # no run compared with it
    assert report._pooled({"arm": "kairos", "vs": {"scorpio": {"runs": 0}}}) == "no run compared"


def test_the_gpu_experiments_low_load_checks_are_left_out_where_only_one_load_ran() -> None:
    """bench/device/slo_gpu.py's acceptance: the 1x checks read the lowest load's rows; with one load that was the
    1.5x rows, read as the 1x checks. Left out (None) then; with both loads, each from its own rows."""
    import importlib.util
    import sys

    path = report.SUMMARIES.parents[1] / "bench/device/slo_gpu.py"
    spec = importlib.util.spec_from_file_location("slo_gpu_for_test", path)
    slo_gpu = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(slo_gpu)
    finally:
        sys.path.remove(str(path.parent))

    def row(policy: str, load: float, goodput: float, adherence: float) -> dict:
        return {"policy": policy, "lengths": "predicted", "load": load, "goodput_rps": goodput,
                "adherence": adherence, "per_seed": [{"seed": 0, "goodput_rps": goodput}],
                "tpot_met_admitted": 1.0, "per_tier_adherence": {"a": adherence}}

    high = [row("fcfs", 1.5, 2.0, 0.3), row("scorpio", 1.5, 4.0, 0.6), row("kairos", 1.5, 5.0, 0.7)]
    one = slo_gpu.acceptance(high, [], [1.5])
    assert one["checks"]["kairos_low_load_adherence_95"] is None and one["checks"]["kairos_low_load_goodput_ge_fcfs"] \
        is None
    assert one["checks"]["scorpio_2x_fcfs"] is True and one["kairos_over_scorpio_min_seed"] == 1.25
    both = slo_gpu.acceptance(high + [row("fcfs", 1.0, 3.0, 0.9), row("kairos", 1.0, 3.1, 0.97)], [], [1.0, 1.5])
    assert both["checks"]["kairos_low_load_adherence_95"] is True and both["checks"]["kairos_low_load_goodput_ge_fcfs"]
