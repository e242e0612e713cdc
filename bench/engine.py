"""Engine benchmark: Kairos's `LLMEngine` alone, against the memory-bandwidth bound and HF `generate`, in one run.

    python -m bench.engine --model kairos-default --summary engine-smollm2-bf16    # a checkpoint, on the CPU
    python -m bench.engine --device cuda --shape llama-8b --summary $OUT/engine-cuda.json   # on a GPU host
    python -m bench.engine --device cpu --shape tiny --quick --dtype float32                # the dry run

The model is a checkpoint (`--model`) or a Llama of a named shape built from a config on the device (`--shape`,
the default with a GPU; random weights, no download, written to /dev/shm where it fits for the engine to load). The
run prints: the device-to-device copy bandwidth; for each batch at the prompt length, and again with contexts
spread evenly (`spread`), the served step (the median wall time of the engine's decode-only steps of the whole
batch, from its step observer), tok/s and the ratio to the bound (weight bytes + the step's KV bytes) / bandwidth,
beside that step's forward + sampling alone (`Prober.decode_ms`); at one batch, the served step sampling at
temperature 1.0 / top-p 0.9 beside greedy, back to back (`sampling`); where the engine overlaps scheduling (CUDA;
the CPU with `--overlap on`), the served step without it beside with it (`overlap`); prefill tok/s
and TFLOP/s (against the bf16 dense peak where known); HF `generate` ms/step on the same model; start-up.
`--time-limit-s` skips what is left once the run has taken that long; a section that fails is reported in `skipped`
and the run goes on.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench.driver import free_memory, resolve_model_path
from bench.report import best_of, print_table, run_info, write_json, write_summary

MODULE = "bench.engine"
DEFAULT_MODEL = "kairos-random-42m"
_RUNS = itertools.count()  # request ids unique across repetitions
GUIDED_WORDS = r"[A-Za-z ,.]*"  # the regex point's: words, commas and full stops, of any length
GUIDED_GRAMMAR = "root ::= (word | [ ,.])*\nword ::= [A-Za-z]+"  # the grammar point's: the same language, as EBNF
# the sampling points, each the served step at the sampling batch beside greedy's: (section, the other run's key, its
# sampling knobs, how the report and the headline name it)
BESIDE_GREEDY: tuple[tuple[str, str, dict[str, Any], str, str], ...] = (
    ("sampling", "top_p", {"temperature": 1.0, "top_p": 0.9}, "temperature 1.0 + top-p 0.9", "top-p 0.9"),
    ("penalties", "penalized", {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.1},
     "repetition 1.1 + frequency 0.1", "penalties"),
    ("logprobs", "logprobs", {"temperature": 0.0, "logprobs": 5}, "with logprobs 5 (a vLLM default)", "logprobs 5"),
    ("json", "json", {"temperature": 0.0, "json_object": True}, "in JSON mode (rows checked on the host)",
     "JSON mode"),
    ("regex", "regex", {"temperature": 0.0, "regex": GUIDED_WORDS}, f"held to {GUIDED_WORDS!r} (on the host)",
     "guided regex"),
    ("grammar", "grammar", {"temperature": 0.0, "grammar": GUIDED_GRAMMAR}, "held to the same language as an EBNF "
     "grammar (on the host)", "guided grammar"),
)
SIDES = tuple(b[0] for b in BESIDE_GREEDY)

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
class Plan:
    """Sizes of a run: `Plan()` a GPU's, `Plan.cpu()` a CPU's, `Plan.quick()` the dry run's and the tests'."""

    batches: tuple[int, ...] = (1, 16, 64, 128, 256)
    prompt_len: int = 512
    spread_batches: tuple[int, ...] = (1, 16, 64, 128, 256)
    spread: tuple[int, int] = (128, 4096)
    warmup_steps: int = 4
    decode_steps: int = 16
    probe_reps: int = 5
    prefill: tuple[tuple[int, int], ...] = ((8, 1024),)
    prefill_reps: int = 3
    hf_batches: tuple[int, ...] = (1, 16, 64)
    sampling_batch: int = 128  # greedy beside temperature 1.0 / top-p 0.9, and beside penalized greedy (0: none)
    overlap_batches: tuple[int, ...] = (1, 64)  # with and without overlap scheduling, where the engine has it
    max_model_len: int = 8192  # a built shape's context window
    prefill_max_tokens: int = 32768
    bw_bytes: int = 4 << 30

    @classmethod
    def cpu(cls) -> Plan:
        return cls(batches=(1, 8, 16, 32), prompt_len=64, spread_batches=(), decode_steps=32, sampling_batch=16,
                   prefill=((1, 512), (8, 128)), prefill_reps=5, hf_batches=(1, 8, 32), max_model_len=2048,
                   prefill_max_tokens=4096, bw_bytes=1 << 30)

    @classmethod
    def quick(cls) -> Plan:
        return cls(batches=(1, 4), prompt_len=32, spread_batches=(1, 4), spread=(16, 96), warmup_steps=2,
                   decode_steps=4, probe_reps=2, prefill=((2, 64),), prefill_reps=2, hf_batches=(1, 4),
                   sampling_batch=4, overlap_batches=(1,),
                   max_model_len=256, prefill_max_tokens=2048, bw_bytes=64 << 20)


# =========================================================================== the model and the machine

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
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
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


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters (tied weights counted once): what one decode step must read."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def matmul_params(model: Any) -> int:
    """Parameters every prompt token goes through: all but the embeddings (the LM head is counted apart)."""
    params = {id(p): p for p in model.parameters()}
    for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
        for p in (emb.parameters() if emb is not None else ()):
            params.pop(id(p), None)
    return sum(p.numel() for p in params.values())


def prefill_flops(cfg, matmul: int, lengths: list[int]) -> float:
    """2 x params x tokens for the layers' matmuls, causal attention (QK^T and PV over half the square), and the
    LM head for each prompt's last token."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = sum(4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * n * (n + 1) / 2 for n in lengths)
    return 2.0 * matmul * sum(lengths) + attn + 2.0 * cfg.vocab_size * cfg.hidden_size * len(lengths)


