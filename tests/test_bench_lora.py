"""bench.lora end to end on kairos-tiny: four points, and the base model's replies alike on both engines."""
import json

from bench import lora


def test_the_lora_benchmark_writes_its_summary(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert lora.main(["--model", "kairos-tiny", "--dtype", "float32", "--batch", "4", "--steps", "4", "--rounds", "1",
                      "--adapters", "2", "--rank", "4", "--summary", str(out)]) == 0
    fig = json.loads(out.read_text())["figures"]
    assert [r["point"] for r in fig["rows"]] == list(lora.POINTS) and fig["rows"][0]["x base"] == 1.0
    assert fig["base_replies_alike"] == [8, 8] and all(len(v) == 1 for v in fig["ms_by_round"].values())
    assert [r["load stall"] for r in fig["load_stall"]] == ["on the worker", "on the loader"]
    assert all(len(v) == 1 for v in fig["load_stall_by_round"].values()) and fig["build_ms"] > 0
    assert set(fig["restack_ms"]) == {"as packed", "packed anew"} and fig["rows"][3]["predicted ms"] > 0
    assert "base replies alike on both engines: 8/8" in capsys.readouterr().out
