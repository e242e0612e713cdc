"""Shared helpers for the Kairos benchmarks (`python -m bench.<name>`).

Generic on purpose so that every benchmark reuses them:
- statistics: `percentile`, `summarize`, `best_of`;
- the environment: `cpu_model`, `loadavg`, `run_info` (cpu, loadavg, date, command, versions);
- output: `format_table` / `print_table` (GitHub-flavoured markdown), `write_json`;
- machine limits: `measure_bandwidth_gb_s` (torch sum over a 1 GB fp32 tensor, best of N);
- models: `resolve_bench_model` (embedded names, paths, and the `llama-110m` bench model built on demand),
  `weight_bytes`, `free_memory`.

The box these run on is noisy (other processes share 2 cores), so benchmarks take best-of-N or the
median and log /proc/loadavg next to every section.
"""
from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from engine.default_model import LLAMA_COMMON

# --------------------------------------------------------------------------- statistics


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default "linear" method); q in [0, 100]. NaN if empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"n", "min", "mean", "max", "p50", "p90", "p99"} of `values` (NaN fields when empty)."""
    xs = [float(v) for v in values]
    out: dict[str, float] = {"n": len(xs)}
    out["min"] = min(xs) if xs else math.nan
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    for q in qs:
        out[f"p{q:g}"] = percentile(xs, q)
    return out


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


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, measured with perf_counter."""
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


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


def _cpu_jiffies() -> tuple[float, float] | None:
    """(busy, total) seconds of all CPUs since boot, from the first line of /proc/stat."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    vals = [float(x) for x in parts[1:9]]  # user nice system idle iowait irq softirq steal
    tck = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    total = sum(vals) / tck
    return total - (vals[3] + vals[4]) / tck, total


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class LoadLog:
    """Noise log of a benchmark: per labelled section, /proc/loadavg and how many cores *other* processes used.

    `mark(label)` starts a section (and ends the previous one). "other_cores" of a section is
    (all CPUs' busy time - this process's CPU time) / wall time: ~0 on a quiet box; 1.0 means another
    process kept a whole core busy, and then 2-thread timings are unreliable.
    """

    def __init__(self) -> None:
        self.samples: dict[str, str] = {}
        self.other_cores: dict[str, float] = {}
        self._last: tuple[str, float, tuple[float, float] | None, float] | None = None

    def _close(self) -> None:
        if self._last is None:
            return
        label, t0, jif0, own0 = self._last
        jif1, t1 = _cpu_jiffies(), time.monotonic()
        if jif0 is not None and jif1 is not None and t1 - t0 > 0.05:
            busy = jif1[0] - jif0[0]
            self.other_cores[label] = max(0.0, (busy - (_own_cpu_s() - own0)) / (t1 - t0))
        self._last = None

    def mark(self, label: str) -> str:
        self._close()
        v = loadavg()
        self.samples[label] = v
        self._last = (label, time.monotonic(), _cpu_jiffies(), _own_cpu_s())
        return v

    def busiest(self) -> tuple[str | None, float]:
        if not self.other_cores:
            return None, 0.0
        k = max(self.other_cores, key=self.other_cores.get)
        return k, self.other_cores[k]

    def as_dict(self) -> dict[str, Any]:
        self._close()
        vals = list(self.samples.values())
        label, worst = self.busiest()
        return {"start": vals[0] if vals else loadavg(), "end": loadavg(), "samples": dict(self.samples),
                "other_cores": dict(self.other_cores), "max_other_cores": worst, "max_other_section": label}


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


SSE_DONE = "[DONE]"


def sse_data(line: str) -> Any:
    """One server-sent-events line: its JSON payload, SSE_DONE for `data: [DONE]`, None for any other line."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return SSE_DONE if data == SSE_DONE else json.loads(data)


def parse_server_timing(value: str | None) -> dict[str, float]:
    """`Server-Timing: a;dur=1.5, b;dur=2` -> {"a": 1.5, "b": 2.0} (entries without a duration are skipped)."""
    out: dict[str, float] = {}
    for entry in (value or "").split(","):
        name, *params = [p.strip() for p in entry.split(";")]
        for p in params:
            key, _, val = p.partition("=")
            if name and key.strip() == "dur":
                try:
                    out[name] = float(val.strip().strip('"'))
                except ValueError:
                    pass
    return out


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


# --------------------------------------------------------------------------- machine limits


