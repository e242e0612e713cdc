"""bench.route's reading of bench.slo's results (pure; the runs themselves are benchmarks, not tests)."""
from __future__ import annotations

from bench.route import _row


def test_a_router_row_keeps_goodput_adherence_tiers_and_the_replica_split() -> None:
    res = {"load_multiple": 1.5, "rate_rps": 10.0335, "n": 218, "goodput_rps": 5.0, "goodput_rps_mean": 5.688,
           "adherence": 0.6, "adherence_mean": 0.6789, "rejection_rate": 0.3073, "ttft_violations": 0,
           "tpot_violations": 3, "token_throughput": 1947.77,
           "per_tier": {"interactive": {"adherence": 0.684}, "strict_tpot": {"adherence": 0.597}},
           "per_replica": {"x0p": {"requests": 103, "output_tokens": 24759},
                           "obr": {"requests": 115, "output_tokens": 25918}},
           "per_seed": [{"seed": 0, "goodput_rps": 5.688}]}
    row = _row("slo", res)
    assert row["router"] == "slo" and row["load"] == 1.5 and row["n"] == 218
    assert row["goodput_rps"] == 5.688 and row["adherence"] == 0.6789  # the mean over seeds where there is one
    assert row["per_tier_adherence"] == {"interactive": 0.684, "strict_tpot": 0.597}
    assert row["tpot_misses"] == 3 and row["tok_s"] == 1947.8
    assert list(row["replica_split"].items()) == [("obr", (115, 25918)), ("x0p", (103, 24759))]  # sorted by id
