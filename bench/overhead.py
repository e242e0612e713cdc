"""What the HTTP path adds over the in-process engine, back to back, same model and load.

    python -m bench.overhead [--serve "" --serve "engine_process=false" ...] [--inproc-threads 2,1] [--saturate]
                             [--rounds N] [--cpu] [--summary NAME]

Runs `bench.streaming` in-process (once per `--inproc-threads` entry; default: torch's default), then once against `serve run deployments:app ARGS` for each `--serve` (ARGS: app key=value arguments, and
NAME=VALUE environment variables of that server, e.g. `--serve "RAY_SERVE_ENABLE_HA_PROXY=0"`)
(default: the defaults, and the engine as a thread of its replica), each server started fresh, warmed with
one request, and stopped (`ray stop --force`) before the next. Prints p50 TTFT / TPOT / ITL and tok/s of each
and what HTTP adds over the in-process run, and for each HTTP run where its TTFT went: outside the replica's
handler (client, proxy, HTTP server) and in it (its Server-Timing `replica`). `--saturate` adds the same
comparison under a burst (150 requests 10 ms apart) without the in-process run. `--rounds N` runs all of it N
times, in rounds, and reports medians (the added TTFT / ITL as the median of each round's own difference). `--cpu`
adds, for each run, where the machine's CPU went while the load ran (`bench.procstat`): CPU seconds and run-queue
wait (ready, waiting for a core) of the engine process, the replica, HAProxy, Serve's controller, the rest of Ray,
and the client (with its start-up; in process, the one process that is engine and client). Never run beside
another benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import procstat
from bench.report import command_line, write_summary
from bench.serving import served

MODULE = "bench.overhead"
FIELDS = ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "throughput_completion_tok_s")


def _streaming(argv: list[str], out: Path, cpu: bool = False) -> dict:
    before, client0 = (procstat.snapshot(), procstat.children_cpu_s()) if cpu else ({}, 0.0)
    subprocess.run([sys.executable, "-m", "bench.streaming", *argv, "--json", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    figures = _figures(json.loads(out.read_text()))
    if cpu:
        used = procstat.usage(before, procstat.snapshot())
        bench = "client" if "--target" in argv else "engine and client (one process)"  # bench.streaming itself
        figures["cpu_s"] = {g: [round(t.cpu_s, 2), round(t.wait_s, 2)] for g, t in sorted(used.items())} | {
            bench: [round(procstat.children_cpu_s() - client0, 2), None]}
    return figures


def _figures(doc: dict) -> dict:
    """The figures kept of one `bench.streaming --json` document."""
    figures = {k: round(float(doc[k]), 2) for k in FIELDS} | {"failed": doc["failed_requests"]}
    hops = doc.get("hops_p50_ms") or {}
    if "replica" in hops:  # HTTP: the time to first token outside the replica's handler, and inside it
        figures["outside_p50_ms"] = round(hops.get("client_proxy", 0.0) + hops.get("body", 0.0), 2)
        figures["replica_p50_ms"] = round(hops["replica"], 2)
    return figures


def _served(serve_args: str, bench_argv: list[str], out: Path, log: Path, cpu: bool = False) -> dict:
    """`bench.streaming` against a fresh `serve run deployments:app` with `serve_args` (see bench.serving)."""
    with served(serve_args, log) as target:
        return _streaming(bench_argv + ["--target", target], out, cpu)


def _median_of(key: str, values: list) -> Any:
    """One figure over rounds: failures summed, CPU per group as medians, the rest a median."""
    if key == "failed":
        return sum(values)
    if key == "cpu_s":
        return {g: [None if values[0][g][j] is None else round(statistics.median(v[g][j] for v in values), 2)
                    for j in range(2)] for g in values[0] if all(g in v for v in values)}
    return round(statistics.median(values), 2)


def _with_model(serve_args: str, model: str) -> str:
    """`serve_args` with `model=MODEL` added unless it names a model: both sides of a comparison serve one model."""
    if any(t.startswith("model=") for t in serve_args.split()):
        return serve_args
    return f"model={model} {serve_args}".strip()


def _added(rounds: list[dict[str, dict]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per HTTP run and in-process baseline: (TTFT, ITL) p50 added, the median over rounds of each round's
    difference (the pairs ran minutes apart; runs of different rounds did not)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name in rounds[0]:
        if name.startswith(("in_process", "burst")):
            continue
        out[name] = {b: tuple(round(statistics.median(rd[name][k] - rd[b][k] for rd in rounds), 2)
                              for k in ("ttft_p50_ms", "itl_p50_ms"))
                     for b in rounds[0] if b.startswith("in_process")}
    return out


def _print(figures: dict[str, dict], added: dict[str, dict[str, tuple[float, float]]]) -> None:
    bases = {k: f for k, f in figures.items() if k.startswith("in_process")}
    print(f"{'run':<40} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p50':>9} {'tok/s':>8}  added TTFT / ITL (ms) vs in-process")
    for name, f in figures.items():
        text = ""
        if not name.startswith(("in_process", "burst")):
            diffs = added.get(name) or {k: (f["ttft_p50_ms"] - b["ttft_p50_ms"], f["itl_p50_ms"] - b["itl_p50_ms"])
                                        for k, b in bases.items()}
            text = "  " + ", ".join(f"{d[0]:+.1f} / {d[1]:+.1f}{'' if k == 'in_process' else ' vs ' + k[len('in_process'):]}"
                                    for k, d in diffs.items())
        print(f"{name:<40} {f['ttft_p50_ms']:>9.1f} {f['tpot_p50_ms']:>9.1f} {f['itl_p50_ms']:>9.1f} "
              f"{f['throughput_completion_tok_s']:>8.1f}{text}")
        if "replica_p50_ms" in f:
            print(f"{'':<4}TTFT p50 split: {f['outside_p50_ms']:.1f} ms outside the replica's handler (client, proxy, "
                  f"HTTP server, both ways), {f['replica_p50_ms']:.1f} in it (tokenize, engine queue, prefill)")
        if "cpu_s" in f:
            print(f"{'':<4}CPU s (run-queue wait s) while it ran: " + ", ".join(
                f"{g} {c:.2f}" + (f" ({w:.2f})" if w is not None else "") for g, (c, w) in f["cpu_s"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="append", help="serve run arguments of one server (repeatable)")
    p.add_argument("--model", default="kairos-default", help="the model of every run: in process, and of each "
                   "server whose --serve names none")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--submit-interval-ms", type=float, default=150.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--inproc-threads", default="", help="comma-separated torch thread counts of the in-process "
                   "runs (the first is the baseline of 'added'); empty: torch's default")
    p.add_argument("--saturate", action="store_true", help="also 150 requests 10 ms apart, HTTP only")
    p.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, in rounds "
                   "(this box drifts by up to 35%% within a minute); figures are medians over rounds")
    p.add_argument("--cpu", action="store_true", help="also where the CPU went during each run (bench.procstat)")
    p.add_argument("--summary", help="keep the figures as bench/summaries/NAME.json")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    servers = args.serve if args.serve else ["", "engine_process=false"]

    def load(n: int, ivl: float) -> list[str]:
        return ["--model", args.model, "--prompt", "Hello", "--prompt-repeats", "8", "--unique-prompts",
                "--num-requests", str(n), "--submit-interval-ms", str(ivl), "--max-new-tokens",
                str(args.max_new_tokens), "--no-stop-on-eos"]

    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for r in range(args.rounds):  # each round runs every configuration once, so drift hits them alike
            figures: dict[str, dict] = {}
            for i, n in enumerate(x.strip() for x in (args.inproc_threads or "").split(",")):
                name = "in_process" if i == 0 else f"in_process[{n} threads]"
                figures[name] = _streaming(load(args.num_requests, args.submit_interval_ms) + ["--policy", "kairos"]
                                           + (["--num-threads", n] if n else []), t / f"inproc{r}-{i}.json",
                                           args.cpu)
            for i, s in enumerate(servers):
                figures[f"http[{s or 'defaults'}]"] = _served(_with_model(s, args.model),
                                                              load(args.num_requests, args.submit_interval_ms),
                                                              t / f"http{r}-{i}.json", t / f"serve{r}-{i}.log",
                                                              args.cpu)
            if args.saturate:
                for i, s in enumerate(servers):
                    figures[f"burst http[{s or 'defaults'}]"] = _served(_with_model(s, args.model), load(150, 10.0),
                                                                        t / f"sat{r}-{i}.json", t / f"sat{r}-{i}.log")
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
        doc = figures | {"added_ttft_itl_ms": added} | ({"rounds": rounds} if args.rounds > 1 else {})
        path = write_summary(args.summary, command_line(MODULE, argv), headline, doc)
        print(f"summary: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
