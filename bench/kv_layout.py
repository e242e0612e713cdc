"""A decode step's time by where its requests' KV blocks lie in the cache, on this machine's engine.

    python -m bench.kv_layout                                   # kairos-tiny, 8 and 16 rows, contexts about 300/600
    python -m bench.kv_layout --rows 16 --ctx 600 --summary kv-layout-zen4

Requests come and go through a cache of the engine's size (`--arrivals` of them, `--rows` running at a time, each
with a prompt of 20 to 2 x ctx tokens and a reply of 1 to 2 x ctx, one token a step), their blocks handed out by
`lowest`, this checkout's `core.kv.BlockManager` (the lowest-numbered free blocks), and by `freed`, a free list in
the order blocks were freed (what the BlockManager did before). The running requests the churn leaves (the same
requests in both: the churn does not depend on where blocks go) then decode, timed, beside `compact`, the same
requests with their blocks side by side from block 0, which is how the engine's latency probes lay them out. Each
figure is the median over `--reps` rounds of the median of `--steps` steps, the layouts taking turns within a round
(the box's speed drifts by tens of percent within a minute: only figures taken side by side compare).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import deque
from typing import Any, Sequence

from bench.report import print_table, run_info, write_summary
from core.kv import BlockManager

MODULE = "bench.kv_layout"
LAYOUTS = ("lowest", "freed", "compact")


class FreedOrderBlocks(BlockManager):
    """Blocks handed out in the order they were freed: the free list a FIFO queue instead of the heap."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free = deque(self._free)  # type: ignore[assignment]

    def ensure(self, seq: Any, num_tokens: int) -> None:
        for _ in range(self.extra_blocks_for(seq, num_tokens)):
            seq.block_table.append(self._free.popleft())  # type: ignore[attr-defined]

    def free(self, seq: Any) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []


class _Seq:
    def __init__(self, tokens: int, end: int) -> None:
        self.block_table: list[int] = []
        self.tokens, self.end = tokens, end


def churn(blocks: BlockManager, rows: int, ctx: int, arrivals: int, seed: int) -> list[tuple[list[int], int]]:
    """(block table, tokens) of the `rows` requests running after `arrivals` have come, `rows` at a time."""
    rng = random.Random(seed)
    running: list[_Seq] = []
    for _ in range(arrivals):
        while len(running) >= rows:  # steps until one ends: each running request gains a token
            for s in running:
                s.tokens += 1
                blocks.ensure(s, s.tokens)
            for s in [s for s in running if s.tokens >= s.end]:
                running.remove(s)
                blocks.free(s)
        prompt = rng.randint(20, 2 * ctx)
        s = _Seq(prompt, prompt + rng.randint(1, 2 * ctx))
        if not blocks.can_fit(s, prompt):
            raise SystemExit(f"the churn needs more than the cache's {blocks.num_blocks} blocks: lower --rows/--ctx")
        blocks.ensure(s, prompt)
        running.append(s)
    return [(list(s.block_table), s.tokens) for s in running]


def compact(layout: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    out, at = [], 0
    for table, n in layout:
        out.append((list(range(at, at + len(table))), n))
        at += len(table)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    ap.add_argument("--rows", default="8,16", help="running requests (comma list)")
    ap.add_argument("--ctx", default="300,600", help="the churn's length scale (comma list; see above)")
    ap.add_argument("--arrivals", type=int, default=3000, help="requests that come and go before the timing")
    ap.add_argument("--steps", type=int, default=25, help="decode steps per timing")
    ap.add_argument("--reps", type=int, default=8, help="rounds (the median is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary", metavar="NAME", help="keep the figures as bench/summaries/NAME.json")
    args = ap.parse_args(argv)

    import torch

    from bench.driver import resolve_model_path
    from core.request import Request
    from core.sampling import SamplingParams
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    extra = {} if args.block_size is None else {"block_size": args.block_size}
    eng = LLMEngine(EngineConfig(model=resolve_model_path(args.model), device="cpu", dtype=args.dtype, **extra))
    try:
        nb, bs = eng.cache.num_blocks, eng.cache.block_size
        gen = torch.Generator().manual_seed(args.seed)
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def requests(layout: list[tuple[list[int], int]]) -> list[Request]:
            out = []
            for i, (table, n) in enumerate(layout):
                r = Request(f"kv-{i}", torch.randint(eng.bundle.vocab_limit, (n,), generator=gen).tolist(), params)
                r.block_table, r.num_computed_tokens = list(table), n - 1
                out.append(r)
            return out

        def step_ms(reqs: list[Request]) -> float:
            t = time.perf_counter()
            eng.sampler.sample(eng.runner.execute([], reqs), reqs)
            return (time.perf_counter() - t) * 1000.0

        table, figures = [], []
        for rows in [int(x) for x in args.rows.split(",") if x.strip()]:
            for ctx in [int(x) for x in args.ctx.split(",") if x.strip()]:
                lowest = churn(BlockManager(nb, bs), rows, ctx, args.arrivals, args.seed)
                freed = churn(FreedOrderBlocks(nb, bs), rows, ctx, args.arrivals, args.seed)
                cases = {"lowest": requests(lowest), "freed": requests(freed), "compact": requests(compact(lowest))}
                times: dict[str, list[float]] = {k: [] for k in cases}
                for _ in range(args.reps):
                    for k, reqs in cases.items():
                        step_ms(reqs)  # warm
                        times[k].append(statistics.median(step_ms(reqs) for _ in range(args.steps)))
                med = {k: statistics.median(v) for k, v in times.items()}
                spans = {k: max(max(t) for t, _ in lay) + 1 for k, lay in (("lowest", lowest), ("freed", freed))}
                mean_ctx = sum(n for _, n in lowest) / len(lowest)
                row: dict[str, Any] = {"rows": rows, "ctx_scale": ctx, "mean_context": round(mean_ctx, 1),
                                       "block_span": spans, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                                       "freed_over_lowest": round(med["freed"] / med["lowest"], 3),
                                       "lowest_over_compact": round(med["lowest"] / med["compact"], 3)}
                figures.append(row)
                table.append([rows, f"{mean_ctx:.0f}", f"{spans['lowest']} / {spans['freed']}",
                              *(f"{med[k]:.3f}" for k in LAYOUTS), f"{row['freed_over_lowest']:.3f}",
                              f"{row['lowest_over_compact']:.3f}"])
        print_table(["rows", "mean context", "blocks spanned (lowest / freed)", "lowest ms", "freed ms", "compact ms",
                     "freed / lowest", "lowest / compact"], table,
                    title=f"decode step by KV layout ({args.model} {args.dtype}, cache {nb} blocks of {bs}; median of "
                          f"{args.reps} x {args.steps} steps)")
        if args.summary:
            info = run_info(MODULE, argv)
            parts = [f"{f['rows']} rows at {f['mean_context']:.0f} tokens: freed order {f['freed_over_lowest']:.2f}x "
                     f"lowest-first" for f in figures]
            write_summary(args.summary, info["command"], "decode step by KV block layout: " + ", ".join(parts),
                          {"run": info, "model": args.model, "dtype": args.dtype, "num_blocks": nb, "block_size": bs,
                           "arrivals": args.arrivals, "steps": args.steps, "reps": args.reps, "figures": figures})
    finally:
        eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
