"""LLMEngine: `add_request` validates, tokenizes and enqueues; one worker thread runs the step loop.

Who owns what:
- the worker thread owns the `Scheduler` (requests, KV accounting, the step's bookkeeping), the model runner,
  the sampler and the `OutputProcessor` (streams, detokenizers);
- other threads talk to it only through the inbox (new requests, aborts, idle jobs) and read `stats()`, a
  snapshot the worker publishes; the latency model is immutable once fitted.
Observers (`add_step_observer`) get a `StepEvent` after every model step, on the worker thread.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from core.messages import ChatTurn, ErrorKind, GenerateRequest, PromptOptions, RejectReason, RequestOutput
from core.request import SLO, FinishReason, LoraSource, Request, Status
from core.sampling import SamplingParams, max_logprobs_of
from core.kv import BlockManager
from engine import backends
from engine.attention import ATTN_NAME
from engine.backends.base import PreparedStep, prompt_spans
from engine.config import EngineConfig, for_device, reconfigured, with_overrides
from engine.errors import EngineDeadError, EngineHungError
from engine.decoder import build_decoder
from engine.lora import LoraError, LoraLoaded, LoraRegistry
from engine.detokenizer import TokenBytes
from engine.host_stream import HostStream, Pending
from engine.inputs import InputProcessor, Prompt
from engine.kv_cache import (KVCache, KVCacheSpec, cache_spec, check_blocks, configured_blocks, cuda_cache_blocks,
                             host_cache_blocks)
from engine.loader import load_model, sampling_defaults
from engine.model_runner import ModelRunner, PromptLogits
from engine.outputs import OutputProcessor
from engine.profiling import PROFILE_BUDGET, load_or_profile, refit
from engine.sampler import Draws, PromptSpan, RowLogprobs, Sampler, SampledTokens
from engine.stats import EngineStats, StepEvent, predict_ttft_ms, snapshot
from engine.stream import OutputSink, RequestStream
from scheduling.config import SchedulerConfig
from scheduling.length_predictor import tokenizer_fingerprint
from scheduling.predictor import LatencyModel
from scheduling.scheduler import Scheduler, StepPlan

log = logging.getLogger("kairos.engine")
STEP_TIMEOUT_FLOOR_S = 120.0  # step_timeout_s=None: at least this...
STEP_TIMEOUT_FACTOR = 10.0  # ...and this many times the latency model's largest step (and each step's own)
# while steps run, the stats snapshot is taken again whenever the requests change (one arrives, is admitted,
# preempted or ends) and otherwise at least this often (its step figures: the step EWMA, the phases, the count)
PUBLISH_EVERY_S = 0.02
T = TypeVar("T")
# the collector's thresholds are the process's: the first running engine raises the young one, the last to exit
# puts back what it found
_gc_lock = threading.Lock()
_gc_users = 0
_gc_saved: tuple[int, ...] = ()


def _raise_gc_threshold(threshold: int) -> bool:
    global _gc_users, _gc_saved
    with _gc_lock:
        if _gc_users == 0:
            _gc_saved = gc.get_threshold()
            gc.set_threshold(max(threshold, _gc_saved[0]), *_gc_saved[1:])
        _gc_users += 1
    return True


def _restore_gc_threshold() -> None:
    global _gc_users
    with _gc_lock:
        _gc_users -= 1
        if _gc_users == 0:
            gc.set_threshold(*_gc_saved)


class _StepFailed(RuntimeError):
    """A request's own forward failed (its step was re-run request by request)."""


class _Preempted(RuntimeError):
    """A request preempted while its failed step was in flight (overlap scheduling on the host: the next step was
    planned before this one landed): its KV went with the preemption, so its part cannot be re-run alone. Not its
    failure: its token is dropped, and drawn again once it runs again (`_resolve`)."""


class _InjectedFault(RuntimeError):
    """`inject_fault`'s failure of a whole step (not re-run request by request)."""