def measure_bandwidth_gb_s(gb: float = 1.0, reps: int = 5) -> float:
    """DRAM read bandwidth (GB/s, 1e9 bytes): torch sum over a `gb`-GB fp32 tensor, best of `reps`."""
    import torch

    n = int(gb * 1e9) // 4
    x = torch.ones(n, dtype=torch.float32)
    x.sum()  # page in
    best = math.inf
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    nbytes = x.numel() * x.element_size()
    del x
    gc.collect()
    return nbytes / best / 1e9


# --------------------------------------------------------------------------- models

# Llama 768/12/12/2048/32000, tied (baseline.md "llama-110m"): the heavy bench model.
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "llama-110m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        # the shared Llama settings, less model_type (never part of this spec, so the cache hash stays)
        **{k: v for k, v in LLAMA_COMMON.items() if k != "model_type"},
    },
}
BENCH_SEED = 0
_TOKENIZER_SOURCE = "kairos-default"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def bench_model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    from engine.default_model import cache_root, recipe_hash

    spec = {"name": name, "seed": BENCH_SEED, "config": BENCH_MODELS[name],
            "tokenizer_from": f"{_TOKENIZER_SOURCE}-{recipe_hash(_TOKENIZER_SOURCE)}"}
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / "bench" / f"{name}-{h}"


def ensure_bench_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build bench model `name` (random init, seed 0, fp32) once with save_pretrained; return its directory.

    The tokenizer (and generation config: eos = <|endoftext|>, <|im_end|>) is copied from the embedded
    kairos-default checkpoint. Built in a temp dir and published with os.replace (safe against races).
    """
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    target = bench_model_dir(name, cache_dir)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file() \
            and (target / "tokenizer.json").is_file():
        return target
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.default_model import deterministic_cpu_build, ensure_default_model, quiet_progress_bars

    src = ensure_default_model(_TOKENIZER_SOURCE, cache_dir)
    src_cfg = json.loads((src / "config.json").read_text())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        config = LlamaConfig(**BENCH_MODELS[name], bos_token_id=src_cfg.get("bos_token_id", 0),
                             eos_token_id=src_cfg.get("eos_token_id", 0), pad_token_id=src_cfg.get("pad_token_id", 0))
        config.dtype = "float32"
        with deterministic_cpu_build(BENCH_SEED):
            model = LlamaForCausalLM(config)
        model.eval()
        with quiet_progress_bars():
            model.save_pretrained(tmp)
        del model
        for f in _TOKENIZER_FILES:  # overwrites save_pretrained's generation_config.json with the ChatML one
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
        (tmp / "kairos_bench_model.json").write_text(json.dumps(
            {"name": name, "seed": BENCH_SEED, "config": BENCH_MODELS[name], "tokenizer_from": str(src)},
            indent=2, sort_keys=True) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    gc.collect()
    return target


def resolve_bench_model(name: str) -> str:
    """What to hand to `load_model`/`EngineConfig(model=...)`: bench-model names become their built directory;
    embedded names (kairos-default, kairos-tiny), paths and hub ids pass through unchanged."""
    if name in BENCH_MODELS:
        return str(ensure_bench_model(name))
    return name


def resolve_model_path(name: str) -> str:
    """The checkpoint directory (or hub id) for `name`, building embedded / bench models if needed."""
    if name in BENCH_MODELS:
        return str(ensure_bench_model(name))
    from engine.default_model import EMBEDDED_MODELS, ensure_default_model

    if name in EMBEDDED_MODELS:
        return str(ensure_default_model(name))
    p = os.path.expanduser(name)
    return os.path.abspath(p) if os.path.isdir(p) else name


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters (tied weights counted once) — what one decode step must read."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def num_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def free_memory() -> None:
    """Collect garbage and trim the malloc heap, to return memory between phases (drop your references first)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed arenas back to the OS (glibc)
    except (OSError, AttributeError):
        pass


__all__ = [
    "BENCH_MODELS", "LoadLog", "best_of", "bench_model_dir", "clean", "command_line", "cpu_flags", "cpu_model",
    "ensure_bench_model", "format_table", "free_memory", "loadavg", "measure_bandwidth_gb_s", "now_iso",
    "num_params", "percentile", "print_table", "resolve_bench_model", "resolve_model_path", "run_info",
    "summarize", "timed", "weight_bytes", "write_json",
]
