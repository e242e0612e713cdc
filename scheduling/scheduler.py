"""The per-replica scheduler: each step it decides which requests to prefill, which to decode, which to reject.

Composes the pure mechanisms (admission, queue order, TTFT guard, credit batching, VBS gate, pace guard,
catch-up, tier floor, work shedding, chunked prefill) according to the policy flags. Owns the waiting/running
sets, the KV block accounting and the step's bookkeeping; the engine executes the plan and hands the sampled
tokens back (`postprocess`).
Steps are prefill-first (as vLLM V0 / SCORPIO): a step with admissions runs only those prefills, unless
`hybrid_steps` is on (kairos): then the running requests' decodes ride in the same forward as the prefills,
so a prefill round no longer stalls every decode for a whole extra step.
"""
from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from core.kv import BlockManager
from core.messages import RejectReason
from core.request import FinishReason, Request, Status, outlook_from
from scheduling.admission import Verdict, take_for_prefill
from scheduling.config import SchedulerConfig
from scheduling.length_predictor import LengthCalibration, conditional_means, for_served_model
from scheduling.length_predictor import quantile as length_quantile
from scheduling.predictor import Adapters, LatencyModel, prefill_sq
from scheduling.queues import order_by_priority, order_least_work, order_waiting
from scheduling.reserve import ImpatientReserve
from scheduling.shedding import PaceCost, WorkShedder, sheds
from scheduling.tier_floor import TierFloor, tpot_class
from scheduling.tpot_guard import (ALONE_ROWS, ItlCorrection, StepModelError, VBSGate, affordable_step_ms,
                                   behind_pace, hold_prefill, next_token_slack_ms, paced_tpot_ms, passes_gate,
                                   select_by_credit, trim_for_catch_up, vbs)
from scheduling.ttft_guard import MeasuredMargin, find_ttft_unattainable

log = logging.getLogger("kairos.scheduler")

TTFT_UNATTAINABLE = RejectReason.TTFT_UNATTAINABLE
TPOT_UNATTAINABLE = RejectReason.TPOT_UNATTAINABLE
OVERLOADED = RejectReason.OVERLOADED
SHED = RejectReason.SHED
GATE_LINE_REFRESH_S = 0.05  # Scheduler.gate_line's answer is reused this long
# the prefill hold's view of a round (`Scheduler._stall_room`): ms until a running reply's next token is due, the step
# predicted with a prefill of n tokens (q token pairs) beside the running decodes, and every such slack
Stall = tuple[float, Callable[[float, float], float], list[float]]


@dataclass(slots=True)
class StepPlan:
    prefill: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, RejectReason]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # where each prefill's computation stops this step (aligned with `prefill`): its num_tokens, or less for a
    # chunk of a longer prompt (chunked prefill), which samples no token
    prefill_ends: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0  # fixed when planned: the prompt tokens this step computes
    num_prefill_sq: float = 0.0  # and their attention work in token pairs (predictor.prefill_sq, summed)
    decode_mean_len: float = 0.0  # mean context of the decodes, fixed when planned
    # prefix caching: each request of the forward as launched, the tokens whose KV the step computes, and its
    # preemptions then (the blocks it may cache once the step lands: `landed`)
    kv_ends: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    def num_prefill_tokens_now(self) -> int:
        """The prompt tokens the planned prefills compute this step (before the step runs)."""
        return sum(end - r.num_computed_tokens for r, end in zip(self.prefill, self.prefill_ends))

    def prefill_sq_now(self) -> float:
        """Their attention work in token pairs (before the step runs): `LatencyModel.prefill_ms`'s q."""
        return sum(prefill_sq(r.num_computed_tokens, end) for r, end in zip(self.prefill, self.prefill_ends))

    @property
    def requests(self) -> list[Request]:
        """The requests that sample a token this step, in the order of the model's output rows: the prefills
        this step completes, then the decodes. A prefill chunk that leaves prompt for later steps has no row."""
        return [r for r, end in zip(self.prefill, self.prefill_ends) if end == r.num_tokens] + self.decode

    @property
    def forward(self) -> list[Request]:
        """Every request in this step's forward pass (chunks included)."""
        return self.prefill + self.decode


def _namespace(r: Request) -> tuple[int, str | None] | None:
    """Whose cached blocks `r` may share (prefix caching): its LoRA adapter's and its cache_salt's (None: the base
    model's, unsalted)."""
    return None if not r.lora_id and r.cache_salt is None else (r.lora_id, r.cache_salt)


def _priority(r: Request) -> int:
    return r.priority


def _rank(r: Request) -> tuple[int, float]:
    """Priority scheduling's order of preemption: the highest (priority, arrival) goes first (vLLM's)."""
    return r.priority, r.arrival_s


def _tpot_of(r: Request) -> float:
    return r.tpot_slo_ms


