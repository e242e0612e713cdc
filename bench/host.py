"""The engine's host work per step outside the model: sampling a token for each row and handing it to its stream.

    python -m bench.host --rows 8,16,64                              # this checkout
    python -m bench.host --rows 8,16,64 --against /tmp/base          # beside another checkout's code, alternating
    python -m bench.host --rows 8,16,64 --against /tmp/base --summary host-step-zen4

Per step of R greedy rows (temperature 0, no stop strings: what bench.slo sends) over logits as wide as the model's
(`--model`, kairos-tiny by default; its vocabulary is what is sampled from): `sample` is `Sampler.sample_async` and
its result with the CPU kernels' host paths; `output` is `OutputProcessor.on_token` for each row (incremental
detokenization and the stream item) into a sink that drops it; where the engine runs in a process of its own (a
replica's default), `engine` is its side of that: `on_token` into its batch (`engine.core_proc._Batch`) and the loop
turn's `Outputs` message pickled, and `client` the other side: the message read back, delivered into each request's
`RequestStream` (`EngineCoreClient._deliver`) and read from it with `get(0)` (a reader keeping up, so no thread
waits: `aget` and a blocked `get` are left out); the socket is left out, and so is the engine's stats, which the
batch reads once (its first message) and which never change. Each figure is the median
of `--reps` timings of `--steps` steps, the two checkouts taking turns, in one process: the box's speed moves by
tens of percent within a minute, so only figures taken side by side compare. `--against DIR` loads DIR's
engine/sampler.py, engine/outputs.py, engine/stream.py, engine/core_messages.py, engine/core_proc.py and CPU kernel
source (built into the kernel cache like this checkout's); the requests, tokenizer and the rest are this checkout's.
A checkout whose engine process has no `core_messages.py` (older than its token columns) gets no `engine` and
`client` rows.
"""
from __future__ import annotations

import argparse
import importlib.util
import pickle
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from bench.report import print_table, run_info, write_summary
from core.messages import RequestOutput

MODULE = "bench.host"
ROOT = Path(__file__).resolve().parent.parent


class _Drop:
    def put(self, item: Any) -> None:
        pass

    def put_token(self, request_id: str, text: str, token_id: int, num_prompt_tokens: int,
                  num_output_tokens: int, logprobs: Any = None, prompt_logprobs: Any = None) -> None:
        RequestOutput(request_id, text, [token_id], num_prompt_tokens=num_prompt_tokens,  # as a `RequestStream` does
                      num_output_tokens=num_output_tokens, logprobs=None if logprobs is None else [logprobs],
                      prompt_logprobs=prompt_logprobs)


def _module(name: str, path: Path, imports: dict[str, ModuleType] | None = None) -> ModuleType:
    """Load `path` as module `name`; `imports`: modules its imports of those names get instead of this checkout's."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    saved = {k: sys.modules.get(k) for k in imports or {}}
    sys.modules.update(imports or {})
    try:
        spec.loader.exec_module(mod)
    finally:
        for k, was in saved.items():
            if was is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = was
    return mod


class Code:
    """One checkout's sampler, output processor and CPU kernels."""

    def __init__(self, label: str, root: Path) -> None:
        from engine.backends.cpu import kernels as K

        self.label = label
        if root == ROOT:
            from engine import core_proc, outputs, sampler, stream
            self.sampler, self.outputs, self.core_proc, self.stream = sampler, outputs, core_proc, stream
            self.kernels = K.load()
        else:
            tag = f"{label}_{abs(hash(str(root)))}"
            self.sampler = _module(f"_host_sampler_{tag}", root / "engine" / "sampler.py")
            self.stream = _module(f"_host_stream_{tag}", root / "engine" / "stream.py")
            self.outputs = _module(f"_host_outputs_{tag}", root / "engine" / "outputs.py",
                                   {"engine.stream": self.stream})
            self.core_proc = None  # None: the checkout's engine process is not timed
            if (root / "engine" / "core_messages.py").exists():
                messages = _module(f"_host_core_messages_{tag}", root / "engine" / "core_messages.py")
                self.core_proc = _module(f"_host_core_proc_{tag}", root / "engine" / "core_proc.py",
                                         {"engine.core_messages": messages, "engine.stream": self.stream})
            else:
                print(f"{root}: no engine/core_messages.py, so no engine or client rows for it", file=sys.stderr)
            self.kernels = K.load_source(root / "engine" / "backends" / "cpu" / "cpu_kernels.cpp")


