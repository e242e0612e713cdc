"""TPOT Guard (SCORPIO §1.2): credit-based decode batching and the VBS admission gate.

Requests are duck-typed: ``tpot_slo_ms`` (+inf for best effort), ``credit`` (mutable, starts at 0),
``num_tokens`` and ``expected_output_len``.
"""
from __future__ import annotations

import bisect
import collections
import itertools
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
    paced = math.isfinite(t_min_ms)
    total = 0.0
    for r in running:  # trp, inlined (a pass over the batch every step)
        t = r.tpot_slo_ms
        total += best_effort_trp if t == math.inf else t_min_ms / t if paced else 1.0
    return total


def select_by_credit(running: Sequence[T], t_min_ms: float, best_effort_trp: float,
                     due: Callable[[T, int], bool] | None = None,
                     pace_of: Callable[[T], float] | None = None) -> list[T]:
    """Pick the requests that decode this step (SCORPIO's ``credit``), in ``running`` order.

    Requests with ``tpot == t_min`` always decode and never touch their credit; the others add
    their TRP to ``credit`` and decode when it reaches 1 (then pay 1). So r decodes about once every
    ``tpot_r / t_min`` steps. Mutates ``r.credit``. With no finite TPOT everyone decodes.
    ``due`` (kairos's pace guard): afterwards, each request the credit skipped decodes anyway where
    ``due(r, n)`` says so (n: the step's batch so far), and pays for it, down to a credit of -1.
    ``pace_of`` (kairos's pace slack): the TPOT a request's TRP is taken at instead of its SLO's
    (`paced_tpot_ms`: slower for a reply ahead of its pace).
    """
    if math.isinf(t_min_ms):
        return list(running)
    out: list[T] = []
    skipped: list[T] = []
    for req in running:
        tpot = req.tpot_slo_ms
        if tpot == t_min_ms:
            out.append(req)
            continue
        req.credit += trp(tpot if pace_of is None else pace_of(req), t_min_ms, best_effort_trp)
        if req.credit >= 1.0 - CREDIT_EPS:
            req.credit -= 1.0
            out.append(req)
        else:
            skipped.append(req)
    if due is None or not skipped:
        return out
    extra = []
    for req in skipped:
        if due(req, len(out) + len(extra)):
            req.credit = max(req.credit - 1.0, -1.0)
            extra.append(req)
    if not extra:
        return out
    chosen = {id(r) for r in out} | {id(r) for r in extra}
    return [r for r in running if id(r) in chosen]


def behind_pace(first_token_s: float | None, num_output_tokens: int, tpot_ms: float, now_s: float,
                this_step_ms: float, next_step_ms: float) -> bool:
    """Whether a paced request must decode in this step to keep the mean TPOT of its tokens so far within
    ``tpot_ms``. With k tokens out, the first at ``first_token_s``, its next token is due by t_first + k * tpot;
    decoded now it comes at the end of this step, skipped at the end of the next one.

    Credit counts steps, so a request falls behind its SLO whenever steps run longer than T_min (a prefill
    rides in the step, a slow step), and a short reply cannot make that up: kairos's TPOT misses under
    overload were mostly short replies just over their TPOT."""
    return this_step_ms + next_step_ms > next_token_slack_ms(first_token_s, num_output_tokens, tpot_ms, now_s)


def affordable_step_ms(first_token_s: float | None, num_output_tokens: int, expected_output_len: int,
                       tpot_ms: float, now_s: float, extra_steps: int = 0) -> float:
    """The longest step a paced request can afford from now on, every remaining step alike, for the mean TPOT
    of all its tokens to stay within ``tpot_ms``: (t_first + (n - 1) * tpot - now) / (n - k + extra_steps),
    n its expected output length (at least k + 1), k the tokens out; ``extra_steps`` counts steps it would
    sit out. +inf for a request without a TPOT SLO or without its first token."""
    if first_token_s is None or num_output_tokens < 1 or math.isinf(tpot_ms):
        return math.inf
    n = max(expected_output_len, num_output_tokens + 1)
    budget_ms = (first_token_s - now_s) * 1000.0 + (n - 1) * tpot_ms
    return budget_ms / (n - num_output_tokens + extra_steps)


