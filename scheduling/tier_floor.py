"""Tier floor (kairos): no TPOT tier whose SLO is feasible on this replica is starved under overload.

Why a tier starves: the VBS gate admits a request only if the batch, paced for the strictest TPOT among it and
the candidate, still meets that TPOT. A strict candidate lowers T_min for everyone, so once looser requests
fill the batch every strict candidate fails and is rejected, while loose candidates keep passing and keep the
batch full. Under sustained overload the strict tier's share goes to ~0 although each of its requests would
be served on an idle replica.

The floor: requests are classed by TPOT SLO (classes `CLASS_RATIO` wide). Per class, exponentially decayed
counts (window `tau_s`) of admissions and rejections give its admitted share (requests still waiting do not
count). A class is *starved* when its share is below `floor` (after at least `min_decided` recent
decisions). While the strictest starved class's SLO is feasible on an idle replica, the scheduler
(`tier_floor_mode`):
- `reserve`: admits a candidate of another class only if the gate would still pass one more request of the
  starved class afterwards (its TPOT, the class's mean mid-decode context): a share of the VBS budget is kept for it, so
  its next arrival gets in at once instead of being rejected behind a full batch;
- `hold`: when a starved class's candidate fails the gate, holds it instead of rejecting it, and admits only
  starved classes while the running batch decodes and drains, until the held request fits. Its TTFT guard
  still rejects it once its deadline is unattainable, which ends the hold;
- `both` (default).
Candidates that are kept out wait in the queue; they are not rejected for it. Best-effort requests (no TPOT)
have no class.

Pure bookkeeping over floats; the scheduler calls `arrived`, `admitted`, `rejected`, `starved` and
`reservation`.
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
    def __init__(self, floor: float = 0.3, tau_s: float = 10.0, min_decided: float = 3.0) -> None:
        if not 0.0 <= floor <= 1.0 or tau_s <= 0 or min_decided < 0:
            raise ValueError("need 0 <= floor <= 1, tau_s > 0 and min_decided >= 0")
        self.floor, self.tau_s, self.min_decided = floor, tau_s, min_decided
        self._arrived: dict[int, float] = {}
        self._admitted: dict[int, float] = {}
        self._rejected: dict[int, float] = {}
        self._tpot: dict[int, float] = {}  # the strictest TPOT seen in each class
        self._length: dict[int, float] = {}  # decayed sum of arrivals' mid-decode context (mean = / arrived)
        self._last_s: float | None = None

    def _decay_to(self, now_s: float) -> None:
        if self._last_s is not None and now_s > self._last_s:
            k = math.exp(-(now_s - self._last_s) / self.tau_s)
            for d in (self._arrived, self._admitted, self._rejected, self._length):
                for c in d:
                    d[c] *= k
        if self._last_s is None or now_s > self._last_s:
            self._last_s = now_s

    def arrived(self, tpot_ms: float, now_s: float, length: float = 0.0) -> None:
        """A request of this TPOT arrived; `length` is its context at mid-decode (prompt + output / 2)."""
        c = tpot_class(tpot_ms)
        if c is not None:
            self._decay_to(now_s)
            self._arrived[c] = self._arrived.get(c, 0.0) + 1.0
            self._length[c] = self._length.get(c, 0.0) + length
            self._tpot[c] = min(self._tpot.get(c, math.inf), tpot_ms)

    def _count(self, d: dict[int, float], tpot_ms: float, now_s: float) -> None:
        c = tpot_class(tpot_ms)
        if c is not None:
            self._decay_to(now_s)
            d[c] = d.get(c, 0.0) + 1.0

    def admitted(self, tpot_ms: float, now_s: float) -> None:
        self._count(self._admitted, tpot_ms, now_s)

    def rejected(self, tpot_ms: float, now_s: float) -> None:
        self._count(self._rejected, tpot_ms, now_s)

    def _decided(self, c: int) -> float:
        return self._admitted.get(c, 0.0) + self._rejected.get(c, 0.0)

    def share(self, tpot_ms: float, now_s: float) -> float:
        """Admitted / (admitted + rejected) of the class over the window (1.0 without recent decisions)."""
        c = tpot_class(tpot_ms)
        self._decay_to(now_s)
        decided = self._decided(c) if c is not None else 0.0
        return 1.0 if decided <= 0.0 else self._admitted.get(c, 0.0) / decided

    def starved(self, tpot_ms: float, now_s: float) -> bool:
        c = tpot_class(tpot_ms)
        if c is None or self.floor <= 0.0:
            return False
        self._decay_to(now_s)
        return self._decided(c) >= self.min_decided and self.share(tpot_ms, now_s) < self.floor

    def reservation(self, now_s: float) -> tuple[float, float] | None:
        """(TPOT, mean context) of the strictest starved class, for which admissions keep VBS room; None if
        no class is starved."""
        self._decay_to(now_s)
        starved = [c for c in self._arrived if self.starved(self._tpot[c], now_s) and self._arrived[c] > 0.0]
        if not starved:
            return None
        c = min(starved, key=lambda k: self._tpot[k])
        return self._tpot[c], self._length[c] / self._arrived[c]
