"""`python -m bench.soak`: its workload and outcome classification, its windows over bench.driver against a fake
server (no Ray), and its short CI mode (~20 s of load): mixed workload, per-window report, no KV leak.

The CI mode runs in this process. Inside the full test session the Ray/Serve instance of tests/serve is reused (the soak app
is a separate application at /kairos-soak, deleted afterwards); run alone, the soak starts and stops its own Ray.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOAK_S = float(os.environ.get("KAIROS_SOAK_S", "20"))


def test_soak_help() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.soak", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--duration-s", "--rate", "--json", "--target", "--report-every-s"):
        assert flag in out.stdout
    assert "default 600" in out.stdout


def test_soak_workload_is_seeded_and_mixed() -> None:
    from bench.soak import parse_args, workload

    a = parse_args(["--duration-s", "20", "--rate", "5", "--seed", "3", "--disconnect-frac", "0.5"])
    mix: list = []
    items = list(workload(a, None, mix))
    again = list(workload(a, None, []))
    assert items == again and len(mix) == len(items) and 50 <= len(items) <= 150
    assert all(0 <= w.arrival_s < 20 for w in items) and items[0].arrival_s == 0.0
    assert [(w.chat, w.stream) for w in items] == mix
    assert {w.chat for w in items} == {True, False} and {w.stream for w in items} == {True, False}
    assert all(8 <= w.max_tokens <= 64 and w.ignore_eos and w.text and w.seed == i for i, w in enumerate(items))
    assert any(math.isfinite(w.ttft_ms) for w in items) and any(math.isinf(w.ttft_ms) for w in items)
    drops = [w for w in items if w.drop_at is not None]
    assert drops and all(w.stream for w in drops) and {-1, 0} & {w.drop_at for w in drops}


def test_soak_outcomes() -> None:
    from bench.driver import Record
    from bench.soak import figures, outcome

    def rec(i: int, **kw) -> Record:
        return Record("", kw.pop("slo", math.inf), math.inf, 0.0, index=i, **kw)

    recs = [rec(0, finish_reason="length", ttft_s=0.1, token_times=[0.5], slo=1000.0),
            rec(1, finish_reason="length", ttft_s=0.2, token_times=[0.7]),
            rec(2, finish_reason="disconnected", error="after_chunks"),
            rec(3, rejected=True, finish_reason="rejected", reject_reason="ttft_slo"),
            rec(4, rejected=True, finish_reason="rejected", reject_reason="x", error="429_without_retry_after"),
            rec(5, finish_reason="error", error="client_timeout"),
            rec(6, finish_reason="error", error="engine step failed: boom"),
            rec(7, finish_reason="error", error="http_500:internal_error"),
            rec(8)]  # cancelled after the drain
    kinds = [outcome(r) for r in recs]
    assert kinds == [("ok", "ok"), ("ok", "ok"), ("disconnected", "after_chunks"), ("rejected", "ttft_slo"),
                     ("error", "429_without_retry_after"), ("error", "client_timeout"),
                     ("error", "stream_error_event"), ("error", "http_500:internal_error"),
                     ("error", "drain_timeout")]
    mix = [(True, True), (False, False)] + [(False, True)] * 7
    f = figures(recs, mix)
    assert f["sent"] == 9 and f["served"] == 2 and f["served_by"] == {"stream": 1, "chat": 1, "slo": 1}
    assert f["rejected"] == {"ttft_slo": 1} and f["disconnected"] == {"after_chunks": 1}
    assert sum(f["errors"].values()) == 5
    assert f["ttft_p99_s"] == 0.1 and f["e2e_p50_s"] == 0.6  # TTFT of streams only; E2E of every served one


def _fake_server(delay_s: float, seen: list):
    """An OpenAI-compatible stand-in (a real HTTP server, `stub_server`): exactly max_tokens tokens, SSE or JSON."""
    from aiohttp import web

    from tests.stub_http import stub_server

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        await asyncio.sleep(delay_s)
        n, chat = body["max_tokens"], "messages" in body
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
        if not body["stream"]:
            return web.json_response({"choices": [{"index": 0, "finish_reason": "length"}], "usage": usage})
        tok = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
        end = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "finish_reason": "length"}
        events = [{"choices": [tok]}] * n + [{"choices": [end]}, {"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return web.Response(body=sse.encode(), headers={"content-type": "text/event-stream"})

    return stub_server(handle)


@pytest.mark.parametrize("max_inflight", [128, 1])
def test_soak_windows_over_the_driver(max_inflight: int) -> None:
    import bench.soak as soak

    seen: list = []
    delay = 0.01 if max_inflight > 1 else 0.3
    a = soak.parse_args(["--duration-s", "3", "--report-every-s", "1", "--rate", "20", "--seed", "2",
                         "--disconnect-frac", "0.3", "--max-inflight", str(max_inflight)])
    lines: list[str] = []
    with _fake_server(delay, seen) as url:
        windows, results, mix = asyncio.run(soak.offer_load(a, url, None, None, lines.append))
    t = soak.figures(results, mix)
    assert len(windows) == 3 and sum(ln.startswith("[soak] window") for ln in lines) == 3, lines
    assert [w["window"] for w in windows] == [1, 2, 3] and windows[-1]["end_s"] == pytest.approx(3, abs=0.3)
    assert t["errors"] == {} and t["rejected"] == {}, t
    backlog = sum(w["client_backlog"] for w in windows)
    assert len(mix) == t["sent"] + backlog and len(seen) == t["sent"]
    if max_inflight > 1:
        assert backlog == 0 and t["served"] >= 30 and sum(t["disconnected"].values()) >= 2, t
        assert min(t["served_by"].values()) > 0 and t["served"] > t["served_by"]["stream"]
        assert sum(w["sent"] for w in windows) <= t["sent"]
        assert {p for p, _, _ in seen} == {"/v1/completions", "/v1/chat/completions"}
        assert any("x-slo-ttft-ms" in h for _, h, _ in seen) and all(b["ignore_eos"] for _, _, b in seen)
    else:
        assert backlog > 0 and t["sent"] <= 3 / delay + 1


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