def paced_tpot_ms(first_token_s: float | None, num_output_tokens: int, expected_output_len: int, tpot_ms: float,
                  now_s: float) -> float:
    """The TPOT a paced reply needs from now on: the longest per-token time its remaining tokens can take, all
    alike, for the mean TPOT of all its tokens to stay within ``tpot_ms`` (`affordable_step_ms`), and never less
    than ``tpot_ms``. A reply ahead of its pace (its tokens came faster than its SLO: fill steps, a light batch)
    has banked time, and needs a token less often than its SLO says until it is spent; a reply behind it counts
    at its SLO (catch-up and the pace guard make up for it). ``tpot_ms`` without a first token or a TPOT SLO."""
    return max(tpot_ms, affordable_step_ms(first_token_s, num_output_tokens, expected_output_len, tpot_ms, now_s)) \
        if first_token_s is not None and num_output_tokens >= 1 and math.isfinite(tpot_ms) else tpot_ms


def next_token_slack_ms(first_token_s: float | None, num_output_tokens: int, tpot_ms: float, now_s: float) -> float:
    """How long from now until a paced request's next token is due: with k tokens out, the first at
    ``first_token_s``, its (k + 1)-th keeps the mean TPOT of its tokens within ``tpot_ms`` if it comes by
    t_first + k * tpot. +inf without a TPOT SLO or a first token."""
    if first_token_s is None or num_output_tokens < 1 or math.isinf(tpot_ms):
        return math.inf
    return (first_token_s - now_s) * 1000.0 + num_output_tokens * tpot_ms


def hold_prefill(step_ms: float, limit_ms: float, ttft_slack_ms: float, prefill_ms: float, margin_ms: float
                 ) -> bool:
    """kairos's prefill hold: keep a fresh prompt waiting this step when the step it would make (``step_ms``: its
    prefill, the round's prefills before it, and the decodes riding along) would end after a running reply's
    next token is due (``limit_ms``, the least `next_token_slack_ms`), while its own TTFT deadline,
    ``ttft_slack_ms`` away, still leaves twice its prefill plus ``margin_ms``. A long prompt prefilled in the
    middle of a short reply stalls that reply for the whole step (a long prompt's prefill can take a large share
    of what a short reply may take in all); held a few steps, it waits for the reply to end or to get ahead of its
    pace, and it is admitted anyway when its deadline draws near. A reply's later steps are no help: the VBS
    gate fills the batch until they take about the strictest TPOT, so a stall is paid only from the time a reply
    is ahead of its pace."""
    return step_ms > limit_ms and ttft_slack_ms > 2.0 * prefill_ms + margin_ms


def trim_for_catch_up(batch: Sequence[T], step_ms: Callable[[int], float], afford: Callable[[T, int], float],
                      pace: Callable[[T], float] | None = None) -> list[T]:
    """kairos's catch-up: when the step predicted for ``batch`` is longer than what its most pressed request can
    afford (``afford(r, 0)``), leave out of this step the requests that can afford to sit it out
    (``afford(r, 1)`` >= the step without them), those with the most room first, until the step fits or no one
    else can wait. A request that cannot afford even a step alone (``step_ms(1)``) is past saving and sets no
    limit. A reply that fell behind (a prefill rode in its steps, the box slowed) then gets shorter steps
    instead of ending just over its TPOT, paid for by requests ahead of their own pace. Keeps ``batch`` order.
    ``pace(r)``: the time each of r's later tokens will take (default: the trimmed step); a request sits out only
    if its steps can then be that long. The trimmed step is no bound on a request's later tokens: it decodes in
    full batches again, and skipped step after step it would end over its TPOT."""
    b = list(batch)
    if len(b) < 2:
        return b
    now = [afford(r, 0) for r in b]
    floor = step_ms(1)  # a request that cannot afford even a step of its own is past saving: not worth a skip
    limit = min([a for a in now if a >= floor], default=math.inf)
    if step_ms(len(b)) <= limit:
        return b
    later = [afford(r, 1) for r in b]
    out: set[int] = set()
    for i in sorted(range(len(b)), key=lambda i: -later[i]):
        n = len(b) - len(out)
        if n <= 1 or step_ms(n) <= limit:
            break
        if now[i] > limit and later[i] >= max(step_ms(n - 1), pace(b[i]) if pace is not None else 0.0):
            out.add(i)
    return [r for i, r in enumerate(b) if i not in out]