def _requests(rows: int) -> list[Any]:
    from core.request import Request
    from core.sampling import SamplingParams

    return [Request(f"host-{i}", list(range(5, 50)), SamplingParams(max_tokens=1 << 20, temperature=0.0).validate())
            for i in range(rows)]


def sample_step(code: Code, rows: int, width: int, vocab: int) -> Callable[[], None]:
    import torch

    k = code.kernels
    s = code.sampler.Sampler(vocab, [0], torch.device("cpu"), k.argmax_rows, k.sample_rows)
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)) * 3
    reqs = _requests(rows)

    def step() -> None:
        s.sample_async(logits, reqs).result()
    return step


def _on_tokens(code: Code, rows: int, tokenizer: Any, vocab: int, steps: int, sink: Any) -> Callable[[], None]:
    """A step of `OutputProcessor.on_token` for each of `rows` requests (one random token id each, the same for all)
    into `sink`."""
    import random

    reqs = _requests(rows)
    proc = code.outputs.OutputProcessor(tokenizer)
    for r in reqs:
        proc.add(r, sink)
    rng = random.Random(0)
    ids = [rng.randrange(100, vocab) for _ in range(steps)]
    at = [0]

    def step() -> None:
        tok = ids[at[0] % len(ids)]
        at[0] += 1
        for r in reqs:
            r.token_ids.append(tok)
            proc.on_token(r, tok, None)
    return step


def output_step(code: Code, rows: int, tokenizer: Any, vocab: int, steps: int) -> Callable[[], None]:
    return _on_tokens(code, rows, tokenizer, vocab, steps, _Drop())


class _Wire:
    """The engine process's end of its socket as `_Batch.flush` uses it: each message pickled, the bytes kept."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, msg: Any) -> None:
        self.sent.append(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _engine_side(code: Code, rows: int, tokenizer: Any, vocab: int, steps: int) -> tuple[Callable[[], None], _Wire]:
    """`output_step`'s tokens through the engine process's path: into its batch, flushed (pickled) as the worker's
    loop turn ends; the wire keeps only the last message's bytes."""
    from types import SimpleNamespace

    wire = _Wire()
    batch = code.core_proc._Batch(wire)
    stats = SimpleNamespace(alive=True, reconfigures=0, priority_scheduling=False)  # (what the client reads of it)
    batch.engine = SimpleNamespace(stats=lambda: stats)
    tokens = _on_tokens(code, rows, tokenizer, vocab, steps, batch)

    def step() -> None:
        tokens()
        batch.flush()
        del wire.sent[:-1]
    return step, wire


def engine_step(code: Code, rows: int, tokenizer: Any, vocab: int, steps: int) -> Callable[[], None]:
    return _engine_side(code, rows, tokenizer, vocab, steps)[0]


