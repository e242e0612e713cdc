"""Several runs of one bench.slo protocol read as one sample: the ratios an acceptance list asks for, run by run and
pooled, with how far they spread.

Why. On a 2-core box a run of 3 seeds moves each goodput ratio from run to run (the box's speed drifts, λ\\* is
searched again, each engine re-times its model, a replica's choices snowball), so one run says little about whether
a ratio clears a target a few points away. Runs of the same protocol at the same default path, read together, say
how often it does and where its mean lies.

    python -m bench.pool bench/summaries/slo-sharegpt-1.5x-3seeds-484req-acc29-zen4.json ... \\
        --vs scorpio,kairos+lengths=hidden,kairos+lengths=exact --targets 1.1,1.3,0.9 --summary NAME

Each input is a bench.slo summary (`--summary`): its per-seed goodputs and walls per policy label. For each label of
`--vs` it prints every run's ratio as the acceptance reads it (`--arm`'s goodput over the label's, each pooled over
the seeds both ran as bench.slo pools a point's seeds: good requests over wall time), their mean, standard deviation
and a 90% interval of that mean (Student's t over the runs: the seeds of a run share its λ\\*, tiers and box, so the
run is the unit), how many runs clear the target, and the pooled ratio (good requests over wall time over every run
and seed, of one arm over the other's). A run whose compared arm served nothing has no ratio: it is listed as
skipped. `--restates OVERRIDE` reads a label that carries `+OVERRIDE` as the label without it: an override that
restated the default of the code the pooled runs share (say `gate_context=batch`), so that such an arm counts as the
default arm (in a run that has both, the bare label ran something else and is left out). Only the runs' own figures
are read; nothing is measured here.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.report import command_line, format_table, write_summary

# two-sided 90% Student's t quantiles (0.95) by degrees of freedom
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
        12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def t95(df: int) -> float:
    """The 0.95 quantile of Student's t with `df` degrees of freedom; between the tabled ones (and above 30), the
    next smaller tabled df's, a larger quantile: the interval is never narrower than the exact one."""
    if df < 1:
        raise ValueError("need at least one degree of freedom")
    return _T95[max(k for k in _T95 if k <= df)]


def strip_override(label: str, restates: Sequence[str]) -> str:
    """`label` without each `+OVERRIDE` component of `restates` (the components of a label are '+'-separated)."""
    parts = label.split("+")
    return "+".join([parts[0]] + [p for p in parts[1:] if p not in restates])