def passes_gate(itl_ms: float, margin: float, slack: float, t_min_ms: float) -> bool:
    """The VBS gate's test of a predicted inter-token latency: ``itl * margin < slack * T_min``."""
    return itl_ms * margin < slack * t_min_ms


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

    ``running_tpot`` (kairos's pace slack): the TPOT each running request counts at, in VBS and in
    T_min, instead of its SLO's (`paced_tpot_ms`): a reply ahead of its pace takes a smaller share of
    the steps until its banked time is spent, and the room it leaves goes to a fresh request.

    ``remaining_of`` (``gate_context="horizon"``, opt-in): the output each running request (and each
    one admitted this round) is expected to have left. Over the candidate's ``O_r`` steps a reply with
    ``m`` tokens left grows by ``min(m, O_r)`` (it ends, or the candidate does), so by half that on
    average: ``L = (sum of num_tokens + sum of min(m, O_r) / 2 + O_r / 2) / n``. SCORPIO's form grows
    every reply by ``O_r / 2``, which over-states the context of a long candidate's steps where the
    batch's replies end first. ``leaves_room``'s hypothetical request comes with its context over its
    whole reply already, so the horizon does not grow it (SCORPIO's form adds ``O_r / 2`` to it too).
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
        running_tpot: Callable[[T], float] | None = None,
        remaining_of: Callable[[T], float] | None = None,
        idle_itl: Callable[[float], float] | None = None,
    ) -> None:
        self._itl = predictor_itl
        # one request's ITL on an idle replica, by its mid-decode context (`feasible_alone`); None: predictor_itl's
        self._idle_itl = idle_itl or (lambda length: predictor_itl(1.0, length))
        self._rem_of = remaining_of
        self._rems: list[float] = []  # with remaining_of: the batch's replies' outputs left, ascending
        self._rem_cum: list[float] | None = [0.0]  # their prefix sums (None: to be summed again)
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
            self._add(req.tpot_slo_ms if running_tpot is None else running_tpot(req), req.num_tokens)
            if remaining_of is not None:
                self._add_remaining(req)
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
        return self._predict(((candidate.tpot_slo_ms, candidate.num_tokens),), self._out_len(candidate))

    def _growth(self, horizon: float) -> float:
        """With `remaining_of`: how much the batch's contexts grow on average over `horizon` more steps, summed over
        its replies: each grows by the output it has left or the horizon, whichever is less, so half that on
        average (a reply that ends within the horizon stops growing; SCORPIO's form grows every reply by the whole
        horizon)."""
        if self._rem_cum is None:
            self._rem_cum = [0.0, *itertools.accumulate(self._rems)]
        k = bisect.bisect_left(self._rems, horizon)
        return (self._rem_cum[k] + horizon * (len(self._rems) - k)) / 2.0

    def _predict(self, extra: Sequence[tuple[float, float]], out_len: float) -> float:
        """ITL(VBS', L) with `extra` (tpot, tokens) sequences added to the batch, over the `out_len` steps of the
        candidate's reply (the first of `extra`; the others' contexts are already the mean over their replies)."""
        t_min, add_inv, add_be, add_tokens = self._t_min, 0.0, 0, 0
        for t, k in extra:  # one pass (the gate's per-candidate test)
            if math.isinf(t):
                add_be += 1
            else:
                add_inv += 1.0 / t
                if t < t_min:
                    t_min = t
            add_tokens += k
        n = self._n_seqs + len(extra)
        vbs_new = float(n) if math.isinf(t_min) else t_min * (self._inv_sum + add_inv) \
            + self._be_trp * (self._n_best_effort + add_be)
        tokens = self._tokens + add_tokens
        if self._rem_of is None:  # SCORPIO's: every context grows by half the candidate's reply
            return self._itl(vbs_new, tokens / n + out_len / 2.0)
        return self._itl(vbs_new, (tokens + self._growth(out_len) + out_len / 2.0) / n)

    def leaves_room(self, candidate: T, tpot_ms: float, length: float) -> bool:
        """Whether, with `candidate` admitted, one more request of TPOT `tpot_ms` and mean context `length`
        would still pass: the tier floor's reservation of VBS budget for a starved tier."""
        extra = [(candidate.tpot_slo_ms, candidate.num_tokens), (tpot_ms, length)]
        t_min = min(self._t_min, candidate.tpot_slo_ms, tpot_ms)
        return passes_gate(self._predict(extra, self._out_len(candidate)), self._margin, self._slack, t_min)

    def itl_ms(self, batch: float, length: float) -> float:
        """The gate's ITL model (with any correction the scheduler applies)."""
        return self._itl(batch, length)

    def feasible_alone(self, tpot_ms: float, length: float) -> bool:
        """Would a request of this TPOT and mid-decode context pass the gate on an idle replica (`idle_itl`)?"""
        return passes_gate(self._idle_itl(length), self._margin, self._slack, tpot_ms)

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
        if passes_gate(self.predicted_tpot_ms(candidate), self._margin, self._slack, t_min):
            return True
        self._fail_tpot = max(self._fail_tpot, tpot)
        self._stopped = not self._monotone_skip
        return False

    def resume(self) -> None:
        """The candidate that failed last leaves the queue (turned away): admission goes on past it. (Without
        `monotone_skip` a failure stops the round: the candidate waits at the head, SCORPIO's head-of-line stop.)"""
        self._stopped = False

    def admit(self, candidate: T) -> None:
        """Record ``candidate`` as admitted this round: later checks include its TRP and tokens."""
        self._add(candidate.tpot_slo_ms, candidate.num_tokens)
        if self._rem_of is not None:
            self._add_remaining(candidate)

    def _add_remaining(self, req: T) -> None:
        """With `remaining_of`: `req`'s output left joins the batch's (sorted, with their prefix sums)."""
        bisect.insort(self._rems, max(0.0, float(self._rem_of(req))))
        self._rem_cum = None


ALONE_ROWS = 2  # the decode rows of a step that `ItlCorrection.idle_factor` counts as a request decoding alone


class ItlCorrection:
    """Bounded multiplicative correction of the offline ITL model, learned from the steps actually run.

    The gate's ITL(B, L) is a pure-decode fit; what a paced request experiences per token is every step's
    wall time, prefill rounds (or hybrid forwards), scheduling and sampling included. Over a sliding
    window (exponential, ``tau_ms`` of wall time) the factor is

        sum(step wall ms) / sum(predicted ITL of the steps that decoded)

    clamped to ``[lo, hi]``. A prefill-only step adds its time and predicts nothing: it is pure stall for
    the running requests. With less than ``min_pred_ms`` of predictions in the window (an idle engine) the
    factor is that of the steps a request decoding alone runs (``idle_factor``: decode only, at most ALONE_ROWS
    rows), so that an idle replica's gate holds what the machine measured instead of returning to the profile,
    which the next steps would overrun, and admitting what it refused a moment earlier. That factor leaves out
    stalls and big batches (where the model errs otherwise) and averages over the last ``idle_horizon_ms`` of
    their predicted time, however long ago (each step counted at most ``hi`` times its prediction), starting from
    the profile's 1 (worth ``idle_prior_ms`` of them): a
    replica's best TPOT, drawn with it, holds still across idle gaps, short requests and bursts, and moves by
    degrees. The offline fit is never replaced, only scaled within bounds. This is the robust replacement for
    four-coefficient RLS, which drifted on steps where B and B*L are collinear. Beside it, ``step_factor`` is the
    model's error on the decode-only steps of the window alone (no stall in them): what one step's plan scales the
    model by, and the gate's factor where it counts only a share of the stalls (`correction_stall_share`).
    """

    JUDGE_MEMORY = 2.0  # judge_factor's window, in offer memories

    def __init__(self, tau_ms: float = 2000.0, lo: float = 0.8, hi: float = 2.5,
                 min_pred_ms: float = 100.0, idle_horizon_ms: float = 5000.0, idle_prior_ms: float = 1000.0,
                 offer_memory_s: float = 10.0) -> None:
        if not (0 < lo <= 1 <= hi) or tau_ms <= 0 or idle_horizon_ms <= 0 or idle_prior_ms <= 0 \
                or offer_memory_s < 0:
            raise ValueError("need tau_ms, idle_horizon_ms, idle_prior_ms > 0, offer_memory_s >= 0 and "
                             "0 < lo <= 1 <= hi")
        self.tau_ms, self.lo, self.hi, self.min_pred_ms = tau_ms, lo, hi, min_pred_ms
        self.idle_horizon_ms = idle_horizon_ms
        self.offer_memory_s = offer_memory_s
        # [idle factor, when it stopped being in effect (inf: it is)] after each step that moved it, the factors
        # rising from front to back (a later, lower factor makes every earlier, higher one irrelevant to any window
        # that reaches now), those that ended before JUDGE_MEMORY x offer_memory_s dropped
        self._lows: collections.deque[list[float]] = collections.deque()
        self._actual = 0.0
        self._pred = 0.0
        self._decode_actual = 0.0  # wall ms of the steps that decoded (the rest: prefill-only stalls)
        self._plain = [0.0, 0.0]  # [wall ms, predicted ms] of the decode-only steps (no prefill in them)
        self._rows: dict[int, list[float]] = {}  # rows bucket -> [wall ms, predicted ms] of its steps
        # [wall ms, predicted ms] of the steps decoding alone, each step's weight decaying with the predicted
        # decode time after it (idle_horizon_ms), not with wall time; seeded with idle_prior_ms of the profile's own
        # (factor 1), so that the first steps move the factor (and the best TPOT drawn with it) by degrees
        self._pure = [idle_prior_ms, idle_prior_ms]
        self._last_s: float | None = None

    def _decay_to(self, now_s: float) -> None:
        if self._last_s is not None:
            if now_s <= self._last_s:
                return
            k = math.exp(-(now_s - self._last_s) * 1000.0 / self.tau_ms)
            self._actual *= k
            self._pred *= k
            self._decode_actual *= k
            self._plain[0] *= k
            self._plain[1] *= k
            for sums in self._rows.values():
                sums[0] *= k
                sums[1] *= k
        self._last_s = now_s

    @staticmethod
    def bucket(rows: int) -> int:
        """The rows bucket of a decode batch: the least power of two >= rows."""
        return 1 << max(0, int(rows) - 1).bit_length()

    def observe(self, now_s: float, step_ms: float, predicted_decode_ms: float, rows: int = 0,
                alone: bool = False, prefill: bool = False) -> None:
        """One finished step: its wall time, the model's ITL for its decode batch (0 if none), that batch's rows
        (the by-rows buckets'), whether it is a step a request decoding alone runs (decode only, at most
        ALONE_ROWS rows: the steps `idle_factor` measures), and whether it carried a prefill (else it is one of
        the decode-only steps `step_factor` measures)."""
        self._decay_to(now_s)
        self._actual += max(step_ms, 0.0)
        self._pred += max(predicted_decode_ms, 0.0)
        if predicted_decode_ms > 0 and rows > 0:
            self._decode_actual += max(step_ms, 0.0)
            sums = self._rows.setdefault(self.bucket(rows), [0.0, 0.0])
            sums[0] += max(step_ms, 0.0)
            sums[1] += predicted_decode_ms
        if not prefill and predicted_decode_ms > 0:
            self._plain[0] += max(step_ms, 0.0)
            self._plain[1] += predicted_decode_ms
        if alone and predicted_decode_ms > 0:
            k = math.exp(-predicted_decode_ms / self.idle_horizon_ms)
            # (a step past `hi` times its prediction is a stall, e.g. a host's pause: it counts as `hi`, else one
            # such step held the factor at `hi` for the whole horizon)
            self._pure[0] = self._pure[0] * k + min(max(step_ms, 0.0), self.hi * predicted_decode_ms)
            self._pure[1] = self._pure[1] * k + predicted_decode_ms
            f, lows = self.idle_factor(), self._lows
            if lows:
                lows[-1][1] = min(lows[-1][1], now_s)  # (the factor in effect until now; one kept below keeps its end)
            while lows and lows[-1][0] >= f:
                lows.pop()
            lows.append([f, math.inf])
            self._forget_lows(now_s)

    def idle_factor(self) -> float:
        """The factor of an idle engine: the wall time over the predictions of the steps a request decoding alone
        runs, over the last `idle_horizon_ms` of their predicted time, the profile's factor 1 weighing as
        `idle_prior_ms` of them at first; clamped to [lo, hi]."""
        return min(self.hi, max(self.lo, self._pure[0] / self._pure[1]))

    def _forget_lows(self, now_s: float) -> None:
        """Drop the factors that ended before the longest window read (`judge_factor`'s) began."""
        lows, cut = self._lows, now_s - self.JUDGE_MEMORY * self.offer_memory_s
        while lows and lows[0][1] <= cut:
            lows.popleft()

    def _least_since(self, now_s: float, memory_s: float) -> float:
        """The least `idle_factor` in effect over the last `memory_s`: the first kept that was still in effect at
        the window's start or came after it (the factors rise from front to back)."""
        self._forget_lows(now_s)
        cut = now_s - memory_s
        return next((f for f, end in self._lows if end > cut), self.idle_factor())

    def offer_factor(self, now_s: float) -> float:
        """The least `idle_factor` in effect over the last `offer_memory_s`: what the SLOs an idle replica offers
        (its SLO floor) are drawn with. A burst on a loaded host slows the steps of its last requests, which decode
        alone, and raises the idle factor; the floor offered just before holds. A rise the machine keeps shows once
        the memory has passed; a fall, at once."""
        return self._least_since(now_s, self.offer_memory_s)

    def judge_factor(self, now_s: float) -> float:
        """The least `idle_factor` in effect over the last JUDGE_MEMORY x `offer_memory_s`: what an idle replica's
        gate admits with and what an SLO is judged unattainable with. Its window holds the whole of the offer's of
        any moment in the last `offer_memory_s`, so an SLO the replica offered (`offer_factor`) is neither refused
        by its idle gate nor judged unattainable for `offer_memory_s` after the offer, however the factor rose
        since (the offer's floor may have stood on a low measured most of a memory before)."""
        return self._least_since(now_s, self.JUDGE_MEMORY * self.offer_memory_s)

    def step_factor(self, now_s: float) -> float:
        """The model's error on the decode-only steps of the window (no stall in them); the idle factor while they
        hold too few predictions."""
        self._decay_to(now_s)
        if self._plain[1] < self.min_pred_ms:
            return self.idle_factor()
        return min(self.hi, max(self.lo, self._plain[0] / self._plain[1]))

    def factor(self, now_s: float, rows: int | None = None) -> float:
        """The factor over all steps; with `rows`, over the steps of that many rows' bucket (times the share the
        prefill-only stalls add to all steps), where the model errs differently by batch size; the factor over
        all steps while that bucket has too few predictions."""
        self._decay_to(now_s)
        if self._pred < self.min_pred_ms:
            return self.idle_factor()
        f = self._actual / self._pred
        if rows is not None and (sums := self._rows.get(self.bucket(rows))) is not None \
                and sums[1] >= self.min_pred_ms and self._decode_actual > 0:
            f = sums[0] / sums[1] * (self._actual / self._decode_actual)
        return min(self.hi, max(self.lo, f))


class StepModelError:
    """How far served decode steps are from the step-time model, by batch size: per decode-rows bucket
    (`ItlCorrection.bucket`), the count of decode-only steps and the sum of their wall time over the model's ITL for
    their rows and mean context. Cumulative (a scraper takes differences); fed by the scheduler after each step.
    Where the model errs by batch size (the strict tier's few rows against the loose tiers' hundreds), the buckets
    show it, which the one-factor ITL correction averages away."""

    __slots__ = ("_sums",)

    def __init__(self) -> None:
        self._sums: dict[int, tuple[int, float]] = {}

    def observe(self, rows: int, wall_ms: float, model_ms: float) -> None:
        if rows <= 0 or not model_ms > 0.0 or not wall_ms >= 0.0:
            return
        k = ItlCorrection.bucket(rows)
        n, total = self._sums.get(k, (0, 0.0))
        self._sums[k] = (n + 1, total + wall_ms / model_ms)

    def snapshot(self) -> dict[int, tuple[int, float]]:
        return dict(self._sums)
