"""TPOT Guard (SCORPIO §1.2): credit-based decode batching and the VBS admission gate.

Requests are duck-typed: ``tpot_slo_ms`` (+inf for best effort), ``credit`` (mutable, starts at 0),
``num_tokens`` and ``expected_output_len``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

CREDIT_EPS = 1e-9  # so that 3 x (1/3) reaches 1 despite rounding


def trp(tpot_ms: float, t_min_ms: float, best_effort_trp: float) -> float:
    """TPOT-relative proportion ``t_min / tpot`` (in (0, 1] when ``t_min <= tpot``): the fraction of
    steps a request must decode in. Best effort (tpot inf) gets ``best_effort_trp``; if no TPOT is
    finite (``t_min`` inf) nothing is paced and every request counts 1."""
    if math.isinf(tpot_ms):
        return best_effort_trp
    if math.isinf(t_min_ms):
        return 1.0
    return t_min_ms / tpot_ms


def min_tpot(reqs: Iterable[T]) -> float:
    """T_min over ``reqs``; +inf when empty or all best effort."""
    return min((r.tpot_slo_ms for r in reqs), default=math.inf)


def vbs(running: Sequence[T], t_min_ms: float, best_effort_trp: float) -> float:
    """Virtual batch size: sum of TRPs, i.e. the expected number of requests per decode step."""
    return sum(trp(r.tpot_slo_ms, t_min_ms, best_effort_trp) for r in running)


def select_by_credit(running: Sequence[T], t_min_ms: float, best_effort_trp: float) -> list[T]:
    """Pick the requests that decode this step (SCORPIO's ``credit``), in ``running`` order.

    Requests with ``tpot == t_min`` always decode and never touch their credit; the others add
    their TRP to ``credit`` and decode when it reaches 1 (then pay 1). So r decodes about once every
    ``tpot_r / t_min`` steps. Mutates ``r.credit``. With no finite TPOT everyone decodes.
    """
    if math.isinf(t_min_ms):
        return list(running)
    out: list[T] = []
    for req in running:
        tpot = req.tpot_slo_ms
        if tpot == t_min_ms:
            out.append(req)
            continue
        req.credit += trp(tpot, t_min_ms, best_effort_trp)
        if req.credit >= 1.0 - CREDIT_EPS:
            req.credit -= 1.0
            out.append(req)
    return out


class VBSGate:
    """Per-round VBS admission gate for prefill candidates (SCORPIO's ``gate<k>``).

    A candidate r with a TPOT SLO passes iff ``itl(VBS', L) * margin < slack * T_min'`` where
    ``T_min' = min(T_min, T_r)``, ``VBS'`` is the VBS of running + admitted-this-round + r under
    ``T_min'``, and ``L = L_in + O_r / 2`` with ``L_in`` the mean context length over the same set:
    (sum of running ``num_tokens`` + tokens of the admitted ones and r) / (their count). SCORPIO
    divides by ``n_running + 1`` only, which overstates L once several are admitted in one step;
    we divide by the number of sequences actually summed. Best-effort candidates always pass.

    After a failure at TPOT T: with ``monotone_skip`` later candidates of this round (the running
    set is fixed per gate) with TPOT <= T fail without evaluation, looser ones are still tried;
    without it (SCORPIO) the gate is ``stopped`` and every later check fails, which the caller maps
    to ``Verdict.STOP``. The skip assumes comparable lengths, as SCORPIO's shortcut does.
    """

    def __init__(
        self,
        running: Sequence[T],
        predictor_itl: Callable[[float, float], float],
        margin: float = 1.3,
        slack: float = 0.99,
        best_effort_trp: float = 0.5,
        monotone_skip: bool = True,
        output_len_estimate: Callable[[T], float] | None = None,
    ) -> None:
        self._itl = predictor_itl
        self._margin = margin
        self._slack = slack
        self._be_trp = best_effort_trp
        self._monotone_skip = monotone_skip
        self._out_len = output_len_estimate or (lambda r: r.expected_output_len)
        # VBS under any T_min is T_min * sum(1 / T) over finite TPOTs + best_effort_trp * n_best_effort,
        # so these running sums make each check O(1).
        self._t_min = math.inf
        self._inv_sum = 0.0
        self._n_best_effort = 0
        self._n_seqs = 0
        self._tokens = 0
        self._fail_tpot = -math.inf
        self._stopped = False
        for req in running:
            self._add(req.tpot_slo_ms, req.num_tokens)
        self._n_running = self._n_seqs

    @property
    def stopped(self) -> bool:
        """True once a candidate failed and ``monotone_skip`` is off (head-of-line stop)."""
        return self._stopped

    @property
    def admitted(self) -> int:
        """Number of candidates recorded with ``admit`` this round."""
        return self._n_seqs - self._n_running

    def _add(self, tpot_ms: float, tokens: int) -> None:
        if math.isinf(tpot_ms):
            self._n_best_effort += 1
        else:
            self._inv_sum += 1.0 / tpot_ms
            self._t_min = min(self._t_min, tpot_ms)
        self._n_seqs += 1
        self._tokens += tokens

    def predicted_tpot_ms(self, candidate: T) -> float:
        """ITL(VBS', L) at the midpoint of the candidate's decode (before the margin)."""
        tpot = candidate.tpot_slo_ms
        t_min = min(self._t_min, tpot)
        inv_sum = self._inv_sum + (0.0 if math.isinf(tpot) else 1.0 / tpot)
        n_be = self._n_best_effort + (1 if math.isinf(tpot) else 0)
        if math.isinf(t_min):
            vbs_new = float(self._n_seqs + 1)  # nobody is paced: every sequence decodes every step
        else:
            vbs_new = t_min * inv_sum + self._be_trp * n_be
        l_in = (self._tokens + candidate.num_tokens) / (self._n_seqs + 1)
        return self._itl(vbs_new, l_in + self._out_len(candidate) / 2.0)

    def check(self, candidate: T) -> bool:
        """Whether admitting ``candidate`` keeps every admitted request within its TPOT SLO."""
        if self._stopped:
            return False
        tpot = candidate.tpot_slo_ms
        if math.isinf(tpot):
            return True
        if self._monotone_skip and tpot <= self._fail_tpot:
            return False
        t_min = min(self._t_min, tpot)
        if self.predicted_tpot_ms(candidate) * self._margin < self._slack * t_min:
            return True
        self._fail_tpot = max(self._fail_tpot, tpot)
        self._stopped = not self._monotone_skip
        return False

    def admit(self, candidate: T) -> None:
        """Record ``candidate`` as admitted this round: later checks include its TRP and tokens."""
        self._add(candidate.tpot_slo_ms, candidate.num_tokens)
