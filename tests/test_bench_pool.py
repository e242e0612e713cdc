"""bench.pool: runs of one bench.slo protocol read together (pure: summaries in, ratios out)."""
import json
import math

import pytest

from bench import pool


def _summary(name: str, policies: dict[str, list[tuple[int, float, float]]], lam: float = 5.0) -> dict:
    """A bench.slo summary's shape: per policy, (seed, goodput rps, wall s) per seed."""
    return {"name": name, "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00",
            "figures": {"lambda_star_rps": lam, "policies": {
                p: {"per_seed": [{"seed": s, "goodput_rps": g, "wall_s": w, "adherence": 0.5, "n": 10}
                                 for s, g, w in seeds]} for p, seeds in policies.items()}}}


def test_strip_override_drops_only_the_named_components():
    assert pool.strip_override("kairos+lengths=hidden+gate_context=batch", ["gate_context=batch"]) \
        == "kairos+lengths=hidden"
    assert pool.strip_override("kairos+gate_context=horizon", ["gate_context=batch"]) == "kairos+gate_context=horizon"
    assert pool.strip_override("kairos", ["gate_context=batch"]) == "kairos"


def test_a_restating_arm_is_read_in_place_of_the_bare_label_that_ran_something_else():
    s = _summary("r", {"kairos": [(0, 1.0, 10.0)], "kairos+gate_context=batch": [(0, 2.0, 10.0)],
                       "scorpio": [(0, 1.0, 10.0)]})
    seeds = pool.per_seed(s, ["gate_context=batch"])
    assert seeds["kairos"] == {0: (20.0, 10.0)}  # the restating arm's 2 rps over 10 s
    assert set(seeds) == {"kairos", "scorpio"}
    # in either order of the labels
    s2 = _summary("r", {"kairos+gate_context=batch": [(0, 2.0, 10.0)], "kairos": [(0, 1.0, 10.0)]})
    assert pool.per_seed(s2, ["gate_context=batch"])["kairos"] == {0: (20.0, 10.0)}
    # a real label of acc28's kind: the length arm's override stays, the restated one goes
    s3 = _summary("r", {"kairos+lengths=hidden+gate_context=batch": [(0, 3.0, 10.0)],
                        "kairos+lengths=hidden": [(0, 1.0, 10.0)]})
    assert pool.per_seed(s3, ["gate_context=batch"]) == {"kairos+lengths=hidden": {0: (30.0, 10.0)}}
    with pytest.raises(ValueError, match="two arms"):
        pool.per_seed(_summary("r", {"kairos+a=1": [(0, 1.0, 1.0)], "kairos+a=1+b=2": [(0, 1.0, 1.0)]}),
                      ["a=1", "b=2"])
    with pytest.raises(ValueError, match="no per-seed goodput"):
        pool.per_seed({"name": "r", "figures": {"policies": {"kairos": {"per_seed": [{"seed": 0,
                                                                                       "goodput_rps": None}]}}}})


def test_a_run_ratio_is_the_acceptance_ratio_bench_slo_kept():
    """On a committed acceptance run: each arm's seeds pooled as bench.slo pools them give its stored ratios."""
    from pathlib import Path
    doc = json.loads((Path(__file__).parent.parent / "bench" / "summaries"
                      / "slo-sharegpt-1.5x-3seeds-484req-acc29-zen4.json").read_text())
    seeds = pool.per_seed(doc)
    for label, stored in doc["figures"]["acceptance"]["kairos_goodput_over"].items():
        ratio, common = pool.run_ratio(seeds["kairos"], seeds[label])
        assert common == [0, 1, 2]
        assert ratio == pytest.approx(stored, rel=1e-9)


def test_a_run_ratio_pools_its_seeds_as_bench_slo_does():
    # goodput pooled over seeds is good requests over wall time, not the mean of the seeds' goodputs
    arm = {0: (50.0, 10.0), 1: (30.0, 20.0)}  # 5 and 1.5 rps: 80 good in 30 s
    other = {0: (40.0, 10.0), 1: (20.0, 10.0), 2: (99.0, 1.0)}  # seed 2 not in arm: left out
    ratio, seeds = pool.run_ratio(arm, other)
    assert seeds == [0, 1]
    assert ratio == pytest.approx((80.0 / 30.0) / (60.0 / 20.0))
    assert pool.run_ratio(arm, {5: (1.0, 1.0)}) is None
    assert pool.run_ratio(arm, {0: (0.0, 10.0)}) is None  # the other arm served nothing