class Scheduler:
    """Owns the waiting and running requests, their KV blocks (its own `BlockManager`) and every change to a
    `Request`: admission, preemption, the step's bookkeeping (`postprocess`) and finishing (`finish`)."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 eos_token_ids: list[int] | tuple[int, ...] = (), predictor: LatencyModel | None = None,
                 tokenizer_fingerprint: str | None = None, tokenizer: Any = None) -> None:
        self.config = config
        self.flags = config.flags()
        self.blocks = BlockManager(num_blocks, block_size, caching=config.enable_prefix_caching)
        # prefix caching since start (metrics, vLLM's): the tokens admissions looked up, and those found cached
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._price(predictor)
        # the length predictor where it is on: the one that counts lengths in the served model's tokens
        # (`tokenizer_fingerprint`: length_predictor.tokenizer_fingerprint), else a words-only one bound to the served
        # `tokenizer`, else (set explicitly) the configured one as it is (`for_served_model`)
        self.lengths = None
        if self.flags.length_predictor:
            self.lengths = for_served_model(config.length_predictor_path, tokenizer_fingerprint, tokenizer,
                                            explicit=bool(config.length_predictor))
        # the served replies' lengths over the predictor's (length_calibration), by which its lengths are scaled
        self.length_cal = LengthCalibration(config.length_calibration_half_life) \
            if self.lengths is not None and self.flags.length_calibration else None
        if self.lengths is None:  # a policy ranks requests by their work only with length information (PRESETS)
            self.flags = replace(self.flags, **{k: False for k in ("short_first", "work_shedding", "impatient_reserve",
                                                                   "urgent_first") if getattr(config, k) is None})
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._round = 0
        self.num_preemptions = 0  # since start (metrics)
        # the requests turned away while every seat (max_num_seqs) was taken, since start (metrics: many, and the seats
        # rather than the policy's own limits bound the batch)
        self.num_rejected_seats_full = 0
        self.last_vbs = 0.0
        self.correction = (ItlCorrection(tau_ms=config.correction_tau_ms, hi=config.correction_max,
                                         idle_prior_ms=config.correction_idle_prior_ms)
                           if self.flags.itl_correction else None)
        self.last_correction = 1.0
        self.last_step_correction = 1.0
        # the share of the measured prefill stalls the gate counts (`_window_factor`); with stall_share_target it
        # follows the paced replies that end over their TPOT (`finish`)
        self.stall_share = config.correction_stall_share
        self._gate_line: tuple[float, tuple[float, float]] | None = None  # (when, line): gate_line's last answer
        self._line_len = 0.0  # and the mean mid-reply context it was drawn at
        self.model_error = StepModelError()  # the model against the served decode-only steps, by rows (stats)
        self._fill_off_until = -math.inf  # fill_steps: suspended until then (a paced reply ended over its TPOT)
        self.floor = (TierFloor(config.tier_floor_share, config.tier_floor_window_s)
                      if self.flags.tier_floor else None)
        self._held: list[Request] = []  # starved-tier requests the batch is draining for (tier floor)
        # vLLM's priority scheduling: requests ranked by `priority` before anything the policy weighs
        self.by_priority = config.by_priority
        self._evicted: list[Request] = []  # waiting requests a more urgent one's arrival turned away (`_evict_for`)
        # a running prompt is partly computed (without chunked_prefill: a best-effort one in chunks,
        # `_best_effort_end`), and the chunk ends of this round's admissions that stop short of their prompt (by id)
        self._partial = False
        self._first_chunks: dict[int, int] = {}
        self.shedder = (WorkShedder(config.shed_target, config.shed_window_s)
                        if self.flags.work_shedding else None)
        self.last_shed_threshold = math.inf
        self.pace_cost: PaceCost | None = None  # work in machine time (pace_work), over the latency model
        self._set_pace_cost()
        # the time between finished replies, and the impatient arrivals (impatient_reserve; urgent_first measures the
        # former only)
        self.reserve = ImpatientReserve(config.impatient_window_s) \
            if self.flags.impatient_reserve or self.flags.urgent_first else None
        self.margin = MeasuredMargin(config.ttft_margin_ms, config.ttft_margin_quantile,
                                     window_s=config.ttft_margin_window_s) \
            if self.flags.measured_margin else None

    # --- queue membership ---
    def add(self, req: Request) -> str | None:
        """Queue a new request; returns a rejection reason instead when the queue is full."""
        # a reply that only its cap ends is as long as its cap (ignore_eos_length): nothing to predict
        if self.lengths is not None and req.predicted_len is None and not req.slo.output_len_hint \
                and not (self.config.ignore_eos_length and req.params.runs_to_cap):
            self._predict_length(req)
        if self.shedder is not None:
            self.shedder.arrived(self._work(req, pace=self._pace()), req.arrival_s)
        if self.reserve is not None:
            self.reserve.arrived(req.arrival_s, (req.deadline_s - req.arrival_s) * 1000.0, req.tpot_slo_ms,
                                 self._mid_len(req))
        if len(self.waiting) >= self.config.max_waiting and not self._evict_for(req):
            if self.floor is not None:
                self.floor.rejected(req.tpot_slo_ms, req.arrival_s)
            if self.shedder is not None:
                self.shedder.saturated(req.arrival_s)
            if self.seats_taken():
                self.num_rejected_seats_full += 1
            return OVERLOADED
        req.status = Status.WAITING
        self._peek(req)
        self.waiting.append(req)
        if self.floor is not None:
            self.floor.arrived(req.tpot_slo_ms, req.arrival_s, self._mid_len(req))
        return None

    def _evict_for(self, req: Request) -> bool:
        """Priority scheduling with the queue full: the fresh waiting request of the highest priority value (the
        latest of them) makes room for `req` where `req`'s value is lower; it is turned away as overloaded at the
        next schedule (`_evicted`), as `req` would have been. Whether one made room."""
        if not self.by_priority:
            return False
        worst = max((r for r in self.waiting if r.first_token_s is None), key=lambda r: (r.priority, r.arrival_s),
                    default=None)
        if worst is None or worst.priority <= req.priority:
            return False
        self.waiting.remove(worst)
        self._evicted.append(worst)
        return True

    def _predict_length(self, req: Request) -> None:
        """The length predictor's expectations for `req`, from its question (a chat request's last user message) or
        else its prompt: with a planning quantile, that quantile everywhere; else the predicted distribution's mean
        (and its mean above the tokens out, as the reply runs: length_outlook), each of the reply as its max_tokens
        (or the window) may cut it: E[min(length, cap)], not min(E[length], cap), which plans for the cap wherever the
        distribution reaches past it (`conditional_means`); and for the VBS gate the policy's
        gate quantile (a bound the reply seldom outruns; 0: the mean), every length at the scale of the replies served
        so far where length_calibration is on (that mean over the scale kept to compare the reply with: `finish`); a
        request's min_tokens takes the distribution above it (`outlook_from`). It
        never raises: a prediction is advice, and a request the predictor fails on plans for its cap (logged), its
        neighbours and the engine unharmed. It runs on the worker between steps (its cost bounded:
        length_predictor.READ_MAX): on another thread of the engine's process it would hold the GIL in the middle of
        steps."""
        try:
            p = self.lengths.probs(req.question_ids or req.prompt_token_ids)
        except Exception:  # noqa: BLE001 - one request's odd prompt must not end the worker's loop
            log.warning("length prediction failed for request %s; it plans for max_tokens", req.request_id,
                        exc_info=True)
            return
        q, scale = self.config.length_predictor_quantile, self.lengths.scale
        cal = self.length_cal.scale if self.length_cal is not None else 1.0
        floor = req.params.min_tokens  # a reply at least this long: the distribution above it
        cap = self._reply_cap(req)  # ...and at most this long: every expectation is of min(length, cap)
        if q is not None:
            req.predicted_len = length_quantile(p, q, scale * cal, floor)
            if self.length_cal is not None:  # the mean is what the replies' lengths are compared with
                # (above min_tokens and within the cap in the calibrated scale, as the mean path's: both are in
                # served tokens)
                req.length_base = outlook_from(conditional_means(p, scale * cal, cap), floor)[0] / cal
            return
        req.length_outlook = outlook_from(conditional_means(p, scale * cal, cap), floor)
        # the calibrated expectation over the scale: at the scale the replies bear out, the replies' lengths over
        # these is that scale (a capped one's included, as the reply the cap may cut is what the expectation is of)
        req.length_base = req.length_outlook[0] / cal
        req.predicted_len = max(1, int(round(req.length_outlook[0])))
        if self.flags.length_gate_quantile > 0:
            req.gate_len = max(req.predicted_len,
                               length_quantile(p, self.flags.length_gate_quantile, scale * cal, floor))

    def _reply_cap(self, req: Request) -> int:
        """The most tokens `req`'s reply can have: its max_tokens, within the window's rest."""
        return min(req.params.max_tokens, self.max_model_len - req.num_prompt_tokens)

    def finish(self, req: Request, reason: FinishReason, now: float) -> bool:
        """End a request (any reason): leave the queues, free its KV blocks. False if it had already ended."""
        if req.status is Status.FINISHED:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
            if not self.running:  # idle: no step will set it again until a request runs
                self.last_vbs = 0.0
            if self.reserve is not None:
                self.reserve.finished(now)
        else:
            for queue in (self.waiting, self._evicted):  # (one a more urgent arrival evicted: ended before its turn)
                try:
                    queue.remove(req)
                    break
                except ValueError:
                    pass
        # (a request that failed may have left KV that is not its tokens': none of its own blocks stays cached)
        self._release(req, keep_cached=reason is not FinishReason.ERROR)
        while req.token_ids and req.token_ids[-1] < 0:  # placeholders of tokens it will not get (`launched`)
            req.token_ids.pop()
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_s = now
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):  # cut short: it says nothing of its length or pace
            return True
        # a reply that ended as soon as min_tokens let it (at min_tokens, or on the EOS or stop right after them) says
        # only that it would have been shorter: not a length
        floor = req.params.min_tokens
        if self.length_cal is not None and req.length_base is not None \
                and not (floor > 0 and req.num_output_tokens <= floor + (reason is FinishReason.STOP)):
            self.length_cal.observe(req.length_base, req.num_output_tokens, self._reply_cap(req))
        if math.isfinite(req.tpot_slo_ms):
            missed = self._missed_tpot(req, now)
            if self.flags.fill_steps and missed:
                self._fill_off_until = now + self.config.fill_pause_s
            target = self.config.stall_share_target
            if target is not None and self.correction is not None and req.num_output_tokens > 1:
                self.stall_share = min(1.0, max(self.config.correction_stall_share, self.stall_share
                                                + self.config.stall_share_step * ((1.0 if missed else 0.0) - target)))
        return True

    @staticmethod
    def _missed_tpot(req: Request, now: float) -> bool:
        """Whether a reply ending now took longer per token than its TPOT SLO (first token to last)."""
        n = req.num_output_tokens - 1
        return req.first_token_s is not None and n > 0 and math.isfinite(req.tpot_slo_ms) \
            and (now - req.first_token_s) * 1000.0 > req.tpot_slo_ms * n

    def ttft_margin_ms(self, prefill_ms: float | None = None, idle: bool | None = None) -> float:
        """The TTFT guard's margin now, for a request whose predicted prefill is `prefill_ms` (None: a typical one):
        measured (`MeasuredMargin`; with nothing running, or `idle`, an idle replica's: `ttft_guard.idle_margin_at`)
        or the configured one."""
        if self.margin is None:
            return self.config.ttft_margin_ms
        return self.margin.margin_ms(prefill_ms, idle=not self.running if idle is None else idle)

    def set_predictor(self, predictor: LatencyModel | None) -> None:
        """A new latency model (a re-profile); the engine calls it on its worker thread, between steps."""
        self._price(predictor)
        self._gate_line = None
        self._set_pace_cost()

    def _price(self, model: LatencyModel | None) -> None:
        """`latency`: the step-time model as fitted; `predictor`: what the decisions read, the same model, or where
        it prices LoRA adapters (an engine that serves them), the model with the adapters of the running batch
        (`Adapters`, kept up to date by `schedule`)."""
        self.latency = model
        self._adapters = Adapters(model) if model is not None and model.prices_adapters else None
        self.predictor: LatencyModel | Adapters | None = self._adapters or model

    def _set_adapters(self, n: int) -> None:
        """The LoRA adapters the decisions price the steps with (`Adapters`; a LoRA engine's model only)."""
        if n != self._adapters.adapters:
            self._adapters.adapters = n
            if self.pace_cost is not None:
                self.pace_cost.use_model(n)

    def _set_pace_cost(self) -> None:
        if self.flags.pace_work and self.predictor is not None:
            self.pace_cost = PaceCost(self.predictor.itl_ms, self.flags.vbs_margin, self.config.vbs_slack,
                                      self.config.max_num_seqs)
        else:
            self.pace_cost = None

    def _pace(self) -> float:
        """The running batch's pace: its strictest TPOT SLO (+inf: none)."""
        return min([r.tpot_slo_ms for r in self.running], default=math.inf)

    def seats_taken(self) -> bool:
        """Whether every seat (max_num_seqs) runs a request."""
        return len(self.running) >= self.config.max_num_seqs

    def has_work(self) -> bool:
        """Whether a schedule has something to do: requests waiting or running, or ones a more urgent arrival
        evicted (turned away at the next schedule: without it they never ended)."""
        return bool(self.waiting or self.running or self._evicted)

    @staticmethod
    def _start(req: Request) -> int:
        """Where its prompt's computation stands: its computed tokens, or while it waits, its cached prefix."""
        return req.num_computed_tokens or req.prefix_hit

    def _cost(self, req: Request) -> int:
        return min(len(req.token_ids) - self._start(req), self.max_model_len)

    def _cost_sq(self, req: Request) -> float:
        """The attention work (token pairs) of its `_cost` tokens, from where its prompt's computation stands."""
        start = self._start(req)
        return prefill_sq(start, start + self._cost(req))

    # --- prefix caching ---
    def _peek(self, req: Request) -> list:
        """The cached blocks `req` (which holds none) could start with now, at least its last token left to compute;
        sets its prefix_hit. Its last lookup's blocks still cached stand; it goes on from them only where blocks were
        cached since. Nothing where caching is off or its prompt is computed whole (it asks for the prompt's
        log-probabilities, vLLM's rule)."""
        bm = self.blocks
        if not bm.caching or req.block_table or req.params.prompt_logprobs is not None:
            req.prefix_hit, req.prefix_nodes, req.prefix_seen = 0, [], None
            return []
        nodes = req.prefix_nodes
        if len(nodes) * bm.block_size >= req.num_tokens:  # its tokens shrank below its last lookup (a placeholder
            req.prefix_seen = None                         # taken back, `engine._resolve`): looked up afresh
        if req.prefix_seen == bm.added and (not nodes or nodes[-1].block >= 0):
            return nodes
        hits = bm.lookup(req.token_ids, min(req.num_tokens - 1, self.max_model_len),
                         nodes if req.prefix_seen is not None else None, _namespace(req))
        req.prefix_nodes, req.prefix_seen, req.prefix_hit = hits, bm.added, len(hits) * bm.block_size
        return hits

    def _claim(self, req: Request, hits: list) -> None:
        """`req`, admitted, starts with the cached blocks `hits` (`_peek`'s, this round): their tokens are computed."""
        bm = self.blocks
        if not bm.caching:
            return
        bm.share(req, hits)
        n = len(hits) * bm.block_size
        req.num_computed_tokens, req.prefix_hit, req.prefix_nodes, req.prefix_seen = n, 0, [], None
        req.cache_tail, req.num_registered, req.num_shared = (hits[-1] if hits else bm.root_of(_namespace(req))), \
            len(hits), len(hits)
        if req.first_token_s is None and not req.num_preemptions:
            req.num_cached_tokens = n
        # (one computed whole looked nothing up; one preempted finds its own blocks again, which vLLM counts apart:
        # counted here, its hits would overstate what requests share under memory pressure)
        if req.params.prompt_logprobs is None and not req.num_preemptions:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += n

    def _release(self, req: Request, keep_cached: bool = True) -> None:
        self.blocks.free(req, keep_cached, req.num_shared)
        req.cache_tail, req.num_registered, req.num_shared, req.prefix_nodes = None, 0, 0, []

    def landed(self, plan: StepPlan) -> None:
        """A launched step ran (its requests that failed have ended): each request still running as it was launched
        caches its full blocks of tokens whose KV the step computed, for the requests after it (prefix caching)."""
        running, bs = Status.RUNNING, self.blocks.block_size
        for r, end, epoch in plan.kv_ends:
            if r.status is not running or r.num_preemptions != epoch or r.cache_tail is None:
                continue
            ids = r.token_ids
            full = min(end, len(ids)) // bs
            while full > r.num_registered and min(ids[(full - 1) * bs:full * bs]) < 0:
                full -= 1  # a block with a token still on its way (overlap scheduling: the tail's)
            if full > r.num_registered:
                r.cache_tail = self.blocks.register(r, ids, r.num_registered, full, r.cache_tail)
                r.num_registered = full

    # --- the step decision ---
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        f = self.flags
        if self._evicted:  # (counted below with the round's rejections)
            plan.rejected += [(r, OVERLOADED) for r in self._evicted]
            self._evicted.clear()
        if self._adapters is not None:  # the LoRA adapters the batch's decode steps run through
            self._set_adapters(len({r.lora_id for r in self.running if r.lora_id}))
        busy = bool(self.running)
        if self.margin is not None:
            self.margin.expire(now)
        if self.blocks.caching:  # what each waiting prompt finds cached now: its cost, for every decision below
            for r in self.waiting:
                self._peek(r)
        if f.queue_order == "ldf" and f.sort_before_reject:
            order_waiting(self.waiting, "ldf")
        # priority scheduling: the guard walks the queue as it will be served, the lower priorities after the rest
        ranked = self.by_priority and order_by_priority(self.waiting)
        if f.ttft_reject and self.predictor is not None and self.waiting:
            # walked in the order served: the prompts in progress (their chunks go first) and the preempted replies
            # (their recompute) count ahead of the fresh requests after them, and are never turned away
            ahead = [r for r in self.running if self._mid_prefill(r) and math.isfinite(r.deadline_s)] \
                if self.config.chunked_prefill or self._partial else []
            walk = [*ahead, *self.waiting] if ahead else self.waiting
            for r in find_ttft_unattainable(walk, now, self.predictor.prefill_ms, self.ttft_margin_ms, self._cost,
                                            cost_sq=self._cost_sq, kept=_started):
                self.waiting.remove(r)
                plan.rejected.append((r, TTFT_UNATTAINABLE))
        if f.queue_order == "ldf" and not f.sort_before_reject:
            order_waiting(self.waiting, "ldf", ranked)
        # the measured time between finished replies, once a step (urgent_first's order, impatient_reserve's room)
        patience = self.reserve.patience_ms(now) if self.reserve is not None else None
        if f.short_first:  # the TTFT guard above walked the queue by deadline; room goes to the least work
            pace = self._pace()
            # (a request without a TPOT SLO weighs nothing to shedding, but is not the least work: it goes after
            # the paced ones, as LDF sends best effort last)
            order_least_work(self.waiting,
                             lambda r: self._work(r, r.expected_output_len - r.num_output_tokens, pace)
                             if r.tpot_slo_ms != math.inf else math.inf,
                             now + patience / 1000.0 if f.urgent_first and patience is not None else -math.inf,
                             ranked)
        budget = self.config.prefill_max_tokens
        partial = self.config.chunked_prefill or self._partial
        self._partial = False
        if partial:  # prompts in progress go first (a best-effort one's chunk after this round's admissions)
            budget = self._continue_prefills(plan, budget, now, best_effort=False)
        if budget is None or budget > 0:
            admitted = self._admit(now, plan, budget, patience)
            plan.prefill += admitted
            ends, chunked = self._first_chunks, self.config.chunked_prefill
            plan.prefill_ends += [ends.get(id(r)) or (self._chunk_end(r, budget) if chunked else r.num_tokens)
                                  for r in admitted]
            if ends:
                self._partial = True
                ends.clear()
        if partial and self._be_chunks and not self.config.chunked_prefill:  # in what the admissions left of it
            left = self.config.prefill_max_tokens
            self._continue_prefills(plan, None if left is None else left - plan.num_prefill_tokens_now(), now,
                                    best_effort=True)
        if self.floor is not None:
            for r, _ in plan.rejected:
                self.floor.rejected(r.tpot_slo_ms, now)
        if self.shedder is not None and busy and any(self._for_capacity(r, reason, now) for r, reason in plan.rejected):
            self.shedder.saturated(now)
        if plan.rejected and self.seats_taken():
            self.num_rejected_seats_full += len(plan.rejected)
        if not self.running:
            self.last_vbs = 0.0
        if len(self.running) > len(plan.prefill) and (f.hybrid_steps or not plan.prefill):
            plan.decode = self._select_decode(plan, now)
        plan.num_prefill_tokens = plan.num_prefill_tokens_now()
        plan.num_prefill_sq = plan.prefill_sq_now()
        if plan.decode:
            plan.decode_mean_len = sum([len(r.token_ids) for r in plan.decode]) / len(plan.decode)
        return plan

    @property
    def _be_chunks(self) -> bool:
        """Whether a best-effort prompt goes in chunks beside running replies (prefill_hold; only where they decode
        beside a prefill, hybrid_steps: else each chunk's step would stall them all)."""
        return self.flags.prefill_hold and self.flags.hybrid_steps

    def _continue_prefills(self, plan: StepPlan, budget: int | None, now: float, best_effort: bool) -> int | None:
        """The running requests whose prompt is only partly computed, each its next chunk within `budget` (chunked
        prefill, or a best-effort prompt admitted beside running replies): those with a deadline (every one where
        best-effort prompts do not go in chunks of their own, `_be_chunks`) before this round's admissions, the
        best-effort ones (`best_effort`) after them in what the admissions left of the budget, each at least a block
        on (none starves) and within the step paced replies can take (`_best_effort_end`), the rest of one left running
        alone whole (as one admitted alone). Returns the budget left; sets `_partial` where a prompt is still
        in progress after this step."""
        be_chunks = self._be_chunks
        be_last = be_chunks and not self.config.chunked_prefill  # (chunked prefill: all in progress go first)
        stall: Stall | None | bool = be_chunks  # True: not read yet
        planned = {id(r) for r in plan.prefill} if best_effort else ()  # this round's admissions have their chunk
        # a best-effort prompt alone (nothing beside it, none admitted this round, none waiting): the rest goes whole
        alone = len(self.running) == 1 and not self.waiting
        # priority scheduling: the prompts of the lower priority values take the budget first
        mid = filter(self._mid_prefill, self.running)
        for r in sorted(mid, key=_priority) if self.by_priority else mid:
            if (be_last and math.isinf(r.deadline_s)) != best_effort or id(r) in planned:
                continue
            if best_effort:
                end = self._chunk_end(r, None if budget is None or alone else max(budget, self.blocks.block_size))
            elif budget is not None and budget <= 0:
                self._partial = True
                continue
            else:
                end = self._chunk_end(r, budget)
            if be_chunks and math.isinf(r.deadline_s):
                if stall is True:
                    stall = self._stall_room(now)
                end = self._best_effort_end(r, stall or None, plan.num_prefill_tokens_now(), plan.prefill_sq_now(),
                                            end, len(self.running) > 1)
            plan.prefill.append(r)
            plan.prefill_ends.append(end)
            self._partial |= r.num_tokens - end > 1
            if budget is not None:
                budget -= end - r.num_computed_tokens
        return budget

    def _best_effort_end(self, r: Request, stall: Stall | None, step_tokens: int,
                         step_sq: float, end: int, beside: bool) -> int:
        """prefill_hold for a best-effort prompt, which has no deadline to wait against: where its computation stops
        this step (at most `end`, which the caller keeps within the step's prompt budget). `beside` running replies,
        its chunk takes no longer than a fresh prompt of prefill_max_tokens (deep in a long prompt a token attends
        to all before it); with paced replies (`stall`) the step (`step_tokens` / `step_sq` of prefill before it,
        its chunk, the decodes) also ends before the first one's next token is due, as `_hold` predicts it. The rest
        goes in later steps, at least a block a step, so that it always progresses."""
        start, budget, model = self._start(r), self.config.prefill_max_tokens, self.predictor
        tests: list[Callable[[int], bool]] = []
        if beside and budget and model is not None:
            cap = model.prefill_ms(budget, prefill_sq(0, budget))
            tests.append(lambda e: model.prefill_ms(e - start, prefill_sq(start, e)) <= cap)
        if stall and model is not None:
            limit, step_of, _ = stall
            k = self.flags.vbs_margin
            tests.append(lambda e: step_of(step_tokens + e - start, step_sq + prefill_sq(start, e)) * k <= limit)

        def fits(e: int) -> bool:
            return all(t(e) for t in tests)

        if fits(end):
            return end
        lo, hi = min(end, start + self.blocks.block_size), end
        if not fits(lo):
            return lo
        while hi - lo > 1:  # the step grows with the chunk: the longest that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    @staticmethod
    def _mid_prefill(r: Request) -> bool:
        """A running request whose prompt is only partly computed (chunked prefill). With one token left it is
        an ordinary decode: that step computes the last prompt token and samples the first output token."""
        return r.num_tokens - r.num_computed_tokens > 1

    def _chunk_end(self, r: Request, budget: int | None) -> int:
        """Chunked prefill: where a request's computation stops this step, `budget` prompt tokens on (for one
        admitted this round: its `_cost` is capped at the round's budget, so the round's chunks fit it in order)."""
        return r.num_tokens if budget is None else min(r.num_tokens, r.num_computed_tokens + budget)

    def _admit(self, now: float, plan: StepPlan, budget: int | None, patience: float | None = None) -> list[Request]:
        """This round's admissions under `budget` prompt tokens (None: no budget); `patience`: the reserve's
        measured time between finished replies now (ms; None: none measured)."""
        cap = self.config.max_num_seqs - len(self.running)
        if cap <= 0 or not self.waiting:
            return []
        f = self.flags
        self._round += 1
        force_fifo = f.force_fifo_every > 0 and self._round % f.force_fifo_every == 0
        gate = None
        if f.vbs_gate and self.predictor is not None:
            model = itl = self.predictor.itl_ms
            if self.correction is not None:
                # the static margin already covers up to k of inflation; scale only by what it does not. Steps
                # measured faster than the model (a fit taken during a stall) scale it down, the margin kept.
                self.last_correction = self._gate_factor(now)
                self.last_step_correction = self.correction.step_factor(now)
                scale = self._gate_scale(self.last_correction)
                if self.pace_cost is not None:
                    self.pace_cost.set_scale(scale)
                corr, by_rows = self.correction, self.config.correction_by_rows
                # an empty replica: a request that will decode alone gets the idle factor; a burst joining it, the
                # window's (its own prefills will stall it as the last ones did)
                alone = None if self.running else scale
                busy = scale if self.running else self._gate_scale(self._window_factor(now))

                def itl(b: float, length: float) -> float:
                    if alone is not None and b <= 1.0:
                        return model(b, length) * alone
                    return model(b, length) * (self._gate_scale(corr.factor(now, math.ceil(b))) if by_rows else busy)
            gate = VBSGate(self.running, itl, margin=self.flags.vbs_margin,
                           slack=self.config.vbs_slack, best_effort_trp=self.config.best_effort_trp,
                           monotone_skip=f.monotone_skip, output_len_estimate=lambda r: r.gate_output_len,
                           running_tpot=self.pace_of(now),
                           remaining_of=self._output_left if f.gate_context == "horizon" else None,
                           # "would it pass on an idle replica" (a request waiting for room, the tier floor, the
                           # reserve; asked of a few, so read as asked) is judged as a rejection's capacity is
                           # (`_for_capacity`): the idle factor, not the busy batch's stalls
                           idle_itl=lambda length: model(1.0, length) * self.judge_gate_scale(now))
        kv_full = False
        self._held = [r for r in self._held if r.status is Status.WAITING]
        held = {tpot_class(r.tpot_slo_ms) for r in self._held}  # reserved: only these classes are admitted
        room = self._floor_reservation(gate, now)  # (tpot, length) of a starved tier to keep VBS room for
        shed_above = self._shed_threshold(now)
        # priority scheduling: a request is shed only where none of a higher priority value waits (they go first)
        shed_from = max([r.priority for r in self.waiting if r.first_token_s is None], default=0) \
            if self.by_priority and shed_above != math.inf else None
        round_tokens, round_sq = 0, 0.0
        chunked = self.config.chunked_prefill and budget is not None
        be_chunks = self._be_chunks
        # what the step's prefill computes: prompts in progress, then this round's (chunked: their first chunks)
        step_tokens, step_sq = plan.num_prefill_tokens_now(), plan.prefill_sq_now()
        step0 = step_tokens
        # Read only once a candidate passes the gate (most rounds admit none): the running batch, the model and the
        # reserve do not change within the round. stall: `Stall` (ms to a reply's next token, the step with a
        # prefill beside the decodes, every such slack in order); impatient:
        # (patience ms, (tpot, length) of a typical impatient arrival), the room a patient request leaves (reserve.py)
        stall: Stall | None | bool = f.prefill_hold  # True: not read yet
        impatient: tuple[float, tuple[float, float]] | None | bool = \
            f.impatient_reserve and self.reserve is not None and gate is not None and patience is not None
        pace = self._pace()  # the batch's, for work shedding
        # hybrid steps: the blocks the running replies' decodes take in this same step are not free for a prompt
        # (else the decode preempts an older reply for the newcomer's sake); read once a candidate gets that far
        decode_blocks: int | None = None if f.hybrid_steps else 0

        # the LoRA adapters the batch will run through (a LoRA engine's model prices them): the running requests',
        # this round's admissions', and the candidate's own while it is judged
        loras = {q.lora_id for q in self.running if q.lora_id} if self._adapters is not None else None
        # priority scheduling: the lowest priority of a request that waits for room this round (none of a higher
        # one is admitted ahead of it); `yields`: the candidate judged last waits to leave room to others' tiers
        waits_at: int | None = None
        yields = False

        def accept(r: Request) -> Verdict:
            nonlocal kv_full, round_tokens, round_sq, step_tokens, step_sq, pace, stall, impatient, decode_blocks
            nonlocal yields
            yields = False
            if kv_full:
                return Verdict.STOP
            if loras is not None:
                self._set_adapters(len(loras) + (bool(r.lora_id) and r.lora_id not in loras))
            # no threshold (+inf) sheds nothing: the request's work is not needed then
            if r.first_token_s is None and shed_above != math.inf and (shed_from is None or r.priority >= shed_from) \
                    and sheds(self._work(r, pace=pace), shed_above, r.tpot_slo_ms, pace, self.config.shed_pace_factor):
                plan.rejected.append((r, SHED))
                return Verdict.DROP
            if held and r.first_token_s is None and tpot_class(r.tpot_slo_ms) not in held:
                yields = True
                return Verdict.KEEP  # waits (not rejected) while the batch drains for a starved tier
            # a reply of one token ends at its prefill: no TPOT to keep, and none to pace the batch at
            decodes = r.params.max_tokens > 1 or r.first_token_s is not None
            if gate is not None and decodes and r.first_token_s is None and not gate.check(r):
                if self._hold_for_floor(r, gate, now):
                    held.add(tpot_class(r.tpot_slo_ms))
                    return Verdict.KEEP
                if f.short_first and self._wait_for_room(r, gate):
                    if self.shedder is not None:  # turned away for capacity as much as a rejection is
                        self.shedder.saturated(now)
                    return Verdict.KEEP  # the TTFT guard rejects it once its deadline is out of reach
                if self.config.tpot_on_fail == "reject" or (not self.running and not gate.admitted):
                    plan.rejected.append((r, TPOT_UNATTAINABLE))
                    gate.resume()  # it leaves: the ones after it are judged on their own, not all turned away
                    return Verdict.DROP
                return Verdict.STOP if gate.stopped else Verdict.KEEP
            # (a reply of one token leaves the batch at its prefill: it takes no room from a tier or the reserve)
            if room is not None and decodes and r.first_token_s is None \
                    and tpot_class(r.tpot_slo_ms) != tpot_class(room[0]) and not gate.leaves_room(r, *room):
                yields = True
                return Verdict.KEEP  # would take the starved tier's room: waits
            if impatient is True:
                room_for = self.reserve.room(now, patience, feasible=gate.feasible_alone)
                impatient = None if room_for is None else (patience, room_for)
            # (one without a TTFT deadline is never held for the reserve: nothing would end its wait)
            if impatient and decodes and r.first_token_s is None and math.isfinite(r.deadline_s) \
                    and (r.deadline_s - now) * 1000.0 > impatient[0] and not gate.leaves_room(r, *impatient[1]):
                yields = True
                return Verdict.KEEP  # it can wait for room: it leaves some for a request that cannot
            if stall is True:
                stall = self._stall_room(now)
            priced = self._cost(r)  # as the round's budget counted it
            hits = self._peek(r) if not r.block_table else []  # its cached prefix now (prefix caching)
            c, q = self._cost(r), self._cost_sq(r)
            if c > priced and round_tokens and (budget is None or min(c, budget) > min(priced, budget)):
                return Verdict.KEEP  # an admission of this round evicted its prefix: past what the budget counted
            chunk, chunk_sq = c, q  # what its prefill computes in this step (chunked: its first chunk)
            if chunked and c > budget:
                start = self._start(r)
                chunk, chunk_sq = budget, prefill_sq(start, start + budget)
            cut = None  # where a best-effort prompt's computation stops this step, short of `chunk`
            if be_chunks and r.first_token_s is None and math.isinf(r.deadline_s):
                # best effort: never held; beside running replies its prompt goes in chunks within what is left of
                # the budget (at least a block), each within the step paced replies can take
                start = self._start(r)
                end = start + chunk
                if budget is not None and self.running:
                    end = min(end, start + max(budget - (step_tokens - step0), self.blocks.block_size))
                end = self._best_effort_end(r, stall or None, step_tokens, step_sq, end, bool(self.running))
                if end < start + chunk:
                    cut, chunk, chunk_sq = end, end - start, prefill_sq(start, end)
            elif stall and r.first_token_s is None and self._hold(r, stall, step_tokens, step_sq, chunk, chunk_sq,
                                                                  now):
                return Verdict.KEEP
            if decode_blocks is None:
                decode_blocks = sum([self.blocks.extra_blocks_for(q, q.num_tokens) for q in self.running
                                     if not self._mid_prefill(q)])
            bm = self.blocks
            # (a cached prefix takes no new block, but the cached blocks nobody holds now count among the free)
            if bm.extra_blocks_for(r, r.num_tokens + 1) - len(hits) + bm.blocks_to_share(hits) + decode_blocks \
                    > bm.num_free:
                kv_full = True  # memory is head-of-line: wait for blocks to free up
                return Verdict.STOP
            self._claim(r, hits)
            bm.ensure(r, r.num_tokens)
            if cut is not None:
                self._first_chunks[id(r)] = cut
            round_tokens += c if cut is None else chunk  # (in chunks: only its first is in this step)
            round_sq += q if cut is None else chunk_sq
            step_tokens += chunk
            step_sq += chunk_sq
            if self.margin is not None and r.first_token_s is None and self.predictor is not None \
                    and id(r) not in self._first_chunks:  # (a prompt in chunks: its first token is steps away)
                r.ttft_estimate = (now, self.predictor.prefill_ms(round_tokens, round_sq), False)
            if decodes:
                pace = min(pace, r.tpot_slo_ms)
                if gate is not None:
                    gate.admit(r)
            if loras is not None and r.lora_id:
                loras.add(r.lora_id)
            if self.floor is not None and r.first_token_s is None:
                self.floor.admitted(r.tpot_slo_ms, now)
            return Verdict.ADMIT

        def ranked(r: Request) -> Verdict:
            """`accept`, in priority order: a request waits while one of a lower priority value waits for room
            (not one that waits only to leave room to a tier the tier floor or the impatient reserve keeps it for)."""
            nonlocal waits_at
            if waits_at is not None and r.priority > waits_at:
                return Verdict.KEEP
            verdict = accept(r)
            if verdict is Verdict.KEEP and not yields:
                waits_at = r.priority if waits_at is None else min(waits_at, r.priority)
            return verdict

        def capped(r: Request) -> int:  # chunked prefill: a prompt longer than the budget takes all of it
            return min(self._cost(r), budget)

        cost = capped if chunked else self._cost
        selected = take_for_prefill(
            self.waiting, cost=cost, max_reqs=min(self.config.prefill_max_batch_size, cap),
            max_tokens=budget, policy=f.admission,
            lookahead=self.config.prefill_admission_lookahead, force_fifo=force_fifo,
            accept=ranked if self.by_priority else accept, rank=_priority if self.by_priority else None)
        if loras is not None:
            self._set_adapters(len(loras))
        if len(selected) == 1 and not self.running and (est := selected[0].ttft_estimate) is not None:
            selected[0].ttft_estimate = (est[0], est[1], True)  # admitted alone (MeasuredMargin's idle table)
        for r in selected:
            r.status = Status.RUNNING
            if r.admitted_s is None:
                r.admitted_s = now
            r.credit = 0.0
            self.running.append(r)
        return selected

    def pace_of(self, now: float) -> Callable[[Request], float] | None:
        """pace_slack: the TPOT a running request counts at in the VBS gate and in its credits: its SLO's, plus
        `pace_slack_share` of what `paced_tpot_ms` (over its expected length) adds; None without it (its SLO's). A
        router's copy of the gate sums the same (EngineStats.tpot_inv_sum)."""
        if not self.flags.pace_slack:
            return None
        share = self.config.pace_slack_share

        def pace(r: Request) -> float:
            t = r.tpot_slo_ms
            if math.isinf(t):  # best effort: no pace
                return t
            return t + share * (paced_tpot_ms(r.first_token_s, r.num_output_tokens, r.expected_output_len, t, now) - t)
        return pace

    @staticmethod
    def _mid_len(r: Request) -> float:
        """The context length the gate sees for `r` over the rest of its reply: its prompt and the middle of the
        output still to come, from the tokens out to the output it plans for (a fresh request: half of it)."""
        return r.num_prompt_tokens + (r.num_output_tokens + r.gate_output_len) / 2.0

    @staticmethod
    def _output_left(r: Request) -> float:
        """The output a running reply is expected to have left (the gate's plan for it)."""
        return float(r.gate_output_len - r.num_output_tokens)

    def _wait_for_room(self, r: Request, gate: VBSGate) -> bool:
        """short_first: whether a fresh request the VBS gate turns away waits in the queue for room instead of being
        rejected: it has a TTFT deadline (so the wait is bounded), the batch it failed is not empty (others will
        finish and make room), and it would pass on an idle replica."""
        return math.isfinite(r.deadline_s) and bool(self.running or gate.admitted) \
            and gate.feasible_alone(r.tpot_slo_ms, self._mid_len(r))

    def _for_capacity(self, r: Request, reason: RejectReason, now: float) -> bool:
        """Whether a rejection says the replica is full (work shedding measures its capacity only then): not one
        of its own sheds, and not a request that would have been turned away by an idle replica too (a prompt
        whose prefill alone overruns its TTFT SLO, a TPOT below a one-request step), which arrive whatever the
        load: counted, they had the shedder measure "capacity" on a nearly empty batch and shed more."""
        if reason is SHED:
            return False
        if self.predictor is None:
            return True
        if reason is TTFT_UNATTAINABLE:
            alone_ms = self.predictor.prefill_ms(self._cost(r), self._cost_sq(r))
            return (r.deadline_s - r.arrival_s) * 1000.0 >= alone_ms + self.ttft_margin_ms(alone_ms, idle=True)
        if reason is TPOT_UNATTAINABLE:
            alone_ms = self.predictor.itl_ms(1.0, self._mid_len(r)) * self.judge_gate_scale(now)
            return passes_gate(alone_ms, self.flags.vbs_margin, self.config.vbs_slack, r.tpot_slo_ms)
        return True

    def _stall_room(self, now: float) -> Stall | None:
        """Prefill hold: how long a step may take before a running reply's next token is due (the least
        `next_token_slack_ms`), the step predicted now with a prefill of n tokens (q token pairs) beside the running
        decodes, and every such slack (in ascending order where `prefill_hold_replies` counts them: sorted once a
        round); None when no reply sets a limit. A reply already late for it by more than a decode step is behind
        its pace whatever the step, and sets none."""
        if self.predictor is None or not self.running:
            return None
        rows = len(self.running)
        decode_ms = self._decode_model(self.running, now)(rows)
        slacks = [x for r in self.running
                  if (x := next_token_slack_ms(r.first_token_s, r.num_output_tokens, r.tpot_slo_ms, now)) >= decode_ms]
        limit = min(slacks, default=math.inf)
        if math.isinf(limit):
            return None
        if self.config.prefill_hold_replies > 0:
            slacks.sort()
        model = self.predictor
        if model.mixed == "sum":
            return limit, lambda n, q: model.step_prefill_ms(n, q) + decode_ms, slacks
        mean_len = sum([len(r.token_ids) for r in self.running]) / rows
        return limit, lambda n, q: model.beside_ms(n, q, rows, mean_len) + decode_ms, slacks

    def _hold(self, r: Request, stall: Stall, step_tokens: int, step_sq: float, chunk: int,
              chunk_sq: float, now: float) -> bool:
        """Prefill hold for fresh `r`, whose prefill computes `chunk` prompt tokens (`chunk_sq` token pairs) in the
        step, beside the `step_tokens` (`step_sq`) of this round's admissions so far (chunked prefill: their first
        chunks; else their prompts): `hold_prefill`, and where its deadline leaves no room to wait, still held if the
        step would make at least `prefill_hold_replies` running replies late (their slack under it), as long as the
        TTFT guard bounds the wait (it turns the request away once its deadline is out of reach)."""
        deadline = r.deadline_s
        if math.isinf(deadline):
            return False  # best effort: no deadline to wait against, so it is never held
        limit, step_of, slacks = stall
        k = self.flags.vbs_margin  # the gate's margin on predicted steps: their error decides a miss here too
        step_ms = step_of(step_tokens + chunk, step_sq + chunk_sq) * k
        alone_ms = self.predictor.prefill_ms(self._cost(r), self._cost_sq(r))  # its first token: the whole prompt
        if hold_prefill(step_ms, limit, (deadline - now) * 1000.0, alone_ms, self.ttft_margin_ms(alone_ms)):
            return True
        n = self.config.prefill_hold_replies  # its deadline leaves no room: held only if it costs that many replies
        # the running paced replies the step would bring their next token late: of those `_stall_room` counts, the
        # ones whose slack is under the step
        return n > 0 and self.flags.ttft_reject and step_ms > limit and bisect.bisect_left(slacks, step_ms) >= n

    def _work(self, r: Request, tokens: int | None = None, pace: float = math.inf) -> float:
        """Work shedding's measure of `tokens` output tokens of `r` (default: all it expects) joining a batch paced
        at `pace` (ms): tokens / TPOT SLO; with pace_work the machine time they take (shedding.PaceCost). A stricter
        pace costs more per token (the gate fits fewer requests into a batch that steps every T ms); a request
        without a TPOT SLO weighs nothing, so best effort is left to the queue bound."""
        n = r.expected_output_len if tokens is None else tokens
        if self.pace_cost is not None:
            return self.pace_cost.work(n, r.tpot_slo_ms, pace, self._mid_len(r))
        return 0.0 if math.isinf(r.tpot_slo_ms) else n / r.tpot_slo_ms

    def _step_work(self, rows: list[Request]) -> float:
        """The work a step did: one token of each of `rows` at the step's pace, their strictest TPOT (the sum of
        `_work(r, 1, pace)`). No row's TPOT is below that pace, so none sets a faster one: a paced row's token costs
        what a token at the pace costs (PaceCost.token_ms at its mid-reply context), or 1 / its TPOT without
        pace_work; a row without a TPOT SLO nothing."""
        inf = math.inf
        if self.pace_cost is None:
            return sum((1.0 / r.tpot_slo_ms for r in rows if r.tpot_slo_ms != inf), 0.0)
        pace, lengths = inf, []
        for r in rows:  # one pass: the pace and each paced row's mid-reply context (`_mid_len`, inlined)
            t = r.tpot_slo_ms
            if t != inf:
                if t < pace:
                    pace = t
                lengths.append(r.num_prompt_tokens + (r.num_output_tokens + r.gate_output_len) / 2.0)
        return self.pace_cost.tokens_ms(pace, lengths) if lengths else 0.0

    def gate_line(self, now: float) -> tuple[float, float] | None:
        """The VBS gate as a line in the batch, for a router: a request joining this replica passes where
        `base + row * VBS' < T_min'` (VBS' the batch's virtual size with it, under the stricter of its TPOT and the
        batch's T_min'), the gate's margin, slack and step correction folded in, at the running batch's mean
        mid-reply context (an idle replica: the one its batch last had). None without a gate or a latency model.
        At most once every GATE_LINE_REFRESH_S (the stats snapshot asks every step; a router, every second or so)."""
        if not self.flags.vbs_gate or self.predictor is None:
            return None
        if self._gate_line is not None and now - self._gate_line[0] < GATE_LINE_REFRESH_S:
            return self._gate_line[1]
        if self.running:  # an idle replica: the context its batch last had (none yet: zero)
            self._line_len = sum(self._mid_len(r) for r in self.running) / len(self.running)
        length = self._line_len
        k = self.flags.vbs_margin / self.config.vbs_slack
        if self.correction is not None:
            k *= self._gate_scale(self._gate_factor(now))
        one, two = self.predictor.itl_ms(1.0, length), self.predictor.itl_ms(2.0, length)
        self._gate_line = (now, (k * (2.0 * one - two), k * (two - one)))
        return self._gate_line[1]

    def _gate_factor(self, now: float) -> float:
        """The measured step factor the gate scales its model by: the window's (`_window_factor`) while requests
        run; on a replica with none running, that of the steps a request decoding alone runs, the least of the last
        few seconds (`ItlCorrection.judge_factor`), since a request admitted now alone decodes without the stalls
        the last requests' prefills made (at most the factor the best TPOT it advertised lately was drawn with, so
        that the replica admits what it offered; a burst admitted together is gated with the window's, `_admit`)."""
        return self._window_factor(now) if self.running else self.correction.judge_factor(now)

    def _window_factor(self, now: float) -> float:
        """The factor over the recent steps with `stall_share` of their prefill stalls: from the model's error on
        the decode-only steps (none) to every step's wall time over the decode predicted (all)."""
        share, corr = self.stall_share, self.correction
        if share >= 1.0:
            return corr.factor(now)
        plain = corr.step_factor(now)
        return plain if share <= 0.0 else plain + share * (corr.factor(now) - plain)

    def idle_gate_scale(self) -> float:
        """The gate's scale of the model for what the steps of a request decoding alone measured lately
        (`ItlCorrection.idle_factor`; 1 without the correction). An idle replica's gate and its SLO floor take the
        least of it over a few seconds (`offer_gate_scale`, `judge_gate_scale`)."""
        return self._gate_scale(self.correction.idle_factor()) if self.correction is not None else 1.0

    def offer_gate_scale(self, now: float) -> float:
        """The scale the SLO floor an idle replica offers is drawn with: the least `idle_gate_scale` of the last few
        seconds (`ItlCorrection.offer_factor`)."""
        return self._gate_scale(self.correction.offer_factor(now)) if self.correction is not None else 1.0

    def judge_gate_scale(self, now: float) -> float:
        """The gate's scale on an idle replica, which an SLO is judged unattainable with: the least
        `idle_gate_scale` over a longer memory than the offer's (`ItlCorrection.judge_factor`), so that an SLO it
        offered is admitted and not judged unattainable moments later because a burst slowed the steps it
        measures."""
        return self._gate_scale(self.correction.judge_factor(now)) if self.correction is not None else 1.0

    def _gate_scale(self, factor: float) -> float:
        """The gate's scale of the model for a measured step factor: the static margin already covers up to k of
        inflation, so only what it does not; a factor under 1 (steps faster than the model) scales it down."""
        c = factor * self.config.correction_safety
        return c if c < 1.0 else max(1.0, c / self.flags.vbs_margin)

    def _shed_threshold(self, now: float) -> float:
        """Work shedding's threshold for this round: +inf (none) without it, on an idle replica, or on one not
        saturated now (no capacity rejection within the shedder's hold)."""
        self.last_shed_threshold = math.inf if self.shedder is None or not self.running \
            or not self.shedder.saturated_now(now) else self.shedder.threshold(now)
        return self.last_shed_threshold

    def _floor_reservation(self, gate: VBSGate | None, now: float) -> tuple[float, float] | None:
        if self.floor is None or gate is None or self.config.tier_floor_mode == "hold":
            return None
        room = self.floor.reservation(now)
        if room is None or not gate.feasible_alone(*room):
            return None
        return room

    def _hold_for_floor(self, r: Request, gate: VBSGate, now: float) -> bool:
        """Tier floor: hold a gate-failed request of a starved tier if it would pass on an idle replica."""
        if self.floor is None or self.config.tier_floor_mode == "reserve" \
                or not self.floor.starved(r.tpot_slo_ms, now):
            return False
        if not gate.feasible_alone(r.tpot_slo_ms, self._mid_len(r)):
            return False  # infeasible even alone: the floor does not apply, the gate's verdict stands
        if r not in self._held:
            self._held.append(r)
        return True

    def _select_decode(self, plan: StepPlan, now: float) -> list[Request]:
        be = self.config.best_effort_trp
        if plan.prefill or self.config.chunked_prefill or self._partial:
            fresh = set(plan.prefill)
            decoding = [r for r in self.running if r not in fresh and not self._mid_prefill(r)]
        else:
            decoding = self.running
        if any([r.token_ids[-1] < 0 for r in decoding]):
            # overlap scheduling: a request whose last token is on its way and ends it by length has nothing more
            # to compute (it ends when that token is resolved)
            decoding = [r for r in decoding if r.token_ids[-1] >= 0 or not self._length_reached(r, r.num_tokens)]
        t_min = min([r.tpot_slo_ms for r in self.running], default=math.inf)
        self.last_vbs = vbs(self.running, t_min, be)
        if self.flags.credit_batching:
            batch = select_by_credit(decoding, t_min, be, self._pace_guard(plan, decoding, t_min, now),
                                     self.pace_of(now))
        else:
            batch = list(decoding)
        if self.flags.catch_up and self.predictor is not None and len(batch) > 1:
            def afford(r: Request, extra_steps: int) -> float:
                return affordable_step_ms(r.first_token_s, len(r.token_ids) - len(r.prompt_token_ids),
                                          r.expected_output_len, r.tpot_slo_ms, now, extra_steps)
            kept = trim_for_catch_up(batch, self._step_ms_for(plan, batch, now), afford, pace=_tpot_of)
            if len(kept) < len(batch) and self.flags.credit_batching:
                stays = {id(r) for r in kept}
                for r in batch:  # sat this step out: a request that paid credit for it gets it back
                    if id(r) not in stays and r.tpot_slo_ms != t_min:
                        r.credit += 1.0
            batch = kept
        out: list[Request] = []
        block_size, running = self.blocks.block_size, Status.RUNNING
        # priority scheduling: the higher priorities take the blocks first, so a lower one is preempted for them
        for r in sorted(batch, key=_priority) if self.by_priority else batch:
            if r.status is not running:  # preempted earlier in this loop
                continue
            if len(r.block_table) * block_size >= len(r.token_ids):  # its blocks hold the step's token (`holds`)
                out.append(r)
                continue
            while not self.blocks.can_fit(r, r.num_tokens):
                victim = self._victim(out, plan)
                self._preempt(victim, plan)
                if victim is r:
                    break
            if r.status is Status.RUNNING:
                self.blocks.ensure(r, r.num_tokens)
                out.append(r)
        if self.by_priority and len(out) > 1:  # in the batch's order
            kept = {id(r) for r in out}
            out = [r for r in batch if id(r) in kept]
        return out

    def _step_ms_for(self, plan: StepPlan, batch: list[Request], now: float) -> Callable[[int], float]:
        """The predicted time of this step with n of `batch` decoding (`_decode_model`, plus the step's prefill)."""
        decode = self._decode_model(batch, now)
        beside = self._beside_model(plan, batch)
        return lambda n: beside(n) + decode(n)

    def _beside_model(self, plan: StepPlan, reqs: list[Request]) -> Callable[[int], float]:
        """What this step's prefill as planned so far adds to a decode step of n of `reqs` (non-empty) at their mean
        context (`LatencyModel.beside_ms`: its own prefill step, or where the fit found a hybrid step one forward, its
        tokens beside the decode rows); 0 without one."""
        if not plan.prefill:
            return lambda n: 0.0
        tokens, sq, model = plan.num_prefill_tokens_now(), plan.prefill_sq_now(), self.predictor
        if model.mixed == "sum":
            ms = model.step_prefill_ms(tokens, sq)
            return lambda n: ms
        mean_len = sum([len(r.token_ids) for r in reqs]) / len(reqs)
        return lambda n: model.beside_ms(tokens, sq, n, mean_len)

    def _decode_model(self, reqs: list[Request], now: float) -> Callable[[int], float]:
        """The predicted decode step with n rows at the mean context of `reqs` (non-empty), scaled by the model's
        measured error on the decode-only steps (`ItlCorrection.step_factor`; a step's prefill is the caller's to
        add), or by n rows' bucket's factor with correction_by_rows; 1 without the correction."""
        scale = self.last_step_correction if self.correction is not None else 1.0
        mean_len = sum([len(r.token_ids) for r in reqs]) / len(reqs)  # their num_tokens
        if self.correction is not None and self.config.correction_by_rows:
            corr = self.correction
            return lambda n: self.predictor.itl_ms(n, mean_len) * corr.factor(now, n)
        return lambda n: self.predictor.itl_ms(n, mean_len) * scale

    def _pace_guard(self, plan: StepPlan, decoding: list[Request], t_min: float, now: float
                    ) -> Callable[[Request, int], bool] | None:
        """kairos's pace guard for `select_by_credit`: a request its credit skipped decodes anyway when it is behind
        its TPOT (`behind_pace`) and the step, one request larger, is still predicted within T_min (the time the
        strictest request in the batch allows a step). With fill_steps, also whenever the step one request larger,
        its prefill included, is still predicted within what the VBS gate plans a step at T_min to take
        (slack x T_min / margin): credits then leave a request out only to keep a step within that plan, and the
        decode is work-conserving where the step hardly grows with the batch (a GPU), so loose replies do not
        linger in seats a seat-bound replica needs. It pauses for `fill_pause_s` after a paced reply ends over its
        TPOT (`finish`): where steps scatter (a CPU sharing its cores), steps filled to the plan leave a strict
        reply no room for a stall. Filling further, to what every decoding request could still afford
        (`affordable_step_ms`), ran steps at the edge of T_min and missed TPOTs."""
        f = self.flags
        if not (f.pace_guard or f.fill_steps) or self.predictor is None or math.isinf(t_min) or not decoding:
            return None
        decode = self._decode_model(decoding, now)
        limit = self.config.vbs_slack * t_min
        # fill: what the gate plans a step at T_min to take; none for a while after a paced reply missed its TPOT
        fill_limit = limit / f.vbs_margin if f.fill_steps and now >= self._fill_off_until else 0.0
        beside = self._beside_model(plan, decoding)

        def due(r: Request, batch: int) -> bool:
            step_ms = decode(batch + 1)
            prefill_ms = beside(batch + 1)
            if f.fill_steps and step_ms + prefill_ms <= fill_limit:
                return True
            return f.pace_guard and step_ms <= limit and behind_pace(
                r.first_token_s, r.num_output_tokens, r.tpot_slo_ms, now, step_ms + prefill_ms, step_ms)
        return due

    def _victim(self, batch: list[Request], plan: StepPlan) -> Request:
        """Preempt the most recently admitted request neither in this step's decode `batch` nor prefilled in it
        (vLLM's choice); with priority scheduling, the one of the highest priority value (the lowest priority), the
        latest to arrive of them, a prompt this step computes too (vLLM chooses over every running request): it
        leaves the step."""
        if self.by_priority:  # vLLM's: the highest (priority, arrival)
            victim = max((r for r in self.running if r not in batch), key=_rank, default=None)
            if victim is not None:
                if victim in plan.prefill:
                    k = plan.prefill.index(victim)
                    del plan.prefill[k], plan.prefill_ends[k]
                return victim
        else:
            for r in reversed(self.running):
                if r not in batch and r not in plan.prefill:
                    return r
        raise RuntimeError("KV cache too small for a single request")  # excluded by add-time validation

    def _preempt(self, r: Request, plan: StepPlan) -> None:
        self.running.remove(r)
        self._release(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        r.credit = 0.0
        r.status = Status.WAITING
        r.prefix_seen = None  # (its tokens grew: looked up afresh)
        self._peek(r)  # (its own blocks, those it cached, are the likeliest)
        self.waiting.appendleft(r)
        plan.preempted.append(r)

    # --- the step's bookkeeping ---
    def postprocess(self, plan: StepPlan, tokens: list[int | Exception], now: float
                    ) -> list[tuple[Request, int | Exception, FinishReason | None]]:
        """Record the step's sampled tokens (one per `plan.requests`, or the exception sampling raised for it):
        `launched` then `resolved`. Returns per request its token and the token-level verdict: STOP (EOS or a stop
        token id), LENGTH (max_tokens or the context window), ERROR (sampling failed), else None. Stop *strings*
        are text and the engine's; it ends such requests with `finish`."""
        reqs = plan.requests
        index = self.launched(plan, reqs)
        self.landed(plan)
        return self.resolved(reqs, index, tokens, now)

    def launched(self, plan: StepPlan, reqs: list[Request]) -> list[int]:
        """The step is on its way: its KV will be in the cache before any later step reads it, and each request that
        samples (`reqs`: `plan.requests` as planned) gets a placeholder for its token, -(row + 1) for its row of the
        step's tokens (`StepBatch`), until `resolved`. Returns where each placeholder sits in its request's token_ids
        (-1 for a request that has already ended: a failed step's)."""
        for req, end in zip(plan.prefill, plan.prefill_ends):
            if end < req.num_tokens:  # a chunk: its KV is in the cache now, no token yet
                req.num_computed_tokens = end
        index: list[int] = []
        finished = Status.FINISHED
        for row, req in enumerate(reqs):
            if req.status is finished:
                index.append(-1)
                continue
            n = len(req.token_ids)  # num_tokens
            req.num_computed_tokens = n
            index.append(n)
            req.token_ids.append(-(row + 1))
        if self.blocks.caching:
            plan.kv_ends = [(r, r.num_computed_tokens, r.num_preemptions) for r in plan.forward
                            if r.status is not finished]
        return index

    def resolved(self, reqs: list[Request], index: list[int], tokens: list[int | Exception], now: float
                 ) -> list[tuple[Request, int | Exception, FinishReason | None]]:
        """The sampled tokens of a `launched` step are known: each fills its placeholder. A request that ended
        meanwhile (overlap scheduling: it ended on the step before, or was aborted) is skipped."""
        out: list[tuple[Request, int | Exception, FinishReason | None]] = []
        eos, margin, finished, length_reached = self.eos_token_ids, self.margin, Status.FINISHED, self._length_reached
        for req, i, tok in zip(reqs, index, tokens):
            if req.status is finished:
                continue
            if isinstance(tok, Exception):
                out.append((req, tok, FinishReason.ERROR))
                continue
            req.token_ids[i] = tok
            req.token_times.append(now)
            if req.first_token_s is None:
                req.first_token_s = now
                if margin is not None and req.ttft_estimate is not None:
                    admitted_s, predicted_ms, alone = req.ttft_estimate
                    margin.observe((now - admitted_s) * 1000.0 - predicted_ms, predicted_ms, now, alone)
            p = req.params
            reason = None
            if (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = FinishReason.STOP
            elif length_reached(req, i + 1):
                reason = FinishReason.LENGTH
            out.append((req, tok, reason))
        return out

    def _length_reached(self, req: Request, num_tokens: int) -> bool:
        """Whether `req` ends by its length once it holds `num_tokens` tokens: max_tokens, the context window, or
        (benchmark only: see Request) its reference reply length."""
        n_out = num_tokens - len(req.prompt_token_ids)
        return n_out >= req.params.max_tokens or num_tokens >= self.max_model_len or (
            self.config.bench_stop and req.bench_stop_after is not None and n_out >= req.bench_stop_after)

    def on_step_done(self, plan: StepPlan, wall_ms: float, now: float, reqs: list[Request] | None = None) -> None:
        """Feedback after a step: `wall_ms` is the whole step as its requests saw it (kairos's ITL correction;
        the work per second work shedding measures); `reqs`: the rows that sampled (`plan.requests` as planned)."""
        if self.shedder is not None and self.shedder.saturated_now(now):  # the step's work is summed only if it counts
            self.shedder.step(now, self._step_work(plan.requests if reqs is None else reqs), wall_ms)
        if self.predictor is None or (self.correction is None and (plan.prefill or not plan.decode)):
            return  # nothing to compare the step with: no correction, and not a decode-only step
        pred = self.predictor.itl_ms(len(plan.decode), plan.decode_mean_len) if plan.decode else 0.0
        if plan.decode and not plan.prefill:
            self.model_error.observe(len(plan.decode), wall_ms, pred)
        if self.correction is not None:
            self.correction.observe(now, wall_ms, pred, len(plan.decode) if self.config.correction_by_rows else 0,
                                    alone=0 < len(plan.decode) <= ALONE_ROWS and not plan.prefill,
                                    prefill=bool(plan.prefill))

    def waiting_load(self) -> tuple[int, float]:
        """The prompt tokens queued for prefill and their attention work in token pairs, in one pass."""
        tokens, sq = 0, 0.0
        for r in self.waiting:
            c, start = self._cost(r), self._start(r)
            tokens += c
            sq += prefill_sq(start, start + c)
        return tokens, sq


def _started(r: Request) -> bool:
    """A request the TTFT guard never turns away: a reply already started (preempted), a prompt in progress."""
    return r.first_token_s is not None or r.num_computed_tokens > 0
