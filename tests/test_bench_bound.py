"""`python -m bench.bound`: the shortest-first oracle over a bench.slo run's records, on hand-made records."""
from __future__ import annotations

import json

import pytest

from bench.bound import bounds, main, shortest_first


def _rec(policy: str, i: int, n: int, *, good: bool, rejected: bool = False, warmup: bool = False,
         arrival: float = 0.0, end: float | None = None) -> dict:
    return {"policy": policy, "load_multiple": 1.5, "seed": 0, "warmup": warmup, "arrival_s": arrival + i * 0.1,
            "rejected": rejected, "good": good, "n_out": 0 if rejected else n, "max_tokens": n,
            "end_s": None if rejected else end}


def test_shortest_first_counts_what_fits() -> None:
    assert shortest_first([5, 1, 3, 10], 9) == 3  # 1 + 3 + 5
    assert shortest_first([5, 1, 3, 10], 0) == 0 and shortest_first([], 100) == 0
    assert shortest_first([4, 4], 8) == 2 and shortest_first([4, 4], 7.9) == 1


def test_bounds_per_policy_own_tokens_and_the_fastest_rate(tmp_path, capsys, monkeypatch) -> None:
    from bench import report

    monkeypatch.setattr(report, "SUMMARIES", tmp_path / "summaries")
    lengths = [10, 20, 30, 40, 100]
    recs = [_rec("fast", 0, 50, good=True, warmup=True, end=1.0)]  # the warm-up: decoded, not counted
    # 200 measured tokens from the first measured arrival (0.1 s) to the last token (4 s): the warm-up's are left out
    recs += [_rec("fast", i + 1, n, good=False, end=4.0) for i, n in enumerate(lengths)]
    recs += [_rec("slow", 0, 50, good=True, warmup=True, end=1.0)]
    recs += [_rec("slow", 1, 10, good=True, end=1.5), _rec("slow", 2, 20, good=True, end=2.0),
             _rec("slow", 3, 30, good=False, rejected=True), _rec("slow", 4, 40, good=False, rejected=True),
             _rec("slow", 5, 100, good=False, rejected=True)]  # 30 measured tokens in 1.9 s
    (b,) = bounds(recs)
    assert b["arrivals"] == 5 and b["arrival_tokens"] == 200 and b["fastest"] == "fast"
    fast, slow = b["policies"]["fast"], b["policies"]["slow"]
    assert fast["tok_s"] == pytest.approx(200 / 3.9) and slow["tok_s"] == pytest.approx(30 / 1.9)
    assert (fast["good"], fast["decoded_tokens"], fast["oracle_own_tokens"]) == (0, 200, 5)
    assert (slow["good"], slow["decoded_tokens"], slow["oracle_own_tokens"]) == (2, 30, 2)
    assert slow["oracle_full_rate"] == 3  # 51.3 tok/s x 1.9 s = 97 tokens: 10 + 20 + 30
    assert b["oracle_best_own_tokens"] == 5  # (one bound for all: what turning requests away cannot lower)
    path = tmp_path / "run"
    path.mkdir()
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main([str(path), "--against", "slow", "--json", str(tmp_path / "b.json"), "--summary", "b"]) == 0
    out = capsys.readouterr().out
    assert "slow: good 2; shortest first with its own tokens 2 (1.00x slow's good), at the full rate in its time 3 " \
           "(1.50x)" in out
    assert json.loads((tmp_path / "b.json").read_text())["bounds"][0]["policies"]["slow"]["oracle_full_rate"] == 3
    summary = json.loads((tmp_path / "summaries" / "b.json").read_text())
    assert summary["command"].startswith("python -m bench.bound ") and summary["figures"]["slow:oracle_full_rate"] == 3
    assert "slow 1.00x / 1.50x" in summary["headline"]
    with pytest.raises(SystemExit):
        main([str(path), "--load", "2"])
