"""`python -m bench.soak` in its short CI mode (~30 s of load): mixed workload, per-window report, no KV leak.

Runs in this process. Inside the full test session the Ray/Serve instance of tests/serve is reused (the soak app
is a separate application at /kairos-soak, deleted afterwards); run alone, the soak starts and stops its own Ray.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOAK_S = float(os.environ.get("KAIROS_SOAK_S", "30"))


def test_soak_help() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.soak", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--duration-s", "--rate", "--json", "--target", "--report-every-s"):
        assert flag in out.stdout
    assert "default 600" in out.stdout


def test_soak_short(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from bench.soak import main

    lines: list[str] = []

    def log(s: str) -> None:
        lines.append(s)
        print(s, flush=True)

    out = tmp_path / "soak.json"
    window = SOAK_S / 3
    code = main(["--duration-s", str(SOAK_S), "--report-every-s", str(window), "--rate", "4", "--seed", "1",
                 "--disconnect-frac", "0.3", "--json", str(out), "--fail-on-errors"], log=log)
    data = json.loads(out.read_text())
    assert code == 0 and data["exit_code"] == 0, "\n".join(lines)
    assert len(data["windows"]) == 3 and sum(ln.startswith("[soak] window") for ln in lines) == 3
    t = data["totals"]
    assert t["errors"] == {}, t
    assert t["served"] >= 0.5 * 4 * SOAK_S, t
    assert min(t["served_by"].values()) > 0 and t["served"] - t["served_by"]["stream"] > 0  # every kind served
    assert sum(t["disconnected"].values()) >= 3, t
    assert t["ttft_p99_s"] is not None and t["e2e_p99_s"] >= t["e2e_p50_s"] > 0
    for w in data["windows"]:
        assert {"served", "errors", "rejected", "ttft_p99_s", "e2e_p99_s", "rss_mb"} <= set(w)
        assert "LLMServer" in w["rss_mb"] and "Ingress" in w["rss_mb"], w["rss_mb"]
    kv = data["kv"]
    assert kv["checked"] and kv["quiesced"] and kv["leaked"] == 0, kv
    assert any("KV blocks leaked after quiescence: 0" in ln for ln in lines)
