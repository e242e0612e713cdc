"""What automatic prefix caching saves: requests that share a long system prompt, each with its own question, on two
engines of one model side by side, one with `enable_prefix_caching` and one without.

Each request goes to both engines in turn, one at a time (the engine otherwise idle: its TTFT is its prefill), the
order alternating so that a box whose speed drifts charges both alike. The first request over each system prompt finds
nothing cached; the rest find the system prompt's full blocks. Reports TTFT (p50, p90) of those that could hit, the
prompt tokens each engine computed, and how many replies agree token for token.

    python -m bench.prefix_cache --model kairos-default --system-tokens 1000 --summary prefix-cache-smollm2
"""
from __future__ import annotations

import argparse
import random
from typing import Any, Sequence

from bench.metrics import percentile
from bench.report import command_line, print_table, run_info, write_summary


def _engine(args, caching: bool):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                  max_model_len=args.system_tokens + args.question_tokens + args.max_tokens + 16,
                                  scheduler=SchedulerConfig(policy="fcfs", enable_prefix_caching=caching,
                                                            prefill_max_tokens=4096)))


def _run(eng, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """One request alone: its tokens, TTFT (ms, the engine's) and the prompt tokens found cached."""
    from core.sampling import SamplingParams

    toks, last = [], None
    for last in eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)):
        toks.extend(last.token_ids)
    m = last.metrics
    return toks, (m.first_token_s - m.arrival_s) * 1000.0, m.num_cached_tokens


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=12, help="requests over each system prompt")
    ap.add_argument("--question-tokens", type=int, default=40, help="the longest question (each 8 to this many)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary", default=None)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    engines = {True: _engine(args, True), False: _engine(args, False)}
    try:
        vocab = engines[True].bundle.vocab_limit
        word = lambda: rng.randrange(100, vocab)  # noqa: E731 - past the special tokens
        prompts: list[tuple[bool, list[int]]] = []  # (could hit, prompt)
        for _ in range(args.system_prompts):
            system = [word() for _ in range(args.system_tokens)]
            for k in range(args.questions):
                prompts.append((k > 0, system + [word() for _ in range(rng.randint(8, args.question_tokens))]))
        for eng in engines.values():  # warm-up: a prompt of the same size shares nothing with the measured ones
            _run(eng, [word() for _ in range(args.system_tokens + 20)], args.max_tokens)
        ttft: dict[bool, list[float]] = {True: [], False: []}
        computed = {True: 0, False: 0}
        cached_tokens, agree = 0, 0
        for i, (hit, prompt) in enumerate(prompts):
            out = {}
            for caching in ((True, False) if i % 2 == 0 else (False, True)):
                toks, ms, cached = _run(engines[caching], prompt, args.max_tokens)
                out[caching] = toks
                computed[caching] += len(prompt) - cached
                if hit:
                    ttft[caching].append(ms)
                if caching:
                    cached_tokens += cached
            agree += out[True] == out[False]
    finally:
        for eng in engines.values():
            eng.shutdown()

    rows = [{"prefix caching": "on" if c else "off", "TTFT p50 ms": round(percentile(ttft[c], 50), 1),
             "TTFT p90 ms": round(percentile(ttft[c], 90), 1), "prompt tokens computed": computed[c]}
            for c in (True, False)]
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    speedup = percentile(ttft[False], 50) / percentile(ttft[True], 50)
    total = sum(len(p) for _, p in prompts)
    print(f"{len(prompts)} requests, {total} prompt tokens, {cached_tokens} found cached; TTFT p50 of those over a "
          f"cached system prompt: {speedup:.2f}x faster with caching; replies alike on both: {agree}/{len(prompts)}")
    if args.summary:
        figures: dict[str, Any] = {"rows": rows, "requests": len(prompts), "prompt_tokens": total,
                                   "cached_tokens": cached_tokens, "ttft_p50_speedup": round(speedup, 3),
                                   "replies_alike": agree, "args": vars(args),
                                   "run": run_info("bench.prefix_cache", argv)}
        headline = (f"{args.system_tokens}-token system prompt, {len(prompts)} requests one at a time: TTFT p50 "
                    f"{rows[0]['TTFT p50 ms']} ms with prefix caching, {rows[1]['TTFT p50 ms']} ms without "
                    f"({speedup:.2f}x); prompt tokens computed {computed[True]} / {computed[False]}")
        write_summary(args.summary, command_line("bench.prefix_cache", argv), headline, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
