"""The engine in its own process: `EngineCoreClient` (the caller's side) and `main` (the process's side).

Why: every torch call of a step drops and retakes the GIL, so a process whose engine thread shares its
interpreter with per-token Python (a Serve replica's event loop, Ray's threads) runs its steps slower.
Like vLLM v1's engine core, the `LLMEngine` runs in a child process that does nothing else; the client keeps
the per-request Python on its own side:

- the client validates and tokenizes (`InputProcessor`, the same one the engine uses in-process), so a bad
  request fails at once in the caller, and sends the child a ready `Request`;
- the child's worker thread detokenizes and batches every stream item of a loop turn into one `Outputs`
  message (its token items as columns, `TokenDeltas`), with the engine's stats snapshot;
- one reader on each side turns the socket into calls: the child's main thread calls `LLMEngine.submit` /
  `abort`; the client's side calls `RequestStream.put_token` / `put`, from a reader thread of its own, or, in a
  process that serves on an asyncio loop (a Serve replica), from that loop (`reader_loop`): as vLLM v1's API
  server reads its engine core's outputs in its event loop, no thread wakes up and hands each step's items over
  to the loop.

The client has the surface the Serve replica uses (`generate`, `abort`, `stats`, `predict_ttft_ms`, `is_alive`,
`reconfigure`, `inject_fault`, `shutdown`). The child exits when the client says so, when its socket closes, when its
parent is gone (polled every second, so also while the model loads), and when its engine's worker dies (it hangs up
first; the client then fails every open stream with an engine error and refuses new requests).

    python -m engine.core_proc FD [--favoured] [--label TEXT]     # started by EngineCoreClient only
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from core.messages import ErrorKind, GenerateRequest, RequestOutput, TokenLogprob
from engine.config import TEAM_ENV, TEAM_NICE_ENV, EngineConfig, for_device, reconfigured, with_overrides
from engine.errors import HUNG_EXIT_CODE, EngineDeadError
from engine.inputs import InputProcessor
from engine.stats import EngineStats, predict_ttft_ms
from engine.stream import RequestStream
from engine.tokenizer_files import class_name, load_light, ready_tokenizer_dir
from engine.core_messages import (Abort, Add, CoreInfo, Died, Heartbeat, InjectFault, Outputs, Reconfigure,
                                  SetupFailed, Shutdown, TokenDeltas)
from scheduling.config import SchedulerConfig

log = logging.getLogger("kairos.engine")
STATS_PERIOD_S = 0.05  # stats ride on every Outputs message; alone, at most this often
HEARTBEAT_S = 1.0  # the child's heartbeat (a thread of its own): the client kills a child silent past its limit


# ---------------------------------------------------------------------- the socket
def _ready_for(sock: socket.socket, events: int, timeout: float) -> bool:
    """Whether `sock` is ready for `events` (POLLIN, POLLOUT; a hang-up or an error counts) within `timeout` seconds:
    poll, not select, which refuses a descriptor past 1023 (a Ray worker holds hundreds of files and sockets)."""
    p = select.poll()
    p.register(sock, events)
    return bool(p.poll(max(0.0, timeout) * 1000.0))


class Link:
    """One end of the socket between the client and its engine process: pickled messages, each behind its length
    (8 bytes, big-endian). `send` from any thread; `recv` blocks (the child's main thread, the client's reader
    thread); `read_available` takes what has arrived without blocking (the client reading on an asyncio loop).

    `queued` (the client's end): `send` never waits for the other end to read. What the socket does not take at once
    waits, in order, for a sender thread that writes it as the socket drains: the client sends from a Serve replica's
    event loop, which a child that stopped reading (stopped, or stuck holding its interpreter until the client's
    watchdog kills it) would otherwise freeze, every other stream of the replica with it. The child's end blocks (its
    outputs wait for a reader, bounded)."""

    HEADER = struct.Struct("!Q")
    CHUNK = 1 << 16

    def __init__(self, sock: socket.socket, *, queued: bool = False) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buf = bytearray()
        self._queued = queued
        self._backlog: collections.deque[memoryview] = collections.deque()  # (queued) what the socket has not taken
        self._sender: threading.Thread | None = None  # (queued) writing the backlog, while there is one
        self._broken: OSError | None = None  # (queued) why the sender could not write: every later send raises it

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        data = self.HEADER.pack(len(data)) + data
        with self._send_lock:
            if not self._queued:
                self.sock.sendall(data)
                return
            if self._broken is not None:
                raise OSError(self._broken.errno, f"the link broke: {self._broken}")
            view = memoryview(data)
            if not self._backlog:  # (else behind it, in order)
                try:
                    view = view[self.sock.send(view, socket.MSG_DONTWAIT):]
                except (BlockingIOError, InterruptedError):
                    pass
                if not view:
                    return
            self._backlog.append(view)
            if self._sender is None:
                self._sender = threading.Thread(target=self._write_backlog, name="kairos-core-sender", daemon=True)
                self._sender.start()

    def _write_backlog(self) -> None:
        """The sender thread (queued): the backlog as the socket takes it; it ends with the backlog, or where the
        socket fails (the other end gone: the reader's EOF fails what is open)."""
        while True:
            with self._send_lock:
                try:
                    while self._backlog:
                        head = self._backlog[0]
                        n = self.sock.send(head, socket.MSG_DONTWAIT)
                        if n < len(head):
                            self._backlog[0] = head[n:]
                            break
                        self._backlog.popleft()
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    self._broken = e
                    self._backlog.clear()
                if not self._backlog:
                    self._sender = None
                    return
            try:
                _ready_for(self.sock, select.POLLOUT, 1.0)
            except (OSError, ValueError) as e:  # (closed meanwhile)
                with self._send_lock:
                    self._broken = e if isinstance(e, OSError) else OSError(f"the link closed: {e}")
                    self._backlog.clear()
                    self._sender = None
                return

    def offer(self, msg: Any, timeout: float = 1.0, *, last: bool = False) -> None:
        """`send`, unless another sender has held the link for `timeout` (stuck: a reader that stopped reading).
        The `last` message before a hang-up is sent only as far as the socket takes it at once, never blocking (a
        cut message is dropped by the reader, at the EOF that follows)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._send_lock.acquire(timeout=timeout):
            return
        try:
            if last:
                self.sock.send(self.HEADER.pack(len(data)) + data, socket.MSG_DONTWAIT)
            else:
                self.sock.sendall(self.HEADER.pack(len(data)) + data)
        except OSError:
            if not last:
                raise
        finally:
            self._send_lock.release()

    def _complete(self) -> bool:
        return len(self._buf) >= 8 and len(self._buf) >= 8 + self.HEADER.unpack_from(self._buf)[0]

    def _pop(self) -> Any:
        n = self.HEADER.unpack_from(self._buf)[0]
        data = self._buf[8:8 + n]  # a copy: the buffer's front is dropped next
        del self._buf[:8 + n]
        return pickle.loads(data)

    def recv(self) -> Any:
        """The next message; EOFError when the other end has closed."""
        while not self._complete():
            chunk = self.sock.recv(self.CHUNK)
            if not chunk:
                raise EOFError("the link closed")
            self._buf += chunk
        return self._pop()

    def poll(self, timeout: float) -> bool:
        """Whether a message (or EOF) can be read within `timeout` seconds."""
        return self._complete() or _ready_for(self.sock, select.POLLIN, timeout)

    def read_available(self) -> tuple[list[Any], bool]:
        """The whole messages that have arrived, without blocking, and whether the other end has closed."""
        eof = False
        while True:
            try:
                chunk = self.sock.recv(self.CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                eof = True
                break
            self._buf += chunk
            if len(chunk) < self.CHUNK:
                break
        msgs = []
        while self._complete():
            msgs.append(self._pop())
        return msgs, eof

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------- the child
class _Batch:
    """The child's output side: token items go into columns (`TokenDeltas`), every other item into a list; the
    worker thread ships both at the end of each loop turn (`flush`, the engine's `on_outputs` hook). Only the worker
    thread touches it: once the worker has died the main thread does not use it, it ends the process (`main`)."""

    def __init__(self, conn: Link) -> None:
        self.conn = conn
        self.items: list[RequestOutput] = []
        self.tokens = TokenDeltas()
        self.engine: Any = None
        self._stats_at = 0.0
        self._last_stats: EngineStats | None = None

    def put(self, item: RequestOutput) -> None:
        self.items.append(item)

    def put_token(self, request_id: str, text: str, token_id: int, num_prompt_tokens: int,
                  num_output_tokens: int, logprobs: TokenLogprob | None = None,
                  prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        t = self.tokens
        if logprobs is not None:
            t.logprobs[len(t.request_ids)] = logprobs
        if prompt_logprobs is not None:
            t.prompt_logprobs[len(t.request_ids)] = prompt_logprobs
        t.request_ids.append(request_id)
        t.texts.append(text)
        t.token_ids.append(token_id)
        t.num_prompt_tokens.append(num_prompt_tokens)
        t.num_output_tokens.append(num_output_tokens)

    def flush(self) -> None:
        if self.engine is None:  # the engine's setup has not returned yet
            return
        now = time.monotonic()
        stats = self.engine.stats()
        some = bool(self.items) or bool(self.tokens.request_ids)
        fresh = stats != self._last_stats and (some or now - self._stats_at >= STATS_PERIOD_S or not stats.alive)
        if not some and not fresh:
            return
        msg = Outputs(self.items, stats if fresh else None, self.tokens if self.tokens.request_ids else None,
                      time.monotonic())
        self.items = []
        if msg.tokens is not None:
            self.tokens = TokenDeltas()
        if fresh:
            self._last_stats, self._stats_at = stats, now
        try:
            self.conn.send(msg)
        except (OSError, TypeError, ValueError):  # the client is gone (or the socket closed at exit)
            pass
        if not stats.alive:  # the worker died: end the link, so the client fails what is open and refuses more
            self.conn.offer(Died(f"its worker died: {self.engine.dead_reason()}"), last=True)
            _hang_up(self.conn)


def _hang_up(conn: Link) -> None:
    """Shut the socket down (both ways) under a main thread blocked reading it: its recv ends with EOF."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _exit_hung(conn: Link, why: str) -> None:
    """The engine's watchdog found its worker hung (`LLMEngine.on_hung`; it has logged where): say why and end the
    link, so that the client fails every open stream and refuses more, then the process, whose worker may never
    return."""
    conn.offer(Died(why), last=True)
    _hang_up(conn)
    os._exit(HUNG_EXIT_CODE)


def _heartbeat(conn: Link) -> None:
    """Tell the client, every HEARTBEAT_S, that this process still runs Python (`EngineCoreClient._watch`): the
    engine's own watchdog is a thread of this process too, and a process stopped, or stuck in a call that holds
    the interpreter, runs neither."""
    beat = Heartbeat()
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            conn.offer(beat, HEARTBEAT_S)
        except OSError:  # the link is over: the main thread ends the process
            return


def _exit_with_parent(parent: int) -> None:
    """The child outlives no parent, even one killed while the model loads: poll who the parent is."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _log_to_stderr(label: str | None) -> None:
    """The engine's log records (`kairos.*`: its start-up summary, the profile, graphs, failed steps) on this
    process's stderr, which it shares with its replica: a Serve replica's log file, and `serve run`'s console."""
    root = logging.getLogger("kairos")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    name = (label or "kairos engine").replace("%", "%%")
    handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s {name} -- %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    _log_to_stderr(args[args.index("--label") + 1] if "--label" in args[:-1] else None)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="kairos-parent-watch",
                     daemon=True).start()
    fd = int(args[0])
    if "--favoured" in args:
        was = unnice()
        if was > 0 and os.environ.get(TEAM_ENV) == "1":  # the team's workers stay where Ray put the process
            os.environ.setdefault(TEAM_NICE_ENV, str(was))
    conn = Link(socket.socket(fileno=fd))
    batch = _Batch(conn)
    try:
        from engine.engine import LLMEngine  # noqa: PLC0415 - torch: only the child runs tensors

        config = EngineConfig.model_validate(conn.recv())
        engine = LLMEngine(config, on_outputs=batch.flush, on_hung=lambda why: _exit_hung(conn, why))
        inputs = engine.inputs
        info = CoreInfo(engine.model_name, engine.max_model_len, engine.bundle.tokenizer_path,
                        config.trust_remote_code, inputs.vocab_limit, list(inputs.eos_token_ids),
                        inputs.kv_capacity_tokens, engine.latency_model, engine.stats(), engine.step_timeout_s,
                        engine.sampling_defaults, engine.bundle.device.type, inputs.lora,
                        class_name(engine.bundle.tokenizer))
    except BaseException as e:  # noqa: BLE001 - handed to the client, which raises it
        conn.send(SetupFailed(isinstance(e, ValueError), str(e) if isinstance(e, ValueError) else repr(e)))
        return 1
    conn.send(info)
    batch.engine = engine
    if engine.step_timeout_s > 0:
        threading.Thread(target=_heartbeat, args=(conn,), name="kairos-core-heartbeat", daemon=True).start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the client closed its end or died, or the worker hung up
                break
            if isinstance(msg, Add):
                try:
                    engine.submit(msg.request, batch)
                except EngineDeadError:  # the worker died: it hangs up; the client fails this request
                    break
            elif isinstance(msg, Abort):
                engine.abort(msg.request_id)
            elif isinstance(msg, InjectFault):
                engine.inject_fault(msg.count, fatal=msg.fatal, hang_s=msg.hang_s)
            elif isinstance(msg, Reconfigure):
                try:
                    engine.reconfigure(msg.scheduler)
                except (ValueError, EngineDeadError) as e:  # the client checked the knobs: a dead engine's stats say
                    log.warning("reconfigure %s: %s", msg.scheduler, e)
            elif isinstance(msg, Shutdown):
                break
    finally:
        engine.shutdown()  # the worker's last turn aborts what is left and flushes it
        conn.close()
    return 0


def unnice() -> int:
    """Undo the calling thread's inherited low priority (Ray starts its workers at nice 15; on Linux a nice value
    is a thread's, and threads started after this inherit it). The engine process does it before any thread
    starts: its steps are what every request waits for, so they should not queue behind the serving processes'
    Python for a core. Needs the privilege to lower a nice value; without it, nothing changes. Returns the nice
    value it undid (0: none)."""
    try:
        was = os.getpriority(os.PRIO_PROCESS, 0)
        if was > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            return was
    except OSError:
        pass
    return 0


class _TokenizerPreload:
    """The client's tokenizer, loaded on a thread of its own while the child starts: from the directory the
    child's loader will take it from, where that exists already (`tokenizer_files.ready_tokenizer_dir`); nothing
    otherwise, and nothing is built or downloaded here. A generic fast tokenizer is loaded without transformers'
    `AutoTokenizer`, and so without torch (`tokenizer_files.load_light`): the client's process then imports no
    torch. `result` waits for it and hands it over only if the child loaded its tokenizer from that same directory,
    and (`AutoTokenizer` choosing the class) of the same class."""

    def __init__(self, config: EngineConfig) -> None:
        self._tok: Any = None
        self._path: str | None = None
        self._failed: Exception | None = None  # what loading raised
        self._thread = threading.Thread(target=self._load, args=(config,), name="kairos-tokenizer-preload",
                                         daemon=True)
        self._thread.start()

    def _load(self, config: EngineConfig) -> None:
        try:
            path = ready_tokenizer_dir(config.model, config.tokenizer)
            if path is None:
                return
            tok = load_light(path)
            if tok is None:
                from transformers import AutoTokenizer  # noqa: PLC0415 - the import is most of the wait

                tok = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code,
                                                    local_files_only=True)
            self._tok, self._path = tok, path
        except Exception as e:  # noqa: BLE001 - a guess: the client loads the tokenizer itself then
            self._tok, self._failed = None, e

    def result(self, tokenizer_path: str, tokenizer_class: str) -> Any:
        self._thread.join()
        if self._tok is None or self._path != tokenizer_path or class_name(self._tok) != tokenizer_class:
            if self._failed is not None or self._tok is not None:  # (else there was nothing to preload)
                log.info("the tokenizer loaded beside the engine's start is not used (%s): loading the tokenizer of "
                         "%s again",
                         f"it failed: {self._failed!r}" if self._tok is None else
                         f"{class_name(self._tok)} of {self._path}, the engine's {tokenizer_class}",
                         tokenizer_path)
            return None
        return self._tok


