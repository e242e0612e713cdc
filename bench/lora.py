"""What serving LoRA adapters costs a decode step: one model on two engines side by side, each in a process of its own
(as a Serve replica runs its engine), one without adapters and one serving `--adapters` of rank `--rank` on every
projection (PEFT adapters of that model, random, built here), the same batch of prompts on each, decoding together.

Four points, each the median time between two tokens of the batch's requests once all decode together (a decode
step of the whole batch, as its requests see it): `base` (the engine without adapters), `lora-engine base` (the
adapters' engine, requests of the base model: what serving adapters costs requests that use none), `one adapter`
(every request through the same adapter) and `mixed` (the requests spread over every adapter). The points run in
turns, `--rounds` times, in an order that rotates, so that a box whose speed drifts charges all alike; the table has
each point's median over the rounds, and what each engine's latency model predicts of such a step (the adapters'
engine's with and without its price of the step's adapters, `LatencyModel.lora_ms`). The base model's replies on both
engines are compared token for token. (Two engines in one process share its OpenMP threads, and each slows the
other's steps.)

What loading an adapter on demand costs the requests running meanwhile (`load stall`), the adapters' engine alone in
this process: a batch of base requests decodes; once it has made a few tokens a request names an adapter of
`dynamic_lora_loading_path` not loaded yet. The longest gap between two tokens of a base request is compared with
their median gap, with the load run on the engine's worker between two steps (`LoraRegistry.loader` None) and on its
loader thread beside the steps (the engine's way), in turns over the rounds; `build ms` is an adapter's load alone
(read, laid out, packed).

    python -m bench.lora --model kairos-default --batch 16 --summary lora-smollm2
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench.report import command_line, print_table, run_info, write_summary

POINTS = ("base", "lora-engine base", "one adapter", "mixed")
SKIP_TOKENS = 4  # a request's first gaps, before the whole batch decodes together


def _config(args, adapters: dict[str, str], dynamic: str | None = None, profile: str | None = None):
    from engine.config import EngineConfig
    from scheduling.config import SchedulerConfig

    b = args.batch
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, lora_modules=adapters,
                        dynamic_lora_loading_path=dynamic, max_lora_rank=max(16, args.rank),
                        max_loras=max(1, len(adapters)),
                        scheduler=SchedulerConfig(policy="fcfs", max_num_seqs=b, prefill_max_batch_size=b,
                                                  prefill_max_tokens=b * args.prompt_len, predictor_path=profile))


def _decode(eng, prompts: list[list[int]], loras: list[str | None], steps: int, tag: str) -> tuple[float, list]:
    """The batch submitted at once to an engine in its own process (`EngineCoreClient`), `steps + SKIP_TOKENS`
    tokens each: the median time between two tokens of its requests after their first SKIP_TOKENS, and the
    replies."""
    from core.messages import GenerateRequest
    from core.sampling import SamplingParams

    sp = SamplingParams(max_tokens=steps + SKIP_TOKENS, temperature=0.0, ignore_eos=True)
    streams = [eng.generate(GenerateRequest(f"{tag}-{i}", prompt=tuple(p), params=sp, lora=lo))
               for i, (p, lo) in enumerate(zip(prompts, loras))]
    items = [list(s) for s in streams]
    gaps = [(b - a) * 1000.0 for it in items for t in [it[-1].metrics.token_times[SKIP_TOKENS:]]
            for a, b in zip(t, t[1:])]
    return statistics.median(gaps), [[t for o in it for t in o.token_ids] for it in items]


def _load_stall(eng, prompts: list[list[int]], adapter: str, steps: int, on_worker: bool) -> tuple[float, float]:
    """The base requests of `prompts` decoding `steps` tokens each, and a request of the adapter folder `adapter`
    (not loaded yet) arriving once they have made a few: (their longest gap between two tokens, their median gap),
    ms. `on_worker`: the load runs on the engine's worker (else on its loader thread)."""
    from core.sampling import SamplingParams

    loader = eng.run_idle(lambda e: e.loras.loader)
    eng.run_idle(lambda e: setattr(e.loras, "loader", None if on_worker else loader))
    try:
        sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        streams = [eng.add_request(p, sp) for p in prompts]
        first, seen, made = iter(streams[0]), None, 0
        while made < min(8, steps // 4) and (seen is None or not seen.finished):
            seen = next(first)  # (a step's tokens may come in one output, the last one too)
            made += len(seen.token_ids)
        lora = eng.add_request(prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                               lora=f"m:{adapter}")
        finals = [([seen] + list(first))[-1]] + [list(s)[-1] for s in streams[1:]]
        list(lora)
    finally:
        eng.run_idle(lambda e: setattr(e.loras, "loader", loader))
    gaps = [(b - a) * 1000.0 for f in finals for a, b in zip(f.metrics.token_times, f.metrics.token_times[1:])]
    return max(gaps), statistics.median(gaps)


def _restack_ms(decoder, adapters: list) -> dict[str, float]:
    """A new set of `adapters` stacked for a step (`LoraStacks.build`), median ms of 3: as the decoder's matmul
    strategy stacks them (a CPU's: its packed weights copied as they are), and with the stacked matrices packed
    anew."""
    import types

    from engine.lora import LoraStacks

    mm = decoder.mm
    anew = types.SimpleNamespace(pack=mm.pack, copies_weights=mm.copies_weights)  # (no `stack`)
    out = {}
    for name, strategy in (("as packed", mm), ("packed anew", anew)):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            LoraStacks.build(adapters, strategy)
            ts.append((time.perf_counter() - t0) * 1000.0)
        out[name] = round(statistics.median(ts), 2)
    return out


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
    from engine.core_proc import EngineCoreClient
    from engine.engine import LLMEngine
    from engine.lora import LoraSpec
    from engine.testing import build_tiny_lora

    args.model = str(resolve_model_path(args.model))
    rng = random.Random(0)
    b = args.batch
    with tempfile.TemporaryDirectory(prefix="kairos-lora-bench-") as tmp:
        adapters = {f"a{i}": str(build_tiny_lora(args.model, Path(tmp) / f"a{i}", seed=i, r=args.rank,
                                                 alpha=2 * args.rank)) for i in range(args.adapters)}
        fresh = Path(tmp) / "on-demand"  # adapters loaded at a request, one new one for each measurement
        for i in range(2 * (args.rounds + 1)):
            build_tiny_lora(args.model, fresh / f"d{i}", seed=100 + i, r=args.rank, alpha=2 * args.rank)
        names = list(adapters)
        runs = {"base": ("plain", [None] * b), "lora-engine base": ("lora", [None] * b),
                "one adapter": ("lora", [names[0]] * b), "mixed": ("lora", [names[i % len(names)] for i in range(b)])}
        ms: dict[str, list[float]] = {p: [] for p in POINTS}
        alike = total = 0
        engines = {}
        try:
            # (each profiled afresh, alone: its predictions are of this box now)
            engines["plain"] = EngineCoreClient(_config(args, {}, profile=f"{tmp}/plain.json"))
            engines["lora"] = EngineCoreClient(_config(args, adapters, profile=f"{tmp}/lora.json"))
            vocab = engines["plain"].inputs.vocab_limit
            for r in range(args.rounds + 1):  # round 0 warms both engines up (not counted)
                prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
                order = POINTS[r % len(POINTS):] + POINTS[:r % len(POINTS)]
                replies = {}
                for point in order:
                    which, loras = runs[point]
                    t, replies[point] = _decode(engines[which], prompts, loras, args.steps, f"r{r}-{point}")
                    if r:
                        ms[point].append(t)
                alike += sum(x == y for x, y in zip(replies["base"], replies["lora-engine base"]))
                total += b
            models = {k: eng.latency_model for k, eng in engines.items()}
        finally:
            for eng in engines.values():
                eng.shutdown()
        # the load stall: the adapters' engine alone in this process
        stall: dict[str, list[tuple[float, float]]] = {"on the worker": [], "on the loader": []}
        eng = LLMEngine(_config(args, adapters, str(fresh)))
        try:
            for r in range(args.rounds + 1):
                prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(b)]
                for j, where in enumerate(sorted(stall, key=lambda w: (w == "on the worker") == bool(r % 2))):
                    got = _load_stall(eng, prompts, f"d{2 * r + j}", args.steps, where == "on the worker")
                    if r:
                        stall[where].append(got)
            build_ms = []
            for _ in range(3):
                t0 = time.perf_counter()
                eng.run_idle(lambda e: e.runner.decoder.build_lora(LoraSpec("x", str(fresh / "d0")), 0,
                                                                   e.loras.max_rank))
                build_ms.append((time.perf_counter() - t0) * 1000.0)
            restack = eng.run_idle(lambda e: _restack_ms(e.runner.decoder, [
                a for a in e.runner.decoder.loras.values() if a.name in adapters]))
        finally:
            eng.shutdown()

    med = {p: statistics.median(ms[p]) for p in POINTS}
    ctx = args.prompt_len + SKIP_TOKENS + args.steps / 2  # the steps' mean context
    adapters_in = {"base": 0, "lora-engine base": 0, "one adapter": 1, "mixed": min(b, args.adapters)}

    def predicted(point: str, priced: bool) -> float | None:
        model = models[runs[point][0]]
        if model is None:
            return None
        return round(model.itl_ms(b, ctx) + (model.lora_ms(adapters_in[point], b) if priced else 0.0), 2)

    rows = [{"point": p, "ms/step": round(med[p], 2), "tok/s": round(b / med[p] * 1000.0, 1),
             "x base": round(med[p] / med["base"], 3), "predicted ms": predicted(p, True),
             "unpriced ms": predicted(p, False)} for p in POINTS]
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    print(f"batch {b}, {args.adapters} adapters of rank {args.rank} on every projection; base replies alike on both "
          f"engines: {alike}/{total}")
    srows = [{"load stall": w, "longest gap ms": round(statistics.median([g for g, _ in v]), 2),
              "median gap ms": round(statistics.median([m for _, m in v]), 2)} for w, v in stall.items()]
    print_table(list(srows[0]), [list(r.values()) for r in srows])
    build = round(statistics.median(build_ms), 2)
    print(f"an adapter's load alone (build ms, median of 3): {build}; each gap: the median over the rounds")
    print(f"a new set of the {args.adapters} adapters stacked for a step (ms, median of 3): {restack}")
    if args.summary:
        figures: dict[str, Any] = {"rows": rows, "ms_by_round": ms, "base_replies_alike": [alike, total],
                                   "load_stall": srows, "load_stall_by_round": stall, "build_ms": build,
                                   "restack_ms": restack,
                                   "args": vars(args), "run": run_info("bench.lora", argv)}
        headline = (f"decode B={b}, rank {args.rank}: an adapter {rows[2]['x base']}x the base step, "
                    f"{args.adapters} adapters mixed {rows[3]['x base']}x, base requests on the adapters' engine "
                    f"{rows[1]['x base']}x; a load on demand: base requests' longest gap {srows[1]['longest gap ms']} "
                    f"ms (loader thread), {srows[0]['longest gap ms']} ms on the worker, median gap "
                    f"{srows[1]['median gap ms']} ms; mixed step predicted {rows[3]['predicted ms']} ms "
                    f"({rows[3]['unpriced ms']} without the adapters' price); a new set of {args.adapters} stacked "
                    f"{restack['as packed']} ms ({restack['packed anew']} packed anew)")
        write_summary(args.summary, command_line("bench.lora", argv), headline, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
