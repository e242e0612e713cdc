"""bench.slo's report: tables, CSV, the acceptance checks, per-request lines, HTTP vs in-process."""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import slo_metrics as M
from bench.common import clean, fmt, format_table
from bench.slo_run import PointRun

CHECK_LOAD = 1.5
TIER_SHORT = {"interactive": "T1", "strict_tpot": "T2", "relaxed": "T3"}


CSV_FIELDS = ("policy", "load_multiple", "rate_rps", "goodput_rps", "adherence", "n", "good", "rejected",
              "rejection_rate", "ttft_violations", "tpot_violations", "incomplete", "timeouts", "token_throughput",
              "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "sched_ms_per_step", "sched_pct",
              "step_ms", "engine_busy_pct", "wall_s", "submit_lag_p99_ms")


def write_csv(path: Path, results: Sequence[dict], tiers: Sequence[str]) -> None:
    cols = list(CSV_FIELDS)
    for t in tiers:
        cols += [f"{t}_adherence", f"{t}_ttft_p50_ms", f"{t}_ttft_p99_ms", f"{t}_tpot_p50_ms", f"{t}_tpot_p99_ms"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            row = [r.get(c) for c in CSV_FIELDS]
            for t in tiers:
                pt = r.get("per_tier", {}).get(t, {})
                row += [pt.get("adherence"), pt.get("ttft_p50_ms"), pt.get("ttft_p99_ms"), pt.get("tpot_p50_ms"),
                        pt.get("tpot_p99_ms")]
            w.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else
                        (f"{v:.6g}" if isinstance(v, float) else v) for v in row])


def load_table(results: Sequence[dict], load: float, tiers: Sequence[str]) -> str:
    rows = []
    for r in results:
        if r["load_multiple"] != load:
            continue
        pt = r.get("per_tier", {})
        rows.append([r["policy"], r["goodput_rps"], 100 * r["adherence"],
                     *[100 * pt.get(t, {}).get("adherence", math.nan) for t in tiers],
                     100 * r["rejection_rate"], r["ttft_violations"], r["tpot_violations"], r["incomplete"],
                     r["token_throughput"], r["sched_ms_per_step"], r["sched_pct"]])
    rate = next((r["rate_rps"] for r in results if r["load_multiple"] == load), math.nan)
    heads = ["policy", "goodput rps", "adh %", *[f"{TIER_SHORT.get(t, t)} %" for t in tiers], "rej %",
             "TTFT viol", "TPOT viol", "incompl", "tok/s", "sched ms/step", "sched %"]
    n = next((r["n"] for r in results if r["load_multiple"] == load), 0)
    title = f"load {load:g}x lambda* = {rate:.3f} rps  (n = {n} per policy after warm-up)"
    return f"\n{title}\n" + format_table(heads, rows, digits=2)


