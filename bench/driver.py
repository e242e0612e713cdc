"""The load driver: one record type, and one open-loop driver that offers a list of `WorkItem`s either to an
in-process `LLMEngine` (`run_engine`) or over HTTP to an OpenAI-compatible server (`run_http`).

Every item is sent at its `arrival_s` (seconds after the start) whether or not earlier ones have finished,
and every request ends as one `Record` on one clock (`time.monotonic`):
- in-process, the record carries the client's view (token arrival per stream item, when `per_request_threads`)
  or the engine's own per-token times (the default: one polling consumer, so the engine keeps the GIL);
- over HTTP, token times are SSE chunk arrivals (a chunk may hold several tokens; `n_out` comes from the usage
  chunk), 429 is a rejection (so is a 400 with x-kairos-reject-reason: slo_unattainable), and `hops` splits the
  time to the first token with the ingress's Server-Timing.
A request's outcome is its `finish_reason`: stop | length (completed), rejected, abort, error (with `error`
saying what), timeout (the driver gave up on it).

The benchmark-only stop (`WorkItem.stop_after`, bench.slo --lengths hidden|predicted): the reply ends after that
many tokens while max_tokens is only a cap, and no policy can read it. In-process it is `Request.bench_stop_after`,
honoured only by the scheduler's finish check with `SchedulerConfig.bench_stop`; over HTTP the client closes the
stream after that many token chunks and records the reply complete (finish "length").

`served()` starts a fresh `serve run deployments:app` for a benchmark; `resolve_model_path` finds a model's folder.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import json
import math
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.ports import free_port
from bench.workload import WorkItem

COMPLETED = ("stop", "length")

# --------------------------------------------------------------------------- models and servers


def resolve_model_path(name: str) -> str:
    """The checkpoint directory (or hub id) for `name`, building a kairos model if needed."""
    from engine.default_model import EMBEDDED_MODELS, ensure_default_model

    if name in EMBEDDED_MODELS:
        return str(ensure_default_model(name))
    p = os.path.expanduser(name)
    return os.path.abspath(p) if os.path.isdir(p) else name


def free_memory() -> None:
    """Collect garbage and trim the malloc heap, to return memory between phases (drop your references first)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def ok(url: str, body: dict | None = None, timeout: float = 5.0) -> bool:
    """True when `url` answers 200 (a POST of `body` as JSON when given)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # also another protocol on that port (BadStatusLine)
        return False


SERVE_CLI = [sys.executable, "-c", "import sys; sys.argv[0] = 'serve'; from ray.serve.scripts import cli; cli()"]
# `serve run CONFIG`: the package first, as `serve run deployments:app` imports it, so that its choices for the Ray
# instance the CLI starts (HAProxy, Serve's loop) are in the environment before Ray is, and its `serve run` hook
# (SIGTERM stops Serve as Ctrl-C does) is in place
SERVE_CLI_CONFIG = [sys.executable, "-c", "import sys; sys.argv[0] = 'serve'; import deployments; "
                    "from ray.serve.scripts import cli; cli()"]
_CONFIGS: dict[str, tuple[Path, dict[str, Any]]] = {}  # a server `served` started from a config: its file, config


def app_config(app_args: list[str], port: int, user_config: dict[str, Any]) -> dict[str, Any]:
    """The Serve config of `serve run deployments:app ARGS` (key=value each; Serve validates them as the app's
    arguments, strings and all) on 127.0.0.1:`port`, its LLM deployment's `user_config` (scheduler knobs the
    replicas take in place: `LLMReplica.reconfigure`) given."""
    args = dict(t.split("=", 1) for t in app_args)
    return {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "default", "route_prefix": "/", "import_path": "deployments:app",
                              "args": args, "deployments": [{"name": "LLMServer", "user_config": user_config}]}]}


def stop_host(proc: subprocess.Popen | None = None) -> None:
    """End a host's Kairos server the fast way (a host of its own only: it ends everyone's Ray there): kill its `serve
    run` (`proc`, where this process started it), then `ray stop --force` and Serve's HTTP front, and wait for its
    engine processes to exit (the next server's engine sizes its KV cache by the device's free memory)."""
    if proc is not None:
        proc.kill()
        proc.wait(10)
    else:  # one another process started: its `serve run`, found by the CLI code it runs
        for pid in _processes((SERVE_CLI[2], SERVE_CLI_CONFIG[2])):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for pid in _processes(("haproxy",)):  # Serve's HTTP front, which Ray's stop may leave behind
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    gone = time.monotonic() + 30.0  # (each engine process exits within a second of its replica)
    while (left := _processes(("engine.core_proc",))) and time.monotonic() < gone:
        time.sleep(0.25)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def adopt_served(target: str, config: Path, timeout_s: float = 10.0) -> bool:
    """Take over a server that an earlier process started from the Serve config `config` and left running (`served`'s
    `keep`): True when it answers at `target`, and `reconfigure_served` can then change its scheduler."""
    if not ok(f"{target}/v1/completions", {"prompt": "warm", "max_tokens": 1}, timeout=timeout_s):
        return False
    try:
        _CONFIGS[target] = (config, json.loads(config.read_text()))
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def served(serve_args: str, log: Path, *, start_timeout_s: float = 600.0, ray_stop: bool = False,
           user_config: dict[str, Any] | None = None, keep: Callable[[], bool] | None = None) -> Iterator[str]:
    """`serve run deployments:app` with `serve_args` (key=value app arguments, and NAME=VALUE upper-case environment
    variables of that server) on a free port (KAIROS_HTTP_PORT), up and warmed with one completion; yields its URL.
    Run as the `serve` console script (a pip --target install has none), so SIGTERM stops it as Ctrl-C does, with
    the Ray instance it started. `ray_stop` (a host of its own only: on a shared box it ends everyone's Ray): kill it
    instead, then `ray stop --force` and Serve's HTTP front, and wait for its engine processes to exit: a graceful
    stop drains replicas that hold nothing, then stops Ray, and takes several times as long. With `user_config`
    the app is deployed from a config file (`app_config`, beside `log`) whose LLM deployment carries it, so that
    `reconfigure_served` can change the scheduler of the running replicas. With `keep`, the server runs in a session
    of its own and is left running at the end where `keep()` says so (a later process takes it over with
    `adopt_served` and ends it with `stop_host`; a host's tool ends only the processes of the caller's session)."""
    tokens = shlex.split(serve_args)
    is_env = [("=" in t and t.split("=", 1)[0].isupper()) for t in tokens]
    port = free_port()
    env = dict(os.environ, KAIROS_HTTP_PORT=str(port), HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled") \
        | dict(t.split("=", 1) for t, e in zip(tokens, is_env) if e)
    app_args = [t for t, e in zip(tokens, is_env) if not e]
    target = f"http://127.0.0.1:{port}"
    if user_config is None:
        cmd = [*SERVE_CLI, "run", "deployments:app", *app_args]
    else:
        config = app_config(app_args, port, user_config)
        path = log.with_suffix(".serve.json")  # JSON is YAML: `serve run` reads it
        path.write_text(json.dumps(config, indent=1))
        _CONFIGS[target] = (path, config)
        cmd = [*SERVE_CLI_CONFIG, "run", str(path)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=keep is not None)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not ok(f"{target}/v1/completions", {"prompt": "warm", "max_tokens": 4}, timeout=30):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`serve run deployments:app {serve_args}` did not come up; see {log}")
            time.sleep(0.5)
        yield target
    finally:
        if keep is not None and proc.poll() is None and keep():
            pass  # left running for a later process (`adopt_served`)
        elif ray_stop:  # a host of its own: nothing to drain, so no graceful shutdown to wait for
            stop_host(proc)
        else:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        _CONFIGS.pop(target, None)


def served_policy(url: str, api_key: str | None = None) -> str | None:
    """The scheduling policy a Kairos server's replica runs, as its /metrics says (`kairos_scheduler_policy`); None
    while it says none (a server that reports no such series, or not yet)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10.0, headers=headers).text
    except Exception:  # noqa: BLE001 - not yet: the caller asks again
        return None
    return next((policy for _, policy in sorted(running_policies(text))), None)


