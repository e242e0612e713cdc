"""PNG plots for the SLO benchmark (matplotlib, Agg backend).

    python -m bench.plots bench/out/slo/<timestamp>     # (re)draw from results.json + records.jsonl

- goodput_vs_load.png     goodput (req/s) vs load multiple of lambda*, one line per policy
- adherence_vs_load.png   SLO adherence (%) vs load, one line per policy
- tier_adherence.png      per-tier adherence bars at 1.5×lambda* (or the nearest load)
- ttft_cdf.png            TTFT CDF per policy at that load (served requests, warm-up dropped), tier SLOs dashed
- tpot_cdf.png            TPOT CDF per policy at that load, tier SLOs dashed
- cumulative_good.png     cumulative #good requests over time at that load (the paper's trace view)
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CHECK_LOAD = 1.5
_STYLE = {  # fixed colours so every figure agrees
    "fcfs": "#7f7f7f", "pack": "#bcbd22", "edf": "#17becf", "edf_reject": "#1f77b4", "tpot_guard": "#9467bd",
    "scorpio": "#ff7f0e", "kairos": "#d62728",
}


def _color(policy: str, i: int) -> str:
    return _STYLE.get(policy, f"C{i % 10}")


def _policies(results: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["policy"] for r in results))


def nearest_load(results: Sequence[dict], at: float = CHECK_LOAD) -> float | None:
    loads = sorted({r["load_multiple"] for r in results})
    return min(loads, key=lambda x: (abs(x - at), -x)) if loads else None


def _save(fig: Any, path: Path) -> Path:
    """Lay out, write (110 dpi) and close `fig`; return `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _line_plot(results: Sequence[dict], key: str, ylabel: str, title: str, path: Path, scale: float = 1.0,
               lam: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, p in enumerate(_policies(results)):
        pts = sorted((r["load_multiple"], r[key]) for r in results if r["policy"] == p and r.get(key) is not None)
        if pts:
            ax.plot([x for x, _ in pts], [y * scale for _, y in pts], marker="o", label=p, color=_color(p, i),
                    linewidth=2.2 if p in ("kairos", "scorpio") else 1.5)
    ax.set_xlabel("load (multiple of λ*)" + (f", λ* = {lam:.3g} req/s" if lam else ""))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def _tier_bars(results: Sequence[dict], load: float, path: Path) -> Path:
    rows = [r for r in results if r["load_multiple"] == load]
    tiers = list(dict.fromkeys(t for r in rows for t in r.get("per_tier", {})))
    pols = _policies(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(pols))
    for i, p in enumerate(pols):
        r = next(x for x in rows if x["policy"] == p)
        ys = [100 * (r["per_tier"].get(t, {}).get("adherence") or 0.0) for t in tiers]
        xs = [j + (i - (len(pols) - 1) / 2) * width for j in range(len(tiers))]
        ax.bar(xs, ys, width=width, label=p, color=_color(p, i))
    ax.set_xticks(range(len(tiers)), tiers)
    ax.set_ylim(0, 105)
    ax.set_ylabel("SLO adherence (%)")
    ax.set_title(f"Per-tier adherence at {load:g}×λ*")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(4, len(pols)))
    return _save(fig, path)


def _cdf(records: Sequence[dict], load: float, key: str, slo_key: str, xlabel: str, path: Path,
         log: bool = True) -> Path:
    rows = [r for r in records if r["load_multiple"] == load and not r.get("warmup") and not r["rejected"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        xs = sorted(r[key] for r in rows if r["policy"] == p and r.get(key) is not None
                    and (key != "tpot_ms" or r["n_out"] >= 2))
        if xs:
            n_all = sum(1 for r in records if r["load_multiple"] == load and r["policy"] == p and not r.get("warmup"))
            ys = [(j + 1) / n_all for j in range(len(xs))]  # of all requests: rejections keep the curve below 1
            ax.step(xs, ys, where="post", label=f"{p} ({len(xs)}/{n_all})", color=_color(p, i))
    slos: dict[float, list[str]] = {}
    for r in rows:
        names = slos.setdefault(round(r[slo_key], 3), [])
        if r["tier"] not in names:
            names.append(r["tier"])
    for j, (v, names) in enumerate(sorted(slos.items())):
        ax.axvline(v, color="k", linestyle="--", linewidth=0.8, alpha=0.6)
        ax.text(v, 0.02 + 0.06 * j, " " + "+".join(sorted(names)), fontsize=7, alpha=0.8)
    if log:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel + (" (log)" if log else ""))
    ax.set_ylabel("fraction of all requests (rejected: never)")
    ax.set_title(f"{xlabel} CDF at {load:g}×λ* (dashed: tier SLOs)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _cumulative_good(records: Sequence[dict], load: float, path: Path) -> Path:
    rows = [r for r in records if r["load_multiple"] == load]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seed0 = min((r["seed"] for r in rows), default=0)
    for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        ends = sorted(r["end_s"] for r in rows if r["policy"] == p and r["seed"] == seed0 and r["good"])
        if ends:
            ax.step(ends, range(1, len(ends) + 1), where="post", label=p, color=_color(p, i))
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("cumulative #good requests")
    ax.set_title(f"Cumulative good requests at {load:g}×λ* (seed {seed0})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_all(doc: dict[str, Any], out_dir: str | Path, records_path: str | Path | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = doc.get("results", [])
    if not results:
        return []
    lam = doc.get("lambda_star_rps")
    paths = [
        _line_plot(results, "goodput_rps", "goodput (good req/s)", "Goodput vs load", out / "goodput_vs_load.png",
                   lam=lam),
        _line_plot(results, "adherence", "SLO adherence (%)", "SLO adherence vs load", out / "adherence_vs_load.png",
                   scale=100.0, lam=lam),
    ]
    load = nearest_load(results)
    paths.append(_tier_bars(results, load, out / "tier_adherence.png"))
    records = read_records(Path(records_path or out / "records.jsonl"))
    if records:
        paths.append(_cdf(records, load, "ttft_ms", "ttft_slo_ms", "TTFT (ms)", out / "ttft_cdf.png"))
        paths.append(_cdf(records, load, "tpot_ms", "tpot_slo_ms", "TPOT (ms)", out / "tpot_cdf.png", log=False))
        paths.append(_cumulative_good(records, load, out / "cumulative_good.png"))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    d = Path(args[0])
    doc = json.loads((d / "results.json").read_text())
    for p in make_all(doc, d):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
