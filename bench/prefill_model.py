"""How well the latency model predicts prefill steps beyond what it was fitted on: single prompts longer than the
profiled ones, and rounds of several short prompts.

The engine profiles single prompts up to twice its prefill budget (`engine.profiling`). A prompt's attention grows
with its square, so the model carries an attention term over the step's token pairs (`LatencyModel.prefill_ms`'s q).
This measures, on the real engine (median of `--reps` steps each):

- single prompts from 128 tokens to `--long` (past the profiled range);
- rounds of equal prompts filling `--round` tokens (e.g. 8 x 256);

and prints each beside the model fitted with the attention term and one fitted without it (alpha·n + beta, the model
before that term), and the engine's own fit (`LatencyModel.fit_prefill` as the profile calls it: the knee below
which a GPU step costs the same whatever its size, and the attention term only where it extrapolates better), all on
the same single-prompt steps measured at the profile's sizes. Prediction / measured per shape; the summary keeps
them. Then hybrid steps (a prompt prefilled while 32 or 128 replies decode, context 512) beside the prefill and the
decode each alone: the scheduler predicts a hybrid step as their sum. Beside that sum, the step as one forward of
n + b tokens would cost: a prefill of n + b tokens plus what the decode rows add over a one-row decode (their
attention and per-row work, the weights read once), to tell which form a fit of hybrid steps should take
(`--hybrid-prompts`, `--hybrid-rows`: the grid). On CUDA, steps with prefill rows that replay the mixed graphs
(`mixed_graph_tokens`) beside the same steps run eagerly. With `--skew-rows`, decode batches of one mean context
three ways (every row alike, the profile's spread, a quarter of the rows long and the rest short): the latency model
sees only a batch's mean context, and a scheduler that serves long replies beside many short ones runs skewed batches.

    python -m bench.prefill_model --model kairos-default --long 8000 --summary prefill-model-default
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Sequence

from bench.engine import _ints
from bench.report import command_line, print_table, run_info, write_summary


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="dummy: random weights built on the device from the model's config (none read)")
    ap.add_argument("--long", type=int, default=8000, help="the longest single prompt measured")
    ap.add_argument("--round", type=int, default=2048, help="tokens of a round of several prompts")
    ap.add_argument("--profile-max", type=int, default=2048, help="the longest single prompt fitted on (the "
                    "engine's profile: twice the prefill budget, 1024 by default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="the engine's: above the hybrid steps' decode rows plus their prompt (on CUDA a step of more "
                         "sequences than this cannot replay a mixed graph and runs eagerly)")
    ap.add_argument("--mixed-graph-tokens", type=int, default=None,
                    help="the engine's mixed_graph_tokens (CUDA: steps with prefill rows of up to this many tokens "
                         "replay a graph; default the engine's): the mixed-graph table measures graph against eager "
                         "up to it")
    ap.add_argument("--hybrid-prompts", type=_ints, default="128,512,2048",
                    help="prompt tokens of the hybrid steps (comma list)")
    ap.add_argument("--hybrid-rows", type=_ints, default="32,128", help="decode rows of the hybrid steps (comma list)")
    ap.add_argument("--skew-rows", type=_ints, default=[], help="decode batches of these rows (multiples of 4), "
                    "each at --skew-context mean context three ways: every row alike, the profile's spread, and a "
                    "quarter of the rows at 3x the mean with the rest at a third of it (comma list; default none)")
    ap.add_argument("--skew-context", type=int, default=300, help="the skewed decode batches' mean context")
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json")
    args = ap.parse_args(argv)
    if args.skew_rows and args.skew_context < 3:
        ap.error("--skew-context must be 3 or more (the short rows are a third of it)")

    from bench.driver import resolve_model_path
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    graphs = {} if args.mixed_graph_tokens is None else {"mixed_graph_tokens": args.mixed_graph_tokens}
    eng = LLMEngine(EngineConfig(model=resolve_model_path(args.model), dtype=args.dtype, device=args.device,
                                 max_model_len=args.max_model_len, load_format=args.load_format,
                                 scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs), **graphs))
    try:
        return _measure(eng, args, argv)
    finally:
        eng.shutdown()


def _measure(eng: Any, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """The measurements of `main` on its engine."""
    from engine.profiling import Prober
    from scheduling.predictor import LatencyModel, _fit_prefill_line, prefill_sq

    if eng.bundle.device.type == "cuda":  # the probes run on this thread: its kernels, graphs and events go there
        import torch
        torch.cuda.set_device(eng.bundle.device)
    probe = Prober(eng)

    def med(step) -> float:
        """The median of `--reps` runs of `step` (ms), after one to warm this shape up."""
        step()
        return statistics.median(step() for _ in range(args.reps))

    def timed(prompts: list[int]) -> float:
        return med(lambda: probe.prefill_ms([probe._ids(n) for n in prompts]))

    limit = eng.max_model_len - 1
    fit_sizes = [n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= min(args.profile_max, limit)]
    samples = [(float(n), timed([n])) for n in fit_sizes]
    # the two forms fitted on the same steps (the engine's own fit keeps the attention term only where it predicts
    # the longest profiled size better: `LatencyModel.fit_prefill`)
    with_sq, linear = LatencyModel(), LatencyModel()
    with_sq._prefill = _fit_prefill_line(samples, attention=True)
    linear._prefill = _fit_prefill_line(samples, attention=False)
    own = LatencyModel().fit_prefill(samples, find_knee=eng.bundle.device.type == "cuda")
    shapes: list[list[int]] = [[n] for n in (128, 512, 2048, 4096, args.long) if n <= limit]
    shapes += [[args.round // k] * k for k in (4, 8, 16) if args.round // k >= 1]
    rows, out = [], []
    for prompts in shapes:
        n, q = sum(prompts), sum(prefill_sq(0, p) for p in prompts)
        ms = next((m for s, m in samples if len(prompts) == 1 and s == prompts[0]), None) or timed(prompts)
        a, b, c = with_sq.prefill_ms(n, q), linear.prefill_ms(n), own.prefill_ms(n, q)
        label = f"{len(prompts)} x {prompts[0]}" if len(prompts) > 1 else f"1 x {n}"
        out.append({"prompts": label, "tokens": n, "measured_ms": round(ms, 1), "model_ms": round(a, 1),
                    "linear_ms": round(b, 1), "engine_fit_ms": round(c, 1),
                    "fitted_on": len(prompts) == 1 and n in fit_sizes})
        rows.append([label, n, f"{ms:.1f}", f"{a:.1f} ({a / ms:.2f}x)", f"{b:.1f} ({b / ms:.2f}x)",
                     f"{c:.1f} ({c / ms:.2f}x)", "yes" if out[-1]["fitted_on"] else ""])
    print_table(["prompts", "tokens", "measured ms", "model (with attention)", "linear model", "engine's fit",
                 "fitted on"], rows)
    # hybrid steps (a prefill and the running replies' decodes in one forward): the scheduler predicts one as the
    # prefill's time plus the decode's; on a GPU the decode alone replays a CUDA graph and the hybrid step runs eager
    seqs = eng.config.scheduler.max_num_seqs
    ctx = min(512, limit // 2)
    mixed = []
    points = [(n, b) for n in args.hybrid_prompts for b in args.hybrid_rows
              if n + b <= limit and b <= seqs and eng.cache.num_blocks * eng.cache.block_size >= n + 2 * b * ctx]
    one_row = med(lambda: probe.decode_ms(probe.lengths(1, ctx))) if points else 0.0  # the weights read once
    for n, b in points:
        lens, ids = probe.lengths(b, ctx), probe._ids(n)
        both, pre = med(lambda: probe.mixed_ms([ids], lens)), med(lambda: probe.prefill_ms([ids]))
        dec = med(lambda: probe.decode_ms(lens))
        merged = med(lambda: probe.prefill_ms([probe._ids(n + b)])) + max(dec - one_row, 0.0)
        mixed.append({"prompt": n, "decode_rows": b, "ctx": ctx, "hybrid_ms": round(both, 2),
                      "prefill_ms": round(pre, 2), "decode_ms": round(dec, 2), "decode_one_row_ms": round(one_row, 2),
                      "merged_ms": round(merged, 2), "hybrid_over_sum": round(both / (pre + dec), 3),
                      "hybrid_over_merged": round(both / merged, 3)})
    if mixed:
        print_table(["prompt", "decode rows", "hybrid ms", "prefill alone", "decode alone",
                     "hybrid / (prefill + decode)", "one forward of n + b", "hybrid / that"],
                    [[m["prompt"], m["decode_rows"], f"{m['hybrid_ms']:.1f}", f"{m['prefill_ms']:.1f}",
                      f"{m['decode_ms']:.1f}", f"{m['hybrid_over_sum']:.2f}", f"{m['merged_ms']:.1f}",
                      f"{m['hybrid_over_merged']:.2f}"] for m in mixed])
    # steps with prefill rows replayed from the mixed CUDA graphs (`engine.backends.cuda.graphs.MixedGraphs`)
    # beside the same steps run eagerly (the graphs set aside for the second measurement)
    graphs = getattr(eng.backend, "mixed", None)
    replayed = []
    for n, b in [(16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (768, 0), (1024, 0), (2048, 0), (128, 32),
                 (128, 128), (256, 128), (512, 128), (896, 128), (1792, 192)]:
        if graphs is None or n + b > graphs.max_tokens or b > seqs:
            continue
        lens, ids = probe.lengths(b, ctx), probe._ids(n)
        run = (lambda: probe.mixed_ms([ids], lens)) if b else (lambda: probe.prefill_ms([ids]))
        with_graph = med(run)
        eng.backend.mixed = None
        try:
            eager = med(run)
        finally:
            eng.backend.mixed = graphs
        replayed.append({"prompt": n, "decode_rows": b, "ctx": ctx if b else 0, "graph_ms": round(with_graph, 2),
                         "eager_ms": round(eager, 2), "eager_over_graph": round(eager / with_graph, 3)})
    if replayed:
        print_table(["prompt", "decode rows", "mixed graph ms", "eager ms", "eager / graph"],
                    [[m["prompt"], m["decode_rows"], f"{m['graph_ms']:.1f}", f"{m['eager_ms']:.1f}",
                      f"{m['eager_over_graph']:.2f}"] for m in replayed])
    # decode batches of one mean context, skewed or not: the latency model sees a batch's mean context only
    skew = []
    m = args.skew_context
    for b in args.skew_rows:
        if b % 4 or 4 * m >= limit or b > seqs \
                or eng.cache.num_blocks * eng.cache.block_size < 2 * b * (m + 1 + eng.cache.block_size):
            print(f"decode skew: {b} rows at context {m} left out (rows a multiple of 4, the long rows within the "
                  "window, the rows within max_num_seqs, and the cache must hold two such batches)")
            continue
        even, spread = [m] * b, probe.lengths(b, m)
        short = m // 3  # three rows in four; the fourth makes the mean exactly m (about 3m)
        skewed = [short] * (3 * b // 4) + [4 * m - 3 * short] * (b // 4)
        # the three in turn, rep after rep: a box's speed wanders over seconds, and timed one shape's
        # reps after another's, that wander would read as a difference between them
        forms = {"even": even, "profile_spread": spread, "skewed": skewed}
        times: dict[str, list[float]] = {name: [] for name in forms}
        for lens in forms.values():
            probe.decode_ms(lens)  # warm each shape up
        for _ in range(args.reps):
            for name, lens in forms.items():
                times[name].append(probe.decode_ms(lens))
        got = {name: statistics.median(v) for name, v in times.items()}
        skew.append({"rows": b, "mean_context": m, "skewed_lengths": sorted(set(skewed)),
                     **{f"{k}_ms": round(v, 3) for k, v in got.items()},
                     "skewed_over_even": round(got["skewed"] / got["even"], 3)})
    if skew:
        print_table(["rows", "mean context", "alike ms", "profile's spread ms", "skewed ms", "skewed / alike"],
                    [[k["rows"], k["mean_context"], f"{k['even_ms']:.3f}", f"{k['profile_spread_ms']:.3f}",
                      f"{k['skewed_ms']:.3f}", f"{k['skewed_over_even']:.2f}"] for k in skew])
    if args.summary:
        worst = {k: max(abs(r[k] / r["measured_ms"] - 1.0) for r in out if not r["fitted_on"])
                 for k in ("model_ms", "linear_ms", "engine_fit_ms")}
        head = (f"prefill steps the profile did not fit ({args.model}, single prompts to {args.long} tokens, rounds "
                f"of {args.round}): worst error {100 * worst['engine_fit_ms']:.0f}% with the engine's fit, "
                f"{100 * worst['model_ms']:.0f}% with the attention term, {100 * worst['linear_ms']:.0f}% without")
        figures: dict[str, Any] = {"run": run_info("bench.prefill_model", argv), "shapes": out,
                                   "coef_with_attention": list(with_sq.prefill_coef),
                                   "coef_linear": list(linear.prefill_coef[:2]),
                                   "engine_fit": {"theta": own.theta, "c0": own.c0, "coef": list(own.prefill_coef)},
                                   "hybrid_steps": mixed, "mixed_graphs": replayed, "decode_skew": skew,
                                   "worst_error": worst}
        print(f"summary -> {write_summary(args.summary, command_line('bench.prefill_model', argv), head, figures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
