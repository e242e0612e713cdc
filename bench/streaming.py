"""The seeds' streaming benchmark (`benchmark_streaming`) and their before/after reproductions, on Kairos.

    python -m bench.streaming [--prompt Hello --num-requests 16 ...] [--target http://host:8000] [--dataset sharegpt]
    python -m bench.streaming seeds --preset pending_queue|micro_batching|token_budget|packed_admission|all
                                    [--model NAME] [--quick] [--repeats N] [--literal] [--extra="ARGS"] [--json PATH]

The first form prints the seeds' block and drives the in-process `LLMEngine` or, with `--target`, a running
OpenAI-compatible server (streaming POST /v1/completions), through `bench/driver.py`: request i is sent at
i x `--submit-interval-ms` (0: a burst), open-loop, and every request ends as one `Record`. In-process, one
consumer thread per request stamps each stream item on arrival (the client's view). Per request:

- add_request latency = `add_request` returned (HTTP: response headers) - the instant before the call;
- TTFT = first token arrival - that instant; Latency = the final item's arrival - that instant;
- ITL = gaps between consecutive token arrivals (pooled); TPOT = (last - first token) / (n - 1), n >= 2.

Submit wall = first submit -> last submit; Throughput (completion,total) = completion tokens / (first submit ->
last finish), then "Throughput (prompt+completion)" with all tokens. Notes on faithfulness:
- A `RequestStream` merges pending deltas when its reader is behind, so one item can carry k > 1 tokens, seen
  at one instant (k - 1 ITL gaps of 0 ms): `merged_deliveries` counts them; `engine_side` has the engine's own
  per-token times.
- `--submit-mode inline` emulates the seeds' pre-027 add_request (prefill inline): the submitter waits for each
  request's first item before the next, so add_request latency includes that request's queueing + prefill.
- `--pretokenize` submits token ids tokenized before the timed loop (time reported as `tokenize_ms`).
- `--no-prefix-cache` is accepted and ignored (Kairos has no prefix cache). `--max-batch-size` is
  `SchedulerConfig.max_num_seqs`, the bound on *running* requests; a prefill round admits at most the free
  slots, so `--prefill-max-batch-size` above it behaves as `--max-batch-size`.
- `--target`: "add_request latency" is send -> response headers (the ingress sends them with the first item,
  so most of TTFT); token counts come from the usage chunk, ITL from SSE chunk arrivals (>= 1 token each).
- `--dataset sharegpt`: prompts and reply lengths (forced with ignore_eos) from `bench.workload.sharegpt` in the
  served model's tokenizer; `--prompt*`, `--unique-prompts`, `--max-new-tokens` and `--no-stop-on-eos` are unused.

`seeds` runs each seed post's "before" and "after" configurations (`PRESETS`; each on a fresh engine, all with
`--policy fcfs`, the seeds' scheduler), prints the two blocks side by side and `<metric>: before X -> after Y
(ratio Z)`, ratio = before / after (every headline metric is lower-is-better), and writes the preset's JSON
(`--preset all`: a list). The seeds' `--max-batch-size` bounded only their decode batch, so presets map their
knobs to Kairos's as each `mapped_note` explains ("mapping" in the JSON); `--literal` runs the seed flags
exactly. The seeds used GPT-2's tokenizer: here "Hello" is 3 tokens and " [i]" 3 more, and a long prompt that
would not fit the context is capped ("notes"). `--quick`: kairos-tiny and small counts (tests only).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from bench.driver import HOPS, Record, free_memory, resolve_bench_model, resolve_model_path, run_engine, run_http, \
    served_model
from bench.metrics import distribution
from bench.report import run_info, write_json, write_summary
from bench.workload import WorkItem

PCTS = (50, 95, 99)
BLOCK_HEADER = "=== streaming benchmark ==="
DEFAULT_MODEL = "kairos-random-42m"  # the seeds' runs: the random 42M model (kairos-default is the trained one)

# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.streaming", epilog="`python -m bench.streaming seeds --help`: the seed presets.",
        description="Streaming benchmark (the seeds' benchmark_streaming): add_request latency, TTFT, TPOT, "
                    "ITL, end-to-end latency and throughput for a burst or a paced stream of requests.")
    a = p.add_argument_group("model").add_argument
    a("--model", default=DEFAULT_MODEL, help="kairos-random-42m | kairos-default (trained) | kairos-tiny | "
      f"llama-110m | a local HF dir (default: {DEFAULT_MODEL})")
    a("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    a("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto)")
    a("--seed", type=int, default=0, help="engine seed; ShareGPT order (default: 0)")
    a("--num-threads", type=int, default=None, help="in-process engine's torch threads (default: all cores)")
    a("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    a = p.add_argument_group("workload").add_argument
    a("--dataset", choices=("synthetic", "sharegpt"), default="synthetic",
      help="synthetic: --prompt repeated (the seeds); sharegpt: real prompts and reply lengths (default: synthetic)")
    a("--dataset-path", default=None, help="--dataset sharegpt: a ShareGPT JSON file instead of the packaged one")
    a("--prompt", default="Hello", help="base prompt (default: Hello)")
    a("--prompt-repeats", default=None, help='comma-separated repeat counts, cycled per request; repeat r -> '
      '" ".join([prompt]*r). Example: "1,1,1,64" is a 3-short + 1-long mix')
    a("--unique-prompts", action="store_true", help='append " [i]" to request i\'s prompt')
    a("--num-requests", type=int, default=16, help="number of streaming requests (default: 16)")
    a("--submit-interval-ms", type=float, default=0.0, help="request i is sent at i x this (default: 0 = burst)")
    a("--max-new-tokens", type=int, default=32, help="tokens to generate per request (default: 32)")
    a("--no-stop-on-eos", action="store_true", help="keep generating past EOS (ignore_eos)")
    a("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    a = p.add_argument_group("scheduler").add_argument
    a("--policy", default="fcfs", help="fcfs | pack | edf | edf_reject | tpot_guard | scorpio | kairos "
      "(default: fcfs, the seeds' scheduler)")
    a("--max-batch-size", type=int, default=8, help="max running requests (max_num_seqs; default: 8)")
    a("--prefill-max-batch-size", type=int, default=None, help="max requests per prefill round (default: "
      "--max-batch-size)")
    a("--prefill-max-tokens", type=int, default=None, help="prompt-token budget per prefill round (default: none)")
    a("--prefill-admission-policy", choices=("fifo", "pack"), default="fifo", help="(default: fifo)")
    a("--prefill-admission-lookahead", type=int, default=64, help="pack's lookahead window (default: 64)")
    a("--prefill-force-fifo-every", type=int, default=0, help="a FIFO round every N (default: 0 = never)")
    a("--hybrid-steps", action="store_true", help="decode the running requests in every step, prefill rounds "
      "included (the seeds' worker: a prefill round then a decode round); default: the policy's")
    a("--no-prefix-cache", action="store_true", help="accepted for the seeds' commands; ignored")
    a = p.add_argument_group("measurement").add_argument
    a("--submit-mode", choices=("async", "inline"), default="async", help="inline: wait for each request's "
      "first output before the next (the seeds' pre-027 add_request) (default: async)")
    a("--pretokenize", action="store_true", help="submit token ids tokenized before the timed loop")
    a("--warmup", type=int, default=1, help="untimed warm-up requests (default: 1)")
    a("--request-timeout", type=float, default=600.0, help="give up on a silent stream (HTTP: a request) after "
      "this many s (default: 600)")
    a("--target", default=None, help="drive a running OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    a("--api-key", default=None, help="bearer token for --target")
    a("--json", default=None, metavar="PATH", help="write every figure (and per-request data) here")
    a("--summary", default=None, metavar="NAME", help="keep the headline as bench/summaries/NAME.json")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    _check_args(args)
    return args


def _check_args(args: argparse.Namespace) -> None:
    for flag, ok in (("--num-requests must be positive", args.num_requests > 0),
                     ("--max-new-tokens must be positive", args.max_new_tokens > 0),
                     ("--submit-interval-ms must be >= 0", args.submit_interval_ms >= 0)):
        if not ok:
            raise SystemExit(flag)
    parse_repeats(args.prompt_repeats)


def parse_repeats(spec: str | None) -> list[int] | None:
    if spec is None or str(spec).strip() == "":
        return None
    try:
        reps = [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-repeats must be comma-separated integers, got {spec!r}") from None
    if not reps or any(r <= 0 for r in reps):
        raise SystemExit(f"--prompt-repeats must be positive integers, got {spec!r}")
    return reps


def build_prompts(args: argparse.Namespace) -> list[str]:
    """The seeds' prompt construction: repeats cycled per request, optional unique suffix."""
    reps = parse_repeats(args.prompt_repeats) or [1]
    out = [" ".join([args.prompt] * reps[i % len(reps)]) for i in range(int(args.num_requests))]
    return [f"{p} [{i}]" for i, p in enumerate(out)] if args.unique_prompts else out


