"""TTFT Guard (SCORPIO's ``rej``): find waiting requests whose TTFT SLO can no longer be met."""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def find_ttft_unattainable(
    waiting: Sequence[T],
    now_s: float,
    prefill_ms: Callable[..., float],
    margin_ms: float | Callable[[float], float],
    cost: Callable[[T], int],
    base_ms: float = 0.0,
    cost_sq: Callable[[T], float] | None = None,
    kept: Callable[[T], bool] | None = None,
) -> list[T]:
    """Return the requests (in queue order) that would miss their TTFT deadline.

    Walk the queue accumulating prompt tokens ``cum``; request r is unattainable iff it has a TTFT
    SLO and ``(r.deadline_s - now_s) * 1000 < base_ms + prefill_ms(cum) + margin_ms``, in which case
    its tokens are taken back out of ``cum`` (it will not be served ahead of the rest). Requests
    without a TTFT SLO are never returned but their tokens count. ``base_ms`` is delay already
    known to come first (e.g. the rest of the current step). ``margin_ms``: a number, or the margin for a
    predicted prefill (`MeasuredMargin.margin_ms`), given ``prefill_ms(cum)``. With ``cost_sq`` (a request's
    attention work in token pairs, `predictor.prefill_sq`) the prefill is ``prefill_ms(cum, cum_sq)``. Requests
    ``kept`` says of (a preempted reply's recompute, a prompt in progress) are never returned but their tokens count.
    """
    out: list[T] = []
    cum, cum_sq = 0, 0.0
    margin = margin_ms if callable(margin_ms) else None
    for req in waiting:
        c = cost(req)
        q = cost_sq(req) if cost_sq is not None else 0.0
        cum += c
        cum_sq += q
        deadline = req.deadline_s
        if math.isfinite(deadline) and (kept is None or not kept(req)):
            p = prefill_ms(cum, cum_sq) if cost_sq is not None else prefill_ms(cum)
            if (deadline - now_s) * 1000.0 < base_ms + p + (margin(p) if margin is not None else margin_ms):
                out.append(req)
                cum -= c
                cum_sq -= q
    return out


def idle_slo_floor(
    prefill_ms: Callable[[int], float],
    itl_ms: Callable[[float, float], float],
    prompt_tokens: int,
    mid_len: float,
    ttft_margin_ms: float,
    vbs_margin: float,
    vbs_slack: float,
    gate_scale: float = 1.0,
) -> tuple[float, float]:
    """The strictest TTFT and TPOT SLOs (ms) an idle replica's guards would accept for one request, by the latency
    model: the TTFT guard keeps a request iff its TTFT SLO >= its prefill alone + ``ttft_margin_ms``; the VBS gate
    admits it alone iff ``itl(1, L) * gate_scale * vbs_margin < vbs_slack * TPOT`` (``L = mid_len``, its context
    mid-reply; ``gate_scale``, what the replica's steps measured, `Scheduler.offer_gate_scale` or
    `judge_gate_scale`), so any TPOT SLO above the returned bound passes. An SLO stricter than these is refused
    whatever the load (`Scheduler._for_capacity` draws the same line): the replica answers it as `slo_unattainable`,
    not busy."""
    best_ttft = prefill_ms(prompt_tokens) + ttft_margin_ms
    best_tpot = itl_ms(1.0, mid_len) * gate_scale * vbs_margin / vbs_slack
    return best_ttft, best_tpot


def idle_margin_at(idle_table: "MarginTable", table: "MarginTable", prefill_ms: float, default_ms: float) -> float:
    """The TTFT guard's margin on a replica with nothing running, for a request of predicted prefill `prefill_ms`:
    from the admissions made alone (`MeasuredMargin.table(idle=True)`) where enough are measured, else the margin
    of all of them but at most the configured one (`default_ms`): what a margin measured under load covers, the
    queue of prefills, the decodes riding in a request's step and the step in flight ahead of it, is not there,
    and a burst's errors would otherwise refuse an idle replica's requests, as `slo_unattainable` too (the idle
    floor, `idle_slo_floor`, is drawn with this margin)."""
    if idle_table:
        return margin_at(idle_table, prefill_ms, default_ms)
    return min(margin_at(table, prefill_ms, default_ms), default_ms)