def reconfigure_served(target: str, user_config: dict[str, Any], log: Path, *, timeout_s: float = 120.0) -> bool:
    """Give the LLM replicas of a server `served` started with a `user_config` a new one, in place (`serve run
    --address auto --non-blocking` of its config with that `user_config`: Serve calls each replica's `reconfigure`,
    no model load), and wait until its /metrics says the engine runs the new config's policy (the engine switches
    once drained). False if the redeploy failed or the switch was not seen within `timeout_s`."""
    if target not in _CONFIGS:  # started from its app arguments: its user_config is not Serve's to change
        return False
    path, config = _CONFIGS[target]
    config = json.loads(json.dumps(config))
    config["applications"][0]["deployments"][0]["user_config"] = user_config
    path.write_text(json.dumps(config, indent=1))
    _CONFIGS[target] = (path, config)
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    deadline = time.monotonic() + timeout_s
    with open(log, "a") as f:
        try:
            rc = subprocess.run([*SERVE_CLI, "run", "--address", "auto", "--non-blocking", str(path)], stdout=f,
                                stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return False
    if rc != 0:
        return False
    want = str(user_config.get("policy") or config["applications"][0]["args"].get("policy", "kairos"))
    while time.monotonic() < deadline:
        if served_policy(target) == want:
            return True
        time.sleep(0.5)
    return False


def _processes(names: tuple[str, ...], proc: Path = Path("/proc")) -> list[int]:
    """Pids of this host's processes that run one of `names`: its program's file name, or an argument of its
    (`python -m engine.core_proc`'s module), whole."""
    out = []
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:  # ended meanwhile
            continue
        if argv and ({os.path.basename(argv[0]), *argv[1:]} & set(names)) and int(cmdline.parent.name) != os.getpid():
            out.append(int(cmdline.parent.name))
    return out


def http_front(proc: Path = Path("/proc")) -> str:
    """The HTTP front of the `serve run` this host runs: "haproxy" where an HAProxy process runs (Serve's HAProxy
    ingress, Kairos's default, deployments/haproxy_ingress.py), else "serve-proxy" (Serve's Python proxy actor, its
    fallback where no haproxy binary could be found). One server per host, as the benchmarks start them."""
    return "haproxy" if _processes(("haproxy",), proc) else "serve-proxy"


# --------------------------------------------------------------------------- the record


@dataclass(slots=True)
class Record:
    """One request as measured. Times are seconds on time.monotonic(); SLOs in ms (inf: none)."""

    tier: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    arrival_s: float  # the client started to send it
    rejected: bool = False
    finish_reason: str | None = None  # stop | length | abort | rejected | error | timeout
    ttft_s: float | None = None  # first token - arrival
    token_times: list[float] = field(default_factory=list)  # absolute arrival of each token (or chunk)
    n_out: int = 0  # output tokens received
    finished_s: float | None = None  # absolute end (last token, rejection, give-up)
    reject_reason: str | None = None
    prompt_len: int = 0
    max_tokens: int = 0  # the output length asked for (a cap when the reply's length is hidden)
    output_len: int = 0  # where the reply ends: max_tokens, or the benchmark-only stop
    hops: dict[str, float] = field(default_factory=dict)  # HTTP: where the time to the first token went (ms)
    index: int = -1  # position in the offered list
    sent_s: float | None = None  # add_request returned / the response headers arrived
    error: str | None = None  # what went wrong, with finish_reason error
    prompt_tokens: int = 0
    deliveries: int = 0  # stream items (in-process) or chunks (HTTP) that carried tokens
    merged_deliveries: int = 0  # items (in-process) or chunks (HTTP, by their usage so far) of more than one token
    replica: str | None = None  # HTTP: the LLM replica that answered (`x-kairos-replica`)
    rerouted: int = 0  # HTTP: replicas that turned it away before that one (`x-kairos-rerouted`)
    predicted_len: int | None = None  # the reply length the server's length predictor expected at its arrival
    # when it was due (the run's start + its item's arrival_s): a client that falls behind sends late, and a span of
    # the sends would differ between policies offered the same arrivals (`metrics.window_of`)
    scheduled_s: float | None = None

    @property
    def completed(self) -> bool:
        return not self.rejected and self.finish_reason in COMPLETED

    @property
    def e2e_s(self) -> float | None:
        """Last token - arrival."""
        if self.token_times:
            return self.token_times[-1] - self.arrival_s
        if self.ttft_s is not None and self.finished_s is not None:
            return self.finished_s - self.arrival_s
        return None

    @property
    def end_s(self) -> float:
        if self.finished_s is not None:
            return self.finished_s
        return self.token_times[-1] if self.token_times else self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_record(i: int, w: WorkItem, arrival: float) -> Record:
    return Record(w.tier, w.ttft_ms, w.tpot_ms, arrival, prompt_len=w.prompt_len, max_tokens=w.max_tokens,
                  output_len=w.output_len, index=i)


@dataclass
class Run:
    """One pass of the driver over a list of items."""

    records: list[Record]  # in item order
    started_s: float  # monotonic time of arrival 0
    submit_end_s: float = math.nan  # the last item was sent
    submit_lag_ms: list[float] = field(default_factory=list)  # how late each item was sent
    engine: dict[str, Any] = field(default_factory=dict)  # in-process: steps and phase times of the run
    timeouts: int = 0


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return None
    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True, file=sys.stderr, disable=None)