def command_for(argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "bench.streaming", *argv])


def to_argv(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that reproduce `args` (defaults, --json and --summary omitted)."""
    parser = build_parser()
    defaults, out = vars(parser.parse_args([])), []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
        v = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "json", "summary") or v == defaults[action.dest]:
            continue
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            out += [action.option_strings[0]] if v else []
            continue
        out += [action.option_strings[0], str(int(v) if isinstance(v, float) and v.is_integer() else v)]
    return out


# --------------------------------------------------------------------------- the workload and the runs


def model_tokenizer(model: str) -> tuple[Any, int]:
    """(the HF tokenizer of `model`, its context length or 0)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    try:
        with open(f"{path}/config.json", encoding="utf-8") as f:
            ctx = int(json.load(f).get("max_position_embeddings") or 0)
    except OSError:
        ctx = 0
    return AutoTokenizer.from_pretrained(path), ctx


def build_items(args: argparse.Namespace, tok: Any, max_len: int | None) -> tuple[list[WorkItem], list[float]]:
    """The requests as `WorkItem`s (request i at i x interval), and the per-prompt tokenization ms."""
    n = int(args.num_requests)
    if args.dataset == "sharegpt":
        from bench.workload import sharegpt

        samples = sharegpt(tok, n, args.seed, max_len, path=args.dataset_path).samples
        picked = [samples[i % len(samples)] for i in range(n)]
        texts, lens, ignore_eos = [s.text for s in picked], [s.output_len for s in picked], True
    else:
        texts, lens, ignore_eos = build_prompts(args), [args.max_new_tokens] * n, bool(args.no_stop_on_eos)
    ids: list[list[int]] = [[] for _ in texts]
    tokenize_ms: list[float] = []
    if args.pretokenize:
        eos = getattr(tok, "eos_token_id", None) or 0
        for i, p in enumerate(texts):
            ts = time.perf_counter()
            ids[i] = tok.encode(p, add_special_tokens=False) or [eos]
            tokenize_ms.append((time.perf_counter() - ts) * 1e3)
    seed = args.seed if args.target and args.temperature > 0 else None
    interval = args.submit_interval_ms / 1e3
    return [WorkItem(i * interval, ids[i], lens[i], text=None if args.pretokenize else texts[i],
                     ignore_eos=ignore_eos, temperature=args.temperature, seed=seed) for i in range(n)], tokenize_ms


def _warmup_items(args: argparse.Namespace) -> list[WorkItem]:
    return [WorkItem(0.0, [], min(4, args.max_new_tokens), text=f"{args.prompt} [warmup {i}]", stream=False)
            for i in range(max(0, args.warmup))]


def _engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig
    from scheduling.config import SchedulerConfig

    pmb = args.prefill_max_batch_size if args.prefill_max_batch_size is not None else args.max_batch_size
    sched = SchedulerConfig(
        policy=args.policy, max_num_seqs=args.max_batch_size, prefill_max_batch_size=pmb,
        prefill_max_tokens=args.prefill_max_tokens, prefill_admission_policy=args.prefill_admission_policy,
        prefill_admission_lookahead=args.prefill_admission_lookahead,
        prefill_force_fifo_every=args.prefill_force_fifo_every, hybrid_steps=True if args.hybrid_steps else None)
    return EngineConfig(model=resolve_bench_model(args.model), dtype=args.dtype, device=args.device, seed=args.seed,
                        max_model_len=args.max_model_len, num_threads=args.num_threads, scheduler=sched)


def _run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from engine.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    startup_s = time.perf_counter() - t0
    try:
        for i, w in enumerate(_warmup_items(args)):  # one after the other
            run_engine(engine, [w], per_request_threads=True, timeout_s=args.request_timeout, tag=f"warmup{i}")
        items, tokenize_ms = build_items(args, engine.tokenizer, engine.max_model_len)
        run = run_engine(engine, items, per_request_threads=True, inline=args.submit_mode == "inline",
                         timeout_s=args.request_timeout, tag="bench")
        engine_stats = {**run.engine, "kv_blocks_total": engine.stats().kv_blocks_total, "startup_s": startup_s,
                        "profile": engine.profile_report, "dtype": str(engine.bundle.dtype),
                        "max_model_len": engine.max_model_len, "model_path": engine.bundle.path}
    finally:
        engine.shutdown()
        del engine
        free_memory()
    return {"run": run, "tokenize_ms": tokenize_ms, "engine_stats": engine_stats}


def _run_http(args: argparse.Namespace) -> dict[str, Any]:
    tok, ctx = model_tokenizer(args.model) if args.pretokenize or args.dataset == "sharegpt" else (None, 0)
    items, tokenize_ms = build_items(args, tok, args.max_model_len or ctx or None)
    kw = {"api_key": args.api_key, "timeout_s": args.request_timeout}
    for w in _warmup_items(args):
        run_http(args.target, [w], **kw)
    return {"run": run_http(args.target, items, **kw), "tokenize_ms": tokenize_ms, "engine_stats": None,
            "served_model": served_model(args.target, args.api_key)}


# --------------------------------------------------------------------------- figures


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return distribution(values, PCTS)


def _fmt3(d: dict[str, float]) -> str:
    return "/".join(f"{d[f'p{q}']:.2f}" for q in PCTS)


def _ok(r: Record) -> bool:
    return r.completed and r.error is None and bool(r.token_times)


def _engine_side(recs: list[Record]) -> dict[str, Any]:
    ttft, queue, itl, tpot = [], [], [], []
    for e in (r.engine for r in recs):
        if not e or e.get("first_token_s") is None:
            continue
        ttft.append((e["first_token_s"] - e["arrival_s"]) * 1e3)
        if e.get("admitted_s") is not None:
            queue.append((e["admitted_s"] - e["arrival_s"]) * 1e3)
        tt = e["token_times"]
        itl.extend((b - a) * 1e3 for a, b in zip(tt, tt[1:]))
        if len(tt) >= 2:
            tpot.append((tt[-1] - tt[0]) / (len(tt) - 1) * 1e3)
    return {"ttft_ms": _pcts(ttft), "queue_ms": _pcts(queue), "itl_ms": _pcts(itl), "tpot_ms": _pcts(tpot),
            "note": "engine timestamps (time.monotonic): arrival = add_request, tokens = end of the model step"}


def summarize_run(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    recs: list[Record] = raw["run"].records
    ok = [r for r in recs if _ok(r)]
    t_first = min(r.arrival_s for r in recs)
    sent = [r for r in recs if r.sent_s is not None and not (r.error or "").startswith("submit:")]
    ms = lambda a, b: (a - b) * 1e3 if a is not None else None  # noqa: E731
    tpot_ms, itl_ms = [], []
    for r in ok:
        tt = r.token_times
        itl_ms.extend((b - a) * 1e3 for a, b in zip(tt, tt[1:]))
        n = r.n_out if args.target else len(tt)
        if n >= 2:
            tpot_ms.append((tt[-1] - tt[0]) / (n - 1) * 1e3)
    finishes = [r.finished_s for r in recs if r.finished_s is not None]
    wall = (max(finishes) - t_first) if finishes else math.nan
    completion_total = sum(r.n_out for r in ok)
    rate = (lambda tokens: tokens / wall if wall > 0 else math.nan)
    res: dict[str, Any] = {
        "bench": "streaming", "model": raw.get("served_model") or args.model,
        "device": args.device if not args.target else f"{args.target}", "mode": "http" if args.target else "engine",
        "dataset": args.dataset, "requests": len(recs), "ok_requests": len(ok), "failed_requests": len(recs) - len(ok),
        "errors": sorted({r.error or (f"rejected: {r.reject_reason}" if r.rejected else
                                      f"finish_reason={r.finish_reason}") for r in recs if not _ok(r)}),
        "prompt_tokens_total": sum(r.prompt_tokens for r in recs), "completion_tokens_total": completion_total,
        "submit_wall_s": raw["run"].submit_end_s - t_first, "wall_s": wall,
        "add_request_ms": _pcts([ms(r.sent_s, r.arrival_s) for r in sent]),
        "ttft_ms": _pcts([ms(r.token_times[0], r.arrival_s) for r in ok]),
        "tpot_ms": _pcts(tpot_ms), "itl_ms": _pcts(itl_ms),
        "latency_ms": _pcts([ms(r.finished_s, r.arrival_s) for r in ok]),
        "throughput_completion_tok_s": rate(completion_total),
        "throughput_total_tok_s": rate(completion_total + sum(r.prompt_tokens for r in ok)),
        "merged_deliveries": sum(r.merged_deliveries for r in recs), "deliveries": sum(r.deliveries for r in recs),
        "submit_mode": args.submit_mode, "pretokenized": bool(args.pretokenize),
        "tokenize_ms": _pcts(raw.get("tokenize_ms") or []),
    }
    for name in ("add_request", "ttft", "tpot", "itl", "latency"):
        for q in PCTS:
            res[f"{name}_p{q}_ms"] = res[f"{name}_ms"][f"p{q}"]
    if args.pretokenize:
        res["add_request_p50_excl_tokenize_ms"] = res["add_request_p50_ms"]
    if args.target:  # where the time to first token went, by the server's Server-Timing (bench.driver.HOPS)
        res["hops_p50_ms"] = {h: statistics.median(xs) for h in HOPS
                              if (xs := [r.hops[h] for r in ok if h in r.hops])}
    if raw.get("engine_stats") is not None:
        res["engine_stats"], res["engine_side"] = raw["engine_stats"], _engine_side(recs)
    res["per_request"] = [
        {"index": r.index, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.n_out,
         "add_request_ms": ms(r.sent_s, r.arrival_s),
         "ttft_ms": ms(r.token_times[0], r.arrival_s) if r.token_times else None,
         "latency_ms": ms(r.finished_s, r.arrival_s), "submit_offset_ms": ms(r.arrival_s, t_first),
         "deliveries": r.deliveries, "finish_reason": r.finish_reason, "error": r.error}
        for r in recs]
    res["block"] = format_block(res)
    return res


def format_block(res: dict[str, Any]) -> str:
    """The seeds' printed block, line for line."""
    return "\n".join([
        BLOCK_HEADER, f"Model: {res['model']}", f"Device: {res['device']}", f"Requests: {res['requests']}",
        f"Prompt tokens (total): {res['prompt_tokens_total']}",
        f"Completion tokens (total): {res['completion_tokens_total']}",
        f"Submit wall: {res['submit_wall_s']:.6f} s",
        f"add_request latency p50/p95/p99: {_fmt3(res['add_request_ms'])} ms",
        f"TTFT p50/p95/p99: {_fmt3(res['ttft_ms'])} ms",
        f"TPOT p50/p95/p99: {_fmt3(res['tpot_ms'])} ms/token",
        f"ITL p50/p95/p99: {_fmt3(res['itl_ms'])} ms",
        f"Latency p50/p95/p99: {_fmt3(res['latency_ms'])} ms",
        f"Throughput (completion,total): {res['throughput_completion_tok_s']:.2f} tokens/s"])


def format_extra(res: dict[str, Any]) -> str:
    lines = [f"Throughput (prompt+completion): {res['throughput_total_tok_s']:.2f} tokens/s"]
    if res["pretokenized"]:
        lines.append(f"Tokenization (outside the timed loop) p50/p95/p99: {_fmt3(res['tokenize_ms'])} ms")
    if res["failed_requests"]:
        lines.append(f"Failed requests: {res['failed_requests']} ({'; '.join(res['errors'][:3])})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry points


def run(args: argparse.Namespace, *, verbose: bool = True, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run one benchmark configuration; return every figure (and write --json / --summary if given)."""
    _check_args(args)
    res = summarize_run(args, _run_http(args) if args.target else _run_engine(args))
    res["config"] = dict(vars(args))
    res["run_info"] = run_info("bench.streaming", argv if argv is not None else to_argv(args))
    res["command"] = res["run_info"].get("command") or command_for(to_argv(args))
    if verbose:
        print(res["block"])
        print(format_extra(res), flush=True)
    if getattr(args, "json", None):
        write_json(args.json, res)
    if getattr(args, "summary", None):
        figures = {k: v for k, v in res.items() if k not in ("per_request", "block", "config", "run_info")}
        write_summary(args.summary, res["command"], f"{res['model']}, {res['requests']} requests: TTFT p50 "
                      f"{res['ttft_p50_ms']:.1f} ms, TPOT p50 {res['tpot_p50_ms']:.1f} ms/token, ITL p99 "
                      f"{res['itl_p99_ms']:.1f} ms, {res['throughput_completion_tok_s']:.1f} tok/s", figures)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["seeds"]:
        return seeds_main(argv[1:])
    args = parse_args(argv)
    res = run(args, argv=argv)
    if args.json:
        print(f"wrote {args.json}")
    return 0 if res["ok_requests"] else 1


# --------------------------------------------------------------------------- the seeds' before/after presets


def _ratio(before: float, after: float) -> float:
    if before is None or after is None or not math.isfinite(before) or not math.isfinite(after) or after <= 0:
        return math.nan
    return before / after


@dataclass(frozen=True)
class Preset:
    name: str
    seed_file: str
    title: str
    metric: str  # key in a bench.streaming result
    unit: str
    base: tuple[str, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    quick_base: tuple[str, ...]
    quick_before: tuple[str, ...] | None
    quick_after: tuple[str, ...] | None
    target: str
    target_check: Callable[[float, float], bool]
    seed_reference: dict[str, Any]
    secondary: tuple[str, ...] = ("submit_wall_s", "add_request_p50_ms", "ttft_p50_ms", "ttft_p99_ms",
                                  "itl_p99_ms", "tpot_p50_ms", "latency_p99_ms", "throughput_completion_tok_s")
    extra_runs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # label -> args added to "after"
    notes: tuple[str, ...] = ()
    mapped: tuple[str, ...] = ()  # Kairos's mapping of the seeds' knobs, applied to `base` unless --literal
    mapped_note: str = ""


_COMMON = ("--policy", "fcfs", "--prompt", "Hello", "--unique-prompts", "--no-stop-on-eos", "--no-prefix-cache")
_N32 = ("--num-requests", "32", "--max-new-tokens", "8")
_QN8 = ("--num-requests", "8", "--max-new-tokens", "4")
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("pending_queue", "002", "027 Pending Queue Admission", "add_request_p50_ms", "ms", (*_COMMON, *_N32),
           ("--submit-mode", "inline"), (), (*_COMMON, *_QN8), None, None, "after <= 0.1 ms", lambda b, a: a <= 0.1,
           {"before": 47.04, "after": 0.05, "submit_wall_s": {"before": 1.625954, "after": 0.085824},
            "model": "gpt2", "device": "cpu"},
           extra_runs={"after_pretokenized": ("--pretokenize",)},
           notes=("before emulates the seed's synchronous add_request (prefill inside the call): the submitting "
                  "thread blocks on the request's first stream item before submitting the next (--submit-mode "
                  "inline).", "after_pretokenized: the same as after with token ids submitted (tokenization outside "
                  "the timed call): add_request_p50_excl_tokenize_ms.")),
    Preset("micro_batching", "004", "028 Prefill Micro-Batching", "ttft_p50_ms", "ms", (*_COMMON, *_N32),
           ("--prefill-max-batch-size", "1"), ("--prefill-max-batch-size", "32"),
           (*_COMMON, *_QN8, "--max-batch-size", "8"), ("--prefill-max-batch-size", "1"),
           ("--prefill-max-batch-size", "8"), "ratio >= 2 (p50 TTFT at least 2x better)",
           lambda b, a: _ratio(b, a) >= 2.0, {"before": 405.64, "after": 132.30, "model": "gpt2", "device": "cpu"},
           mapped=("--max-batch-size", "32"),
           mapped_note="--max-batch-size 32 (the seed's command sets none; Kairos admits at most the free running "
                       "slots per prefill round, so with the default 8 a 32-wide prefill batch could never form)"),
    Preset("token_budget", "003", "031 Prefill Token Budget", "itl_p99_ms", "ms",
           (*_COMMON, "--prompt-repeats", "1,1,1,64", "--num-requests", "32", "--submit-interval-ms", "20",
            "--max-batch-size", "8", "--prefill-max-batch-size", "32", "--max-new-tokens", "32"),
           (), ("--prefill-max-tokens", "224"),
           (*_COMMON, "--prompt-repeats", "1,1,1,64", "--num-requests", "8", "--submit-interval-ms", "5",
            "--max-batch-size", "8", "--prefill-max-batch-size", "8", "--max-new-tokens", "8"),
           None, None, "after < before", lambda b, a: a < b,
           {"before": 438.15, "after": 340.15, "model": "gpt2", "device": "cpu"},
           notes=("Kairos's tokenizer makes the 64-repeat prompt ~195 tokens (GPT-2: ~67), so the 224-token budget "
                  "admits one long prompt per round instead of three.",),
           mapped=("--max-batch-size", "32", "--hybrid-steps"),
           mapped_note="--max-batch-size 32 instead of the seed's 8: the seed's --max-batch-size bounded only its "
                       "decode batch (its active set grew up to --prefill-max-batch-size 32 and was decoded "
                       "round-robin), while Kairos's bounds the running set. With 8, Kairos runs lockstep waves of 8 "
                       "that finish together and are re-admitted in one prefill round that stalls nobody, so a budget "
                       "can only add stalls (it splits a wave's admission). --hybrid-steps: the seed's worker runs one "
                       "prefill round AND one decode round per iteration, so the budget bounds the stall between two "
                       "decode rounds; Kairos's fcfs is prefill-first (vLLM V0): with a queue, budgeted prefill rounds "
                       "run back to back and the budget only splits one stall into several (measured 2026-11-22 with "
                       "3 repeats: ITL p99 579 -> 758 ms without --hybrid-steps). --literal runs the seed's exact "
                       "flags"),
    Preset("packed_admission", "000", "Packed Prefill Admission", "ttft_p99_ms", "ms",
           (*_COMMON, "--prompt-repeats", "512,1,1,1", "--num-requests", "128", "--submit-interval-ms", "0",
            "--max-batch-size", "8", "--prefill-max-batch-size", "128", "--prefill-max-tokens", "256",
            "--max-new-tokens", "32"),
           (), ("--prefill-admission-policy", "pack", "--prefill-admission-lookahead", "64",
                "--prefill-force-fifo-every", "8"),
           (*_COMMON, "--prompt-repeats", "128,1,1,1", "--num-requests", "16", "--submit-interval-ms", "0",
            "--max-batch-size", "8", "--prefill-max-batch-size", "16", "--prefill-max-tokens", "256",
            "--max-new-tokens", "4"),
           None, None, "after <= 0.7 x before (>= 30% lower TTFT p99)", lambda b, a: a <= 0.7 * b,
           {"before": 1144.49, "after": 689.69, "model": "gpt2", "device": "cuda"},
           notes=("The seed ran GPT-2 on CUDA, where prefill is nearly free and TTFT p99 counts admission rounds; on "
                  "this CPU prefill runs at ~2.3k tokens/s (kairos-random-42m), and pack's p99 (the last long prompt, "
                  "deferred to the end) still waits for all 32 long prefills, ~16k tokens: ordering cannot shorten "
                  "that.",),
           mapped=("--max-batch-size", "128", "--prompt-repeats", "171,1,1,1"),
           mapped_note="--max-batch-size 128 instead of the seed's 8: the seed's --max-batch-size bounded only its "
                       "decode batch and its active set grew with every prefill round, so TTFT measured prefill "
                       "rounds, not waits for one of 8 slots (with 8, TTFT p99 is the 16th wave of 8 in either "
                       "order). --prompt-repeats 171,1,1,1: Kairos's tokenizer makes 'Hello' 3 tokens, so 171 repeats "
                       "give the seed's 512-token long prompt (2x the 256-token budget); 512 repeats (1.5k tokens) "
                       "make the run prefill-bound (32 long prefills are ~2/3 of the wall time, and the last one "
                       "bounds TTFT p99 in any order: measured 2026-11-22, ratio 1.04 with the seed's flags, 1.01 "
                       "with only the first change). --literal runs the seed's exact flags"),
)}
ORDER = ("pending_queue", "micro_batching", "token_budget", "packed_admission")


def _fit_prompt(argv: list[str]) -> tuple[list[str], list[str]]:
    """Cap --prompt-repeats so the longest prompt + max-new-tokens fits the model's context window."""
    a = parse_args(argv)  # resolved values (later flags win, --flag=value forms work)
    reps = parse_repeats(a.prompt_repeats)
    if not reps:
        return argv, []
    try:
        tok, ctx = model_tokenizer(a.model)
    except Exception as e:  # noqa: BLE001 - the check is best effort; the engine still validates
        return argv, [f"prompt-fit check skipped: {type(e).__name__}: {e}"]
    suffix = f" [{a.num_requests - 1}]" if a.unique_prompts else ""
    ntok = lambda r: len(tok.encode(" ".join([a.prompt] * r) + suffix, add_special_tokens=False))  # noqa: E731
    notes, new = [], []
    for r in reps:
        if ctx and ntok(r) + a.max_new_tokens >= ctx:
            lo, hi = 1, r
            while lo < hi:  # the largest repeat count that fits
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ntok(mid) + a.max_new_tokens < ctx else (lo, mid - 1)
            notes.append(f"prompt repeat {r} ({ntok(r)} tokens) + {a.max_new_tokens} new tokens does not fit the "
                         f"{ctx}-token context; capped to {lo} repeats ({ntok(lo)} tokens)")
            r = lo
        new.append(r)
    notes.append(f"prompt tokens per repeat count (with the unique suffix): "
                 f"{ {r: ntok(r) for r in sorted(set(new))} }; context {ctx}")
    return (argv if new == reps else [*argv, "--prompt-repeats", ",".join(map(str, new))]), notes


def _flag_pairs(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """`--a 1 --switch --b x` -> [("--a", "1"), ("--switch", None), ("--b", "x")]."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        out.append((argv[i], argv[i + 1] if has_value else None))
        i += 2 if has_value else 1
    return out


def _preset_argvs(p: Preset, args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    base = list(p.quick_base if args.quick else p.base)
    if not args.quick and not args.literal:
        for flag, value in _flag_pairs(p.mapped):
            if flag not in base:
                base += [flag] if value is None else [flag, value]
            elif value is not None:
                base[base.index(flag) + 1] = value
    before = list(p.quick_before if args.quick and p.quick_before is not None else p.before)
    after = list(p.quick_after if args.quick and p.quick_after is not None else p.after)
    model = args.model or ("kairos-tiny" if args.quick else DEFAULT_MODEL)
    extra = shlex.split(args.extra) if args.extra else []
    return ["--model", model, "--device", args.device, "--dtype", args.dtype, *base], before + extra, after + extra


def _seed_command(args: argparse.Namespace, preset: str) -> str:
    parts = ["python", "-m", "bench.streaming", "seeds", "--preset", preset]
    parts += ["--model", args.model] if args.model else []
    parts += ["--device", args.device] if args.device != "cpu" else []
    parts += ["--dtype", args.dtype] if args.dtype != "auto" else []
    parts += ["--quick"] if args.quick else []
    parts += ["--repeats", str(args.repeats)] if args.repeats != 1 else []
    parts += ["--literal"] if args.literal else []
    return shlex.join(parts + ([f"--extra={args.extra}"] if args.extra else []))


def _one(label: str, argv: list[str]) -> dict[str, Any]:
    print(f"  [{label}] {command_for(argv)}", flush=True)
    t0 = time.perf_counter()
    res = run(parse_args(argv), verbose=False, argv=argv)
    res["elapsed_s"] = time.perf_counter() - t0
    free_memory()
    return res


def side_by_side(left: str, right: str, titles: tuple[str, str] = ("before", "after"), gap: str = "  |  ") -> str:
    ls, rs = left.splitlines(), right.splitlines()
    w, n = max(len(x) for x in [titles[0], *ls]), max(len(ls), len(rs))
    ls, rs = ls + [""] * (n - len(ls)), rs + [""] * (n - len(rs))
    out = [f"{titles[0].ljust(w)}{gap}{titles[1]}", f"{'-' * w}{gap}{'-' * max(len(x) for x in [titles[1], *rs])}"]
    return "\n".join(out + [f"{a.ljust(w)}{gap}{b}" for a, b in zip(ls, rs)])


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "nan"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.4f}"
    return str(v)


def run_preset(name: str, args: argparse.Namespace) -> dict[str, Any]:
    p = PRESETS[name]
    base, before_x, after_x = _preset_argvs(p, args)
    before_argv, notes = _fit_prompt(base + before_x)
    after_argv, _ = _fit_prompt(base + after_x)
    print(f"\n##### preset {name}: seed {p.seed_file} ({p.title}); metric {p.metric} #####", flush=True)
    befores, afters, extras = [], [], {}
    for rep in range(max(1, args.repeats)):
        sfx = f" #{rep + 1}" if args.repeats > 1 else ""
        befores.append(_one(f"before{sfx}", before_argv))
        afters.append(_one(f"after{sfx}", after_argv))
        for label, extra in p.extra_runs.items():
            extras.setdefault(label, []).append(_one(f"{label}{sfx}", after_argv + list(extra)))
    bvals, avals = [r[p.metric] for r in befores], [r[p.metric] for r in afters]
    b, a = statistics.median(bvals), statistics.median(avals)
    ratio = _ratio(b, a)
    try:
        met = bool(p.target_check(b, a))
    except (TypeError, ValueError):
        met = False
    bf, af = befores[-1], afters[-1]
    print(side_by_side(bf["block"], af["block"], ("before: " + (" ".join(before_x) or "(defaults)"),
                                                   "after: " + (" ".join(after_x) or "(defaults)"))))
    for label, runs in extras.items():
        print(f"\n{label}:\n{runs[-1]['block']}")
    print()
    for key in p.secondary:
        if key != p.metric:
            print(f"  {key}: before {_fmt(bf.get(key))} -> after {_fmt(af.get(key))}")
    if "after_pretokenized" in extras:
        pre = extras["after_pretokenized"][-1]
        print(f"  add_request_p50_excl_tokenize_ms (after, --pretokenize): {_fmt(pre['add_request_p50_ms'])}")
    if bf["failed_requests"] + af["failed_requests"]:
        print(f"  WARNING: {bf['failed_requests'] + af['failed_requests']} failed requests "
              f"({'; '.join((bf['errors'] + af['errors'])[:3])})")
    line = f"{p.metric}: before {_fmt(b)} -> after {_fmt(a)} (ratio {_fmt(ratio)})"
    print(line)
    print(f"  target: {p.target} -> {'MET' if met else 'NOT MET'}"
          f"{'' if not args.quick else ' (quick mode: not meaningful)'}", flush=True)
    out: dict[str, Any] = {
        "preset": name, "seed": p.seed_file, "title": p.title, "metric": p.metric, "unit": p.unit,
        "before": b, "after": a, "ratio": ratio, "ratio_definition": "before / after (lower-is-better metric)",
        "target": p.target, "target_met": met, "quick": bool(args.quick), "repeats": max(1, args.repeats),
        "before_values": bvals, "after_values": avals,
        "secondary": {k: {"before": bf.get(k), "after": af.get(k)} for k in p.secondary},
        "before_full": bf, "after_full": af, "command": _seed_command(args, name),
        "commands": {"before": command_for(before_argv), "after": command_for(after_argv),
                     **{k: command_for(after_argv + list(v)) for k, v in p.extra_runs.items()}},
        "seed_reference": p.seed_reference, "notes": [*p.notes, *notes], "summary_line": line,
        "literal": bool(args.literal), "mapping": [] if (args.literal or args.quick or not p.mapped) else [p.mapped_note],
    }
    for label, runs in extras.items():
        out[f"{label}_full"] = runs[-1]
    if "after_pretokenized" in extras:
        out["add_request_p50_excl_tokenize_ms"] = statistics.median(
            [r["add_request_p50_ms"] for r in extras["after_pretokenized"]])
    return out


def seeds_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.streaming seeds",
                                description="Reproduce the seed blog posts' before/after benchmarks on Kairos.")
    a = p.add_argument
    a("--preset", required=True, choices=(*ORDER, "all"))
    a("--json", default=None, metavar="PATH", help="write the result(s) here")
    a("--summary", default=None, metavar="NAME", help="keep the headlines as bench/summaries/NAME.json")
    a("--model", default=None, help=f"model for every run (default: {DEFAULT_MODEL}; --quick: kairos-tiny)")
    a("--device", default="cpu", help="device for every run (default: cpu)")
    a("--dtype", default="auto", help="dtype for every run (default: auto)")
    a("--quick", action="store_true", help="kairos-tiny and small counts (smoke tests only)")
    a("--repeats", type=int, default=1, help="run each before/after pair N times (interleaved); headline = median")
    a("--literal", action="store_true", help="use the seed commands' flags exactly, without Kairos's knob mapping")
    a("--extra", default=None, metavar="ARGS", help='bench.streaming arguments appended to every run (later flags '
      'win), e.g. --extra="--max-batch-size 128" (note the "=")')
    return p


def seeds_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    args = seeds_parser().parse_args(argv)
    results = [run_preset(n, args) for n in (ORDER if args.preset == "all" else (args.preset,))]
    if len(results) > 1:
        print("\n##### summary #####")
        for r in results:
            print(f"[{r['preset']}] {r['summary_line']}  target {r['target']}: "
                  f"{'MET' if r['target_met'] else 'NOT MET'}")
    if args.json:
        write_json(args.json, results if args.preset == "all" else results[0])
        print(f"wrote {args.json}")
    if args.summary:
        keys = ("metric", "before", "after", "ratio", "target", "target_met")
        write_summary(args.summary, shlex.join(["python", "-m", "bench.streaming", "seeds", *argv]),
                      "; ".join(f"{r['preset']} {r['metric']} {_fmt(r['ratio'])}x"
                                f"{'' if r['target_met'] else ' (target missed)'}" for r in results),
                      {r["preset"]: {k: r[k] for k in keys} for r in results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
