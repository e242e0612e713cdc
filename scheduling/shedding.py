"""Work shedding (kairos's where it predicts reply lengths; `work_shedding=true` elsewhere): under overload, turn
away the requests that would hold the batch longest.

Why. Goodput counts requests. Once the VBS gate binds, a replica decodes a roughly fixed amount per second: a
paced request of TPOT t decodes one token every t ms, and a request of n output tokens holds its share of the
batch for about n steps at the strictest pace, whatever its tier. *Which* arrivals get that capacity decides
how many requests are served. Admitted as they come, the batch takes whatever arrives when a place frees, and
the long replies stay longest (on ShareGPT a minority of long replies carries most of the tokens). Serving the
shorter replies first serves more requests with the same capacity.

A request's *work* is its expected output tokens divided by its TPOT SLO (the scheduler's `_work`): a token at a
stricter pace costs more, since a batch that must step every T ms fits fewer requests. The shedder keeps the works
of the arrivals of the last `window_s` seconds, and C, the work per second of the steps run while the replica was
saturated (each step's tokens weighed alike): within `hold_s` of a request turned away by the TPOT gate (rejected,
or kept waiting for room: short_first), the TTFT guard or a full queue. Its own sheds do not count, or shedding
would lower C, which would shed more. Its threshold is the largest work θ such that the arrivals of work <= θ offer
at most `target` x C per second; a fresh request of work > θ is shed (429 with Retry-After) instead of being offered
to the gate. θ is +inf while all arrivals together offer less than that and before any saturated step is measured,
and it is never below the window's median work (requests that all ask for the same are never shed by it). The
scheduler sheds only while requests are running (an idle replica admits anything) and while the replica is saturated
(within `hold_s` of a capacity rejection): where a fast replica's batch has room between the bursts that fill it, a
long request shed there would have been served within SLO (most sheds came while no strict reply paced the batch).
It ranks by expected work, so kairos sheds only with length information (its predictor, `Scheduler`): with no more
than max_tokens to go by, work ranks requests by their tier.

A request that would set a faster pace for the whole batch (its TPOT stricter than every running request's)
costs more than its own tokens: while it runs, every decode step must fit its TPOT, and the gate fits less than half
as many requests into such steps. With
`pace_factor` < 1 such a request is shed above `pace_factor` x θ (`sheds`), so the strict tier is served by its
shorter requests, and strict requests that arrive while one already runs share that cost (the pace is set).
Off by default (`shed_pace_factor` 1.0): on ShareGPT it traded the strict tier's share for goodput that did not
hold from run to run.

With `pace_work` the work is machine time instead (`PaceCost`): a token decoded at pace T costs the predicted
step of the largest batch the VBS gate fits into T, divided by that batch (so tiers cost alike where the step
hardly grows with the batch, as on a GPU), and a request that would set a faster pace for the whole batch also
pays for what the others lose while it runs: about n x T of wall time at the lower throughput of the faster pace.

Pure bookkeeping over floats; the scheduler calls `arrived`, `saturated`, `step` and `threshold`, then `sheds`.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate
from typing import Callable, Sequence


PACE_TOLERANCE = 0.95  # a TPOT under this share of the batch's pace sets a faster one (tiers differ by far more)


def sheds(work: float, threshold: float, tpot_ms: float, pace_ms: float, pace_factor: float = 1.0) -> bool:
    """Whether work shedding turns away a fresh request of this work and TPOT SLO, the round's threshold θ and
    the batch's pace (the strictest TPOT running or admitted this round; +inf for none): its work is over θ, or
    over `pace_factor` x θ when its TPOT would set a faster pace for the batch."""
    lowers_pace = tpot_ms < PACE_TOLERANCE * pace_ms
    return work > (threshold * pace_factor if lowers_pace else threshold)


class PaceCost:
    """Machine time per decoded token at a pace, from the latency model the VBS gate uses (`itl(b, length)`, ms;
    increasing in b): a batch stepping at pace T holds at most V(T) requests, the largest b with
    itl(b, L) * margin <= slack * T (at least 1, at most `max_batch`), and each of its tokens costs itl(V, L) / V.
    Lengths are bucketed (`len_step` tokens) and each (pace, length) is solved once per `scale` of the model and
    variant of it (`use_model`: the LoRA adapters a batch runs through)."""

    def __init__(self, itl: Callable[[float, float], float], margin: float, slack: float, max_batch: int,
                 len_step: int = 64) -> None:
        self.itl, self.margin, self.slack, self.max_batch, self.len_step = itl, margin, slack, max_batch, len_step
        self.scale = 1.0
        # the costs solved, by variant of the model (`use_model`), the one in use as `_memo`
        self._memos: dict[int, dict[tuple[float, int], float]] = {}
        self._variant = 0
        self._memo = self._memos.setdefault(0, {})

    def set_scale(self, scale: float) -> None:
        """The gate's correction of the model (measured / predicted steps); the memo is kept within 5% of it."""
        if abs(scale - self.scale) > 0.05 * self.scale:
            self.scale = scale
            self._memos.clear()
            self._memo = self._memos.setdefault(self._variant, {})

    def use_model(self, variant: int) -> None:
        """The variant of the model the costs are of from now on (the LoRA adapters a step runs through,
        `predictor.Adapters`): each keeps its own solved costs, so going back to one solves nothing again."""
        if variant != self._variant:
            self._variant = variant
            self._memo = self._memos.setdefault(variant, {})

    def token_ms(self, tpot_ms: float, length: float) -> float:
        """Machine ms per token of a batch paced at `tpot_ms` (+inf: the largest batch) at mean context `length`."""
        return self.tokens_ms(tpot_ms, (length,))

    def tokens_ms(self, tpot_ms: float, lengths: Sequence[float]) -> float:
        """The sum of `token_ms(tpot_ms, length)` over `lengths`, in their order (a step's rows: one lookup each)."""
        memo, step, total = self._memo, self.len_step, 0.0
        for length in lengths:
            bucket = max(1, int(length) // step + 1)
            # a request's TPOT is one float throughout (its SLO's): no rounding needed to hit
            got = memo.get((tpot_ms, bucket))
            total += got if got is not None else self._solve(tpot_ms, bucket)
        return total

    def _solve(self, tpot_ms: float, bucket: int) -> float:
        """token_ms at a length bucket not in the memo: solved, then kept."""
        ctx = float(bucket * self.len_step)

        def step(b: int) -> float:
            return self.itl(float(b), ctx) * self.scale

        lo, hi = 1, self.max_batch  # V: the largest feasible b (1 if even one request alone does not fit)
        limit = self.slack * tpot_ms / self.margin
        if step(hi) <= limit:
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if step(mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        cost = max(step(lo), 1e-9) / lo
        if len(self._memo) >= 4096:  # clients' TPOTs are arbitrary floats: keep the memo bounded
            self._memo.clear()
        self._memo[(tpot_ms, bucket)] = cost
        return cost

    def work(self, tokens: float, tpot_ms: float, pace_ms: float, length: float) -> float:
        """Machine ms for `tokens` more tokens of a request of TPOT `tpot_ms` joining a batch paced at `pace_ms`
        (+inf: none): its own tokens at the pace it decodes at, plus, if it would set a faster pace, what the
        batch loses over its n x T of wall time (the share of the machine's throughput the faster pace costs)."""
        if tokens <= 0 or not math.isfinite(tpot_ms):
            return 0.0
        own = self.token_ms(min(tpot_ms, pace_ms), length)
        if tpot_ms >= PACE_TOLERANCE * pace_ms:
            return tokens * own
        lost = max(0.0, 1.0 - self.token_ms(pace_ms, length) / own)
        return tokens * (own + tpot_ms * lost)


class WorkShedder:
    def __init__(self, target: float = 1.0, window_s: float = 20.0, hold_s: float = 1.0, tau_s: float = 10.0,
                 min_arrivals: int = 20, max_arrivals: int = 4096, refresh_s: float = 0.05) -> None:
        if target <= 0 or window_s <= 0 or hold_s < 0 or tau_s <= 0 or not 1 <= min_arrivals <= max_arrivals \
                or refresh_s < 0:
            raise ValueError("need target > 0, window_s > 0, hold_s >= 0, tau_s > 0, "
                             "1 <= min_arrivals <= max_arrivals and refresh_s >= 0")
        self.target, self.window_s, self.hold_s, self.tau_s = target, window_s, hold_s, tau_s
        self.min_arrivals, self.refresh_s = min_arrivals, refresh_s
        # (arrival s, work), oldest first; at most max_arrivals, so a fast replica's window costs a bounded sort
        self._arrivals: deque[tuple[float, float]] = deque(maxlen=max_arrivals)
        self._theta: tuple[float, float] | None = None  # (when, θ): reused for refresh_s
        self._first_s: float | None = None
        self._saturated_s = -math.inf
        self._work = 0.0  # decayed sums over saturated steps
        self._ms = 0.0
        self._last_s: float | None = None

    def arrived(self, work: float, now_s: float) -> None:
        """A request of this work arrived."""
        if self._first_s is None:
            self._first_s = now_s
        self._arrivals.append((now_s, max(float(work), 0.0)))
        self._expire(now_s)

    def saturated(self, now_s: float) -> None:
        """A request was turned away for capacity (gate, TTFT guard, full queue), not by the shedder."""
        self._saturated_s = max(self._saturated_s, now_s)

    def saturated_now(self, now_s: float) -> bool:
        """Whether the replica counts as saturated now (within `hold_s` of a capacity rejection): a step finished now
        counts toward C, and the scheduler sheds only then."""
        return now_s - self._saturated_s <= self.hold_s

    def step(self, now_s: float, work: float, wall_ms: float) -> None:
        """A finished step that did `work` (its tokens' work) in `wall_ms`; measured only while saturated.
        Steps not measured need not be reported: the sums decay by the time since the last one measured."""
        if self._last_s is not None and now_s > self._last_s:
            k = math.exp(-(now_s - self._last_s) / self.tau_s)
            self._work *= k
            self._ms *= k
        if self._last_s is None or now_s > self._last_s:
            self._last_s = now_s
        if self.saturated_now(now_s) and wall_ms > 0:
            self._work += work
            self._ms += wall_ms

    @property
    def capacity_per_s(self) -> float | None:
        """C: work per second over the saturated steps (None before any)."""
        return None if self._ms <= 0 else 1000.0 * self._work / self._ms

    def _expire(self, now_s: float) -> None:
        while self._arrivals and self._arrivals[0][0] < now_s - self.window_s:
            self._arrivals.popleft()

    def threshold(self, now_s: float) -> float:
        """θ: requests of more work than this are shed (+inf: none). Computed at most every `refresh_s`."""
        if self._theta is not None and 0.0 <= now_s - self._theta[0] < self.refresh_s:
            return self._theta[1]
        theta = self._compute(now_s)
        self._theta = (now_s, theta)
        return theta

    def _compute(self, now_s: float) -> float:
        self._expire(now_s)
        cap = self.capacity_per_s
        if cap is None or len(self._arrivals) < self.min_arrivals or self._first_s is None:
            return math.inf
        start = max(self._first_s, now_s - self.window_s)
        if len(self._arrivals) == self._arrivals.maxlen:  # the oldest ones were dropped: the window is shorter
            start = max(start, self._arrivals[0][0])
        span = max(now_s - start, 1.0)
        budget = self.target * cap * span  # the work the window's arrivals may offer
        works = sorted([w for _, w in self._arrivals])
        cum = list(accumulate(works))
        if cum[-1] <= budget:
            return math.inf
        cut = works[bisect_right(cum, budget)]  # the shortest work that no longer fits
        below = bisect_left(works, cut)  # every arrival of that work counts once θ reaches it
        theta = works[below - 1] if below > 0 else -math.inf
        return max(theta, works[(len(works) - 1) // 2])
