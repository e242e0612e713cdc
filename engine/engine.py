"""LLMEngine: `add_request` validates and enqueues; one worker thread owns every request and runs the step loop."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine import cpu_matmul
from engine.attention import ATTN_NAME
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv.block_manager import BlockManager
from engine.kv.cache import KVCache, choose_cache_dtype
from engine.loader import ModelBundle, load_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestMetrics, RequestOutput
from engine.request import SLO, FinishReason, Request, Status
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.stream import RequestStream
from scheduling.scheduler import Scheduler, StepPlan

log = logging.getLogger("kairos.engine")


class EngineDeadError(RuntimeError):
    pass


@dataclass(slots=True)
class _InjectFault:
    count: int


@dataclass(slots=True)
class _Reprofile:
    time_budget_s: float
    scale: tuple[float, float]
    done: threading.Event = field(default_factory=threading.Event)
    report: dict | None = None
    error: str | None = None


@dataclass(slots=True)
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
    waiting_tokens: int = 0  # prompt tokens queued for prefill
    predictor_mape: float | None = None
    itl_correction: float = 1.0  # the gate's measured/predicted step-time factor (kairos; 1 when off)
    # accumulated wall time per phase (seconds): schedule, prepare+forward, sample, postprocess
    phase_s: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config = (config or EngineConfig()).model_copy(update=overrides)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.bundle: ModelBundle = load_model(
            config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=config.device,
            trust_remote_code=config.trust_remote_code, attn_implementation=ATTN_NAME,
            max_model_len=config.max_model_len)
        b = self.bundle
        self.upcast_linears = cpu_matmul.install(b.model, config.cpu_upcast_matmul)
        self.tokenizer = b.tokenizer
        self.encode = prompt_encoder(b.tokenizer)
        self.max_model_len = b.max_model_len
        self.model_name = b.name
        self.cache = self._build_cache()
        self.blocks = BlockManager(self.cache.num_blocks, config.block_size)
        self.runner = ModelRunner(b.model, self.cache, b.device)
        self.sampler = Sampler(b.vocab_limit, b.eos_token_ids, b.device)
        self._eos = set(b.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len)
        self.profile_report: dict | None = None
        from engine.profiling import load_or_profile  # noqa: PLC0415 (needs the runner)
        self.scheduler.predictor, self.profile_report = load_or_profile(self)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[str, Request] = {}  # worker-owned
        self._ids = itertools.count()
        self._stop = False
        self._dead: BaseException | None = None
        self._fault_steps = 0
        self._steps = 0
        self._rejected: dict[str, int] = {}
        self._phase = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "postprocess": 0.0}
        self._stats_lock = threading.Lock()
        self._stats = self._snapshot(0, 0)
        self._thread = threading.Thread(target=self._run, name="kairos-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (any thread)
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, slo: SLO | None = None,
                    request_id: str | None = None) -> RequestStream:
        if self._dead is not None or self._stop:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        params = (params or SamplingParams()).validate()
        if any(t >= self.bundle.vocab_limit for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.bundle.vocab_limit}")
        slo = (slo or SLO()).validate()
        ids = self._tokenize(prompt)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window is {limit} tokens "
                             f"(prompt + at least 1 generated token must fit)")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(ids) + 1 > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the KV cache capacity of {capacity} tokens")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        req = Request(rid, ids, params, slo, arrival_s=time.monotonic())
        req.stream = RequestStream(rid)
        self._inbox.put(req)
        self._wakeup.set()
        return req.stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)
        self._wakeup.set()

    def stats(self) -> EngineStats:
        with self._stats_lock:
            return self._stats

    def predict_ttft_ms(self, num_prompt_tokens: int) -> float:
        """TTFT a new request would see now: prefill of what is queued (last published) plus its own."""
        pred = self.scheduler.predictor
        if pred is None:
            return 0.0
        return pred.prefill_ms(self.stats().waiting_tokens + min(num_prompt_tokens, self.max_model_len))

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def inject_fault(self, count: int = 1) -> None:
        """Test hook: the next `count` model steps raise."""
        self._inbox.put(_InjectFault(count))
        self._wakeup.set()

    def reprofile(self, time_budget_s: float = 12.0, scale: tuple[float, float] = (1.0, 1.0),
                  timeout: float = 120.0) -> dict:
        """Time the model again now and give the scheduler the new fit, its (decode, prefill) step times times
        `scale` (a calibration to served steps); returns the fit's report. It runs on the worker thread between
        steps, and only while no request is in flight (a profile needs free KV blocks and would stall running
        requests): otherwise RuntimeError. The unscaled fit replaces the cached profile."""
        job = _Reprofile(time_budget_s, scale)
        self._inbox.put(job)
        self._wakeup.set()
        if not job.done.wait(timeout):
            raise TimeoutError(f"reprofile did not finish within {timeout} s")
        if job.error is not None:
            raise RuntimeError(job.error)
        return dict(job.report or {})

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            try:
                ids = self.encode(prompt)
            except (TypeError, UnicodeError) as e:  # e.g. lone surrogates
                raise ValueError(f"prompt is not valid text: {e}") from None
            return ids or [self.bundle.eos_token_ids[0]]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.bundle.vocab_limit
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return list(prompt)

    def _build_cache(self) -> KVCache:
        c, b = self.config, self.bundle
        hf = b.config
        layers = hf.num_hidden_layers
        heads = hf.num_attention_heads
        kvh = getattr(hf, "num_key_value_heads", None) or heads
        hd = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        dtype = choose_cache_dtype(c.kv_cache_dtype, b.dtype, b.device)
        per_block = KVCache.bytes_per_block(layers, c.block_size, kvh, hd, dtype)
        if c.num_kv_blocks:
            n = c.num_kv_blocks
        elif c.kv_cache_memory_gb:
            n = int(c.kv_cache_memory_gb * 1024**3 // per_block)
        elif b.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(b.device)
            n = int((free - (1 - c.gpu_memory_utilization) * total) // per_block)
        else:
            n = int(1024**3 // per_block)  # 1 GiB on CPU
        min_blocks = -(-self.max_model_len // c.block_size)
        if n < min_blocks:
            raise ValueError(f"KV cache of {n} blocks cannot hold one full context ({min_blocks} blocks)")
        return KVCache(layers, n, c.block_size, kvh, hd, dtype, b.device)

    def _snapshot(self, last_prefill: int, last_decode: int) -> EngineStats:
        s, bm = self.scheduler, self.blocks
        tmin = min((r.tpot_slo_ms for r in s.running), default=float("inf"))
        pred = s.predictor
        return EngineStats(
            alive=self._dead is None, num_waiting=len(s.waiting), num_running=len(s.running),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free, kv_blocks_used=bm.num_used,
            vbs=s.last_vbs, strictest_tpot_ms=None if tmin == float("inf") else tmin,
            last_decode_batch=last_decode, last_prefill_batch=last_prefill, steps=self._steps,
            waiting_tokens=s.waiting_tokens(),
            rejected=dict(self._rejected),
            predictor_mape=(self.profile_report or {}).get("mape_holdout") if pred is not None else None,
            itl_correction=s.last_correction,
            phase_s=dict(self._phase))

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.scheduler.has_work():
                    self._publish(0, 0)
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: fail everyone, mark dead
            log.exception("engine worker died")
            self._dead = e
            for req in list(self._requests.values()):
                self._finish(req, FinishReason.ERROR, error=f"engine failure: {e!r}")
            self._publish(0, 0)
        finally:
            self._drain_after_stop()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _InjectFault):
                self._fault_steps += item.count
            elif isinstance(item, _Reprofile):
                self._reprofile(item)
            elif isinstance(item, Request):
                if item.request_id in self._requests:
                    item.stream.put(RequestOutput(item.request_id, finished=True, finish_reason="error",
                                                  error=f"duplicate request id {item.request_id!r}"))
                    continue
                item.detok = IncrementalDetokenizer(self.tokenizer)
                self._requests[item.request_id] = item
                reason = self.scheduler.add(item)
                if reason is not None:
                    self._reject(item, reason)
            else:
                req = self._requests.get(item)
                if req is not None:
                    self._finish(req, FinishReason.ABORT)

    def _step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(time.monotonic())
        for req, reason in plan.rejected:
            self._reject(req, reason)
        t1 = time.perf_counter()
        self._phase["schedule"] += t1 - t0
        if plan.empty:
            if plan.rejected:
                return
            # waiting requests that cannot be admitted yet (KV full with nothing running cannot happen)
            self._wakeup.wait(0.005)
            self._wakeup.clear()
            return
        reqs = plan.prefill + plan.decode
        try:
            if self._fault_steps > 0:
                self._fault_steps -= 1
                raise RuntimeError("injected fault")
            logits = self.runner.execute(plan.prefill, plan.decode)
            t2 = time.perf_counter()
            tokens = self.sampler.sample(logits, reqs)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests; the engine keeps serving
            log.exception("model step failed; failing %d requests", len(reqs))
            for req in reqs:
                self._finish(req, FinishReason.ERROR, error=f"model step failed: {e!r}")
            return
        t3 = time.perf_counter()
        self._phase["forward"] += t2 - t1
        self._phase["sample"] += t3 - t2
        now = time.monotonic()
        for req, tok in zip(reqs, tokens):
            req.num_computed_tokens = req.num_tokens
            if isinstance(tok, Exception):
                self._finish(req, FinishReason.ERROR, error=f"sampling failed: {tok!r}")
            else:
                self._append_token(req, tok, now)
        self._steps += 1
        t4 = time.perf_counter()
        self._phase["postprocess"] += t4 - t3
        # forward time refits the model; the whole step (what a running request waits per token) corrects it
        self.scheduler.on_step_done(plan, (t2 - t1) * 1000.0, (t4 - t0) * 1000.0, time.monotonic())
        self._publish(len(plan.prefill), len(plan.decode))

    def _reprofile(self, job: _Reprofile) -> None:
        from engine.profiling import load_or_profile  # noqa: PLC0415 (imports this module's types)

        if self._stop or self._requests:
            job.error = "engine shut down" if self._stop else f"{len(self._requests)} requests in flight"
        else:
            try:
                model, self.profile_report = load_or_profile(self, job.time_budget_s, fresh=True)
                self.scheduler.predictor = model.scaled(*job.scale)
                job.report = self.profile_report
            except Exception as e:  # noqa: BLE001 - the caller gets the error; the old fit stays
                job.error = f"profiling failed: {e!r}"
        job.done.set()

    def _reject(self, req: Request, reason: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self._finish(req, FinishReason.REJECTED, reject_reason=reason)

    def _append_token(self, req: Request, tok: int, now: float) -> None:
        req.token_ids.append(tok)
        req.token_times.append(now)
        if req.first_token_s is None:
            req.first_token_s = now
        p = req.params
        reason = None
        delta = req.detok.step(tok)
        if (tok in self._eos and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = FinishReason.STOP
        if delta:
            req.text += delta
            if p.stop:
                hit = _find_stop(req.text, p.stop, len(req.text) - len(delta))
                if hit is not None:
                    req.text = req.text[:hit]
                    reason = FinishReason.STOP
        if reason is None and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(req, reason, last_token=tok)
            return
        hold = max((len(s) for s in p.stop), default=1) - 1  # a stop string may still be completing
        upto = max(req.emitted_chars, len(req.text) - hold)
        text = req.text[req.emitted_chars:upto]
        req.emitted_chars = upto
        req.stream.put(RequestOutput(req.request_id, text=text, token_ids=[tok],
                                     num_prompt_tokens=req.num_prompt_tokens,
                                     num_output_tokens=req.num_output_tokens))

    def _finish(self, req: Request, reason: FinishReason, *, reject_reason: str | None = None,
                error: str | None = None, last_token: int | None = None) -> None:
        if req.status is Status.FINISHED:
            return
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_s = time.monotonic()
        self._requests.pop(req.request_id, None)
        if reason is not FinishReason.STOP or not req.params.stop:
            req.text += req.detok.flush() if req.detok is not None else ""
        text = req.text[req.emitted_chars:]
        req.emitted_chars = len(req.text)
        req.stream.put(RequestOutput(
            req.request_id, text=text, token_ids=[] if last_token is None else [last_token], finished=True,
            finish_reason=reason.value, reject_reason=reject_reason, error=error,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            metrics=RequestMetrics(req.arrival_s, req.admitted_s, req.first_token_s, req.finished_s,
                                   req.token_times)))

    def _publish(self, last_prefill: int, last_decode: int) -> None:
        snap = self._snapshot(last_prefill, last_decode)
        with self._stats_lock:
            self._stats = snap

    def _drain_after_stop(self) -> None:
        self._drain_inbox()
        for req in list(self._requests.values()):
            self._finish(req, FinishReason.ABORT, error="engine shut down")


def prompt_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> ids, as `tokenizer.encode(text, add_special_tokens=False)`. A fast tokenizer's Rust backend is
    called directly: the same ids without the Python wrapper, which was most of add_request's own cost."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False)
    return lambda text: backend.encode(text, add_special_tokens=False).ids


def _find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Earliest index of a stop string that ends inside the newly added text."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
