"""Engine benchmark: Kairos `LLMEngine` vs HF transformers on the same model, same process, same run.

    python -m bench.engine                                   # kairos-random-42m, bfloat16, 2 threads
    python -m bench.engine --model kairos-default --json /tmp/e.json --summary engine-smollm2-bf16
    python -m bench.engine --llama-110m --dtype float32      # (= --model llama-110m) heavy bench model
    python -m bench.engine --model kairos-tiny --dtype float32 --quick

Figures (all greedy, EOS ignored, random prompt ids < vocab_limit, seeded; best-of-N, /proc/loadavg per section):
- decode tok/s and ms/step at batch 1/8/16/32, prompt 64, 64 new tokens. Engine: B requests submitted at once;
  decode-only = tokens after the step in which the last request got its first token, up to the step in which
  the last one finished, over that time (`metrics.token_times`). HF: `generate` (sdpa) with min = max = 64 new
  tokens, minus a prefill-only (`max_new_tokens=1`) run. Beside them the memory-bandwidth bound
  B / (weight bytes / GB/s), GB/s from a torch sum over 1 GB fp32.
- prefill tok/s for 1x512 and 8x128. Engine: one step (forward + sampling) of throwaway requests on the real
  paged cache (`engine.profiling.Prober` inside `LLMEngine.run_idle`). HF: one forward, `logits_to_keep=1`.
- mixed: 64 requests, prompts U[16, 512], outputs U[16, 256], all at t=0. Engine: first submit to last finish.
  HF: `generate` in static left-padded batches of 32, each to its longest output (only requested tokens count).
- engine per-step overhead at batch 32: schedule + prepare + sample + postprocess, as % of the decode step
  (`LLMEngine.stats().phase_s`; `runner.prepare` timed by `Prober.prepare_ms`).
Files only where asked: `--json PATH` (every figure), `--summary NAME` (`bench/summaries/NAME.json`).

A model of a named shape on a device (issue 54's figures; no download, random weights):

    python -m bench.engine --device cuda --shape llama-8b --summary $OUT/engine-cuda.json   # on a GPU host
    python -m bench.engine --device cpu --shape tiny --quick --dtype float32              # the dry run

builds a Llama of that shape from a config directly on the device, writes it (/dev/shm where it fits) for the
engine to load, and prints in one run: the device-to-device copy bandwidth; for each batch 1/16/64/128/256 at
prompt 512, and again with contexts spread evenly over 128-4096, the served step (the median wall time of the
engine's decode-only steps of the whole batch, `add_step_observer`), tok/s and the ratio to the bound (weight bytes
+ the step's KV bytes) / bandwidth, beside that step's forward + sampling alone (`Prober.decode_ms`); prefill tok/s
and TFLOP/s for 8 x 1024 tokens against the bf16 dense peak; HF `generate` ms/step at batch 1/16/64; start-up
(the model's build and write, then `LLMEngine(...)` with its latency profile). `--time-limit-s` skips what is left
once a run has taken that long.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.driver import free_memory
from bench.metrics import distribution
from bench.report import LoadLog, best_of, measure_bandwidth_gb_s, print_table, run_info, write_json, write_summary

MODULE = "bench.engine"
DEFAULT_MODEL = "kairos-random-42m"  # the random 42M model (the old kairos-default)
_RUNS = itertools.count()  # request ids unique across repetitions


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
    def quick(cls) -> Plan:
        return cls(batches=(1, 8, 32), prompt_len=32, new_tokens=16, decode_reps=1, prefill_reps=2,
                   mixed_requests=16, mixed_prompt=(16, 128), mixed_output=(8, 32), mixed_hf_batch=8,
                   mixed_reps=1, bw_gb=1.0, bw_reps=2, prepare_reps=10, rep_budget_s=None, min_reps=1)

    def reps(self, fn, n: int, key=None, warmup: int = 0):
        return best_of(fn, n, key=key, warmup=warmup, budget_s=self.rep_budget_s, min_reps=self.min_reps)


@dataclass
class Workloads:
    """Token ids shared by the engine and HF (the same prompts for both)."""

    decode: dict[int, list[list[int]]] = field(default_factory=dict)
    prefill: dict[str, list[list[int]]] = field(default_factory=dict)
    mixed_prompts: list[list[int]] = field(default_factory=list)
    mixed_outputs: list[int] = field(default_factory=list)


def make_workloads(plan: Plan, vocab_limit: int) -> Workloads:
    w, base = Workloads(), plan.seed * 1_000_003

    def ids(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(vocab_limit) for _ in range(n)]

    for b in plan.batches:
        rng = random.Random(base + 1000 + b)
        w.decode[b] = [ids(rng, plan.prompt_len) for _ in range(b)]
    for n, length in plan.prefill_shapes:
        rng = random.Random(base + 2000 + n * 10_000 + length)
        w.prefill[f"{n}x{length}"] = [ids(rng, length) for _ in range(n)]
    rng = random.Random(base + 3000)
    for _ in range(plan.mixed_requests):
        w.mixed_prompts.append(ids(rng, rng.randint(*plan.mixed_prompt)))
        w.mixed_outputs.append(rng.randint(*plan.mixed_output))
    return w


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters (tied weights counted once): what one decode step must read."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params)


def num_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# =========================================================================== engine side


def _submit_and_wait(eng, prompts: list[list[int]], max_tokens: list[int], tag: str) -> tuple[float, list]:
    """Submit every prompt at (nearly) the same instant; return (t0 monotonic, final outputs in order)."""
    from core.sampling import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # keep the GIL while enqueueing, so the worker sees the whole batch at once
    try:
        t0 = time.monotonic()
        streams = [eng.add_request(p, sp, request_id=f"{tag}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    finally:
        sys.setswitchinterval(old)
    finals = [_final(st) for st in streams]
    for f, m in zip(finals, max_tokens):
        if f.finish_reason != "length" or f.num_output_tokens != m:
            raise RuntimeError(f"request {f.request_id} ended {f.finish_reason!r} after {f.num_output_tokens}/{m} "
                               f"tokens (reject={f.reject_reason!r}, error={f.error!r})")
    return t0, finals


def _final(stream, timeout: float = 1800.0):
    """The stream's last item (a failed engine finishes its streams with an error item; a hang raises)."""
    while not (out := stream.get(timeout)).finished:
        pass
    return out


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
    return {"tok_s": len(window) / dt if dt > 0 else float("nan"),
            "ms_step": dt / steps * 1000.0 if steps else float("nan"),
            "tokens": len(window), "steps": steps, "seconds": dt,
            "prefill_aligned": len({t[0] for t in tts}) == 1}  # all B prefilled in one step


