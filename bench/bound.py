"""How many requests a policy could have completed in a `bench.slo` run, had it chosen perfectly: shortest first.

    python -m bench.bound bench/out/RUN [--load 1.5] [--against scorpio] [--json PATH] [--summary NAME]

`bench.slo --out RUN` writes one record per request (`records.jsonl`). For each seed of a load point and each
policy this counts how many of the measured arrivals (the warm-up left out, as in the goodput) a chooser that
knew every reply's length in advance would complete, serving the shortest replies first, within a budget of
decode tokens:

- `own tokens`: the tokens the policy's admitted requests decoded in its run (the same work, better chosen); and
  the most of those over the run's policies (`oracle_best_own_tokens`: one bound for all, which a policy cannot
  lower by turning requests away);
- `full rate`: the fastest decode rate any policy of the run reached (decoded tokens over its run's span, the
  first measured arrival to the last token; FCFS's large batches as a rule) over this policy's own span (the
  engine's whole throughput in the same time).

Both leave out what a real policy pays on top (prefills, arrival times, TTFT and TPOT SLOs), so they are
optimistic: a goodput beyond `own tokens` needs more decode throughput than the policy had, and one beyond
`full rate` more than the engine has.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.report import command_line, format_table, write_json, write_summary


def shortest_first(lengths: Iterable[int], budget: float) -> int:
    """How many of `lengths` fit in `budget`, taken shortest first."""
    done, spent = 0, 0
    for n in sorted(lengths):
        if spent + n > budget:
            break
        spent += n
        done += 1
    return done


def _span_s(recs: list[dict]) -> float:
    ends = [r["end_s"] for r in recs if r.get("end_s") is not None]
    return max(ends) - min(r["arrival_s"] for r in recs) if ends else 0.0


def bounds(records: Iterable[dict], load: float | None = None) -> list[dict[str, Any]]:
    """Per (load, seed): each policy's good and decoded tokens, and the oracle's counts for both budgets."""
    runs: dict[tuple[float, int], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if load is None or abs(r["load_multiple"] - load) < 1e-9:
            runs[(r["load_multiple"], r["seed"])][r["policy"]].append(r)
    out = []
    for (lm, seed), by_policy in sorted(runs.items()):
        measured = {p: [r for r in recs if not r.get("warmup")] for p, recs in by_policy.items()}
        lengths = [r.get("output_len") or r["max_tokens"] for r in next(iter(measured.values()))]
        policies: dict[str, dict[str, Any]] = {}
        for p in by_policy:  # (the measured arrivals' span and tokens: the warm-up's are no budget for them)
            span = _span_s(measured[p])
            decoded = sum(r["n_out"] or 0 for r in measured[p] if not r["rejected"])
            policies[p] = {"good": sum(bool(r["good"]) for r in measured[p]), "span_s": span,
                           "decoded_tokens": decoded, "tok_s": decoded / span if span else 0.0}
        fastest = max(policies, key=lambda p: policies[p]["tok_s"])
        for v in policies.values():
            v["oracle_own_tokens"] = shortest_first(lengths, v["decoded_tokens"])
            v["oracle_full_rate"] = shortest_first(lengths, policies[fastest]["tok_s"] * v["span_s"])
        # the same bound for every policy: the most any policy's decode work completes, chosen shortest first (a
        # policy's own bound shrinks with what it turns away: judged against it, turning most away scored well)
        best = max(v["oracle_own_tokens"] for v in policies.values())
        out.append({"load_multiple": lm, "seed": seed, "arrivals": len(lengths), "arrival_tokens": sum(lengths),
                    "fastest": fastest, "oracle_best_own_tokens": best, "policies": policies})
    return out


def _ratio(x: float, ref: float | None) -> str:
    return f"{x / ref:.2f}x" if ref else "-"


def read_records(run: Path) -> list[dict]:
    path = run / "records.jsonl" if run.is_dir() else run
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bound", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a bench.slo --out directory (or its records.jsonl)")
    p.add_argument("--load", type=float, default=None, help="only this load multiple (default: every one)")
    p.add_argument("--against", default="scorpio", help="the policy whose good requests the bounds are set "
                                                       "against (default scorpio)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON here")
    p.add_argument("--summary", metavar="NAME", help="keep the totals as bench/summaries/NAME.json")
    a = p.parse_args(argv)
    res = bounds(read_records(a.run), a.load)
    if not res:
        p.error(f"no records in {a.run}" + (f" at load {a.load:g}" if a.load is not None else ""))
    rows, total = [], defaultdict(int)
    for b in res:
        ref = b["policies"].get(a.against, {}).get("good")
        for name, v in b["policies"].items():
            rows.append([f"{b['load_multiple']:g}", b["seed"], name, b["arrivals"], v["good"], f"{v['tok_s']:.0f}",
                         f"{v['span_s']:.1f}", v["oracle_own_tokens"], v["oracle_full_rate"],
                         _ratio(v["oracle_own_tokens"], ref), _ratio(v["oracle_full_rate"], ref)])
            for key in ("good", "oracle_own_tokens", "oracle_full_rate"):
                total[f"{name}:{key}"] += v[key]
        total["arrivals"] += b["arrivals"]
    print(format_table(["load", "seed", "policy", "arrivals", "good", "decode tok/s", "span s",
                        "shortest first, own tokens", "shortest first, full rate", f"/ {a.against} good",
                        f"/ {a.against} good (full)"], rows))
    ref_total = total.get(f"{a.against}:good")
    print(f"all seeds: {total['arrivals']} arrivals; {a.against} good {ref_total}")
    parts = []  # the summary's headline: each policy's two ratios (FCFS's, the rate reference, left out)
    for name in res[0]["policies"]:
        own, full = total[f"{name}:oracle_own_tokens"], total[f"{name}:oracle_full_rate"]
        print(f"  {name}: good {total[f'{name}:good']}; shortest first with its own tokens {own} "
              f"({_ratio(own, ref_total)} {a.against}'s good), at the full rate in its time {full} "
              f"({_ratio(full, ref_total)})")
        if name != "fcfs":
            parts.append(f"{name} {_ratio(own, ref_total)} / {_ratio(full, ref_total)}")
    if a.json:
        write_json(a.json, {"run": str(a.run), "against": a.against, "bounds": res, "totals": dict(total)})
    if a.summary:
        headline = (f"shortest-first oracle over {a.run.name} ({total['arrivals']} arrivals), against {a.against}'s "
                    f"{ref_total} good: with each policy's own decode tokens / at the fastest rate in its time: "
                    + ", ".join(parts))
        print(f"summary: {write_summary(a.summary, command_line('bench.bound', argv), headline, dict(total))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
