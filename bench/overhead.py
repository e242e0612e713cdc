"""What the HTTP path adds over the in-process engine: one load, in process and against fresh servers, back to back.

    python -m bench.overhead [--serve "" --serve "engine_process=false" ...] [--saturate] [--rounds N] [--summary NAME]
    python -m bench.overhead run [--model M] [--num-requests N] [--submit-interval-ms MS] [--max-new-tokens N]
                                 [--dataset sharegpt] [--policy P] [--target URL] [--json PATH] [--summary NAME]

`run` is one load (request i at i x `--submit-interval-ms`, open-loop, through `bench/driver.py`) on the in-process
`LLMEngine` or, with `--target`, on a running OpenAI-compatible server. The comparison runs `run` in process, then
against a fresh `serve run deployments:app ARGS` for each `--serve`, and prints what HTTP adds (bench/README.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench.driver import (HOPS, Record, free_memory, http_front, resolve_model_path, run_engine, run_http, served,
                          served_model_info)
from bench.metrics import distribution
from bench.report import command_line, run_info, write_json, write_summary
from bench.workload import WorkItem

MODULE = "bench.overhead"
FIELDS = ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "throughput_completion_tok_s")
PCTS = (50, 95, 99)
BLOCK_HEADER = "=== streaming benchmark ==="
DEFAULT_MODEL = "kairos-random-42m"  # `run`'s default (kairos-default is the trained model)

# --------------------------------------------------------------------------- one load: `run`

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE} run",
        description="One load: add_request latency, TTFT, TPOT, ITL, end-to-end latency and throughput for a burst "
                    "or a paced stream of requests, in process or against --target.")
    a = p.add_argument_group("model").add_argument
    a("--model", default=DEFAULT_MODEL, help="kairos-random-42m | kairos-default (trained) | kairos-tiny | "
      f"a local HF dir (default: {DEFAULT_MODEL})")
    a("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    a("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto)")
    a("--seed", type=int, default=0, help="engine seed; ShareGPT order (default: 0)")
    a("--num-threads", type=int, default=None, help="in-process engine's torch threads (default: all cores)")
    a("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    a("--load-format", default="auto", choices=("auto", "dummy"),
      help="dummy: random weights built on the device from the model's config (none read; default: auto)")
    a = p.add_argument_group("workload").add_argument
    a("--dataset", choices=("synthetic", "sharegpt"), default="synthetic",
      help="synthetic: --prompt repeated; sharegpt: real prompts and reply lengths (default: synthetic)")
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
    a = p.add_argument_group("scheduler (in process)").add_argument
    a("--policy", default="fcfs", help="fcfs | pack | edf | edf_reject | tpot_guard | scorpio | kairos "
      "(default: fcfs)")
    a("--max-batch-size", type=int, default=8, help="max running requests (max_num_seqs; default: 8)")
    a("--prefill-max-tokens", type=int, default=None, help="prompt-token budget per prefill round (default: none)")
    a = p.add_argument_group("measurement").add_argument
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
    for flag, good in (("--num-requests must be positive", args.num_requests > 0),
                       ("--max-new-tokens must be positive", args.max_new_tokens > 0),
                       ("--submit-interval-ms must be >= 0", args.submit_interval_ms >= 0)):
        if not good:
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
    """Repeats cycled per request, optional unique suffix."""
    reps = parse_repeats(args.prompt_repeats) or [1]
    out = [" ".join([args.prompt] * reps[i % len(reps)]) for i in range(int(args.num_requests))]
    return [f"{p} [{i}]" for i, p in enumerate(out)] if args.unique_prompts else out


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


def build_items(args: argparse.Namespace, tok: Any, max_len: int | None) -> list[WorkItem]:
    """The requests as `WorkItem`s (request i at i x interval)."""
    n = int(args.num_requests)
    if args.dataset == "sharegpt":
        from bench.workload import sharegpt

        samples = sharegpt(tok, n, args.seed, max_len, path=args.dataset_path).samples
        picked = [samples[i % len(samples)] for i in range(n)]
        texts, lens, ignore_eos = [s.text for s in picked], [s.output_len for s in picked], True
    else:
        texts, lens, ignore_eos = build_prompts(args), [args.max_new_tokens] * n, bool(args.no_stop_on_eos)
    seed = args.seed if args.target and args.temperature > 0 else None
    interval = args.submit_interval_ms / 1e3
    return [WorkItem(i * interval, [], lens[i], text=texts[i], ignore_eos=ignore_eos, temperature=args.temperature,
                     seed=seed) for i in range(n)]


def _warmup_items(args: argparse.Namespace) -> list[WorkItem]:
    return [WorkItem(0.0, [], min(4, args.max_new_tokens), text=f"{args.prompt} [warmup {i}]", stream=False)
            for i in range(max(0, args.warmup))]


def _engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig
    from scheduling.config import SchedulerConfig

    sched = SchedulerConfig(policy=args.policy, max_num_seqs=args.max_batch_size,
                            prefill_max_batch_size=args.max_batch_size, prefill_max_tokens=args.prefill_max_tokens)
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                        max_model_len=args.max_model_len, num_threads=args.num_threads, scheduler=sched,
                        load_format=args.load_format)


def _run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from engine.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    startup_s = time.perf_counter() - t0
    try:
        for i, w in enumerate(_warmup_items(args)):  # one after the other
            run_engine(engine, [w], per_request_threads=True, timeout_s=args.request_timeout, tag=f"warmup{i}")
        items = build_items(args, engine.tokenizer, engine.max_model_len)
        run = run_engine(engine, items, per_request_threads=True, timeout_s=args.request_timeout, tag="bench")
        engine_stats = {**run.engine, "kv_blocks_total": engine.stats().kv_blocks_total, "startup_s": startup_s,
                        "profile": engine.profile_report, "dtype": str(engine.bundle.dtype),
                        "max_model_len": engine.max_model_len, "model_path": engine.bundle.path}
    finally:
        engine.shutdown()
        del engine
        free_memory()
    return {"run": run, "engine_stats": engine_stats}


def _run_http(args: argparse.Namespace) -> dict[str, Any]:
    tok, ctx = model_tokenizer(args.model) if args.dataset == "sharegpt" else (None, 0)
    items = build_items(args, tok, args.max_model_len or ctx or None)
    kw = {"api_key": args.api_key, "timeout_s": args.request_timeout}
    for w in _warmup_items(args):
        run_http(args.target, [w], **kw)
    return {"run": run_http(args.target, items, **kw), "engine_stats": None,
            "served_model": served_model_info(args.target, args.api_key)[0]}


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return distribution(values, PCTS)


def _fmt3(d: dict[str, float]) -> str:
    return "/".join(f"{d[f'p{q}']:.2f}" for q in PCTS)


def _ok(r: Record) -> bool:
    return r.completed and r.error is None and bool(r.token_times)


def summarize_run(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    recs: list[Record] = raw["run"].records
    good = [r for r in recs if _ok(r)]
    t_first = min(r.arrival_s for r in recs)
    sent = [r for r in recs if r.sent_s is not None and not (r.error or "").startswith("submit:")]
    ms = lambda a, b: (a - b) * 1e3 if a is not None else None  # noqa: E731
    tpot_ms, itl_ms = [], []
    for r in good:
        tt = r.token_times
        itl_ms.extend((b - a) * 1e3 for a, b in zip(tt, tt[1:]))
        n = r.n_out if args.target else len(tt)
        if n >= 2:
            tpot_ms.append((tt[-1] - tt[0]) / (n - 1) * 1e3)
    finishes = [r.finished_s for r in recs if r.finished_s is not None]
    wall = (max(finishes) - t_first) if finishes else math.nan
    completion_total = sum(r.n_out for r in good)
    rate = (lambda tokens: tokens / wall if wall > 0 else math.nan)
    res: dict[str, Any] = {
        "bench": "overhead run", "model": raw.get("served_model") or args.model,
        "device": args.device if not args.target else f"{args.target}", "mode": "http" if args.target else "engine",
        "dataset": args.dataset, "requests": len(recs), "ok_requests": len(good),
        "failed_requests": len(recs) - len(good),
        "errors": sorted({r.error or (f"rejected: {r.reject_reason}" if r.rejected else
                                      f"finish_reason={r.finish_reason}") for r in recs if not _ok(r)}),
        "prompt_tokens_total": sum(r.prompt_tokens for r in recs), "completion_tokens_total": completion_total,
        "submit_wall_s": raw["run"].submit_end_s - t_first, "wall_s": wall,
        "add_request_ms": _pcts([ms(r.sent_s, r.arrival_s) for r in sent]),
        "ttft_ms": _pcts([ms(r.token_times[0], r.arrival_s) for r in good]),
        "tpot_ms": _pcts(tpot_ms), "itl_ms": _pcts(itl_ms),
        "latency_ms": _pcts([ms(r.finished_s, r.arrival_s) for r in good]),
        "throughput_completion_tok_s": rate(completion_total),
        "throughput_total_tok_s": rate(completion_total + sum(r.prompt_tokens for r in good)),
        "merged_deliveries": sum(r.merged_deliveries for r in recs), "deliveries": sum(r.deliveries for r in recs),
    }
    for name in ("add_request", "ttft", "tpot", "itl", "latency"):
        for q in PCTS:
            res[f"{name}_p{q}_ms"] = res[f"{name}_ms"][f"p{q}"]
    if args.target:  # where the time to first token went, by the server's Server-Timing (bench.driver.HOPS)
        res["hops_p50_ms"] = {h: statistics.median(xs) for h in HOPS
                              if (xs := [r.hops[h] for r in good if h in r.hops])}
    if raw.get("engine_stats") is not None:
        res["engine_stats"] = raw["engine_stats"]
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
    lines = [
        BLOCK_HEADER, f"Model: {res['model']}", f"Device: {res['device']}", f"Requests: {res['requests']}",
        f"Prompt tokens (total): {res['prompt_tokens_total']}",
        f"Completion tokens (total): {res['completion_tokens_total']}",
        f"Submit wall: {res['submit_wall_s']:.6f} s",
        f"add_request latency p50/p95/p99: {_fmt3(res['add_request_ms'])} ms",
        f"TTFT p50/p95/p99: {_fmt3(res['ttft_ms'])} ms",
        f"TPOT p50/p95/p99: {_fmt3(res['tpot_ms'])} ms/token",
        f"ITL p50/p95/p99: {_fmt3(res['itl_ms'])} ms",
        f"Latency p50/p95/p99: {_fmt3(res['latency_ms'])} ms",
        f"Throughput (completion,total): {res['throughput_completion_tok_s']:.2f} tokens/s",
        f"Throughput (prompt+completion): {res['throughput_total_tok_s']:.2f} tokens/s"]
    if res["failed_requests"]:
        lines.append(f"Failed requests: {res['failed_requests']} ({'; '.join(res['errors'][:3])})")
    return "\n".join(lines)


def run(argv: Sequence[str], *, verbose: bool = True) -> dict[str, Any]:
    """Run one load (`run`'s arguments); return every figure (and write --json / --summary if given)."""
    args = parse_args(argv)
    res = summarize_run(args, _run_http(args) if args.target else _run_engine(args))
    res["config"] = dict(vars(args))
    res["run_info"] = run_info(MODULE, ["run", *argv])
    res["command"] = res["run_info"]["command"]
    if verbose:
        print(res["block"], flush=True)
    if args.json:
        write_json(args.json, res)
    if args.summary:
        figures = {k: v for k, v in res.items() if k not in ("per_request", "block", "config", "run_info")}
        write_summary(args.summary, res["command"], f"{res['model']}, {res['requests']} requests: TTFT p50 "
                      f"{res['ttft_p50_ms']:.1f} ms, TPOT p50 {res['tpot_p50_ms']:.1f} ms/token, ITL p99 "
                      f"{res['itl_p99_ms']:.1f} ms, {res['throughput_completion_tok_s']:.1f} tok/s", figures)
    return res


def run_main(argv: Sequence[str]) -> int:
    res = run(list(argv))
    return 0 if res["ok_requests"] else 1


# --------------------------------------------------------------------------- HTTP against in process


def _load(argv: list[str], out: Path) -> dict:
    """One `run` in a process of its own (the in-process engine then has the interpreter to itself)."""
    subprocess.run([sys.executable, "-m", MODULE, "run", *argv, "--json", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return _figures(json.loads(out.read_text()))


def _figures(doc: dict) -> dict:
    """The figures kept of one `run --json` document."""
    figures = {k: round(float(doc[k]), 2) for k in FIELDS} | {"failed": doc["failed_requests"]}
    hops = doc.get("hops_p50_ms") or {}
    if "replica" in hops:  # HTTP: the time to first token outside the replica's handler, and inside it
        figures["outside_p50_ms"] = round(sum(hops.get(h, 0.0) for h in ("client_proxy", "proxy", "body")), 2)
        figures["replica_p50_ms"] = round(hops["replica"], 2)
        figures["hops_p50_ms"] = {h: round(v, 2) for h, v in hops.items()}  # each hop's own (bench.driver.HOP_NOTES)
    return figures


def _served(serve_args: str, bench_argv: list[str], out: Path, log: Path, fronts: dict[str, str]) -> dict:
    """`run` against a fresh `serve run deployments:app` with `serve_args`; the HTTP front that served it goes into
    `fronts` (`driver.http_front`), under those arguments."""
    with served(serve_args, log) as target:
        fronts[serve_args] = http_front()
        return _load(bench_argv + ["--target", target], out)


def _median_of(key: str, values: list) -> Any:
    """One figure over rounds: failures summed, the rest a median."""
    if key == "failed":
        return sum(values)
    if isinstance(values[0], dict):  # per hop: each one's median over the rounds that have it
        return {k: round(statistics.median([v[k] for v in values if k in v]), 2) for k in values[0]}
    return round(statistics.median(values), 2)


def _with_model(serve_args: str, model: str) -> str:
    """`serve_args` with `model=MODEL` added unless it names a model: both sides of a comparison serve one model."""
    if any(t.startswith("model=") for t in serve_args.split()):
        return serve_args
    return f"model={model} {serve_args}".strip()


def _with_engine(serve_args: str, engine: dict[str, str]) -> str:
    """`serve_args` with the comparison's engine knobs (device, dtype, load_format) added where it does not set
    them."""
    given = {t.split("=", 1)[0] for t in serve_args.split()}
    return " ".join([serve_args] + [f"{k}={v}" for k, v in engine.items() if k not in given]).strip()


def _added(rounds: list[dict[str, dict]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per HTTP run: (TTFT, ITL) p50 added over the in-process run, the median over rounds of each round's
    difference (the pairs ran minutes apart; runs of different rounds did not)."""
    return {name: {"in_process": tuple(round(statistics.median(rd[name][k] - rd["in_process"][k] for rd in rounds), 2)
                                       for k in ("ttft_p50_ms", "itl_p50_ms"))}
            for name in rounds[0] if name.startswith("http")}


def _print(figures: dict[str, dict], added: dict[str, dict[str, tuple[float, float]]]) -> None:
    base = figures["in_process"]
    print(f"{'run':<40} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p50':>9} {'tok/s':>8}  added TTFT / ITL (ms)")
    for name, f in figures.items():
        d = (added.get(name) or {}).get("in_process") or (f["ttft_p50_ms"] - base["ttft_p50_ms"],
                                                           f["itl_p50_ms"] - base["itl_p50_ms"])
        text = f"  {d[0]:+.1f} / {d[1]:+.1f}" if name.startswith("http") else ""
        print(f"{name:<40} {f['ttft_p50_ms']:>9.1f} {f['tpot_p50_ms']:>9.1f} {f['itl_p50_ms']:>9.1f} "
              f"{f['throughput_completion_tok_s']:>8.1f}{text}")
        if "replica_p50_ms" in f:
            print(f"{'':<4}TTFT p50 split: {f['outside_p50_ms']:.1f} ms outside the replica's handler (client, proxy, "
                  f"HTTP server, both ways), {f['replica_p50_ms']:.1f} in it (tokenize, engine queue, prefill)")
            print(f"{'':<4}by hop (p50 ms): " + ", ".join(f"{h} {v:.2f}" for h, v in f.get("hops_p50_ms", {}).items()))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return run_main(argv[1:])
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
                                epilog=f"`python -m {MODULE} run --help`: one load.")
    p.add_argument("--serve", action="append", help="serve run arguments of one server (repeatable)")
    p.add_argument("--model", default="kairos-default", help="the model of every run: in process, and of each "
                   "server whose --serve names none")
    p.add_argument("--device", default=None, help="the engine's device on both sides (e.g. cuda; default: each "
                   "side's own default, the CPU)")
    p.add_argument("--dtype", default=None, help="the engine's dtype on both sides (default: auto)")
    p.add_argument("--load-format", default=None, choices=("auto", "dummy"), help="the engine's load_format on both "
                   "sides (dummy: random weights built from the model's config, none read)")
    p.add_argument("--num-threads", type=int, default=None, help="the in-process engine's torch threads (default: "
                   "all cores; a server sizes its own, e.g. one for a GPU engine)")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--submit-interval-ms", type=float, default=150.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--saturate", action="store_true", help="also 150 requests 10 ms apart, HTTP only")
    p.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, in rounds "
                   "(a shared box drifts within minutes); figures are medians over rounds")
    p.add_argument("--summary", help="keep the figures as bench/summaries/NAME.json")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    servers = args.serve if args.serve else ["", "engine_process=false"]

    engine = {k: v for k, v in (("device", args.device), ("dtype", args.dtype), ("load_format", args.load_format))
              if v}

    def load(n: int, ivl: float) -> list[str]:
        return ["--model", args.model, "--prompt", "Hello", "--prompt-repeats", "8", "--unique-prompts",
                "--num-requests", str(n), "--submit-interval-ms", str(ivl), "--max-new-tokens",
                str(args.max_new_tokens), "--no-stop-on-eos"]

    def serve_args(s: str) -> str:
        return _with_engine(_with_model(s, args.model), engine)

    in_process = [a for k, v in engine.items() for a in (f"--{k.replace('_', '-')}", v)]
    if args.num_threads:
        in_process += ["--num-threads", str(args.num_threads)]

    rounds: list[dict[str, dict]] = []
    fronts: dict[str, str] = {}  # a server's arguments -> the HTTP front that served them
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for r in range(args.rounds):  # each round runs every configuration once, so drift hits them alike
            figures: dict[str, dict] = {}
            figures["in_process"] = _load(load(args.num_requests, args.submit_interval_ms) + in_process
                                          + ["--policy", "kairos"], t / f"inproc{r}.json")
            for i, s in enumerate(servers):
                figures[f"http[{s or 'defaults'}]"] = _served(serve_args(s),
                                                              load(args.num_requests, args.submit_interval_ms),
                                                              t / f"http{r}-{i}.json", t / f"serve{r}-{i}.log",
                                                              fronts)
            if args.saturate:
                for i, s in enumerate(servers):
                    figures[f"burst http[{s or 'defaults'}]"] = _served(serve_args(s), load(150, 10.0),
                                                                        t / f"sat{r}-{i}.json", t / f"sat{r}-{i}.log",
                                                                        fronts)
            rounds.append(figures)
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}:")
                _print(figures, {})
    added = _added(rounds)
    figures = {name: {k: _median_of(k, [rd[name][k] for rd in rounds]) for k in rounds[0][name]}
               for name in rounds[0]}
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds (added: the median of each round's difference):")
    _print(figures, added)
    if args.summary:
        first = f"http[{servers[0] or 'defaults'}]"
        ttft, itl = added[first]["in_process"]
        headline = (f"HTTP ({servers[0] or 'defaults'}) adds TTFT {ttft:+.1f} ms, ITL {itl:+.1f} ms p50 over the "
                    f"in-process engine" + (f" (median of {args.rounds} rounds)" if args.rounds > 1 else ""))
        doc = figures | {"added_ttft_itl_ms": added, "http_front": {s or "defaults": fronts.get(serve_args(s))
                                                                      for s in servers}} \
            | ({"rounds": rounds} if args.rounds > 1 else {})
        path = write_summary(args.summary, command_line(MODULE, argv), headline, doc)
        print(f"summary: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