def _probe(eng, fn):
    """`fn(Prober)` on the engine's worker while it is idle (the probes use the real paged cache)."""
    from engine.profiling import Prober

    return eng.run_idle(lambda e: fn(Prober(e)), timeout=3600.0)


def measure(side: str, plan: Plan, w: Workloads, loads: LoadLog, log, decode, prefill, mixed) -> dict[str, Any]:
    """The three sections, alike for both systems: `decode(B)` -> best figures (tok_s, ms_step, ...),
    `prefill(prompts)` -> seconds of one prefill, `mixed()` -> one run's figures (wall_s, tok_s, ...)."""
    res: dict[str, Any] = {"decode": {}, "prefill": {}}
    loads.mark(f"{side.lower()}_decode")
    for bsz in plan.batches:
        d = res["decode"][bsz] = decode(bsz)
        log(f"{side} decode B={bsz}: {d['tok_s']:.1f} tok/s, {d['ms_step']:.2f} ms/step")
    loads.mark(f"{side.lower()}_prefill")
    for shape, prompts in w.prefill.items():
        best, all_ = plan.reps(lambda p=prompts: prefill(p), plan.prefill_reps, warmup=1)
        p = res["prefill"][shape] = {"tok_s": sum(map(len, prompts)) / best, "ms": best * 1000.0,
                                     "all_ms": [x * 1000.0 for x in all_]}
        log(f"{side} prefill {shape}: {p['tok_s']:.0f} tok/s ({p['ms']:.1f} ms)")
    loads.mark(f"{side.lower()}_mixed")
    best, runs = best_of(mixed, plan.mixed_reps, key=lambda r: r["wall_s"])
    res["mixed"] = dict(best, all_wall_s=[r["wall_s"] for r in runs])
    log(f"{side} mixed: {best['wall_s']:.1f} s wall, {best['tok_s']:.1f} useful tok/s")
    return res


def run_engine(model: str, args, plan: Plan, loads: LoadLog, log) -> dict[str, Any]:
    import torch

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    extra: dict[str, Any] = {"kv_cache_memory_gb": args.kv_cache_gb} if args.kv_cache_gb else {}
    cfg = EngineConfig(model=model, dtype=args.dtype, device="cpu", num_threads=args.threads,
                       scheduler=SchedulerConfig(policy="fcfs", max_num_seqs=64, prefill_max_tokens=4096), **extra)
    log(f"engine: loading {model} ({args.dtype}) and its latency profile (the first start fits it; cached after)")
    t0 = time.perf_counter()
    eng = LLMEngine(cfg)
    startup, prof = time.perf_counter() - t0, dict(eng.profile_report or {})
    log(f"engine: started in {startup:.1f} s; latency profile "
        + ("cached" if prof.get("cached") else f"fitted in {prof.get('seconds', float('nan')):.1f} s"))
    try:
        b, bs = eng.bundle, eng.config.block_size
        w = make_workloads(plan, b.vocab_limit)
        bmax = max(plan.batches)
        _submit_and_wait(eng, w.decode[bmax], [min(4, plan.new_tokens)] * bmax, "warm")  # the whole loop, once

        def decode(bsz: int) -> dict[str, Any]:
            def once() -> dict[str, Any]:
                before = _wait_idle(eng)
                _, finals = _submit_and_wait(eng, w.decode[bsz], [plan.new_tokens] * bsz, f"dec{bsz}-{next(_RUNS)}")
                after = _wait_idle(eng)
                return dict(_decode_figures(finals), step_delta=after.steps - before.steps,
                            phase_delta_s={k: v - before.phase_s.get(k, 0.0) for k, v in after.phase_s.items()})

            best, runs = plan.reps(once, plan.decode_reps, key=lambda f: -f["tok_s"])
            return dict(best, all_tok_s=[f["tok_s"] for f in runs])

        def mixed() -> dict[str, Any]:
            _wait_idle(eng)
            t0m, finals = _submit_and_wait(eng, w.mixed_prompts, w.mixed_outputs, f"mix-{next(_RUNS)}")
            wall = max(f.metrics.finished_s for f in finals) - t0m
            gen = sum(f.num_output_tokens for f in finals)
            return {"wall_s": wall, "tok_s": gen / wall, "generated_tokens": gen,
                    "ttft_s": distribution(f.metrics.ttft_s for f in finals),
                    "tpot_ms": distribution((f.metrics.tpot_s or 0.0) * 1000.0 for f in finals)}

        res = measure("engine", plan, w, loads, log, decode,
                      lambda prompts: _probe(eng, lambda p: p.prefill_ms(prompts)) / 1000.0, mixed)

        # per-step overhead at the largest batch (32 by default): phases of its best decode run, prepare probed
        loads.mark("engine_overhead")
        d = res["decode"][bmax]
        per_step = {k: v / max(1, d["step_delta"]) * 1000.0 for k, v in d["phase_delta_s"].items()}
        ctx = plan.prompt_len + plan.new_tokens // 2
        prep = _probe(eng, lambda p: best_of(lambda: p.prepare_ms([ctx] * bmax), plan.prepare_reps, warmup=2)[0])
        over = sum(per_step.get(k, 0.0) for k in ("schedule", "sample", "postprocess")) + prep
        res["overhead"] = {
            "batch": bmax, "steps": d["step_delta"], "step_ms": d["ms_step"],
            "schedule_ms": per_step.get("schedule"), "prepare_ms": prep, "sample_ms": per_step.get("sample"),
            "postprocess_ms": per_step.get("postprocess"),
            "forward_incl_prepare_ms": per_step.get("forward"),  # averaged over all steps incl. the prefill step
            "overhead_ms": over, "overhead_pct": over / d["ms_step"] * 100.0,
            "note": "phase times averaged over the run's steps (one prefill step included); prepare timed "
                    "separately on throwaway requests at the mid-decode context"}
        res.update(startup_s=startup, profile=prof, workloads=w, rejected=dict(_wait_idle(eng).rejected),
                   vocab_limit=b.vocab_limit, weight_bytes=weight_bytes(b.model), params=num_params(b.model),
                   model_path=b.path, torch_dtype=str(b.dtype).removeprefix("torch."),
                   kv_cache={"blocks": eng.cache.num_blocks, "block_size": bs,
                             "dtype": str(eng.cache.dtype).removeprefix("torch."),
                             "tokens": eng.cache.num_blocks * bs},
                   threads=torch.get_num_threads(), upcast_linears=eng.upcast_linears)
    finally:
        eng.shutdown()
    return res  # the caller frees the memory (this frame's closures hold the engine until it returns)


