"""What a guided request costs the requests batched with it: plain requests decoding together, alone and beside one
request held to a format (guided decoding checks its tokens on the host, in Python, on the engine's thread, between
the batch's steps), on one engine.

Each round runs the plain batch alone, then beside one guided request of each format, in an order that rotates so
that a box whose speed drifts charges all alike; a point is the median time between two tokens of the plain requests
(after their first few) over the rounds, and how many of the guided replies were of their format. The formats: a JSON
schema of one property whose value is an enum of `--values` values, a closed object of `--keys` properties (each an
enum of three), a regular expression, and json_object. The guided requests sample (temperature 1, as an OpenAI client
asks by default).

    python -m bench.guided --model kairos-default --summary guided-smollm2
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from typing import Any, Sequence

from bench.report import command_line, print_table, run_info, write_summary

SKIP_TOKENS = 2  # a plain request's first gaps, before the batch decodes together
REGEX = r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){1,3}, [0-9]{4}\."


def formats(values: int, keys: int) -> dict[str, dict[str, Any]]:
    """Each format's guided request fields (`SamplingParams`), by name."""
    enum = {"type": "object", "properties": {"color": {"type": "string",
                                                       "enum": [f"shade number {i}" for i in range(values)]}},
            "required": ["color"]}
    closed = {"type": "object", "additionalProperties": False, "required": ["field_0"],
              "properties": {f"field_{i}": {"type": "string", "enum": [f"v{i}a", f"v{i}b", f"value {i} c"]}
                             for i in range(keys)}}
    return {f"enum of {values}": {"json_schema": json.dumps(enum)},
            f"{keys} keys": {"json_schema": json.dumps(closed)},
            "regex": {"regex": REGEX}, "json_object": {"json_object": True}}


def _of_format(text: str, fields: dict[str, Any], finished: bool) -> bool:
    """Whether a guided reply is of its format (a reply its max_tokens cut: whether it is a prefix of one, unknown
    here: counted as of it only where it ended)."""
    if not finished:
        return False
    if "regex" in fields:
        return re.fullmatch(fields["regex"], text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict)


def _point(eng, prompt: list[int], plain: int, steps: int, fields: dict[str, Any] | None, tag: str, seed: int
           ) -> tuple[float, bool | None]:
    """The plain batch (beside one guided request of `fields`): the median gap of its tokens (ms), and whether the
    guided reply was of its format (None: none ran)."""
    from core.sampling import SamplingParams

    sp = SamplingParams(max_tokens=steps + SKIP_TOKENS, temperature=0.0, ignore_eos=True)
    guided = eng.add_request(prompt, SamplingParams(max_tokens=10 * steps, temperature=1.0, seed=seed, **fields),
                             request_id=f"{tag}-g") if fields is not None else None
    streams = [eng.add_request(prompt, sp, request_id=f"{tag}-{i}") for i in range(plain)]
    items = [list(s) for s in streams]
    gaps = [(b - a) * 1000.0 for it in items for t in [it[-1].metrics.token_times[SKIP_TOKENS:]]
            for a, b in zip(t, t[1:])]
    ok = None
    if guided is not None:
        outs = list(guided)
        ok = _of_format("".join(o.text for o in outs), fields, outs[-1].finish_reason == "stop")
    return statistics.median(gaps), ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guided", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kairos-default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plain", type=int, default=3, help="plain requests in the batch")
    ap.add_argument("--steps", type=int, default=30, help="tokens measured per plain request")
    ap.add_argument("--values", type=int, default=300)
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default="answer", help="every request's user message (as a client's, it asks for no "
                    "format: the guided row's likeliest tokens often do not fit)")
    ap.add_argument("--summary", default=None)
    args = ap.parse_args(argv)

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 scheduler=SchedulerConfig(policy="fcfs")))
    points: dict[str, dict[str, Any] | None] = {"plain alone": None, **formats(args.values, args.keys)}
    ms: dict[str, list[float]] = {p: [] for p in points}
    kept: dict[str, list[bool]] = {p: [] for p in points if points[p] is not None}
    try:
        tok = eng.inputs.tokenizer
        ask = [{"role": "user", "content": args.prompt}]
        prompt = list(tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]) if tok.chat_template else \
            tok.encode(args.prompt)
        names = list(points)
        for r in range(args.rounds + 1):  # round 0 warms up (not counted)
            for name in names[r % len(names):] + names[:r % len(names)]:
                gap, ok = _point(eng, prompt, args.plain, args.steps, points[name], f"r{r}-{name}", r)
                if r:
                    ms[name].append(gap)
                    if ok is not None:
                        kept[name].append(ok)
    finally:
        eng.shutdown()
    base = statistics.median(ms["plain alone"])
    rows = [{"point": p, "plain ms/token": round(statistics.median(v), 2),
             "x alone": round(statistics.median(v) / base, 3),
             "guided replies ended in their format": f"{sum(kept[p])}/{len(kept[p])}" if p in kept else "-"}
            for p, v in ms.items()]
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    print(f"{args.plain} plain requests, greedy, {args.steps} tokens each; beside one sampled guided request")
    if args.summary:
        worst = max(rows[1:], key=lambda r: r["x alone"])
        headline = (f"{args.plain} plain requests' time per token beside one guided request: at most "
                    f"{worst['x alone']}x alone ({worst['point']}); " +
                    ", ".join(f"{r['point']} {r['x alone']}x" for r in rows[1:]))
        write_summary(args.summary, command_line("bench.guided", argv), headline,
                      {"rows": rows, "ms_by_round": ms, "kept": kept, "args": vars(args),
                       "run": run_info("bench.guided", argv)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
