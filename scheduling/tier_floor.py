"""Tier floor (kairos): no TPOT tier whose SLO is feasible on this replica is starved under overload.

Why a tier starves: the VBS gate admits a request only if the batch, paced for the strictest TPOT among it and
the candidate, still meets that TPOT. A strict candidate lowers T_min for everyone, so once looser requests
fill the batch every strict candidate fails and is rejected, while loose candidates keep passing and keep the
batch full. Under sustained overload the strict tier's share goes to ~0 although each of its requests would
be served on an idle replica.

The floor: requests are classed by TPOT SLO (classes `CLASS_RATIO` wide). Per class, exponentially decayed
counts (window `tau_s`) of arrivals and admissions give its admitted share. A class is *starved* when its share
is below `floor` (after at least `min_arrivals` recent arrivals). When a candidate of a starved class fails the
gate, but would pass on an idle replica, the scheduler holds it instead of rejecting it and *reserves* the
round for starved classes: candidates of other classes wait in the queue (they are not rejected) while the
running batch decodes and drains, until the held request fits. Its TTFT guard still rejects it once its
deadline is unattainable, which ends the reservation. Best-effort requests (no TPOT) have no class.

Pure bookkeeping over floats; the scheduler calls `arrived`, `admitted` and `starved`.
"""
from __future__ import annotations

import math

CLASS_RATIO = 1.25  # TPOT SLOs within a factor 1.25 of each other share a class


def tpot_class(tpot_ms: float) -> int | None:
    """The class of a TPOT SLO (None for best effort): floor(log_1.25(tpot))."""
    if not math.isfinite(tpot_ms) or tpot_ms <= 0:
        return None
    return math.floor(math.log(tpot_ms) / math.log(CLASS_RATIO))


class TierFloor:
    def __init__(self, floor: float = 0.3, tau_s: float = 10.0, min_arrivals: float = 3.0) -> None:
        if not 0.0 <= floor <= 1.0 or tau_s <= 0 or min_arrivals < 0:
            raise ValueError("need 0 <= floor <= 1, tau_s > 0 and min_arrivals >= 0")
        self.floor, self.tau_s, self.min_arrivals = floor, tau_s, min_arrivals
        self._arrived: dict[int, float] = {}
        self._admitted: dict[int, float] = {}
        self._last_s: float | None = None

    def _decay_to(self, now_s: float) -> None:
        if self._last_s is not None and now_s > self._last_s:
            k = math.exp(-(now_s - self._last_s) / self.tau_s)
            for d in (self._arrived, self._admitted):
                for c in d:
                    d[c] *= k
        if self._last_s is None or now_s > self._last_s:
            self._last_s = now_s

    def arrived(self, tpot_ms: float, now_s: float) -> None:
        c = tpot_class(tpot_ms)
        if c is not None:
            self._decay_to(now_s)
            self._arrived[c] = self._arrived.get(c, 0.0) + 1.0

    def admitted(self, tpot_ms: float, now_s: float) -> None:
        c = tpot_class(tpot_ms)
        if c is not None:
            self._decay_to(now_s)
            self._admitted[c] = self._admitted.get(c, 0.0) + 1.0

    def share(self, tpot_ms: float, now_s: float) -> float:
        """Admitted / arrived of the class over the window (1.0 without recent arrivals)."""
        c = tpot_class(tpot_ms)
        self._decay_to(now_s)
        arrived = self._arrived.get(c, 0.0) if c is not None else 0.0
        return 1.0 if arrived <= 0.0 else min(1.0, self._admitted.get(c, 0.0) / arrived)

    def starved(self, tpot_ms: float, now_s: float) -> bool:
        c = tpot_class(tpot_ms)
        if c is None or self.floor <= 0.0:
            return False
        self._decay_to(now_s)
        return self._arrived.get(c, 0.0) >= self.min_arrivals and self.share(tpot_ms, now_s) < self.floor
