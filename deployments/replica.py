"""`LLMServer`: one `LLMEngine` per Ray Serve replica.

The ingress calls `generate(GenerateRequest)` through a streaming handle and gets `RequestOutput` items back
(core/messages.py): the engine's own stream items, the first one stamped with `served_by` (this replica, and
how long it took to answer). Bad input and a dead engine come back as a final item with a typed error, never
as an exception. The engine is imported lazily so that the ingress process never loads torch.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, AsyncIterator

from ray import serve

from core.messages import (ChatTurn, ContextLengthExceeded, ErrorKind, GenerateRequest, PromptOptions, PromptTooLong,
                           RejectReason, RequestOutput, RoutingStats, ServedBy, chat_texts)
from core.request import FinishReason
from deployments.autoscaling import INFLIGHT, DemandRates
from deployments.metrics import ReplicaMetrics, StatsLog
from deployments.pacing import StreamPacing
from deployments.tool_calls import detect
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.inputs import LONG_TEXT_CHARS
from scheduling.config import SchedulerConfig
from scheduling.ttft_guard import idle_margin_at, idle_slo_floor

log = logging.getLogger("ray.serve")

MAX_RETRY_AFTER_S = 60  # the `openai` client waits out a Retry-After of up to 60 s, and no longer
CALLER_CHECK_S = 1.0  # how often a replica asks whether the callers of its requests are alive (`_callers_loop`)


@dataclasses.dataclass(frozen=True, slots=True)
class RejectionView:
    """What a client is told about a rejection: the reason (a TTFT or TPOT rejection that an idle replica would
    have made too becomes `slo_unattainable`), when to retry a busy one, and the strictest SLOs an idle replica
    would accept for the request (None without a latency model)."""
    reason: RejectReason
    retry_after_s: int | None
    best_ttft_ms: float | None
    best_tpot_ms: float | None


def judge_rejection(reason: RejectReason, req: GenerateRequest, num_prompt_tokens: int, model: Any,
                    sched: SchedulerConfig, max_model_len: int, waiting_tokens: int, step_ms: float | None,
                    decode_left: list[int], ttft_margin_ms: float | Callable[[float], float] | None = None,
                    waiting_sq: float = 0.0, gate_scale: float = 1.0,
                    planned_len: int | None = None, nearest_end: int | None = None,
                    judge_scale: float | None = None) -> RejectionView:
    """Tell a rejection a retry cannot help (`slo_unattainable`: an SLO stricter than the idle floor of the
    scheduler's own guards, `scheduling.ttft_guard.idle_slo_floor`, for an SLO the policy enforces) from a busy
    one, and for a busy one compute Retry-After from the queue: the predicted prefill of the waiting prompts and
    this one, plus, where the running batch has to thin out (TPOT gate, work shedding), the decode steps until
    the in-flight request nearest its end finishes (`decode_left`: their expected remaining tokens; a step takes
    `step_ms`, the engine's measured decode step, else the model's). Rounded up to whole seconds, 1 to 60.
    `ttft_margin_ms`: the TTFT guard's margin on an idle replica, or a function of the request's predicted prefill
    that gives it (measured: `ttft_guard.idle_margin_at`; default the configured). `waiting_sq`: the waiting
    prompts' attention work in token pairs (`Scheduler.waiting_sq`). `gate_scale`: the VBS gate's scale of the model
    on an idle replica that the SLOs offered are drawn with (`Scheduler.offer_gate_scale`: the least the decode steps
    it measured gave lately); `judge_scale`, the one an SLO is judged unattainable with (`Scheduler.judge_gate_scale`:
    the least over a longer memory, so that an SLO offered lately is not judged unattainable; default `gate_scale`).
    `planned_len`: the reply length the scheduler planned the request for (`RequestOutput.planned_output_len`: a
    predicted one where its length predictor ran), else its hint, else max_tokens. `nearest_end`: the engine's own
    count of the tokens until the running request nearest its end finishes (`EngineStats.nearest_end`: expected
    lengths as its scheduler plans for them, kairos's predicted ones), which wins over `decode_left`'s (hints and
    max_tokens)."""
    n = max(num_prompt_tokens, 1)
    if model is None:
        return RejectionView(reason, 1, None, None)
    flags = sched.flags()
    p = req.params.max_tokens if req.params.max_tokens is not None else max(1, max_model_len - n)
    hint = req.slo.output_len_hint
    mid_len = n + (planned_len if planned_len else min(hint, p) if hint else p) / 2.0
    margin = sched.ttft_margin_ms if ttft_margin_ms is None else ttft_margin_ms
    if callable(margin):
        margin = margin(model.prefill_ms(min(n, max_model_len)))

    def floor(scale: float) -> tuple[float, float]:
        return idle_slo_floor(model.prefill_ms, model.itl_ms, min(n, max_model_len), mid_len, margin,
                              flags.vbs_margin, sched.vbs_slack, scale)

    best_ttft, best_tpot = floor(gate_scale)
    least_ttft, least_tpot = (best_ttft, best_tpot) if judge_scale is None or judge_scale == gate_scale \
        else floor(judge_scale)
    slo = req.slo
    if reason in (RejectReason.TTFT_UNATTAINABLE, RejectReason.TPOT_UNATTAINABLE) and (
            (flags.ttft_reject and slo.ttft_ms is not None and slo.ttft_ms < least_ttft)
            or (flags.vbs_gate and slo.tpot_ms is not None and slo.tpot_ms <= least_tpot)):
        return RejectionView(RejectReason.SLO_UNATTAINABLE, None, best_ttft, best_tpot)
    own = min(n, max_model_len)
    wait_ms = model.prefill_ms(waiting_tokens + own, waiting_sq + float(own) * own)
    if reason in (RejectReason.TPOT_UNATTAINABLE, RejectReason.SHED) and (decode_left or nearest_end is not None):
        step = step_ms if step_ms else model.itl_ms(float(max(1, len(decode_left))), mid_len)
        wait_ms += max(0, nearest_end if nearest_end is not None else min(decode_left)) * step
    retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait_ms / 1000.0)))
    return RejectionView(reason, retry, best_ttft, best_tpot)


def _rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process, this one by default (0 where it cannot be read)."""
    try:
        import psutil  # noqa: PLC0415

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # noqa: BLE001
        return 0


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCores:
    """How a replica's engine uses the node's cores."""
    threads: int | None  # torch threads; None: torch's default
    favoured: bool  # its process may undo Ray's nice 15, but not its team's workers (`EngineCoreClient(favoured=...)`)
    team: bool  # its kernels run on Kairos's thread team (`EngineCoreClient(team=...)`)


def engine_threads(cpus: int, num_threads: int | None, share_cores_with: int | None, engine_process: bool,
                   omp_num_threads: str | None, gpu: bool = False) -> EngineCores:
    """How the engine of a replica uses `cpus` cores, shared with `share_cores_with` replicas' engines.

    An engine on a GPU (`gpu`) runs one torch thread unless `num_threads` says otherwise, as vLLM's GPU workers do:
    its host work is launching kernels and small tensors, and more threads only take cores from Serve's proxy and
    the replicas' event loops. In its own process it goes before that Python (nice 0).

    With `num_cpus=0` (`share_cores_with` = the replicas on the node) Ray sets OMP_NUM_THREADS=1, so Kairos splits
    the node's cores between the replicas itself. Where each engine gets 4 cores or more and runs in its own
    process, one core stays with Serve's own processes (proxy, ingress, the replicas' event loops), as vLLM's CPU
    backend keeps one for its API server, and the engine's steps go before that Python (nice 0). With fewer, a
    spare core would cost an engine half its speed or more, so it takes every core: its kernels run on Kairos's
    thread team, which does not wait for a worker that Serve's Python keeps off its core, and only the engine's
    own thread goes before that Python, its workers staying at Ray's nice 15 (HTTP then adds less over the
    in-process engine than with one thread; OpenMP threads at nice 0 starved the HTTP proxy). With `num_cpus>0`
    Ray's split stands."""
    if gpu:
        return EngineCores(num_threads or 1, engine_process, False)
    threads = num_threads
    if threads is None and share_cores_with:
        spare = 1 if engine_process and cpus // share_cores_with >= 4 else 0
        threads = max(1, (cpus - spare) // share_cores_with)
    if not (engine_process and share_cores_with):
        return EngineCores(threads, False, False)
    used = threads or (int(omp_num_threads) if (omp_num_threads or "").isdigit() else cpus)  # torch's default
    spares_a_core = used * share_cores_with < cpus
    team = not spares_a_core and used > 1
    return EngineCores(threads, spares_a_core or team, team)


def _on_gpu(device: str) -> bool:
    """Whether an engine of `device` runs on a GPU: cuda[:N], or auto in a replica that Ray gave a GPU (this process
    does not initialise CUDA: its engine does, in its own process)."""
    d = str(device).strip().lower()
    if d.startswith("cuda"):
        return True
    if d != "auto":
        return False
    try:
        import ray  # noqa: PLC0415

        return ray.is_initialized() and bool(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - outside Ray: the engine decides
        return False


def scales_to_zero() -> bool | None:
    """Whether this replica's deployment autoscales down to none (min_replicas 0), as Serve runs it: the app's
    arguments, or a Serve config's `deployments:` that overrides them (None outside Serve; the replica context's
    deployment config is Ray's private field, pinned with Ray)."""
    try:
        scaling = serve.get_replica_context()._deployment_config.autoscaling_config
    except Exception:  # noqa: BLE001 - outside Serve (unit use)
        return None
    return scaling is not None and scaling.min_replicas == 0


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _ToServe(logging.Handler):
    """Hands each record to Serve's logger, whose handlers (they change with the deployment's logging config) write
    it: the replica's log file and the console."""

    def emit(self, record: logging.LogRecord) -> None:
        log.handle(record)


def engine_logs_to_serve() -> None:
    """An engine in the replica's own process logs (`kairos.*`: its start-up summary, profile, failed steps) where
    the replica does, through Serve's logger at its level; one in a process of its own writes them to the stderr it
    shares with the replica (`engine.core_proc`)."""
    kairos = logging.getLogger("kairos")
    if kairos.handlers:
        return
    kairos.addHandler(_ToServe())
    kairos.setLevel(log.getEffectiveLevel())
    kairos.propagate = False


def _text_chars(req: GenerateRequest) -> int:
    """The characters of text a request's prompt holds (what rendering and tokenizing it costs)."""
    if req.messages is None:
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    return sum(map(len, chat_texts(req.messages, req.options)))


class LLMReplica:
    """One engine and what Serve asks of it: `generate` streams, the control plane (`check_health`,
    `record_routing_stats`, `stats`, `model_info`, `reconfigure`, `inject_fault`) and the replica's metrics.
    `LLMServer` below deploys it behind the Ingress; `deployments.direct.DirectLLMServer` adds the HTTP surface to
    it."""

    async def __init__(self, engine_config: dict[str, Any], metrics_interval_s: float = 0.5,
                       log_prompts: bool = False, share_cores_with: int | None = None,
                       pacing: StreamPacing | None = None, engine_process: bool = True,
                       loop_priority: str = "engine", served_name: str | None = None,
                       log_stats_s: float = 0.0) -> None:
        """`served_name`: the model's name to clients (the app's served_model_name), the vLLM series' model_name;
        `log_stats_s`: the period of the replica's stats line in its log (`StatsLog`; 0: none)."""
        cfg = EngineConfig.model_validate(engine_config)
        cores = engine_threads(_usable_cpus(), cfg.num_threads, share_cores_with, engine_process,
                               os.environ.get("OMP_NUM_THREADS"), gpu=_on_gpu(cfg.device))
        cfg = cfg.model_copy(update={"num_threads": cores.threads})
        try:
            ctx = serve.get_replica_context()
            self.replica_id = ctx.replica_id.unique_id
            label = f"ServeReplica:{ctx.app_name}:{ctx.deployment}-engine"  # as Ray titles the replica's process
        except Exception:  # noqa: BLE001 - outside Serve (unit use)
            self.replica_id, label = "local", None
        if engine_process:  # the engine in its own process: no per-token Python shares its GIL
            from engine.core_proc import EngineCoreClient, unnice  # noqa: PLC0415

            # its outputs are read on this replica's event loop, which delivers them (`reader_loop`)
            self.engine = await asyncio.to_thread(EngineCoreClient, cfg, favoured=cores.favoured,
                                                  team=cores.team, label=label,
                                                  reader_loop=asyncio.get_running_loop())
            if cores.favoured and loop_priority == "engine":
                # This thread runs the replica's event loop (`prefer_user_code_on_main_loop`): it admits every
                # request and delivers every token (and, serving HTTP itself, answers /health). At Ray's nice 15
                # it lost its core to the favoured engine thread whenever both were runnable: on a small box a
                # burst's admissions held /health several times longer than at nice 0. Its work is small next to
                # the steps', so it runs at the engine thread's priority.
                unnice()
        else:
            from engine.engine import LLMEngine  # noqa: PLC0415 - heavy (torch); LLM replicas only

            engine_logs_to_serve()
            self.engine = await asyncio.to_thread(LLMEngine, cfg)
        self._engine_pid = getattr(self.engine, "pid", os.getpid())
        self._sched = cfg.scheduler
        self._user_config: dict[str, Any] = {}  # the scheduler knobs `reconfigure` last applied
        self._decode_left: dict[str, int] = {}  # in-flight request -> output tokens it is still expected to make
        self.model_name = self.engine.model_name
        self.log_prompts = log_prompts
        self.pacing = pacing or StreamPacing()
        self._pacing_running: int | None = None  # the LLM replicas running, as the last request said
        self.metrics = ReplicaMetrics(str(cfg.model), served_name)
        self._stats_log = StatsLog(log_stats_s) if log_stats_s > 0 else None
        self.inflight = 0
        self._inflight_peak = 0  # the most in flight since the last autoscaling report
        self.demand = DemandRates()  # admitted and turned away, for Serve's autoscaling (`record_autoscaling_stats`)
        self.aborted = 0  # requests the caller abandoned (client disconnects), aborted in the engine
        self._prompt_lens: deque[int] = deque([64], maxlen=256)
        self._closed = False
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop(metrics_interval_s))
        self._callers: dict[str, set[str]] = {}  # caller actor id (an Ingress replica) -> its requests in flight here
        self._callers_task = asyncio.get_running_loop().create_task(self._callers_loop(CALLER_CHECK_S))
        log.info("LLMServer %s ready: model=%s max_model_len=%d engine_process=%s %s", self.replica_id,
                 self.model_name, self.engine.max_model_len, engine_process, cores)

    # ------------------------------------------------------------------ request path
    def _refused(self, req: GenerateRequest, t_in: float, kind: ErrorKind, message: str) -> RequestOutput:
        return RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ERROR, error=message[:500],
                             error_kind=kind, served_by=ServedBy(self.replica_id, (time.monotonic() - t_in) * 1e3))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid = req.request_id
        t_in = time.monotonic()
        req = req.arrived(t_in)  # its way here (routing, Serve's queue) is spent too
        if req.replicas_running and req.replicas_running != self._pacing_running:  # (an autoscaled app's share)
            self._pacing_running = req.replicas_running
            self.pacing = self.pacing.for_running(req.replicas_running)
        if rid in self._decode_left:  # (the engine refuses it too, but this call's clean-up would undo the first's)
            yield self._refused(req, t_in, ErrorKind.INVALID_REQUEST, f"duplicate request id {rid!r}")
            return
        try:
            stream = self.engine.generate(req) if _text_chars(req) <= LONG_TEXT_CHARS else await self._generate_off(req)
        except ContextLengthExceeded as e:
            yield self._refused(req, t_in, ErrorKind.CONTEXT_LENGTH, str(e))
            return
        except PromptTooLong as e:
            yield self._refused(req, t_in, ErrorKind.PROMPT_TOO_LONG, str(e))
            return
        except (ValueError, TypeError, UnicodeError) as e:  # TypeError: the tokenizer refusing odd text
            yield self._refused(req, t_in, ErrorKind.INVALID_REQUEST, str(e))
            return
        except EngineDeadError as e:
            yield self._refused(req, t_in, ErrorKind.UNAVAILABLE, f"engine unavailable: {e}")
            return
        tier = self.metrics.tier_label(req.slo)
        if self.log_prompts:
            log.info("request %s prompt=%r messages=%r", rid, req.prompt, req.messages)
        else:
            log.debug("request %s: slo=%s", rid, req.slo)
        self.inflight += 1
        self._inflight_peak = max(self._inflight_peak, self.inflight)
        if req.caller is not None:
            self._callers.setdefault(req.caller, set()).add(rid)
        left = self._decode_left
        hint, cap = req.slo.output_len_hint, req.params.max_tokens or self.engine.max_model_len
        left[rid] = min(hint, cap) if hint else cap
        finished, first, last_t = False, True, time.monotonic()
        admitted, streamed = False, 0  # for the metrics of a request its caller abandons
        # TTFT and ITL as the engine's tokens came out (their put times on the stream), not as this loop read them:
        # pacing merges a stream's tokens into chunks, and a loop behind them reads them late
        track = getattr(stream, "track_token_times", None)
        if track is not None:
            track()
        timing = _TokenTiming(tier, getattr(stream, "arrival_s", None) or t_in, self.metrics)
        try:
            while True:
                if not first and self.pacing.holds:
                    # stream pacing (deployments/pacing.py): after the first token, a chunk at most every `hold`
                    # seconds; aget() then merges every delta queued meanwhile (fewer chunks through Ray and the
                    # proxy, the same tokens, the same mean TPOT)
                    st = self.engine.stats()
                    hold = self.pacing.hold_s(self.inflight, st.step_ms, st.step_batch)
                    wait = last_t + hold - time.monotonic()
                    if wait > 0:  # ...but the final tokens go out as soon as the request finishes
                        await stream.wait_closed(wait)
                out = await stream.aget()
                now = time.monotonic()
                timing.read(stream)
                if first:
                    first = False
                    if not early_end(out):  # (one the engine never took says nothing of the prompts it runs)
                        self._prompt_lens.append(max(out.num_prompt_tokens, 1))
                    served = ServedBy(self.replica_id, (now - t_in) * 1000.0)
                    ids, thinking = None, None  # (vLLM's return_token_ids: an admitted request's prompt's)
                    if out.finish_reason is FinishReason.REJECTED:
                        left.pop(rid, None)
                        view = self._judge(req, out)
                        served = dataclasses.replace(served, retry_after_s=view.retry_after_s,
                                                     best_ttft_ms=view.best_ttft_ms, best_tpot_ms=view.best_tpot_ms)
                        out = dataclasses.replace(out, reject_reason=view.reason)
                        self.metrics.on_rejected(tier, view.reason)
                        if view.reason is not RejectReason.SLO_UNATTAINABLE:  # (an idle replica's too: not load)
                            self.demand.turned_away += 1
                    elif not early_end(out):
                        admitted = True
                        self.demand.admitted += 1
                        self.metrics.on_admitted(tier, out.num_prompt_tokens)
                        if req.return_token_ids:  # (vLLM's return_token_ids)
                            ids = list(stream.prompt_token_ids or ())
                        thinking = stream.prompt_thinking
                    out = dataclasses.replace(out, served_by=served, prompt_token_ids=ids, prompt_thinking=thinking)
                if out.token_ids:
                    n = len(out.token_ids)
                    if rid in left:
                        left[rid] -= n
                    streamed += n
                    self.metrics.on_tokens(tier, n)
                last_t = now
                if out.finished:
                    # counted out before the last item goes: a caller that stops at it may never resume (or
                    # close) this generator, and its `finally` would then wait for the garbage collector
                    finished = True
                    self.inflight -= 1
                    left.pop(rid, None)
                    if req.caller is not None:
                        _forget_caller(self._callers, req.caller, rid)
                    if admitted:
                        self.metrics.on_finished(tier, req.engine_slo, out, streamed)  # TTFT as it measures it
                    elif out.finish_reason is FinishReason.ABORT:  # before its admission (its caller's death, a
                        self.metrics.on_abandoned(tier)  # shutdown): as a caller that went away
                    yield out
                    return
                yield out
        finally:  # client went away (CancelledError / GeneratorExit) or an error: free the KV now
            if not finished:
                self.inflight -= 1
                left.pop(rid, None)
                # counted already where `_callers_loop` aborted it as its caller died (and took it off its caller)
                if req.caller is None or _forget_caller(self._callers, req.caller, rid):
                    self.aborted += 1
                self.engine.abort(rid)  # first: its KV blocks are freed whatever the metrics do
                log.info("request %s aborted (caller cancelled)", rid)
                if admitted:
                    self.metrics.on_aborted(tier)
                else:
                    self.metrics.on_abandoned(tier)

    def _judge(self, req: GenerateRequest, out: RequestOutput) -> RejectionView:
        reason = out.reject_reason or RejectReason.OVERLOADED
        try:
            st = self.engine.stats()
            return judge_rejection(reason, req, out.num_prompt_tokens, self.engine.latency_model, self._sched,
                                   self.engine.max_model_len, st.waiting_tokens, st.step_ms,
                                   list(self._decode_left.values()),
                                   lambda p: idle_margin_at(st.ttft_idle_margins, st.ttft_margins, p,
                                                            self._sched.ttft_margin_ms),
                                   st.waiting_sq, st.offer_gate_scale, out.planned_output_len, st.nearest_end,
                                   st.judge_gate_scale)
        except Exception:  # noqa: BLE001 - a rejection must still answer
            log.exception("judging a rejection failed")
            return RejectionView(reason, 1, None, None)

    # ------------------------------------------------------------------ control plane
    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (where the app autoscales): the requests this replica admitted and
        turned away for its load, a second each lately, and the most in flight since the last report
        (deployments/autoscaling.py). On the event loop, as `generate` counts them (a sync hook runs on Serve's
        thread pool, where its swap of the peak could write over a request counted in between)."""
        peak, self._inflight_peak = self._inflight_peak, self.inflight
        return {**self.demand.rates(time.monotonic()), INFLIGHT: float(peak)}

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the controller every `request_routing_stats_period_s`; read by `router.SLORouter` as a
        `RoutingStats` (Serve carries it as a plain dict)."""
        st = self.engine.stats()
        median = int(statistics.median(self._prompt_lens))
        try:
            queue_ms = self.engine.predict_ttft_ms(1)
            median_ms = self.engine.predict_ttft_ms(median)
        except Exception:  # noqa: BLE001 - predictor not ready: fall back to load only
            queue_ms = median_ms = None
        return RoutingStats(
            num_waiting=st.num_waiting, num_running=st.num_running, inflight=self.inflight, vbs=st.vbs,
            strictest_tpot_ms=st.strictest_tpot_ms, kv_blocks_free=st.kv_blocks_free,
            kv_blocks_total=st.kv_blocks_total, predicted_ttft_ms=median_ms, predicted_queue_ms=queue_ms,
            median_prompt_tokens=median, prefill_sq_ms=self._prefill_sq_ms(), itl_ms=st.step_ms,
            step_batch=st.step_batch, alive=st.alive and self.engine.is_alive(), ts=time.time(),
            gate_base_ms=st.gate_line[0] if st.gate_line else None,
            gate_row_ms=st.gate_line[1] if st.gate_line else None, tpot_inv_sum=st.tpot_inv_sum,
            best_effort_share=st.num_best_effort * self._sched.best_effort_trp,
            **self._prefill_model(), waiting_tokens=int(st.waiting_tokens), waiting_sq=float(st.waiting_sq)).to_dict()

    def _prefill_model(self) -> dict[str, float | None]:
        """The latency model's prefill (`LatencyModel.prefill_params`) as `RoutingStats` carries it (None: none)."""
        model = self.engine.latency_model
        if model is None:
            return {}
        c0, theta, alpha, beta, _ = model.prefill_params()
        return {"prefill_c0_ms": c0, "prefill_theta": theta, "prefill_alpha_ms": alpha, "prefill_beta_ms": beta}

    def _prefill_sq_ms(self) -> float:
        """The latency model's ms per token pair of attention (0 without a model, or one fitted as a line)."""
        model = self.engine.latency_model
        return float(model.prefill_coef[2]) if model is not None else 0.0

    async def _generate_off(self, req: GenerateRequest) -> Any:
        """`engine.generate` of a long prompt on a thread of its own: rendering and tokenizing it on the event loop
        stalled every stream of the replica for as long (a second a megabyte). A caller that goes away meanwhile
        (a client that disconnected) has its request aborted once the engine has it."""
        job = asyncio.get_running_loop().run_in_executor(None, self.engine.generate, req)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            def ended(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.engine.abort(req.request_id)
            job.add_done_callback(ended)
            raise

    def reconfigure(self, user_config: dict[str, Any] | None, rank: Any = None) -> None:
        """Serve's `user_config` of the LLM deployment: scheduler knobs by the names the app's arguments give them
        (`{"policy": "scorpio"}`, `{"policy": "kairos", "vbs_margin": 1.1}`), over the knobs the replica started with.
        `serve deploy` of a config whose only change is this `user_config` calls it on every running replica in place:
        no model load, no new replica. The engine switches once the requests it holds have finished (those that arrive
        meanwhile wait for the new scheduler); its `kairos_scheduler_policy` gauge says when (`LLMEngine.reconfigure`).
        An unknown knob, a bad value, or one fixed at start (max_num_seqs, prefill_max_tokens, chunked_prefill,
        predictor_path) is logged as an error and changes nothing: the replica keeps serving as it was (Serve would
        replace a replica whose `reconfigure` raised, and its replacement would fail the same way: a typo would leave
        the deployment no replica). `rank` (the replica's, Serve's) is not read: taking it, the method is called with
        a None `user_config` too (Serve 2.60 calls one without it only for a config), so that a config that drops its
        `user_config` takes the replicas back to the knobs they started with."""
        knobs = {} if user_config is None else dict(user_config) if isinstance(user_config, dict) else user_config
        if knobs == self._user_config:
            return
        try:
            self._sched = self.engine.reconfigure(knobs)
        except ValueError as e:
            log.error("LLMServer %s: user_config %r not applied, the scheduler runs as before: %s", self.replica_id,
                      user_config, e)
            return
        self._user_config = knobs
        log.info("LLMServer %s: scheduler knobs %s (policy %s), applied once its requests in flight end",
                 self.replica_id, knobs, self._sched.policy)

    def inject_fault(self, count: int = 1, replica: str | None = None, hang_s: float = 0.0) -> str:
        """Test hook (deployment handle only, never routed over HTTP): the next `count` model steps of this
        replica's engine raise; with `hang_s`, its next step blocks that long instead (a hung device call). With
        `replica`, only that replica arms the fault (handle calls land on a random replica: call until the
        returned id matches). Returns this replica's id."""
        if replica is None or replica == self.replica_id:
            if hang_s > 0:
                self.engine.inject_fault(hang_s=float(hang_s))
            else:
                self.engine.inject_fault(int(count))
        return self.replica_id

    def check_health(self) -> None:
        if (why := self.engine.dead_reason()) is not None:
            raise RuntimeError(f"LLM engine worker of replica {self.replica_id} is dead: {why}")

    def stats(self) -> dict[str, Any]:
        """For tests and debugging: `handle.stats.remote()` (routed to any replica)."""
        st = self.engine.stats()
        return {"replica": self.replica_id, "num_running": st.num_running, "num_waiting": st.num_waiting,
                "kv_blocks_free": st.kv_blocks_free, "kv_blocks_total": st.kv_blocks_total,
                "inflight": self.inflight, "aborted": self.aborted, "steps": st.steps, "rejected": dict(st.rejected),
                "policy": st.policy, "chunks_per_s": self.pacing.max_chunks_per_s,
                "pid": os.getpid(), "engine_pid": self._engine_pid,
                # this replica's memory, its engine process included
                "rss_bytes": _rss_bytes() + (_rss_bytes(self._engine_pid) if self._engine_pid != os.getpid() else 0)}

    def prompt_tokens(self, prompt: str | None, messages: tuple[ChatTurn, ...] | None, options: PromptOptions,
                      token_strs: bool = False) -> dict[str, Any]:
        """vLLM's /tokenize on this replica's model: the token ids a generation would take (`count`, `tokens`,
        `max_model_len`, and with `token_strs` each token's text; `thinking`: where they leave a reasoning model's
        thinking, `RequestOutput.prompt_thinking`), or `error` for a prompt the engine refuses."""
        inputs = self.engine.inputs
        try:
            ids, rendered = inputs.prompt_ids_and_text(prompt, messages, options.check(), empty=True)
        except (ValueError, TypeError, UnicodeError) as e:
            return {"error": str(e)[:500]}
        strs = inputs.tokenizer.convert_ids_to_tokens(ids) if token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs,
                "thinking": inputs.prompt_thinking(ids, messages, options, rendered) if messages is not None else None}

    async def check_lora(self, name: str, path: str) -> dict[str, Any]:
        """vLLM's /v1/load_lora_adapter asks a replica whether its engine can serve the folder `path` as adapter
        `name` before the front lists it: {"rank"}, or {"error", "not_found"} (no adapter there). Read on a thread (its
        config and its tensors' shapes): the replica's event loop streams other requests' tokens meanwhile."""
        from engine.lora import LoraError

        try:
            return {"rank": await asyncio.to_thread(self.engine.inputs.check_lora, name, path)}
        except (LoraError, OSError) as e:  # (OSError: a folder this replica may not read)
            found = os.path.isfile(os.path.join(path, "adapter_config.json"))
            return {"error": str(e)[:1000], "not_found": not found}  # (vLLM's 404: no adapter there)

    def token_text(self, tokens: list[int]) -> dict[str, Any]:
        """vLLM's /detokenize on this replica's model: the text of `tokens` (`prompt`), or `error`."""
        try:
            return {"prompt": self.engine.inputs.detokenize(tokens)}
        except ValueError as e:
            return {"error": str(e)[:500]}

    def model_info(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.engine.max_model_len, "alive": self.engine.is_alive(),
                "max_logprobs": self.engine.inputs.max_logprobs,  # (the front checks a request's against it)
                "sampling_defaults": dict(self.engine.sampling_defaults),
                "eos_token_ids": list(self.engine.inputs.eos_token_ids),  # (beam search ends a beam at one)
                # what a max_tokens beyond the context left is (beam search checks its own: its steps are 1 token)
                "max_tokens_over_context": "reject" if self.engine.inputs.reject_max_tokens_over_context else "clamp",
                # whether it ranks requests by their priority (scheduling_policy "priority"; `user_config` may set it)
                "priority_scheduling": self.engine.inputs.priority_scheduling,
                # the tool-call format its chat template shows (`tool_calls.detect`): tool_call_parser=auto's
                "tool_call_parser": detect(getattr(self.engine.inputs.tokenizer, "chat_template", None)),
                # whether its deployment may scale to zero, as Serve runs it (a Serve config's `deployments:` too)
                "scales_to_zero": scales_to_zero()}

    async def _callers_loop(self, period_s: float) -> None:
        """Every `period_s`, abort in the engine the requests whose caller (an Ingress replica) Ray reports dead: when
        a caller dies nothing cancels its calls' generators here, and they would generate to the end for no one, their
        KV held. Only a DEAD state counts; a failed lookup waits for the next round."""
        while not self._closed:
            await asyncio.sleep(period_s)
            for caller in list(self._callers):
                try:
                    state = await asyncio.to_thread(_actor_state, caller)
                except Exception:  # noqa: BLE001 - the GCS busy or unreachable: ask again next round
                    continue
                if state != "DEAD":
                    continue
                rids = self._callers.pop(caller, set())
                for rid in rids:
                    self.engine.abort(rid)
                self.aborted += len(rids)  # (their generators, closed later, find them gone and count them no more)
                log.warning("aborted %d request(s) whose caller %s died", len(rids), caller)

    async def _metrics_loop(self, period_s: float) -> None:
        """Every `period_s`: the engine's gauges, and how late this wake-up came (`kairos_event_loop_lag_s`: the
        event loop that streams every chunk and takes every request of this replica, behind by that much)."""
        lag = None
        while not self._closed:
            try:
                if lag is not None:
                    self.metrics.on_loop_lag(lag)
                st = self.engine.stats()
                self.metrics.update_engine(st, self.inflight)
                if self._stats_log is not None and (line := self._stats_log.line(time.monotonic(), self.metrics,
                                                                                  st)):
                    log.info("%s", line)
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                log.exception("metrics update failed")
            due = time.monotonic() + period_s
            await asyncio.sleep(period_s)
            lag = max(time.monotonic() - due, 0.0)

    def __del__(self) -> None:
        self._closed = True
        for name in ("_metrics_task", "_callers_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.shutdown(timeout=5.0)


def early_end(out: RequestOutput) -> bool:
    """Whether a request's first item ends it before the engine admitted it, not by a rejection: failed (an adapter
    that does not load, a duplicate id, an engine that died or shut down) or aborted (its caller's death, a shutdown)
    while it waited, or aborted while its prompt ran (as its caller going away then counts: abandoned before its
    first token). Counted neither admitted nor finished (`metrics`): only what the scheduler took is, and a step's
    failure is (an error the operators see)."""
    return out.finished and not out.token_ids and out.finish_reason is not FinishReason.REJECTED \
        and (out.metrics is None or out.metrics.admitted_s is None or out.finish_reason is FinishReason.ABORT)


class _TokenTiming:
    """A request's TTFT (from its arrival, `arrival_s`) and inter-token latencies, observed as its stream's token
    items were put (`RequestStream.take_token_times`): when the engine gave them, however they were read. An item of
    n tokens after a gap of t counts n latencies of t / n. A stream without put times (a stand-in): none."""

    __slots__ = ("tier", "arrival_s", "metrics", "last_s")

    def __init__(self, tier: str, arrival_s: float, metrics: Any) -> None:
        self.tier, self.arrival_s, self.metrics = tier, arrival_s, metrics
        self.last_s: float | None = None  # the last token's put time (None: no token yet)

    def read(self, stream: Any) -> None:
        take = getattr(stream, "take_token_times", None)
        gaps = []
        for t, n in take() if take is not None else ():
            if self.last_s is None:  # (an item's other tokens came with the first: no latency of theirs)
                self.metrics.on_first_token(self.tier, max(t - self.arrival_s, 0.0))
            else:
                gaps.append((max(t - self.last_s, 0.0) / n, n))
            self.last_s = t
        if gaps:
            self.metrics.on_itls(self.tier, gaps)


def _forget_caller(callers: dict[str, set[str]], caller: str, rid: str) -> bool:
    """Request `rid` ended: `caller` no longer has it in flight here (`LLMReplica._callers`). Whether it had
    (False: `_callers_loop` took it off, aborting it, as its caller died)."""
    rids = callers.get(caller)
    if rids is None or rid not in rids:
        return False
    rids.discard(rid)
    if not rids:
        del callers[caller]
    return True


def _actor_state(actor_id: str) -> str | None:
    """Ray's state of an actor (ALIVE, RESTARTING, DEAD, ...), from the GCS; None if it has no record."""
    import ray._private.state as ray_state  # Ray's own table (private; pinned with Ray, as the router's context)

    return ray_state.actors(actor_id).get("State")


LLMServer = serve.deployment(
    LLMReplica, name="LLMServer", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
    health_check_period_s=5.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=20.0)
