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

Trained offline on ShareGPT by `python -m bench.length_training`: the held-out split (`HOLDOUT`: the first turns
the CPU benchmark draws first, never trained on) and the figures it reaches are in that module. Loading and predicting
need numpy alone. The file (`save`) holds W in int8 steps of each bucket column's largest magnitude, the bias, the
metadata and the tokenizer's `WordTable`.
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