# =========================================================================== HF side


def _left_pad(prompts: list[list[int]], pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_hf(path: str, dtype: str, plan: Plan, w: Workloads, loads: LoadLog, log) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine.loader import resolve_dtype

    loads.mark("hf_load")
    hf_logging.set_verbosity_error()
    cfg = AutoConfig.from_pretrained(path, local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
    tdtype = resolve_dtype(dtype, torch.device("cpu"))
    log(f"HF: loading {path} ({tdtype}, sdpa) ...")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    gcfg = model.generation_config
    eos = gcfg.eos_token_id if gcfg.eos_token_id is not None else cfg.eos_token_id
    pad = gcfg.pad_token_id if gcfg.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    @torch.inference_mode()
    def generate(prompts: list[list[int]], n: int) -> float:
        ids, mask = _left_pad(prompts, pad)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, num_beams=1, pad_token_id=pad, use_cache=True)
        dt = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"HF generate produced {out.shape[1] - ids.shape[1]} tokens, expected {n}")
        return dt

    @torch.inference_mode()
    def prefill(prompts: list[list[int]]) -> float:
        ids, mask = _left_pad(prompts, pad)
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - t0

    def decode(bsz: int) -> dict[str, Any]:  # generate(64) - generate(1): 63 decode steps
        t_full, all_full = plan.reps(lambda: generate(w.decode[bsz], plan.new_tokens), plan.decode_reps)
        t_pre, all_pre = plan.reps(lambda: generate(w.decode[bsz], 1), plan.decode_reps)
        dt, steps = max(t_full - t_pre, 1e-9), plan.new_tokens - 1
        return {"tok_s": bsz * steps / dt, "ms_step": dt / steps * 1000.0, "generate_s": t_full,
                "prefill_only_s": t_pre, "all_generate_s": all_full, "all_prefill_only_s": all_pre}

    def mixed() -> dict[str, Any]:  # static batches, each to its longest output
        k = plan.mixed_hf_batch
        chunks = [(w.mixed_prompts[i:i + k], w.mixed_outputs[i:i + k]) for i in range(0, plan.mixed_requests, k)]
        wall = sum(generate(prompts, max(outs)) for prompts, outs in chunks)
        useful = sum(w.mixed_outputs)
        return {"wall_s": wall, "tok_s": useful / wall, "useful_tokens": useful, "batch": k,
                "generated_tokens_incl_waste": sum(max(outs) * len(prompts) for prompts, outs in chunks)}

    generate(w.decode[max(plan.batches)], min(4, plan.new_tokens))  # warm-up: page in, size the allocator
    return measure("HF", plan, w, loads, log, decode, prefill, mixed)  # the caller frees the memory


# =========================================================================== report


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def build_report(args, plan: Plan, info: dict, bw: float, eng: dict, hf: dict | None, loads: LoadLog,
                 model_name: str) -> dict[str, Any]:
    wb, hf = eng["weight_bytes"], hf or {}
    step_bound_s = wb / (bw * 1e9)
    decode = []
    for bsz in plan.batches:
        e, h = eng["decode"][bsz], hf.get("decode", {}).get(bsz, {})
        decode.append({
            "batch": bsz, "engine_tok_s": e["tok_s"], "hf_tok_s": h.get("tok_s"),
            "engine_ms_step": e["ms_step"], "hf_ms_step": h.get("ms_step"),
            "bound_tok_s": bsz / step_bound_s, "bound_ms_step": step_bound_s * 1000.0,
            "engine_vs_hf": _ratio(e["tok_s"], h.get("tok_s")),
            "engine_pct_of_bound": e["tok_s"] / (bsz / step_bound_s) * 100.0,
            "engine_prefill_aligned": e["prefill_aligned"], "engine_all_tok_s": e["all_tok_s"],
            "engine_steps": e["steps"], "engine_tokens": e["tokens"], "engine_reps": len(e["all_tok_s"]),
            "hf_reps": len(h["all_generate_s"]) if h else None})
    prefill = []
    for shape, e in eng["prefill"].items():
        h = hf.get("prefill", {}).get(shape, {})
        prefill.append({"shape": shape, "engine_tok_s": e["tok_s"], "hf_tok_s": h.get("tok_s"),
                        "engine_ms": e["ms"], "hf_ms": h.get("ms"), "engine_vs_hf": _ratio(e["tok_s"], h.get("tok_s")),
                        "engine_reps": len(e["all_ms"]), "hf_reps": len(h["all_ms"]) if h else None})
    em, hm, wl = eng["mixed"], hf.get("mixed", {}), eng["workloads"]
    mixed = {
        "engine_tok_s": em["tok_s"], "hf_tok_s": hm.get("tok_s"), "engine_wall_s": em["wall_s"],
        "hf_wall_s": hm.get("wall_s"), "engine_vs_hf": _ratio(em["tok_s"], hm.get("tok_s")),
        "requests": plan.mixed_requests, "prompt_len": list(plan.mixed_prompt), "output_len": list(plan.mixed_output),
        "useful_tokens": sum(wl.mixed_outputs), "prompt_tokens": sum(map(len, wl.mixed_prompts)),
        "hf_batch": plan.mixed_hf_batch, "hf_generated_tokens_incl_waste": hm.get("generated_tokens_incl_waste"),
        "engine_ttft_s": em["ttft_s"], "engine_tpot_ms": em["tpot_ms"],
        "engine_all_wall_s": em["all_wall_s"], "hf_all_wall_s": hm.get("all_wall_s")}
    return {
        "model": model_name, "model_path": eng["model_path"], "dtype": eng["torch_dtype"], "threads": args.threads,
        "quick": bool(args.quick), "params": eng["params"], "weight_bytes": wb, "vocab_limit": eng["vocab_limit"],
        "decode": decode, "prefill": prefill, "mixed": mixed,
        "bandwidth_gb_s": bw, "bound_ms_step": step_bound_s * 1000.0,
        "overhead_pct_b32": eng["overhead"]["overhead_pct"], "overhead": eng["overhead"],
        "engine_startup_s": eng["startup_s"], "engine_profile": eng["profile"], "engine_kv_cache": eng["kv_cache"],
        "engine_rejected": eng["rejected"], "engine_upcast_linears": eng["upcast_linears"], "hf_included": bool(hf),
        "cpu": info["cpu"], "loadavg": loads.as_dict(), "date": info["date"], "command": info["command"],
        "env": info, "settings": asdict(plan)}


