"""Step-time model: ``Prefill(n, q) = alpha·n + beta + gamma·q``, never below ``c0`` where the fit found a knee (a
step of at most ``theta`` tokens costs ``c0``: `prefill_time_ms`) and
``ITL(B, L) = a·B·L + b·B + c·L + d``; on an engine that serves LoRA adapters, a decode step whose rows run through
``k >= 1`` of them takes ``e0 + e1·k + e2·B`` more (`LatencyModel.lora_ms`; `Adapters` adds it for the batch running).
A step that prefills beside B decodes (a hybrid step) costs their sum (``mixed`` "sum"), or, where the profile's
hybrid probes say so (a GPU: the decode rows are more tokens of the same forward, whose weights it reads once), the
prefill of its tokens and the decode rows together plus their context's reads, ``Prefill(n + B, q) + a·B·L``
("shared"; `LatencyModel.beside_ms`).

``q`` is the step's attention work in token pairs: the sum over its prompts of ``end² - start²`` (a prompt computed
from position ``start`` to ``end`` attends each new token to all before it), ``n²`` for one fresh prompt of ``n``
tokens, the default. A prompt's attention grows with its square: a model linear in a step's tokens, fitted on single
prompts, under-predicts prompts longer than the profiled ones and over-predicts a round of short prompts, which
costs far less than one prompt of their total (`bench.prefill_model` measures both). Callers that sum several
prompts' tokens pass their ``q`` (`prefill_sq`). A profile may time chunks over a cached prefix too (``q`` then
grows with the prefix at a fixed ``n``), which fixes the attention term where fresh prompts leave it to their noise.

Fitted by non-negative least squares on profiled steps (``profile``) and saved as JSON. A fitted model is
not changed afterwards (``scaled`` returns a copy). Pure numpy; the engine supplies the timings.
"""
from __future__ import annotations

import bisect
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MIN_MS = 0.05  # predictions are clamped to at least this
MIXED_FORMS = ("sum", "shared")  # how a hybrid step's prefill and decode rows add up (`LatencyModel.beside_ms`)


def prefill_time_ms(n: float, q: float, c0: float, theta: float, alpha: float, beta: float, gamma: float) -> float:
    """A prefill step's time over ``n`` tokens of ``q`` token pairs: the line ``alpha·n + beta + gamma·q``, and where
    the fit found a knee (``theta`` > 0: on a GPU a small step costs about a launch-bound ``c0`` whatever its size)
    never below ``c0``. So a step never costs less for more tokens (the line below the knee's ``c0`` just past it
    did), and a short chunk deep in a long prompt keeps its attention (``c0`` alone dropped it). The one formula
    of the replica's model and of the router's copy of it (`deployments.router.view`)."""
    line = alpha * n + beta + gamma * q
    return max(MIN_MS, max(c0, line) if theta > 0 else line)
_FORMAT = 2  # 2: no RLS state


