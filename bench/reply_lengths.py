"""How long a served model answers ShareGPT's held-out first turns, against the reference replies the length
predictor learned and the predictor's own expectation: the scale that kairos's length calibration
(`scheduling.length_predictor.LengthCalibration`) learns on a replica serving this model.

    python -m bench.reply_lengths [--model kairos-default] [--num-prompts 48] [--max-tokens 1536]
        [--temperature 0.7] [--top-p 0.9] [--summary reply-lengths-kairos-default]

The engine runs in-process. The prompts are the held-out first turns in bench.workload's seed-0 order whose question
and reference reply pass the benchmarks' filters in the model's tokens, each sent as a chat request. It reports the
ratios of the sums (the replies' over the references', the replies' and the references' over the predictor's
expected lengths, the predictor bound to the model's tokenizer as a replica binds it), the medians, and how many
replies reached `--max-tokens`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def held_out_turns(tokenizer: Any, n: int) -> list[tuple[str, int]]:
    """The first `n` held-out first turns (question, reference reply length in `tokenizer`'s tokens) that pass the
    benchmarks' filters."""
    from bench import workload as W

    pairs = W.first_turns(W.read_conversations())
    out: list[tuple[str, int]] = []
    for i in W.sample_order(len(pairs), 0):
        q, a = pairs[i]
        nq = len(tokenizer(q, add_special_tokens=False)["input_ids"])
        na = len(tokenizer(a, add_special_tokens=False)["input_ids"])
        if W.SHAREGPT_MIN <= nq <= W.SHAREGPT_MAX_PROMPT and na >= W.SHAREGPT_MIN and nq + na <= W.SHAREGPT_MAX_TOTAL:
            out.append((q, na))
            if len(out) >= n:
                break
    return out


def figures_of(rows: list[dict[str, float]], cap: int) -> dict[str, Any]:
    """The run's figures from its rows (`out`: the reply's tokens, `ref`: the reference's, `pred`: the predictor's
    expected length)."""
    out, ref, pred = ([r[k] for r in rows] for k in ("out", "ref", "pred"))
    return {"n": len(rows), "replies_over_references": sum(out) / sum(ref),
            "replies_over_predicted": sum(out) / sum(pred), "references_over_predicted": sum(ref) / sum(pred),
            "median_reply": statistics.median(out), "median_reference": statistics.median(ref),
            "median_predicted": statistics.median(pred), "at_cap": sum(1 for x in out if x >= cap)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=1536)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json")
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--num-prompts and --max-tokens must be positive")

    from core.messages import ChatTurn
    from core.sampling import SamplingParams
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.length_predictor import conditional_means

    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    try:
        tok = eng.tokenizer
        turns = held_out_turns(tok, args.num_prompts)
        lengths = eng.scheduler.lengths
        if lengths is None:
            raise SystemExit(f"{args.model}: the scheduler has no length predictor to compare with")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        t0 = time.perf_counter()
        streams = [eng.add_request(None, params, messages=[ChatTurn("user", q)]) for q, _ in turns]
        rows = []
        for (q, ref), stream in zip(turns, streams):
            final = None
            for final in stream:
                pass
            ids = tok(q, add_special_tokens=False)["input_ids"]
            rows.append({"out": final.num_output_tokens, "ref": ref,
                         "pred": conditional_means(lengths.probs(ids), lengths.scale)[0]})
        wall = time.perf_counter() - t0
    finally:
        eng.shutdown()
    figures = {**figures_of(rows, args.max_tokens), "model": args.model, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "top_p": args.top_p, "wall_s": round(wall, 1)}
    head = (f"{args.model} on {figures['n']} held-out ShareGPT first turns (temperature {args.temperature}): replies "
            f"{figures['replies_over_references']:.2f}x the references' tokens, {figures['at_cap']} at the "
            f"{args.max_tokens}-token cap; the predictor expected {1 / figures['references_over_predicted']:.2f}x "
            f"the references'")
    print(head)
    if args.summary:
        from bench.report import command_line, write_summary

        print(f"summary -> {write_summary(args.summary, command_line('bench.reply_lengths', argv), head, figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
