"""Step-time model: ``Prefill(n, q) = alpha·n + beta + gamma·q``, never below ``c0`` where the fit found a knee (a
step of at most ``theta`` tokens costs ``c0``: `prefill_time_ms`) and
``ITL(B, L) = a·B·L + b·B + c·L + d``; on an engine that serves LoRA adapters, a decode step whose rows run through
``k >= 1`` of them takes ``e0 + e1·k + e2·B`` more (`LatencyModel.lora_ms`; `Adapters` adds it for the batch running).

``q`` is the step's attention work in token pairs: the sum over its prompts of ``end² - start²`` (a prompt computed
from position ``start`` to ``end`` attends each new token to all before it), ``n²`` for one fresh prompt of ``n``
tokens, the default. A prompt's attention grows with its square: a model linear in a step's tokens, fitted on single
prompts, under-predicts prompts longer than the profiled ones and over-predicts a round of short prompts, which
costs far less than one prompt of their total (`bench.prefill_model` measures both). Callers that sum several
prompts' tokens pass their ``q`` (`prefill_sq`).

Fitted by non-negative least squares on profiled steps (``profile``) and saved as JSON. A fitted model is
not changed afterwards (``scaled`` returns a copy). Pure numpy; the engine supplies the timings.
"""
from __future__ import annotations

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


def _prefill_x(n: float) -> list[float]:
    return [float(n), 1.0, float(n) * float(n)]


def prefill_sq(start: int, end: int) -> float:
    """The attention work (token pairs, `LatencyModel.prefill_ms`'s ``q``) of computing a prompt from ``start`` to
    ``end``."""
    return float(end) * end - float(start) * start


def _prefill_w(w: Sequence[float], pad: float = 0.0) -> list[float]:
    """Prefill weights (or their scales) as (alpha, beta, gamma): a fit without the attention term (an older file,
    or two given) has gamma 0."""
    w = [float(v) for v in w]
    return w + [pad] * (3 - len(w))


def _fit_prefill_line(samples: Sequence[tuple[float, float]], attention: bool = True) -> "_Linear":
    """``alpha·n + beta (+ gamma·n²)`` fitted on single-prompt ``(n, ms)`` samples (non-negative weights)."""
    line = _Linear([0.0, 0.0, 0.0])
    x = np.array([_prefill_x(n) if attention else [float(n), 1.0, 0.0] for n, _ in samples])
    line.fit(x, np.array([ms for _, ms in samples]))
    return line


