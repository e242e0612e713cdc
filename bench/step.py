"""Small CPU checks behind bench/README.md's "Against vLLM on CPU" section.

    python -m bench.step steps [--model kairos-default] [--dtype bfloat16] [--model-impl auto|kairos|hf]
                               [--cpu-kernels auto,off] [--packed-isa best,avx512_bf16,none] [--compact on,off]
                               [--grid on,off]
    python -m bench.step parts [--model kairos-default] [--dtype bfloat16] [--batches 1,8,32] [--per-op]
    python -m bench.step gemm [--model kairos-default] [--rows 1,8,32,1024] [--against OTHER.cpp ...] [--dtype float32]
                              [--grid]
    python -m bench.step attn [--model kairos-default] [--batches 1,8,32] [--context 96] [--cached] [--dtype float32]
                              [--against OTHER.cpp ...]
    python -m bench.step omp
    python -m bench.step peak [--threads 1,2]
    python -m bench.step prefill [--model kairos-default] [--dtype bfloat16] [--work 1x2048,4x512] [--limits 0,default]
    python -m bench.step contend [--model kairos-default] [--dtype auto] [--threads 1,2] [--team]
                                 [--busy-ms 1 --every-ms 2] [--spinner-nice 0]

`steps`: one raw decode step (forward + sampling, no scheduling) of B contexts of 96 tokens, timed by
`engine.profiling.Prober` inside `LLMEngine.run_idle`, best of 8, at B = 1, 8, 32, and one prefill step of 16
prompts of 64 tokens (one 1024-token budget), best of 4; once per `--cpu-kernels`
setting (Kairos's compiled CPU kernels, `engine/cpu_kernels.py`, against the torch ops they replace), and once per
`--packed-isa` (the packed bf16 GEMM on AMX or on AVX512-BF16, or none: oneDNN's GEMM, and torch's linear for fp32
instead of the packed fp32 GEMM; `CpuKernels.use_packed_isa`, `use_packed_f32`), and once per `--compact` (on: fp32
weights whose values are all bf16 values packed as bf16, `CpuKernels.use_compact_weights`) and `--grid` (on: fp32
weights whose blocks of 32 k lie on a 4- or 8-bit grid, as a de-quantized Q4_1 or Q8_0 GGUF's do, packed as
grid4 / grid8, `CpuKernels.use_grid_weights`).
`parts`: where a decode step's time goes (context 96, mean of 20 after 5 warm-ups): the decoder's matmul calls and
compiled kernels timed by wrapping them; where a decode step runs every layer in one kernel call
(`KairosDecoder.whole_step`), that call's phases as it times them itself ("layers: ...", `CpuKernels.phase_times`),
else (or with `--per-op`) on the per-op path; "other" is the rest of the forward (embedding, views, the Python
between calls), "outside" the step's input preparation and the rest of sampling. On the per-op path the ~7 timer
wrappers a layer add a little to the step against `steps`.
`gemm`: one pass of the model's per-layer linear layers on Kairos's packed bf16 GEMM (`--dtype float32`: the fp32
one; q|k|v, o_proj += h, silu(gate) * up, down += h, every layer; random weights of the model's shapes, so that they
stream from memory as a step's do; `--grid`: fp32 weights on a Q4_1 grid, packed as grid4 as the default model's
layers are; `--cached`: one layer's weights for every layer, so that they come from the
caches), at each row count,
median and best of `--reps` on a fresh thread. With `--against`, each given version of
`engine/cpu_kernels.cpp` (e.g. `git show REV:engine/cpu_kernels.cpp > old.cpp`) is built with the same flags and
timed in turn with this tree's, alternating within every repetition (this box drifts within minutes). With
KAIROS_CPU_ISA=avx2 in front, every build is the one a CPU without AVX-512 runs (`bench.peer --emulate-avx2`).
`attn`: the bf16 (or `--dtype float32`) paged decode attention of every layer for B requests of `--context` tokens, their blocks scattered
over each layer's cache (one cache per layer, so that a pass reads them from memory as a step does; `--cached`: one
layer's cache for every layer, so that it comes from the caches and the arithmetic shows), timed the same way, with
`--against` as for `gemm`.
`omp`: 30 layers of SmolLM2-shaped bf16 GEMVs (packed oneDNN weights, one row), timed on a fresh thread,
then on a fresh thread after the main thread has run one parallel op: libgomp then manages more threads
than cores and wakes its workers by futex instead of spinning (why the engine does all its tensor work on
its worker thread, `LLMEngine._setup`).
`peak`: the arithmetic ceiling the packed GEMM works under: GFLOP/s of AVX-512's bf16 dot product (`vdpbf16ps` on
24 independent accumulators, registers only; `vfmadd231ps` where the CPU lacks AVX512-BF16) on each of `--threads`
OpenMP threads at once, compiled as the kernels are. Set against `gemm --cached`'s rows x 2 x weights / time.
`prefill`: one prefill step of each `--work` item (COUNTxLENGTH: that many prompts of that many random tokens), best
of 2, with prefills of up to each `--limits` entry tokens attending through the paged kernel (`ModelRunner.
paged_prefill_max`; 0: SDPA for every prompt, `default`: what this CPU and dtype get), alternating, twice.
`contend`: a raw decode step (B = 1 and 8, context 96, median of 10) alone, with a Python spinner busy 1 ms in
every 2 (`--busy-ms`, `--every-ms`) as a thread of the engine's process, and with the same spinner in another
process: a thread costs the engine its GIL, a process only cores (why a served engine runs in its own process,
`engine/core_proc.py`).
`--team`: the CPU kernels' loops run on Kairos's thread team instead of OpenMP (`engine.config.TEAM_ENV`, as a
served engine that shares its cores runs them). `--spinner-nice`: the spinner process's nice value; set
`KAIROS_CPU_TEAM_NICE` too to put the team's worker where a served engine's is (Ray's 15).
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import threading
import time

MODULE = "bench.step"


def steps(model: str, dtype: str, impl: str, threads: int, cpu_kernels: str = "auto",
          packed_isa: str = "best", compact: str = "on", grid: str = "on") -> dict[int | str, float]:
    from engine import cpu_kernels as ck
    from engine.engine import LLMEngine
    from engine.profiling import Prober

    if packed_isa != "best" or cpu_kernels != "off":  # set it each time: the choice is the process's
        k = ck.load()
        best = k.packed_isas[-1] if k.packed_isas else None
        k.use_packed_isa({"best": best, "none": None}.get(packed_isa, packed_isa))
        k.use_packed_f32(packed_isa != "none")  # none: torch's linear for fp32 too
        k.use_compact_weights(compact == "on")
        k.use_grid_weights(grid == "on")
    eng = LLMEngine(model=model, dtype=dtype, num_threads=threads, model_impl=impl, max_model_len=1024,
                    kv_cache_memory_gb=0.2, cpu_kernels=cpu_kernels)
    def run(e) -> dict[int | str, float]:
        p = Prober(e)
        out: dict[int | str, float] = {b: min(p.decode_ms([96] * b) for _ in range(8)) for b in (1, 8, 32)}
        rng = random.Random(0)
        prompts = [[rng.randrange(e.bundle.vocab_limit) for _ in range(64)] for _ in range(16)]
        out["prefill 16x64"] = min(p.prefill_ms(prompts) for _ in range(4))
        return out

    try:
        return eng.run_idle(run, timeout=600)
    finally:
        eng.shutdown()


_PARTS = {"matmuls": ("linear", "residual", "mlp"),
          "kernels": ("rms_norm", "rope_write", "decode_attn", "argmax_rows")}


def parts(model: str, dtype: str, batches: list[int], threads: int,
          per_op: bool = False) -> dict[int, dict[str, float]]:
    """Mean ms per decode step spent in each matmul call kind and compiled kernel, plus the step; where the step
    runs its layers in one kernel call (and not `per_op`), that call's own phase times ("layers: ...")."""
    from collections import defaultdict

    from engine.engine import LLMEngine
    from engine.profiling import Prober

    acc: dict[str, float] = defaultdict(float)
    depth = [0]  # a timed call inside another (TorchMatmuls.mlp calls its linear) counts once, in the outer

    def timed(name, fn, whole=False):  # whole: times everything inside, whatever else is timed there
        def wrapper(*a, **kw):
            if whole:
                t = time.perf_counter()
                out = fn(*a, **kw)
                acc[name] += time.perf_counter() - t
                return out
            if depth[0]:
                return fn(*a, **kw)
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += time.perf_counter() - t
                depth[0] -= 1
        return wrapper

    eng = LLMEngine(model=model, dtype=dtype, num_threads=threads, max_model_len=1024, kv_cache_memory_gb=0.2)
    try:
        dec, kernels = eng.runner.decoder, eng.runner.kernels
        if dec is None:
            raise SystemExit(f"{model} runs on the HF modules' forward: nothing to break down")
        if not per_op and dec.whole_step and kernels is not None:
            phases = kernels  # decode_layers times its own phases (`CpuKernels.phase_times`)
        else:
            phases = None
            dec.whole_step = False  # the per-op path, whose calls can be timed one by one
        for name in _PARTS["matmuls"]:  # instance attributes shadow the backend's methods for this engine only
            setattr(dec.mm, name, timed(name, getattr(dec.mm, name)))
        if kernels is not None:
            for name in _PARTS["kernels"]:
                setattr(kernels, name, timed(name, getattr(kernels, name)))
            dec.norm_fn = kernels.rms_norm
            eng.sampler.argmax = kernels.argmax_rows
        fwd = eng.runner.forward
        eng.runner.forward = timed("forward", fwd, whole=True)

        def run(e) -> dict[int, dict[str, float]]:
            out = {}
            p = Prober(e)
            for b in batches:
                for _ in range(5):
                    p.decode_ms([96] * b)
                acc.clear()
                if phases is not None:
                    phases.phase_times(on=True)
                step = sum(p.decode_ms([96] * b) for _ in range(20)) / 20
                row = {k: v / 20 * 1000.0 for k, v in acc.items()}
                if phases is not None:
                    row.update({f"layers: {k}": v / 20 for k, v in phases.phase_times(on=False).items()})
                forward = row.pop("forward")
                row["other"] = forward - sum(v for k, v in row.items() if k != "argmax_rows")
                row["outside"] = step - forward - row.get("argmax_rows", 0.0)  # input preparation, the rest of sampling
                row["step"] = step
                out[b] = row
            return out
        return eng.run_idle(run, timeout=600)
    finally:
        if kernels is not None:  # the loaded kernels are shared by every engine of this process
            for name in _PARTS["kernels"]:
                kernels.__dict__.pop(name, None)
        eng.shutdown()


