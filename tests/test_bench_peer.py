"""bench.peer: the shared workload, the ratio it reports, and a Kairos-only run end to end (no vLLM here)."""
from bench import peer


def test_prompts_are_seeded_and_avoid_special_ids():
    a = peer.make_prompts([1, 4], 16, 512, seed=0)
    assert a == peer.make_prompts([1, 4], 16, 512, seed=0)
    assert [len(a[b]) for b in (1, 4)] == [1, 4]
    assert all(len(p) == 16 and all(100 <= t < 512 for t in p) for ps in a.values() for p in ps)


def test_kairos_only_run(tmp_path, capsys):
    """Without --vllm-venv, Kairos alone: the same rounds, its best run per batch size."""
    import json

    out = tmp_path / "peer.json"
    assert peer.main(["--model", "kairos-tiny", "--paired", "float32:bfloat16", "--batches", "1,3", "--prompt-len",
                      "8", "--new-tokens", "4", "--reps", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["paired"]
    assert res["kairos_dtype"] == "float32" and res["vllm_dtype"] is None and res["ratio_median"] == {}
    assert [list(p) for b in ("1", "3") for p in res["runs"][b]] == [["kairos"], ["kairos"]]
    assert set(res["best_tok_s"]) == {"1", "3"} and all(v["kairos"] > 0 for v in res["best_tok_s"].values())
    assert "kairos float32 best tok/s" in capsys.readouterr().out


def test_paired_figures_are_each_engines_best_and_the_median_of_the_rounds_ratios():
    runs = {8: [{"kairos": 300.0, "vllm": 200.0}, {"kairos": 330.0, "vllm": 300.0}, {"kairos": 280.0, "vllm": 140.0}]}
    f = peer.paired_figures(runs)
    assert f["best_tok_s"] == {8: {"kairos": 330.0, "vllm": 300.0}}
    assert f["ratio_median"] == {8: 1.5} and f["ratio_range"] == {8: (1.1, 2.0)}


def test_child_loop_replies_once_ready_then_once_per_command():
    import io
    import json

    asked = []

    def run(b):
        asked.append(b)
        return 0.5, 4 * b
    replies = io.StringIO()
    peer.serve_commands(run, {"start_s": 1.5}, io.StringIO('{"b": 1}\n{"b": 8}\n'), replies)
    lines = replies.getvalue().splitlines()
    assert all(line.startswith(peer.REPLY) for line in lines) and asked == [1, 8]
    assert [json.loads(line[len(peer.REPLY):]) for line in lines] == [
        {"start_s": 1.5}, {"b": 1, "wall_s": 0.5, "tokens": 4}, {"b": 8, "wall_s": 0.5, "tokens": 32}]


def test_paired_run_alternates_the_engines_round_by_round(monkeypatch):
    """`--paired` with a stand-in for the vLLM child (no vLLM here) and Kairos's real engine: a warm-up of each per
    batch size, then per round each batch size on both engines, the first engine alternating by round."""
    order = []

    class FakeVllm:
        def __init__(self, venv, model_dir, dtype, prompts, new_tokens, workdir, temperature=0.0, top_p=1.0):
            self.start_s, self.prompts, self.new_tokens = 2.0, prompts, new_tokens

        def run(self, b):
            order.append(("vllm", b))
            return 1.0, b * self.new_tokens

        def close(self):
            order.append("closed")
    real_run = peer.KairosSession.run

    def kairos_run(self, b):
        order.append(("kairos", b))
        return real_run(self, b)
    monkeypatch.setattr(peer, "VllmSession", FakeVllm)
    monkeypatch.setattr(peer.KairosSession, "run", kairos_run)
    prompts = peer.make_prompts([1, 2], 8, 256, seed=0)
    res = peer.run_paired("kairos-tiny", "float32", "unused", "bfloat16", prompts, 3, rounds=2, threads=1)
    warm = [("kairos", 1), ("vllm", 1), ("kairos", 2), ("vllm", 2)]
    assert order == warm + warm + [("vllm", 1), ("kairos", 1), ("vllm", 2), ("kairos", 2), "closed"]
    assert res["kairos_dtype"] == "float32" and res["start_s"]["vllm"] == 2.0
    assert all(len(res["runs"][b]) == 2 and all(p["vllm"] == b * 3 for p in res["runs"][b]) for b in (1, 2))
    assert set(res["ratio_median"]) == {1, 2} and all(r > 0 for r in res["ratio_median"].values())


def test_serve_mode_alternates_the_servers_and_reports_each_ones_median(monkeypatch, tmp_path):
    """`--serve` with stand-ins for both servers and vLLM's client (no Ray, no vLLM here): round r runs Kairos first
    when r is even, each run's client figures are kept, and each engine's figures are the median of its runs."""
    import contextlib

    import bench.driver

    order, ttft = [], iter([100.0, 200.0, 300.0, 150.0, 120.0, 210.0])

    @contextlib.contextmanager
    def served(args, log):
        order.append(("kairos", args))
        yield "http://kairos"

    def vllm_run(venv, model_dir, run, log, timeout_s):
        order.append(("vllm", venv))
        return run("http://vllm")

    def client(venv, url, model_dir, dataset, n, rate, out):
        assert (n, rate, dataset) == (8, 1.5, "sg.json")
        return {"median_ttft_ms": next(ttft), "median_tpot_ms": 20.0, "request_throughput": 1.4,
                "mean_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "url": url}
    monkeypatch.setattr(bench.driver, "served", served)
    monkeypatch.setattr(peer, "vllm_server_run", vllm_run)
    monkeypatch.setattr(peer, "bench_serve", client)
    args = peer.parse_args(["--serve", "--vllm-venv", "V", "--serve-args", "policy=fcfs", "--rate", "1.5",
                            "--num-prompts", "8", "--reps", "3", "--dataset-path", "sg.json"])
    res = peer.run_servers(args, "model-dir")
    assert [e for e, _ in order] == ["kairos", "vllm", "vllm", "kairos", "kairos", "vllm"]
    assert ("kairos", "policy=fcfs") in order
    assert [r["median_ttft_ms"] for r in res["runs"]["kairos"]] == [100.0, 150.0, 120.0]
    assert {r["url"] for r in res["runs"]["vllm"]} == {"http://vllm"}
    assert res["median_of_runs"]["kairos"]["median_ttft_ms"] == 120.0
    assert res["median_of_runs"]["vllm"]["median_ttft_ms"] == 210.0
