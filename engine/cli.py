"""Stream one completion from the in-process engine: `python -m engine.cli --prompt "Hello"`."""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="kairos-default", help="kairos-default | kairos-random-42m | kairos-tiny | HF dir or hub id")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt", default="Hello, Kairos!")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from core.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        final = None
        for out in eng.add_request(args.prompt, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            final = out
        m = final.metrics
        print(f"\n[{final.finish_reason}] {final.num_output_tokens} tokens, TTFT {m.ttft_s * 1e3:.1f} ms, "
              f"TPOT {(m.tpot_s or 0) * 1e3:.1f} ms", file=sys.stderr)
    finally:
        eng.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