def summary(r: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`--summary`'s one-line headline (decode tok/s per batch, engine vs HF) and its small figures dict."""
    hf, m = r["hf_included"], r["mixed"]
    headline = f"decode tok/s engine{' vs HF generate' if hf else ''}: " + ", ".join(
        f"B={d['batch']} {d['engine_tok_s']:.0f}" + (f" vs {d['hf_tok_s']:.0f}" if hf else "") for d in r["decode"])
    figures = {"model": r["model"], "dtype": r["dtype"], "threads": r["threads"], "quick": r["quick"],
               "decode": {d["batch"]: {k: d[k] for k in ("engine_tok_s", "hf_tok_s")} for d in r["decode"]},
               "prefill_tok_s": {p["shape"]: {k: p[k] for k in ("engine_tok_s", "hf_tok_s")} for p in r["prefill"]},
               "mixed_wall_s": {"engine": m["engine_wall_s"], "hf": m["hf_wall_s"]},
               "overhead_pct_b32": r["overhead_pct_b32"], "bandwidth_gb_s": r["bandwidth_gb_s"]}
    return headline, figures


def print_report(r: dict[str, Any], plan: Plan) -> None:
    env, prof, kv, la = r["env"], r["engine_profile"], r["engine_kv_cache"], r["loadavg"]
    up = r["engine_upcast_linears"]
    print(f"\n## Kairos engine benchmark: {r['model']} ({r['params'] / 1e6:.1f}M params, "
          f"{r['weight_bytes'] / 1e6:.1f} MB of weights), {r['dtype']}, {r['threads']} threads"
          + (" [quick]" if r["quick"] else ""))
    print(f"cpu: {r['cpu']} [{' '.join(env.get('cpu_flags', [])) or '?'}] | torch {env.get('torch')} | "
          f"transformers {env.get('transformers')} | {r['date']}")
    print(f"memory bandwidth: {r['bandwidth_gb_s']:.1f} GB/s (torch sum over {plan.bw_gb:g} GB fp32, best of "
          f"{plan.bw_reps}) -> weight-read bound {r['bound_ms_step']:.2f} ms/step")
    print(f"engine: startup {r['engine_startup_s']:.1f} s (latency profile "
          + ("cached" if prof.get("cached") else f"fitted in {prof.get('seconds', 0):.1f} s")
          + f"); KV cache {kv['tokens']} tokens ({kv['dtype']})"
          + (f"; {up} linears upcast to fp32 GEMM (no native bf16 on this CPU)" if up else "")
          + "; HF: transformers eager, sdpa")
    print(f"loadavg: start {la['start']} | end {la['end']}")
    if la.get("other_cores"):
        print("cores used by other processes, per section: "
              + ", ".join(f"{k} {v:.2f}" for k, v in la["other_cores"].items()))
        if la["max_other_cores"] > 0.25:
            print(f"WARNING: other processes used {la['max_other_cores']:.2f} cores during {la['max_other_section']}: "
                  "this box has 2 cores, so those timings are unreliable (rerun on a quiet box)")
    budget = ("" if plan.rep_budget_s is None else
              f" (at least {plan.min_reps}, fewer once a configuration has used {plan.rep_budget_s:g} s)")

    def reps(d):
        return f"{d['engine_reps']}/{'-' if d['hf_reps'] is None else d['hf_reps']}"

    print_table(["batch", "engine tok/s", "HF tok/s", "engine/HF", "engine ms/step", "HF ms/step", "bound tok/s",
                 "engine % of bound", "reps e/HF"],
                [[d["batch"], d["engine_tok_s"], d["hf_tok_s"], d["engine_vs_hf"], d["engine_ms_step"], d["hf_ms_step"],
                  d["bound_tok_s"], d["engine_pct_of_bound"], reps(d)] for d in r["decode"]],
                title=f"Decode: prompt {plan.prompt_len}, {plan.new_tokens} new tokens ({plan.new_tokens - 1} timed "
                      f"decode steps), greedy, EOS ignored; best of up to {plan.decode_reps}{budget}; "
                      "bound = B / (weight bytes / bandwidth)", digits=2 if r["quick"] else 1)
    print_table(["shape", "engine tok/s", "HF tok/s", "engine/HF", "engine ms", "HF ms", "reps e/HF"],
                [[p["shape"], p["engine_tok_s"], p["hf_tok_s"], p["engine_vs_hf"], p["engine_ms"], p["hf_ms"], reps(p)]
                 for p in r["prefill"]],
                title="Prefill (engine: one step, forward + sampling; HF: one forward, logits_to_keep=1); best of "
                      f"up to {plan.prefill_reps}{budget}")
    m = r["mixed"]
    print_table(["system", "wall s", "useful tok/s", "speedup"],
                [["engine (all at t=0)", m["engine_wall_s"], m["engine_tok_s"], m["engine_vs_hf"]],
                 [f"HF generate (static batches of {m['hf_batch']})", m["hf_wall_s"], m["hf_tok_s"],
                  1.0 if m["hf_tok_s"] else None]],
                title=f"Mixed: {m['requests']} requests, prompts U[{m['prompt_len'][0]},{m['prompt_len'][1]}] "
                      f"({m['prompt_tokens']} tokens), outputs U[{m['output_len'][0]},{m['output_len'][1]}] "
                      f"({m['useful_tokens']} tokens), EOS ignored", digits=2)
    t, tp = m["engine_ttft_s"], m["engine_tpot_ms"]
    print(f"engine mixed: TTFT p50 {t['p50']:.2f} s / p99 {t['p99']:.2f} s; TPOT p50 {tp['p50']:.1f} ms / "
          f"p99 {tp['p99']:.1f} ms")
    o = r["overhead"]
    print_table(["schedule ms", "prepare ms", "sample ms", "postprocess ms", "overhead ms", "decode step ms",
                 "overhead %"],
                [[o[k] for k in ("schedule_ms", "prepare_ms", "sample_ms", "postprocess_ms", "overhead_ms", "step_ms",
                                 "overhead_pct")]],
                title=f"Engine per-step overhead at batch {o['batch']} (everything but the model forward)", digits=2,
                align="r" * 7)
    if any(not d["engine_prefill_aligned"] for d in r["decode"]):
        print("note: in some decode runs the batch was not prefilled in a single step (the window counts "
              "only tokens after the last first token)")
    if r["engine_rejected"]:
        print(f"note: engine rejected requests: {r['engine_rejected']}")
    sys.stdout.flush()



# =========================================================================== a named shape on a device (--shape)

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: 8.0B parameters, untied embeddings
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # Llama-3.2-1B: 1.2B parameters, tied embeddings
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # a tiny Llama for dry runs and tests (vocabulary = the tiny tokenizer's)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=None, tie_word_embeddings=False),
}
# bf16 dense matrix peak by the vendor's datasheet (TFLOP/s), matched against torch's device name
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


