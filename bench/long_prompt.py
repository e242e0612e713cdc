"""What a long best-effort prompt does to the streams already running, over HTTP on a running server.

    python -m bench.long_prompt --target http://127.0.0.1:8000 [--prompt-tokens 8000] [--summary NAME]
                                [--server-commit SHA]

For each case (a stream with SLO headers, then one without), one streamed completion of `--stream-tokens` tokens
runs while, `--delay-s` after it starts, a request with no SLO sends a prompt of `--prompt-tokens` token ids. It
reports the stream's longest gap between chunks and its mean time per chunk, and how long the long request took:
a replica that prefills the long prompt in one step stalls every stream for all of it (bench/README.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any, Sequence

from bench.report import command_line, write_summary

MODULE = "bench.long_prompt"
CASES = {"slo": {"x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "200"}, "no_slo": {}}


async def _stream(client: Any, headers: dict[str, str], tokens: int) -> dict[str, float]:
    body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": tokens, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times, times[1:])] or [0.0]
    return {"chunks": len(times), "max_gap_ms": max(gaps) * 1e3,
            "mean_gap_ms": (times[-1] - times[0]) / max(1, len(times) - 1) * 1e3 if times else 0.0}


async def _long(client: Any, delay_s: float, prompt_tokens: int) -> dict[str, float]:
    await asyncio.sleep(delay_s)
    t = time.monotonic()
    ids = [100 + i % 3000 for i in range(prompt_tokens)]
    r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})
    r.raise_for_status()
    return {"long_status": r.status_code, "long_ms": (time.monotonic() - t) * 1e3}


async def measure(target: str, prompt_tokens: int, stream_tokens: int, delay_s: float) -> dict[str, dict]:
    import httpx

    out: dict[str, dict] = {}
    async with httpx.AsyncClient(base_url=target, timeout=600) as client:
        for case, headers in CASES.items():
            s, lng = await asyncio.gather(_stream(client, headers, stream_tokens), _long(client, delay_s,
                                                                                            prompt_tokens))
            out[case] = {**s, **lng}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the server's base URL")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--delay-s", type=float, default=1.0)
    ap.add_argument("--summary", default=None, help="write bench/summaries/NAME.json")
    ap.add_argument("--server-commit", default=None, help="the commit the server runs, for the summary (default: "
                    "this checkout's)")
    args = ap.parse_args(argv)
    res = asyncio.run(measure(args.target, args.prompt_tokens, args.stream_tokens, args.delay_s))
    print(json.dumps(res, indent=1))
    if args.summary:
        head = "; ".join(f"{c}: the stream's longest gap {r['max_gap_ms'] / 1e3:.2f} s, mean "
                         f"{r['mean_gap_ms']:.0f} ms a chunk, the {args.prompt_tokens}-token prompt "
                         f"{r['long_ms'] / 1e3:.1f} s" for c, r in res.items())
        write_summary(args.summary, command_line(MODULE, argv), head, {"cases": res, "args": vars(args)},
                      commit=args.server_commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
