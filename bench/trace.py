"""Where a missed reply's time went: read a `bench.slo --trace` run and print, for every admitted request that
missed its TPOT SLO, its longest gaps between tokens and the engine steps that ended them.

    python -m bench.trace bench/out/RUN [--policy kairos] [--gaps 3]

A gap is the time between two of a reply's tokens. The steps in it are those after the step that gave the first
token, up to the one that gave the second: a step stamps its tokens just before it ends, so the step of a token
is the first to end at or after its time (in-process runs use the engine's clock for both).
The longest is shown as its wall time, its prefills (requests / prompt tokens) and its decode rows: a long gap
with a step that prefilled a long prompt is a prefill stall (in the reply's own step with hybrid steps, in a
step of its own without); many ordinary steps in one gap are steps the reply sat out.
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Gap:
    index: int  # between token index and index + 1
    ms: float
    steps: int  # engine steps that ended within it (1: the reply was in each step; more: it sat some out)
    step: list[float] | None  # the longest of them: end_s, wall_ms, prefills, prompt_tokens, decodes, mean ctx


@dataclass(frozen=True, slots=True)
class Miss:
    record: dict[str, Any]
    gaps: list[Gap]  # the longest, longest first


Key = tuple[str, float, int]  # policy, load multiple, seed: one run of the engine


def misses(records: Sequence[dict[str, Any]], steps: dict[Key, list[list[float]]], top: int = 3) -> list[Miss]:
    """The admitted, non-warm-up requests over their TPOT SLO, each with its `top` longest gaps (pure)."""
    out = []
    for r in records:
        tpot = r.get("tpot_ms")
        if r.get("rejected") or r.get("warmup") or tpot is None or tpot <= r["tpot_slo_ms"]:
            continue
        times = r.get("token_times_s") or []
        run = steps.get((r["policy"], r["load_multiple"], r["seed"]), [])
        ends = [s[0] for s in run]
        gaps = []
        for i in range(len(times) - 1):
            inside = run[bisect.bisect_left(ends, times[i]) + 1:bisect.bisect_left(ends, times[i + 1]) + 1]
            longest = max(inside, key=lambda s: s[1], default=None)
            gaps.append(Gap(i, (times[i + 1] - times[i]) * 1000.0, len(inside), longest))
        out.append(Miss(r, sorted(gaps, key=lambda g: -g.ms)[:top]))
    return out


def load(run_dir: Path) -> tuple[list[dict[str, Any]], dict[Key, list[list[float]]]]:
    records = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines() if x.strip()]
    steps: dict[Key, list[list[float]]] = {}
    path = run_dir / "steps.jsonl"
    if path.exists():
        for x in path.read_text().splitlines():
            if x.strip():
                d = json.loads(x)
                steps[(d["policy"], d["load_multiple"], d["seed"])] = d["steps"]
    return records, steps


def describe(m: Miss) -> str:
    r = m.record
    lines = [f"{r['policy']} {r['load_multiple']:g}x seed {r['seed']} {r['tier']}: arrived {r['arrival_s']:.3f} s, "
             f"prompt {r['prompt_len']}, {r['n_out']} tokens at {r['tpot_ms']:.2f} ms against "
             f"{r['tpot_slo_ms']:.2f} ({r['tpot_ms'] / r['tpot_slo_ms']:.2f}x)"]
    for g in m.gaps:
        s = g.step
        what = "no step ended in it" if s is None else (f"{g.steps} steps, the longest {s[1]:.1f} ms: {s[2]:.0f} "
                                                        f"prefills / {s[3]:.0f} prompt tokens, {s[4]:.0f} decodes")
        lines.append(f"    gap after token {g.index}: {g.ms:.1f} ms, {what}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a bench.slo --out directory written with --trace")
    ap.add_argument("--policy", default=None, help="only this policy label")
    ap.add_argument("--gaps", type=int, default=3, help="longest gaps shown per reply")
    args = ap.parse_args(argv)
    records, steps = load(args.run)
    if not any("token_times_s" in r for r in records):
        ap.error(f"{args.run} has no token times: rerun bench.slo with --trace")
    found = [m for m in misses(records, steps, args.gaps) if args.policy in (None, m.record["policy"])]
    for m in found:
        print(describe(m))
    print(f"{len(found)} TPOT misses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
