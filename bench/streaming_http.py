"""bench.streaming --target: the same requests over HTTP (SSE), one thread per request."""
from __future__ import annotations

import argparse
import math
import threading
import time
from typing import Any

from bench.common import SSE_DONE, sse_data
from bench.models import resolve_model_path
from bench.streaming_report import Rec

# --------------------------------------------------------------------------- HTTP target


def _http_request(client, url: str, body: dict, headers: dict, rec: Rec, t_start: float, timeout: float) -> None:
    import httpx

    rec.submit_start = t_start
    try:
        req = client.build_request("POST", url, json=body, headers=headers,
                                   timeout=httpx.Timeout(timeout, connect=30.0))
        resp = client.send(req, stream=True)
    except Exception as e:  # noqa: BLE001
        rec.submit_end = time.perf_counter()
        rec.add_error = f"{type(e).__name__}: {e}"
        return
    rec.submit_end = time.perf_counter()
    try:
        if resp.status_code != 200:
            resp.read()
            rec.add_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return
        n_chunks = 0
        for line in resp.iter_lines():
            t = time.perf_counter()
            obj = sse_data(line)
            if obj is None:
                continue
            if obj == SSE_DONE:
                break
            if "error" in obj:
                rec.error = str(obj["error"].get("message", obj["error"]))
                continue
            usage = obj.get("usage")
            if usage:
                rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                rec.completion_tokens = int(usage.get("completion_tokens", 0))
            for ch in obj.get("choices") or []:
                if "text" in ch:  # one chunk per delivery of >= 1 token (its text may be '' mid-character)
                    rec.token_times.append(t)
                    n_chunks += 1
                if ch.get("finish_reason"):
                    rec.finish_reason = ch["finish_reason"]
                    rec.finish_ts = t
        rec.deliveries = n_chunks
        if math.isnan(rec.finish_ts):
            rec.finish_ts = time.perf_counter()
        if not rec.completion_tokens:
            rec.completion_tokens = n_chunks
    except Exception as e:  # noqa: BLE001
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        resp.close()


def run_http(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    import httpx

    base = args.target.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    n = len(prompts)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    tokenize_ms: list[float] = []
    inputs: list[Any] = list(prompts)
    if args.pretokenize:
        from transformers import AutoTokenizer

        path = resolve_model_path(args.model)
        tok = AutoTokenizer.from_pretrained(path)
        inputs = []
        for p in prompts:
            ts = time.perf_counter()
            inputs.append(tok.encode(p, add_special_tokens=False) or [tok.eos_token_id or 0])
            tokenize_ms.append((time.perf_counter() - ts) * 1e3)
    with httpx.Client(limits=limits, headers=headers) as client:
        served_model = None
        try:
            r = client.get(f"{base}/v1/models", timeout=30.0)
            if r.status_code == 200:
                served_model = r.json()["data"][0]["id"]
        except Exception:  # noqa: BLE001 - the name is cosmetic
            pass
        url = f"{base}/v1/completions"
        for i in range(max(0, args.warmup)):
            body = {"prompt": f"{args.prompt} [warmup {i}]", "max_tokens": min(4, args.max_new_tokens),
                    "temperature": 0.0, "ignore_eos": True, "stream": False}
            try:
                client.post(url, json=body, timeout=args.request_timeout)
            except Exception:  # noqa: BLE001
                pass
        recs = [Rec(i) for i in range(n)]
        bodies = [{"prompt": inp, "max_tokens": args.max_new_tokens, "temperature": args.temperature,
                   "ignore_eos": bool(args.no_stop_on_eos), "stream": True,
                   "stream_options": {"include_usage": True}} for inp in inputs]
        if args.seed is not None and args.temperature > 0:
            for b in bodies:
                b["seed"] = args.seed
        threads = []
        interval = args.submit_interval_ms / 1e3
        t_first = time.perf_counter()
        for i in range(n):
            t_start = time.perf_counter()
            th = threading.Thread(target=_http_request,
                                  args=(client, url, bodies[i], {}, recs[i], t_start, args.request_timeout),
                                  daemon=True, name=f"bench-http-{i}")
            th.start()
            threads.append(th)
            if interval > 0 and i + 1 < n:
                time.sleep(interval)
        submit_end = time.perf_counter()
        for th in threads:
            th.join()
    return {"recs": recs, "t_first": t_first, "submit_end": submit_end, "tokenize_ms": tokenize_ms,
            "engine_stats": None, "served_model": served_model}
