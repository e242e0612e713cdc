"""bench.engine's report: the JSON document and the printed tables."""
from __future__ import annotations

import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from bench.common import LoadLog, print_table
if TYPE_CHECKING:
    from bench.engine import Plan

# =========================================================================== report


def _ratio(a, b):
    try:
        return a / b if a is not None and b else None
    except TypeError:
        return None


def build_report(args, argv, plan: Plan, info: dict, bw: float, eng: dict, hf: dict | None,
                 loads: LoadLog, model_name: str) -> dict[str, Any]:
    wb = eng["weight_bytes"]
    step_bound_s = wb / (bw * 1e9)
    hf = hf or {}
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
            "hf_reps": len(h["all_generate_s"]) if h else None,
        })
    prefill = []
    for shape, e in eng["prefill"].items():
        h = hf.get("prefill", {}).get(shape, {})
        prefill.append({"shape": shape, "engine_tok_s": e["tok_s"], "hf_tok_s": h.get("tok_s"),
                        "engine_ms": e["ms"], "hf_ms": h.get("ms"), "engine_vs_hf": _ratio(e["tok_s"], h.get("tok_s")),
                        "engine_reps": len(e["all_ms"]), "hf_reps": len(h["all_ms"]) if h else None})
    em, hm = eng["mixed"], hf.get("mixed", {})
    mixed = {
        "engine_tok_s": em["tok_s"], "hf_tok_s": hm.get("tok_s"), "engine_wall_s": em["wall_s"],
        "hf_wall_s": hm.get("wall_s"), "engine_vs_hf": _ratio(em["tok_s"], hm.get("tok_s")),
        "requests": plan.mixed_requests, "prompt_len": list(plan.mixed_prompt), "output_len": list(plan.mixed_output),
        "useful_tokens": sum(eng["workloads"].mixed_outputs),
        "prompt_tokens": sum(map(len, eng["workloads"].mixed_prompts)),
        "hf_batch": plan.mixed_hf_batch, "hf_generated_tokens_incl_waste": hm.get("generated_tokens_incl_waste"),
        "engine_ttft_s": em["ttft_s"], "engine_tpot_ms": em["tpot_ms"],
        "engine_all_wall_s": em["all_wall_s"], "hf_all_wall_s": hm.get("all_wall_s"),
    }
    settings = asdict(plan)
    return {
        "model": model_name, "model_path": eng["model_path"], "dtype": eng["torch_dtype"], "threads": args.threads,
        "quick": bool(args.quick), "params": eng["params"], "weight_bytes": wb, "vocab_limit": eng["vocab_limit"],
        "decode": decode, "prefill": prefill, "mixed": mixed,
        "bandwidth_gb_s": bw, "bound_ms_step": step_bound_s * 1000.0,
        "overhead_pct_b32": eng["overhead"]["overhead_pct"], "overhead": eng["overhead"],
        "engine_startup_s": eng["startup_s"], "engine_profile": eng["profile"], "engine_kv_cache": eng["kv_cache"],
        "engine_rejected": eng["rejected"], "engine_upcast_linears": eng["upcast_linears"], "hf_included": bool(hf),
        "cpu": info["cpu"], "loadavg": loads.as_dict(), "date": info["date"], "command": info["command"],
        "env": info, "settings": settings,
    }


