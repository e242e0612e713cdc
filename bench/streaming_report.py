"""bench.streaming's figures: the per-request record, percentiles, and the seeds' printed block."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from bench.common import summarize

PCTS = (50, 95, 99)
BLOCK_HEADER = "=== streaming benchmark ==="
BLOCK_LINES = ("Model:", "Device:", "Requests:", "Prompt tokens (total):", "Completion tokens (total):",
               "Submit wall:", "add_request latency p50/p95/p99:", "TTFT p50/p95/p99:", "TPOT p50/p95/p99:",
               "ITL p50/p95/p99:", "Latency p50/p95/p99:", "Throughput (completion,total):")


# --------------------------------------------------------------------------- per-request record


@dataclass
class Rec:
    index: int
    submit_start: float = math.nan
    submit_end: float = math.nan
    token_times: list[float] = field(default_factory=list)
    deliveries: int = 0
    merged_deliveries: int = 0
    finish_ts: float = math.nan
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine: dict[str, Any] | None = None
    add_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.add_error is None and bool(self.token_times) \
            and self.finish_reason in ("length", "stop")


# --------------------------------------------------------------------------- figures


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return summarize(values, PCTS)


def _fmt3(d: dict[str, float]) -> str:
    return "/".join(f"{d[f'p{q}']:.2f}" for q in PCTS)


def _engine_side(recs: list[Rec]) -> dict[str, Any]:
    ttft, queue, itl, tpot = [], [], [], []
    for r in recs:
        e = r.engine
        if not e or e.get("first_token_s") is None:
            continue
        ttft.append((e["first_token_s"] - e["arrival_s"]) * 1e3)
        if e.get("admitted_s") is not None:
            queue.append((e["admitted_s"] - e["arrival_s"]) * 1e3)
        tt = e["token_times"]
        itl.extend((b - a) * 1e3 for a, b in zip(tt, tt[1:]))
        if len(tt) >= 2:
            tpot.append((tt[-1] - tt[0]) / (len(tt) - 1) * 1e3)
    return {"ttft_ms": _pcts(ttft), "queue_ms": _pcts(queue), "itl_ms": _pcts(itl), "tpot_ms": _pcts(tpot),
            "note": "engine timestamps (time.monotonic): arrival = add_request, tokens = end of the model step"}


def summarize_run(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    recs: list[Rec] = raw["recs"]
    ok = [r for r in recs if r.ok]
    t_first = raw["t_first"]
    add_ms = [(r.submit_end - r.submit_start) * 1e3 for r in recs if r.add_error is None]
    ttft_ms = [(r.token_times[0] - r.submit_start) * 1e3 for r in ok]
    lat_ms = [(r.finish_ts - r.submit_start) * 1e3 for r in ok]
    tpot_ms, itl_ms = [], []
    for r in ok:
        tt = r.token_times
        itl_ms.extend((b - a) * 1e3 for a, b in zip(tt, tt[1:]))
        n = r.completion_tokens if args.target else len(tt)
        if n >= 2:
            tpot_ms.append((tt[-1] - tt[0]) / (n - 1) * 1e3)
    finishes = [r.finish_ts for r in recs if not math.isnan(r.finish_ts)]
    wall = (max(finishes) - t_first) if finishes else math.nan
    prompt_total = sum(r.prompt_tokens for r in recs)
    completion_total = sum(r.completion_tokens for r in ok)
    thr = completion_total / wall if wall and wall > 0 else math.nan
    thr_total = (completion_total + sum(r.prompt_tokens for r in ok)) / wall if wall and wall > 0 else math.nan
    res: dict[str, Any] = {
        "bench": "streaming",
        "model": raw.get("served_model") or args.model,
        "device": args.device if not args.target else f"{args.target}",
        "mode": "http" if args.target else "engine",
        "requests": len(recs),
        "ok_requests": len(ok),
        "failed_requests": len(recs) - len(ok),
        "errors": sorted({(r.add_error or r.error or f"finish_reason={r.finish_reason}") for r in recs if not r.ok}),
        "prompt_tokens_total": prompt_total,
        "completion_tokens_total": completion_total,
        "submit_wall_s": raw["submit_end"] - t_first,
        "wall_s": wall,
        "add_request_ms": _pcts(add_ms),
        "ttft_ms": _pcts(ttft_ms),
        "tpot_ms": _pcts(tpot_ms),
        "itl_ms": _pcts(itl_ms),
        "latency_ms": _pcts(lat_ms),
        "throughput_completion_tok_s": thr,
        "throughput_total_tok_s": thr_total,
        "merged_deliveries": sum(r.merged_deliveries for r in recs),
        "deliveries": sum(r.deliveries for r in recs),
        "submit_mode": args.submit_mode,
        "pretokenized": bool(args.pretokenize),
        "tokenize_ms": _pcts(raw.get("tokenize_ms") or []),
    }
    for name in ("add_request", "ttft", "tpot", "itl", "latency"):
        for q in PCTS:
            res[f"{name}_p{q}_ms"] = res[f"{name}_ms"][f"p{q}"]
    if args.pretokenize:
        res["add_request_p50_excl_tokenize_ms"] = res["add_request_p50_ms"]
    if raw.get("engine_stats") is not None:
        res["engine_stats"] = raw["engine_stats"]
        res["engine_side"] = _engine_side(recs)
    res["per_request"] = [
        {"index": r.index, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
         "add_request_ms": (r.submit_end - r.submit_start) * 1e3,
         "ttft_ms": (r.token_times[0] - r.submit_start) * 1e3 if r.token_times else None,
         "latency_ms": (r.finish_ts - r.submit_start) * 1e3 if not math.isnan(r.finish_ts) else None,
         "submit_offset_ms": (r.submit_start - t_first) * 1e3, "deliveries": r.deliveries,
         "finish_reason": r.finish_reason, "error": r.add_error or r.error}
        for r in recs]
    res["block"] = format_block(res)
    return res


def format_block(res: dict[str, Any]) -> str:
    """The seeds' printed block, line for line."""
    return "\n".join([
        BLOCK_HEADER,
        f"Model: {res['model']}",
        f"Device: {res['device']}",
        f"Requests: {res['requests']}",
        f"Prompt tokens (total): {res['prompt_tokens_total']}",
        f"Completion tokens (total): {res['completion_tokens_total']}",
        f"Submit wall: {res['submit_wall_s']:.6f} s",
        f"add_request latency p50/p95/p99: {_fmt3(res['add_request_ms'])} ms",
        f"TTFT p50/p95/p99: {_fmt3(res['ttft_ms'])} ms",
        f"TPOT p50/p95/p99: {_fmt3(res['tpot_ms'])} ms/token",
        f"ITL p50/p95/p99: {_fmt3(res['itl_ms'])} ms",
        f"Latency p50/p95/p99: {_fmt3(res['latency_ms'])} ms",
        f"Throughput (completion,total): {res['throughput_completion_tok_s']:.2f} tokens/s",
    ])


def format_extra(res: dict[str, Any]) -> str:
    lines = [f"Throughput (prompt+completion): {res['throughput_total_tok_s']:.2f} tokens/s"]
    if res["pretokenized"]:
        lines.append(f"Tokenization (outside the timed loop) p50/p95/p99: {_fmt3(res['tokenize_ms'])} ms")
    if res["failed_requests"]:
        lines.append(f"Failed requests: {res['failed_requests']} ({'; '.join(res['errors'][:3])})")
    return "\n".join(lines)
