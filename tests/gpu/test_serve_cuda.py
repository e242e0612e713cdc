"""One request over HTTP through Ray Serve with the engine on the GPU, as a user deploys it: `serve run` in a
subprocess, `deployments:app` with `device=cuda` (the tiny Llama, fp32; a replica per GPU, the default), and a
completion without `temperature` (the API's default 1.0, a sampled request) answered 200 with its tokens.

The app runs from a Serve config file (`import_path: deployments:app`, the same arguments as `key=value`) only to
give it a free HTTP port and its own local Ray (`--address local`): other Ray clusters on a shared box are left
alone. Skipped where Ray is not importable (on a lent GPU host it comes from `.dev/site312.tar.xz`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0


def _call(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def test_completion_over_http_without_temperature(device, ckpts, tmp_path):
    pytest.importorskip("ray", reason="Ray is not importable (on a GPU host: unpack .dev/site312.tar.xz)")
    pytest.importorskip("ray.serve")
    port = free_port()
    args = {"model": ckpts["llama"], "device": device, "dtype": "float32",
            "num_kv_blocks": 256, "max_num_seqs": 8, "served_model_name": "tiny-llama"}
    if device == "cpu":
        args.update(num_threads=1, num_gpus=0)
    # on CUDA num_gpus and num_replicas are left to their defaults, as a user does: a replica per GPU Ray finds
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "kairos-gpu-test", "route_prefix": "/", "import_path": "deployments:app",
                                "args": args}]}
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", "--address", "local", str(cfg)],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                status, _ = _call(url + "/health", timeout=5)
            except OSError:
                status = None
            if status == 200:
                break
            assert proc.poll() is None, f"serve run exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"not ready in {START_TIMEOUT_S:.0f} s:\n" \
                                                            f"{log.read_text()[-4000:]}"
            time.sleep(1.0)
        print(f"\n[serve] ready in {time.monotonic() - t0:.1f} s")
        status, body = _call(url + "/v1/completions", {"model": "tiny-llama", "prompt": "The GPU says",
                                                       "max_tokens": 8}, timeout=120)
        assert status == 200, body
        choice = body["choices"][0]
        assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop"), body
        assert 1 <= body["usage"]["completion_tokens"] <= 8, body
        status, body = _call(url + "/v1/completions", {"model": "tiny-llama", "prompt": "Greedy", "max_tokens": 4,
                                                       "temperature": 0}, timeout=120)
        assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # serve run shuts the app and its local Ray down
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
