"""Streaming benchmark: the seeds' `benchmark_streaming` against Kairos (`python -m bench.streaming`).

Reproduces the CLI and the printed block of the seed blog posts (027 pending-queue admission, 028 prefill
micro-batching, 031 prefill token budget, packed admission), driving either the in-process `LLMEngine`
or, with `--target http://host:8000`, a running OpenAI-compatible server (streaming POST /v1/completions).

Submission follows the seeds: one submitting thread calls `add_request` for each request in turn (each call
timed with `time.perf_counter` -> "add_request latency"), sleeping `--submit-interval-ms` between calls, and
starts one consumer thread per request that drains that request's stream and stamps every token on arrival
(client side, `time.perf_counter`). Per request:

- TTFT    = first token arrival - the instant just before its `add_request` call;
- ITL     = gaps between consecutive token arrivals (all requests pooled);
- TPOT    = (last token - first token) / (n - 1), for requests with n >= 2 tokens;
- Latency = last arrival (the finished item) - the instant just before its `add_request` call.

Submit wall = first submit -> end of the submission loop. Throughput (completion,total) = completion tokens /
(first submit -> last finish); a "Throughput (prompt+completion)" line with all tokens follows the block.

Notes on faithfulness
- A `RequestStream` merges pending deltas when its reader is behind, so one delivery can carry k > 1 tokens;
  the client then sees k tokens at the same instant (k - 1 gaps of 0 ms in ITL). `merged_deliveries` in the
  JSON counts these; the engine's own per-token timestamps are in `engine_side` for comparison.
- `--submit-mode inline` emulates the seeds' *before* of 027 (add_request ran the prefill inline): the
  submitting thread blocks on the stream's first item before moving on, so add_request latency includes
  the queueing + prefill of that request, as in the seed.
- `--pretokenize` tokenizes every prompt before the timed loop and passes token ids, so add_request latency
  excludes tokenization (the engine accepts `list[int]`); the tokenization time is reported separately.
- `--no-prefix-cache` is accepted for command-line compatibility with the seeds and ignored: Kairos has no
  prefix cache.
- In Kairos `--max-batch-size` is `SchedulerConfig.max_num_seqs`, the bound on *running* requests, and a
  prefill round admits at most the free slots; so `--prefill-max-batch-size` above `--max-batch-size`
  behaves as `--max-batch-size` (in the seeds the prefill knob could exceed the decode batch).
- `--target`: timestamps are client-side; "add_request latency" is the time to send the request and receive
  the response headers (the Kairos ingress sends headers once the first item is ready, so this includes
  most of TTFT), each request runs in its own thread so a slow header never delays the next submission,
  token counts come from the final usage chunk and ITL uses SSE chunk arrivals (a chunk may hold several
  tokens).

The HTTP client lives in `bench/streaming_http.py`, the per-request record and the figures in
`bench/streaming_report.py`.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from typing import Any, Sequence

from bench.common import run_info, write_json
from bench.models import free_memory, resolve_bench_model
from bench.streaming_http import run_http
from bench.streaming_report import Rec, format_extra, summarize_run

# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.streaming",
        description="Streaming benchmark (the seeds' benchmark_streaming): add_request latency, TTFT, TPOT, "
                    "ITL, end-to-end latency and throughput for a burst or a paced stream of requests.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="kairos-default",
                   help="kairos-default | kairos-tiny | llama-110m | a local HF dir (default: kairos-default)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (default: 0)")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt", default="Hello", help="base prompt (default: Hello)")
    g.add_argument("--prompt-repeats", default=None,
                   help='comma-separated repeat counts, cycled per request; repeat r -> " ".join([prompt]*r). '
                        'Example: "1,1,1,64" is a 3-short + 1-long mix')
    g.add_argument("--unique-prompts", action="store_true", help='append " [i]" to request i\'s prompt')
    g.add_argument("--num-requests", type=int, default=16, help="number of streaming requests (default: 16)")
    g.add_argument("--submit-interval-ms", type=float, default=0.0,
                   help="sleep this many ms between submissions (default: 0 = burst)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per request (default: 32)")
    g.add_argument("--no-stop-on-eos", action="store_true", help="keep generating past EOS (ignore_eos)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    g = p.add_argument_group("scheduler")
    g.add_argument("--policy", default="fcfs",
                   help="scheduler policy: fcfs | pack | edf | edf_reject | tpot_guard | scorpio | kairos "
                        "(default: fcfs, the seeds' scheduler)")
    g.add_argument("--max-batch-size", type=int, default=8,
                   help="max running requests (SchedulerConfig.max_num_seqs; default: 8)")
    g.add_argument("--prefill-max-batch-size", type=int, default=None,
                   help="max requests per prefill round (default: same as --max-batch-size)")
    g.add_argument("--prefill-max-tokens", type=int, default=None,
                   help="prompt-token budget per prefill round (default: unlimited)")
    g.add_argument("--prefill-admission-policy", choices=("fifo", "pack"), default="fifo",
                   help="prefill admission policy (default: fifo)")
    g.add_argument("--prefill-admission-lookahead", type=int, default=64,
                   help="pending lookahead window for pack admission (default: 64)")
    g.add_argument("--prefill-force-fifo-every", type=int, default=0,
                   help="force a FIFO admission round every N rounds (default: 0 = never)")
    g.add_argument("--hybrid-steps", action="store_true",
                   help="decode the running requests in every step, prefill rounds included (the seeds' worker "
                        "loop: a prefill round then a decode round per iteration); default: the policy's")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="accepted for compatibility with the seeds' commands; ignored (Kairos has no prefix cache)")
    g = p.add_argument_group("measurement")
    g.add_argument("--submit-mode", choices=("async", "inline"), default="async",
                   help="async: add_request returns at once (Kairos). inline: the submitter waits for each "
                        "request's first output before submitting the next, emulating the seeds' pre-027 "
                        "add_request that ran the prefill inline (default: async)")
    g.add_argument("--pretokenize", action="store_true",
                   help="tokenize all prompts before the timed loop and submit token ids, so add_request "
                        "latency excludes tokenization")
    g.add_argument("--warmup", type=int, default=1,
                   help="untimed warm-up requests after the engine starts (default: 1)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="give up on a request whose stream is silent this long, in s (default: 600)")
    g.add_argument("--target", default=None,
                   help="drive a running OpenAI-compatible server (e.g. http://127.0.0.1:8000) through "
                        "streaming POST /v1/completions instead of the in-process engine")
    g.add_argument("--api-key", default=None, help="bearer token for --target")
    g.add_argument("--json", default=None, metavar="PATH", help="write every figure (and per-request data) here")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    _check_args(args)
    return args


def _check_args(args: argparse.Namespace) -> None:
    if args.num_requests <= 0:
        raise SystemExit("--num-requests must be positive")
    if args.max_new_tokens <= 0:
        raise SystemExit("--max-new-tokens must be positive")
    if args.submit_interval_ms < 0:
        raise SystemExit("--submit-interval-ms must be >= 0")
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
    repeats = parse_repeats(args.prompt_repeats)
    prompts = []
    for i in range(int(args.num_requests)):
        rep = repeats[i % len(repeats)] if repeats is not None else 1
        p = " ".join([args.prompt] * rep) if rep > 1 else args.prompt
        if args.unique_prompts:
            p = f"{p} [{i}]"
        prompts.append(p)
    return prompts


def command_for(argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "bench.streaming", *argv])


# --------------------------------------------------------------------------- in-process engine


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
                        scheduler=sched)


def _sampling(args: argparse.Namespace):
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                          ignore_eos=bool(args.no_stop_on_eos))


def _take(rec: Rec, out, t: float) -> bool:
    """Record one stream item that arrived at `t`; True when it was the final one."""
    k = len(out.token_ids)
    if k:
        rec.token_times.extend([t] * k)
        rec.deliveries += 1
        if k > 1:
            rec.merged_deliveries += 1
    if not out.finished:
        return False
    rec.finish_ts = t
    rec.finish_reason = out.finish_reason
    rec.prompt_tokens = out.num_prompt_tokens
    rec.completion_tokens = out.num_output_tokens or len(rec.token_times)
    if out.error or out.reject_reason:
        rec.error = out.error or f"rejected: {out.reject_reason}"
    m = out.metrics
    if m is not None:
        rec.engine = {"arrival_s": m.arrival_s, "admitted_s": m.admitted_s, "first_token_s": m.first_token_s,
                      "finished_s": m.finished_s, "token_times": list(m.token_times)}
    return True


def _consume(stream, rec: Rec, first, timeout: float) -> None:
    try:
        if first is not None:
            out, t = first
            if _take(rec, out, t):
                return
        while True:
            out = stream.get(timeout)
            if _take(rec, out, time.perf_counter()):
                return
    except TimeoutError as e:
        rec.error = f"timeout: {e}"
    except Exception as e:  # noqa: BLE001 - recorded, reported as an error
        rec.error = f"{type(e).__name__}: {e}"


def _warmup(engine, args: argparse.Namespace, n: int) -> None:
    from engine.sampling import SamplingParams

    for i in range(max(0, n)):
        s = engine.add_request(f"{args.prompt} [warmup {i}]",
                               SamplingParams(max_tokens=min(4, args.max_new_tokens), temperature=0.0,
                                              ignore_eos=True), request_id=f"warmup-{i}")
        for _ in s:
            pass


def _run_engine(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    from engine.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    startup_s = time.perf_counter() - t0
    try:
        _warmup(engine, args, args.warmup)
        tokenize_ms: list[float] = []
        if args.pretokenize:
            eos = engine.bundle.eos_token_ids[0]
            inputs: list[Any] = []
            for p in prompts:
                ts = time.perf_counter()
                inputs.append(engine.tokenizer.encode(p, add_special_tokens=False) or [eos])
                tokenize_ms.append((time.perf_counter() - ts) * 1e3)
        else:
            inputs = list(prompts)
        params = [_sampling(args) for _ in prompts]
        recs = [Rec(i) for i in range(len(prompts))]
        threads: list[threading.Thread] = []
        inline = args.submit_mode == "inline"
        interval = args.submit_interval_ms / 1e3
        timeout = args.request_timeout
        steps0 = engine.stats().steps
        t_first = time.perf_counter()
        for i, inp in enumerate(inputs):
            rec = recs[i]
            rec.submit_start = time.perf_counter()
            try:
                stream = engine.add_request(inp, params[i], None, f"bench-{i}")
            except Exception as e:  # noqa: BLE001 - counted as a failed request
                rec.submit_end = time.perf_counter()
                rec.add_error = f"{type(e).__name__}: {e}"
                continue
            first = None
            if inline:  # the seeds' "before": add_request returned only after the request's prefill
                try:
                    out = stream.get(timeout)
                    first = (out, time.perf_counter())
                except TimeoutError as e:
                    rec.error = f"timeout: {e}"
            rec.submit_end = time.perf_counter()
            if rec.error is None:
                th = threading.Thread(target=_consume, args=(stream, rec, first, timeout), daemon=True,
                                      name=f"bench-consumer-{i}")
                th.start()
                threads.append(th)
            if interval > 0 and i + 1 < len(inputs):
                time.sleep(interval)
        submit_end = time.perf_counter()
        for th in threads:
            th.join()
        st = engine.stats()
        engine_stats = {"steps": st.steps - steps0, "phase_s": dict(st.phase_s), "rejected": dict(st.rejected),
                        "kv_blocks_total": st.kv_blocks_total, "startup_s": startup_s,
                        "profile": engine.profile_report, "dtype": str(engine.bundle.dtype),
                        "max_model_len": engine.max_model_len, "model_path": engine.bundle.path}
    finally:
        engine.shutdown()
        del engine
        free_memory()
    return {"recs": recs, "t_first": t_first, "submit_end": submit_end, "tokenize_ms": tokenize_ms,
            "engine_stats": engine_stats}


# --------------------------------------------------------------------------- entry points


def run(args: argparse.Namespace, *, verbose: bool = True, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run one benchmark configuration in-process; return every figure (and write --json if given)."""
    _check_args(args)
    prompts = build_prompts(args)
    raw = run_http(args, prompts) if args.target else _run_engine(args, prompts)
    res = summarize_run(args, raw)
    res["config"] = {k: v for k, v in vars(args).items()}
    res["run_info"] = run_info("bench.streaming", argv if argv is not None else to_argv(args))
    res["command"] = res["run_info"].get("command") or command_for(to_argv(args))
    if verbose:
        print(res["block"])
        print(format_extra(res), flush=True)
    if getattr(args, "json", None):
        write_json(args.json, res)
    return res


def to_argv(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that reproduce `args` (defaults omitted)."""
    defaults = vars(build_parser().parse_args([]))
    parser = build_parser()
    out: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
        if not action.option_strings or action.dest == "help":
            continue
        v = getattr(args, action.dest, None)
        if v == defaults.get(action.dest) or action.dest == "json":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if v:
                out.append(flag)
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        out += [flag, str(v)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    res = run(args, argv=argv)
    if args.json:
        print(f"wrote {args.json}")
    return 0 if res["ok_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
