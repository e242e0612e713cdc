"""What the engine publishes: a stats snapshot (any thread reads it) and a `StepEvent` per model step."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from scheduling.predictor import LatencyModel
from scheduling.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One model step, as observers see it."""

    t_end: float  # time.monotonic() at the end of the step
    num_prefill: int
    num_prefill_tokens: int
    num_decode: int
    decode_mean_len: float  # mean context of the decodes (0.0 without decodes)
    forward_ms: float  # prepare + forward (its launch, where the device runs it asynchronously: CUDA)
    wall_ms: float  # the whole step: schedule, forward, sample, postprocess
    num_prefill_sq: float | None = None  # the prefill's attention work in token pairs (None: not given)


@dataclass(frozen=True, slots=True)
class EngineStats:
    alive: bool
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    vbs: float
    strictest_tpot_ms: float | None
    last_decode_batch: int
    last_prefill_batch: int
    steps: int
    rejected: dict[str, int] = field(default_factory=dict)
    # of those, the ones turned away while every seat (max_num_seqs) was taken: where they are many, the seats rather
    # than the policy's own limits (a VBS gate, the TTFT guard) bound the batch, and more seats, where the KV cache
    # holds them, would have let the policy judge them
    rejected_seats_full: int = 0
    waiting_tokens: int = 0  # prompt tokens queued for prefill
    waiting_sq: float = 0.0  # and their attention work in token pairs (predictor.prefill_sq, summed)
    predictor_mape: float | None = None
    itl_correction: float = 1.0  # the gate's measured/predicted step-time factor (kairos; 1 when off)
    length_scale: float = 1.0  # the served replies' lengths over the length predictor's (length_calibration; 1: off)
    # the gate's scale of the model on an idle replica, the least of it lately: the SLO floor's it offers
    # (Scheduler.offer_gate_scale), and, over a longer memory, the one it judges an SLO unattainable with
    # (Scheduler.judge_gate_scale)
    offer_gate_scale: float = 1.0
    judge_gate_scale: float = 1.0
    step_ms: float | None = None  # EWMA of the wall time of steps that decoded: the ITL of a request paced every step
    step_batch: float | None = None  # EWMA of those steps' decode batch sizes
    ttft_margin_ms: float | None = None  # the TTFT guard's margin now for a typical request (measured where the
    # policy measures it), and by predicted prefill (ttft_guard.margin_at reads them; empty: ttft_margin_ms for all)
    ttft_margins: tuple[tuple[float, float], ...] = ()
    ttft_idle_margins: tuple[tuple[float, float], ...] = ()  # of the admissions made alone (ttft_guard.idle_margin_at)
    shed_threshold: float | None = None  # work shedding: fresh requests of more work (tokens / TPOT ms) are shed
    # accumulated wall time per phase (seconds): schedule, prepare+forward, sample, postprocess
    phase_s: dict[str, float] = field(default_factory=dict)
    # the latency model's error as served, since start: per decode-rows bucket (a power of two, rows in (k/2, k]) the
    # decode-only steps run and the sum of their wall time / the model's ITL (Scheduler.model_error)
    decode_over_model: dict[int, tuple[int, float]] = field(default_factory=dict)
    gate_line: tuple[float, float] | None = None  # the VBS gate's (base, row) ms: Scheduler.gate_line
    tpot_inv_sum: float = 0.0  # sum of 1 / TPOT (ms) over the running requests with a TPOT SLO, as the gate counts
    num_best_effort: int = 0  # running requests without a TPOT SLO
    preemptions: int = 0  # requests preempted (their KV freed, to be prefilled again) since start
    # prefix caching since start (vLLM's counters): the tokens admissions looked up, and those found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    lora_adapters: int = 0  # LoRA adapters loaded (engine.lora)
    # the output tokens the running request nearest its end is still expected to make (its expected length, as the
    # scheduler plans for it, less its tokens out); None with none running
    nearest_end: int | None = None
    policy: str = ""  # the scheduling policy running (`LLMEngine.reconfigure` changes it)
    # `LLMEngine.reconfigure` calls the engine has taken, and whether the requests it takes now keep their priority
    # (`InputProcessor.priority_scheduling`: the asked scheduler's rule, or the old one's where that one stayed)
    reconfigures: int = 0
    priority_scheduling: bool = False


def snapshot(s: Scheduler, *, alive: bool, steps: int, rejected: dict[str, int], phase_s: dict[str, float],
             predictor_mape: float | None, last: tuple[int, int],
             step: tuple[float | None, float | None], **engine: Any) -> EngineStats:
    """The scheduler's state as an immutable snapshot (taken on the worker thread); `engine`: fields the engine
    owns (its reconfigure calls and their rule, its LoRA adapters)."""
    bm = s.blocks
    tmin, inv_sum, n_be = math.inf, 0.0, 0
    now = time.monotonic()
    pace = s.pace_of(now)  # as the gate counts a running reply (with pace_slack, one ahead of its pace: less)
    nearest = None
    for r in s.running:
        left = r.expected_output_len - r.num_output_tokens
        if nearest is None or left < nearest:
            nearest = left
        t = r.tpot_slo_ms
        if t == math.inf:
            n_be += 1
        else:
            inv_sum += 1.0 / (t if pace is None else pace(r))
            tmin = min(tmin, t)
    if s.margin is not None:  # an idle engine does not step: its published tables forget old errors here too
        s.margin.expire(now)
    waiting_tokens, waiting_sq = s.waiting_load()
    return EngineStats(
        alive=alive, num_waiting=len(s.waiting), num_running=len(s.running),
        kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free, kv_blocks_used=bm.num_used,
        vbs=s.last_vbs, strictest_tpot_ms=None if tmin == float("inf") else tmin,
        last_prefill_batch=last[0], last_decode_batch=last[1], steps=steps,
        waiting_tokens=waiting_tokens, waiting_sq=waiting_sq, rejected=dict(rejected),
        rejected_seats_full=s.num_rejected_seats_full,
        predictor_mape=predictor_mape if s.predictor is not None else None,
        itl_correction=s.last_correction, length_scale=s.length_cal.scale if s.length_cal is not None else 1.0,
        offer_gate_scale=s.offer_gate_scale(now), judge_gate_scale=s.judge_gate_scale(now),
        phase_s=dict(phase_s),
        step_ms=step[0], step_batch=step[1], ttft_margin_ms=s.ttft_margin_ms(),
        ttft_margins=s.margin.table() if s.margin is not None else (),
        ttft_idle_margins=s.margin.table(idle=True) if s.margin is not None else (),
        shed_threshold=None if s.last_shed_threshold == float("inf") else s.last_shed_threshold,
        decode_over_model=s.model_error.snapshot(), gate_line=s.gate_line(time.monotonic()),
        tpot_inv_sum=inv_sum, num_best_effort=n_be, preemptions=s.num_preemptions,
        prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits,
        nearest_end=None if nearest is None else max(0, nearest), policy=s.config.policy, **engine)


def predict_ttft_ms(model: LatencyModel | None, stats: EngineStats, num_prompt_tokens: int,
                    max_model_len: int) -> float:
    """TTFT a new request would see now: prefill of what is queued (as last published) plus its own."""
    if model is None:
        return 0.0
    n = min(num_prompt_tokens, max_model_len)
    return model.prefill_ms(stats.waiting_tokens + n, stats.waiting_sq + float(n) * n)