def _builds(against: list[str]) -> dict:
    """This tree's kernels and each other version of cpu_kernels.cpp, built with the same flags."""
    from pathlib import Path

    from engine import cpu_kernels as ck

    return {"this tree": ck.load()} | {src: ck.load_source(Path(src), ck.isa_flags()) for src in against}


def _alternating(builds: dict, sizes: list[int], reps: int, threads: int, setup,
                 one_pass) -> dict[str, dict[int, tuple]]:
    """(median, best) ms of `one_pass(kernels, inputs)` per build and size, `inputs = setup(size)`, the builds taking
    turns within every repetition, after one warm-up pass each; on a fresh thread (the engine's OpenMP pool rule)."""
    import statistics

    import torch

    def run() -> dict[str, dict[int, tuple]]:
        torch.set_num_threads(threads)
        out: dict[str, dict[int, tuple]] = {name: {} for name in builds}
        for size in sizes:
            inputs = setup(size)
            times: dict[str, list[float]] = {name: [] for name in builds}
            for k in builds.values():
                one_pass(k, inputs)
            for _ in range(reps):
                for name, k in builds.items():
                    t = time.perf_counter()
                    one_pass(k, inputs)
                    times[name].append((time.perf_counter() - t) * 1000.0)
            for name, ts in times.items():
                out[name][size] = (statistics.median(ts), min(ts))
        return out
    return _on_fresh_thread(run)