@dataclass
class ShapePlan:
    """Sizes of a `--shape` run (`--quick`: a small one for the CPU dry run and tests)."""

    batches: tuple[int, ...] = (1, 16, 64, 128, 256)
    prompt_len: int = 512
    spread_batches: tuple[int, ...] = (1, 16, 64, 128, 256)
    spread: tuple[int, int] = (128, 4096)
    warmup_steps: int = 4
    decode_steps: int = 16
    probe_reps: int = 5
    prefill: tuple[int, int] = (8, 1024)
    prefill_reps: int = 3
    hf_batches: tuple[int, ...] = (1, 16, 64)
    max_model_len: int = 8192
    prefill_max_tokens: int = 32768
    bw_bytes: int = 4 << 30

    @classmethod
    def quick(cls) -> ShapePlan:
        return cls(batches=(1, 4), prompt_len=32, spread_batches=(1, 4), spread=(16, 96), warmup_steps=2,
                   decode_steps=4, probe_reps=2, prefill=(2, 64), prefill_reps=2, hf_batches=(1, 4),
                   max_model_len=256, prefill_max_tokens=2048, bw_bytes=64 << 20)


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _empty_cache(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth_gb_s(dev, nbytes: int, reps: int = 10) -> float:
    """A device-to-device copy of `nbytes` (bytes read + bytes written over the time; median of `reps`)."""
    import statistics

    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / statistics.median(times) / 1e9


def shape_config(shape: str, vocab: int, max_model_len: int):
    from transformers import LlamaConfig

    kw = dict(SHAPES[shape])
    kw["vocab_size"] = kw["vocab_size"] or vocab
    return LlamaConfig(max_position_embeddings=max_model_len, rope_theta=500000.0, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0, **kw)


def build_shape_model(config, dev, dtype, seed: int = 0):
    """A random model of `config`, its weights created on `dev` (no host round trip)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.device(dev):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def _scratch_dir(nbytes: int) -> str:
    """Where to write the checkpoint the engine loads: /dev/shm when it has room (RAM, no disk), else tmp."""
    import shutil
    import tempfile

    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and shutil.disk_usage(shm).free > 1.3 * nbytes else None
    return tempfile.mkdtemp(prefix="kairos-shape-", dir=base)


def _linear_params(model) -> int:
    """Parameters of the decoder layers (the matmuls every prompt token goes through)."""
    return sum(p.numel() for p in model.model.layers.parameters())


def prefill_flops(cfg, linear_params: int, lengths: list[int]) -> float:
    """2 x params x tokens for the layers' matmuls, causal attention (QK^T and PV over half the square), and the
    LM head for each prompt's last token."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = sum(4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * n * (n + 1) / 2 for n in lengths)
    return 2.0 * linear_params * sum(lengths) + attn + 2.0 * cfg.vocab_size * cfg.hidden_size * len(lengths)


def _spread_lengths(b: int, lo: int, hi: int) -> list[int]:
    return [(lo + hi) // 2] if b == 1 else [lo + (hi - lo) * i // (b - 1) for i in range(b)]


class _Events:
    """The engine's StepEvents, collected on its worker thread."""

    def __init__(self, eng) -> None:
        self.items: list = []
        self.unsubscribe = eng.add_step_observer(self.items.append)


def _served_decode(eng, events: _Events, prompts: list[list[int]], plan: ShapePlan, tag: str) -> dict[str, Any]:
    """Submit the batch at once, decode `warmup + steps + 1` tokens each; the figures of the decode-only steps
    with the whole batch after the first `warmup` of them (the engine's own step wall time: schedule, forward,
    sampling, postprocess)."""
    import statistics

    b = len(prompts)
    start = len(events.items)
    _submit_and_wait(eng, prompts, [plan.warmup_steps + plan.decode_steps + 1] * b, tag)
    eng.run_idle(lambda e: None, require_idle=False)  # the last step's event is in
    steps = [e for e in events.items[start:] if e.num_decode == b and e.num_prefill == 0][plan.warmup_steps:]
    steps = steps[:plan.decode_steps]
    if not steps:
        raise RuntimeError(f"no decode-only step of the whole batch of {b} (the scheduler split it)")
    ms = statistics.median(e.wall_ms for e in steps)
    return {"ms_step": ms, "tok_s": b / ms * 1000.0, "steps": len(steps),
            "forward_ms": statistics.median(e.forward_ms for e in steps),
            "mean_context": statistics.mean(e.decode_mean_len for e in steps),
            "all_ms": [e.wall_ms for e in steps]}


def run_shape(args, argv) -> int:
    import shutil
    import statistics

    import torch

    from engine.config import EngineConfig
    from engine.default_model import build_tokenizer, quiet_progress_bars
    from engine.engine import LLMEngine
    from engine.loader import resolve_device, resolve_dtype
    from engine.testing import TINY_VOCAB
    from scheduling.config import SchedulerConfig

    plan = ShapePlan.quick() if args.quick else ShapePlan()
    for name in ("batches", "spread_batches", "hf_batches"):
        if getattr(args, name) is not None:
            setattr(plan, name, tuple(getattr(args, name)))
    if args.decode_steps:
        plan.decode_steps = args.decode_steps
    shape = args.shape or "llama-8b"
    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    t_all = time.perf_counter()
    deadline = None if args.time_limit_s is None else t_all + args.time_limit_s
    skipped: list[str] = []

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_all:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def time_left(what: str) -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(what)
            log(f"skipped {what}: past --time-limit-s {args.time_limit_s:g}")
            return False
        return True

    def guarded(what: str, fn) -> None:
        """A section that fails is reported in `skipped`; the run goes on and writes what it has."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            skipped.append(f"{what} failed: {e!r}"[:300])
            log(skipped[-1])

    info = run_info(MODULE, argv)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if gpu and k in gpu), None)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 runs stay fp32 (bf16 is the default)
    bw = copy_bandwidth_gb_s(dev, plan.bw_bytes)
    log(f"{gpu or info['cpu']}: device-to-device copy {bw:.0f} GB/s")
    _empty_cache(dev)

    # ---- the model: built on the device from a config, written where the engine loads it from
    tok = build_tokenizer(TINY_VOCAB)
    cfg = shape_config(shape, len(tok), plan.max_model_len)
    t0 = time.perf_counter()
    model = build_shape_model(cfg, dev, dtype)
    _sync(dev)
    build_s = time.perf_counter() - t0
    wbytes, params, linear = weight_bytes(model), num_params(model), _linear_params(model)
    folder = _scratch_dir(wbytes)
    t0 = time.perf_counter()
    with quiet_progress_bars():
        model.save_pretrained(folder)
    tok.save_pretrained(folder)
    save_s = time.perf_counter() - t0
    del model
    free_memory()
    _empty_cache(dev)
    dname = str(dtype).removeprefix("torch.")
    log(f"{shape}: {params / 1e6:.1f}M parameters, {wbytes / 1e9:.2f} GB ({dname}); built on {dev} in "
        f"{build_s:.1f} s, written to {folder} in {save_s:.1f} s")

    res: dict[str, Any] = {"decode": [], "spread": [], "prefill": None, "hf": []}
    bmax = max(plan.batches + plan.spread_batches)
    try:
        sched = SchedulerConfig(policy="fcfs", max_num_seqs=bmax, max_waiting=2 * bmax, prefill_max_batch_size=bmax,
                                prefill_max_tokens=plan.prefill_max_tokens)
        extra: dict[str, Any] = {"gpu_memory_utilization": args.gpu_memory_utilization} \
            if args.gpu_memory_utilization else {}
        if args.kv_cache_gb:
            extra["kv_cache_memory_gb"] = args.kv_cache_gb
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(model=folder, dtype=str(dtype).removeprefix("torch."), device=str(dev),
                                     num_threads=args.threads if dev.type == "cpu" else None,
                                     max_model_len=plan.max_model_len, scheduler=sched, **extra))
        init_s = time.perf_counter() - t0
        prof = dict(eng.profile_report or {})
        kv_per_token = (2 * cfg.num_hidden_layers * eng.cache.num_kv_heads * eng.cache.head_dim
                        * torch.empty((), dtype=eng.cache.dtype).element_size())  # K and V, every layer
        startup = {"build_s": build_s, "save_s": save_s, "engine_init_s": init_s,
                   "profile_fit_s": None if prof.get("cached") else prof.get("seconds"),
                   "profile_cached": bool(prof.get("cached")), "scratch_dir": folder,
                   "note": "engine_init_s is LLMEngine(...) wall time: loading the checkpoint, sizing the KV cache, "
                           "the latency profile (its fit time is profile_fit_s) and whatever else the engine "
                           "does at start; build_s + save_s are this benchmark's, not the engine's"}
        for k in ("startup_report", "graph_capture_s"):  # phase times, where the engine exposes them
            if getattr(eng, k, None) is not None:
                startup[k] = getattr(eng, k)
        log(f"engine ready in {init_s:.1f} s (latency profile "
            + ("cached" if prof.get("cached") else f"fitted in {prof.get('seconds', float('nan')):.1f} s")
            + f"); KV cache {eng.cache.num_blocks * eng.cache.block_size} tokens")
        events = _Events(eng)
        rng = random.Random(0)
        vl = eng.bundle.vocab_limit

        def ids(n: int) -> list[int]:
            return [rng.randrange(vl) for _ in range(n)]

        def bound_ms(b: int, mean_ctx: float) -> tuple[float, float]:
            kv = b * mean_ctx * kv_per_token
            return (wbytes + kv) / (bw * 1e9) * 1000.0, kv

        def probe(lens: list[int]) -> float | None:  # forward + sampling alone, on throwaway requests
            try:
                return statistics.median(_probe(eng, lambda p: [p.decode_ms(lens) for _ in range(plan.probe_reps)]))
            except Exception as e:  # noqa: BLE001 - a figure beside the served one; the run goes on
                log(f"probe of {len(lens)} contexts failed: {e!r}")
                return None

        guarded("warm-up", lambda: _submit_and_wait(eng, [ids(plan.prompt_len)] * 2, [4, 4], "warm"))
        def ladder(section: str, batches: tuple[int, ...], lens_of) -> None:
            for b in batches:
                if not time_left(f"{section} B={b}"):
                    continue
                lens = lens_of(b)
                bs, extra_tokens = eng.cache.block_size, plan.warmup_steps + plan.decode_steps + 2
                if sum(-(-(n + extra_tokens) // bs) for n in lens) > eng.cache.num_blocks:
                    skipped.append(f"{section} B={b} (KV cache too small)")
                    continue
                d = _served_decode(eng, events, [ids(n) for n in lens], plan, f"{section}{b}-{next(_RUNS)}")
                bms, kv = bound_ms(b, d["mean_context"])
                d.update(batch=b, contexts=[min(lens), max(lens)], bound_ms=bms, kv_bytes_per_step=kv,
                         ratio_to_bound=d["ms_step"] / bms,
                         probe_ms=probe([n + plan.warmup_steps + plan.decode_steps // 2 for n in lens]))
                res[section].append(d)
                log(f"{section} B={b} ctx {min(lens)}-{max(lens)}: {d['ms_step']:.2f} ms/step, {d['tok_s']:.0f} "
                    f"tok/s, {d['ratio_to_bound']:.2f}x the bound ({bms:.2f} ms); forward+sampling alone "
                    f"{d['probe_ms'] or float('nan'):.2f} ms")

        # cheapest and most asked-for first: a --time-limit-s cut leaves out the spread ladder's large batches
        ladder("decode", plan.batches, lambda b: [plan.prompt_len] * b)
        def prefill_point() -> None:
            n, length = plan.prefill
            prompts = [ids(length) for _ in range(n)]
            best, all_ = best_of(lambda: _probe(eng, lambda p: p.prefill_ms(prompts)) / 1000.0, plan.prefill_reps,
                                 warmup=1)
            flops = prefill_flops(cfg, linear, [length] * n)
            res["prefill"] = {"shape": f"{n}x{length}", "ms": best * 1000.0, "tok_s": n * length / best,
                              "tflops": flops / best / 1e12, "flops": flops, "peak_tflops": peak,
                              "pct_of_peak": flops / best / 1e12 / peak * 100.0 if peak else None,
                              "all_ms": [x * 1000.0 for x in all_]}
            p = res["prefill"]
            log(f"prefill {p['shape']}: {p['ms']:.1f} ms, {p['tok_s']:.0f} tok/s, {p['tflops']:.1f} TFLOP/s"
                + (f" ({p['pct_of_peak']:.0f}% of {peak:g})" if peak else ""))

        if time_left("prefill"):
            guarded("prefill", prefill_point)
        ladder("spread", plan.spread_batches, lambda b: _spread_lengths(b, *plan.spread))
        kv_info = {"blocks": eng.cache.num_blocks, "block_size": eng.cache.block_size,
                   "dtype": str(eng.cache.dtype).removeprefix("torch."), "bytes_per_token": kv_per_token}
        rejected = dict(eng.stats().rejected)
        events.unsubscribe()
        eng.shutdown()
        del eng, events
        free_memory()
        _empty_cache(dev)

        # ---- HF generate on a model of the same shape (built again on the device: the values do not matter)
        def hf_section() -> None:
            model = build_shape_model(cfg, dev, dtype)
            n_new = plan.decode_steps + 1

            @torch.inference_mode()
            def generate(prompts: list[list[int]], n: int) -> float:
                x, mask = _left_pad(prompts, 0)
                x, mask = x.to(dev), mask.to(dev)
                _sync(dev)
                t0 = time.perf_counter()
                model.generate(input_ids=x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, num_beams=1, pad_token_id=0, use_cache=True)
                _sync(dev)
                return time.perf_counter() - t0

            generate([ids(plan.prompt_len)], 2)  # warm-up
            for b in plan.hf_batches:
                if not time_left(f"hf B={b}"):
                    continue
                prompts = [ids(plan.prompt_len) for _ in range(b)]
                t_full, t_one = generate(prompts, n_new), generate(prompts, 1)
                ms = max(t_full - t_one, 1e-9) / (n_new - 1) * 1000.0
                res["hf"].append({"batch": b, "ms_step": ms, "tok_s": b / ms * 1000.0, "generate_s": t_full,
                                  "prefill_only_s": t_one})
                log(f"HF generate B={b}: {ms:.2f} ms/step")

        if plan.hf_batches and time_left("hf"):
            guarded("hf", hf_section)
            free_memory()
    finally:
        if not args.keep_model:
            shutil.rmtree(folder, ignore_errors=True)

    report = {
        "mode": "shape", "shape": shape, "config": {k: getattr(cfg, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "max_position_embeddings")},
        "device": str(dev), "gpu": gpu, "dtype": str(dtype).removeprefix("torch."), "params": params,
        "weight_bytes": wbytes, "bandwidth_gb_s": bw, "peak_bf16_tflops": peak,
        "bound_definition": "(all weight bytes + the step's KV bytes: batch x mean context x per-token K and V "
                            "bytes) / the copy bandwidth measured in this run",
        "plan": asdict(plan), "startup": startup, "kv_cache": kv_info, "rejected": rejected,
        "decode": res["decode"], "spread": res["spread"], "prefill": res["prefill"], "hf": res["hf"],
        "skipped": skipped, "versions": _versions(), "commit": info["commit"] or os.environ.get("KAIROS_COMMIT", ""),
        "date": info["date"], "command": info["command"], "env": info, "total_s": time.perf_counter() - t_all}
    if args.json:
        log(f"wrote {write_json(args.json, report)}")
    if args.summary:
        log(f"wrote {write_shape_summary(args.summary, report)}")
    print_shape_report(report)
    return 0


def _versions() -> dict[str, Any]:
    import torch

    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = None
    return v


def shape_headline(r: dict[str, Any]) -> str:
    parts = [f"{r['shape']} {r['dtype']} on {r['gpu'] or r['device']}: bw {r['bandwidth_gb_s']:.0f} GB/s"]
    if r["decode"]:
        parts.append("decode ms/step (x bound) " + ", ".join(
            f"B={d['batch']} {d['ms_step']:.1f} ({d['ratio_to_bound']:.1f}x)" for d in r["decode"]))
    if r["spread"]:
        parts.append("spread " + ", ".join(f"B={d['batch']} {d['ms_step']:.1f} ({d['ratio_to_bound']:.1f}x)"
                                           for d in r["spread"]))
    if r["prefill"]:
        parts.append(f"prefill {r['prefill']['shape']} {r['prefill']['tflops']:.0f} TFLOP/s")
    return "; ".join(parts)


def write_shape_summary(target: str, r: dict[str, Any]):
    """`--summary`: a path (has a '/' or ends in .json) gets the summary there; a plain name goes to
    bench/summaries/NAME.json as every benchmark's does."""
    from bench.report import machine, write_summary

    figures = {k: r[k] for k in ("shape", "device", "gpu", "dtype", "params", "weight_bytes", "bandwidth_gb_s",
                                 "peak_bf16_tflops", "bound_definition", "startup", "kv_cache", "decode", "spread",
                                 "prefill", "hf", "skipped", "versions", "total_s")}
    headline = shape_headline(r)
    if "/" not in target and not target.endswith(".json"):
        return write_summary(target, r["command"], headline, figures)
    doc = {"name": os.path.basename(target).removesuffix(".json"), "command": r["command"], "commit": r["commit"],
           "date": r["date"], "machine": machine(), "headline": headline, "figures": figures}
    return write_json(target, doc)


def print_shape_report(r: dict[str, Any]) -> None:
    st = r["startup"]
    print(f"\n## Kairos engine on {r['gpu'] or r['device']}: {r['shape']} shape, {r['params'] / 1e6:.1f}M params, "
          f"{r['weight_bytes'] / 1e9:.2f} GB of weights ({r['dtype']}), random weights")
    print(f"versions: {r['versions']} | commit {r['commit'] or '?'} | {r['date']}")
    print(f"bandwidth: {r['bandwidth_gb_s']:.0f} GB/s (device-to-device copy, bytes read + written); "
          f"bound = {r['bound_definition']}")
    print(f"start-up: build {st['build_s']:.1f} s + write {st['save_s']:.1f} s (this benchmark); LLMEngine(...) "
          f"{st['engine_init_s']:.1f} s, of it the latency profile's fit "
          + ("(cached)" if st["profile_cached"] else f"{st['profile_fit_s'] or float('nan'):.1f} s")
          + f"; KV cache {r['kv_cache']['blocks'] * r['kv_cache']['block_size']} tokens ({r['kv_cache']['dtype']})")
    hdr = ["batch", "contexts", "ms/step", "tok/s", "bound ms", "x bound", "fwd+sample ms", "steps"]
    for key, title in (("decode", "Decode, prompts of equal length"), ("spread", "Decode, contexts spread evenly")):
        if r[key]:
            print_table(hdr, [[d["batch"], f"{d['contexts'][0]}-{d['contexts'][1]}", d["ms_step"], d["tok_s"],
                               d["bound_ms"], d["ratio_to_bound"], d["probe_ms"], d["steps"]] for d in r[key]],
                        title=f"{title}: the served step (LLMEngine's step wall time, median of the decode-only "
                              "steps of the whole batch); fwd+sample = that step's forward and sampling alone",
                        digits=2)
    p = r["prefill"]
    if p:
        print(f"prefill {p['shape']}: {p['ms']:.1f} ms, {p['tok_s']:.0f} tok/s, {p['tflops']:.1f} TFLOP/s"
              + (f" = {p['pct_of_peak']:.0f}% of {p['peak_tflops']:g} (bf16 dense peak, datasheet)"
                 if p["peak_tflops"] else " (no peak known for this device)"))
    if r["hf"]:
        print_table(["batch", "HF ms/step", "HF tok/s"], [[h["batch"], h["ms_step"], h["tok_s"]] for h in r["hf"]],
                    title="HF generate (sdpa), greedy: (generate(n) - generate(1)) / (n - 1)", digits=2)
    if r["skipped"]:
        print(f"skipped: {', '.join(r['skipped'])}")
    print(f"total {r['total_s']:.0f} s")
    sys.stdout.flush()


# =========================================================================== CLI


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="Kairos engine vs HF transformers: decode, prefill, mixed workload, per-step overhead "
                    "(same model, same run), with the memory-bandwidth bound.")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"{DEFAULT_MODEL} (default) | kairos-default (trained SmolLM2-135M) | kairos-tiny | "
                         "llama-110m (built on demand) | a local HF checkpoint dir")
    ap.add_argument("--llama-110m", action="store_true",
                    help="shorthand for --model llama-110m (Llama 768/12/12/2048/32000, random, seed 0)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 | float16 | auto (default bfloat16)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (process-wide; default 2)")
    ap.add_argument("--quick", action="store_true", help="fewer reps and smaller sizes (tests, smoke runs)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    ap.add_argument("--summary", metavar="NAME",
                    help="also keep the headline (decode tok/s per batch, mixed wall) as bench/summaries/NAME.json "
                         "(a --shape run: NAME may be a path, e.g. $OUT/engine-cuda.json)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF baseline (engine figures only)")
    ap.add_argument("--decode-reps", type=int, help="override the decode repetitions (best of N)")
    ap.add_argument("--mixed-reps", type=int, help="override the mixed-workload repetitions (best of N)")
    ap.add_argument("--kv-cache-gb", type=float, help="engine KV cache size in GB (default: the engine's own)")
    g = ap.add_argument_group("a model of a named shape on a device (--device cuda, or --shape)")
    g.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:N; not cpu: the --shape run")
    g.add_argument("--shape", choices=sorted(SHAPES), help="build a Llama of this shape from a config (random "
                   "weights, no download; default with --device cuda: llama-8b) and run the decode ladder at equal "
                   "and spread contexts, prefill TFLOP/s, HF generate, start-up and the measured bandwidth")
    g.add_argument("--batches", type=_ints, help="decode batches at the prompt length (default 1,16,64,128,256)")
    g.add_argument("--spread-batches", type=_ints, help="decode batches with contexts spread over 128-4096 "
                   "(default 1,16,64,128,256)")
    g.add_argument("--hf-batches", type=_ints, help="HF generate batches (default 1,16,64; '' for none)")
    g.add_argument("--decode-steps", type=int, help="timed decode steps per batch (default 16, after 4 warm-up)")
    g.add_argument("--time-limit-s", type=float, help="skip the remaining points once the run has taken this long")
    g.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak (default: 989 for an H100 or "
                   "H200, by the datasheet; else none)")
    g.add_argument("--gpu-memory-utilization", type=float, help="the engine's share of the GPU (default its own)")
    g.add_argument("--keep-model", action="store_true", help="keep the written checkpoint (default: deleted)")
    args = ap.parse_args(argv)
    if args.threads <= 0:
        ap.error("--threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)  # before transformers is imported (nothing above imports it)
    import torch

    if args.shape or args.device != "cpu":
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        return run_shape(args, argv)

    torch.set_num_threads(args.threads)
    plan = Plan.quick() if args.quick else Plan()
    plan.decode_reps = args.decode_reps or plan.decode_reps
    plan.mixed_reps = args.mixed_reps or plan.mixed_reps
    model_name = "llama-110m" if args.llama_110m else args.model
    t_all = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_all:6.1f}s] {msg}", file=sys.stderr, flush=True)

    loads = LoadLog()
    loads.mark("setup")
    info = run_info(MODULE, argv)
    engine_model = model_name
    loads.mark("bandwidth")
    bw = measure_bandwidth_gb_s(plan.bw_gb, plan.bw_reps)
    log(f"bandwidth {bw:.1f} GB/s; loadavg {loads.mark('engine_startup')}")
    eng = run_engine(engine_model, args, plan, loads, log)
    free_memory()
    hf = None if args.no_hf else run_hf(eng["model_path"], args.dtype, plan, eng["workloads"], loads, log)
    free_memory()
    loads.mark("end")
    report = build_report(args, plan, info, bw, eng, hf, loads, model_name)
    report["total_s"] = time.perf_counter() - t_all
    if args.json:  # before printing: a closed stdout must not lose the figures
        log(f"wrote {write_json(args.json, report)}")
    if args.summary:
        headline, figures = summary(report)
        log(f"wrote {write_summary(args.summary, info['command'], headline, figures)}: {headline}")
    print_report(report, plan)
    print(f"total {report['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