def _pace(t0: float, w: WorkItem) -> float:
    """Sleep until the item's arrival; return how late it is (ms)."""
    delay = t0 + w.arrival_s - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    return max(0.0, time.monotonic() - (t0 + w.arrival_s)) * 1000.0


# --------------------------------------------------------------------------- in-process


def _submit(engine: Any, w: WorkItem, rid: str) -> Any:
    from core.messages import ChatTurn
    from core.request import SLO
    from core.sampling import SamplingParams

    params = SamplingParams(max_tokens=w.max_tokens, temperature=w.temperature, ignore_eos=w.ignore_eos,
                            seed=w.seed)
    finite = [x if math.isfinite(x) else None for x in (w.ttft_ms, w.tpot_ms)]
    slo = SLO(*finite, w.output_len_hint) if any(x is not None for x in finite) else None
    turns = [ChatTurn("user", w.prompt if isinstance(w.prompt, str) else "")] if w.chat else None
    if w.stop_after is not None:  # the benchmark-only stop: on the Request, where only the finish check reads it
        from engine.stream import RequestStream

        req = engine.inputs.process(None if w.chat else w.prompt, params, slo, rid, turns)
        req.bench_stop_after = w.stop_after
        stream = RequestStream(req.request_id)
        engine.submit(req, stream)
        return stream
    if w.chat:
        return engine.add_request(None, params, slo, rid, messages=turns)
    return engine.add_request(w.prompt, params, slo, rid)


def check_length(rec: Record, w: WorkItem) -> None:
    """A completed forced-length reply (ignore_eos, or the benchmark-only stop) of another length is an error."""
    if rec.completed and (w.ignore_eos or w.stop_after is not None) and rec.n_out != w.output_len:
        rec.finish_reason, rec.error = "error", "token_count_mismatch"