def client_step(code: Code, rows: int, tokenizer: Any, vocab: int, steps: int) -> Callable[[], None]:
    """The client's side of `engine_step`'s messages (made once, beforehand): each read back, delivered into its
    requests' `RequestStream`s (`EngineCoreClient._deliver`) and read from each (`get`), as by a reader keeping up."""
    import threading
    from types import SimpleNamespace

    make, wire = _engine_side(code, rows, tokenizer, vocab, steps)
    msgs = []
    for _ in range(steps):
        make()
        msgs.append(wire.sent[-1])
    streams = {f"host-{i}": code.stream.RequestStream(f"host-{i}") for i in range(rows)}
    client = object.__new__(code.core_proc.EngineCoreClient)  # the reader's side only: no process
    client._lock, client._streams, client._heard, client._stats = threading.Lock(), dict(streams), 0.0, None
    client._reconfigures, client.inputs = 0, SimpleNamespace(priority_scheduling=False)
    at = [0]

    def step() -> None:
        client._deliver(pickle.loads(msgs[at[0] % len(msgs)]))
        at[0] += 1
        for st in streams.values():
            st.get(0)
    return step


def _commit(root: Path) -> str | None:
    import subprocess

    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def _us_per_step(fn: Callable[[], None], steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,16,64", help="decode rows per step (comma list)")
    ap.add_argument("--model", default="kairos-tiny", help="the model whose tokenizer and logits width are used")
    ap.add_argument("--against", metavar="DIR", help="another checkout whose code is timed beside this one's")
    ap.add_argument("--steps", type=int, default=500, help="steps per timing")
    ap.add_argument("--reps", type=int, default=5, help="timings per figure (the median is kept)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--summary", metavar="NAME", help="keep the figures as bench/summaries/NAME.json")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from bench.driver import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab, width = len(tokenizer), int(AutoConfig.from_pretrained(path).vocab_size)
    rows = [int(x) for x in args.rows.split(",") if x.strip()]
    codes = [Code("this", ROOT)]
    if args.against:
        codes.insert(0, Code("against", Path(args.against).resolve()))
    cases: list[tuple[str, int, str, Callable[[], None]]] = []
    for n in rows:
        for code in codes:
            cases.append(("sample", n, code.label, sample_step(code, n, width, vocab)))
            cases.append(("output", n, code.label, output_step(code, n, tokenizer, vocab, args.steps)))
            if code.core_proc is not None:
                cases.append(("engine", n, code.label, engine_step(code, n, tokenizer, vocab, args.steps)))
                cases.append(("client", n, code.label, client_step(code, n, tokenizer, vocab, args.steps)))
    times: dict[tuple[str, int, str], list[float]] = {(w, n, c): [] for w, n, c, _ in cases}
    for _ in range(args.reps):  # the checkouts take turns within each rep
        for what, n, label, fn in cases:
            fn()  # warm
            times[(what, n, label)].append(_us_per_step(fn, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    table, figures = [], []
    for n in rows:
        for what in ("sample", "output", "engine", "client"):
            this = med[(what, n, "this")]
            row: dict[str, Any] = {"rows": n, "part": what, "this_us": round(this, 1)}
            other = med.get((what, n, "against"))
            if other is not None:
                row |= {"against_us": round(other, 1), "this_over_against": round(this / other, 3)}
            figures.append(row)
            table.append([n, what, f"{this:.1f}"] + ([f"{other:.1f}", f"{this / other:.2f}"] if other is not None
                                                      else ["-", "-"] if args.against else []))
    head = ["rows", "part", "this us/step"] + (["against us/step", "this / against"] if args.against else [])
    print_table(head, table, title=f"host work per step outside the model ({args.model}, vocabulary {vocab}, "
                                   f"logits width {width}; median of {args.reps} x {args.steps} steps)")
    if args.summary:
        info = run_info(MODULE, argv)
        parts = [f"{f['rows']} rows {f['part']} {f['this_us']:.0f} us" +
                 (f" ({f['this_over_against']:.2f}x)" if "this_over_against" in f else "") for f in figures]
        write_summary(args.summary, info["command"], "host work per step: " + ", ".join(parts),
                      {"run": info, "model": args.model, "vocab": vocab, "width": width, "against": args.against,
                       "against_commit": _commit(Path(args.against)) if args.against else None,
                       "steps": args.steps, "reps": args.reps, "figures": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