def _model_config(model: str):
    from transformers import AutoConfig

    from bench.driver import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(model))
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg, hd


def gemm(model: str, rows: list[int], against: list[str], reps: int, threads: int,
         cached: bool = False, dtype: str = "bfloat16", grid: bool = False) -> dict[str, dict[int, tuple]]:
    import torch

    from engine.cpu_kernels import CpuKernels
    from engine.testing import q4_1_round_trip

    dt = getattr(torch, dtype)
    cfg, hd = _model_config(model)
    d, inter = cfg.hidden_size, cfg.intermediate_size
    wq, wo = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, cfg.num_attention_heads * hd
    builds = _builds(against)
    if any(not k.packed_linear_supported(dt, d, inter) for k in builds.values()):
        raise SystemExit(f"no packed {dtype} GEMM here (bf16 needs AMX or AVX512-BF16, fp32 AVX2 FMAs)")
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dt)
    if grid:  # every weight on a Q4_1 GGUF's grid, packed as grid4 as the engine packs the default model's layers
        if dt != torch.float32:
            raise SystemExit("--grid packs fp32 weights: add --dtype float32")
        packer = next(iter(builds.values()))

        def pack(w: torch.Tensor):
            return packer.pack_exact(q4_1_round_trip(w))

        def pack_gated(gate: torch.Tensor, up: torch.Tensor):
            return packer.pack_exact_gated(q4_1_round_trip(gate), q4_1_round_trip(up))
    else:
        pack, pack_gated = CpuKernels.pack_weight, CpuKernels.pack_gated
    layers = [(pack(rand(wq, d)), pack(rand(d, wo)), pack_gated(rand(inter, d), rand(inter, d)),
               pack(rand(d, inter))) for _ in range(1 if cached else cfg.num_hidden_layers)]
    layers *= cfg.num_hidden_layers // len(layers)  # --cached: one layer's weights every time, from the caches

    def one_pass(k: CpuKernels, inputs: tuple) -> None:
        x, a, o, h = inputs
        for qkv, o_proj, gate_up, down in layers:  # the inputs' values do not change the time
            k.linear(x, qkv)
            k.linear(o, o_proj, residual=h)
            k.linear(x, gate_up)
            k.linear(a, down, residual=h)
    return _alternating(builds, rows, reps, threads, lambda m: (rand(m, d), rand(m, inter), rand(m, wo), rand(m, d)),
                        one_pass)