def _take(rec: Record, out: Any, t: float, client_times: bool) -> bool:
    """Fold one stream item that arrived at `t` into the record; True when it was the final one."""
    k = len(out.token_ids)
    if k and client_times:
        rec.token_times.extend([t] * k)
        if rec.ttft_s is None:
            rec.ttft_s = t - rec.arrival_s
        rec.deliveries += 1
        rec.merged_deliveries += k > 1
    if not out.finished:
        return False
    reason = str(out.finish_reason) if out.finish_reason is not None else None
    rec.finish_reason, rec.n_out, rec.prompt_tokens = reason, out.num_output_tokens, out.num_prompt_tokens
    rec.rejected = reason == "rejected"
    rec.reject_reason = str(out.reject_reason) if out.reject_reason is not None else None
    rec.error = out.error
    m = out.metrics
    if m is not None:
        rec.predicted_len = m.predicted_output_len
    if m is not None and not client_times:  # the engine's clock is the same monotonic clock
        rec.arrival_s, rec.token_times, rec.finished_s = m.arrival_s, list(m.token_times), m.finished_s
        rec.ttft_s = m.ttft_s
    rec.finished_s = rec.finished_s if rec.finished_s is not None else t
    return True


def _drain(stream: Any, rec: Record, timeout: float, client_times: bool) -> None:
    try:
        while not _take(rec, stream.get(timeout), time.monotonic(), client_times):
            pass
    except TimeoutError as e:
        rec.finish_reason, rec.error, rec.finished_s = "timeout", f"timeout: {e}", time.monotonic()
    except Exception as e:  # noqa: BLE001 - recorded as an error, never a crash of the benchmark
        rec.finish_reason, rec.error, rec.finished_s = "error", f"{type(e).__name__}: {e}", time.monotonic()


def freeze_heap() -> None:
    """Move what this process holds now (the ShareGPT corpus, the workloads, earlier records) out of the garbage
    collector's reach before a timed run: a full collection walks every tracked object and stalls the in-process
    engine's thread (it shares the GIL) or the client's token stamps."""
    gc.collect()
    gc.freeze()


def run_engine(engine: Any, items: Sequence[WorkItem], *, drain_s: float = math.inf, timeout_s: float = 600.0,
               per_request_threads: bool = False, tag: str = "r",
               progress: bool = False, desc: str = "") -> Run:
    """Offer `items` open-loop to an in-process engine; wait for every stream (abort stragglers after `drain_s`).

    per_request_threads: one consumer thread per request stamps each stream item on arrival (the client's
    view). Default: one consumer polls the streams every 20 ms and keeps the engine's own token times, so
    thousands of requests do not take the GIL from the engine thread.
    """
    n = len(items)
    records: list[Record] = [new_record(i, w, math.nan) for i, w in enumerate(items)]
    freeze_heap()
    streams: queue.SimpleQueue = queue.SimpleQueue()
    deadline = [math.inf]
    bar = progress_bar(n, desc, progress)
    threads: list[threading.Thread] = []

    def done(i: int) -> None:
        if bar is not None:
            bar.update(1)

    def poll() -> None:
        pending: dict[int, tuple[Any, str]] = {}
        submitted_all = False
        while True:
            while True:
                try:
                    got = streams.get_nowait()
                except queue.Empty:
                    break
                if got is None:
                    submitted_all = True
                else:
                    pending[got[0]] = got[1:]
            for i in [i for i, (st, _) in pending.items() if st.closed]:
                _drain(pending.pop(i)[0], records[i], 5.0, False)
                done(i)
            if submitted_all and not pending:
                return
            if time.monotonic() >= deadline[0]:  # give up: abort the stragglers, keep what they got
                for _, rid in pending.values():
                    engine.abort(rid)
                for i, (st, _) in sorted(pending.items()):
                    rec = records[i]
                    _drain(st, rec, 30.0, False)
                    if rec.finish_reason not in COMPLETED and rec.finish_reason != "rejected":
                        rec.finish_reason, rec.finished_s = "timeout", deadline[0]
                    done(i)
                return
            time.sleep(0.02)

    poller = None if per_request_threads else threading.Thread(target=poll, name="bench-poll", daemon=True)
    if poller is not None:
        poller.start()
    stats0 = engine.stats()
    lags: list[float] = []
    t0 = time.monotonic() + 0.05
    for i, w in enumerate(items):
        lags.append(_pace(t0, w))
        rec = records[i]
        rec.arrival_s, rec.scheduled_s = time.monotonic(), t0 + w.arrival_s
        rid = f"{tag}-{i}"
        try:
            stream = _submit(engine, w, rid)
        except Exception as e:  # noqa: BLE001 - a refused submission is a miss, not a crash of the benchmark
            rec.sent_s = rec.finished_s = time.monotonic()
            rec.finish_reason, rec.error = "error", f"submit: {type(e).__name__}: {e}"[:200]
            rec.reject_reason = rec.error
            done(i)
            continue
        rec.sent_s = time.monotonic()
        if poller is not None:
            streams.put((i, stream, rid))
        else:
            th = threading.Thread(target=lambda s=stream, r=rec, j=i: (_drain(s, r, timeout_s, True), done(j)),
                                  name=f"bench-consumer-{i}", daemon=True)
            th.start()
            threads.append(th)
    submit_end = time.monotonic()
    deadline[0] = submit_end + drain_s
    if poller is not None:
        streams.put(None)
        poller.join()
    for th in threads:
        th.join()
    if bar is not None:
        bar.close()
    for rec, w in zip(records, items):
        check_length(rec, w)
    stats1 = engine.stats()
    phase = {k: v - stats0.phase_s.get(k, 0.0) for k, v in stats1.phase_s.items()}
    steps, busy = stats1.steps - stats0.steps, sum(phase.values())
    eng = {"steps": steps, "phase_s": phase,
           "sched_ms_per_step": phase.get("schedule", 0.0) / steps * 1000.0 if steps else math.nan,
           "sched_pct": phase.get("schedule", 0.0) / busy * 100.0 if busy > 0 else math.nan,
           "step_ms": busy / steps * 1000.0 if steps else math.nan,
           "rejected": {k: v - stats0.rejected.get(k, 0) for k, v in stats1.rejected.items()}}
    return Run(records, t0, submit_end, lags, eng, sum(r.finish_reason == "timeout" for r in records))


