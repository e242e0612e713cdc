"""The heterogeneous-SLO goodput benchmark end to end: one point over HTTP (a mock server) and in-process (a fake
engine), then `python -m bench.slo` on kairos-tiny (sweep, capacity search, ShareGPT, --probe-check)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace as NS

import numpy as np
import pytest

from bench import metrics as M
from bench import workload as W

# --------------------------------------------------------------------------- one point, HTTP and in-process


def test_http_point_against_a_mock_server():
    """The HTTP client: SSE parsing, 429 = rejection, usage tokens, headers carry the SLOs, the engine's own view
    (`kairos_metrics`: its TTFT and TPOT, the length its predictor expected)."""
    from aiohttp import web

    from bench.driver import run_http
    from bench.slo import hop_summary
    from tests.stub_http import stub_server

    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        if float(request.headers["x-slo-ttft-ms"]) < 200:
            return web.json_response({}, status=429, headers={"x-kairos-reject-reason": "ttft_unattainable"})
        n = body["max_tokens"]
        chunks = [f'data: {json.dumps({"choices": [{"text": "x", "finish_reason": None}]})}\n\n'
                  for _ in range(n - 1)]
        chunks.append(f'data: {json.dumps({"choices": [{"text": "y", "finish_reason": "length"}]})}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": n}, "kairos_metrics": {"ttft_ms": 9.0, "tpot_ms": 4.5,
                                                                           "predicted_output_tokens": 7}}
        chunks += [f"data: {json.dumps(usage)}\n\n", "data: [DONE]\n\n"]
        return web.Response(body="".join(chunks).encode(),
                            headers={"content-type": "text/event-stream",
                                     "server-timing": "parse;dur=0.5, route;dur=2.0, replica;dur=7.5"})

    items = [W.WorkItem(0.0, [5, 6, 7], 4, "interactive", 100.0, 50.0, 4),
             W.WorkItem(0.01, [5, 6], 3, "relaxed", 3000.0, 50.0, None)]
    with stub_server(handler) as url:
        run = run_http(url, items, model="m", drain_s=5.0)
    r0, r1 = sorted(run.records, key=lambda r: r.arrival_s)
    assert r0.rejected and r0.reject_reason == "ttft_unattainable"
    assert r1.finish_reason == "length" and r1.n_out == 3 and r1.ttft_s is not None and M.is_good(r1)
    assert seen[0]["x-slo-output-len"] == "4" and "x-slo-output-len" not in seen[1]
    # the ingress's Server-Timing splits the time to first token; the rest up to the headers is client/proxy
    h = r1.hops
    assert (h["parse"], h["route"], h["replica"]) == (0.5, 2.0, 7.5)
    assert (h["engine_ttft"], h["engine_tpot"]) == (9.0, 4.5)  # the engine's own view, from the usage chunk
    assert r1.predicted_len == 7 and r0.predicted_len is None
    assert h["client_proxy"] == pytest.approx(h["headers"] - 10.0) and h["body"] >= 0.0
    summary = hop_summary(run.records)
    assert summary["replica"]["p50"] == 7.5 and summary["replica"]["n"] == 1 and "parse" in summary


def test_the_live_rank_of_the_servers_length_predictions():
    """`predicted_length_rank`: Spearman of the predicted lengths against where the replies ended, over the records
    that have a prediction; None where fewer than 3 do (no predictor ran)."""
    from bench.driver import Record

    def rec(predicted, out):
        return Record("t", 100.0, 10.0, 0.0, predicted_len=predicted, output_len=out)

    ranked = M.predicted_length_rank([rec(10, 5), rec(20, 50), rec(40, 80), rec(None, 1), rec(30, 60)])
    assert ranked == {"n": 4, "spearman": pytest.approx(1.0)}
    assert M.predicted_length_rank([rec(10, 80), rec(20, 50), rec(40, 5)])["spearman"] == pytest.approx(-1.0)
    assert M.predicted_length_rank([rec(None, 5)] * 5 + [rec(3, 4)] * 2) is None


def test_http_client_in_several_processes_keeps_every_request_in_order_on_one_clock():
    """run_http(procs=2): the items dealt to two client processes, their records merged in item order, each sent at
    its arrival time after one arrival 0 (the processes share the monotonic clock), the same results as one."""
    from aiohttp import web

    from bench.driver import run_http
    from bench.slo import client_procs
    from tests.stub_http import stub_server

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if body["max_tokens"] == 3:
            return web.json_response({}, status=429, headers={"x-kairos-reject-reason": "shed"})
        chunks = [f'data: {json.dumps({"choices": [{"text": "x", "finish_reason": None}]})}\n\n'
                  for _ in range(body["max_tokens"] - 1)]
        chunks += [f'data: {json.dumps({"choices": [{"text": "y", "finish_reason": "length"}]})}\n\n',
                   "data: [DONE]\n\n"]
        return web.Response(body="".join(chunks).encode(), headers={"content-type": "text/event-stream"})

    items = [W.WorkItem(0.02 * i, [5, 6, 7], 3 + i % 4, "relaxed", 3000.0, 50.0, None) for i in range(9)]
    with stub_server(handler) as url:
        one = run_http(url, items, model="m", drain_s=5.0)
        two = run_http(url, items, model="m", drain_s=5.0, procs=2)
    assert [r.index for r in two.records] == list(range(9)) and len(two.submit_lag_ms) == 9
    for a, b in zip(one.records, two.records):
        assert (a.rejected, a.reject_reason, a.finish_reason, len(a.token_times)) == \
            (b.rejected, b.reject_reason, b.finish_reason, len(b.token_times))
    assert [r.rejected for r in two.records] == [i % 4 == 0 for i in range(9)]
    # each sent at its own arrival on the shared clock: arrival times keep the offered spacing
    offsets = [r.arrival_s - two.started_s - w.arrival_s for r, w in zip(two.records, items)]
    assert all(0.0 <= o < 0.5 for o in offsets), offsets
    assert (client_procs(None, 2), client_procs(None, 16), client_procs(None, 64), client_procs(3)) == (1, 4, 4, 3)


def test_server_timing_round_trip():
    from bench.driver import parse_server_timing
    from deployments.ingress import server_timing

    st = parse_server_timing(server_timing(10.0, 10.002, 10.050, 40.0))
    assert st == pytest.approx({"parse": 2.0, "route": 8.0, "replica": 40.0})
    assert parse_server_timing(server_timing(0.0, 0.0, 0.01, None)) == pytest.approx({"parse": 0.0, "route": 10.0})
    assert parse_server_timing('a;dur=1, b;desc="x", c;dur="2.5", bad;dur=x') == {"a": 1.0, "c": 2.5}
    assert parse_server_timing(None) == {}


class _FakeEngine:
    """Finishes even-numbered requests at once (3 tokens, 10 ms apart, 3 decode steps); odd ones only when aborted."""

    def __init__(self):
        import engine.stats  # noqa: F401 - imported here, not in the first add_request: its cold import there
        import engine.stream  # noqa: F401 - would stamp the first arrival late and break the open-loop check

        self.streams, self.aborted, self.observers = {}, [], []
        self.steps, self.phase = 0, {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "postprocess": 0.0}
        self.latency_model = NS(itl_ms=lambda b, length: 5.0, prefill_ms=lambda n, q=None: 5.0,
                               step_prefill_ms=lambda n, q=None: 5.0)

    def add_step_observer(self, fn):
        self.observers.append(fn)
        return lambda: self.observers.remove(fn)

    def stats(self):
        return NS(steps=self.steps, phase_s=dict(self.phase), rejected={})

    def add_request(self, prompt, params, slo, request_id, *, messages=None):
        from core.messages import RequestMetrics, RequestOutput
        from engine.stats import StepEvent
        from engine.stream import RequestStream

        st = RequestStream(request_id)
        now = time.monotonic()
        self.streams[request_id] = (st, now)
        if int(request_id.rsplit("-", 1)[1]) % 2 == 0:
            times = [now + 0.01 * k for k in range(3)]
            st.put(RequestOutput(request_id, token_ids=[1], num_output_tokens=1))
            st.put(RequestOutput(request_id, finished=True, finish_reason="length", num_output_tokens=3,
                                 metrics=RequestMetrics(now, now, times[0], times[-1], times)))
            self.steps += 3
            self.phase["schedule"] += 0.001
            self.phase["forward"] += 0.01
            for fn in self.observers:
                fn(StepEvent(now, 0, 0, 1, 3.0, 9.0, 10.0))
        return st

    def abort(self, rid):
        from core.messages import RequestMetrics, RequestOutput

        self.aborted.append(rid)
        st, t = self.streams[rid]
        st.put(RequestOutput(rid, finished=True, finish_reason="abort", num_output_tokens=1,
                             metrics=RequestMetrics(t, t, t + 0.02, time.monotonic(), [t + 0.02])))


def test_engine_point_open_loop_and_timeouts():
    from bench.slo import engine_point

    eng = _FakeEngine()
    items = [W.WorkItem(0.05 * k, [5, 6], 3, "relaxed", 3000.0, 50.0, 3) for k in range(6)]
    t0 = time.monotonic()
    run = engine_point(eng, items, drain_s=0.3, tag="x")
    took = time.monotonic() - t0
    assert 0.55 <= took < 3.0  # last arrival at 0.25 s + 0.3 s drain
    assert sorted(eng.aborted) == ["x-1", "x-3", "x-5"]
    recs = sorted(run.records, key=lambda r: r.arrival_s)
    assert [r.finish_reason for r in recs] == ["length", "timeout"] * 3
    assert run.timeouts == 3
    assert all(M.is_good(r) for r in recs[::2]) and not any(M.is_good(r) for r in recs[1::2])
    arrivals = np.array([r.arrival_s - recs[0].arrival_s for r in recs])
    # open-loop schedule kept: none sent early, and the last well before a closed loop's, which sends each after the
    # one before ended (three give-ups of 0.3 s: 0.9 s at least); a busy 2-core box (CI) stalled the sender once by
    # 0.2 s (the sends due meanwhile went at once, as open loop does)
    assert np.all(arrivals >= np.array([0.05 * k for k in range(6)]) - 0.01), arrivals
    assert arrivals[-1] < 0.8, arrivals
    assert all(r.finished_s >= recs[-1].arrival_s + 0.29 for r in recs[1::2])  # misses end at the give-up
    assert run.engine["steps"] == 9 and run.engine["sched_ms_per_step"] == pytest.approx(1.0 / 3)
    tap = run.engine["tap"]  # the step observer saw the 3 decode-only steps, and is gone again
    assert tap["decode_ratios"] == [2.0] * 3 and tap["total_ms"] == 30.0 and eng.observers == []


# --------------------------------------------------------------------------- end-to-end smoke (real engine)

SMALL = ["--model", "kairos-tiny", "--max-num-seqs", "8", "--drain", "10", "--no-progress"]
SHORT = ["--prompt-median", "12", "--prompt-cap", "32", "--output-median", "6", "--output-cap", "12",
         "--prefill-max-tokens", "64"]


def test_smoke_run_writes_json_pngs_and_summary(tmp_path, monkeypatch):
    from bench import report, slo

    monkeypatch.setattr(report, "SUMMARIES", tmp_path / "summaries")
    out, js = tmp_path / "out", tmp_path / "r.json"
    argv = ["--quick", *SMALL, *SHORT, "--policies", "fcfs,scorpio", "--loads", "1.5", "--lambda-star", "6",
            "--num-requests", "12", "--probe-requests", "24", "--out", str(out), "--json", str(js),
            "--summary", "slo-smoke"]
    assert slo.main(argv) == 0
    doc = json.loads(js.read_text())
    assert doc["lambda_star_rps"] == 6.0
    assert set(doc["tiers"]) == set(W.TIER_NAMES)
    assert doc["predictor"]["r2"] is not None and "slo_scale" in doc["predictor"]
    assert doc["config"]["refresh_profile"] and doc["config"]["calibrate"]
    assert doc["config"]["dataset"] == {"name": "synthetic"}
    cal = doc["calibration"]  # served steps against the probe fit, from one FCFS run at lambda*
    assert cal["decode"] > 0 and cal["n_decode_steps"] > 0 and cal["prefill"] > 0
    fits = doc["profiles_per_run"]  # a fresh fit before every (policy, seed) run
    assert [(f["policy"], f["seed"]) for f in fits] == [("fcfs", 0), ("scorpio", 0)] and fits[0]["d4_ms"] > 0
    res = doc["results"]
    assert res[0]["steps"] > 0 and res[0]["rejected"] == 0  # fcfs serves everything
    assert 0.0 <= res[0]["prefill_only_pct"] <= 100.0 and res[0]["decode_wall_over_model_p50"] > 0
    assert [(r["policy"], r["load_multiple"]) for r in res] == [("fcfs", 1.5), ("scorpio", 1.5)]
    for r in res:
        assert r["rate_rps"] == pytest.approx(9.0)
        assert r["n"] == 11 and r["n_dropped_warmup"] == 1  # 12 requests, 10% warm-up -> floor(1.2) = 1
        assert 0.0 <= r["adherence"] <= 1.0 and r["goodput_rps"] >= 0.0
        assert set(r["per_tier"]) <= set(W.TIER_NAMES)
        assert r["steps"] >= 0 and (r["steps"] == 0 or r["sched_ms_per_step"] > 0)
        if r["steps"]:  # where a step's time goes: the phases sum to the step
            ph = r["phase_ms_per_step"]
            assert {"schedule", "forward"} <= set(ph) and ph["schedule"] == pytest.approx(r["sched_ms_per_step"])
            assert sum(ph.values()) == pytest.approx(r["step_ms"])
        assert r["good"] + r["rejected"] <= r["n"]
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 24 and {"ttft_ms", "tpot_ms", "good", "output_len", "warmup"} <= set(recs[0])
    for name in ("goodput_vs_load", "latency_cdf"):
        p = out / f"{name}.png"
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "load_multiple" in doc["acceptance"]
    summary = json.loads((tmp_path / "summaries" / "slo-smoke.json").read_text())
    assert summary["command"].startswith("python -m bench.slo --quick") and "fcfs" in summary["headline"]
    assert set(summary["figures"]["policies"]) == {"fcfs", "scorpio"}


def test_smoke_capacity_search(tmp_path):
    from bench import slo

    js = tmp_path / "r.json"
    argv = ["--quick", *SMALL, *SHORT, "--policies", "fcfs", "--loads", "1", "--num-requests", "12",
            "--probe-requests", "24", "--out", str(tmp_path / "out"), "--json", str(js), "--no-plots",
            "--overlap", "on"]  # (the engines run their steps on the host stream)
    assert slo.main(argv) == 0
    doc = json.loads(js.read_text())
    assert doc["config"]["overlap"] == "on"
    search = doc["lambda_star_search"]
    assert search["definition"] == "capacity" and search["probes"]
    assert doc["lambda_star_rps"] > 0 and doc["results"][0]["rate_rps"] == pytest.approx(doc["lambda_star_rps"])


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_smoke_sharegpt(tmp_path, api):
    """--dataset sharegpt: real first turns in kairos-tiny's tokens (its 1024-token context filters the rest), sent
    as completions or as chat requests (--api chat: one user message, in the model's chat template)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution(W.SHAREGPT_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{W.SHAREGPT_DIST} is not installed (the bench extra)")
    from bench import slo

    js = tmp_path / "r.json"
    argv = ["--dataset", "sharegpt", "--quick", *SMALL, "--policies", "fcfs", "--loads", "1", "--lambda-star", "2",
            "--num-requests", "8", "--output-cap", "16", "--no-refresh-profile", "--out", str(tmp_path / "out"),
            "--json", str(js), "--no-plots", "--api", api]
    assert slo.main(argv) == 0
    doc = json.loads(js.read_text())
    ds = doc["config"]["dataset"]
    assert ds["name"] == "sharegpt" and ds["conversations_read"] > 1000 and ds["samples"] > 0 and ds["api"] == api
    assert ds["mean_prompt"] > 4 and 4 <= ds["mean_output"] <= 16
    wl = doc["config"]["workload"]
    assert wl["prompt_len"]["max"] < 1024 and wl["output_len"]["max"] <= 16
    r = doc["results"][0]
    assert r["policy"] == "fcfs" and r["n"] == 8 and r["rejected"] == 0 and r["output_tokens"] > 0
