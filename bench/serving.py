"""A fresh `serve run deployments:app` for a benchmark: started, warmed with one completion, and stopped.

Used by `bench.overhead` and `bench.route`. The server is started as `python -m ray.serve.scripts run` and stopped
with `python -m ray.scripts.scripts stop --force`, so it needs no console scripts on PATH (a `pip --target`
install has none), only this interpreter's `ray`.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

TARGET = "http://127.0.0.1:8000"


def ok(url: str, body: dict | None = None, timeout: float = 5.0) -> bool:
    """True when `url` answers 200 (a POST of `body` as JSON when given)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def stop_ray() -> None:
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def served(serve_args: str, log: Path, target: str = TARGET, start_timeout_s: float = 600.0) -> Iterator[str]:
    """`serve run deployments:app` with `serve_args` (key=value app arguments, and NAME=VALUE upper-case
    environment variables of that server, e.g. RAY_SERVE_ENABLE_HA_PROXY=0), up and warmed; yields its URL."""
    tokens = shlex.split(serve_args)
    env_pairs = [t.split("=", 1) for t in tokens if "=" in t and t.split("=", 1)[0].isupper()]
    env = dict(os.environ) | dict(env_pairs)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    cmd = [sys.executable, "-m", "ray.serve.scripts", "run", "deployments:app",
           *(t for t in tokens if not ("=" in t and t.split("=", 1)[0].isupper()))]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + start_timeout_s
        # a completion, not /health (200 once an LLM replica is up): it also warms the replica's first request
        while not ok(f"{target}/v1/completions", {"prompt": "warm", "max_tokens": 4}, timeout=30):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(cmd)}` did not come up; see {log}")
            time.sleep(2)
        yield target
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        stop_ray()