def print_report(r: dict[str, Any], plan: Plan) -> None:
    mb = r["weight_bytes"] / 1e6
    print(f"\n## Kairos engine benchmark: {r['model']} ({r['params'] / 1e6:.1f}M params, {mb:.1f} MB of weights), "
          f"{r['dtype']}, {r['threads']} threads{' [quick]' if r['quick'] else ''}")
    env = r["env"]
    print(f"cpu: {r['cpu']} [{' '.join(env.get('cpu_flags', [])) or '?'}] | torch {env.get('torch')} | "
          f"transformers {env.get('transformers')} | {r['date']}")
    print(f"memory bandwidth: {r['bandwidth_gb_s']:.1f} GB/s (torch sum over {plan.bw_gb:g} GB fp32, best of "
          f"{plan.bw_reps}) -> weight-read bound {r['bound_ms_step']:.2f} ms/step")
    prof = r["engine_profile"]
    kv = r["engine_kv_cache"]
    up = r.get("engine_upcast_linears")
    print(f"engine: startup {r['engine_startup_s']:.1f} s (latency profile "
          + ("cached" if prof.get("cached") else f"fitted in {prof.get('seconds', 0):.1f} s")
          + f"); KV cache {kv['tokens']} tokens ({kv['dtype']})"
          + (f"; {up} linears upcast to fp32 GEMM (no native bf16 on this CPU)" if up else "")
          + "; HF: transformers eager, sdpa")
    la = r["loadavg"]
    print(f"loadavg: start {la['start']} | end {la['end']}")
    if la.get("other_cores"):
        print("cores used by other processes, per section: "
              + ", ".join(f"{k} {v:.2f}" for k, v in la["other_cores"].items()))
        if la["max_other_cores"] > 0.25:
            print(f"WARNING: other processes used {la['max_other_cores']:.2f} cores during {la['max_other_section']}: "
                  "this box has 2 cores, so those timings are unreliable (rerun on a quiet box)")
    steps = plan.new_tokens - 1
    budget = ("" if plan.rep_budget_s is None else
              f" (at least {plan.min_reps}, fewer once a configuration has used {plan.rep_budget_s:g} s)")

    def reps(d):
        return f"{d['engine_reps']}/{'-' if d['hf_reps'] is None else d['hf_reps']}"

    print_table(
        ["batch", "engine tok/s", "HF tok/s", "engine/HF", "engine ms/step", "HF ms/step", "bound tok/s",
         "engine % of bound", "reps e/HF"],
        [[d["batch"], d["engine_tok_s"], d["hf_tok_s"], d["engine_vs_hf"], d["engine_ms_step"], d["hf_ms_step"],
          d["bound_tok_s"], d["engine_pct_of_bound"], reps(d)] for d in r["decode"]],
        title=f"Decode: prompt {plan.prompt_len}, {plan.new_tokens} new tokens ({steps} timed decode steps), greedy, "
              f"EOS ignored; best of up to {plan.decode_reps}{budget}; bound = B / (weight bytes / bandwidth)",
        digits=2 if r["quick"] else 1)
    print_table(
        ["shape", "engine tok/s", "HF tok/s", "engine/HF", "engine ms", "HF ms", "reps e/HF"],
        [[p["shape"], p["engine_tok_s"], p["hf_tok_s"], p["engine_vs_hf"], p["engine_ms"], p["hf_ms"], reps(p)]
         for p in r["prefill"]],
        title=f"Prefill (engine: runner.execute + sampling; HF: one forward, logits_to_keep=1); best of up to "
              f"{plan.prefill_reps}{budget}")
    m = r["mixed"]
    print_table(
        ["system", "wall s", "useful tok/s", "speedup"],
        [["engine (all at t=0)", m["engine_wall_s"], m["engine_tok_s"], m["engine_vs_hf"]],
         [f"HF generate (static batches of {m['hf_batch']})", m["hf_wall_s"], m["hf_tok_s"],
          1.0 if m["hf_tok_s"] else None]],
        title=f"Mixed: {m['requests']} requests, prompts U[{m['prompt_len'][0]},{m['prompt_len'][1]}] "
              f"({m['prompt_tokens']} tokens), outputs U[{m['output_len'][0]},{m['output_len'][1]}] "
              f"({m['useful_tokens']} tokens), EOS ignored",
        digits=2)
    t, tp = m["engine_ttft_s"], m["engine_tpot_ms"]
    print(f"engine mixed: TTFT p50 {t['p50']:.2f} s / p99 {t['p99']:.2f} s; TPOT p50 {tp['p50']:.1f} ms / "
          f"p99 {tp['p99']:.1f} ms")
    o = r["overhead"]
    print_table(
        ["schedule ms", "prepare ms", "sample ms", "postprocess ms", "overhead ms", "decode step ms", "overhead %"],
        [[o["schedule_ms"], o["prepare_ms"], o["sample_ms"], o["postprocess_ms"], o["overhead_ms"], o["step_ms"],
          o["overhead_pct"]]],
        title=f"Engine per-step overhead at batch {o['batch']} (everything but the model forward)", digits=2,
        align="r" * 7)
    if any(not d["engine_prefill_aligned"] for d in r["decode"]):
        print("note: in some decode runs the batch was not prefilled in a single step (the window counts "
              "only tokens after the last first token)")
    if r["engine_rejected"]:
        print(f"note: engine rejected requests: {r['engine_rejected']}")
    sys.stdout.flush()