def _attention_extrapolates(samples: Sequence[tuple[float, float]]) -> bool:
    """Whether the attention term predicts past the profiled prompts better than a line: both are fitted without the
    longest size and judged on it. On a few short sizes the square of n is mostly the noise of a busy box, and a
    fit that bends with it over-predicts the prompts past them; where the steps do grow with the square (a long
    prompt on a small model's CPU kernels), the bent fit wins by far."""
    sizes = sorted({n for n, _ in samples})
    if len(sizes) < 4:
        return False
    top = sizes[-1]
    train = [(n, ms) for n, ms in samples if n < top]
    held = [ms for n, ms in samples if n == top]
    measured = float(np.median(held))

    def miss(line: "_Linear") -> float:
        return abs(float(line.w @ np.array(_prefill_x(top))) - measured)
    return miss(_fit_prefill_line(train, True)) < miss(_fit_prefill_line(train, False))


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
    ) -> None:
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
        summed over its prompts; default ``n²``: one fresh prompt)."""
        alpha, beta, gamma = self._prefill.coef
        return prefill_time_ms(n, n * n if q is None else q, self.c0, self.theta, alpha, beta, gamma)

    def prefill_params(self) -> tuple[float, float, float, float, float]:
        """(c0, theta, alpha, beta, gamma) of `prefill_time_ms`: what a replica reports for the router's copy."""
        alpha, beta, gamma = self._prefill.coef
        return float(self.c0), float(self.theta), float(alpha), float(beta), float(gamma)

    def itl_ms(self, batch: float, ctx_len: float) -> float:
        """Time of a decode step over ``batch`` sequences of mean context length ``ctx_len``."""
        a, b, c, d = self._decode.coef  # _decode_x's terms, in plain floats (called many times a step)
        return max(MIN_MS, a * batch * ctx_len + b * batch + c * ctx_len + d)

    def fit_prefill(self, samples: Sequence[tuple[float, float]], *, find_knee: bool = False) -> LatencyModel:
        """Least squares on ``(n, ms)``, one fresh prompt of n tokens each: ``c0`` = mean over ``n <= theta``,
        ``alpha·n + beta + gamma·n²`` over the rest. With ``find_knee`` theta is chosen among the sampled sizes (or
        none; three sizes at least above it) for the least squared error: on a GPU a small prefill costs about the
        same as a launch-bound step whatever its size, and only larger ones grow with n."""
        if find_knee:
            sizes = sorted({n for n, _ in samples})
            best = None
            for theta in [-5.0, *sizes[:-3]]:
                trial = LatencyModel(c0=self.c0, theta=theta).fit_prefill(samples)
                err = sum((trial.prefill_ms(n) - ms) ** 2 for n, ms in samples)
                if best is None or err < best[0] - 1e-12:
                    best = (err, trial)
            if best is not None:
                self.theta, self.c0, self._prefill = best[1].theta, best[1].c0, best[1]._prefill
            return self
        low = [ms for n, ms in samples if n <= self.theta]
        high = [(n, ms) for n, ms in samples if n > self.theta]
        if low:
            self.c0 = float(np.mean(low))
        if high:
            self._prefill = _fit_prefill_line(high, attention=_attention_extrapolates(high))
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

    def score_prefill(self, samples: Sequence[tuple[float, float]]) -> dict[str, float]:
        y = [ms for _, ms in samples]
        yhat = [self.prefill_ms(n) for n, _ in samples]
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
        })

    @classmethod
    def from_json(cls, text: str) -> LatencyModel:
        d = json.loads(text)
        if d.get("format") != _FORMAT:
            raise ValueError(f"unsupported latency-model format {d.get('format')!r}")
        model = cls(c0=d["c0"], theta=d["theta"], meta=d["meta"])
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
) -> tuple[LatencyModel, dict[str, Any]]:
    """Measure prefill and decode steps through the engine's callables (which return ms) and fit.

    Each repeat interleaves prefill sizes with the (B, L) grid in a seeded shuffled order, so a
    budget cut leaves both kinds of sample and holding out every 4th decode sample does not alias
    with the grid (`grid`, a sample of (B, L) pairs, replaces the full product; `find_knee`: see `fit_prefill`). No sample is started once ``time_budget_s`` has elapsed; the fit uses whatever
    was measured. The decode fit excludes the held-out samples, which give ``mape_holdout``.
    """
    rng = np.random.default_rng(seed)
    grid = list(grid) if grid is not None else [(b, n) for b in batch_sizes for n in ctx_lens]
    prefill: list[tuple[float, float]] = []
    decode: list[tuple[float, float, float]] = []
    start = clock()
    exhausted = False
    for _ in range(repeats):
        shuffled = [grid[i] for i in rng.permutation(len(grid))]
        for task in itertools.chain.from_iterable(itertools.zip_longest(prefill_sizes, shuffled)):
            if task is None:
                continue
            if clock() - start >= time_budget_s:
                exhausted = True
                break
            if isinstance(task, tuple):
                decode.append((task[0], task[1], float(run_decode(*task))))
            else:
                prefill.append((task, float(run_prefill(task))))
        if exhausted:
            break
    train = [s for i, s in enumerate(decode) if i % 4 != 3]
    holdout = [s for i, s in enumerate(decode) if i % 4 == 3]
    model = LatencyModel().fit_prefill(cell_medians(prefill), find_knee=find_knee).fit_decode(cell_medians(train))
    fit = model.score_decode(train) if train else {"r2": None, "mape": None}
    prefill_fit = model.score_prefill(prefill) if prefill else {"r2": None, "mape": None}
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
    }
    return model, report