def acceptance(results: Sequence[dict], at: float = CHECK_LOAD) -> dict[str, Any]:
    """The §4 checks at the load nearest to `at`×lambda*."""
    loads = sorted({r["load_multiple"] for r in results})
    if not loads:
        return {}
    load = min(loads, key=lambda x: (abs(x - at), -x))
    by = {r["policy"]: r for r in results if r["load_multiple"] == load}
    out: dict[str, Any] = {"load_multiple": load}
    f, s, k = by.get("fcfs"), by.get("scorpio"), by.get("kairos")
    if f and s:
        out["scorpio_over_fcfs_goodput"] = s["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else math.inf
        out["scorpio_minus_fcfs_adherence_pts"] = 100 * (s["adherence"] - f["adherence"])
    if s and k:
        out["kairos_goodput_rps"], out["scorpio_goodput_rps"] = k["goodput_rps"], s["goodput_rps"]
        out["kairos_goodput_ge_scorpio"] = k["goodput_rps"] >= s["goodput_rps"]
        out["kairos_adherence_ge_scorpio"] = k["adherence"] >= s["adherence"]
        out["kairos_minus_scorpio_adherence_pts"] = 100 * (k["adherence"] - s["adherence"])
    if f and k:
        out["kairos_over_fcfs_goodput"] = k["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else math.inf
    if f and by.get("edf_reject"):
        out["ttft_violations_fcfs_vs_edf_reject"] = [f["ttft_violations"], by["edf_reject"]["ttft_violations"]]
    if f and by.get("tpot_guard"):
        out["tpot_violations_fcfs_vs_tpot_guard"] = [f["tpot_violations"], by["tpot_guard"]["tpot_violations"]]
    return out


def format_acceptance(acc: dict[str, Any]) -> str:
    if not acc:
        return ""
    lines = [f"\nAcceptance checks at {acc['load_multiple']:g}x lambda*:"]
    if "scorpio_over_fcfs_goodput" in acc:
        lines.append(f"  scorpio / fcfs goodput        : {acc['scorpio_over_fcfs_goodput']:.2f}x")
        lines.append(f"  scorpio - fcfs adherence      : {acc['scorpio_minus_fcfs_adherence_pts']:+.1f} pts")
    if "kairos_goodput_ge_scorpio" in acc:
        lines.append(f"  kairos >= scorpio (goodput)   : {fmt(acc['kairos_goodput_ge_scorpio'])}"
                     f" ({acc['kairos_goodput_rps']:.3f} vs {acc['scorpio_goodput_rps']:.3f} rps; adherence: "
                     f"{fmt(acc['kairos_adherence_ge_scorpio'])}, "
                     f"{acc['kairos_minus_scorpio_adherence_pts']:+.1f} pts)")
    if "kairos_over_fcfs_goodput" in acc:
        lines.append(f"  kairos / fcfs goodput         : {acc['kairos_over_fcfs_goodput']:.2f}x")
    if "ttft_violations_fcfs_vs_edf_reject" in acc:
        a, b = acc["ttft_violations_fcfs_vs_edf_reject"]
        lines.append(f"  TTFT violations fcfs -> edf_reject : {a} -> {b}")
    if "tpot_violations_fcfs_vs_tpot_guard" in acc:
        a, b = acc["tpot_violations_fcfs_vs_tpot_guard"]
        lines.append(f"  TPOT violations fcfs -> tpot_guard : {a} -> {b}")
    return "\n".join(lines)


def _records_lines(policy: str, load: float, seed: int, run: PointRun, warmup: float) -> list[str]:
    kept = {id(r) for r in M.drop_warmup(run.records, warmup)}
    out = []
    for r in sorted(run.records, key=lambda r: r.arrival_s):
        t = M.tpot_s(r)
        out.append(json.dumps(clean({
            "policy": policy, "load_multiple": load, "seed": seed, "tier": r.tier, "warmup": id(r) not in kept,
            "arrival_s": r.arrival_s - run.started_s, "rejected": r.rejected, "finish_reason": r.finish_reason,
            "reject_reason": r.reject_reason, "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000.0,
            "tpot_ms": None if t is None else t * 1000.0, "n_out": r.n_out, "prompt_len": r.prompt_len,
            "ttft_slo_ms": r.ttft_slo_ms, "tpot_slo_ms": r.tpot_slo_ms, "good": M.is_good(r),
            "end_s": r.end_s - run.started_s, "hops_ms": r.hops or None})))
    return out


def compare(results: Sequence[dict], baseline: Sequence[dict], label: str = "HTTP",
            base_label: str = "in-process") -> str:
    """Side by side, per load present in both: goodput, adherence, rejections, TTFT/TPOT percentiles, and the
    per-request deltas that the HTTP path adds (TTFT p50/p99, TPOT p50 = mean inter-token latency)."""
    def key(r: dict) -> float:
        return round(float(r["load_multiple"]), 6)

    base = {key(r): r for r in baseline}
    rows = []
    for r in results:
        b = base.get(key(r))
        if b is None:
            continue
        for name, x in ((base_label, b), (label, r)):
            rows.append([f"{r['load_multiple']:g}x {name} ({x['policy']})", x["goodput_rps"], 100 * x["adherence"],
                         x["rejected"], x.get("ttft_p50_ms"), x.get("ttft_p99_ms"), x.get("tpot_p50_ms"),
                         x.get("tpot_p99_ms")])
        rows.append([f"{r['load_multiple']:g}x added by {label}", r["goodput_rps"] - b["goodput_rps"],
                     100 * (r["adherence"] - b["adherence"]), r["rejected"] - b["rejected"],
                     *(_diff(r, b, k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"))])
    heads = ["run", "goodput rps", "adh %", "rejected", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
    if not rows:
        return f"(no load in common with the {base_label} run)"
    return f"\n{label} vs {base_label}\n" + format_table(heads, rows, digits=2)


def hops_table(results: Sequence[dict]) -> str:
    """HTTP mode: where each point's time to first token went, hop by hop (from the Server-Timing header)."""
    rows = []
    for r in results:
        hops = r.get("http_hops_ms") or {}
        for hop in HOPS:
            h = hops.get(hop)
            if h:
                rows.append([f"{r['load_multiple']:g}x {r['policy']}", hop, h["n"], h["p50"], h["p90"], h["p99"],
                             h["max"], HOP_NOTES[hop]])
    if not rows:
        return ""
    return "\nTime to first token by hop (ms)\n" + format_table(
        ["point", "hop", "n", "p50", "p90", "p99", "max", "what"], rows, digits=1)


def _diff(a: dict, b: dict, k: str) -> float | None:
    return None if a.get(k) is None or b.get(k) is None else a[k] - b[k]


def protocol_lambda_90(results: Sequence[dict], target: float = 0.90) -> float | None:
    """The protocol's lambda* read off the sweep: the highest swept FCFS rate whose adherence is >= target
    (only a bound: the sweep's grid is coarse). None without FCFS points or when none reaches the target."""
    ok = [r["rate_rps"] for r in results if r["policy"] == "fcfs" and r["adherence"] >= target]
    return max(ok) if ok else None
