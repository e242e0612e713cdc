"""The serving replica's own Python work per streamed chunk, beside its HTTP write: what bounds the chunks a second one
event loop can stream (deployments/pacing.py's budgets).

    python -m bench.front                                   # this checkout
    python -m bench.front --against /tmp/base               # beside another checkout's code, alternating
    python -m bench.front --against /tmp/base --summary front-chunk-zen4

Per chunk, what `LLMReplica.generate` and `OpenAIFrontend._sse` do with a stream item that carries `--tokens` tokens
of text: its inter-token latency and its tokens onto the replica's metrics (`ReplicaMetrics.on_itl`, `on_tokens`),
and its SSE bytes (`_sse_item`, with the stream's `TextChunks` where the checkout has them); each request's end
(`on_finished`) every `--reply` chunks. The metrics are Ray's own (a local Ray instance, one CPU), as a replica
records them; Serve's replica tags are absent outside a replica. Left out: the engine's delivery into the stream
(`bench.host`'s `client` row), the pacing, the ASGI send and the socket. Each figure is the median of `--reps`
timings of `--chunks` chunks, the checkouts taking turns in one process (the box's speed moves by tens of percent
within a minute: only figures taken side by side compare). `--against DIR` loads DIR's deployments/metrics.py and
deployments/ingress.py; the rest is this checkout's.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from bench.report import print_table, run_info, write_summary
from core.messages import RequestOutput
from core.request import SLO

MODULE = "bench.front"
ROOT = Path(__file__).resolve().parent.parent


def load(root: Path, rel: str, name: str) -> ModuleType:
    """`root`/`rel` as a module of its own (`name`), importing this checkout's packages."""
    spec = importlib.util.spec_from_file_location(name, root / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def chunk_loop(metrics_mod: ModuleType, ingress_mod: ModuleType, kind: str, tokens: int, reply: int,
               tag: str) -> Callable[[int], float]:
    """A function timing `n` chunks of one checkout's per-chunk work (seconds)."""
    m = metrics_mod.ReplicaMetrics(f"front-{tag}")
    sse_item = ingress_mod._sse_item
    chunks_cls = getattr(ingress_mod, "TextChunks", None)
    takes_fast = "fast" in inspect.signature(sse_item).parameters
    rid, model, created = "chatcmpl-0123456789abcdef", "meta-llama/Llama-3.1-8B-Instruct", int(time.time())
    item = RequestOutput(rid, " word" * tokens, list(range(7, 7 + tokens)), num_prompt_tokens=200,
                         num_output_tokens=tokens)
    final = RequestOutput(rid, "", [], num_prompt_tokens=200, num_output_tokens=reply * tokens, finished=True,
                          finish_reason="stop")
    tier, slo = "ttft500_tpot50", SLO(ttft_ms=500.0, tpot_ms=50.0)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        fast = chunks_cls(kind, rid, model, created, False) if chunks_cls is not None else None
        for i in range(n):
            m.on_itl(tier, 0.02 / tokens, tokens)
            m.on_tokens(tier, tokens)
            if takes_fast:
                sse_item(item, kind, rid, model, created, False, 0, False, fast)
            else:
                sse_item(item, kind, rid, model, created, False, 0, False)
            if i % reply == reply - 1:
                m.on_finished(tier, slo, final, reply * tokens)
        return time.perf_counter() - t0

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=None, help="another checkout's root, timed beside this one")
    ap.add_argument("--kind", choices=("chat", "completion"), default="chat")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per chunk (1: a stream keeping up; more: merged)")
    ap.add_argument("--reply", type=int, default=200, help="chunks per request (its end's metrics every so many)")
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-ray", action="store_true", help="no local Ray instance (its metrics then record nothing: "
                    "a smoke run, not a figure)")
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json")
    args = ap.parse_args(argv)
    import ray

    started = not args.no_ray and not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        labels = {"this": ROOT} | ({"against": Path(args.against).resolve()} if args.against else {})
        loops = {}
        for label, root in labels.items():
            mods = [load(root, f"deployments/{f}.py", f"_front_{label}_{f}") for f in ("metrics", "ingress")]
            loops[label] = chunk_loop(*mods, args.kind, args.tokens, args.reply, label)
            loops[label](min(args.chunks, 2000))  # warm-up: the tier's tags, the first calls
        times: dict[str, list[float]] = {k: [] for k in loops}
        for _ in range(args.reps):
            for label, run in loops.items():
                times[label].append(run(args.chunks))
    finally:
        if started:
            ray.shutdown()
    us = {k: 1e6 * statistics.median(v) / args.chunks for k, v in times.items()}
    rows = [[k, str(labels[k]), f"{v:.2f}"] for k, v in us.items()]
    print_table(["code", "checkout", "us / chunk (median)"], rows)
    head = f"replica's Python work per streamed {args.kind} chunk ({args.tokens} token(s)): " + ", ".join(
        f"{k} {v:.2f} us" for k, v in us.items())
    if "against" in us:
        head += f" ({us['this'] / us['against']:.2f}x)"
    print(head)
    if args.summary:
        from bench.report import command_line

        figures: dict[str, Any] = {"us_per_chunk": us, "runs_s": times, "args": vars(args), **run_info(MODULE, argv)}
        print(f"summary -> {write_summary(args.summary, command_line(MODULE, argv), head, figures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