def per_seed(summary: dict[str, Any], restates: Sequence[str] = ()) -> dict[str, dict[int, tuple[float, float]]]:
    """{label: {seed: (good requests, wall s)}} of a bench.slo summary (a seed's goodput is their quotient); a label
    that restates a default under `restates` is read as the label without it, and where the run has that bare label
    too, the restating arm is the one read (the bare label ran something else there: the run compared the two).
    ValueError for a summary without those figures."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    restating: set[str] = set()
    for label, fig in (summary.get("figures", {}).get("policies") or {}).items():
        key = strip_override(label, restates)
        if key != label:
            if key in restating:
                raise ValueError(f"{summary.get('name')}: two arms read as {key!r}")
            restating.add(key)
        elif key in restating:
            continue
        try:
            # (good, span): goodput is over the arrivals' span (`window_s`) since it is reported, over the run's own
            # (`wall_s`) in the summaries before
            out[key] = {int(s["seed"]): (float(s["goodput_rps"]) * float(s.get("window_s", s["wall_s"])),
                                         float(s.get("window_s", s["wall_s"]))) for s in fig.get("per_seed") or []}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{summary.get('name')}: {label!r} has no per-seed goodput and wall ({e!r})") from None
    return out


def goodput_over(summary: dict[str, Any]) -> str:
    """What a bench.slo summary's goodputs divide by: "window" (the arrivals' span, one for every policy of a seed:
    `window_s`, reported since 12-07) or "wall" (each policy's own run, in the summaries before)."""
    for fig in (summary.get("figures", {}).get("policies") or {}).values():
        if any("window_s" in s for s in fig.get("per_seed") or ()):
            return "window"
    return "wall"


def goodput(seeds: Iterable[tuple[float, float]]) -> float | None:
    """Good requests over wall time of (good, wall) seeds pooled, as bench.slo pools a point's seeds."""
    got = list(seeds)
    wall = sum(w for _, w in got)
    return sum(g for g, _ in got) / wall if wall > 0 else None


def ratio(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float | None:
    """Pooled goodput of seeds `a` over that of seeds `b`; None where `b` served nothing."""
    ga, gb = goodput(a), goodput(b)
    return ga / gb if ga is not None and gb else None


def run_ratio(arm: dict[int, tuple[float, float]], other: dict[int, tuple[float, float]]
              ) -> tuple[float, list[int]] | None:
    """The acceptance's ratio for one run: `arm`'s goodput over `other`'s, each pooled over the seeds both ran
    (bench.slo pools a point's seeds: good requests over wall time); with those seeds. None without a common seed or
    where `other` served nothing."""
    seeds = sorted(set(arm) & set(other))
    got = ratio([arm[k] for k in seeds], [other[k] for k in seeds])
    return None if got is None else (got, seeds)


def pool(summaries: Sequence[tuple[str, dict[str, Any]]], arm: str, vs: Sequence[str],
         targets: Sequence[float | None], restates: Sequence[str] = ()) -> dict[str, Any]:
    """The figures `main` prints and keeps: per label of `vs`, each run's ratio and their statistics."""
    restates = [r.lstrip("+") for r in restates]
    runs = [(name, s, per_seed(s, restates)) for name, s in summaries]
    for r in restates:
        if not any(r in label.split("+")[1:] for _, s, _ in runs
                   for label in (s.get("figures", {}).get("policies") or {})):
            raise ValueError(f"--restates {r}: no arm of these runs carries +{r}")
    out: dict[str, Any] = {"arm": arm, "runs": [], "vs": {}}
    for name, s, seeds in runs:
        f = s.get("figures", {})
        out["runs"].append({"summary": name, "commit": s.get("commit"), "date": s.get("date"),
                            "lambda_star_rps": f.get("lambda_star_rps"),
                            "seeds": sorted(seeds.get(arm, {})),
                            "arm_goodput_rps": goodput(seeds.get(arm, {}).values()),
                            "goodput_over": goodput_over(s)})
    # (a run's ratio compares its arms under one definition; runs under both are pooled, and said to be)
    out["goodput_over"] = sorted({r["goodput_over"] for r in out["runs"]})
    for label, target in zip(vs, targets):
        rows, skipped, pooled_a, pooled_b = [], [], [], []
        for name, _, seeds in runs:
            a, b = seeds.get(arm), seeds.get(label)
            if not (a and b):
                continue  # not a run of this comparison
            got = run_ratio(a, b)
            if got is None:
                skipped.append(name)
                continue
            run, common = got
            rows.append({"summary": name, "ratio": run, "seeds": common})
            pooled_a += [a[k] for k in common]
            pooled_b += [b[k] for k in common]
        ratios = [r["ratio"] for r in rows]
        fig: dict[str, Any] = {"target": target, "per_run": rows, "runs": len(rows), "skipped": skipped}
        if ratios:
            mean = statistics.fmean(ratios)
            sd = statistics.stdev(ratios) if len(ratios) > 1 else None
            half = t95(len(ratios) - 1) * sd / math.sqrt(len(ratios)) if sd is not None else None
            fig.update(mean=mean, sd=sd, ci90=[mean - half, mean + half] if half is not None else None,
                       min=min(ratios), max=max(ratios), pooled=ratio(pooled_a, pooled_b))
            if target is not None:
                fig["runs_meeting"] = sum(r >= target for r in ratios)
        out["vs"][label] = fig
    return out


def _targets(text: str | None, n: int) -> list[float | None]:
    if not text:
        return [None] * n
    try:
        vals = [float(t) if t.strip() else None for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"--targets takes comma-separated numbers (or empty places), not {text!r}") from None
    if len(vals) != n:
        raise SystemExit(f"--targets has {len(vals)} values for {n} labels of --vs")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summaries", nargs="+", help="bench.slo summary JSONs (runs of one protocol)")
    ap.add_argument("--arm", default="kairos", help="the label whose goodput is over the others'")
    ap.add_argument("--vs", default="scorpio,kairos+lengths=hidden,kairos+lengths=exact",
                    help="comma-separated labels to compare with")
    ap.add_argument("--targets", default=None, help="comma-separated target ratios, one per --vs label (or empty)")
    ap.add_argument("--restates", action="append", default=[], metavar="OVERRIDE",
                    help="a label's +OVERRIDE restated the default of the code the runs share: read it as the label "
                    "without it (repeatable)")
    ap.add_argument("--summary", default=None, help="keep the figures as bench/summaries/NAME.json")
    args = ap.parse_args(argv)
    vs = [v for v in args.vs.split(",") if v]
    targets = _targets(args.targets, len(vs))
    docs = []
    for p in args.summaries:
        try:
            docs.append((Path(p).stem, json.loads(Path(p).read_text(encoding="utf-8"))))
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read {p}: {e}") from None
    try:
        figs = pool(docs, args.arm, vs, targets, args.restates)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rows = [[r["summary"], r["commit"], r["lambda_star_rps"], r["arm_goodput_rps"], r["goodput_over"]]
            for r in figs["runs"]]
    print(format_table(["run", "commit", "lambda* rps", f"{args.arm} rps", "goodput over"], rows, digits=2))
    if len(figs["goodput_over"]) > 1:
        print("note: these runs' goodputs divide by different times (each run's ratio by one of them): "
              "the arrivals' span (window) and each policy's own run (wall)")
    print()
    heads = ["vs", "runs", "per run", "mean", "sd", "90% interval", "pooled", "target", "runs meeting"]
    rows = []
    for label, f in figs["vs"].items():
        if not f["runs"]:
            rows.append([label, 0, "", "", "", "", "", f["target"], ""])
            continue
        ci = f["ci90"]
        rows.append([label, f["runs"], " ".join(f"{r['ratio']:.2f}" for r in f["per_run"]), f"{f['mean']:.3f}",
                     "" if f["sd"] is None else f"{f['sd']:.3f}",
                     "" if ci is None else f"{ci[0]:.2f}-{ci[1]:.2f}", f"{f['pooled']:.3f}",
                     "" if f["target"] is None else f["target"],
                     "" if f["target"] is None else f"{f['runs_meeting']}/{f['runs']}"])
    print(format_table(heads, rows, digits=3))
    for label, f in figs["vs"].items():
        if f["skipped"]:
            print(f"skipped (no {label} goodput to divide by): {', '.join(f['skipped'])}")
    if args.summary:
        parts = [f"{label} {f['mean']:.2f}x" + (f" (90% {f['ci90'][0]:.2f}-{f['ci90'][1]:.2f})" if f["ci90"] else "")
                 if f["runs"] else f"{label} -" for label, f in figs["vs"].items()]
        headline = f"{args.arm} over, mean of {len(figs['runs'])} runs: " + ", ".join(parts)
        path = write_summary(args.summary, command_line("bench.pool", argv), headline, figs)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
