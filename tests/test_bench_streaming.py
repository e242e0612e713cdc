"""Smoke tests for the seeds' streaming benchmark (`bench.streaming`) and its seed presets (`bench.streaming seeds`).

Shape only (no timing asserts): the printed block has the seeds' lines, the JSON carries every figure.
Runs the embedded kairos-tiny on CPU; the whole file takes well under a minute.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import report, streaming

SEED_LINES = (
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
    i = lines.index(SEED_LINES[0])
    return lines[i:i + len(SEED_LINES)]


def _check_block(text: str) -> None:
    block = _block_lines(text)
    assert len(block) == len(SEED_LINES)
    for line, prefix in zip(block, SEED_LINES):
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
    args = streaming.parse_args(["--prompt", "Hi", "--prompt-repeats", "1,3", "--unique-prompts",
                                 "--num-requests", "3"])
    assert streaming.build_prompts(args) == ["Hi [0]", "Hi Hi Hi [1]", "Hi [2]"]
    assert streaming.parse_repeats(None) is None
    with pytest.raises(SystemExit):
        streaming.parse_args(["--prompt-repeats", "1,x"])
    # the reproduction command round-trips
    argv = ["--model", "kairos-tiny", "--num-requests", "6", "--no-stop-on-eos", "--prefill-max-tokens", "224"]
    assert vars(streaming.parse_args(streaming.to_argv(streaming.parse_args(argv)))) == vars(streaming.parse_args(argv))
    # defaults the seeds rely on
    d = streaming.parse_args([])
    assert (d.model, d.device, d.dtype, d.prompt, d.num_requests, d.max_new_tokens, d.max_batch_size,
            d.prefill_max_batch_size, d.prefill_max_tokens, d.prefill_admission_policy,
            d.prefill_admission_lookahead, d.prefill_force_fifo_every, d.policy, d.temperature) == (
        "kairos-random-42m", "cpu", "auto", "Hello", 16, 32, 8, None, None, "fifo", 64, 0, "fcfs", 0.0)
    assert (d.dataset, d.max_model_len, d.summary) == ("synthetic", None, None)


def test_streaming_smoke(tmp_path, capsys):
    out = tmp_path / "stream.json"
    rc = streaming.main(["--model", "kairos-tiny", "--num-requests", "6", "--max-new-tokens", "4",
                         "--unique-prompts", "--no-stop-on-eos", "--no-prefix-cache", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    _check_block(text)
    assert "Model: kairos-tiny" in text and "Device: cpu" in text and "Requests: 6" in text
    assert "Completion tokens (total): 24" in text
    res = json.loads(out.read_text())
    _check_result(res, 6, 4)
    assert res["block"] in text
    assert res["engine_side"]["ttft_ms"]["n"] == 6
    assert res["engine_stats"]["steps"] > 0
    assert res["command"].startswith("python -m bench.streaming")


def test_streaming_inline_pretokenized(capsys):
    args = streaming.parse_args(["--model", "kairos-tiny", "--num-requests", "3", "--max-new-tokens", "2",
                                 "--no-stop-on-eos", "--submit-mode", "inline", "--pretokenize",
                                 "--prompt-repeats", "1,4", "--warmup", "0"])
    res = streaming.run(args)
    _check_block(capsys.readouterr().out)
    _check_result(res, 3, 2)
    assert res["pretokenized"] and res["tokenize_ms"]["n"] == 3
    assert "add_request_p50_excl_tokenize_ms" in res
    # inline: each add_request returned only once the request's first token was out
    for r in res["per_request"]:
        assert r["ttft_ms"] <= r["add_request_ms"] + 1e-6


def test_streaming_sharegpt_and_summary(tmp_path, monkeypatch, capsys):
    """--dataset sharegpt: real prompts, each reply forced to its ShareGPT length; --summary writes a headline."""
    from bench.workload import sharegpt

    monkeypatch.setattr(report, "SUMMARIES", tmp_path)
    argv = ["--model", "kairos-tiny", "--dataset", "sharegpt", "--num-requests", "3", "--max-model-len", "96",
            "--warmup", "0", "--pretokenize", "--summary", "stream-test"]
    res = streaming.run(streaming.parse_args(argv), argv=argv)
    _check_block(capsys.readouterr().out)
    tok, _ = streaming.model_tokenizer("kairos-tiny")
    samples = sharegpt(tok, 3, 0, 96).samples
    assert res["dataset"] == "sharegpt" and res["ok_requests"] == 3 and res["failed_requests"] == 0
    assert [r["completion_tokens"] for r in res["per_request"]] == [s.output_len for s in samples]
    assert [r["prompt_tokens"] for r in res["per_request"]] == [len(s.prompt_ids) for s in samples]
    assert res["completion_tokens_total"] == sum(s.output_len for s in samples)
    summary = json.loads((tmp_path / "stream-test.json").read_text())
    assert summary["command"].startswith("python -m bench.streaming") and "--dataset sharegpt" in summary["command"]
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


def test_streaming_http_target(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = streaming.run(streaming.parse_args(["--target", url, "--num-requests", "4", "--max-new-tokens", "3",
                                                  "--submit-interval-ms", "1"]))
    finally:
        server.shutdown()
        server.server_close()
    text = capsys.readouterr().out
    _check_block(text)
    assert "Model: fake-model" in text
    _check_result(res, 4, 3)
    assert res["mode"] == "http" and res["prompt_tokens_total"] == 20


PRESET_KEYS = ("preset", "metric", "unit", "before", "after", "ratio", "before_full", "after_full", "command",
               "commands", "target", "target_met", "seed_reference", "notes", "mapping", "literal")


def test_seeds_all_quick(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    assert streaming.main(["seeds", "--preset", "all", "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert isinstance(data, list)
    assert [d["preset"] for d in data] == ["pending_queue", "micro_batching", "token_budget", "packed_admission"]
    metrics = {"pending_queue": "add_request_p50_ms", "micro_batching": "ttft_p50_ms",
               "token_budget": "itl_p99_ms", "packed_admission": "ttft_p99_ms"}
    for d in data:
        for key in PRESET_KEYS:
            assert key in d, (d["preset"], key)
        assert d["metric"] == metrics[d["preset"]] and d["unit"] == "ms"
        assert isinstance(d["before"], float) and isinstance(d["after"], float)
        assert d["ratio"] == pytest.approx(d["before"] / d["after"])
        assert d["before_full"][d["metric"]] == d["before"] and d["after_full"][d["metric"]] == d["after"]
        assert d["command"].startswith("python -m bench.streaming seeds --preset " + d["preset"])
        assert d["commands"]["before"] != d["commands"]["after"]
        for full in (d["before_full"], d["after_full"]):
            assert full["model"] == "kairos-tiny" and full["failed_requests"] == 0
            _check_block(full["block"])
        assert f"{d['metric']}: before " in text and "(ratio " in text
    assert "after_pretokenized_full" in data[0] and "add_request_p50_excl_tokenize_ms" in data[0]
    assert text.count("=== streaming benchmark ===") >= 9  # two per side-by-side line pair + the extra run


def test_seeds_single_preset_json_is_an_object(tmp_path):
    out = tmp_path / "one.json"
    # a variant through --extra, and the long prompt is capped to fit kairos-tiny's 1024-token context
    assert streaming.main(["seeds", "--preset", "packed_admission", "--quick", "--json", str(out),
                       "--extra=--num-requests 4 --prompt-repeats 400,1"]) == 0
    d = json.loads(out.read_text())
    assert isinstance(d, dict) and d["preset"] == "packed_admission"
    assert d["before_full"]["requests"] == 4
    assert any("capped" in n for n in d["notes"])
    assert "--extra=" in d["command"]


def test_seed_presets_mapping_and_literal():
    """The default Kairos mapping vs the seed commands' exact flags (no engine needed)."""
    def argv(preset: str, *flags: str) -> list[str]:
        a = streaming.seeds_parser().parse_args(["--preset", preset, *flags])
        base, _, after = streaming._preset_argvs(streaming.PRESETS[preset], a)
        return base + after

    def mbs(v: list[str]) -> int:
        return streaming.parse_args(v).max_batch_size

    tb = argv("token_budget")
    assert tb.count("--max-batch-size") == 1 and mbs(tb) == 32
    assert streaming.parse_args(tb).hybrid_steps  # a valueless mapped flag is applied too
    assert mbs(argv("token_budget", "--literal")) == 8
    assert not streaming.parse_args(argv("token_budget", "--literal")).hybrid_steps
    assert streaming._flag_pairs(["--a", "1", "--s", "--b", "x", "--t"]) == [("--a", "1"), ("--s", None),
                                                                             ("--b", "x"), ("--t", None)]
    assert streaming.parse_args(tb).model == "kairos-random-42m"  # the seeds' runs: the random 42M model
    assert mbs(argv("micro_batching")) == 32 and mbs(argv("micro_batching", "--literal")) == 8
    def pk(*flags: str) -> tuple:
        a = streaming.parse_args(argv("packed_admission", *flags))
        return (a.max_batch_size, a.prefill_max_batch_size, a.prefill_max_tokens, a.num_requests, a.prompt_repeats,
                a.prefill_admission_policy, a.prefill_admission_lookahead, a.prefill_force_fifo_every,
                a.max_new_tokens)

    assert pk("--literal") == (8, 128, 256, 128, "512,1,1,1", "pack", 64, 8, 32)
    assert pk() == (128, 128, 256, 128, "171,1,1,1", "pack", 64, 8, 32)  # seed's active set, 512-token prompt
    tbx = streaming.parse_args(argv("token_budget", "--extra=--max-batch-size 16"))
    assert tbx.max_batch_size == 16 and tbx.prefill_max_tokens == 224 and tbx.submit_interval_ms == 20
