"""bench.prefix_cache end to end on kairos-tiny: both engines answer alike, and the one with prefix caching computes
only what follows the cached system prompts."""
import json

from bench import prefix_cache


def test_the_prefix_cache_benchmark_writes_its_summary(tmp_path, capsys):
    out = tmp_path / "pc.json"
    assert prefix_cache.main(["--model", "kairos-tiny", "--system-tokens", "64", "--questions", "3",
                              "--system-prompts", "2", "--summary", str(out)]) == 0
    fig = json.loads(out.read_text())["figures"]
    on, off = fig["rows"]
    assert off["prompt tokens computed"] == fig["prompt_tokens"] and fig["replies_alike"] == fig["requests"] == 6
    # each system prompt's 4 full blocks of 16 are found by its two later requests
    assert fig["cached_tokens"] == 2 * 2 * 64 and on["prompt tokens computed"] == fig["prompt_tokens"] - 256
    assert "faster with caching" in capsys.readouterr().out
