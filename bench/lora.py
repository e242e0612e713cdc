"""What serving LoRA adapters costs a decode step: one model on two engines side by side, one without adapters and one
serving `--adapters` of rank `--rank` on every projection (PEFT adapters of that model, random, built here), the
same batch of prompts on each, decoding together.

Four points, each the median wall time of the decode steps of the whole batch (schedule, forward, sampling):
`base` (the engine without adapters), `lora-engine base` (the adapters' engine, requests of the base model: what
serving adapters costs requests that use none), `one adapter` (every request through the same adapter) and `mixed`
(the requests spread over every adapter). The points run in turns, `--rounds` times, in an order that rotates, so
that a box whose speed drifts charges all alike; the table has each point's median over the rounds. The base
model's replies on both engines are compared token for token.

    python -m bench.lora --model kairos-default --batch 16 --summary lora-smollm2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench.report import command_line, print_table, run_info, write_summary

POINTS = ("base", "lora-engine base", "one adapter", "mixed")


def _engine(args, adapters: dict[str, str]):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    b = args.batch
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, lora_modules=adapters,
                                  max_lora_rank=max(16, args.rank), max_loras=max(1, len(adapters)),
                                  scheduler=SchedulerConfig(policy="fcfs", max_num_seqs=b, prefill_max_batch_size=b,
                                                            prefill_max_tokens=b * args.prompt_len)))


def _decode(eng, events: list, prompts: list[list[int]], loras: list[str | None], steps: int) -> tuple[float, list]:
    """The batch submitted at once, `steps + 4` tokens each: the median wall ms of its decode steps of the whole
    batch after the first two, and the replies."""
    from core.sampling import SamplingParams

    start, b = len(events), len(prompts)
    sp = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the worker sees the whole batch at once
    try:
        streams = [eng.add_request(p, sp, lora=lo) for p, lo in zip(prompts, loras)]
    finally:
        sys.setswitchinterval(old)
    replies = [[t for o in s for t in o.token_ids] for s in streams]
    eng.run_idle(lambda e: None, require_idle=False)  # the last step's event is in
    ms = [e.wall_ms for e in events[start:] if e.num_decode == b and e.num_prefill == 0][2:]
    if not ms:
        raise RuntimeError("no decode step of the whole batch (the scheduler split it)")
    return statistics.median(ms), replies


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps measured per point and round")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--summary", default=None)
    args = ap.parse_args(argv)

    import random

    from bench.driver import resolve_model_path
    from engine.testing import build_tiny_lora

    args.model = str(resolve_model_path(args.model))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kairos-lora-bench-") as tmp:
        adapters = {f"a{i}": str(build_tiny_lora(args.model, Path(tmp) / f"a{i}", seed=i, r=args.rank,
                                                 alpha=2 * args.rank)) for i in range(args.adapters)}
        engines = {"plain": _engine(args, {}), "lora": _engine(args, adapters)}
        events: dict[str, list] = {k: [] for k in engines}
        for k, eng in engines.items():
            eng.add_step_observer(events[k].append)
        names = list(adapters)
        b = args.batch
        runs = {"base": ("plain", [None] * b), "lora-engine base": ("lora", [None] * b),
                "one adapter": ("lora", [names[0]] * b), "mixed": ("lora", [names[i % len(names)] for i in range(b)])}
        ms: dict[str, list[float]] = {p: [] for p in POINTS}
        alike = total = 0
        try:
            vocab = engines["plain"].bundle.vocab_limit
            for r in range(args.rounds + 1):  # round 0 warms both engines up (not counted)
                prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
                order = POINTS[r % len(POINTS):] + POINTS[:r % len(POINTS)]
                replies = {}
                for point in order:
                    which, loras = runs[point]
                    t, replies[point] = _decode(engines[which], events[which], prompts, loras, args.steps)
                    if r:
                        ms[point].append(t)
                alike += sum(x == y for x, y in zip(replies["base"], replies["lora-engine base"]))
                total += b
        finally:
            for eng in engines.values():
                eng.shutdown()

    med = {p: statistics.median(ms[p]) for p in POINTS}
    rows = [{"point": p, "ms/step": round(med[p], 2), "tok/s": round(b / med[p] * 1000.0, 1),
             "x base": round(med[p] / med["base"], 3)} for p in POINTS]
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    print(f"batch {b}, {args.adapters} adapters of rank {args.rank} on every projection; base replies alike on both "
          f"engines: {alike}/{total}")
    if args.summary:
        figures: dict[str, Any] = {"rows": rows, "ms_by_round": ms, "base_replies_alike": [alike, total],
                                   "args": vars(args), "run": run_info("bench.lora", argv)}
        headline = (f"decode B={b}, rank {args.rank}: an adapter {rows[2]['x base']}x the base step, "
                    f"{args.adapters} adapters mixed {rows[3]['x base']}x, base requests on the adapters' engine "
                    f"{rows[1]['x base']}x")
        write_summary(args.summary, command_line("bench.lora", argv), headline, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