def r2(y: Sequence[float], yhat: Sequence[float]) -> float:
    """Coefficient of determination (1.0 for a perfect fit of constant data)."""
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    ss_res = float(np.sum((y - yhat) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0.0:
        return 1.0 if ss_res < 1e-12 else 0.0
    return 1.0 - ss_res / ss_tot


def mape(y: Sequence[float], yhat: Sequence[float]) -> float:
    """Mean absolute percentage error as a fraction (0.027 = 2.7%)."""
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    return float(np.mean(np.abs(y - yhat) / np.maximum(np.abs(y), 1e-12)))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set: drop the most negative, refit).

    Step time cannot fall as the batch, the context or the prompt grows; on a noisy box a plain fit of
    an overhead-dominated model can come out with a negative slope, which would invert every decision
    made from it (a bigger batch predicted faster than a small one).
    """
    active = list(range(x.shape[1]))
    w = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (sol >= 0).all():
            w[active] = sol
            return w
        active.pop(int(np.argmin(sol)))
    return w


class _Linear:
    """``y = w·x``, fitted in feature coordinates scaled to O(1)."""

    def __init__(self, w: Sequence[float], scale: Sequence[float] | None = None) -> None:
        self.w = np.asarray(w, float)
        self.scale = np.ones(len(self.w)) if scale is None else np.asarray(scale, float)

    @property
    def w(self) -> np.ndarray:
        return self._w

    @w.setter
    def w(self, w: np.ndarray) -> None:
        self._w = np.asarray(w, float)
        self.coef = tuple(float(v) for v in self._w)  # the weights as floats: a scheduler predicts every step

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        self.scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        self.w = _nnls(x / self.scale, y) / self.scale

    def to_dict(self) -> dict[str, Any]:
        return {"w": self.w.tolist(), "scale": self.scale.tolist()}


def prefill_sq(start: int, end: int) -> float:
    """The attention work (token pairs, `LatencyModel.prefill_ms`'s ``q``) of computing a prompt from ``start`` to
    ``end``."""
    return float(end) * end - float(start) * start


def _prefill_w(w: Sequence[float], pad: float = 0.0) -> list[float]:
    """Prefill weights (or their scales) as (alpha, beta, gamma): a fit without the attention term (an older file,
    or two given) has gamma 0."""
    w = [float(v) for v in w]
    return w + [pad] * (3 - len(w))


def _triples(samples: Sequence[tuple[float, ...]]) -> list[tuple[float, float, float]]:
    """Prefill samples as ``(n, q, ms)``: a ``(n, ms)`` one is a fresh prompt (``q = n²``)."""
    return [(float(s[0]), float(s[0]) ** 2, float(s[1])) if len(s) == 2 else (float(s[0]), float(s[1]), float(s[2]))
            for s in samples]


def _deep(n: float, q: float) -> bool:
    """Whether a prefill sample computed its tokens over a cached prefix (more attention than a fresh prompt's)."""
    return q > n * n * (1 + 1e-9)


def _padded(n: float, ladder: Sequence[int]) -> float:
    """The tokens a step of ``n`` runs as where its engine pads such steps to ``ladder``'s counts (up to its last)."""
    if ladder and 0 < n <= ladder[-1]:
        return float(ladder[bisect.bisect_left(ladder, n)])
    return n


def _fit_prefill_line(samples: Sequence[tuple[float, ...]], attention: bool = True,
                      ladder: Sequence[int] = ()) -> "_Linear":
    """``alpha·n + beta (+ gamma·q)`` fitted on prefill samples, ``(n, ms)`` (one fresh prompt each) or
    ``(n, q, ms)`` (non-negative weights); each sample a step of n tokens run as ``ladder`` pads it."""
    line = _Linear([0.0, 0.0, 0.0])
    rows = _triples(samples)
    x = np.array([[_padded(n, ladder), 1.0, q if attention else 0.0] for n, q, _ in rows])
    line.fit(x, np.array([ms for _, _, ms in rows]))
    return line


def _attention_extrapolates(samples: Sequence[tuple[float, ...]], ladder: Sequence[int] = ()) -> bool:
    """Whether the attention term predicts past the profiled prompts better than a line: both are fitted without the
    longest size and judged on it. On a few short sizes the square of n is mostly the noise of a busy box, and a
    fit that bends with it over-predicts the prompts past them; where the steps do grow with the square (a long
    prompt on a small model's CPU kernels), the bent fit wins by far. Chunks timed over a cached prefix fix the term
    by themselves (their attention grows at a fixed n): it is kept."""
    rows = _triples(samples)
    if any(_deep(n, q) for n, q, _ in rows):
        return True
    sizes = sorted({n for n, _, _ in rows})
    if len(sizes) < 4:
        return False
    top = sizes[-1]
    train = [(n, ms) for n, _, ms in rows if n < top]
    measured = float(np.median([ms for n, _, ms in rows if n == top]))

    def miss(line: "_Linear") -> float:
        return abs(float(line.w @ np.array([_padded(top, ladder), 1.0, top * top])) - measured)
    return miss(_fit_prefill_line(train, True, ladder)) < miss(_fit_prefill_line(train, False, ladder))


def _decode_x(batch: float, ctx_len: float) -> list[float]:
    return [batch * ctx_len, float(batch), float(ctx_len), 1.0]


class LatencyModel:
    """Step-time predictor in milliseconds; ``meta`` records model/device/dtype of the fit."""

    def __init__(
        self,
        prefill_coef: Sequence[float] = (0.0, 0.0, 0.0),
        decode_coef: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
        *,
        c0: float = 0.0,
        theta: float = -5.0,
        meta: Mapping[str, Any] | None = None,
        lora_coef: Sequence[float] = (0.0, 0.0, 0.0),
        mixed: str = "sum",
        token_ladder: Sequence[int] = (),
    ) -> None:
        if mixed not in MIXED_FORMS:
            raise ValueError(f"mixed must be one of {MIXED_FORMS}, got {mixed!r}")
        self.mixed = mixed  # how a hybrid step's prefill and decode rows add up (`beside_ms`)
        # the token counts steps with prefill rows are padded to, in order (a GPU's mixed CUDA graphs): a step of up
        # to the last runs as the next count up (its attention as it is: padding rows attend to nothing); read by
        # the predictions of one step (`step_prefill_ms`, `beside_ms`), not by a queue's (`prefill_ms`)
        self.token_ladder = tuple(int(t) for t in token_ladder)
        self.c0 = float(c0)
        self._lora = _Linear(lora_coef)
        self.theta = float(theta)
        self.meta: dict[str, Any] = dict(meta or {})
        self._prefill = _Linear(_prefill_w(prefill_coef))
        self._decode = _Linear(decode_coef)

    @property
    def prefill_coef(self) -> tuple[float, float, float]:
        """(alpha, beta, gamma) of ``alpha·n + beta + gamma·q``."""
        alpha, beta, gamma = self._prefill.w.tolist()
        return alpha, beta, gamma

    @property
    def decode_coef(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) of ``a·B·L + b·B + c·L + d``."""
        a, b, c, d = self._decode.w.tolist()
        return a, b, c, d

    @property
    def lora_coef(self) -> tuple[float, float, float]:
        """(e0, e1, e2) of a decode step's ``e0 + e1·k + e2·B`` more with rows of k >= 1 LoRA adapters."""
        e0, e1, e2 = self._lora.w.tolist()
        return e0, e1, e2

    @property
    def prices_adapters(self) -> bool:
        return any(self._lora.coef)

    def lora_ms(self, adapters: int, batch: float) -> float:
        """What a decode step of `batch` rows takes more where they run through `adapters` LoRA adapters (0: none)."""
        if adapters <= 0:
            return 0.0
        e0, e1, e2 = self._lora.coef
        return e0 + e1 * adapters + e2 * batch

    def fit_lora(self, samples: Sequence[tuple[float, float, float]]) -> LatencyModel:
        """Least squares (non-negative) on ``(B, k, extra ms)``: decode steps of B rows over k >= 1 adapters, less
        the same steps without them."""
        if samples:
            self._lora.fit(np.array([[1.0, float(k), float(b)] for b, k, _ in samples]),
                           np.array([max(0.0, ms) for _, _, ms in samples]))
        return self

    def prefill_ms(self, n: float, q: float | None = None) -> float:
        """Time of a prefill step over ``n`` prompt tokens whose attention work is ``q`` token pairs (`prefill_sq`
        summed over its prompts; default ``n²``: one fresh prompt). The one formula of the router's copy too
        (`prefill_time_ms`): what a queue of prompts takes, summed over steps, reads it."""
        alpha, beta, gamma = self._prefill.coef
        return prefill_time_ms(n, n * n if q is None else q, self.c0, self.theta, alpha, beta, gamma)

    def step_prefill_ms(self, n: float, q: float | None = None) -> float:
        """`prefill_ms` of one step: as many tokens as the engine pads it to (``token_ladder``)."""
        return self.prefill_ms(_padded(n, self.token_ladder), n * n if q is None else q)

    def prefill_params(self) -> tuple[float, float, float, float, float]:
        """(c0, theta, alpha, beta, gamma) of `prefill_time_ms`: what a replica reports for the router's copy."""
        alpha, beta, gamma = self._prefill.coef
        return float(self.c0), float(self.theta), float(alpha), float(beta), float(gamma)

    def itl_ms(self, batch: float, ctx_len: float) -> float:
        """Time of a decode step over ``batch`` sequences of mean context length ``ctx_len``."""
        a, b, c, d = self._decode.coef  # _decode_x's terms, in plain floats (called many times a step)
        return max(MIN_MS, a * batch * ctx_len + b * batch + c * ctx_len + d)

    def beside_ms(self, n: float, q: float | None, batch: float, ctx_len: float) -> float:
        """What a prefill of ``n`` tokens (``q`` token pairs, as `prefill_ms`) adds to a decode step of ``batch`` rows
        at mean context ``ctx_len`` that it runs beside (a hybrid step is this plus `itl_ms`; 0 without tokens):
        "sum", its own prefill step; "shared", the one forward over its tokens and the decode rows with their
        context's reads, less the decode step alone (never below nothing)."""
        if n <= 0:
            return 0.0
        if self.mixed == "sum" or batch <= 0:
            return self.step_prefill_ms(n, q)
        a = self._decode.coef[0]
        q = n * n if q is None else q
        return max(0.0, self.step_prefill_ms(n + batch, q) + a * batch * ctx_len - self.itl_ms(batch, ctx_len))

    def mixed_ms(self, n: float, q: float | None, batch: float, ctx_len: float) -> float:
        """Time of a step that prefills ``n`` tokens (``q`` pairs) beside ``batch`` decodes at mean context
        ``ctx_len``."""
        decode = self.itl_ms(batch, ctx_len) if batch > 0 else 0.0
        return decode + self.beside_ms(n, q, batch, ctx_len)

    def fit_mixed(self, samples: Sequence[tuple[float, float, float, float, float]]) -> dict[str, Any]:
        """Choose how hybrid steps add up (``mixed``) by their error on ``(n, q, B, L, ms)`` samples (hybrid steps
        timed at start): the form of the lower mean absolute percentage error. Returns both errors and the form."""
        if not samples:
            return {}
        errs = {}
        for form in MIXED_FORMS:
            self.mixed = form
            errs[form] = mape([ms for *_, ms in samples], [self.mixed_ms(n, q, b, ln) for n, q, b, ln, _ in samples])
        self.mixed = min(MIXED_FORMS, key=lambda f: errs[f])
        return {"mixed": self.mixed, **{f"mixed_mape_{f}": errs[f] for f in MIXED_FORMS}, "n_mixed": len(samples)}

    def fit_prefill(self, samples: Sequence[tuple[float, ...]], *, find_knee: bool = False) -> LatencyModel:
        """Least squares on ``(n, ms)`` samples, one fresh prompt of n tokens each, or ``(n, q, ms)`` (a chunk over
        a cached prefix: ``q`` its attention's token pairs): ``c0`` = mean over the fresh prompts of ``n <= theta``,
        ``alpha·n + beta + gamma·q`` over the rest. With ``find_knee`` theta is chosen among the fresh sizes (or
        none; three sizes at least above it) for the least squared error: on a GPU a small prefill costs about the
        same as a launch-bound step whatever its size, and only larger ones grow with n."""
        rows = _triples(samples)
        if find_knee:
            sizes = sorted({n for n, q, _ in rows if not _deep(n, q)})
            best = None
            for theta in [-5.0, *sizes[:-3]]:
                trial = LatencyModel(c0=self.c0, theta=theta, token_ladder=self.token_ladder).fit_prefill(rows)
                err = sum((trial.step_prefill_ms(n, q) - ms) ** 2 for n, q, ms in rows)
                if best is None or err < best[0] - 1e-12:
                    best = (err, trial)
            if best is not None:
                self.theta, self.c0, self._prefill = best[1].theta, best[1].c0, best[1]._prefill
            return self
        low = [ms for n, q, ms in rows if n <= self.theta and not _deep(n, q)]
        high = [(n, q, ms) for n, q, ms in rows if n > self.theta or _deep(n, q)]
        if low:
            self.c0 = float(np.mean(low))
        if high:
            ladder = self.token_ladder
            self._prefill = _fit_prefill_line(high, _attention_extrapolates(high, ladder), ladder)
        return self

    def fit_decode(self, samples: Sequence[tuple[float, float, float]]) -> LatencyModel:
        """Least squares on ``(B, L, ms)`` decode-step samples."""
        if samples:
            x = np.array([_decode_x(b, n) for b, n, _ in samples])
            self._decode.fit(x, np.array([ms for _, _, ms in samples]))
        return self

    def scaled(self, decode: float = 1.0, prefill: float = 1.0) -> LatencyModel:
        """A copy whose decode and prefill step times are multiplied by these factors (a calibration)."""
        model = LatencyModel.from_json(self.to_json())
        model._decode.w = model._decode.w * decode
        model._lora.w = model._lora.w * decode
        model._prefill.w = model._prefill.w * prefill
        model.c0 *= prefill
        return model

    def score_prefill(self, samples: Sequence[tuple[float, ...]]) -> dict[str, float]:
        rows = _triples(samples)
        y = [ms for _, _, ms in rows]
        yhat = [self.step_prefill_ms(n, q) for n, q, _ in rows]  # (each sample one step)
        return {"r2": r2(y, yhat), "mape": mape(y, yhat)}

    def score_decode(self, samples: Sequence[tuple[float, float, float]]) -> dict[str, float]:
        y = [ms for _, _, ms in samples]
        yhat = [self.itl_ms(b, n) for b, n, _ in samples]
        return {"r2": r2(y, yhat), "mape": mape(y, yhat)}

    def matches(self, meta: Mapping[str, Any]) -> bool:
        """Whether this fit was made for ``meta`` (every given key equal, e.g. model/device/dtype)."""
        return all(self.meta.get(k) == v for k, v in meta.items())

    def to_json(self) -> str:
        return json.dumps({
            "format": _FORMAT, "meta": self.meta, "theta": self.theta, "c0": self.c0,
            "prefill": self._prefill.to_dict(), "decode": self._decode.to_dict(), "lora": self._lora.to_dict(),
            "mixed": self.mixed, "token_ladder": list(self.token_ladder),
        })

    @classmethod
    def from_json(cls, text: str) -> LatencyModel:
        d = json.loads(text)
        if d.get("format") != _FORMAT:
            raise ValueError(f"unsupported latency-model format {d.get('format')!r}")
        model = cls(c0=d["c0"], theta=d["theta"], meta=d["meta"], mixed=d.get("mixed", "sum"),
                    token_ladder=d.get("token_ladder", ()))
        model._prefill = _Linear(_prefill_w(d["prefill"]["w"]), _prefill_w(d["prefill"]["scale"], 1.0))
        model._decode = _Linear(d["decode"]["w"], d["decode"]["scale"])
        if "lora" in d:  # (a fit for an engine that serves adapters)
            model._lora = _Linear(d["lora"]["w"], d["lora"]["scale"])
        return model

    def save(self, path: str | Path) -> None:
        """Written whole or not at all: a private file renamed over `path`, so that a process that reads it while
        another writes it (replicas of one host profiling the same setup at once) reads a whole model."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(self.to_json())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        return cls.from_json(Path(path).read_text())


class Adapters:
    """A latency model whose decode steps carry the LoRA adapters of the batch running now (`adapters`, which the
    scheduler sets as the batch changes): ``itl_ms(B, L)`` is the model's plus its `lora_ms` of them. Everything
    else is the model's."""

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self.adapters = 0

    def itl_ms(self, batch: float, ctx_len: float) -> float:
        return self.model.itl_ms(batch, ctx_len) + self.model.lora_ms(self.adapters, batch)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self.model, name)


def cell_medians(samples: Sequence[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """One sample per distinct input (all fields but the last): the median of its measured times."""
    cells: dict[tuple[float, ...], list[float]] = {}
    for *key, ms in samples:
        cells.setdefault(tuple(key), []).append(ms)
    return [(*key, float(np.median(v))) for key, v in cells.items()]


def profile(
    run_prefill: Callable[[int], float],
    run_decode: Callable[[int, int], float],
    *,
    prefill_sizes: Sequence[int],
    batch_sizes: Sequence[int],
    ctx_lens: Sequence[int],
    repeats: int = 3,
    time_budget_s: float = 60.0,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    grid: Sequence[tuple[int, int]] | None = None,
    find_knee: bool = False,
    run_chunk: Callable[[int, int], float] | None = None,
    chunks: Sequence[tuple[int, int]] = (),
    run_mixed: Callable[[int, int, int], float] | None = None,
    mixed: Sequence[tuple[int, int, int]] = (),
    token_ladder: Sequence[int] = (),
) -> tuple[LatencyModel, dict[str, Any]]:
    """Measure prefill and decode steps through the engine's callables (which return ms) and fit.

    Each repeat interleaves prefill sizes with the (B, L) grid in a seeded shuffled order, so a
    budget cut leaves both kinds of sample and holding out every 4th decode sample does not alias
    with the grid (`grid`, a sample of (B, L) pairs, replaces the full product; `find_knee`: see `fit_prefill`).
    `chunks`: ``(n, start)`` prompt chunks computed over a cached prefix (`run_chunk`), prefill samples whose
    attention grows at a fixed n; `mixed`: ``(n, B, L)`` hybrid steps, a fresh prompt of n tokens beside B decodes
    at mean context L (`run_mixed`), which choose how such steps add up (`LatencyModel.fit_mixed`); both are
    spread among the others, each repeat. No sample is started once ``time_budget_s`` has elapsed; the fit uses
    whatever was measured. The decode fit excludes the held-out samples, which give ``mape_holdout``.
    `token_ladder`: the token counts the engine pads steps with prefill rows to (`LatencyModel.token_ladder`).
    """
    rng = np.random.default_rng(seed)
    grid = list(grid) if grid is not None else [(b, n) for b in batch_sizes for n in ctx_lens]
    extra = [("chunk", c) for c in (chunks if run_chunk is not None else ())] \
        + [("mixed", m) for m in (mixed if run_mixed is not None else ())]
    prefill: list[tuple[float, float, float]] = []
    decode: list[tuple[float, float, float]] = []
    hybrid: list[tuple[float, float, float, float, float]] = []
    start = clock()
    exhausted = False
    for _ in range(repeats):
        shuffled = [("decode", grid[i]) for i in rng.permutation(len(grid))]
        tasks = [t for t in itertools.chain.from_iterable(itertools.zip_longest(
            [("prefill", n) for n in prefill_sizes], shuffled)) if t is not None]
        if extra:  # (one among every few of the others)
            pending = [extra[i] for i in rng.permutation(len(extra))]
            every = max(1, len(tasks) // len(pending))
            merged = []
            for i, t in enumerate(tasks):
                merged.append(t)
                if pending and i % every == every - 1:
                    merged.append(pending.pop())
            tasks = merged + pending
        for kind, task in tasks:
            if clock() - start >= time_budget_s:
                exhausted = True
                break
            if kind == "decode":
                decode.append((task[0], task[1], float(run_decode(*task))))
            elif kind == "prefill":
                prefill.append((task, float(task) * task, float(run_prefill(task))))
            elif kind == "chunk":
                n, at = task
                prefill.append((n, prefill_sq(at, at + n), float(run_chunk(n, at))))  # type: ignore[misc]
            else:
                n, b, ln = task
                hybrid.append((n, float(n) * n, b, ln, float(run_mixed(n, b, ln))))  # type: ignore[misc]
        if exhausted:
            break
    train = [s for i, s in enumerate(decode) if i % 4 != 3]
    holdout = [s for i, s in enumerate(decode) if i % 4 == 3]
    model = LatencyModel(token_ladder=token_ladder).fit_prefill(cell_medians(prefill), find_knee=find_knee) \
        .fit_decode(cell_medians(train))
    fit = model.score_decode(train) if train else {"r2": None, "mape": None}
    prefill_fit = model.score_prefill(prefill) if prefill else {"r2": None, "mape": None}
    mixed_fit = model.fit_mixed(cell_medians(hybrid)) if hybrid else {}
    report = {
        "r2": fit["r2"],
        "mape_train": fit["mape"],
        "mape_holdout": model.score_decode(holdout)["mape"] if holdout else None,
        "prefill_r2": prefill_fit["r2"],
        "prefill_mape": prefill_fit["mape"],
        "n_samples": len(prefill) + len(decode),
        "n_prefill": len(prefill),
        "n_decode": len(decode),
        "n_holdout": len(holdout),
        "seconds": clock() - start,
        "budget_exhausted": exhausted,
        **({"n_chunk": sum(_deep(n, q) for n, q, _ in prefill)} if extra else {}),
        **mixed_fit,
    }
    return model, report