def attn(model: str, batches: list[int], context: int, against: list[str], reps: int,
         threads: int, cached: bool = False, dtype: str = "bfloat16") -> dict[str, dict[int, tuple]]:
    import torch

    from engine.cpu_kernels import CpuKernels

    dt = getattr(torch, dtype)
    cfg, hd = _model_config(model)
    nh, nkv, nl, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers, 16
    width = -(-context // bs)
    g = torch.Generator().manual_seed(0)

    def setup(b: int) -> tuple:
        blocks = b * width + 1
        caches = [tuple(torch.randn(blocks, bs, nkv, hd, generator=g).to(dt) for _ in range(2))
                  for _ in range(1 if cached else nl)]  # every layer's: the step reads them all from memory
        caches *= nl // len(caches)  # --cached: one layer's cache every time, from the caches
        tables = torch.randperm(blocks - 1, generator=g)[:b * width].view(b, width).to(torch.int32)  # scattered
        return caches, tables, torch.full((b,), context, dtype=torch.int32), torch.randn(b, nh, hd).to(dt)

    def one_pass(k: CpuKernels, inputs: tuple) -> None:
        caches, tables, lens, q = inputs
        for kc, vc in caches:
            k.decode_attn(q, kc, vc, tables, lens, hd ** -0.5)
    return _alternating(_builds(against), batches, reps, threads, setup, one_pass)


def _gemv_stack_ms() -> float:
    import torch

    torch.set_num_threads(2)
    pack, lin = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    shapes = [(576, 960), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30  # (in, out) per layer
    ws = [pack(torch.randn(n, k).bfloat16()) for k, n in shapes]
    xs = {k: torch.randn(1, k).bfloat16() for k in (576, 1536)}

    def run() -> None:
        for (k, _), w in zip(shapes, ws):
            lin(xs[k], w, None, "none", [], "")
    for _ in range(2):
        run()
    t = time.perf_counter()
    for _ in range(5):
        run()
    return (time.perf_counter() - t) / 5 * 1000.0


def _report(lines: list[str], summary: str | None, argv: list[str] | None) -> None:
    """Print each build's line; with a summary name, keep them as that summary (headline: the lines joined)."""
    for line in lines:
        print(line)
    if summary:
        from bench.report import command_line, write_summary  # noqa: PLC0415

        print(write_summary(summary, command_line("bench.step", argv), "; ".join(lines), {"lines": lines}))


def _on_fresh_thread(fn):
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


def omp() -> tuple[float, float]:
    import torch

    alone = _on_fresh_thread(_gemv_stack_ms)
    torch.randn(1 << 20).sum()  # one parallel op here starts this thread's OpenMP pool
    return alone, _on_fresh_thread(_gemv_stack_ms)


_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
    const int threads = std::atoi(argv[1]);
    const long iters = 20000000;
    double gflops = 0;
#pragma omp parallel num_threads(threads) reduction(+ : gflops)
    {
#if defined(__AVX512BF16__)
        __m512 a[24];
        for (int j = 0; j < 24; ++j) a[j] = _mm512_setzero_ps();
        __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
        const double per = 24.0 * 16 * 2 * 2;  // 16 lanes x 2 products, a multiply and an add each
#define STEP(j) a[j] = _mm512_dpbf16_ps(a[j], x, x)
#elif defined(__AVX2__)
        __m256 a[12];
        for (int j = 0; j < 12; ++j) a[j] = _mm256_setzero_ps();
        __m256 x = _mm256_set1_ps(1e-9f);
        const double per = 12.0 * 8 * 2;
#define STEP(j) a[j] = _mm256_fmadd_ps(x, x, a[j])
#endif
        const int n = sizeof(a) / sizeof(a[0]);
        const auto t = std::chrono::steady_clock::now();
        for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 24
            for (int j = 0; j < n; ++j) STEP(j);
            __asm__ volatile("" : "+v"(x));
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        float sink = 0;
        for (int j = 0; j < n; ++j) sink += ((float*)&a[j])[0];
        if (sink == 42.f) std::puts("");
        gflops += iters * per / s / 1e9;
    }
#if defined(__AVX512BF16__)
    std::printf("vdpbf16ps %.1f\n", gflops);
#else
    std::printf("vfmadd231ps-ymm %.1f\n", gflops);
#endif
}
"""


def peak(threads: list[int]) -> dict[int, tuple[str, float]]:
    """{threads: (instruction, GFLOP/s over all of them)}: the CPU's multiply-add ceiling, built as the kernels are."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise SystemExit("peak: no C++ compiler")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(_PEAK_SOURCE)
        subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        out = {}
        for n in threads:
            name, value = subprocess.run([str(exe), str(n)], check=True, capture_output=True,
                                         text=True).stdout.split()
            out[n] = (name, float(value))
        return out


def prefill_paths(model: str, dtype: str, threads: int, work: list[tuple[int, int]],
                  limits: list[str]) -> dict[tuple[int, int], dict[str, float]]:
    """{(count, length): {limit: ms}}: the best of 2 x 2 alternating rounds of one prefill step."""
    from engine.engine import LLMEngine
    from engine.profiling import Prober

    longest = max(n for _, n in work)
    eng = LLMEngine(model=model, dtype=dtype, num_threads=threads, max_model_len=max(1024, longest + 1))
    default = eng.runner.paged_prefill_max
    values = {x: default if x == "default" else int(x) for x in limits}

    def run(e) -> dict[tuple[int, int], dict[str, float]]:
        p = Prober(e)
        out: dict[tuple[int, int], dict[str, float]] = {}
        for cnt, n in work:
            ids = [[p.rng.randrange(100, e.bundle.vocab_limit) for _ in range(n)] for _ in range(cnt)]
            best = {x: float("inf") for x in limits}
            for _ in range(2):
                for x in limits:
                    e.runner.paged_prefill_max = values[x]
                    p.prefill_ms(ids)
                    best[x] = min(best[x], *(p.prefill_ms(ids) for _ in range(2)))
            out[(cnt, n)] = best
        e.runner.paged_prefill_max = default
        return out
    try:
        return eng.run_idle(run, timeout=3600)
    finally:
        eng.shutdown()


def _spin(stop, duty_s: float = 0.001, period_s: float = 0.002, nice: int = 0) -> None:
    """Busy `duty_s` in every `period_s` until `stop` is set (a stand-in for a server's per-token Python), at
    `nice` (a process; a thread shares its process's)."""
    if nice:
        os.nice(nice)
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < duty_s:
            pass
        time.sleep(period_s - duty_s)


def contend(model: str, dtype: str, threads: int, busy_s: float = 0.001, every_s: float = 0.002,
            nice: int = 0) -> dict[str, dict[int, float]]:
    import multiprocessing as mp
    import statistics

    from engine.engine import LLMEngine
    from engine.profiling import Prober

    eng = LLMEngine(model=model, dtype=dtype, num_threads=threads, max_model_len=1024, kv_cache_memory_gb=0.2)

    def measure() -> dict[int, float]:
        return eng.run_idle(lambda e: {b: statistics.median(Prober(e).decode_ms([96] * b) for _ in range(10))
                                       for b in (1, 8)})
    try:
        out = {"alone": measure()}
        stop = threading.Event()
        th = threading.Thread(target=_spin, args=(stop, busy_s, every_s), daemon=True)
        th.start()
        out["spinner thread"] = measure()
        stop.set()
        th.join()
        ctx = mp.get_context("spawn")
        pstop = ctx.Event()
        proc = ctx.Process(target=_spin, args=(pstop, busy_s, every_s, nice), daemon=True)
        proc.start()
        time.sleep(1.0)  # the child's interpreter start is not part of the measurement
        out["spinner process"] = measure()
        pstop.set()
        proc.join()
        return out
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("steps")
    s.add_argument("--model", default="kairos-default")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--model-impl", default="auto", choices=("auto", "kairos", "hf"))
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--cpu-kernels", default="auto", help="comma list of EngineConfig.cpu_kernels settings")
    s.add_argument("--packed-isa", default="best", help="comma list: best, amx, avx512_bf16, avx2_fma, none "
                   "(oneDNN; fp32: torch's linear)")
    s.add_argument("--compact", default="on", help="comma list: on, off (fp32 weights with bf16 values packed as bf16)")
    s.add_argument("--grid", default="on",
                   help="comma list: on, off (fp32 weights on a 4- or 8-bit grid packed as such)")
    pp = sub.add_parser("parts")
    pp.add_argument("--model", default="kairos-default")
    pp.add_argument("--dtype", default="bfloat16")
    pp.add_argument("--batches", default="1,8,32")
    pp.add_argument("--threads", type=int, default=2)
    pp.add_argument("--per-op", action="store_true", help="time the per-op path even where a step is one call")
    gm = sub.add_parser("gemm")
    gm.add_argument("--model", default="kairos-default")
    gm.add_argument("--rows", default="1,8,32,1024")
    gm.add_argument("--against", action="append", default=[], help="another version of engine/cpu_kernels.cpp")
    gm.add_argument("--reps", type=int, default=15)
    gm.add_argument("--threads", type=int, default=2)
    gm.add_argument("--cached", action="store_true", help="one layer's weights for every layer (they stay cached)")
    gm.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    gm.add_argument("--grid", action="store_true", help="float32 weights on a Q4_1 grid, packed as grid4")
    gm.add_argument("--summary", help="also keep the figures as bench/summaries/NAME.json")
    at = sub.add_parser("attn")
    at.add_argument("--model", default="kairos-default")
    at.add_argument("--batches", default="1,8,32")
    at.add_argument("--context", type=int, default=96)
    at.add_argument("--against", action="append", default=[], help="another version of engine/cpu_kernels.cpp")
    at.add_argument("--reps", type=int, default=15)
    at.add_argument("--threads", type=int, default=2)
    at.add_argument("--cached", action="store_true", help="one layer's cache for every layer (it stays cached)")
    at.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    at.add_argument("--summary", help="also keep the figures as bench/summaries/NAME.json")
    sub.add_parser("omp")
    pf = sub.add_parser("prefill")
    pf.add_argument("--model", default="kairos-default")
    pf.add_argument("--dtype", default="bfloat16")
    pf.add_argument("--threads", type=int, default=2)
    pf.add_argument("--work", default="1x4096,1x2048,2x1024,4x512,8x300", help="COUNTxLENGTH list")
    pf.add_argument("--limits", default="0,default", help="paged-prefill limits to compare (0: SDPA only; "
                    "default: this CPU's and dtype's)")
    pk = sub.add_parser("peak")
    pk.add_argument("--threads", default="1,2", help="comma list of thread counts")
    c = sub.add_parser("contend")
    c.add_argument("--model", default="kairos-default")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--threads", default="1,2", help="comma-separated engine thread counts")
    c.add_argument("--team", action="store_true", help="the CPU kernels' loops on Kairos's thread team")
    c.add_argument("--busy-ms", type=float, default=1.0, help="the spinner is busy this long...")
    c.add_argument("--every-ms", type=float, default=2.0, help="...in every this long")
    c.add_argument("--spinner-nice", type=int, default=0, help="the spinner process's nice value (Ray's workers: 15)")
    args = ap.parse_args(argv)
    if args.cmd == "contend" and not 0 < args.busy_ms < args.every_ms:
        ap.error("contend: --busy-ms must be above 0 and below --every-ms")
    if getattr(args, "team", False):  # before torch loads: its OpenMP reads the wait policy once
        from engine.config import TEAM_ENV  # noqa: PLC0415

        os.environ[TEAM_ENV] = "1"
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if args.cmd == "steps":
        for setting in args.cpu_kernels.split(","):
            for isa in args.packed_isa.split(","):
                for compact, grid in itertools.product(args.compact.split(","), args.grid.split(",")):
                    ms = steps(args.model, args.dtype, args.model_impl, args.threads, setting, isa, compact, grid)
                    prefill = ms.pop("prefill 16x64")
                    print(f"{args.model} {args.dtype} impl={args.model_impl} cpu_kernels={setting} packed_isa={isa} "
                          f"compact={compact} grid={grid}: decode step ms (context 96) "
                          + ", ".join(f"B={b} {v:.2f}" for b, v in ms.items())
                          + f"; prefill of 16 prompts x 64 tokens {prefill:.1f} ms")
    elif args.cmd == "parts":
        for b, row in parts(args.model, args.dtype, [int(x) for x in args.batches.split(",")], args.threads,
                            args.per_op).items():
            print(f"B={b}: step {row.pop('step'):.2f} ms = " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    elif args.cmd == "gemm":
        lines = [f"{name}: one pass of the per-layer {args.dtype}{' grid4' if args.grid else ''} GEMMs, ms (median / "
                 f"best of {args.reps}): " + ", ".join(f"{m} rows {med:.2f} / {best:.2f}"
                                                       for m, (med, best) in by_rows.items())
                 for name, by_rows in gemm(args.model, [int(x) for x in args.rows.split(",")], args.against,
                                           args.reps, args.threads, args.cached, args.dtype, args.grid).items()]
        _report(lines, args.summary, argv)
    elif args.cmd == "attn":
        lines = [f"{name}: {args.dtype} decode attention of every layer{' (cached)' if args.cached else ''}, context "
                 f"{args.context}, ms (median / best of {args.reps}): "
                 + ", ".join(f"B={b} {med:.2f} / {best:.2f}" for b, (med, best) in by_b.items())
                 for name, by_b in attn(args.model, [int(x) for x in args.batches.split(",")], args.context,
                                        args.against, args.reps, args.threads, args.cached, args.dtype).items()]
        _report(lines, args.summary, argv)
    elif args.cmd == "contend":
        for n in (int(x) for x in args.threads.split(",")):
            for name, ms in contend(args.model, args.dtype, n, args.busy_ms / 1000.0, args.every_ms / 1000.0,
                                    args.spinner_nice).items():
                print(f"{n} engine thread(s), {name}: decode step ms " + ", ".join(f"B={b} {v:.1f}" for b, v in ms.items()))
    elif args.cmd == "prefill":
        limits = [x.strip() for x in args.limits.split(",")]
        work = [tuple(int(v) for v in w.split("x")) for w in args.work.split(",")]
        for (cnt, n), ms in prefill_paths(args.model, args.dtype, args.threads, work, limits).items():
            print(f"{args.model} {args.dtype} {cnt} x {n} tokens: prefill step ms "
                  + ", ".join(f"limit {x} {v:.1f}" for x, v in ms.items())
                  + (f" ({ms[limits[0]] / ms[limits[-1]]:.2f}x)" if len(limits) == 2 else ""))
    elif args.cmd == "peak":
        for n, (name, gflops) in peak([int(x) for x in args.threads.split(",")]).items():
            print(f"{n} thread(s): {name} {gflops:.1f} GFLOP/s ({gflops / n:.1f} a thread)")
    else:
        alone, after = omp()
        print(f"30 layers of bf16 GEMVs: {alone:.2f} ms on a fresh thread; {after:.2f} ms on a fresh thread after "
              "the main thread ran one parallel op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
