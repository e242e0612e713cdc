"""bench.engine's baseline: HF transformers `generate` / forward on the same model and workloads."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from bench.common import LoadLog, best_of
from bench.models import free_memory
if TYPE_CHECKING:
    from bench.engine import Plan, Workloads

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
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine.loader import resolve_dtype

    loads.mark("hf_load")
    hf_logging.set_verbosity_error()
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
    tdtype = resolve_dtype(dtype, torch.device("cpu"), getattr(cfg, "dtype", None))
    log(f"HF: loading {path} ({tdtype}, sdpa) ...")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    gcfg = model.generation_config
    eos = gcfg.eos_token_id if gcfg.eos_token_id is not None else cfg.eos_token_id
    pad = gcfg.pad_token_id if gcfg.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    res: dict[str, Any] = {}

    @torch.inference_mode()
    def generate(ids, mask, n: int) -> float:
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, num_beams=1, pad_token_id=pad, use_cache=True)
        dt = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"HF generate produced {out.shape[1] - ids.shape[1]} tokens, expected {n}")
        return dt

    @torch.inference_mode()
    def prefill_once(ids, mask) -> float:
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        out.logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - t0

    try:
        # warm-up: page in the weights, size the allocator
        bmax = max(plan.batches)
        ids, mask = _left_pad(w.decode[bmax], pad)
        generate(ids, mask, min(4, plan.new_tokens))

        loads.mark("hf_decode")
        decode = {}
        for bsz in plan.batches:
            ids, mask = _left_pad(w.decode[bsz], pad)
            t_full, all_full = best_of(lambda: generate(ids, mask, plan.new_tokens), plan.decode_reps,
                                       budget_s=plan.rep_budget_s, min_reps=plan.min_reps)
            t_pre, all_pre = best_of(lambda: generate(ids, mask, 1), plan.decode_reps, budget_s=plan.rep_budget_s,
                                     min_reps=plan.min_reps)
            dt = max(t_full - t_pre, 1e-9)
            steps = plan.new_tokens - 1
            decode[bsz] = {"tok_s": bsz * steps / dt, "ms_step": dt / steps * 1000.0, "generate_s": t_full,
                           "prefill_only_s": t_pre, "all_generate_s": all_full, "all_prefill_only_s": all_pre}
            log(f"HF decode B={bsz}: {decode[bsz]['tok_s']:.1f} tok/s, {decode[bsz]['ms_step']:.2f} ms/step")
        res["decode"] = decode

        loads.mark("hf_prefill")
        prefill = {}
        for shape, prompts in w.prefill.items():
            ids, mask = _left_pad(prompts, pad)
            best, all_ = best_of(lambda: prefill_once(ids, mask), plan.prefill_reps, warmup=1,
                                 budget_s=plan.rep_budget_s, min_reps=plan.min_reps)
            tokens = sum(len(p) for p in prompts)
            prefill[shape] = {"tok_s": tokens / best, "ms": best * 1000.0, "all_ms": [x * 1000.0 for x in all_]}
            log(f"HF prefill {shape}: {prefill[shape]['tok_s']:.0f} tok/s ({prefill[shape]['ms']:.1f} ms)")
        res["prefill"] = prefill

        loads.mark("hf_mixed")
        runs = []
        for _ in range(plan.mixed_reps):
            wall, useful, computed = 0.0, 0, 0
            k = plan.mixed_hf_batch
            for i in range(0, len(w.mixed_prompts), k):
                prompts, outs = w.mixed_prompts[i:i + k], w.mixed_outputs[i:i + k]
                ids, mask = _left_pad(prompts, pad)
                n = max(outs)
                wall += generate(ids, mask, n)
                useful += sum(outs)
                computed += n * len(prompts)
            runs.append({"wall_s": wall, "tok_s": useful / wall, "useful_tokens": useful,
                         "generated_tokens_incl_waste": computed, "batch": k})
            log(f"HF mixed: {wall:.1f} s wall, {useful / wall:.1f} useful tok/s")
        best = min(runs, key=lambda r: r["wall_s"])
        best["all_wall_s"] = [r["wall_s"] for r in runs]
        res["mixed"] = best
    finally:
        del model
        free_memory()
    return res