def test_pool_reports_each_run_and_the_spread_of_their_ratios():
    runs = [("a", _summary("a", {"kairos": [(0, 6.0, 10.0), (1, 6.0, 10.0)], "scorpio": [(0, 5.0, 10.0),
                                                                                          (1, 5.0, 10.0)]})),
            ("b", _summary("b", {"kairos": [(0, 4.0, 10.0)], "scorpio": [(0, 4.0, 10.0)]})),
            ("c", _summary("c", {"scorpio": [(0, 4.0, 10.0)]}))]  # no kairos arm: not a run of this ratio
    figs = pool.pool(runs, "kairos", ["scorpio", "fcfs"], [1.1, None])
    assert [r["arm_goodput_rps"] for r in figs["runs"]] == [pytest.approx(6.0), pytest.approx(4.0), None]
    f = figs["vs"]["scorpio"]
    assert [r["summary"] for r in f["per_run"]] == ["a", "b"]
    assert [r["ratio"] for r in f["per_run"]] == pytest.approx([1.2, 1.0])
    assert f["mean"] == pytest.approx(1.1)
    assert f["sd"] == pytest.approx(math.sqrt(0.02))
    half = pool.t95(1) * math.sqrt(0.02) / math.sqrt(2)
    assert f["ci90"] == pytest.approx([1.1 - half, 1.1 + half])
    assert f["runs_meeting"] == 1  # 1.2 >= 1.1, 1.0 not
    assert f["pooled"] == pytest.approx(160.0 / 140.0)  # 160 good in 30 s over 140 in 30 s
    assert figs["vs"]["fcfs"]["runs"] == 0 and f["skipped"] == []
    assert figs["goodput_over"] == ["wall"] and {r["goodput_over"] for r in figs["runs"]} == {"wall"}
    # a run whose goodputs divide by the arrivals' span (window_s, since 12-07) beside those over each run's wall
    new = _summary("d", {"kairos": [(0, 6.0, 10.0)], "scorpio": [(0, 5.0, 10.0)]})
    for fig in new["figures"]["policies"].values():
        fig["per_seed"][0]["window_s"] = 9.0
    mixed = pool.pool(runs + [("d", new)], "kairos", ["scorpio"], [1.1])
    assert mixed["goodput_over"] == ["wall", "window"] and mixed["runs"][-1]["goodput_over"] == "window"


def test_one_run_has_no_spread_and_a_run_whose_other_arm_served_nothing_is_skipped():
    runs = [("a", _summary("a", {"kairos": [(0, 6.0, 10.0)], "scorpio": [(0, 5.0, 10.0)]})),
            ("z", _summary("z", {"kairos": [(0, 6.0, 10.0)], "scorpio": [(0, 0.0, 10.0)]}))]
    f = pool.pool(runs, "kairos", ["scorpio"], [1.1])["vs"]["scorpio"]
    assert f["runs"] == 1 and f["skipped"] == ["z"]
    assert f["mean"] == pytest.approx(1.2) and f["sd"] is None and f["ci90"] is None
    assert f["runs_meeting"] == 1


def test_restates_must_name_an_override_some_run_carries():
    runs = [("a", _summary("a", {"kairos+gate_context=batch": [(0, 6.0, 10.0)], "scorpio": [(0, 5.0, 10.0)]}))]
    # a leading '+' is the label's separator, not part of the override
    assert pool.pool(runs, "kairos", ["scorpio"], [None], ["+gate_context=batch"])["vs"]["scorpio"]["runs"] == 1
    with pytest.raises(ValueError, match="no arm of these runs carries"):
        pool.pool(runs, "kairos", ["scorpio"], [None], ["gate_context=horizon"])


def test_t95_follows_the_table_and_falls_back_to_the_normal():
    assert pool.t95(1) == pytest.approx(6.314)
    assert pool.t95(11) == pool.t95(10)  # the next smaller tabled df: a wider interval, never a narrower one
    assert pool.t95(31) == pool.t95(30) == pytest.approx(1.697)  # above the table: never narrower than exact
    with pytest.raises(ValueError):
        pool.t95(0)


def test_main_prints_the_table_and_keeps_a_summary(tmp_path, capsys):
    paths = []
    for name, k in (("r1", 6.0), ("r2", 5.4)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(_summary(name, {"kairos": [(0, k, 10.0)], "scorpio": [(0, 5.0, 10.0)],
                                                "kairos+lengths=hidden": [(0, 4.0, 10.0)]})))
        paths.append(str(p))
    out = tmp_path / "pooled.json"
    assert pool.main(paths + ["--vs", "scorpio,kairos+lengths=hidden", "--targets", "1.1,1.3",
                              "--summary", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| r1 " in printed and "| r2 " in printed
    doc = json.loads(out.read_text())
    assert doc["figures"]["vs"]["kairos+lengths=hidden"]["runs_meeting"] == 2  # 1.5 and 1.35 over it, both >= 1.3
    assert doc["figures"]["vs"]["scorpio"]["runs_meeting"] == 1  # 1.2 and 1.08 over it
    assert doc["command"].startswith("python -m bench.pool")
    assert doc["figures"]["vs"]["scorpio"]["per_run"][0]["ratio"] == pytest.approx(1.2)
    assert "kairos over, mean of 2 runs" in doc["headline"]
    with pytest.raises(SystemExit, match="2 values for 1 labels"):
        pool.main(paths + ["--vs", "scorpio", "--targets", "1.1,1.3"])  # a target per label
    with pytest.raises(SystemExit, match="comma-separated numbers"):
        pool.main(paths + ["--vs", "scorpio", "--targets", "x"])
    with pytest.raises(SystemExit, match="cannot read"):
        pool.main([str(tmp_path / "missing.json")])
