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
    assert all((report.SUMMARIES / f"{name}.json").exists() for _, name, _ in report.HEADLINES)
    assert report.headline_table() in report.TOP_README.read_text(encoding="utf-8")
