"""TTFT Guard (SCORPIO's ``rej``): find waiting requests whose TTFT SLO can no longer be met."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def find_ttft_unattainable(
    waiting: Sequence[T],
    now_s: float,
    prefill_ms: Callable[[int], float],
    margin_ms: float,
    cost: Callable[[T], int],
    base_ms: float = 0.0,
) -> list[T]:
    """Return the requests (in queue order) that would miss their TTFT deadline.

    Walk the queue accumulating prompt tokens ``cum``; request r is unattainable iff it has a TTFT
    SLO and ``(r.deadline_s - now_s) * 1000 < base_ms + prefill_ms(cum) + margin_ms``, in which case
    its tokens are taken back out of ``cum`` (it will not be served ahead of the rest). Requests
    without a TTFT SLO are never returned but their tokens count. ``base_ms`` is delay already
    known to come first (e.g. the rest of the current step).
    """
    out: list[T] = []
    cum = 0
    for req in waiting:
        c = cost(req)
        cum += c
        deadline = req.deadline_s
        if math.isfinite(deadline) and (deadline - now_s) * 1000.0 < base_ms + prefill_ms(cum) + margin_ms:
            out.append(req)
            cum -= c
    return out


def idle_slo_floor(
    prefill_ms: Callable[[int], float],
    itl_ms: Callable[[float, float], float],
    prompt_tokens: int,
    mid_len: float,
    ttft_margin_ms: float,
    vbs_margin: float,
    vbs_slack: float,
) -> tuple[float, float]:
    """The strictest TTFT and TPOT SLOs (ms) an idle replica's guards would accept for one request, by the latency
    model: the TTFT guard keeps a request iff its TTFT SLO >= its prefill alone + ``ttft_margin_ms``; the VBS gate
    admits it alone iff ``itl(1, L) * vbs_margin < vbs_slack * TPOT`` (``L = mid_len``, its context mid-reply), so
    any TPOT SLO above the returned bound passes. An SLO stricter than these is refused whatever the load
    (`Scheduler._for_capacity` draws the same line): the replica answers it as `slo_unattainable`, not busy."""
    best_ttft = prefill_ms(prompt_tokens) + ttft_margin_ms
    best_tpot = itl_ms(1.0, mid_len) * vbs_margin / vbs_slack
    return best_ttft, best_tpot


class MeasuredMargin:
    """kairos's TTFT margin, measured on the replica's own admissions instead of SCORPIO's fixed 50 ms.

    The TTFT guard keeps a waiting request while ``prefill_ms(cum) + margin`` still fits before its deadline; the
    margin has to cover what that prefill estimate leaves out of a request's time from admission to first token:
    the decodes riding in its step (hybrid steps), the step still in flight ahead of it (overlap scheduling),
    sampling and the model's own error. A fixed margin is the wrong size on both machines: a CPU step is a few ms,
    so 50 ms turned away interactive requests that could still have waited most of their SLO; a GPU step with
    hundreds of decodes is tens of ms, more than a fixed margin may hold. Each request admitted fresh records its
    error, ``(first token - admission) - predicted prefill`` of its round up to it (`observe`); the margin is the
    ``quantile`` of the last ``window`` errors (`margin_ms`), and the configured margin until ``min_samples`` are in.
    """

    def __init__(self, default_ms: float, quantile: float = 0.99, window: int = 256, min_samples: int = 32) -> None:
        if default_ms < 0 or not 0 < quantile <= 1 or not 1 <= min_samples <= window:
            raise ValueError("need default_ms >= 0, 0 < quantile <= 1 and 1 <= min_samples <= window")
        self.default_ms, self.quantile, self.min_samples = default_ms, quantile, min_samples
        self._errs: deque[float] = deque(maxlen=window)
        self._cached: float | None = None

    def observe(self, err_ms: float) -> None:
        """One request's admission-to-first-token time less the prefill the guard predicted for it (ms)."""
        self._errs.append(max(float(err_ms), 0.0))
        self._cached = None

    def margin_ms(self) -> float:
        if len(self._errs) < self.min_samples:
            return self.default_ms
        if self._cached is None:
            errs = sorted(self._errs)
            self._cached = errs[min(len(errs) - 1, math.ceil(self.quantile * len(errs)) - 1)]
        return self._cached