MarginTable = tuple[tuple[float, float], ...]  # (bound ms, margin ms) rows, bounds ascending: `MeasuredMargin.table`


def _bucket(prefill_ms: float) -> int:
    """The least k >= 0 with 2 ** k ms >= `prefill_ms`."""
    return 0 if prefill_ms <= 1.0 else math.ceil(math.log2(prefill_ms))


def margin_at(table: MarginTable, prefill_ms: float, default_ms: float) -> float:
    """The margin `table` gives a request whose predicted prefill is `prefill_ms`: the first row whose bound is at
    least that, else the last row; `default_ms` for an empty table (too few admissions measured)."""
    if not table:
        return default_ms
    for bound, margin in table:
        if prefill_ms <= bound:
            return margin
    return table[-1][1]


LONE_STALL = 4.0  # an error this many times the next largest (and the configured margin) is a lone stall (below)


def _lone_stall(largest: tuple[float, float], next_ms: float, default_ms: float, typical_ms: float) -> bool:
    """Whether the largest error of a row, (error, its predicted prefill), stands alone far above the rest on a
    prompt of the row's typical size (its prediction at most twice the row's median, `typical_ms`): a stall of the
    host (a garbage collection, a kernel compile). The model's error on a prompt far longer than the rest is not
    one: that one sets the margin of prompts as long."""
    err, predicted = largest
    return err > LONE_STALL * max(next_ms, default_ms) and predicted <= 2.0 * typical_ms