@dataclass(slots=True)
class _InjectFault:
    count: int
    fatal: bool = False
    hang_s: float = 0.0  # the next step first blocks this long (a device call that does not return)


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet (overlap scheduling keeps one in flight)."""
    plan: StepPlan
    reqs: list[Request]  # the rows that sample (`plan.requests` when it was launched)
    index: list[int]  # where each row's placeholder sits in its token_ids (`Scheduler.launched`)
    tokens: SampledTokens | Pending | None  # None: no row samples (prefill chunks only); Pending: on the host stream
    t0: float  # when its scheduling started (perf_counter)
    forward_ms: float  # its forward's launch (the whole forward where the device is the host)
    # on the host stream: the step's forward requests as it was launched, (num_computed_tokens, num_tokens) each, and
    # its draw's plan: what re-running it request by request needs once the requests have moved on
    as_launched: list[tuple[int, int]] | None = None
    draws: Draws | None = None


@dataclass(slots=True)
class _IdleJob:
    fn: Callable[["LLMEngine"], Any]
    timeout_s: float = math.inf  # its caller's wait: the watchdog gives the job that much more than a step
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, on_outputs: Callable[[], None] | None = None,
                 on_hung: Callable[[str], None] | None = None, **overrides) -> None:
        """Load the model and start the worker; raises what loading raised (ValueError for bad settings).
        `on_outputs`, if given, runs on the worker thread after each turn of its loop (a step, or a drained
        inbox while idle): the hook that ships a turn's stream items out of the process at once
        (`engine.core_proc`). `on_hung(why)`, if given, runs on the watchdog thread once the worker has hung
        (`step_timeout_s`) and the engine counts as dead, instead of failing every open stream here."""
        self.config = with_overrides(config or EngineConfig(), overrides)
        self._emit = on_outputs or (lambda: None)
        self._on_hung = on_hung
        self.step_timeout_s = 0.0  # the watchdog's limit on one turn of the worker (`_setup`; 0: no watchdog)
        self._turn = (time.monotonic(), math.inf)  # (start, allowance) of the worker's current turn
        self._hang_s = 0.0  # inject_fault(hang_s=...)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[str, Request] = {}  # worker-owned
        self.loras: LoraRegistry | None = None  # the LoRA adapters it serves (`_setup`; worker-owned)
        self._lora_loader: _Loader | None = None  # where they load (`LoraRegistry`)
        # requests that wait for their adapter's load, by the load (worker-owned)
        # (and when the load began: its deadline's)
        self._lora_waiting: dict[tuple[str, LoraSource | None], tuple[float, list[Request]]] = {}
        self._observers: list[Callable[[StepEvent], None]] = []
        self._stop = False
        self._stopped = threading.Event()  # set by shutdown (the watchdog's wake-up)
        self._watchdog: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._closed = False  # the worker has ended and read its inbox for the last time (`_run`'s end)
        self._fault_steps = 0
        self._fatal_fault = False
        self._steps = 0
        self._churn = 0  # requests added or ended so far (a published snapshot is stale once it moves)
        self._published: tuple[tuple[int, int], float] = ((-1, -1), -math.inf)  # (requests, when)
        self._rejected: dict[str, int] = {}
        self._phase = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "postprocess": 0.0}
        self._step_ms: float | None = None  # EWMA of the wall time of steps that decoded (the ITL of every step)
        self._step_batch: float | None = None  # EWMA of their decode batch sizes
        self._inflight: _InFlight | None = None  # overlap scheduling: the launched step not yet resolved
        self._next_scheduler: SchedulerConfig | None = None  # `reconfigure`'s, until the scheduler has drained
        self._reconfigures = 0  # `reconfigure` calls taken
        self._parked: list[Request] = []  # requests that arrived meanwhile: the next scheduler takes them
        self._last_resolved = 0.0  # perf_counter when the last step's tokens were resolved
        self._stats_lock = threading.Lock()
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._gc_raised = False
        self._thread = threading.Thread(target=self._main, name="kairos-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            self._thread.join()
            raise self._setup_error
        if self.step_timeout_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name="kairos-engine-watchdog", daemon=True)
            self._watchdog.start()

    def _setup(self) -> None:
        """On the worker thread, like every tensor op of the engine: libgomp keeps one thread pool per thread
        that starts parallel regions and, once it manages more threads than there are cores, wakes its workers
        by futex instead of spinning, which slowed every step when the model was loaded (and so a pool started)
        on the caller's thread."""
        config = self.config
        t0 = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.bundle = b = load_model(
            config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=config.device,
            trust_remote_code=config.trust_remote_code, attn_implementation=ATTN_NAME,
            max_model_len=config.max_model_len, backend=config.backend, load_format=config.load_format,
            chat_template=config.chat_template, own_decoder=config.model_impl != "hf")
        if b.device.type == "cuda":  # this thread's current device: kernels, graphs and events go to the model's GPU
            torch.cuda.set_device(b.device)
        self._given_scheduler = config.scheduler  # its knobs as given, which `reconfigure` starts from
        self.config = config = for_device(config, b.device.type)  # a GPU's scheduler defaults where not given
        self.backend = backend = backends.create(config.backend, b.device, config.kernels)
        self.upcast_linears = backend.adapt_model(b.model, config.cpu_upcast_matmul)
        self.tokenizer = b.tokenizer
        self.max_model_len = b.max_model_len
        self.model_name = b.name
        # what a request that leaves them out samples with (the OpenAI server applies them: model_info)
        self.sampling_defaults: dict[str, float | int] = {}
        if config.generation_config == "auto":
            self.sampling_defaults, skipped = sampling_defaults(b.generation_sampling)
            if self.sampling_defaults:
                log.info("sampling defaults from the model's generation config: %s", self.sampling_defaults)
            if skipped:
                log.warning("the model's generation config sets %s, not a valid sampling value: not applied",
                            ", ".join(f"{k}={v!r}" for k, v in skipped.items()))
        spec = cache_spec(config, b, backend)
        backend.bind(spec, b.dtype, b.config.num_attention_heads)
        decoder = build_decoder(config.model_impl, b, backend, self.upcast_linears > 0, config.serves_lora)
        # (the adapters of lora_modules load here, before the KV cache is sized: their memory is counted)
        if config.serves_lora:  # adapters loaded later are read on a thread of their own, between the worker's steps
            self._lora_loader = _Loader()
            self.loras = LoraRegistry(decoder, config.lora_paths(), config.dynamic_lora_loading_path,
                                      config.max_loras, config.max_lora_rank, self._lora_loader.submit, self._post)
        self.sampler = backend.sampler(b.vocab_limit, b.eos_token_ids)
        self.sampler.token_bytes = TokenBytes(b.tokenizer)  # what guided decoding checks
        # its tokens' first bytes (a guided row's whole scan keeps those that may come) read at the start, not in the
        # first step that needs them (a pass over the vocabulary: a stall of that step's batch)
        self.sampler.token_bytes.first_bytes(b.vocab_limit)
        t_load = time.perf_counter()
        blocks = configured_blocks(config, spec)
        if blocks is None and b.device.type == "cuda":  # what is left after the largest step's activations
            blocks = cuda_cache_blocks(config, spec, b.device, self._warmup_peak(spec, decoder))
        elif blocks is None:
            blocks = host_cache_blocks(spec)
        check_blocks(blocks, spec, self.max_model_len)
        self.cache = KVCache.of(spec, blocks, b.device, backend.scratch_blocks)
        backend.attach(self.cache)
        self.runner = ModelRunner(b.model, self.cache, backend, decoder)
        # where the device is the host, a thread of its own runs the steps (`engine.host_stream`; only when asked)
        host = b.device.type != "cuda"
        self.overlap = config.overlap == "on" or (config.overlap == "auto" and not host)
        self._stream = HostStream(torch.get_num_threads()) if self.overlap and host else None
        t_cache = time.perf_counter()
        # (enforce_eager: the kernels compiled, no graph captured)
        self.graph_report = backend.capture(self.runner, 0 if config.enforce_eager else config.scheduler.max_num_seqs,
                                            self.max_model_len, config.mixed_graph_tokens)
        self.inputs = InputProcessor(b.tokenizer, b.vocab_limit, b.eos_token_ids, self.max_model_len,
                                     self.cache.num_blocks * self.cache.block_size,
                                     config.max_tokens_over_context == "reject",
                                     config.lora_serving(decoder.lora_shape) if config.serves_lora else None,
                                     config.scheduler.by_priority, self.sampling_defaults.get("max_tokens"),
                                     config.max_logprobs)
        self.outputs = OutputProcessor(b.tokenizer, b.eos_token_ids)
        t_graphs = time.perf_counter()
        predictor, self.profile_report = load_or_profile(self)
        self.scheduler = self._new_scheduler(config.scheduler, predictor)
        self.step_timeout_s = step_timeout_s(config, predictor, self.max_model_len)
        self._stats = self._snapshot(0, 0)
        t_end = time.perf_counter()
        tokens = self.cache.num_blocks * self.cache.block_size
        log.info("engine ready in %.1f s (model %.1f s, KV cache %.1f s, graphs %.1f s, latency profile %.1f s%s): "
                 "%s on %s in %s (%s backend); KV cache %d blocks of %d = %d tokens, %.1fx a full %d-token context; "
                 "policy %s, max_num_seqs %d, prefill_max_tokens %s, step_timeout_s %g",
                 t_end - t0, t_load - t0, t_cache - t_load, t_graphs - t_cache, t_end - t_graphs,
                 ", cached" if (self.profile_report or {}).get("cached") else "", self.model_name, b.device,
                 str(b.dtype).removeprefix("torch."), type(backend).__name__.removesuffix("Backend").lower(),
                 self.cache.num_blocks, self.cache.block_size, tokens, tokens / self.max_model_len, self.max_model_len,
                 config.scheduler.policy, config.scheduler.max_num_seqs, config.scheduler.prefill_max_tokens,
                 self.step_timeout_s)
        # The model, its tokenizer and the libraries leave hundreds of thousands of objects that live as long as the
        # engine, and a full collection walks them all: a stall of every request in flight. Like a Ray Serve replica
        # after its start-up, the engine moves them out of the collector's reach (the permanent generation) until
        # its worker exits. Each step then allocates thousands of short-lived objects: a higher first threshold runs
        # the young collection less often, on the same objects.
        gc.collect()
        gc.freeze()
        if self.config.gc_threshold:
            self._gc_raised = _raise_gc_threshold(self.config.gc_threshold)

    def _main(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - re-raised by the constructor
            self._setup_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._run()
        finally:
            gc.unfreeze()  # what the engine held may be garbage now (its cycles too)
            if self._gc_raised:
                _restore_gc_threshold()
            self._release()

    def _warmup_peak(self, spec: KVCacheSpec, decoder) -> int:
        """Bytes the largest step's activations take beyond the weights, measured as vLLM and nano-vllm do: one
        step with the longest prefill a step can run and `max_num_seqs` decodes, over a cache just big enough for it
        (CUDA: the cache is sized after this, from what is left). The longest prefill: the token budget with chunked
        prefill, else a prompt of the whole window (admitted alone, in one step); and the latency profile's longest
        probe, twice the budget (`profiling.load_or_profile`)."""
        sc = self.config.scheduler
        limit = self.max_model_len - 1
        one_step = sc.prefill_max_tokens if sc.chunked_prefill and sc.prefill_max_tokens else limit
        budget = min(max(one_step, 2 * (sc.prefill_max_tokens or PROFILE_BUDGET)), limit)
        seqs = sc.max_num_seqs
        bs = spec.block_size
        dev = self.bundle.device
        n = -(-budget // bs) + seqs * -(-2 // bs)  # (each decode holds 2 tokens: 2 blocks of 1)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        cache = KVCache.of(spec, n, dev, self.backend.scratch_blocks)
        base += cache.nbytes
        self.backend.attach(cache)
        runner = ModelRunner(self.bundle.model, cache, self.backend, decoder)
        blocks = BlockManager(n, bs)
        # every row sampled, penalized, under min_p and with logprobs: the peak holds the sampler's largest step too
        # (its token counts for `seqs` penalized requests are made here, and freed with the rest)
        top = max_logprobs_of(self.config.max_logprobs, self.bundle.vocab_limit)
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                frequency_penalty=0.1, logprobs=top)
        prompt = Request("warmup-prefill", [0] * budget, params)
        decodes = [Request(f"warmup-decode-{i}", [0, 0], params) for i in range(seqs)]
        for r in (prompt, *decodes):
            blocks.ensure(r, r.num_tokens)
        for r in decodes:
            r.num_computed_tokens = 1
        logits = runner.execute([prompt], decodes)
        self.sampler.sample(logits, [prompt, *decodes])
        for r in (prompt, *decodes):
            self.sampler.release(r.request_id)
        torch.cuda.synchronize(dev)
        self.sampler.drop_state()
        peak = max(0, torch.cuda.max_memory_allocated(dev) - base)
        del logits, runner, cache
        self.backend.attach(None)
        gc.collect()
        torch.cuda.empty_cache()
        log.info("warm-up step (%d prompt tokens, %d decodes): %.2f GiB of activations at its peak", budget, seqs,
                 peak / 1024**3)
        return peak

    def _release(self) -> None:
        """The engine stopped: free what it holds on the device (weights, KV cache, the backend's buffers and graphs)
        so that another engine in this process can have it."""
        stream = getattr(self, "_stream", None)
        if stream is not None:  # its step in flight writes the cache: it ends first
            stream.close()
        self.loras = None  # (it holds the decoder)
        backend = getattr(self, "backend", None)
        if backend is None:
            return
        backend.release()
        sampler = getattr(self, "sampler", None)
        if sampler is not None:
            sampler.drop_state()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.model = runner.decoder = runner.cache = None
        cache = getattr(self, "cache", None)
        if cache is not None:
            cache.k = cache.v = None
        self.bundle.model = None
        gc.collect()
        if self.bundle.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ public API (any thread)
    def add_request(self, prompt: Prompt | None, params: SamplingParams | None = None, slo: SLO | None = None,
                    request_id: str | None = None, *, messages: Sequence[ChatTurn] | None = None,
                    options: PromptOptions | None = None, lora: str | None = None,
                    cache_salt: str | None = None, lora_source: LoraSource | None = None,
                    priority: int = 0, read_thinking: bool = False) -> RequestStream:
        """Validate and tokenize (ValueError on bad input), then enqueue; the stream yields `RequestOutput`s.
        `options`: how the prompt is tokenized (`PromptOptions`; default a text prompt's special tokens, a chat's
        template with the assistant's turn opened). `lora`: the name of a LoRA adapter served (`lora_modules`) to
        run it through (`lora_source`: the folder of one loaded at run time); `cache_salt` (vLLM's): its prompt shares
        cached KV only with requests of the same salt; `priority` (vLLM's): lower first, with the scheduler's
        scheduling_policy "priority" (else it has no effect, as vLLM's); `read_thinking`: its stream says where the
        prompt leaves a reasoning model's thinking (`RequestStream.prompt_thinking`)."""
        req = self.inputs.process(prompt, params, slo, request_id, messages, options, lora, cache_salt, lora_source,
                                  priority, read_thinking)
        stream = RequestStream(req.request_id, req.prompt_token_ids, req.prompt_thinking, req.arrival_s)
        self.submit(req, stream)
        return stream

    def add_requests(self, prompts: Sequence[Prompt], params: SamplingParams | None = None,
                     slo: SLO | None = None) -> list[RequestStream]:
        """`add_request` for a list of prompts that reach the scheduler together, as vLLM's `LLM.generate` adds
        its whole list before its first step (one by one, the worker may start on the first prompt alone). Every
        prompt is validated first: a bad one raises ValueError and enqueues none."""
        reqs = [self.inputs.process(p, params, slo, None, None) for p in prompts]
        streams = [RequestStream(r.request_id) for r in reqs]
        self._enqueue(list(zip(reqs, streams)))
        return streams

    def submit(self, req: Request, stream: OutputSink) -> None:
        """Enqueue a request that `InputProcessor.process` has already validated; the worker thread puts its
        items into `stream`."""
        self._enqueue((req, stream))

    def _enqueue(self, item: tuple[Request, OutputSink] | list[tuple[Request, OutputSink]]) -> None:
        if self._dead is not None or self._stop:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        self._post(item)

    def _post(self, item: Any) -> None:
        """Put `item` in the worker's inbox and wake the worker."""
        self._inbox.put(item)
        self._wakeup.set()
        if isinstance(self._dead, EngineHungError) and self._on_hung is None:  # the watchdog emptied the inbox
            self._fail_inbox(f"engine failure: {self._dead}")  # before this put: nothing would read it
        elif self._closed:  # the worker read its inbox for the last time before this put (`_enqueue` checked
            self._fail_inbox(self._gone_why())  # before it stopped): nothing will read it

    def generate(self, request: GenerateRequest) -> RequestStream:
        """`add_request` for the typed message the ingress sends."""
        return self.add_request(request.prompt, request.params, request.engine_slo, request.request_id,
                                messages=request.messages, options=request.options, lora=request.lora,
                                cache_salt=request.cache_salt, lora_source=request.lora_source,
                                priority=request.priority, read_thinking=request.read_thinking)

    def abort(self, request_id: str) -> None:
        self._post(request_id)

    def stats(self) -> EngineStats:
        with self._stats_lock:
            return self._stats

    @property
    def latency_model(self) -> LatencyModel | None:
        """The scheduler's current step-time model (immutable; replaced whole by `reprofile`)."""
        return self.scheduler.latency

    @property
    def itl_correction_enabled(self) -> bool:
        return self.scheduler.flags.itl_correction

    def predict_ttft_ms(self, num_prompt_tokens: int) -> float:
        """TTFT a new request would see now: prefill of what is queued (last published) plus its own."""
        return predict_ttft_ms(self.latency_model, self.stats(), num_prompt_tokens, self.max_model_len)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (None while it can)."""
        if self.is_alive():
            return None
        return str(self._dead) if self._dead is not None else "its worker exited"

    def add_step_observer(self, fn: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call `fn(event)` on the worker thread after every model step (keep it cheap); returns the unsubscribe."""
        self.run_idle(lambda e: e._observers.append(fn), require_idle=False)
        return lambda: self.run_idle(lambda e: e._observers.remove(fn), require_idle=False)

    def run_idle(self, fn: Callable[["LLMEngine"], T], timeout: float = 120.0, *, require_idle: bool = True) -> T:
        """Run `fn(engine)` on the worker thread between steps and return its result (or raise its error).
        With `require_idle` (the default) it runs only while no request is in flight, else RuntimeError: the
        hook for profiling and benchmarks that time steps on the real cache."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        job = _IdleJob(fn if not require_idle else _when_idle(fn), timeout_s=math.inf if timeout is None else timeout)
        self._post(job)
        if not job.done.wait(timeout):
            raise TimeoutError(f"the engine did not run the job within {timeout} s")
        if job.error is not None:
            raise job.error
        return job.result

    def reprofile(self, time_budget_s: float = 12.0, scale: tuple[float, float] = (1.0, 1.0),
                  timeout: float = 120.0) -> dict:
        """Time the model again now and give the scheduler the new fit, its (decode, prefill) step times times
        `scale` (a calibration to served steps); returns the fit's report. Only while no request is in flight
        (a profile needs free KV blocks and would stall running requests): otherwise RuntimeError. The
        unscaled fit replaces the cached profile."""
        return self.run_idle(lambda e: refit(e, time_budget_s, scale), timeout)

    def reconfigure(self, scheduler: dict[str, Any]) -> SchedulerConfig:
        """Change the running engine's scheduler knobs (its policy and the policy's mechanisms, margins, the length
        predictor) without loading anything again: `scheduler` is SchedulerConfig knobs by name over the ones the
        engine started with, replacing what an earlier call asked (`engine.config.reconfigured`; a Serve
        deployment's `user_config` reaches it this way). The change takes effect once the requests the scheduler
        holds (running and waiting) have finished under it; those that arrive meanwhile wait for the new one, which
        takes them in their order (a switch under load costs them the old scheduler's drain: at most about its
        longest reply). Returns the config that will run;
        ValueError for an unknown knob, a bad value, or one fixed at start (`FIXED_SCHEDULER_KNOBS`)."""
        try:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self._dead!r}")
            config = reconfigured(self._given_scheduler, self.config.scheduler, scheduler, self.bundle.device.type)
            # (requests from now on; set before the worker can take the change: a swap that fails sets it back)
            self.inputs.priority_scheduling = config.by_priority
            self._post(config)
            return config
        finally:  # (counted once its rule is set: the stats' count and rule, read in that order, agree)
            self._reconfigures += 1

    def inject_fault(self, count: int = 1, *, fatal: bool = False, hang_s: float = 0.0) -> None:
        """Test hook: the next `count` model steps raise (their requests fail, the engine goes on); with `fatal`,
        the next step breaks the worker's loop itself (every request fails, the engine is dead); with `hang_s`,
        the next step first blocks that long, as a device call that does not return (past `step_timeout_s` the
        watchdog declares the engine hung)."""
        self._post(_InjectFault(count, fatal, hang_s))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wakeup.set()
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        # the watchdog too: a thread that outlives its engine may drop the engine's last reference, and free its
        # tensors, while the interpreter exits (a daemon thread that blocks then is ended mid C++ frame: an abort)
        w = self._watchdog
        if w is not None and w.is_alive() and threading.current_thread() is not w:
            w.join(timeout)
        if self._lora_loader is not None:  # (likewise: a load in progress ends first, within `timeout`)
            self._lora_loader.close(timeout)

    # ------------------------------------------------------------------ worker thread
    def _snapshot(self, last_prefill: int, last_decode: int) -> EngineStats:
        mape = (self.profile_report or {}).get("mape_holdout")
        # (the count read before the rule: a count that takes in a reconfigure call comes with that call's rule)
        taken = self._reconfigures
        snap = snapshot(self.scheduler, alive=self._dead is None, steps=self._steps, rejected=self._rejected,
                        phase_s=self._phase, predictor_mape=mape, last=(last_prefill, last_decode),
                        step=(self._step_ms, self._step_batch), reconfigures=taken,
                        priority_scheduling=self.inputs.priority_scheduling,
                        lora_adapters=len(self.loras.loaded) if self.loras is not None else 0)
        # waiting for a scheduler change, or for their adapter's load: they count as waiting (those not aborted)
        held = [*self._parked, *(r for _, rs in self._lora_waiting.values() for r in rs)] \
            if self._parked or self._lora_waiting else ()
        if held:
            snap = dataclasses.replace(snap, num_waiting=snap.num_waiting + sum([r.status is not Status.FINISHED
                                                                                 for r in held]))
        return snap

    def _run(self) -> None:
        limit = self.step_timeout_s or math.inf
        try:
            while not self._stop:
                self._turn = (time.monotonic(), limit)  # the watchdog's clock: this turn must end within `limit`
                self._drain_inbox()
                if self._lora_waiting:
                    self._expire_lora_loads()
                if not self.scheduler.has_work():
                    if self._inflight is not None:  # its requests all ended (aborted): nothing waits for it
                        self._settle()
                        continue
                    if self._next_scheduler is not None:
                        self._swap_scheduler()
                        if self.scheduler.has_work():  # the requests that waited for it
                            continue
                    self._publish(0, 0)
                    self._emit()
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                self._step()
                self._emit()
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: fail everyone, mark dead
            log.exception("engine worker died")
            self._dead = e
            for req in list(self._requests.values()):
                try:
                    self._finish(req, FinishReason.ERROR, error=f"engine failure: {e!r}")
                except Exception:  # noqa: BLE001 - its stream is ended below all the same
                    log.exception("request %s: ending it after the worker died failed", req.request_id)
            self._publish(0, 0)
        finally:
            try:
                self._inflight = None  # (its device work finishes before `_release` frees memory: `Backend.release`)
                self._drain_after_stop()
                self._emit()
            finally:  # whatever failed above, no stream is left waiting
                # a request posted after that drain (its `_enqueue` ran before the stop) is failed by its poster once
                # this is set, or here if it came before: either way its stream ends
                self._closed = True
                why = self._gone_why()
                for rid, stream in self.outputs.open_streams():  # (none, unless ending one failed above)
                    _put_quietly(stream, RequestOutput.failed(rid, why, ErrorKind.UNAVAILABLE))
                self._fail_inbox(why)

    def _gone_why(self) -> str:
        return "engine shut down" if self._dead is None else f"engine failure: {self._dead!r}"

    def _inbox_items(self) -> Iterator[Any]:
        """Take what is in the inbox now, item by item."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for item in self._inbox_items():
            if isinstance(item, _InjectFault):
                if item.hang_s > 0:
                    self._hang_s = item.hang_s
                elif item.fatal:
                    self._fatal_fault = True
                else:
                    self._fault_steps += item.count
            elif isinstance(item, _IdleJob):
                self._run_job(item)
            elif isinstance(item, LoraLoaded):
                self._lora_landed(item)
            elif isinstance(item, SchedulerConfig):  # reconfigure: the next one while idle
                self._next_scheduler = item
            elif isinstance(item, tuple):
                self._admit(*item)
            elif isinstance(item, list):  # add_requests: one batch
                for req, stream in item:
                    self._admit(req, stream)
            else:
                req = self._requests.get(item)
                if req is not None:
                    self._finish(req, FinishReason.ABORT)

    def _admit(self, req: Request, stream: OutputSink) -> None:
        if req.request_id in self._requests:
            stream.put(RequestOutput.failed(req.request_id, f"duplicate request id {req.request_id!r}",
                                            ErrorKind.INVALID_REQUEST))
            return
        lora_id: int | tuple = 0
        if req.lora is not None:
            try:
                lora_id = self._acquire_lora(req.lora, req.lora_source)
            except LoraError as e:  # (a dynamic adapter that does not load: this request's error alone)
                stream.put(RequestOutput.failed(req.request_id, str(e), ErrorKind.INVALID_REQUEST))
                return
        self._requests[req.request_id] = req
        self._churn += 1
        self.outputs.add(req, stream)
        if not isinstance(lora_id, int):  # its adapter is being loaded: it waits for that load (`_lora_landed`)
            self._lora_waiting.setdefault(lora_id, (time.monotonic(), []))[1].append(req)
            return
        req.lora_id = lora_id
        self._take_or_park(req)

    def _take_or_park(self, req: Request) -> None:
        if self._next_scheduler is not None:  # a scheduler change waits for the requests the scheduler holds
            self._parked.append(req)
            return
        self._take((req,))

    def _acquire_lora(self, name: str, source: LoraSource | None) -> int | tuple:
        """The id of LoRA adapter `name` for a request the engine takes, or the load it waits for."""
        if self.loras is None:
            raise LoraError("this engine serves no LoRA adapters")
        return self.loras.acquire(name, source)

    def _lora_landed(self, done: LoraLoaded) -> None:
        """An adapter's load has ended (`LoraRegistry`'s loader): the requests that waited for it run through it, or
        each fails with the reason it did not load (those aborted meanwhile have ended already)."""
        if self.loras is None or self.loras.stale(done):  # (one past its deadline: its requests failed already)
            return
        waiting = [r for r in self._lora_waiting.pop(done.key, (0.0, []))[1] if r.status is not Status.FINISHED]
        try:
            lora_id = self.loras.installed(done)
        except LoraError as e:
            for r in waiting:
                self._finish(r, FinishReason.ERROR, error=str(e), error_kind=ErrorKind.INVALID_REQUEST)
            return
        for r in waiting:
            r.lora_id = self.loras.hold(lora_id)
            self._take_or_park(r)

    def _expire_lora_loads(self) -> None:
        """Loads past `lora_load_timeout_s` (files that cannot be read: a hung mount) fail the requests waiting for
        them (503: a retry loads again); the loader goes on with later loads on a new thread, the stuck read left
        to end on its own (what it brings then is dropped: `LoraRegistry.stale`)."""
        limit = self.config.lora_load_timeout_s
        if not limit or self.loras is None or self._lora_loader is None:
            return
        now = time.monotonic()
        for key in [k for k, (t0, _) in self._lora_waiting.items() if now - t0 > limit]:
            self.loras.forget(key)
            self._lora_loader.restart()
            why = (f"LoRA adapter {key[0]!r} did not load within {limit:g} s (lora_load_timeout_s): its files could "
                   "not be read in time; retry later")
            log.error("%s", why)
            for r in self._lora_waiting.pop(key)[1]:
                if r.status is not Status.FINISHED:
                    self._finish(r, FinishReason.ERROR, error=why, error_kind=ErrorKind.UNAVAILABLE)

    def _new_scheduler(self, config: SchedulerConfig, predictor: LatencyModel | None) -> Scheduler:
        b = self.bundle
        return Scheduler(config, self.cache.num_blocks, self.cache.block_size, self.max_model_len, b.eos_token_ids,
                         predictor, tokenizer_fingerprint(b.tokenizer_path or b.path), b.tokenizer)

    def _swap_scheduler(self) -> None:
        """`reconfigure`'s change, on the worker once the scheduler holds no request: a new scheduler of the asked
        config over the same KV cache (every block free) and latency model, which then takes the requests that
        arrived meanwhile (`_parked`), in their order. What the engine counts since its start (preemptions, the
        latency model's error on the served steps) carries over; what a policy measures for itself (its ITL
        correction, TTFT margins, length calibration) starts again."""
        config, self._next_scheduler = self._next_scheduler, None
        parked, self._parked = [r for r in self._parked if r.status is not Status.FINISHED], []
        old = self.scheduler
        try:
            new = self._new_scheduler(config, old.latency)
        except Exception:  # noqa: BLE001 - e.g. a length predictor file that does not load: serve on as before
            log.exception("scheduler not reconfigured (policy %s stays): %s", old.config.policy,
                          config.model_dump(exclude_unset=True))
            new = None
        if new is None:
            self.inputs.priority_scheduling = old.config.by_priority  # (the old scheduler's ranking stands)
            self._churn += 1  # (the published rule is stale)
            self._take(parked)
            return
        new.num_preemptions, new.model_error = old.num_preemptions, old.model_error
        new.num_rejected_seats_full = old.num_rejected_seats_full
        new.prefix_queries, new.prefix_hits = old.prefix_queries, old.prefix_hits
        self.scheduler = new
        self.config = self.config.model_copy(update={"scheduler": config})
        self._churn += 1  # the published snapshot is stale
        self._take(parked)
        log.info("scheduler reconfigured: policy %s (was %s); knobs %s", config.policy, old.config.policy,
                 config.model_dump(exclude_unset=True))

    def _take(self, reqs: Sequence[Request]) -> None:
        """The scheduler takes requests the engine has admitted already (`_admit`'s part after its bookkeeping)."""
        for req in reqs:
            reason = self.scheduler.add(req)
            if reason is not None:
                self._reject(req, reason)

    def _run_job(self, job: _IdleJob) -> None:
        try:
            self._settle()  # a job sees the engine between steps, every launched step resolved
            if self._stop:
                raise RuntimeError("engine shut down")
            if self._dead is not None:  # (the inbox drained after the worker's loop broke: no job on its remains)
                raise EngineDeadError(f"engine is not running: {self._dead!r}")
            self._turn = (time.monotonic(), job.timeout_s + (self.step_timeout_s or math.inf))
            job.result = job.fn(self)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            job.error = e
        job.done.set()
        self._turn = (time.monotonic(), self.step_timeout_s or math.inf)  # the rest of the turn: a step's limit

    def _step(self) -> None:
        """Schedule and launch a step; resolve the step launched before it (overlap scheduling: this one stays in
        flight while the host plans the next), or this one at once (without overlap)."""
        t0 = time.perf_counter()
        sched = self.scheduler
        plan = sched.schedule(time.monotonic())
        for req, reason in plan.rejected:
            self._reject(req, reason)
        t1 = time.perf_counter()
        self._phase["schedule"] += t1 - t0
        prev, self._inflight = self._inflight, None
        if plan.empty:
            if prev is not None:  # what is left runs out with the step in flight (its last tokens)
                self._resolve(prev)
            elif not plan.rejected:  # waiting requests that cannot be admitted yet
                self._wakeup.wait(0.005)
                self._wakeup.clear()
            return
        reqs = plan.requests  # those that sample a token (a prefill chunk does not)
        # only a prefill of more than a window outruns the largest step the automatic limit was sized for
        if plan.num_prefill_tokens > self.max_model_len and self.config.step_timeout_s is None:
            self._allow(plan)
        if self._hang_s > 0:
            hang, self._hang_s = self._hang_s, 0.0
            time.sleep(hang)
        if self._fatal_fault:
            raise RuntimeError("injected fatal fault")
        draws: Draws | None = None
        try:
            if self._fault_steps > 0:
                self._fault_steps -= 1
                raise _InjectedFault("injected fault")
            if self._stream is not None:  # what reads the requests here; the launch is below
                staged = self.runner.prepare(plan.prefill, plan.decode, plan.prefill_ends), \
                    self.sampler.plan(reqs) if reqs else None
                t2 = time.perf_counter()
                tokens = None
            else:
                staged = None
                prev_tokens = prev.tokens.device_tokens(self.bundle.device) \
                    if prev is not None and prev.tokens is not None else None
                logits = self.runner.execute(plan.prefill, plan.decode, plan.prefill_ends, prev_tokens)
                t2 = time.perf_counter()
                # planned, then drawn: a draw that fails is re-drawn per request with the numbers planned here (a
                # seeded request's generator gives them once)
                draws = self.sampler.plan(reqs, logits.device, prev.tokens if prev is not None else None) \
                    if reqs else None
                spans = _prompt_rows(plan.prefill, plan.prefill_ends)
                tokens = _draw_step(self.sampler, logits, draws, spans)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests; the engine keeps serving
            t2 = time.perf_counter()
            if prev is not None:  # the step before first: its tokens are this one's inputs
                self._resolve(prev)
                prev = None
            isolated = self._isolate(plan, reqs, e, draws=draws)
            if isolated is not None:  # its tokens are on the host already: resolved now, so that the requests that
                # failed end before the next step is planned (else that step fails and is isolated again)
                self._resolve(_InFlight(plan, reqs, sched.launched(plan, reqs), isolated, t0, (t2 - t1) * 1000.0))
            return
        if staged is not None:
            self._phase["forward"] += t2 - t1  # preparing the inputs (and planning the draw)
            self._launch_on_host(plan, reqs, prev, *staged, t0)
            return
        t3 = time.perf_counter()
        self._phase["forward"] += t2 - t1
        self._phase["sample"] += t3 - t2
        launched = _InFlight(plan, reqs, sched.launched(plan, reqs), tokens, t0, (t2 - t1) * 1000.0)
        if prev is not None:
            self._resolve(prev)
        if self.overlap:
            self._inflight = launched
        else:
            self._resolve(launched)

    def _launch_on_host(self, plan: StepPlan, reqs: list[Request], prev: _InFlight | None, prepared: PreparedStep,
                        draws: Draws | None, t0: float) -> None:
        """Overlap scheduling on the host stream, the step's inputs prepared and its draw planned (they read the
        requests): wait for the step before to land (its tokens are this one's inputs; a step that failed is re-run
        request by request first), launch this one, and hand the step before's tokens out while it runs."""
        as_launched = [(r.num_computed_tokens, len(r.token_ids)) for r in plan.forward]
        spans = _prompt_rows(plan.prefill, plan.prefill_ends)
        if prev is not None:
            self._landed(prev)
        prev_tokens = prev.tokens if prev is not None else None
        if draws is not None:  # its penalized rows' last tokens may be the step before's
            draws.prev = prev_tokens
        runner, sampler, device = self.runner, self.sampler, self.bundle.device

        def step() -> SampledTokens | None:
            ids = prev_tokens.device_tokens(device) if prev_tokens is not None else None
            return _draw_step(sampler, runner.forward(prepared, ids), draws, spans)
        pending = self._stream.launch(step)  # (before the placeholders: the step starts its kernel the sooner)
        launched = _InFlight(plan, reqs, self.scheduler.launched(plan, reqs), pending, t0, 0.0, as_launched, draws)
        if prev is not None:
            self._resolve(prev)
        self._inflight = launched

    def _landed(self, f: _InFlight) -> None:
        """Wait for a step launched on the host stream to run (time spent waiting for the device); if it raised,
        re-run it request by request, each request as it was when the step was launched."""
        if not isinstance(f.tokens, Pending):
            return
        t0 = time.perf_counter()
        try:
            f.tokens, f.forward_ms = f.tokens.result()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests; the engine keeps serving
            f.tokens = None
            isolated = self._isolate(f.plan, f.reqs, e, f)
            if isolated is not None:
                f.tokens = isolated
            elif f.reqs:  # every request of the step failed (`_isolate` ended them)
                f.tokens = SampledTokens.of([0] * len(f.reqs))
        self._phase["forward"] += time.perf_counter() - t0

    def _allow(self, plan: StepPlan) -> None:
        """The automatic step_timeout_s covers a step of the whole window; a step predicted longer still (a prefill
        of many whole prompts: no token budget) gets STEP_TIMEOUT_FACTOR times its own prediction."""
        lm = self.scheduler.predictor
        if lm is None:
            return
        rows, ctx = len(plan.decode), plan.decode_mean_len
        ms = lm.beside_ms(plan.num_prefill_tokens, plan.num_prefill_sq, rows, ctx) \
            + (lm.itl_ms(rows, ctx) if rows else 0.0)
        started, limit = self._turn
        if STEP_TIMEOUT_FACTOR * ms / 1000.0 > limit:
            self._turn = (started, STEP_TIMEOUT_FACTOR * ms / 1000.0)

    def _settle(self) -> None:
        """Resolve the step in flight, if any."""
        f, self._inflight = self._inflight, None
        if f is not None:
            self._resolve(f)

    def _resolve(self, f: _InFlight) -> None:
        """A launched step's tokens reach the host (waiting for the device): the scheduler's bookkeeping, then the
        streams, the step's feedback and the published stats."""
        sched, plan = self.scheduler, f.plan
        self._landed(f)
        sched.landed(plan)  # (its KV is in the cache: its full blocks may be shared)
        t0 = time.perf_counter()
        tokens = f.tokens.result() if f.tokens is not None else []
        logprobs = f.tokens.logprobs() if f.tokens is not None else {}
        if f.tokens is not None and f.tokens.prompt:  # before the tokens: a reply's first item carries them
            for req in plan.prefill:  # (not one that ended meanwhile: its id may be a new request's by now)
                if req.status is not Status.FINISHED and (got := f.tokens.prompt.get(req.request_id)) is not None:
                    self.outputs.add_prompt_logprobs(req, *got)
        t1 = time.perf_counter()
        self._phase["forward"] += t1 - t0  # waiting for the device
        where = {id(r): i for r, i in zip(f.reqs, f.index)}
        row = {id(r): k for k, r in enumerate(f.reqs)} if logprobs else {}
        for req, tok, reason in sched.resolved(f.reqs, f.index, tokens, time.monotonic()):
            if isinstance(tok, _Preempted):  # its placeholder goes: the token is drawn again when it runs again
                if req.status is not Status.RUNNING and where[id(req)] == len(req.token_ids) - 1:
                    req.token_ids.pop()
                    continue
                tok = _StepFailed(str(tok))  # (running again already, on its placeholder: it cannot go on)
            if isinstance(tok, Exception):
                what = "model step failed" if isinstance(tok, _StepFailed) else "sampling failed"
                self._finish(req, FinishReason.ERROR, error=f"{what}: {tok.__cause__ or tok!r}")
                continue
            lp = logprobs.get(row[id(req)]) if logprobs else None
            try:
                reason = self.outputs.on_token(req, tok, reason, where[id(req)] + 1 - req.num_prompt_tokens, lp)
            except Exception as e:  # noqa: BLE001 - its text's failure (detokenizing, a stop string) is its own
                log.exception("request %s: its output failed", req.request_id)
                self._finish(req, FinishReason.ERROR, error=f"output failed: {e!r}"[:500])
                continue
            if reason is not None:
                self._finish(req, reason, last_token=tok, last_logprobs=lp)
        self._steps += 1
        t2 = time.perf_counter()
        self._phase["postprocess"] += t2 - t1
        now = time.monotonic()
        # the step as its requests saw it: from its start, or from the step before's tokens where it overlapped that
        step_ms = (t2 - max(f.t0, self._last_resolved)) * 1000.0
        self._last_resolved = t2
        sched.on_step_done(plan, step_ms, now, f.reqs)
        if plan.decode:
            b = float(len(plan.decode))
            first = self._step_ms is None
            self._step_ms = step_ms if first else 0.9 * self._step_ms + 0.1 * step_ms
            self._step_batch = b if first else 0.9 * self._step_batch + 0.1 * b
        if self._observers:
            event = StepEvent(now, len(plan.prefill), plan.num_prefill_tokens, len(plan.decode),
                              plan.decode_mean_len, f.forward_ms, step_ms, plan.num_prefill_sq)
            for fn in self._observers:
                fn(event)
        self._publish_step(len(plan.prefill), len(plan.decode), now)

    def _isolate(self, plan, reqs: list[Request], err: Exception, launched: _InFlight | None = None,
                 draws: Draws | None = None) -> SampledTokens | None:
        """A step failed: run each of its requests alone so that one bad request fails alone, not its neighbours.
        Returns the tokens of `reqs` (a `_StepFailed` for those that fail again; chunks that fail are finished
        here) with their log-probabilities, or None when the whole step failed as it was (a step of one request, or
        an injected fault).
        `launched`: the step ran on the host stream and its requests have moved on since (a placeholder each, the
        next step planned): each is re-run as it was launched and draws with the numbers planned for it, as does each
        of a step whose `draws` were planned before it failed."""
        forward = plan.forward
        if len(forward) == 1 or isinstance(err, _InjectedFault):
            log.exception("model step failed; failing %d requests", len(forward), exc_info=err)
            for req in forward:
                self._finish(req, FinishReason.ERROR, error=f"model step failed: {err!r}")
            return None
        log.warning("model step of %d requests failed (%r): running them one by one", len(forward), err)
        sampled = {id(r): i for i, r in enumerate(reqs)}
        tokens: list[int | Exception] = [0] * len(reqs)
        logprobs: dict[int, RowLogprobs] = {}
        prompt: dict[str, tuple[int, list[RowLogprobs]]] = {}
        ends = dict(zip(map(id, plan.prefill), plan.prefill_ends))
        as_launched = launched.as_launched if launched is not None else None
        if launched is not None:
            draws = launched.draws
        for k, req in enumerate(forward):
            if req.status is Status.FINISHED:  # ended with the step before (overlap scheduling)
                continue
            try:
                alone = self._run_alone(req, ends.get(id(req)), sampled.get(id(req)),
                                        as_launched[k] if as_launched is not None else None, draws)
                tok = alone.result()[0] if alone is not None and id(req) in sampled else None
                if alone is not None and (lp := alone.logprobs().get(0)) is not None:
                    logprobs[sampled[id(req)]] = lp
                if alone is not None and alone.prompt:
                    prompt.update(alone.prompt)
            except _Preempted as e:  # not its failure: a chunk is run again, a token drawn again (`_resolve`)
                tok = e
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.warning("request %s failed its step: %r", req.request_id, e)
                fail = _StepFailed(str(e))
                fail.__cause__ = e
                tok = fail
                if id(req) not in sampled:  # a chunk: no token to carry the error
                    self._finish(req, FinishReason.ERROR, error=f"model step failed: {e!r}")
            if id(req) in sampled:
                tokens[sampled[id(req)]] = tok
        out = SampledTokens.of(tokens, logprobs)
        out.prompt = prompt or None
        return out

    def _run_alone(self, req: Request, end: int | None, row: int | None, as_launched: tuple[int, int] | None,
                   draws: Draws | None) -> SampledTokens | None:
        """One request's part of a failed step, alone: its prefill up to `end` or its decode, and its draw (its token,
        with its log-probabilities where it asks for them) if it samples (its `row` among the step's), with the
        numbers the step's `draws` planned for it where it planned them. `as_launched`: (num_computed_tokens,
        num_tokens) when the step was launched on the host stream; the request is run as it was then."""
        saved = (req.token_ids, req.num_computed_tokens)
        if as_launched is not None:
            computed, n = as_launched
            if req.num_computed_tokens < (end if end is not None else n):  # its blocks went since
                raise _Preempted("preempted while its step was in flight")
            req.token_ids, req.num_computed_tokens = req.token_ids[:n], computed
        try:
            logits = self.runner.execute([req], [], [end]) if end is not None else self.runner.execute([], [req])
            spans = _prompt_rows([req], [end]) if end is not None else []
            alone = None if row is None else draws.row(row) if draws is not None else \
                self.sampler.plan([req], logits.device)
            return _draw_step(self.sampler, logits, alone, spans)
        finally:
            req.token_ids, req.num_computed_tokens = saved

    def _reject(self, req: Request, reason: RejectReason) -> None:
        self._rejected[reason.value] = self._rejected.get(reason.value, 0) + 1
        self._finish(req, FinishReason.REJECTED, reject_reason=reason)

    def _finish(self, req: Request, reason: FinishReason, *, reject_reason: RejectReason | None = None,
                error: str | None = None, last_token: int | None = None,
                last_logprobs: RowLogprobs | None = None, error_kind: ErrorKind = ErrorKind.ENGINE) -> None:
        if not self.scheduler.finish(req, reason, time.monotonic()):
            return
        self._requests.pop(req.request_id, None)
        self._churn += 1
        if req.lora_id:
            self.loras.release(req.lora_id)
        self.sampler.release(req.request_id)
        self.outputs.finish(req, reject_reason=reject_reason, error=error, error_kind=error_kind,
                            last_token=last_token, last_logprobs=last_logprobs)

    def _publish_step(self, last_prefill: int, last_decode: int, now: float) -> None:
        """After a step: publish unless the last snapshot holds the same requests and is under PUBLISH_EVERY_S old
        (taking one costs as much as a few rows' output, every step)."""
        key = (self._churn, len(self.scheduler.running))  # an admission or a preemption moves the running count
        if key == self._published[0] and now - self._published[1] < PUBLISH_EVERY_S:
            return
        self._published = (key, now)
        self._publish(last_prefill, last_decode)

    def _publish(self, last_prefill: int, last_decode: int) -> None:
        snap = self._snapshot(last_prefill, last_decode)
        with self._stats_lock:
            self._stats = snap

    def _drain_after_stop(self) -> None:
        self._drain_inbox()
        for req in list(self._requests.values()):
            self._finish(req, FinishReason.ABORT, error="engine shut down")

    # ------------------------------------------------------------------ watchdog thread
    def _watch(self) -> None:
        """Declare the engine hung (`_hung`) once one turn of the worker has run past its allowance: a model step
        past `step_timeout_s` (a device call that never returns, a deadlock), an idle job past its caller's
        timeout as well. Nothing else would end its requests: the worker thread is alive, so the engine would
        look healthy while every stream waits forever."""
        period = min(1.0, self.step_timeout_s / 4)
        while not self._stop and self._dead is None and self._thread.is_alive():
            if self._stopped.wait(period):
                return
            started, allowed = self._turn
            stuck = time.monotonic() - started
            if stuck > allowed and not self._stop and self._dead is None:
                self._hung(stuck)
                return

    def _hung(self, stuck_s: float) -> None:
        frame = sys._current_frames().get(self._thread.ident or -1)
        where = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(unknown)"
        why = f"engine worker hung: one step has run {stuck_s:.0f} s, past step_timeout_s={self.step_timeout_s:g}"
        log.error("%s. Its requests fail as unavailable and the engine counts as dead (a Serve replica's health "
                  "check then fails, and Serve replaces it). The worker is at:\n%s", why, where)
        self._dead = EngineHungError(why)
        self._stop = True
        with self._stats_lock:
            self._stats = dataclasses.replace(self._stats, alive=False)
        if self._on_hung is not None:
            self._on_hung(why)
        else:
            self._fail_open(f"engine failure: {why}")

    def _fail_open(self, error: str) -> None:
        """End every request's stream as unavailable: those the worker admitted and those still in its inbox. On the
        watchdog thread, the worker stuck: the streams are the worker's, but stuck it puts nothing until it returns,
        then finds the engine stopped, and a stream that has ended drops what is put after."""
        for rid, stream in self.outputs.open_streams():
            _put_quietly(stream, RequestOutput.failed(rid, error, ErrorKind.UNAVAILABLE))
        self._fail_inbox(error)

    def _fail_inbox(self, error: str) -> None:
        for item in self._inbox_items():
            if isinstance(item, _IdleJob):
                item.error = EngineDeadError(error)
                item.done.set()
            elif isinstance(item, (tuple, list)):
                for req, stream in item if isinstance(item, list) else [item]:
                    _put_quietly(stream, RequestOutput.failed(req.request_id, error, ErrorKind.UNAVAILABLE))


def _prompt_rows(prefill: list[Request], ends: list[int]) -> list[PromptSpan]:
    """The step's prompt rows (`prompt_spans`) as the sampler takes them, read now (the step may draw later)."""
    return [(r.request_id, start, r.token_ids[start + 1:start + 1 + count], r.params.prompt_logprobs or 0)
            for i, start, count in prompt_spans(prefill, ends) for r in (prefill[i],)]


def _draw_step(sampler: Sampler, logits: torch.Tensor | PromptLogits, draws: Draws | None,
               spans: list[PromptSpan]) -> SampledTokens | None:
    """A step's draw from its output: its sampled rows' tokens, and where it has prompt rows (`PromptLogits`, of
    `spans`), their prompt logprobs with the tokens (`SampledTokens.prompt`). None where it has neither."""
    prompt = None
    if isinstance(logits, PromptLogits):
        prompt = sampler.prompt_logprobs(logits.rows, spans)
        logits = logits.sampled
    tokens = sampler.draw(logits, draws) if draws is not None else None
    if prompt:
        tokens = tokens if tokens is not None else SampledTokens.of([])
        tokens.prompt = prompt
    return tokens


class _Loader:
    """The thread LoRA adapters load on (`LoraRegistry`'s loader), started at the first load, one job at a time, at
    the lowest CPU priority (Linux: a thread's nice is its own, and the OpenMP threads it starts inherit it): a load's
    tensor work runs in what the worker's steps leave. A daemon, so that a load stuck on its files (a hung mount)
    holds up neither the engine's shutdown (`close` waits `timeout` at most) nor the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        if self._closed:  # (the engine stopped: its requests end with it)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), name="kairos-lora-load",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def restart(self) -> None:
        """The job running is stuck past its deadline (`LLMEngine._expire_lora_loads`): the jobs queued behind it,
        and later ones, run on a new thread; the stuck one ends after its job."""
        old, self._jobs, self._thread = self._jobs, queue.SimpleQueue(), None
        queued = []
        while True:
            try:
                job = old.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                queued.append(job)
        old.put(None)
        for job in queued:
            self.submit(job)

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # not Linux: the thread keeps the process's priority
            pass
        while (job := jobs.get()) is not None:
            job()

    def close(self, timeout: float) -> None:
        """No more jobs: the one running ends (within `timeout`), those queued are dropped (their requests end with
        the engine)."""
        self._closed = True
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)


def _put_quietly(stream: OutputSink, item: RequestOutput) -> None:
    """Put a request's last item from the watchdog: a reader gone (its loop closed) must not cost the others theirs."""
    try:
        stream.put(item)
    except Exception:  # noqa: BLE001
        log.debug("could not end the stream of %s", item.request_id, exc_info=True)


def step_timeout_s(config: EngineConfig, model: LatencyModel | None, max_model_len: int) -> float:
    """The watchdog's limit on one model step: `config.step_timeout_s` where set (0: none), else the larger of
    STEP_TIMEOUT_FLOOR_S and STEP_TIMEOUT_FACTOR times the latency model's largest step (a whole window's prompt
    in one prefill, beside a full decode batch at the window's context)."""
    if config.step_timeout_s is not None:
        return config.step_timeout_s
    if model is None:
        return STEP_TIMEOUT_FLOOR_S
    largest_ms = model.prefill_ms(max_model_len) + model.itl_ms(config.scheduler.max_num_seqs, max_model_len)
    return max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * largest_ms / 1000.0)


def _when_idle(fn: Callable[[LLMEngine], T]) -> Callable[[LLMEngine], T]:
    def guarded(e: LLMEngine) -> T:
        if e._requests:
            raise RuntimeError(f"{len(e._requests)} requests in flight")
        # a job on the idle engine may write any block (profile probes take them from the first): none stays cached
        e.scheduler.blocks.clear_cache()
        return fn(e)
    return guarded
