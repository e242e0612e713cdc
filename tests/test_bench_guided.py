"""bench.guided end to end on kairos-tiny: every point measured, and the summary written."""
import json

from bench import guided


def test_the_guided_benchmark_writes_its_summary(tmp_path, capsys):
    out = tmp_path / "guided.json"
    assert guided.main(["--model", "kairos-tiny", "--dtype", "float32", "--rounds", "1", "--steps", "4",
                        "--values", "20", "--keys", "20", "--summary", str(out)]) == 0
    fig = json.loads(out.read_text())["figures"]
    assert [r["point"] for r in fig["rows"]] == ["plain alone", "enum of 20", "20 keys", "regex", "json_object"]
    assert fig["rows"][0]["x alone"] == 1.0 and all(len(v) == 1 for v in fig["ms_by_round"].values())
    assert "beside one sampled guided request" in capsys.readouterr().out