class MeasuredMargin:
    """kairos's TTFT margin, measured on the replica's own admissions instead of SCORPIO's fixed 50 ms.

    The TTFT guard keeps a waiting request while ``prefill_ms(cum) + margin`` still fits before its deadline; the
    margin has to cover what that prefill estimate leaves out of a request's time from admission to first token:
    the decodes riding in its step (hybrid steps), the step still in flight ahead of it (overlap scheduling),
    sampling and the model's own error. A fixed margin is the wrong size on both machines: a CPU step is a few ms,
    so 50 ms turned away interactive requests that could still have waited most of their SLO; a GPU step with
    hundreds of decodes is tens of ms, more than a fixed margin may hold. Each request admitted fresh records its
    error, ``(first token - admission) - predicted prefill`` of its round up to it, with that prediction
    (`observe`); the margin is the ``quantile`` of the errors of the last ``window`` admissions, and the configured
    margin until ``min_samples`` are in.

    The model's error grows with the prefill: a prompt far longer than the profiled ones is extrapolated to, and
    its attention grows with its square. So a request's margin is measured on admissions of about its size or
    smaller (`margin_ms(prefill_ms)`): those whose predicted prefill was at most twice the power of two (in ms) at
    or above its own, and at least ``min_samples`` of them, the smallest predicted first. One long prompt whose
    prefill took seconds more than predicted raises the margin of prompts as long, and no longer that of every
    short request for the next ``window`` admissions (which then all missed a TTFT SLO of a few seconds). With just
    ``min_samples`` admissions measured every row pools them all, and a row of fewer than 1 / (1 - quantile) errors
    takes its largest: the first admissions after start-up count fully until more come; but not a lone stall
    (`_lone_stall`: far above the next largest error, on a prompt of the row's typical size): one collection or
    compile made the margin its length, which turned every request of a shorter TTFT SLO away until it aged out;
    a tail of several large errors still sets it.

    Errors also age out: those older than ``window_s`` (`expire`) no longer count. Under a burst the errors are the
    burst's (a queue of prefills, decodes riding in every step, on a CPU the HTTP work on the same cores); on the
    idle replica after it they would have turned away, for the next ``window`` admissions, requests an idle replica
    serves well within their SLO, and as `slo_unattainable` (the idle floor reads the same margin).
    """

    def __init__(self, default_ms: float, quantile: float = 0.99, window: int = 256, min_samples: int = 32,
                 window_s: float = math.inf) -> None:
        if default_ms < 0 or not 0 < quantile <= 1 or not 1 <= min_samples <= window or not window_s > 0:
            raise ValueError("need default_ms >= 0, 0 < quantile <= 1, 1 <= min_samples <= window and window_s > 0")
        self.default_ms, self.quantile, self.min_samples, self.window_s = default_ms, quantile, min_samples, window_s
        # (predicted prefill ms, error ms, when observed, admitted alone), oldest first
        self._obs: deque[tuple[float, float, float, bool]] = deque(maxlen=window)
        self._tables: dict[bool, MarginTable] = {}  # built on demand (idle: the admissions made alone)
        self._typical = 0.0  # the median predicted prefill of the window (with the table)

    def observe(self, err_ms: float, predicted_ms: float = 0.0, now_s: float = 0.0, alone: bool = False) -> None:
        """One request's admission-to-first-token time less the prefill the guard predicted for it, `predicted_ms`,
        observed at `now_s`; `alone`: it was admitted first in its round with nothing running."""
        self._obs.append((max(float(predicted_ms), 0.0), max(float(err_ms), 0.0), now_s, alone))
        self._tables.clear()

    def expire(self, now_s: float) -> None:
        """Forget the errors observed more than ``window_s`` before `now_s`."""
        while self._obs and now_s - self._obs[0][2] > self.window_s:
            self._obs.popleft()
            self._tables.clear()

    def table(self, idle: bool = False) -> MarginTable:
        """The margins by predicted prefill (`margin_at` reads them): a row per power of two from the smallest
        prediction's to the largest's, each the ``quantile`` of the errors `margin_ms` describes. Empty while fewer
        than ``min_samples`` admissions are measured. `idle`: of the admissions made alone only."""
        got = self._tables.get(idle)
        if got is None:
            got = self._tables[idle] = self._build(idle)
        return got

    def _build(self, idle: bool) -> MarginTable:
        obs = sorted((p, e) for p, e, _, alone in self._obs if alone or not idle)  # by predicted prefill
        n = len(obs)
        if n < self.min_samples:
            return ()
        if not idle:
            self._typical = obs[n // 2][0]
        errs: list[tuple[float, float]] = []  # (error, predicted prefill), by error
        rows: list[tuple[float, float]] = []
        i, k, top = 0, _bucket(obs[0][0]), _bucket(obs[-1][0])
        while True:
            limit = 2.0 ** (k + 1)  # twice the row's bound
            while i < n and (obs[i][0] <= limit or i < self.min_samples):
                bisect.insort(errs, (obs[i][1], obs[i][0]))
                i += 1
            j = min(len(errs) - 1, math.ceil(self.quantile * len(errs)) - 1)
            typical = obs[(i - 1) // 2][0]  # the row's median predicted prefill (obs are sorted by it)
            if j == len(errs) - 1 and j > 0 and _lone_stall(errs[j], errs[j - 1][0], self.default_ms, typical):
                j -= 1  # a lone stall (a collection, a compile) in a row too short for its quantile: not the margin
            rows.append((2.0 ** k, errs[j][0]))
            if k >= top:
                return tuple(rows)
            k += 1

    def margin_ms(self, prefill_ms: float | None = None, idle: bool = False) -> float:
        """The margin for a request whose predicted prefill (its round's, up to it) is `prefill_ms`; None: for a
        typical one (the median prediction measured), as a replica reports it. `idle`: on a replica with nothing
        running (`idle_margin_at`)."""
        table = self.table()
        p = self._typical if prefill_ms is None else prefill_ms
        return idle_margin_at(self.table(idle=True), table, p, self.default_ms) if idle \
            else margin_at(table, p, self.default_ms)
