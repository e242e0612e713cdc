"""bench.route's reading of bench.slo's results (pure; the runs themselves are benchmarks, not tests)."""
from __future__ import annotations

import json

from bench.route import _row, _rows


def test_a_router_row_keeps_goodput_adherence_tiers_and_the_replica_split() -> None:
    res = {"load_multiple": 1.5, "rate_rps": 10.0335, "n": 218, "goodput_rps": 5.0, "goodput_rps_mean": 5.688,
           "adherence": 0.6, "adherence_mean": 0.6789, "rejection_rate": 0.3073, "ttft_violations": 0,
           "tpot_violations": 3, "token_throughput": 1947.77,
           "per_tier": {"interactive": {"adherence": 0.684, "good": 52, "ttft_violations": 2},
                        "strict_tpot": {"adherence": 0.597, "good": 43, "ttft_violations": 0}},
           "reject_reasons": {"shed": 30, "tpot_unattainable": 37},
           "per_replica": {"x0p": {"requests": 103, "output_tokens": 24759},
                           "obr": {"requests": 115, "output_tokens": 25918}},
           "per_seed": [{"seed": 0, "goodput_rps": 5.688}]}
    row = _row("slo", res)
    assert row["router"] == "slo" and row["load"] == 1.5 and row["n"] == 218
    assert row["goodput_rps"] == 5.688 and row["adherence"] == 0.6789  # the mean over seeds where there is one
    assert row["per_tier_adherence"] == {"interactive": 0.684, "strict_tpot": 0.597}
    assert row["tpot_misses"] == 3 and row["tok_s"] == 1947.8
    assert list(row["replica_split"].items()) == [("obr", (115, 25918)), ("x0p", (103, 24759))]  # sorted by id
    assert row["per_tier_good"] == {"interactive": 52, "strict_tpot": 43}
    assert row["per_tier_ttft_misses"] == {"interactive": 2, "strict_tpot": 0}
    assert row["reject_reasons"] == {"shed": 30, "tpot_unattainable": 37} and row["replica_tiers"] == {}


def test_an_arms_rows_count_each_replicas_tiers_per_load_without_the_warmup(tmp_path) -> None:
    res = {"load_multiple": 1.0, "rate_rps": 5.0, "n": 3, "goodput_rps": 1.0, "adherence": 1.0, "rejection_rate": 0.0,
           "ttft_violations": 0, "tpot_violations": 0, "token_throughput": 10.0,
           "per_tier": {"relaxed": {"adherence": 1.0, "good": 3, "ttft_violations": 0}}}
    (tmp_path / "results.json").write_text(json.dumps({"results": [res, {**res, "load_multiple": 1.5}]}))
    lines = [(1.0, False, "a", "relaxed"), (1.0, False, "a", "strict_tpot"), (1.0, False, "b", "relaxed"),
             (1.0, True, "b", "relaxed"), (1.5, False, "b", "relaxed"), (1.0, False, None, "relaxed")]
    (tmp_path / "records.jsonl").write_text("".join(
        json.dumps({"load_multiple": x, "warmup": w, "replica": rid, "tier": t}) + "\n" for x, w, rid, t in lines))
    one, half = _rows("slo", tmp_path)
    assert (one["load"], half["load"]) == (1.0, 1.5)
    assert one["replica_tiers"] == {"a": {"relaxed": 1, "strict_tpot": 1}, "b": {"relaxed": 1}}
    assert half["replica_tiers"] == {"b": {"relaxed": 1}}