# --------------------------------------------------------------------------- HTTP

SSE_DONE = "[DONE]"
HOPS = ("client_proxy", "proxy", "parse", "route", "replica", "body", "engine_ttft", "engine_tpot")
HOP_NOTES = {
    "client_proxy": "request sent -> response headers, minus the server's own time: client, HTTP proxy, the way back",
    "proxy": "HAProxy read it -> the ingress's handler: its wait for the ingress (HAProxy's stamp, one machine only)",
    "parse": "ingress: read and validate the body",
    "route": "ingress -> replica handle call: routing and transport, both ways",
    "replica": "replica: tokenize, engine queue, prefill, first output",
    "body": "response headers -> first token chunk at the client",
    "engine_ttft": "TTFT as the engine measured it (add_request -> first token), from the usage chunk",
    "engine_tpot": "TPOT as the engine measured it; the client's TPOT minus this is what delivery adds",
}


def sse_data(line: str) -> Any:
    """One server-sent-events line: its JSON payload, SSE_DONE for `data: [DONE]`, None for any other line."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return SSE_DONE if data == SSE_DONE else json.loads(data)


def parse_server_timing(value: str | None) -> dict[str, float]:
    """`Server-Timing: a;dur=1.5, b;dur=2` -> {"a": 1.5, "b": 2.0} (entries without a duration are skipped)."""
    out: dict[str, float] = {}
    for entry in (value or "").split(","):
        name, *params = [p.strip() for p in entry.split(";")]
        for p in params:
            key, _, val = p.partition("=")
            if name and key.strip() == "dur":
                try:
                    out[name] = float(val.strip().strip('"'))
                except ValueError:
                    pass
    return out


def request_body(w: WorkItem, model: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, JSON body, SLO headers) of one item as an OpenAI request."""
    body: dict[str, Any] = {"model": model, "max_tokens": w.max_tokens, "ignore_eos": w.ignore_eos,
                            "temperature": w.temperature, "stream": w.stream}
    if model == "":
        del body["model"]
    if w.seed is not None:
        body["seed"] = w.seed
    if w.stream:  # vLLM's continuous_usage_stats: each chunk says the tokens so far, so that the benchmark-only
        # stop counts tokens, not chunks (a replica behind its client merges tokens into one chunk)
        body["stream_options"] = {"include_usage": True, **({"continuous_usage_stats": True}
                                                            if w.stop_after is not None else {})}
    if w.chat:
        body["messages"] = [{"role": "user", "content": w.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = w.prompt
        path = "/v1/completions"
    headers = {}
    if math.isfinite(w.ttft_ms):
        headers["x-slo-ttft-ms"] = f"{w.ttft_ms:.3f}"
    if math.isfinite(w.tpot_ms):
        headers["x-slo-tpot-ms"] = f"{w.tpot_ms:.3f}"
    if w.output_len_hint is not None and headers:
        headers["x-slo-output-len"] = str(w.output_len_hint)
    return path, body, headers


def _error_code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"].get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "non_json"


async def _lines(resp: Any) -> Any:
    """The body's lines as they arrive (no length limit, unlike aiohttp's own line reader)."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if buf:
        yield buf.decode()


async def _read_sse(resp: Any, rec: Record, w: WorkItem) -> None:
    done = False
    async for line in _lines(resp):
        obj = sse_data(line)
        if obj is None:
            continue
        if obj == SSE_DONE:
            done = True
            break
        now = time.monotonic()
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            rec.finish_reason, rec.error = "error", f"stream_error: {msg}"
            continue
        # the tokens this chunk carried: by the usage so far where the server sends it (continuous_usage_stats),
        # else one a chunk (text may be '' mid-character)
        so_far = (obj.get("usage") or {}).get("completion_tokens") if obj.get("choices") else None
        for c in obj.get("choices") or []:
            new = 1 if so_far is None else int(so_far) - len(rec.token_times)  # (0: the finish reason alone)
            if new > 0 and ("text" in c or (c.get("delta") or {}).get("content") is not None):
                rec.token_times.extend([now] * new)
                rec.deliveries += 1
                rec.merged_deliveries += new > 1
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.arrival_s
                    if "headers" in rec.hops:
                        rec.hops["body"] = rec.ttft_s * 1000.0 - rec.hops["headers"]
                if w.stop_after is not None and len(rec.token_times) >= w.stop_after:  # the benchmark-only stop
                    # (a merged chunk past it: the reply's stop_after-th token came with it)
                    del rec.token_times[w.stop_after:]
                    rec.finish_reason, rec.n_out = "length", w.stop_after
                    return
            if c.get("finish_reason") and rec.finish_reason != "error":
                rec.finish_reason = c["finish_reason"]
        usage = obj.get("usage")
        if usage:
            rec.n_out, rec.prompt_tokens = int(usage.get("completion_tokens", 0)), int(usage.get("prompt_tokens", 0))
            em = obj.get("kairos_metrics") or {}
            for k in ("ttft", "tpot"):
                if em.get(f"{k}_ms") is not None:
                    rec.hops[f"engine_{k}"] = float(em[f"{k}_ms"])
            if em.get("predicted_output_tokens") is not None:
                rec.predicted_len = int(em["predicted_output_tokens"])
    if not done and rec.finish_reason != "error":
        rec.finish_reason, rec.error = "error", "stream_without_done"


async def _read_json(resp: Any, rec: Record) -> None:
    body = json.loads(await resp.read())
    now = time.monotonic()
    usage = body.get("usage") or {}
    rec.n_out, rec.prompt_tokens = int(usage.get("completion_tokens", 0)), int(usage.get("prompt_tokens", 0))
    choice = (body.get("choices") or [{}])[0]
    rec.finish_reason = choice.get("finish_reason") or "error"
    rec.ttft_s, rec.token_times = now - rec.arrival_s, [now]


async def _send(client: Any, base: str, rec: Record, w: WorkItem, model: str) -> None:
    """One request over HTTP (`client`: an aiohttp session, `base`: the server's URL), to its end, measured into
    `rec`."""
    path, body, headers = request_body(w, model)
    rec.arrival_s = time.monotonic()

    async def go() -> None:
        async with client.post(base + path, json=body, headers=headers) as resp:
            rec.sent_s = time.monotonic()
            rec.replica = resp.headers.get("x-kairos-replica") or None
            rec.rerouted = int(resp.headers.get("x-kairos-rerouted") or 0)
            st = parse_server_timing(resp.headers.get("server-timing"))
            rec.hops = {"headers": (rec.sent_s - rec.arrival_s) * 1000.0, **st}
            if st:
                rec.hops["client_proxy"] = rec.hops["headers"] - sum(st.values())
            if resp.status != 200:
                raw = await resp.read()
                if resp.status == 429 or resp.headers.get("x-kairos-reject-reason"):  # 400: slo_unattainable
                    rec.rejected, rec.finish_reason = True, "rejected"
                    rec.reject_reason = resp.headers.get("x-kairos-reject-reason") or _error_code(raw)
                    if resp.status == 429 and not resp.headers.get("retry-after"):
                        rec.error = "429_without_retry_after"
                else:
                    rec.finish_reason = "error"
                    rec.error = rec.reject_reason = f"http_{resp.status}:{_error_code(raw)}"
                return
            await (_read_sse(resp, rec, w) if w.stream else _read_json(resp, rec))

    import aiohttp

    try:
        await go()
    except asyncio.CancelledError:
        rec.finish_reason = "timeout"
        raise
    except aiohttp.ClientError as e:
        rec.finish_reason, rec.error = "error", f"transport:{type(e).__name__}"
    except (ValueError, KeyError, TypeError) as e:
        rec.finish_reason, rec.error = "error", f"bad_response:{type(e).__name__}"
    finally:
        rec.n_out = rec.n_out or len(rec.token_times)
        rec.finished_s = time.monotonic()
        check_length(rec, w)
        if rec.finish_reason is None:
            rec.finish_reason, rec.error = "error", rec.error or "no_finish_reason"


async def run_http_async(url: str, items: Iterable[WorkItem], *, model: str = "", drain_s: float = math.inf,
                         timeout_s: float | None = None, api_key: str | None = None,
                         max_inflight: int | None = None, on_done: Callable[[Record], None] | None = None,
                         bar: Any = None, start_s: float | None = None,
                         indices: Sequence[int] | None = None) -> Run:
    """Offer `items` (any iterable, e.g. a generator bounded by a duration) open-loop over HTTP.

    A request still running `drain_s` after the last arrival is cancelled ("timeout"); one that takes longer
    than `timeout_s` ends as an error "client_timeout". With `max_inflight`, an arrival that finds that many
    requests in flight is not sent (its record: error "client_backlog"). `start_s`: the monotonic time of arrival 0
    (default: now); `indices`: each item's index in the offered list (default: its position here).

    The client is aiohttp's, as in vLLM's `bench serve`: httpx's async client read a higher TTFT over HTTP, run pair
    by run pair, its own work on the cores the server shares on one box.
    """
    import aiohttp

    records: list[Record] = []
    lags: list[float] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(rec: Record, w: WorkItem) -> None:
        try:  # a cancellation at the drain deadline leaves the record as "timeout"
            await asyncio.wait_for(_send(client, base, rec, w, model), timeout_s)
        except asyncio.TimeoutError:
            rec.finish_reason, rec.error, rec.finished_s = "error", "client_timeout", time.monotonic()
        if on_done is not None:
            on_done(rec)
        if bar is not None:
            bar.update(1)

    base = url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None, connect=30.0)) as client:
        inflight: set[asyncio.Task] = set()
        t0 = time.monotonic() + 0.05 if start_s is None else start_s
        for i, w in enumerate(items):
            delay = t0 + w.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, time.monotonic() - (t0 + w.arrival_s)) * 1000.0)
            rec = new_record(i if indices is None else indices[i], w, time.monotonic())
            rec.scheduled_s = t0 + w.arrival_s
            records.append(rec)
            if max_inflight is not None and len(inflight) >= max_inflight:
                rec.finish_reason, rec.error, rec.finished_s = "error", "client_backlog", rec.arrival_s
                if on_done is not None:
                    on_done(rec)
                continue
            task = asyncio.create_task(one(rec, w))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        submit_end = time.monotonic()
        _, pending = await asyncio.wait(inflight, timeout=drain_s if math.isfinite(drain_s) else None) \
            if inflight else (set(), set())
        give_up = time.monotonic()
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    timeouts = 0
    for r in records:
        if r.finish_reason == "timeout":
            r.finished_s = give_up
            timeouts += 1
    return Run(records, t0, submit_end, lags, {}, timeouts)


def run_http(url: str, items: Sequence[WorkItem], *, progress: bool = False, desc: str = "", procs: int = 1,
             **kw: Any) -> Run:
    """`run_http_async` from synchronous code. `procs` > 1: the items dealt round-robin to that many client processes
    (`_run_http_sharded`), each with its own event loop, on one clock: a single Python client reading every streamed
    chunk of a GPU replica's hundreds of replies (tens of thousands a second) falls behind them, and its late reads
    would count as the server's TTFT and TPOT. Not with `on_done` or `max_inflight`, which count across all
    requests."""
    freeze_heap()
    if procs > 1 and len(items) >= 2 * procs and kw.get("on_done") is None and kw.get("max_inflight") is None:
        return _run_http_sharded(url, items, procs, progress=progress, desc=desc, **kw)
    bar = progress_bar(len(items), desc, progress)
    try:
        return asyncio.run(run_http_async(url, items, bar=bar, **kw))
    finally:
        if bar is not None:
            bar.close()


def _http_shard(conn: Any, url: str, items: list[WorkItem], indices: list[int], kw: dict[str, Any]) -> None:
    """A client process of `_run_http_sharded`: says it is ready, takes arrival 0's monotonic time, offers its items,
    sends back its `Run` (or the error that ended it, as text)."""
    try:
        import aiohttp  # noqa: F401 (before "ready": its import is not the first arrival's delay)

        conn.send("ready")
        start_s = conn.recv()
        conn.send(asyncio.run(run_http_async(url, items, start_s=start_s, indices=indices, **kw)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _run_http_sharded(url: str, items: Sequence[WorkItem], procs: int, *, progress: bool = False, desc: str = "",
                      **kw: Any) -> Run:
    """`run_http` over `procs` processes (spawned: the caller may hold threads a fork would copy mid-lock). Each
    offers every `procs`-th item at its own arrival time on the shared monotonic clock (CLOCK_MONOTONIC is one
    clock for every process of a machine), from an arrival 0 set once all are ready; their records merge in item
    order. A request still running `drain_s` after its process's last arrival is cancelled."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    shards = [list(range(k, len(items), procs)) for k in range(procs)]
    pipes, workers = [], []
    for idx in shards:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_http_shard, args=(child, url, [items[i] for i in idx], idx, kw), daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        workers.append(p)
    bar = progress_bar(len(items), desc, progress)
    try:
        for conn in pipes:
            if (msg := conn.recv()) != "ready":
                raise RuntimeError(f"an HTTP client process failed to start: {msg}")
        start_s = time.monotonic() + 0.05
        for conn in pipes:
            conn.send(start_s)
        runs = []
        for conn in pipes:
            got = conn.recv()
            if not isinstance(got, Run):
                raise RuntimeError(f"an HTTP client process failed: {got}")
            runs.append(got)
            if bar is not None:
                bar.update(len(got.records))
    finally:
        if bar is not None:
            bar.close()
        for p in workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    records = sorted((r for run in runs for r in run.records), key=lambda r: r.index)
    lags = [lag for _, lag in sorted((i, lag) for idx, run in zip(shards, runs)
                                     for i, lag in zip(idx, run.submit_lag_ms))]
    return Run(records, start_s, max(run.submit_end_s for run in runs), lags, {}, sum(run.timeouts for run in runs))


def prometheus_series(text: str, names: Iterable[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """The samples of the series `names` in Prometheus text: (name, labels, value) each (labels without quotes)."""
    wanted = set(names)
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in wanted or "}" not in rest:
            continue
        body, _, value = rest.rpartition("}")
        labels = dict(kv.split("=", 1) for kv in body.split(",") if "=" in kv)
        try:
            v = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        yield name, {k: x.strip('"') for k, x in labels.items()}, v


def decode_over_model(text: str) -> dict[int, tuple[int, float]]:
    """From Prometheus text (a Kairos server's /metrics): per decode-rows bucket, the decode-only steps and the sum of
    their wall / model ratios (`ray_kairos_decode_steps_total`, `ray_kairos_decode_step_over_model_sum_total`),
    summed over replicas."""
    out: dict[int, list[float]] = {}
    names = {"ray_kairos_decode_steps_total": 0, "ray_kairos_decode_step_over_model_sum_total": 1}
    for name, labels, v in prometheus_series(text, names):
        try:
            k = int(labels.get("rows", ""))
        except ValueError:
            continue
        out.setdefault(k, [0.0, 0.0])[names[name]] += v
    return {k: (int(n), total) for k, (n, total) in sorted(out.items()) if n > 0}


def running_policies(text: str) -> set[tuple[str, str]]:
    """From Prometheus text (a Kairos server's /metrics): (replica, policy) of each replica's scheduling policy that
    runs (`ray_kairos_scheduler_policy` at 1)."""
    return {(labels.get("replica", ""), labels["policy"])
            for _, labels, v in prometheus_series(text, ("ray_kairos_scheduler_policy",))
            if v == 1.0 and "policy" in labels}


def rejected_seats_full(text: str) -> float | None:
    """From Prometheus text (a Kairos server's /metrics): the requests its replicas turned away while every seat was
    taken (`ray_kairos_requests_rejected_seats_full_total`), summed over replicas; None where no replica exports it
    (none has counted one yet, or another server)."""
    got = [v for _, _, v in prometheus_series(text, ("ray_kairos_requests_rejected_seats_full_total",))]
    return sum(got) if got else None


LOOP_LAG = "ray_kairos_event_loop_lag_s"


def loop_lag(text: str) -> dict[str, Any]:
    """From Prometheus text (a Kairos server's /metrics): the replicas' event-loop lag histogram
    (`ray_kairos_event_loop_lag_s`), summed over replicas: {"count", "sum" (s), "le": {bound: cumulative count}}; an
    empty dict where there is none."""
    le: dict[float, float] = {}
    out: dict[str, Any] = {}
    for name, labels, v in prometheus_series(text, (f"{LOOP_LAG}_bucket", f"{LOOP_LAG}_count", f"{LOOP_LAG}_sum")):
        if name.endswith("_bucket"):
            try:
                bound = float(labels.get("le", ""))
            except ValueError:
                continue
            le[bound] = le.get(bound, 0.0) + v
        else:
            key = name.rsplit("_", 1)[1]
            out[key] = out.get(key, 0.0) + v
    if not out.get("count"):
        return {}
    return {**out, "le": {str(b): c for b, c in sorted(le.items())}}


def lag_between(now: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """The event-loop lag over the wake-ups between two `loop_lag` readings (before None: since the server's start):
    wake-ups, mean and an upper bound of each quantile (the bucket it falls in; None past the last bound), ms."""
    if not now:
        return None
    before = before or {}
    n = now.get("count", 0.0) - before.get("count", 0.0)
    if n <= 0:
        return None
    was = before.get("le", {})
    cum = [(float(b), c - was.get(b, 0.0)) for b, c in now.get("le", {}).items()]
    cum.sort()

    def upper(q: float) -> float | None:
        b = next((b for b, c in cum if c >= q * n), math.inf)
        return 1000.0 * b if math.isfinite(b) else None
    return {"wakeups": int(n), "mean_ms": round(1000.0 * (now.get("sum", 0.0) - before.get("sum", 0.0)) / n, 2),
            "p50_le_ms": upper(0.5), "p90_le_ms": upper(0.9), "p99_le_ms": upper(0.99),
            "over_100ms": int(n - next((c for b, c in cum if b >= 0.1), n))}


def server_metrics(url: str, parse: Callable[[str], Any], *, settle_s: float = 2.0, limit_s: float = 12.0,
                   api_key: str | None = None) -> Any:
    """`parse` of a server's /metrics once it has settled: Ray's agent exports what replicas report every few
    seconds, so this scrapes until two scrapes `settle_s` apart parse alike (at most `limit_s`). None where a scrape
    fails."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, last = time.monotonic() + limit_s, None
    while True:
        try:
            r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10.0, headers=headers)
            got = parse(r.text) if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - a figure for the report, never a failed run
            got = None
        if got is not None and got == last or time.monotonic() + settle_s > deadline:
            return got
        last = got
        time.sleep(settle_s)


def server_decode_over_model(url: str, *, settle_s: float = 2.0, limit_s: float = 12.0,
                             api_key: str | None = None) -> dict[str, Any] | None:
    """What a Kairos server's /metrics says of its latency model against its decode-only steps so far, by decode
    rows: {rows: {"steps", "mean"}} (mean wall / model), once settled (`server_metrics`). None where the server
    exports no such series (another server, or its metrics agent out of reach)."""
    got = server_metrics(url, decode_over_model, settle_s=settle_s, limit_s=limit_s, api_key=api_key)
    if not got:
        return None
    return {str(k): {"steps": n, "mean": round(total / n, 4)} for k, (n, total) in got.items()}


def served_model_info(url: str, api_key: str | None = None) -> tuple[str, int | None]:
    """(id, max_model_len) of the first model of `GET /v1/models`; ("", None) when the server does not say (vLLM
    and Kairos both list `max_model_len`)."""
    import httpx

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0, headers=headers)
        r.raise_for_status()
        model = r.json()["data"][0]
        max_len = model.get("max_model_len")
        return model["id"], int(max_len) if isinstance(max_len, int) and max_len > 0 else None
    except Exception:  # noqa: BLE001 - the name is cosmetic; requests then go without "model"
        return "", None
