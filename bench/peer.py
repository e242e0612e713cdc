"""Kairos against vLLM's CPU build on the same model, same box, one run (bench/README.md).

    python -m bench.peer --vllm-venv /work/peers/vllm --paired auto:bfloat16 --reps 4   # decode, side by side
    python -m bench.peer --vllm-venv /work/peers/vllm --serve --rate 1 --reps 2        # servers: TTFT, TPOT, req/s

The workload: B prompts of 64 random token ids (seeded, the same for both engines), 64 new tokens each with EOS
ignored, greedy (or `--temperature`, `--top-p`), all B submitted at once; tok/s = B * 64 / (submit to last token).
Kairos runs in this process, vLLM in a child process of the peer venv (`LLM(model=dir, dtype=..., max_model_len=
1024)`, computing on every core; stopped with SIGSTOP between its runs). One engine of each stays alive and they
alternate run by run, in turn first: per batch size, each engine's best run and the median over rounds of the
round's ratio. Without --vllm-venv, Kairos alone.

`--serve` compares the servers instead: `serve run deployments:app` (`--serve-args`) against vLLM's OpenAI server,
one at a time, alternating `--reps` rounds, each freshly started and warmed, under vLLM's own `bench serve` client
(the chat route, ShareGPT exported by `bench.workload`, `--num-prompts` at `--rate` req/s, seed 0): each run's
median TTFT, median TPOT and request throughput, and per engine the median of its runs.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TextIO

MODULE = "bench.peer"
ROOT = Path(__file__).resolve().parent.parent


def make_prompts(batches: list[int], prompt_len: int, vocab_limit: int, seed: int) -> dict[int, list[list[int]]]:
    """Token ids in [100, vocab_limit): no special tokens (they sit at the start of every vocab we serve)."""
    rng = random.Random(seed)
    return {b: [[rng.randrange(100, vocab_limit) for _ in range(prompt_len)] for _ in range(b)] for b in batches}


# --------------------------------------------------------------------------- vLLM (child process, stdlib + vllm)


REPLY = "@@peer "  # the prefix of the child's replies on its stderr (vLLM logs there too)


class _VllmRunner:
    """One vLLM `LLM` in the child, and one timed `generate` of a batch's prompts per call."""

    def __init__(self, spec: dict[str, Any]) -> None:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gb", 2)))
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        self.llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                       skip_tokenizer_init=True, seed=0)
        self.start_s = time.perf_counter() - t0
        self.params = SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True,
                                     temperature=spec.get("temperature", 0.0), top_p=spec.get("top_p", 1.0),
                                     detokenize=False)
        self.inputs = {int(b): [TokensPrompt(prompt_token_ids=p) for p in ps] for b, ps in spec["prompts"].items()}

    def __call__(self, b: int) -> tuple[float, int]:
        t = time.perf_counter()
        outs = self.llm.generate(self.inputs[b], self.params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def serve_commands(run: Callable[[int], tuple[float, int]], ready: dict[str, Any], cmds: TextIO,
                   replies: TextIO) -> None:
    """The child's loop: one reply line (REPLY + JSON) when ready, then per command line (`{"b": B}`) one timed run
    and its reply, until the commands end."""
    replies.write(REPLY + json.dumps(ready) + "\n")
    replies.flush()
    for line in cmds:
        if not line.strip():
            break
        b = int(json.loads(line)["b"])
        wall, ntok = run(b)
        replies.write(REPLY + json.dumps({"b": b, "wall_s": wall, "tokens": ntok}) + "\n")
        replies.flush()


def _vllm_child(spec_path: str) -> None:
    run = _VllmRunner(json.loads(Path(spec_path).read_text()))
    serve_commands(run, {"start_s": run.start_s}, sys.stdin, sys.stderr)


def _child_cmd(venv: str) -> tuple[list[str], dict[str, str]]:
    python = Path(venv).expanduser() / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no Python at {python}: pass --vllm-venv, the venv where vllm-cpu is installed")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    return [str(python), "-m", MODULE, "--child"], env


class VllmSession:
    """A vLLM child kept alive: `run(b)` -> (wall s, tokens) of one timed run of batch b. Between its runs the
    child's processes are stopped (SIGSTOP): idle, vLLM's CPU workers poll and take every core."""

    def __init__(self, venv: str, model_dir: str, dtype: str, prompts: dict[int, list[list[int]]],
                 new_tokens: int, workdir: Path, temperature: float = 0.0, top_p: float = 1.0) -> None:
        cmd, env = _child_cmd(venv)
        spec = workdir / f"spec-{dtype}.json"
        spec.write_text(json.dumps({"model": model_dir, "dtype": dtype, "max_model_len": 1024, "prompts": prompts,
                                    "new_tokens": new_tokens, "temperature": temperature, "top_p": top_p}))
        self.dtype, self._tail = dtype, collections.deque(maxlen=15)
        self.proc = subprocess.Popen([*cmd, str(spec)], env=env, cwd=workdir, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)  # its own process group: the engine's processes too
        self.start_s = float(self._reply()["start_s"])
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # it has ended; _reply says how
            pass

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            self._tail.append(line.rstrip())
        raise RuntimeError(f"vLLM child ({self.dtype}) ended with code {self.proc.wait()}:\n" + "\n".join(self._tail))

    def run(self, b: int) -> tuple[float, int]:
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps({"b": b}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        self._signal(signal.SIGSTOP)
        return float(reply["wall_s"]), int(reply["tokens"])

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the commands end: the child returns and exits
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --------------------------------------------------------------------------- Kairos (this process)


class KairosSession:
    """Kairos's engine in this process: `run(b)` -> (wall s, tokens) of one run of batch b's prompts."""

    def __init__(self, model: str, dtype: str, prompts: dict[int, list[list[int]]], new_tokens: int,
                 threads: int, temperature: float = 0.0, top_p: float = 1.0) -> None:
        import torch

        from core.sampling import SamplingParams
        from engine.engine import LLMEngine

        t0 = time.perf_counter()
        self.eng = LLMEngine(model=model, dtype=dtype, num_threads=threads, max_model_len=1024)
        self.start_s = time.perf_counter() - t0
        self.dtype = str(self.eng.bundle.dtype).removeprefix("torch.")
        self.threads = torch.get_num_threads()
        self.prompts = prompts
        self.params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=temperature,
                                     top_p=top_p, ignore_eos=True)

    def run(self, b: int) -> tuple[float, int]:
        t = time.perf_counter()
        streams = self.eng.add_requests(self.prompts[b], self.params)  # all B at once, as vLLM's LLM.generate
        ntok = 0
        for s in streams:
            for out in s:
                if out.finished:
                    ntok += out.num_output_tokens
        return time.perf_counter() - t, ntok

    def close(self) -> None:
        self.eng.shutdown()


def run_paired(model_dir: str, kdtype: str, venv: str | None, vdtype: str, prompts: dict[int, list[list[int]]],
               new_tokens: int, rounds: int, threads: int, temperature: float = 0.0,
               top_p: float = 1.0) -> dict[str, Any]:
    """Both engines alive (Kairos alone without `venv`), alternating run by run (see the module's doc)."""
    with tempfile.TemporaryDirectory() as tmp:
        sessions: dict[str, Any] = {"kairos": KairosSession(model_dir, kdtype, prompts, new_tokens, threads,
                                                            temperature, top_p)}
        try:
            if venv:
                sessions["vllm"] = VllmSession(venv, model_dir, vdtype, prompts, new_tokens, Path(tmp), temperature,
                                               top_p)
            names = list(sessions)
            for b in prompts:  # warm-ups
                for s in sessions.values():
                    s.run(b)
            runs: dict[int, list[dict[str, float]]] = {b: [] for b in prompts}
            for r in range(rounds):
                for b in prompts:
                    pair: dict[str, float] = {}
                    for name in (names if r % 2 == 0 else names[::-1]):
                        wall, ntok = sessions[name].run(b)
                        pair[name] = ntok / wall
                    runs[b].append(pair)
                    print(f"round {r + 1} B={b}: " + ", ".join(f"{e} {x:.1f}" for e, x in pair.items()) + " tok/s"
                          + (f" ({pair['kairos'] / pair['vllm']:.2f}x)" if "vllm" in pair else ""), file=sys.stderr,
                          flush=True)
        finally:
            for s in reversed(sessions.values()):
                s.close()
    return {"kairos_dtype": sessions["kairos"].dtype, "vllm_dtype": vdtype if venv else None,
            "start_s": {e: s.start_s for e, s in sessions.items()}, "runs": runs, **paired_figures(runs)}


def paired_figures(runs: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    """Per batch size: each engine's best tok/s, and the median and range over rounds of the round's ratio."""
    out: dict[str, Any] = {"best_tok_s": {}, "ratio_median": {}, "ratio_range": {}}
    for b, pairs in runs.items():
        out["best_tok_s"][b] = {e: max(p[e] for p in pairs) for e in pairs[0]}
        if "vllm" in pairs[0]:
            ratios = sorted(p["kairos"] / p["vllm"] for p in pairs)
            out["ratio_median"][b] = statistics.median(ratios)
            out["ratio_range"][b] = (ratios[0], ratios[-1])
    return out


# --------------------------------------------------------------------------- servers (--serve)

VLLM_PORT = 8001
# vLLM's `bench serve` as a module call: its `vllm` console command fails on a CPU install
BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
SERVE_FIGURES = ("median_ttft_ms", "median_tpot_ms", "request_throughput", "mean_ttft_ms", "p99_ttft_ms",
                 "median_itl_ms", "output_throughput", "completed", "failed", "duration")


def bench_serve(venv: str, url: str, model_dir: str, dataset: str, num_prompts: int, rate: float, out: Path,
                served_name: str = "kairos-default") -> dict[str, Any]:
    """One `vllm.benchmarks.serve` run against `url` (the chat route, ShareGPT); its figures (SERVE_FIGURES)."""
    cmd, env = _child_cmd(venv)
    env.pop("PYTHONPATH")  # vLLM's own modules only
    argv = [cmd[0], "-c", BENCH_SERVE, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", url, "--model", served_name, "--tokenizer", model_dir, "--dataset-name", "sharegpt",
            "--dataset-path", dataset, "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    proc = subprocess.run(argv, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n" + "\n".join(proc.stdout.splitlines()[-15:]))
    res = json.loads(out.read_text())
    return {k: res.get(k) for k in SERVE_FIGURES}


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    from bench.driver import ok

    deadline = time.monotonic() + timeout_s
    while not ok(f"{url}/v1/completions", {"model": "kairos-default", "prompt": "warm", "max_tokens": 4}, 30):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server did not come up (code {proc.poll()})")
        time.sleep(2)


def vllm_server_run(venv: str, model_dir: str, run: Callable[[str], dict[str, Any]], log: Path,
                    timeout_s: float) -> dict[str, Any]:
    """vLLM's OpenAI server on 127.0.0.1:VLLM_PORT (bf16, the model's dir served as kairos-default), up and
    warmed; `run(url)`; then stopped (its process group)."""
    python = Path(venv).expanduser() / "bin" / "python"
    _, env = _child_cmd(venv)
    env.pop("PYTHONPATH")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            "kairos-default", "--dtype", "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1",
            "--port", str(VLLM_PORT)]
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, cwd=log.parent, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{VLLM_PORT}"
    try:
        _wait_http(url, proc, timeout_s)
        return run(url)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_servers(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """`--serve`: Kairos's and vLLM's servers under vLLM's client, alternating (see the module's doc)."""
    from bench.driver import served
    from bench.workload import main as export_sharegpt

    runs: dict[str, list[dict[str, Any]]] = {"kairos": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dataset = args.dataset_path or str(work / "sharegpt.json")
        if not args.dataset_path:
            export_sharegpt(["--export-sharegpt", dataset])
        for r in range(args.reps):
            for engine in (("kairos", "vllm") if r % 2 == 0 else ("vllm", "kairos")):
                out = work / f"{engine}-{r}.json"

                def client(url: str, out: Path = out) -> dict[str, Any]:
                    return bench_serve(args.vllm_venv, url, model_dir, dataset, args.num_prompts, args.rate, out)

                if engine == "kairos":
                    with served(args.serve_args, work / f"serve-{r}.log") as url:
                        fig = client(url)
                else:
                    fig = vllm_server_run(args.vllm_venv, model_dir, client, work / f"vllm-{r}.log",
                                          args.vllm_timeout)
                runs[engine].append(fig)
                print(f"round {r + 1} {engine}: TTFT p50 {fig['median_ttft_ms']:.1f} ms, TPOT p50 "
                      f"{fig['median_tpot_ms']:.1f} ms, {fig['request_throughput']:.3f} req/s", file=sys.stderr,
                      flush=True)
    med = {e: {k: statistics.median(f[k] for f in fs) for k in ("median_ttft_ms", "median_tpot_ms",
                                                                 "request_throughput", "mean_ttft_ms", "p99_ttft_ms")}
           for e, fs in runs.items()}
    return {"runs": runs, "median_of_runs": med,
            "workload": f"vllm.benchmarks.serve, openai-chat, ShareGPT, {args.num_prompts} prompts at {args.rate} "
                        f"req/s, seed 0; kairos: serve run deployments:app {args.serve_args}".rstrip()}


def _main_serve(args: argparse.Namespace, model_dir: str) -> int:
    from bench.report import command_line, print_table, write_json, write_summary

    if not args.vllm_venv:
        raise SystemExit("--serve needs --vllm-venv")
    res = run_servers(args, model_dir)
    med = res["median_of_runs"]
    headers = ["server", "TTFT p50 ms", "TPOT p50 ms", "req/s", "TTFT mean ms", "TTFT p99 ms"]
    rows = [[e, m["median_ttft_ms"], m["median_tpot_ms"], f"{m['request_throughput']:.3f}", m["mean_ttft_ms"],
             m["p99_ttft_ms"]] for e, m in med.items()]
    print_table(headers, rows, title=f"{res['workload']}; median of {args.reps} runs each, alternating")
    k, v = med["kairos"], med["vllm"]
    head = (f"vLLM bench serve, ShareGPT chat, {args.num_prompts} prompts at {args.rate} req/s, median of "
            f"{args.reps} alternating runs: TTFT p50 {k['median_ttft_ms']:.0f} vs vLLM {v['median_ttft_ms']:.0f} ms, "
            f"TPOT p50 {k['median_tpot_ms']:.1f} vs {v['median_tpot_ms']:.1f} ms, "
            f"{k['request_throughput']:.2f} vs {v['request_throughput']:.2f} req/s")
    print(head)
    if args.json:
        write_json(args.json, {"args": vars(args), **res})
    if args.summary:
        write_summary(args.summary, command_line(MODULE, None), head,
                      {"table": {"headers": headers, "rows": rows}, **res})
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", help="venv with vllm-cpu installed (omit to run Kairos alone)")
    ap.add_argument("--model", default="kairos-default", help="Kairos model name or HF dir (default kairos-default)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="rounds (after one warm-up run of each engine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-timeout", type=float, default=1200.0, help="--serve: seconds for vLLM's server to start")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--summary", metavar="NAME", help="write bench/summaries/NAME.json")
    ap.add_argument("--temperature", type=float, default=0.0, help="both engines (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="both engines, with --temperature > 0")
    ap.add_argument("--paired", metavar="KAIROS_DTYPE:VLLM_DTYPE", default="auto:bfloat16",
                    help="the engines' dtypes (default auto:bfloat16)")
    ap.add_argument("--emulate-avx2", action="store_true",
                    help="both engines as on a CPU with AVX2 but no AVX-512 (see AVX2_ENV): Kairos builds its kernels "
                         "without AVX-512 and `auto` means float32; vLLM's oneDNN and MKL stop at AVX2")
    ap.add_argument("--serve", action="store_true", help="compare the servers under vLLM's bench serve client "
                    "(ShareGPT chat): median TTFT, TPOT and request throughput, --reps alternating runs each")
    ap.add_argument("--serve-args", default="", help="--serve: Kairos's app arguments (serve run deployments:app ARGS)")
    ap.add_argument("--rate", type=float, default=1.0, help="--serve: request rate (req/s)")
    ap.add_argument("--num-prompts", type=int, default=48, help="--serve: requests per run")
    ap.add_argument("--dataset-path", help="--serve: a ShareGPT JSON (default: exported by bench.workload)")
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# What --emulate-avx2 sets before either engine starts (torch reads ATEN_CPU_CAPABILITY, oneDNN ONEDNN_MAX_CPU_ISA and
# MKL MKL_ENABLE_INSTRUCTIONS once, at start-up: hence a fresh process). On a Zen 4, whose AVX-512 runs on 256-bit
# units, AVX2 code reaches the same FLOPs a cycle as on the Zen 2/3 EPYCs this emulates.
AVX2_ENV = {"KAIROS_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emulate_avx2 and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, "-m", MODULE, *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, **AVX2_ENV})
    if args.child:
        _vllm_child(args.child)
        return 0
    from transformers import AutoConfig, AutoTokenizer

    from bench.driver import resolve_model_path
    from bench.report import print_table, run_info, write_json, write_summary

    info = run_info(MODULE, argv)
    batches = [int(x) for x in args.batches.split(",")]
    model_dir = resolve_model_path(args.model)
    if args.serve:
        return _main_serve(args, model_dir)
    kdtype, _, vdtype = args.paired.partition(":")
    if not (kdtype and vdtype):
        raise SystemExit("--paired takes KAIROS_DTYPE:VLLM_DTYPE, e.g. auto:bfloat16")
    # no tensor work on this thread: it would start an OpenMP pool beside the engine's (see LLMEngine._setup)
    vocab = min(len(AutoTokenizer.from_pretrained(model_dir)), AutoConfig.from_pretrained(model_dir).vocab_size)
    prompts = make_prompts(batches, args.prompt_len, vocab, seed=0)
    res = run_paired(model_dir, kdtype, args.vllm_venv, vdtype, prompts, args.new_tokens, args.reps, args.threads,
                     args.temperature, args.top_p)
    best = res["best_tok_s"]
    headers = ["B", f"kairos {res['kairos_dtype']} best tok/s"]
    rows = [[b, best[b]["kairos"]] for b in batches]
    if args.vllm_venv:  # ratios to 2 digits: 1.46 is not 1.5
        headers += [f"vllm {vdtype} best tok/s", "ratio, median of rounds", "range"]
        rows = [row + [best[b]["vllm"], f"{res['ratio_median'][b]:.2f}", "{:.2f}-{:.2f}".format(*res["ratio_range"][b])]
                for row, b in zip(rows, batches)]
    print_table(headers, rows, title=f"{args.model}: {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
                f"{args.reps} rounds side by side, {args.threads} threads")
    head = ", ".join(f"B={b} {res['ratio_median'][b]:.2f}x" for b in batches if b in res["ratio_median"])
    if head:
        print(f"Kairos / vLLM, median of the rounds' ratios: {head}")
    if args.json:
        write_json(args.json, {"info": info, "args": vars(args), "paired": res})
    if args.summary:
        write_summary(args.summary, info["command"],
                      f"Kairos {res['kairos_dtype']} / vLLM-cpu {vdtype}, side by side, median of {args.reps} "
                      f"rounds' ratios: {head}" if head else f"Kairos {res['kairos_dtype']} alone: " + ", ".join(
                          f"B={b} {best[b]['kairos']:.0f} tok/s" for b in batches),
                      {"table": {"headers": headers, "rows": rows}, "paired": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
