"""Engine benchmark: Kairos `LLMEngine` vs HF transformers on the same model, same process, same run.

    python -m bench.engine                                   # kairos-default, bfloat16, 2 threads
    python -m bench.engine --dtype float32 --json /tmp/e.json
    python -m bench.engine --llama-110m --dtype float32      # (= --model llama-110m) heavy bench model
    python -m bench.engine --model kairos-tiny --dtype float32 --quick

Figures (all greedy, EOS ignored, random prompt ids < vocab_limit, seeded):
- decode tok/s and ms/step at batch 1/8/16/32, prompt 64, 64 new tokens. Engine: B requests submitted
  at once through `add_request`; decode-only throughput = tokens produced after the step in which the
  last request got its first token, up to the step in which the last one finished, over that time
  (per-request `metrics.token_times`). HF: `generate` (sdpa) on the batch, min_new_tokens =
  max_new_tokens = 64, minus a prefill-only (`max_new_tokens=1`) run, as baseline.md section 3.
  Beside them: the memory-bandwidth bound B / (weight bytes / GB/s), GB/s from a torch sum over 1 GB fp32.
- prefill tok/s for 1x512 and 8x128. Engine: `runner.execute` + sampling on throwaway requests over the
  real paged cache (as engine.profiling._Prober). HF: one forward with `logits_to_keep=1` (+ argmax).
- mixed workload: 64 requests, prompt lengths U[16, 512], output lengths U[16, 256], all at t=0. Engine:
  wall from the first submit to the last finish. HF: `generate` in static left-padded batches of 32, each
  running to its longest output; only each request's own requested tokens count as useful output.
- engine per-step overhead at batch 32: schedule + input preparation + sample + postprocess, as % of the
  decode step time (phases from `LLMEngine.stats().phase_s`, `runner.prepare` timed separately).

Best-of-N everywhere (the box is noisy); /proc/loadavg is logged per section.
The HF baseline lives in `bench/engine_hf.py`, the JSON document and printed tables in `bench/engine_report.py`.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import LoadLog, best_of, measure_bandwidth_gb_s, run_info, summarize, write_json  # noqa: E402
from bench.models import free_memory, num_params, resolve_bench_model, weight_bytes  # noqa: E402
from bench.engine_hf import run_hf  # noqa: E402
from bench.engine_report import build_report, print_report  # noqa: E402

MODULE = "bench.engine"


@dataclass
class Plan:
    """Sizes and repetitions of one run (`--quick` shrinks them)."""

    batches: tuple[int, ...] = (1, 8, 16, 32)
    prompt_len: int = 64
    new_tokens: int = 64
    decode_reps: int = 3
    prefill_shapes: tuple[tuple[int, int], ...] = ((1, 512), (8, 128))
    prefill_reps: int = 5
    mixed_requests: int = 64
    mixed_prompt: tuple[int, int] = (16, 512)
    mixed_output: tuple[int, int] = (16, 256)
    mixed_hf_batch: int = 32
    mixed_reps: int = 1
    bw_gb: float = 1.0
    bw_reps: int = 5
    prepare_reps: int = 50
    rep_budget_s: float | None = 20.0  # per configuration: stop repeating (after min_reps) once this is spent
    min_reps: int = 2
    seed: int = 0

    @classmethod
    def quick(cls) -> "Plan":
        return cls(batches=(1, 8, 32), prompt_len=32, new_tokens=16, decode_reps=1, prefill_reps=2,
                   mixed_requests=16, mixed_prompt=(16, 128), mixed_output=(8, 32), mixed_hf_batch=8,
                   mixed_reps=1, bw_gb=1.0, bw_reps=2, prepare_reps=10, rep_budget_s=None, min_reps=1)


@dataclass
class Workloads:
    """Token ids shared by the engine and HF (the same prompts for both)."""

    decode: dict[int, list[list[int]]] = field(default_factory=dict)
    prefill: dict[str, list[list[int]]] = field(default_factory=dict)
    mixed_prompts: list[list[int]] = field(default_factory=list)
    mixed_outputs: list[int] = field(default_factory=list)


def make_workloads(plan: Plan, vocab_limit: int) -> Workloads:
    w = Workloads()
    for b in plan.batches:
        rng = random.Random(plan.seed * 1_000_003 + 1000 + b)
        w.decode[b] = [[rng.randrange(vocab_limit) for _ in range(plan.prompt_len)] for _ in range(b)]
    for n, length in plan.prefill_shapes:
        rng = random.Random(plan.seed * 1_000_003 + 2000 + n * 10_000 + length)
        w.prefill[f"{n}x{length}"] = [[rng.randrange(vocab_limit) for _ in range(length)] for _ in range(n)]
    rng = random.Random(plan.seed * 1_000_003 + 3000)
    for _ in range(plan.mixed_requests):
        p = rng.randint(*plan.mixed_prompt)
        w.mixed_prompts.append([rng.randrange(vocab_limit) for _ in range(p)])
        w.mixed_outputs.append(rng.randint(*plan.mixed_output))
    return w


# =========================================================================== engine side


def _final(eng, stream, timeout: float = 1800.0):
    """The stream's last output; raises if the engine's worker dies or nothing finishes within `timeout`."""
    deadline = time.monotonic() + timeout
    out = None
    while out is None or not out.finished:
        try:
            out = stream.get(timeout=1.0)
        except TimeoutError:
            if not eng.is_alive():
                raise RuntimeError(f"engine worker died: {getattr(eng, '_dead', None)!r}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {stream.request_id} did not finish within {timeout:.0f} s") from None
    return out


def _submit_and_wait(eng, prompts: list[list[int]], max_tokens: list[int], tag: str) -> tuple[float, list]:
    """Submit every prompt at (nearly) the same instant; return (t0 monotonic, final outputs in order)."""
    from engine.sampling import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # keep the GIL while enqueueing, so the worker sees the whole batch at once
    try:
        t0 = time.monotonic()
        streams = [eng.add_request(p, sp, request_id=f"{tag}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    finally:
        sys.setswitchinterval(old)
    finals = [_final(eng, s) for s in streams]
    for f, m in zip(finals, max_tokens):
        if f.finish_reason != "length" or f.num_output_tokens != m:
            raise RuntimeError(f"request {f.request_id} ended {f.finish_reason!r} after {f.num_output_tokens}/{m} "
                               f"tokens (reject={f.reject_reason!r}, error={f.error!r})")
    return t0, finals


def _wait_idle(eng, timeout: float = 30.0):
    """The worker publishes stats at the end of each step: wait until it shows nothing in flight."""
    deadline = time.monotonic() + timeout
    while True:
        s = eng.stats()
        if (s.num_running == 0 and s.num_waiting == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.001)


def _decode_figures(finals) -> dict[str, Any]:
    tts = [f.metrics.token_times for f in finals]
    t_start = max(t[0] for t in tts)  # the step in which the last request got its first token
    t_end = max(t[-1] for t in tts)  # the step in which the last request finished
    window = [x for t in tts for x in t if t_start < x <= t_end]
    dt = t_end - t_start
    steps = len(set(window))  # every token of one step carries the same timestamp
    return {
        "tok_s": len(window) / dt if dt > 0 else float("nan"),
        "ms_step": dt / steps * 1000.0 if steps else float("nan"),
        "tokens": len(window),
        "steps": steps,
        "seconds": dt,
        "prefill_aligned": len({t[0] for t in tts}) == 1,  # all B prefilled in one step
    }


def _throwaway(n_tokens: int, rng: random.Random, vocab: int, rid: str):
    from engine.request import Request
    from engine.sampling import SamplingParams

    ids = [rng.randrange(vocab) for _ in range(n_tokens)]
    return Request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))


def engine_prefill(eng, prompts: list[list[int]], reps: int, budget_s: float | None = None,
                   min_reps: int = 1) -> dict[str, Any]:
    """Time `runner.execute` + sampling of one prefill step over throwaway requests (worker idle)."""
    from engine.request import Request
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [Request(f"bench-prefill-{i}", list(p), params) for i, p in enumerate(prompts)]
    try:
        for r in reqs:
            eng.blocks.ensure(r, r.num_tokens)

        def once() -> float:
            t0 = time.perf_counter()
            logits = eng.runner.execute(reqs, [])
            eng.sampler.sample(logits, reqs)
            return time.perf_counter() - t0

        best, all_ = best_of(once, reps, warmup=1, budget_s=budget_s, min_reps=min_reps)
    finally:
        for r in reqs:
            eng.blocks.free(r)
    tokens = sum(len(p) for p in prompts)
    return {"tok_s": tokens / best, "ms": best * 1000.0, "all_ms": [x * 1000.0 for x in all_]}


def engine_prepare_ms(eng, batch: int, ctx: int, reps: int) -> float:
    """Best-of time of `runner.prepare` for a decode step of `batch` requests at context `ctx`."""
    rng = random.Random(7)
    vocab = eng.bundle.vocab_limit
    reqs = [_throwaway(ctx, rng, vocab, f"bench-prep-{i}") for i in range(batch)]
    try:
        for r in reqs:
            eng.blocks.ensure(r, ctx)
            r.num_computed_tokens = ctx - 1

        def once() -> float:
            t0 = time.perf_counter()
            eng.runner.prepare([], reqs)
            return time.perf_counter() - t0

        best, _ = best_of(once, reps, warmup=2)
    finally:
        for r in reqs:
            eng.blocks.free(r)
    return best * 1000.0


def run_engine(model: str, args, plan: Plan, loads: LoadLog, log) -> dict[str, Any]:
    import torch

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    extra: dict[str, Any] = {}
    if args.kv_cache_gb:
        extra["kv_cache_memory_gb"] = args.kv_cache_gb
    cfg = EngineConfig(model=model, dtype=args.dtype, device="cpu", num_threads=args.threads,
                       scheduler=SchedulerConfig(policy="fcfs", max_num_seqs=64, prefill_max_tokens=4096), **extra)
    log(f"engine: loading {model} ({args.dtype}) and its latency profile "
        "(the first start fits it: ~15 s; cached after) ...")
    t0 = time.perf_counter()
    eng = LLMEngine(cfg)
    startup = time.perf_counter() - t0
    prof = dict(eng.profile_report or {})
    log(f"engine: started in {startup:.1f} s; latency profile "
        + ("cached" if prof.get("cached") else f"fitted in {prof.get('seconds', float('nan')):.1f} s")
        + (f" (holdout MAPE {prof['mape_holdout']:.3f})" if isinstance(prof.get("mape_holdout"), float) else ""))
    res: dict[str, Any] = {"startup_s": startup, "profile": prof}
    try:
        b = eng.bundle
        res.update(vocab_limit=b.vocab_limit, weight_bytes=weight_bytes(b.model), params=num_params(b.model),
                   model_path=b.path, torch_dtype=str(b.dtype).removeprefix("torch."),
                   kv_cache={"blocks": eng.cache.num_blocks, "block_size": eng.blocks.block_size,
                             "dtype": str(eng.cache.dtype).removeprefix("torch."),
                             "tokens": eng.cache.num_blocks * eng.blocks.block_size},
                   threads=torch.get_num_threads(), upcast_linears=getattr(eng, "upcast_linears", None))
        w = make_workloads(plan, b.vocab_limit)
        res["workloads"] = w

        # warm-up: one small round through the whole loop at the largest batch
        bmax = max(plan.batches)
        _submit_and_wait(eng, w.decode[bmax], [min(4, plan.new_tokens)] * bmax, "warm")
        _wait_idle(eng)

        # ---- decode
        loads.mark("engine_decode")
        decode: dict[int, dict[str, Any]] = {}
        phase_b = bmax
        for bsz in plan.batches:
            reps = []
            t_cfg = time.perf_counter()
            for rep in range(plan.decode_reps):
                if (rep >= plan.min_reps and plan.rep_budget_s is not None
                        and time.perf_counter() - t_cfg > plan.rep_budget_s):
                    break
                before = _wait_idle(eng)
                _, finals = _submit_and_wait(eng, w.decode[bsz], [plan.new_tokens] * bsz, f"dec{bsz}-{rep}")
                after = _wait_idle(eng)
                fig = _decode_figures(finals)
                fig["phase_delta_s"] = {k: after.phase_s.get(k, 0.0) - before.phase_s.get(k, 0.0)
                                        for k in after.phase_s}
                fig["step_delta"] = after.steps - before.steps
                reps.append(fig)
            best = max(reps, key=lambda f: f["tok_s"])
            best["all_tok_s"] = [f["tok_s"] for f in reps]
            decode[bsz] = best
            log(f"engine decode B={bsz}: {best['tok_s']:.1f} tok/s, {best['ms_step']:.2f} ms/step "
                f"(reps {', '.join(f'{x:.0f}' for x in best['all_tok_s'])})")
        res["decode"] = decode

        # ---- per-step overhead at the largest batch (32 by default)
        d = decode[phase_b]
        n = max(1, d["step_delta"])
        per_step = {k: v / n * 1000.0 for k, v in d["phase_delta_s"].items()}
        prep = engine_prepare_ms(eng, phase_b, plan.prompt_len + plan.new_tokens // 2, plan.prepare_reps)
        over = per_step.get("schedule", 0.0) + per_step.get("sample", 0.0) + per_step.get("postprocess", 0.0) + prep
        res["overhead"] = {
            "batch": phase_b, "steps": d["step_delta"], "step_ms": d["ms_step"],
            "schedule_ms": per_step.get("schedule"), "prepare_ms": prep, "sample_ms": per_step.get("sample"),
            "postprocess_ms": per_step.get("postprocess"),
            "forward_incl_prepare_ms": per_step.get("forward"),  # averaged over all steps incl. the prefill step
            "overhead_ms": over, "overhead_pct": over / d["ms_step"] * 100.0,
            "note": "phase times averaged over the run's steps (one prefill step included); prepare timed "
                    "separately on throwaway requests at the mid-decode context",
        }

        # ---- prefill
        loads.mark("engine_prefill")
        prefill = {}
        for shape, prompts in w.prefill.items():
            prefill[shape] = engine_prefill(eng, prompts, plan.prefill_reps, plan.rep_budget_s, plan.min_reps)
            log(f"engine prefill {shape}: {prefill[shape]['tok_s']:.0f} tok/s ({prefill[shape]['ms']:.1f} ms)")
        res["prefill"] = prefill

        # ---- mixed
        loads.mark("engine_mixed")
        runs = []
        for rep in range(plan.mixed_reps):
            _wait_idle(eng)
            t0m, finals = _submit_and_wait(eng, w.mixed_prompts, w.mixed_outputs, f"mix-{rep}")
            wall = max(f.metrics.finished_s for f in finals) - t0m
            gen = sum(f.num_output_tokens for f in finals)
            runs.append({
                "wall_s": wall, "tok_s": gen / wall, "generated_tokens": gen,
                "ttft_s": summarize(f.metrics.ttft_s for f in finals),
                "tpot_ms": summarize((f.metrics.tpot_s or 0.0) * 1000.0 for f in finals),
            })
            log(f"engine mixed: {wall:.1f} s wall, {gen / wall:.1f} tok/s")
        best = min(runs, key=lambda r: r["wall_s"])
        best["all_wall_s"] = [r["wall_s"] for r in runs]
        res["mixed"] = best
        s = _wait_idle(eng)
        res["rejected"] = dict(s.rejected)
    finally:
        eng.shutdown()
    del eng
    free_memory()
    return res


# =========================================================================== CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="Kairos engine vs HF transformers: decode, prefill, mixed workload, per-step overhead "
                    "(same model, same run), with the memory-bandwidth bound.")
    ap.add_argument("--model", default="kairos-default",
                    help="kairos-default | kairos-tiny | llama-110m (built on demand) | a local HF checkpoint dir")
    ap.add_argument("--llama-110m", action="store_true",
                    help="shorthand for --model llama-110m (Llama 768/12/12/2048/32000, random, seed 0)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 | float16 | auto (default bfloat16)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (process-wide; default 2)")
    ap.add_argument("--quick", action="store_true", help="fewer reps and smaller sizes (tests, smoke runs)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF baseline (engine figures only)")
    ap.add_argument("--decode-reps", type=int, help="override the decode repetitions (best of N)")
    ap.add_argument("--mixed-reps", type=int, help="override the mixed-workload repetitions (best of N)")
    ap.add_argument("--kv-cache-gb", type=float, help="engine KV cache size in GB (default: the engine's own)")
    args = ap.parse_args(argv)
    if args.threads <= 0:
        ap.error("--threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    plan = Plan.quick() if args.quick else Plan()
    if args.decode_reps:
        plan.decode_reps = args.decode_reps
    if args.mixed_reps:
        plan.mixed_reps = args.mixed_reps
    model_name = "llama-110m" if args.llama_110m else args.model
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_all:6.1f}s] {msg}", file=sys.stderr, flush=True)

    loads = LoadLog()
    loads.mark("setup")
    info = run_info(MODULE, argv)
    engine_model = resolve_bench_model(model_name)  # builds llama-110m on first use

    loads.mark("bandwidth")
    bw = measure_bandwidth_gb_s(plan.bw_gb, plan.bw_reps)
    log(f"bandwidth {bw:.1f} GB/s; loadavg {loads.mark('engine_startup')}")

    eng = run_engine(engine_model, args, plan, loads, log)
    hf = None
    if not args.no_hf:
        hf = run_hf(eng["model_path"], args.dtype, plan, eng["workloads"], loads, log)
    loads.mark("end")
    report = build_report(args, argv, plan, info, bw, eng, hf, loads, model_name)
    report["total_s"] = time.perf_counter() - t_all
    if args.json:  # before printing: a closed stdout must not lose the figures
        p = write_json(args.json, report)
        log(f"wrote {p}")
    print_report(report, plan)
    print(f"total {report['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