def _spread_lengths(b: int, lo: int, hi: int) -> list[int]:
    return [(lo + hi) // 2] if b == 1 else [lo + (hi - lo) * i // (b - 1) for i in range(b)]


def _left_pad(prompts: list[list[int]], pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


# =========================================================================== the engine's steps

def _submit_and_wait(eng, prompts: list[list[int]], max_tokens: list[int], tag: str,
                     sampling: dict[str, float] | None = None) -> list:
    """Submit every prompt at (nearly) the same instant, greedy (or with `sampling`'s knobs); the final outputs."""
    from core.sampling import SamplingParams

    knobs = sampling or {"temperature": 0.0}
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **knobs) for m in max_tokens]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # keep the GIL while enqueueing, so the worker sees the whole batch at once
    try:
        streams = [eng.add_request(p, sp, request_id=f"{tag}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    finally:
        sys.setswitchinterval(old)
    finals = []
    for st, m in zip(streams, max_tokens):
        while not (f := st.get(1800.0)).finished:
            pass
        if f.finish_reason != "length" or f.num_output_tokens != m:
            raise RuntimeError(f"request {f.request_id} ended {f.finish_reason!r} after {f.num_output_tokens}/{m} "
                               f"tokens (reject={f.reject_reason!r}, error={f.error!r})")
        finals.append(f)
    return finals


def _probe(eng, fn):
    """`fn(Prober)` on the engine's worker while it is idle (the probes use the real paged cache)."""
    from engine.profiling import Prober

    return eng.run_idle(lambda e: fn(Prober(e)), timeout=3600.0)


def _served_decode(eng, events: list, prompts: list[list[int]], plan: Plan, tag: str,
                   sampling: dict[str, float] | None = None) -> dict[str, Any]:
    """Submit the batch at once, decode `warmup + steps + 1` tokens each; the figures of the decode-only steps
    with the whole batch after the first `warmup` of them (the engine's own step wall time: schedule, forward,
    sampling, postprocess)."""
    b, start = len(prompts), len(events)
    _submit_and_wait(eng, prompts, [plan.warmup_steps + plan.decode_steps + 1] * b, tag, sampling)
    eng.run_idle(lambda e: None, require_idle=False)  # the last step's event is in
    steps = [e for e in events[start:] if e.num_decode == b and e.num_prefill == 0][plan.warmup_steps:]
    steps = steps[:plan.decode_steps]
    if not steps:
        raise RuntimeError(f"no decode-only step of the whole batch of {b} (the scheduler split it)")
    ms = statistics.median(e.wall_ms for e in steps)
    return {"ms_step": ms, "tok_s": b / ms * 1000.0, "steps": len(steps),
            "forward_ms": statistics.median(e.forward_ms for e in steps),
            "mean_context": statistics.mean(e.decode_mean_len for e in steps), "all_ms": [e.wall_ms for e in steps]}


# =========================================================================== the run

def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from engine.config import EngineConfig
    from engine.default_model import build_tokenizer, quiet_progress_bars
    from engine.engine import LLMEngine
    from engine.loader import resolve_device, resolve_dtype
    from engine.testing import TINY_VOCAB
    from scheduling.config import SchedulerConfig

    dev = resolve_device(args.device)
    shape = args.shape or ("llama-8b" if dev.type == "cuda" and not args.model else None)
    plan = Plan.quick() if args.quick else Plan() if dev.type == "cuda" else Plan.cpu()
    for name in ("batches", "spread_batches", "hf_batches"):
        if getattr(args, name) is not None:
            setattr(plan, name, tuple(getattr(args, name)))
    plan.decode_steps = args.decode_steps or plan.decode_steps
    dtype = resolve_dtype(args.dtype, dev)
    dname = str(dtype).removeprefix("torch.")
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
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported in `skipped`; the run goes on and writes what it has
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

    # ---- the model: a checkpoint, or a shape built on the device and written where the engine loads it from
    startup: dict[str, Any] = {}
    folder = None
    if shape:
        tok = build_tokenizer(TINY_VOCAB)
        cfg = shape_config(shape, len(tok), plan.max_model_len)
        t0 = time.perf_counter()
        model = build_shape_model(cfg, dev, dtype)
        _sync(dev)
        startup["build_s"] = time.perf_counter() - t0
        nbytes = weight_bytes(model)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 1.3 * nbytes else None
        path = folder = tempfile.mkdtemp(prefix="kairos-shape-", dir=shm)
        t0 = time.perf_counter()
        with quiet_progress_bars():
            model.save_pretrained(folder)
        tok.save_pretrained(folder)
        startup["save_s"] = time.perf_counter() - t0
        del model
        free_memory()
        _empty_cache(dev)
        log(f"{shape}: {nbytes / 1e9:.2f} GB ({dname}) built on {dev} in {startup['build_s']:.1f} s, written to "
            f"{folder} in {startup['save_s']:.1f} s")
    else:
        path = resolve_model_path(args.model or DEFAULT_MODEL)
        cfg = AutoConfig.from_pretrained(path)

    res: dict[str, Any] = {"decode": [], "spread": [], "prefill": [], "hf": [], **{k: [] for k in SIDES},
                           "overlap": []}
    bmax = max(plan.batches + plan.spread_batches + plan.overlap_batches + (plan.sampling_batch,))
    try:
        sched = SchedulerConfig(policy="fcfs", max_num_seqs=bmax, max_waiting=2 * bmax, prefill_max_batch_size=bmax,
                                prefill_max_tokens=plan.prefill_max_tokens)
        extra = {k: v for k, v in (("gpu_memory_utilization", args.gpu_memory_utilization),
                                   ("kv_cache_memory_gb", args.kv_cache_gb)) if v}
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(model=path, dtype=dname, device=str(dev),
                                     num_threads=args.threads if dev.type == "cpu" else None,
                                     max_model_len=plan.max_model_len if shape else None, scheduler=sched,
                                     overlap=args.overlap, **extra))
        prof = dict(eng.profile_report or {})
        startup.update(engine_init_s=time.perf_counter() - t0, profile_cached=bool(prof.get("cached")),
                       profile_fit_s=None if prof.get("cached") else prof.get("seconds"))
        for k in ("startup_report", "graph_capture_s"):  # phase times, where the engine exposes them
            if getattr(eng, k, None) is not None:
                startup[k] = getattr(eng, k)
        model = eng.bundle.model
        wbytes, params, matmul = weight_bytes(model), sum(p.numel() for p in model.parameters()), matmul_params(model)
        del model
        kv_per_token = (2 * cfg.num_hidden_layers * eng.cache.num_kv_heads * eng.cache.head_dim
                        * torch.empty((), dtype=eng.cache.dtype).element_size())  # K and V, every layer
        log(f"engine ready in {startup['engine_init_s']:.1f} s (latency profile "
            + ("cached" if prof.get("cached") else f"fitted in {prof.get('seconds', float('nan')):.1f} s")
            + f"); KV cache {eng.cache.num_blocks * eng.cache.block_size} tokens")
        events: list = []
        unsubscribe = eng.add_step_observer(events.append)  # called on the engine's thread; append is atomic
        rng = random.Random(0)
        vl = eng.bundle.vocab_limit

        def ids(n: int) -> list[int]:
            return [rng.randrange(vl) for _ in range(n)]

        def probe(lens: list[int]) -> float | None:  # forward + sampling alone, on throwaway requests
            try:
                return statistics.median(_probe(eng, lambda p: [p.decode_ms(lens) for _ in range(plan.probe_reps)]))
            except Exception as e:  # noqa: BLE001 - a figure beside the served one; the run goes on
                log(f"probe of {len(lens)} contexts failed: {e!r}")
                return None

        def ladder(section: str, batches: tuple[int, ...], lens_of) -> None:
            for b in batches:
                if time_left(f"{section} B={b}"):
                    guarded(f"{section} B={b}", lambda b=b: point(section, b, lens_of(b)))

        def point(section: str, b: int, lens: list[int]) -> None:
            bs, extra_tokens = eng.cache.block_size, plan.warmup_steps + plan.decode_steps + 2
            if sum(-(-(n + extra_tokens) // bs) for n in lens) > eng.cache.num_blocks:
                skipped.append(f"{section} B={b} (KV cache too small)")
                return
            d = _served_decode(eng, events, [ids(n) for n in lens], plan, f"{section}{b}-{next(_RUNS)}")
            kv = b * d["mean_context"] * kv_per_token
            bms = (wbytes + kv) / (bw * 1e9) * 1000.0
            d.update(batch=b, contexts=[min(lens), max(lens)], bound_ms=bms, kv_bytes_per_step=kv,
                     ratio_to_bound=d["ms_step"] / bms,
                     probe_ms=probe([n + plan.warmup_steps + plan.decode_steps // 2 for n in lens]))
            res[section].append(d)
            log(f"{section} B={b} ctx {min(lens)}-{max(lens)}: {d['ms_step']:.2f} ms/step, {d['tok_s']:.0f} "
                f"tok/s, {d['ratio_to_bound']:.2f}x the bound ({bms:.2f} ms); forward+sampling alone "
                f"{d['probe_ms'] or float('nan'):.2f} ms")

        def prefill() -> None:
            for n, length in plan.prefill:
                prompts = [ids(length) for _ in range(n)]
                best, all_ = best_of(lambda: _probe(eng, lambda p: p.prefill_ms(prompts)) / 1000.0, plan.prefill_reps,
                                     warmup=1)
                flops = prefill_flops(cfg, matmul, [length] * n)
                p = {"shape": f"{n}x{length}", "ms": best * 1000.0, "tok_s": n * length / best,
                     "tflops": flops / best / 1e12, "flops": flops, "peak_tflops": peak,
                     "pct_of_peak": flops / best / 1e12 / peak * 100.0 if peak else None,
                     "all_ms": [x * 1000.0 for x in all_]}
                res["prefill"].append(p)
                log(f"prefill {p['shape']}: {p['ms']:.1f} ms, {p['tok_s']:.0f} tok/s, {p['tflops']:.2f} TFLOP/s"
                    + (f" ({p['pct_of_peak']:.0f}% of {peak:g})" if peak else ""))

        def side_by_side(section: str, b: int, other: str, run_other) -> None:
            """The served step of batch b at the prompt length, as the engine runs by default and then by `other`
            (`run_other(prompts, tag)`), back to back on the same prompts."""
            prompts = [ids(plan.prompt_len) for _ in range(b)]
            base = _served_decode(eng, events, prompts, plan, f"{section}{b}-{next(_RUNS)}")
            alt = run_other(prompts, f"{section}{b}-{next(_RUNS)}")
            d = {"batch": b, "prompt_len": plan.prompt_len, "ms_step": base["ms_step"],
                 f"{other}_ms_step": alt["ms_step"], "ratio": alt["ms_step"] / base["ms_step"]}
            res[section].append(d)
            log(f"{section} B={b}: {base['ms_step']:.2f} ms/step, {other} {alt['ms_step']:.2f} ms/step "
                f"({d['ratio']:.3f}x)")

        def beside_greedy(section: str, other: str, knobs: dict[str, Any]) -> None:
            side_by_side(section, plan.sampling_batch, other,
                         lambda prompts, tag: _served_decode(eng, events, prompts, plan, tag, knobs))

        def overlap() -> None:
            def without(prompts, tag):
                eng.run_idle(lambda e: setattr(e, "overlap", False))
                try:
                    return _served_decode(eng, events, prompts, plan, tag)
                finally:
                    eng.run_idle(lambda e: setattr(e, "overlap", True))
            for b in plan.overlap_batches:
                if time_left(f"overlap B={b}"):
                    side_by_side("overlap", b, "no_overlap", without)

        guarded("warm-up", lambda: _submit_and_wait(eng, [ids(plan.prompt_len)] * 2, [4, 4], "warm"))
        # cheapest and most asked-for first: a --time-limit-s cut leaves out the spread ladder's large batches
        ladder("decode", plan.batches, lambda b: [plan.prompt_len] * b)
        if time_left("prefill"):
            guarded("prefill", prefill)
        for section, other, knobs, _, _ in BESIDE_GREEDY:
            if plan.sampling_batch and time_left(section):
                guarded(section, functools.partial(beside_greedy, section, other, knobs))
        if eng.overlap and plan.overlap_batches:
            guarded("overlap", overlap)
        ladder("spread", plan.spread_batches, lambda b: _spread_lengths(b, *plan.spread))
        kv_info = {"blocks": eng.cache.num_blocks, "block_size": eng.cache.block_size,
                   "dtype": str(eng.cache.dtype).removeprefix("torch."), "bytes_per_token": kv_per_token}
        rejected = dict(eng.stats().rejected)
        unsubscribe()
        eng.shutdown()
        del eng
        free_memory()
        _empty_cache(dev)

        def hf_section() -> None:  # HF generate on the same weights (a shape: built again, the values do not matter)
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            model = build_shape_model(cfg, dev, dtype) if shape else AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa").to(dev).eval().requires_grad_(False)
            gen = model.generation_config
            eos = gen.eos_token_id if gen.eos_token_id is not None else 0
            pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
            n_new = plan.decode_steps + 1

            @torch.inference_mode()
            def generate(prompts: list[list[int]], n: int) -> float:
                x, mask = _left_pad(prompts, pad)
                x, mask = x.to(dev), mask.to(dev)
                _sync(dev)
                t0 = time.perf_counter()
                model.generate(input_ids=x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, num_beams=1, pad_token_id=pad, use_cache=True)
                _sync(dev)
                return time.perf_counter() - t0

            generate([ids(plan.prompt_len)], n_new)  # warm-up
            for b in plan.hf_batches:
                if not time_left(f"hf B={b}"):
                    continue
                prompts = [ids(plan.prompt_len) for _ in range(b)]
                t_full, t_one = generate(prompts, n_new), generate(prompts, 1)
                ms = max(t_full - t_one, 1e-9) / (n_new - 1) * 1000.0
                res["hf"].append({"batch": b, "ms_step": ms, "tok_s": b / ms * 1000.0, "generate_s": t_full,
                                  "prefill_only_s": t_one})
                log(f"HF generate B={b}: {ms:.2f} ms/step")

        if plan.hf_batches and not args.no_hf and time_left("hf"):
            guarded("hf", hf_section)
            free_memory()
    finally:
        if folder and not args.keep_model:
            shutil.rmtree(folder, ignore_errors=True)

    return {
        "model": shape or args.model or DEFAULT_MODEL, "shape": shape, "model_path": None if shape else path,
        "config": {k: getattr(cfg, k, None) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "max_position_embeddings")},
        "device": str(dev), "gpu": gpu, "dtype": dname, "threads": torch.get_num_threads(), "quick": args.quick,
        "params": params, "weight_bytes": wbytes, "bandwidth_gb_s": bw, "peak_bf16_tflops": peak,
        "bound_definition": "(all weight bytes + the step's KV bytes: batch x mean context x per-token K and V "
                            "bytes) / the copy bandwidth measured in this run",
        "plan": asdict(plan), "startup": startup, "kv_cache": kv_info, "rejected": rejected,
        "decode": res["decode"], "spread": res["spread"], "prefill": res["prefill"], "hf": res["hf"],
        **{k: res[k] for k in SIDES}, "overlap": res["overlap"], "skipped": skipped,
        "versions": _versions(), "commit": info["commit"] or os.environ.get("KAIROS_COMMIT", ""),
        "date": info["date"], "command": info["command"], "env": info, "total_s": time.perf_counter() - t_all}


def _versions() -> dict[str, Any]:
    import torch

    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = None
    return v


# =========================================================================== report

def headline(r: dict[str, Any]) -> str:
    hf = {h["batch"]: h["ms_step"] for h in r["hf"]}

    def cells(rows: list[dict], with_hf: bool = False) -> str:
        return ", ".join(f"B={d['batch']} {d['ms_step']:.1f} ({d['ratio_to_bound']:.1f}x"
                         + (f"; HF {hf[d['batch']]:.1f}" if with_hf and d["batch"] in hf else "") + ")" for d in rows)

    parts = [f"{r['model']} {r['dtype']} on {r['gpu'] or r['device']}: bw {r['bandwidth_gb_s']:.0f} GB/s"]
    if r["decode"]:
        parts.append("decode ms/step (x bound" + ("; HF generate" if hf else "") + ") " + cells(r["decode"], True))
    if r["spread"]:
        parts.append("spread " + cells(r["spread"]))
    if r["prefill"]:
        parts.append("prefill " + ", ".join(f"{p['shape']} {p['tok_s']:.0f} tok/s {p['tflops']:.1f} TFLOP/s"
                                            for p in r["prefill"]))
    for section, _, _, _, name in BESIDE_GREEDY:
        for d in r.get(section, []):
            parts.append(f"{name} at B={d['batch']} {d['ratio']:.3f}x" + (" greedy's step" if section == SIDES[0]
                                                                          else ""))
    if r.get("overlap"):
        parts.append("without overlap " + ", ".join(f"B={d['batch']} {d['ratio']:.2f}x" for d in r["overlap"]))
    return "; ".join(parts)


def write_run_summary(target: str, r: dict[str, Any]):
    figures = {k: r[k] for k in ("model", "shape", "device", "gpu", "dtype", "threads", "params", "weight_bytes",
                                 "bandwidth_gb_s", "peak_bf16_tflops", "bound_definition", "startup", "kv_cache",
                                 "decode", "spread", "prefill", "hf", *SIDES, "overlap", "skipped",
                                 "versions", "total_s")}
    return write_summary(target, r["command"], headline(r), figures, commit=r["commit"])


def print_report(r: dict[str, Any]) -> None:
    st = r["startup"]
    print(f"\n## Kairos engine on {r['gpu'] or r['env']['cpu']}: {r['model']}, {r['params'] / 1e6:.1f}M params, "
          f"{r['weight_bytes'] / 1e9:.2f} GB of weights ({r['dtype']})"
          + (f", {r['threads']} threads" if r["device"] == "cpu" else ""))
    print(f"versions: {r['versions']} | commit {r['commit'] or '?'} | {r['date']}")
    print(f"bandwidth: {r['bandwidth_gb_s']:.0f} GB/s (device-to-device copy, bytes read + written); "
          f"bound = {r['bound_definition']}")
    print("start-up: " + (f"build {st['build_s']:.1f} s + write {st['save_s']:.1f} s (this benchmark); "
                          if "build_s" in st else "") + f"LLMEngine(...) {st['engine_init_s']:.1f} s, of it the "
          "latency profile's fit " + ("(cached)" if st["profile_cached"] else f"{st['profile_fit_s'] or 0:.1f} s")
          + f"; KV cache {r['kv_cache']['blocks'] * r['kv_cache']['block_size']} tokens ({r['kv_cache']['dtype']})")
    hf = {h["batch"]: h["ms_step"] for h in r["hf"]}
    hdr = ["batch", "contexts", "ms/step", "tok/s", "bound ms", "x bound", "fwd+sample ms", "HF ms/step", "steps"]
    for key, title in (("decode", "Decode, prompts of equal length"), ("spread", "Decode, contexts spread evenly")):
        if r[key]:
            print_table(hdr, [[d["batch"], f"{d['contexts'][0]}-{d['contexts'][1]}", d["ms_step"], d["tok_s"],
                               d["bound_ms"], d["ratio_to_bound"], d["probe_ms"],
                               hf.get(d["batch"]) if key == "decode" else None, d["steps"]] for d in r[key]],
                        title=f"{title}: the served step (LLMEngine's step wall time, median of the decode-only "
                              "steps of the whole batch); fwd+sample = that step's forward and sampling alone; HF = "
                              "(generate(n) - generate(1)) / (n - 1)", digits=2)
    for p in r["prefill"]:
        print(f"prefill {p['shape']}: {p['ms']:.1f} ms, {p['tok_s']:.0f} tok/s, {p['tflops']:.2f} TFLOP/s"
              + (f" = {p['pct_of_peak']:.0f}% of {p['peak_tflops']:g} (bf16 dense peak, datasheet)"
                 if p["peak_tflops"] else ""))
    for section, other, _, label, _ in BESIDE_GREEDY:
        for d in r.get(section, []):
            print(f"{section} B={d['batch']}: greedy {d['ms_step']:.2f} ms/step, {label} "
                  f"{d[f'{other}_ms_step']:.2f} ms/step ({d['ratio']:.3f}x)")
    for d in r["overlap"]:
        print(f"overlap scheduling B={d['batch']}: {d['ms_step']:.2f} ms/step, without it {d['no_overlap_ms_step']:.2f} "
              f"ms/step ({d['ratio']:.2f}x)")
    if r["skipped"]:
        print(f"skipped: {', '.join(r['skipped'])}")
    print(f"total {r['total_s']:.0f} s")
    sys.stdout.flush()


# =========================================================================== CLI

def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=f"a checkpoint: kairos-default | kairos-tiny | {DEFAULT_MODEL} (the default on "
                    "the CPU) | a local HF folder")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a Llama of this shape built from a config instead "
                    "(random weights, no download; the default with --device cuda: llama-8b)")
    ap.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:N")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) | float32 | float16 | auto")
    ap.add_argument("--threads", type=int, default=2, help="CPU: torch threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="small sizes and counts (the dry run, tests)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    ap.add_argument("--summary", metavar="NAME", help="keep the headline as bench/summaries/NAME.json (NAME may be "
                    "a path, e.g. $OUT/engine-cuda.json)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--batches", type=_ints, help="decode batches at the prompt length")
    ap.add_argument("--spread-batches", type=_ints, help="decode batches with contexts spread evenly ('' for none)")
    ap.add_argument("--hf-batches", type=_ints, help="HF generate batches ('' for none)")
    ap.add_argument("--decode-steps", type=int, help="timed decode steps per batch (after the warm-up steps)")
    ap.add_argument("--time-limit-s", type=float, help="skip the remaining points once the run has taken this long")
    ap.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak (default: 989 for an H100 or "
                    "H200, by the datasheet; else none)")
    ap.add_argument("--gpu-memory-utilization", type=float, help="the engine's share of the GPU (default its own)")
    ap.add_argument("--kv-cache-gb", type=float, help="the engine's KV cache in GB (default its own)")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto", help="the engine's overlap "
                    "scheduling (auto: on for CUDA); where on, the run also times steps without it")
    ap.add_argument("--keep-model", action="store_true", help="keep a built shape's checkpoint (default: deleted)")
    args = ap.parse_args(argv)
    if args.threads <= 0:
        ap.error("--threads must be positive")
    if args.model and args.shape:
        ap.error("--model and --shape exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)  # before transformers is imported (nothing above imports it)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    report = run(args, argv)
    if args.json:  # before printing: a closed stdout must not lose the figures
        print(f"wrote {write_json(args.json, report)}", file=sys.stderr)
    if args.summary:
        print(f"wrote {write_run_summary(args.summary, report)}", file=sys.stderr)
    print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