# ---------------------------------------------------------------------- the client
class EngineCoreClient:
    """An `LLMEngine` in a child process, driven from this one. Construction starts the child and waits until
    its model is loaded; it raises what loading raised (ValueError for bad settings)."""

    def __init__(self, config: EngineConfig | None = None, *, favoured: bool = False, team: bool = False,
                 label: str | None = None, reader_loop: asyncio.AbstractEventLoop | None = None,
                 startup_timeout_s: float = 1800.0, **overrides) -> None:
        """`favoured`: the child undoes an inherited low priority (Ray's nice 15), so that its steps go before
        the serving processes' Python. Only where its threads leave those processes a core, or where the other
        threads are the team's workers, which keep the inherited priority: on 2 cores, an engine with 2 OpenMP
        threads at nice 0 starved the HTTP proxy. `team`: the child's CPU kernels
        run on Kairos's thread team, and torch's OpenMP threads sleep when idle instead of spinning on the
        team's cores (`engine.config.TEAM_ENV`), for an engine whose cores other processes share (neither is set
        where the caller set it already). `label` goes on the child's command line (e.g. the Serve replica it
        belongs to), for whoever lists processes. `reader_loop`: read the engine's outputs on this asyncio loop
        (a callback on its socket) instead of on a thread of this client's, for a process that serves on that
        loop: each step's items then reach the streams' readers without a thread that wakes up only to hand them
        over (on shared cores, Ray's nice 15 kept that thread waiting for a core each step). The client
        may be built on another thread; it starts reading once the loop runs."""
        self.config = with_overrides(config or EngineConfig(), overrides)
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        if team:
            env.setdefault(TEAM_ENV, "1")
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads libgomp
        argv = [sys.executable, "-m", "engine.core_proc", str(theirs.fileno())]
        argv += (["--favoured"] if favoured else []) + (["--label", label] if label else [])
        self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Link(ours, queued=True)  # (sent from a replica's event loop: never waits for the child)
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and _dead (callers' threads add, the reader removes)
        self._dead: str | None = None
        self._death: str | None = None  # why the child said it stopped (`Died`), before it hung up
        try:
            # the tokenizer this process needs, loaded while the child starts (transformers' import alone takes
            # seconds)
            preload = _TokenizerPreload(self.config)
            self._send(self.config.model_dump(mode="json", exclude_unset=True))  # the engine fills in its device's
            info = self._wait_ready(startup_timeout_s)
            tok = preload.result(info.tokenizer_path, info.tokenizer_class)
            if tok is None:  # not preloaded (a hub id, a model built by the child), or from elsewhere, or another class
                from transformers import AutoTokenizer  # noqa: PLC0415

                kw: dict[str, Any] = {"trust_remote_code": info.trust_remote_code}
                if os.environ.get("HF_HUB_OFFLINE") == "1":
                    kw["local_files_only"] = True
                tok = AutoTokenizer.from_pretrained(info.tokenizer_path, **kw)
            if self.config.chat_template is not None:  # (vLLM's --chat-template, as the child's)
                tok.chat_template = self.config.chat_template
        except BaseException:
            self._kill()
            self._conn.close()
            raise
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.sampling_defaults = info.sampling_defaults
        self.latency_model = info.latency_model
        self._stats: EngineStats = info.stats
        self._device_type = info.device_type
        self._scheduler = for_device(self.config, info.device_type).scheduler  # its knobs fixed at start
        self._reconfigures = 0  # `reconfigure` calls sent to the child
        self.inputs = InputProcessor(tok, info.vocab_limit, info.eos_token_ids, info.max_model_len,
                                     info.kv_capacity_tokens, self.config.max_tokens_over_context == "reject",
                                     info.lora, self._scheduler.by_priority, info.sampling_defaults.get("max_tokens"),
                                     self.config.max_logprobs)
        self._loop = reader_loop
        self._heard = time.monotonic()  # when the child last sent anything (`_deliver`)
        # one reader at a time on a loop's socket: the loop's callback, or a shutdown from another thread
        self._read_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        if reader_loop is None:
            self._reader = threading.Thread(target=self._read, name="kairos-core-reader", daemon=True)
            self._reader.start()
        else:
            reader_loop.call_soon_threadsafe(reader_loop.add_reader, self._conn.fileno(), self._on_readable)
        if info.step_timeout_s > 0:
            threading.Thread(target=self._watch, args=(max(info.step_timeout_s, 4 * HEARTBEAT_S),),
                             name="kairos-core-watch", daemon=True).start()

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._proc.pid

    def _wait_ready(self, timeout_s: float) -> CoreInfo:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self._proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine process did not start within {timeout_s:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited with code {self._proc.wait()} while starting") from None
        if isinstance(msg, SetupFailed):
            raise (ValueError if msg.bad_input else RuntimeError)(msg.message)
        return msg

    # ------------------------------------------------------------------ the LLMEngine surface
    def generate(self, request: GenerateRequest) -> RequestStream:
        """Validate and tokenize here (ValueError on bad input), then hand the request to the child."""
        self._check_alive()
        req = self.inputs.process(request.prompt, request.params, request.engine_slo, request.request_id,
                                  request.messages, request.options, request.lora, request.cache_salt,
                                  request.lora_source, request.priority, request.read_thinking)
        stream = RequestStream(req.request_id, req.prompt_token_ids if request.return_token_ids else None,
                               req.prompt_thinking, req.arrival_s)
        with self._lock:
            self._check_alive()  # under the lock: the reader fails every stream registered before it gave up
            if req.request_id in self._streams:
                stream.put(RequestOutput.failed(req.request_id, f"duplicate request id {req.request_id!r}",
                                                ErrorKind.INVALID_REQUEST))
                return stream
            self._streams[req.request_id] = stream
        try:
            self._send(Add(req))
        except BaseException as e:
            with self._lock:
                self._streams.pop(req.request_id, None)
            if isinstance(e, OSError):
                raise EngineDeadError(f"engine process unreachable: {e}") from None
            raise
        return stream

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._stats.alive:
            raise EngineDeadError("the engine's worker died")

    def abort(self, request_id: str) -> None:
        try:
            self._send(Abort(request_id))
        except OSError:
            pass  # the process is gone: its streams were already failed

    def reconfigure(self, scheduler: dict[str, Any]) -> SchedulerConfig:
        """As `LLMEngine.reconfigure`: the knobs are checked here (ValueError), then sent; the child's stats say
        when the new policy runs (`EngineStats.policy`)."""
        self._check_alive()
        config = reconfigured(self.config.scheduler, self._scheduler, scheduler, self._device_type)
        try:
            self._send(Reconfigure(dict(scheduler)))
        except OSError as e:
            raise EngineDeadError(f"engine process unreachable: {e}") from None
        with self._lock:  # (beside `_deliver`'s reading of the child's)
            self._reconfigures += 1
            self.inputs.priority_scheduling = config.by_priority  # (requests from now on; the child's stats confirm)
        return config

    def inject_fault(self, count: int = 1, *, fatal: bool = False, hang_s: float = 0.0) -> None:
        """Test hook, as `LLMEngine.inject_fault`."""
        self._send(InjectFault(count, fatal, hang_s))

    def stats(self) -> EngineStats:
        """The child's last published snapshot."""
        return self._stats

    def predict_ttft_ms(self, num_prompt_tokens: int) -> float:
        return predict_ttft_ms(self.latency_model, self._stats, num_prompt_tokens, self.max_model_len)

    def is_alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None and self._stats.alive

    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (None while it can)."""
        if self.is_alive():
            return None
        code = self._proc.poll()
        return self._dead or (f"engine process exited (code {code})" if code is not None else "its worker died")

    def shutdown(self, timeout: float = 10.0) -> None:
        try:
            self._send(Shutdown())
        except OSError:
            pass
        # the child's stopping engine sends what it ends (each open request's last item) before it exits: read on a
        # loop, that loop may be this very thread (Serve runs a replica's destructor there), so it is read here while
        # the child stops, or a send past the socket's buffer blocked the child until it was killed at the timeout,
        # and its requests failed as an engine failure instead of ending aborted
        deadline = time.monotonic() + timeout
        while self._proc.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                break
            if self._reader is None and self._dead is None:
                if _ready_for(self._conn.sock, select.POLLIN, min(left, 0.05)):
                    self._on_readable()
            else:
                try:
                    self._proc.wait(min(left, 0.05))
                except subprocess.TimeoutExpired:
                    pass
        if self._reader is not None:
            self._reader.join(timeout)
        elif self._dead is None:  # read on a loop: stop reading, deliver what the child sent last, end the rest
            self._stop_reading_on_loop()
            self._on_readable()  # the child has exited: one pass reads to the end of the socket
            self._gone()

    # ------------------------------------------------------------------ plumbing
    def _send(self, msg: Any) -> None:
        self._conn.send(msg)

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def _deliver(self, msg: Outputs | Died | Heartbeat) -> None:
        self._heard = time.monotonic()
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, Died):  # the child hangs up next (`_gone`)
            self._death = msg.reason
            return
        if msg.stats is not None:
            self._stats = msg.stats
            with self._lock:  # the child has taken every change sent: its rule stands (the old one's where it failed)
                if msg.stats.reconfigures == self._reconfigures:
                    self.inputs.priority_scheduling = msg.stats.priority_scheduling
        if (t := msg.tokens) is not None:  # before the items: a request's last item comes after its tokens
            with self._lock:
                streams = [self._streams.get(rid) for rid in t.request_ids]
            # first tokens first: the readers they wake go ahead of the other streams' in the event loop's queue (a
            # request's time to first token waits for no stream's chunk); a request's later tokens still follow
            # its first
            n_outs = t.num_output_tokens
            firsts = [i for i, n in enumerate(n_outs) if n == 1]
            order = firsts + [i for i, n in enumerate(n_outs) if n != 1] if firsts else range(len(n_outs))
            lps, prompts = t.logprobs, t.prompt_logprobs
            for i in order:
                stream = streams[i]
                if stream is not None:
                    stream.put_token(t.request_ids[i], t.texts[i], t.token_ids[i], t.num_prompt_tokens[i], n_outs[i],
                                     lps.get(i) if lps else None, prompts.get(i) if prompts else None, at=msg.sent_s)
        for item in msg.items:
            with self._lock:
                stream = self._streams.pop(item.request_id, None) if item.finished else \
                    self._streams.get(item.request_id)
            if stream is not None:
                stream.put(item, at=msg.sent_s)

    def _read(self) -> None:
        """The reader thread (no `reader_loop`)."""
        try:
            while True:
                self._deliver(self._conn.recv())
        except (EOFError, OSError):
            pass
        except BaseException:  # noqa: BLE001 - a broken message: the link cannot be trusted any more
            log.exception("engine client: reading the engine process failed")
        self._gone()

    def _on_readable(self) -> None:
        """`reader_loop`'s callback when the socket has data (or has closed)."""
        try:
            with self._read_lock:  # read and delivered in order, whichever thread calls
                msgs, eof = self._conn.read_available()
                for msg in msgs:
                    self._deliver(msg)
        except OSError:
            eof = True
        except Exception:  # noqa: BLE001 - a broken message, as in _read
            log.exception("engine client: reading the engine process failed")
            eof = True
        if eof:
            self._stop_reading_on_loop()
            self._gone()

    def _stop_reading_on_loop(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.remove_reader(self._conn.fileno())
        else:
            loop.call_soon_threadsafe(loop.remove_reader, self._conn.fileno())

    def _watch(self, limit_s: float) -> None:
        """Kill a child that has sent nothing, not even its heartbeat, for `limit_s` (its engine's step timeout):
        stopped, or stuck in a call that holds its interpreter, where its own watchdog cannot run. Its link then
        closes, and `_gone` fails what is open."""
        while self._dead is None and self._proc.poll() is None:
            time.sleep(min(1.0, limit_s / 4))
            silent = time.monotonic() - self._heard
            if silent > limit_s and self._dead is None and self._proc.poll() is None:
                self._death = f"its process sent nothing for {silent:.0f} s (stopped, or stuck holding its interpreter)"
                log.error("engine process %d: %s; killing it", self._proc.pid, self._death)
                self._proc.kill()
                return

    def _gone(self) -> None:
        """The link is over: mark the engine dead and fail every open stream as unavailable."""
        code = self._proc.poll()
        with self._lock:
            if self._dead is not None:
                return
            self._dead = (f"engine process stopped: {self._death}" if self._death is not None else
                          "engine process link closed" if code is None else
                          "engine process exited: its worker hung (step_timeout_s)" if code == HUNG_EXIT_CODE else
                          f"engine process exited (code {code})")
            self._stats = dataclasses.replace(self._stats, alive=False)
            orphans, self._streams = self._streams, {}
        for rid, stream in orphans.items():
            stream.put(RequestOutput.failed(rid, f"engine failure: {self._dead}", ErrorKind.UNAVAILABLE))


if __name__ == "__main__":
    sys.exit(main())
