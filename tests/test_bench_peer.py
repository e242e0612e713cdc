"""bench.peer: the shared workload, the ratio it reports, and a Kairos-only run end to end (no vLLM here)."""
from bench import peer


def test_prompts_are_seeded_and_avoid_special_ids():
    a = peer.make_prompts([1, 4], 16, 512, seed=0)
    assert a == peer.make_prompts([1, 4], 16, 512, seed=0)
    assert [len(a[b]) for b in (1, 4)] == [1, 4]
    assert all(len(p) == 16 and all(100 <= t < 512 for t in p) for ps in a.values() for p in ps)


def test_ratio_is_best_dtype_over_best_dtype():
    res = [{"engine": "kairos", "batches": {1: {"tok_s": 30.0}}}, {"engine": "kairos", "batches": {1: {"tok_s": 40.0}}},
           {"engine": "vllm", "batches": {1: {"tok_s": 20.0}}}, {"engine": "vllm", "batches": {1: {"tok_s": 25.0}}}]
    assert peer.ratios(res, [1]) == {1: 40.0 / 25.0}


def test_kairos_only_run(tmp_path, capsys):
    out = tmp_path / "peer.json"
    assert peer.main(["--model", "kairos-tiny", "--kairos-dtypes", "float32", "--batches", "1,3", "--prompt-len", "8",
                      "--new-tokens", "4", "--reps", "1", "--json", str(out)]) == 0
    import json

    res = json.loads(out.read_text())["results"]
    assert [r["engine"] for r in res] == ["kairos"]
    assert {int(b): v["tokens"] for b, v in res[0]["batches"].items()} == {1: 4, 3: 12}
    a = res[0]["batches"]["3"]["anatomy"]  # one prefill step for the 3 prompts, then 3 decode steps
    assert len(a["prefill_steps_ms"]) == 1 and a["decode_steps"] == 3
    assert "B=3 tok/s" in capsys.readouterr().out
