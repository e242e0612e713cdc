"""Room for the impatient (`impatient_reserve`, kairos's with length information): a request that can wait for room
leaves some for one that cannot.

Why. Heterogeneous TTFT SLOs differ by an order of magnitude or more (SCORPIO's tiers: u, 6u, 30u). Under
overload the batch is full most of the time and room appears one finished reply at a time. A request whose TTFT
SLO is shorter than the time between two finished replies cannot wait for room: if the batch is full when it
arrives it is lost, while a request with seconds of TTFT slack would have been served a little later anyway.
Admitting the patient requests into every bit of room as soon as it appears (what every gate does) loses the
impatient ones at random.

What. The replica measures how often a running request finishes (`patience_ms`: the mean time between finishes
over `window_s`): a request is *impatient* while its TTFT SLO is shorter than that, *patient* while its TTFT
deadline is further away than that (a patient request whose deadline draws near becomes impatient, so it is never
kept waiting past its SLO by this). Over the same window the reserve remembers the impatient arrivals; `room`
is a typical one of those an idle replica could serve (the median TPOT SLO, the mean context length mid-reply):
one whose TPOT SLO fails the gate even alone is rejected whatever room is kept. The scheduler admits a patient
fresh request only if the VBS gate would still pass that typical impatient request after it (`VBSGate.leaves_room`);
otherwise it waits in the queue (short_first orders it by work there). Without impatient arrivals, or where
requests finish faster than any TTFT SLO runs out (a GPU replica with a large batch), nothing is reserved.

The same measure orders the waiting queue (`urgent_first`): when room opens, the requests whose TTFT deadline comes
before the next room is expected take it before those that can wait for a later one.

Pure bookkeeping over floats; the scheduler calls `arrived`, `finished`, `patience_ms` and `room`.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable


class ImpatientReserve:
    def __init__(self, window_s: float = 10.0, min_finished: int = 8, max_events: int = 1024) -> None:
        if window_s <= 0 or min_finished < 1 or max_events < min_finished:
            raise ValueError("need window_s > 0 and 1 <= min_finished <= max_events")
        self.window_s, self.min_finished = window_s, min_finished
        self._finished: deque[float] = deque(maxlen=max_events)
        # (arrival s, TTFT SLO ms, TPOT SLO ms, context length mid-reply) of arrivals with both SLOs
        self._arrivals: deque[tuple[float, float, float, float]] = deque(maxlen=max_events)

    def arrived(self, now_s: float, ttft_ms: float, tpot_ms: float, mid_len: float) -> None:
        """A request arrived with these SLOs (an infinite one: it never needs room at once, and is not kept)."""
        if math.isfinite(ttft_ms) and math.isfinite(tpot_ms):
            self._arrivals.append((now_s, ttft_ms, tpot_ms, mid_len))

    def finished(self, now_s: float) -> None:
        """A request that had been running ended (room appeared)."""
        self._finished.append(now_s)

    def _expire(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._finished and self._finished[0] < horizon:
            self._finished.popleft()
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._arrivals.popleft()

    def patience_ms(self, now_s: float) -> float | None:
        """The mean time between finishes over the window (ms); None before `min_finished` of them."""
        self._expire(now_s)
        if len(self._finished) < self.min_finished:
            return None
        span_s = now_s - max(self._finished[0], now_s - self.window_s)
        return 1000.0 * max(span_s, 1e-6) / len(self._finished)

    def room(self, now_s: float, patience: float | None = None,
             feasible: Callable[[float, float], bool] | None = None) -> tuple[float, float] | None:
        """(TPOT SLO ms, mid-reply context) of a typical impatient arrival of the window, None if none (or no
        measure of patience yet). `patience`: `patience_ms(now_s)` where the caller has it already. `feasible(tpot,
        mid)`: whether such a request could be served at all (on an idle replica); those that cannot are rejected
        whatever room is kept, so they are not the typical arrival room is kept for."""
        if patience is None:
            patience = self.patience_ms(now_s)
        if patience is None:
            return None
        imp = [(tpot, mid) for _, ttft, tpot, mid in self._arrivals
               if ttft < patience and (feasible is None or feasible(tpot, mid))]
        if not imp:
            return None
        tpots = sorted([t for t, _ in imp])
        return tpots[(len(tpots) - 1) // 2], sum([m for _, m in imp]) / len(imp)
