"""TTFT Guard (SCORPIO's ``rej``): find waiting requests whose TTFT SLO can no longer be met."""
from __future__ import annotations

import math
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
