"""bench.overhead's aggregation over rounds (pure; the runs themselves are benchmarks, not tests)."""
from __future__ import annotations

from bench.overhead import _added, _figures


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
