"""Kairos serving metrics via `ray.serve.metrics` (exported as `ray_kairos_*` by each node's metrics agent).

Serve adds the `deployment`, `replica` and `application` tags itself. Per-request series are tagged by SLO tier
(`core.request.SLO.tier`, e.g. `best_effort`, `ttft500_tpot50`): the first `MAX_TIER_LABELS` tiers a replica sees
keep their name, later ones are `other` (clients choose SLO values: the series they make must stay bounded). Engine
gauges are refreshed periodically from `LLMEngine.stats()` by the replica; generated tokens are counted as they are
streamed and handed to their counter when their request ends and on each refresh (a GPU replica streams tens of
thousands a second, and a counter call per chunk was a large part of its event loop's work per chunk), prompt tokens
with a request's first token, TTFT at the first token, the other histograms and counters when a request ends;
inter-token latencies are observed per token as they come, through `_TierRecorder`. TTFT and inter-token latencies
are timed as the engine gave the tokens (when they were put on the request's stream), not as the replica read them:
stream pacing reads a stream's tokens in chunks (`deployments/pacing.py`).

Beside them, the series Ray Serve LLM's vLLM engines export, under vLLM's names (`VllmSeries`: `vllm_*`, exported as
`ray_vllm_*` and tagged `model_name` and `engine`): Ray's own Serve LLM Grafana dashboard reads them, and the serving
port's `/metrics` gives them as vLLM's server names them (`vllm:*`, `VLLM_RENAME`).

Every request a replica's engine takes ends counted once: rejected (`requests_rejected`), abandoned while it
waited for its first token (`requests_abandoned`: its caller went away), or admitted (`requests_admitted`, with its
first token); every admitted request is finished (`requests_finished`, by reason, `abort` for a caller that went
away) or still running.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from core.messages import RequestOutput
from core.request import SLO

from ray.serve.metrics import Counter, Gauge, Histogram

log = logging.getLogger("ray.serve")

_LAT_S = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60, 180, 600]
_E2E_S = [0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600, 1200, 2400, 7680]
# vLLM's own buckets for its series (vllm/v1/metrics/loggers.py), so that dashboards and alerts made for vLLM read
# them alike: time to first token; time per output token and inter-token latency; a request's phases
VLLM_TTFT_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                  960.0, 1920.0, 7680.0]
_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
_LOOP_LAG_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
# a reply's tokens over the length predicted for it: powers of two either way of exact, finer near it
_LENGTH_RATIO = [0.0625, 0.125, 0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0, 8.0, 16.0]
_TOKENS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
MAX_TIER_LABELS = 16  # distinct `tier` label values per replica; the rest are "other"
OTHER_TIER = "other"


class _TierRecorder:
    """`metric`'s observations by `tier` label (`label`; None: a metric with no such tag, its own tags only), on its
    recording path with each tier's final tags built once. A
    Serve metric's own `observe` / `inc` merges and checks its tags and reads Serve's request context on every call,
    what a per-token series pays per token on the replica's event loop; the tags it would send are the same for every
    call of a tier (the metric's default tags, Serve's replica tags, the tier). Falls back to the public call where
    the metric has no such path (a metric Ray discards, another Ray)."""

    def __init__(self, metric: Any, label: str | None = "tier") -> None:
        self.metric, self.label = metric, label
        self._tags: dict[str, dict[str, str]] = {}
        self._record = None
        if not getattr(metric, "_discard_metric", True) and getattr(metric, "_metric", None) is not None \
                and hasattr(metric, "_get_final_tags"):
            self._record = metric._metric.record

    def record(self, value: float, tier: str, n: int = 1) -> None:
        """`n` observations of `value` (a histogram) for `tier`."""
        self.record_many(((value, n),), tier)

    def record_many(self, values: Any, tier: str) -> None:
        """For each (value, n) of `values`, `n` observations of `value` for `tier` (its tags built once)."""
        given = {self.label: tier} if self.label is not None else {}
        if self._record is None:
            for value, n in values:
                for _ in range(n):
                    self.metric.observe(value, tags=given)
            return
        try:
            tags = self._tags.get(tier)
            if tags is None:
                tags = self.metric._get_final_tags(given)
                self.metric._validate_tags(tags)
                tags = self._tags[tier] = dict(tags)
            record = self._record
            for value, n in values:
                for _ in range(n):
                    record(value, tags=tags)
        except (AttributeError, TypeError, ValueError) as e:  # a Ray whose path differs: its public call from now on
            log.warning("kairos metrics: %s's recording path failed (%r); using its observe()", self.metric, e)
            self._record = None
            self.record_many(values, tier)


def _one_two_five(top: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `top` (vLLM's buckets for token counts, up to its max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return out
            out.append(float(m * scale))
        scale *= 10


class _Summed:
    """A histogram and its observations' exact total, handed to a counter beside it (`flush`, with the engine's
    gauges): Ray's metrics agent exports a histogram's `_sum` rebuilt from its buckets (each observation as its
    bucket's midpoint), which the serving port's `/metrics` replaces with this total (`filter_exposition`), as
    vLLM's own server exports it."""

    def __init__(self, hist: Any, total: Any) -> None:
        self.hist, self.total, self.pending = hist, total, 0.0
        self.started = False  # whether the counter has its series (its first total goes with the histogram's)

    def observe(self, value: float) -> None:
        self.hist.observe(value)
        self.add(value)

    def add(self, value: float) -> None:
        self.pending += value
        if not self.started:  # at once: the agent gets the two series in one report (a _sum that fell back to
            self.flush()  # the agent's own for a report, then to this total, would read as a counter's reset)

    def flush(self) -> None:
        if self.pending > 0:  # (Counter.inc(0) raises)
            self.total.inc(self.pending)
            self.pending, self.started = 0.0, True


EXACT_SUM = "_exact_sum"  # a histogram's name and this: its counter of the observations' exact total (`_Summed`)
LENGTH_TOP = 10_000_000  # the token-count histograms' last finite bucket (a window of 10M tokens: Llama 4's)


class VllmSeries:
    """The series a vLLM engine exports under Ray Serve LLM (vLLM's metric names with `vllm_` for `vllm:`, as Ray
    takes them, and its `model_name` tag), for what they mean in this engine: Ray's Serve LLM Grafana dashboard
    (token throughput, TTFT, TPOT and end-to-end latency, the scheduler's state, KV cache and prefix cache use, the
    finish reasons, queue, prefill and decode times, prompt and reply lengths) works on a Kairos app as on Ray Serve
    LLM's. Per request, observed when it ends (`time_per_output_token` once per request, its mean: vLLM's
    request_time_per_output_token), but for `time_to_first_token`, observed at the first token, and
    `inter_token_latency`, observed per token as they come (`itl`; an item of n tokens: n gaps of its time over n),
    as vLLM observes them. Latency buckets are vLLM's (`VLLM_TTFT_S`, `VLLM_ITL_S`, `VLLM_REQUEST_S`); token counts'
    are its 1-2-5 steps up to `LENGTH_TOP` whatever the model's window (vLLM's end at it: Ray's metrics agent keeps
    the first buckets a name is reported with on a node, and dropped the counts of every other model's replicas
    there). Each series has vLLM's `engine` tag ("0": one engine a replica)."""

    def __init__(self, model: str) -> None:
        tags = {"model_name": model, "engine": "0"}

        def made(kind: type, name: str, desc: str, keys: tuple[str, ...] = (), **kw: Any) -> Any:
            m = kind(f"vllm_{name}", description=desc, tag_keys=keys + ("model_name", "engine"), **kw)
            m.set_default_tags(dict(tags))  # Serve mutates the dict
            return m

        self.summed: list[_Summed] = []

        def hist(name: str, desc: str, bounds: list[float]) -> Any:
            h = _Summed(made(Histogram, name, desc, boundaries=bounds),
                        made(Counter, name + EXACT_SUM, f"the exact total of {name}'s observations"))
            self.summed.append(h)
            return h

        lengths = _one_two_five(LENGTH_TOP)
        self.running = made(Gauge, "num_requests_running", "requests running (admitted, unfinished)")
        self.waiting = made(Gauge, "num_requests_waiting", "requests waiting to be admitted")
        self.kv_usage = made(Gauge, "kv_cache_usage_perc", "KV cache blocks in use, a fraction of all (0 to 1)")
        self.prompt_tokens = made(Counter, "prompt_tokens", "prompt tokens of admitted requests")
        self.generation_tokens = made(Counter, "generation_tokens", "generated tokens")
        self.preemptions = made(Counter, "num_preemptions", "requests preempted (KV freed, prefilled again later)")
        self.prefix_queries = made(Counter, "prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = made(Counter, "prefix_cache_hits", "of those, the tokens found cached")
        self.success = made(Counter, "request_success", "finished requests, by finish reason", ("finished_reason",))
        self.ttft = hist("time_to_first_token_seconds", "time to first token, seconds", VLLM_TTFT_S)
        self.tpot = hist("request_time_per_output_token_seconds", "a request's mean time per output token after "
                         "the first, seconds", VLLM_ITL_S)
        self.itl_sum = hist("inter_token_latency_seconds", "time between a request's output tokens, seconds",
                            VLLM_ITL_S)
        self.itl = _TierRecorder(self.itl_sum.hist, None)  # (per token: its recording path; the total by hand)
        self.e2e = hist("e2e_request_latency_seconds", "request latency, arrival to last token, seconds",
                        VLLM_REQUEST_S)
        self.queue = hist("request_queue_time_seconds", "time waiting, arrival to admission, seconds", VLLM_REQUEST_S)
        self.prefill = hist("request_prefill_time_seconds", "admission to first token, seconds", VLLM_REQUEST_S)
        self.decode = hist("request_decode_time_seconds", "first token to last, seconds", VLLM_REQUEST_S)
        self.inference = hist("request_inference_time_seconds", "admission to last token, seconds", VLLM_REQUEST_S)
        self.prompt_len = hist("request_prompt_tokens", "prompt tokens per finished request", lengths)
        self.output_len = hist("request_generation_tokens", "generated tokens per finished request", lengths)
        self.max_output_len = hist("request_max_num_generation_tokens", "the most generated tokens of a finished "
                                   "request's choices (one choice each here: its own)", lengths)

    def engine(self, st: Any, kv_usage: float, advance: Any) -> None:
        """The gauges from an `EngineStats` (and its KV usage, a fraction); `advance(name, counter, count)` hands
        the engine's counts on."""
        g = lambda name, default=0: getattr(st, name, default)  # noqa: E731
        self.running.set(g("num_running"))
        self.waiting.set(g("num_waiting"))
        self.kv_usage.set(kv_usage)
        for name, counter in (("preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                              ("prefix_cache_hits", self.prefix_hits)):
            advance("vllm_" + name, counter, g(name))

    def itls(self, gaps: Any) -> None:
        """For each (seconds, n) of `gaps`, n inter-token latencies of `seconds`."""
        self.itl.record_many(gaps, "")
        self.itl_sum.add(sum(s * n for s, n in gaps))

    def flush_sums(self) -> None:
        for h in self.summed:
            h.flush()

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt > 0:  # Counter.inc(0) raises ValueError
            self.prompt_tokens.inc(prompt)
        if generated > 0:
            self.generation_tokens.inc(generated)

    def finished(self, reason: str, final: RequestOutput | None) -> None:
        """A request that ended with `reason` (an admitted one's: stop, length, abort, error); `final` its last
        stream item (None for one whose caller went away)."""
        self.success.inc(tags={"finished_reason": reason})
        m = final.metrics if final is not None else None
        if m is None:
            return
        self.prompt_len.observe(final.num_prompt_tokens)
        self.output_len.observe(final.num_output_tokens)
        self.max_output_len.observe(final.num_output_tokens)
        spans = ((self.e2e, m.arrival_s, m.finished_s),
                 (self.queue, m.arrival_s, m.admitted_s), (self.prefill, m.admitted_s, m.first_token_s),
                 (self.decode, m.first_token_s, m.finished_s), (self.inference, m.admitted_s, m.finished_s))
        for hist, start, end in spans:
            if start is not None and end is not None:
                hist.observe(max(end - start, 0.0))
        if m.tpot_s is not None:
            self.tpot.observe(m.tpot_s)


_WAIT_S = [0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600]


def replica_wait_histogram(model: str) -> Histogram:
    """The Ingress's series of the requests that waited for an LLM replica able to serve, and how long (their 503s
    too): `reason` scaled_to_zero (none ran, and the request asked Serve for one: a cold start) or not_ready (none had
    answered yet, or Serve was replacing them)."""
    h = Histogram("kairos_ingress_replica_wait_s", description="time a request waited at the Ingress for an LLM "
                  "replica able to serve (a cold start where the app scaled to zero), seconds", boundaries=_WAIT_S,
                  tag_keys=("reason", "model"))
    h.set_default_tags({"model": model})
    return h


class ReplicaMetrics:
    """All series one LLM replica exports. Cheap to call from the request path (no I/O)."""

    def __init__(self, model: str, served_name: str | None = None) -> None:
        """`model`: the model argument (the `model` tag); `served_name`: its name to clients, the vLLM series'
        `model_name` (None: `model`)."""
        tier, model_tags = ("tier", "model"), {"model": model}
        self.vllm = VllmSeries(served_name or model)

        def hist(name: str, desc: str, bounds: list[float]) -> Histogram:
            h = Histogram(f"kairos_{name}", description=desc, boundaries=bounds, tag_keys=tier + ("model",))
            h.set_default_tags(dict(model_tags))  # Serve mutates the dict
            return h

        def ctr(name: str, desc: str, keys: tuple[str, ...] = ()) -> Counter:
            c = Counter(f"kairos_{name}", description=desc, tag_keys=keys + ("model",))
            c.set_default_tags(dict(model_tags))  # Serve mutates the dict
            return c

        def gauge(name: str, desc: str) -> Gauge:
            g = Gauge(f"kairos_{name}", description=desc, tag_keys=("model",))
            g.set_default_tags(dict(model_tags))  # Serve mutates the dict
            return g

        self.ttft = hist("ttft_s", "time to first token (arrival to first token), seconds", _LAT_S)
        self.tpot = hist("tpot_s", "time per output token after the first, per request, seconds", _LAT_S)
        self.itl = hist("itl_s", "inter-token latency as observed by the replica, seconds", _LAT_S)
        self.e2e = hist("e2e_s", "request latency, arrival to last token, seconds", _E2E_S)
        self.queue_time = hist("queue_time_s", "time in the queue, arrival to admission (its first prefill), seconds",
                               _LAT_S)
        self.prompt_len = hist("request_prompt_tokens", "prompt tokens per finished request", _TOKENS)
        self.output_len = hist("request_generation_tokens", "generated tokens per finished request", _TOKENS)
        self.length_ratio = hist("length_prediction_ratio", "kairos: a reply that ended on its own (EOS or a stop), "
                                 "its generated tokens over the length the length predictor expected at its arrival "
                                 "(1: exact; the spread is the predictor's error on this traffic)", _LENGTH_RATIO)
        self.tokens_in = ctr("prompt_tokens", "prompt tokens of admitted requests (counted at the first token, "
                             "added at its request's end and each metrics refresh)", ("tier",))
        self.tokens_out = ctr("generation_tokens", "generated tokens (counted as they stream, added at each "
                             "request's end and each metrics refresh)", ("tier",))
        self.admitted = ctr("requests_admitted", "requests admitted by the engine (counted at the first token, "
                            "added at its request's end and each metrics refresh)", ("tier",))
        self.finished = ctr("requests_finished", "admitted requests that ended, by finish reason",
                            ("tier", "reason"))
        self.rejected = ctr("requests_rejected", "requests rejected at admission (429, and 400 slo_unattainable), by "
                            "reason", ("tier", "reason"))
        self.abandoned = ctr("requests_abandoned", "requests whose caller went away before their first token",
                             ("tier",))
        self.slo_met = ctr("slo_met", "finished requests that met all their SLOs", ("tier",))
        self.slo_missed = ctr("slo_missed", "finished requests that missed an SLO, by which", ("tier", "slo"))
        self.engine_alive = gauge("engine_alive", "1 while the replica's engine serves, 0 once it died (its "
                                  "requests failed; the replica fails its health checks until Serve replaces it)")
        self.queue_len = gauge("queue_len", "requests waiting in the engine")
        self.running = gauge("num_running", "requests running in the engine")
        self.decode_batch = gauge("decode_batch_size", "last decode batch size")
        self.prefill_batch = gauge("prefill_batch_size", "last prefill batch size")
        self.vbs = gauge("vbs", "virtual batch size (SCORPIO)")
        self.kv_used = gauge("kv_blocks_used", "paged-KV blocks in use")
        self.kv_free = gauge("kv_blocks_free", "paged-KV blocks free")
        self.kv_usage = gauge("kv_cache_usage", "paged-KV blocks in use, a fraction of all (0 to 1)")
        self.preemptions = ctr("preemptions", "requests preempted (KV freed, prefilled again later)")
        self.lora_adapters = gauge("lora_adapters", "LoRA adapters loaded (lora_modules, and those of "
                                   "dynamic_lora_loading_path loaded on demand)")
        self.prefix_queries = ctr("prefix_cache_queries", "prompt tokens admissions looked up in the prefix cache "
                                  "(vLLM's prefix_cache_queries)")
        self.prefix_hits = ctr("prefix_cache_hits", "of those, the tokens found cached, not computed again (vLLM's "
                               "prefix_cache_hits)")
        self.rejected_seats_full = ctr("requests_rejected_seats_full", "of the requests rejected, those turned away "
                                       "while every seat (max_num_seqs) was taken: many say the seats, not the "
                                       "policy, bound the batch")
        self.itl_correction = gauge("itl_correction", "kairos: measured / predicted step time (1 = the profile holds)")
        self.length_scale = gauge("length_scale", "kairos: the served replies' lengths over what the length "
                                  "predictor expected of them, by which its predictions are scaled (1: as trained)")
        self.shed_threshold = gauge("shed_threshold", "kairos work shedding: fresh requests of more work "
                                    "(output tokens / TPOT SLO ms) than this are shed under overload (0: none)")
        self.predictor_mape = gauge("predictor_mape", "TTFT/ITL predictor mean absolute percentage error")
        self.inflight = gauge("replica_inflight", "requests inside this replica's generate()")
        self.policy = Gauge("kairos_scheduler_policy", description="1 for the scheduling policy the engine runs, 0 for "
                            "one it ran before (user_config changes it in place)", tag_keys=("model", "policy"))
        self.policy.set_default_tags(dict(model_tags))  # Serve mutates the dict
        self._policies: set[str] = set()  # the policies it ran (a handful at most)
        self.decode_hist = Histogram("kairos_decode_batch", description="sampled decode batch sizes",
                                     boundaries=_BATCH, tag_keys=("model",))
        self.decode_hist.set_default_tags(dict(model_tags))  # Serve mutates the dict
        # the step-time model against served decode-only steps, by decode-rows bucket (a power of two): their
        # mean wall / model is rate(..._sum) / rate(decode_steps) of one `rows`
        self.decode_steps = ctr("decode_steps", "decode-only model steps, by decode rows (rows in (k/2, k])", ("rows",))
        self.decode_over_model = ctr("decode_step_over_model_sum", "sum over decode-only steps of wall time / the "
                                     "latency model's ITL, by decode rows (a mean of 1: the model holds)", ("rows",))
        self._decode_seen: dict[int, tuple[int, float]] = {}
        self.loop_lag = Histogram("kairos_event_loop_lag_s", description="how late the replica's periodic metrics "
                                  "task woke on the event loop that streams its chunks and takes its requests, "
                                  "seconds (a loop falling behind its streams: deployments/pacing.py)",
                                  boundaries=_LOOP_LAG_S, tag_keys=("model",))
        self.loop_lag.set_default_tags(dict(model_tags))  # Serve mutates the dict
        self._seen: dict[str, int] = {}  # each engine count since start, as last handed to its counter (`_advance`)
        self._tiers: set[str] = set()
        self._itl = _TierRecorder(self.itl)
        # counts not yet on their counters, by tier, flushed at each metrics refresh and at a request's end
        # (`flush_counts`): generated tokens streamed (`tokens_out`), and requests admitted with their prompt tokens
        # (`admitted`, `tokens_in`): a counter's inc goes through Ray's tag checks, off the way of every chunk and of
        # every first token
        self._tokens_pending: dict[str, int] = {}
        self._admitted_pending: dict[str, list[int]] = {}  # tier -> [requests, prompt tokens]
        self._tokens_counted = [0, 0]  # prompt and generated tokens flushed onto their counters since start

    @property
    def tokens_counted(self) -> tuple[int, int]:
        """The prompt and generated tokens counted on this replica's series since its start."""
        return self._tokens_counted[0], self._tokens_counted[1]

    def tier_label(self, slo: SLO) -> str:
        """The `tier` label of a request with `slo`: its tier while this replica has seen fewer than
        `MAX_TIER_LABELS`, else `other`."""
        tier = slo.tier
        if tier in self._tiers:
            return tier
        if len(self._tiers) < MAX_TIER_LABELS:
            self._tiers.add(tier)
            return tier
        return OTHER_TIER

    def _advance(self, name: str, counter: Any, now: int) -> None:
        """Hand an engine's count since its start (`name`, now `now`) to its counter: what it grew since last read."""
        seen = self._seen.get(name, 0)
        if now < seen:  # a new engine (counting from 0 again)
            seen = 0
        if now > seen:
            counter.inc(now - seen)
        self._seen[name] = now

    def update_engine(self, st: Any, inflight: int) -> None:
        """Refresh gauges from an `EngineStats` (duck-typed so a partial stats object still works), and hand the
        counts since the last refresh to their counters."""
        self.flush_counts()
        alive = bool(getattr(st, "alive", True))
        self.engine_alive.set(1.0 if alive else 0.0)
        if not alive and dataclasses.is_dataclass(st):  # what a dead engine holds is nothing (its last figures were
            # republished, a busy replica on the dashboards, until Serve replaced it)
            st = dataclasses.replace(st, num_running=0, num_waiting=0, last_decode_batch=0, last_prefill_batch=0,
                                     kv_blocks_used=0, kv_blocks_free=st.kv_blocks_total, vbs=0.0)
        g = lambda name, default=0: getattr(st, name, default)  # noqa: E731
        self.queue_len.set(g("num_waiting"))
        self.running.set(g("num_running"))
        self.decode_batch.set(g("last_decode_batch"))
        self.prefill_batch.set(g("last_prefill_batch"))
        self.vbs.set(float(g("vbs", 0.0) or 0.0))
        self.itl_correction.set(float(g("itl_correction", 1.0)))
        self.length_scale.set(float(g("length_scale", 1.0)))
        self.kv_used.set(g("kv_blocks_used"))
        self.kv_free.set(g("kv_blocks_free"))
        used, total = g("kv_blocks_used"), g("kv_blocks_total")
        usage = used / total if total else 0.0
        self.kv_usage.set(usage)
        self.lora_adapters.set(g("lora_adapters"))
        for name, counter in (("preemptions", self.preemptions), ("rejected_seats_full", self.rejected_seats_full),
                              ("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits)):
            self._advance(name, counter, g(name))
        self.vllm.engine(st, usage, self._advance)
        self.vllm.flush_sums()
        self.shed_threshold.set(float(g("shed_threshold", None) or 0.0))
        if g("predictor_mape", None) is not None:
            self.predictor_mape.set(float(st.predictor_mape))
        if g("last_decode_batch"):
            self.decode_hist.observe(st.last_decode_batch)
        for rows, (n, total) in (g("decode_over_model", None) or {}).items():
            n0, t0 = self._decode_seen.get(rows, (0, 0.0))
            if n < n0:  # a new engine (its sums start again)
                n0, t0 = 0, 0.0
            if n > n0:
                tags = {"rows": str(rows)}
                self.decode_steps.inc(n - n0, tags=tags)
                self.decode_over_model.inc(max(total - t0, 0.0), tags=tags)
            self._decode_seen[rows] = (n, total)
        self.inflight.set(inflight)
        if policy := g("policy", ""):  # every time, as the other gauges (a value set before the exporter is up is lost)
            self._policies.add(policy)
            for p in self._policies:
                self.policy.set(1.0 if p == policy else 0.0, tags={"policy": p})

    def on_loop_lag(self, seconds: float) -> None:
        """A periodic task on the replica's event loop woke `seconds` after it was due."""
        self.loop_lag.observe(seconds)

    def on_admitted(self, tier: str, prompt_tokens: int) -> None:
        """A request's first token: it is admitted, and its prompt is in (counted at the next `flush_counts`)."""
        got = self._admitted_pending.get(tier)
        if got is None:
            self._admitted_pending[tier] = [1, max(prompt_tokens, 0)]
        else:
            got[0] += 1
            got[1] += max(prompt_tokens, 0)

    def on_tokens(self, tier: str, n: int) -> None:
        """`n` tokens streamed: counted on `tokens_out` at the next `flush_counts`."""
        if n > 0:
            self._tokens_pending[tier] = self._tokens_pending.get(tier, 0) + n

    def flush_counts(self, tier: str | None = None) -> None:
        """The admissions and tokens not yet counted (of `tier`; None: every tier's) onto their counters."""
        for t in (self._admitted_pending.copy() if tier is None else (tier,)):
            got = self._admitted_pending.pop(t, None)
            if got is not None:
                tags = {"tier": t}
                self.admitted.inc(got[0], tags=tags)
                if got[1] > 0:  # Counter.inc(0) raises ValueError
                    self.tokens_in.inc(got[1], tags=tags)
                    self.vllm.tokens(got[1], 0)
                    self._tokens_counted[0] += got[1]
        for t in (self._tokens_pending.copy() if tier is None else (tier,)):
            n = self._tokens_pending.pop(t, 0)
            if n > 0:
                self.tokens_out.inc(n, tags={"tier": t})
                self.vllm.tokens(0, n)
                self._tokens_counted[1] += n

    def on_abandoned(self, tier: str) -> None:
        """A request whose caller went away before its first token (it waited in the queue, or for its prefill)."""
        self.abandoned.inc(tags={"tier": tier})

    def on_rejected(self, tier: str, reason: str) -> None:
        self.rejected.inc(tags={"tier": tier, "reason": reason or "unknown"})

    def on_aborted(self, tier: str) -> None:
        """An admitted request whose caller went away before it finished (reason `abort`, as vLLM counts it)."""
        self.finished.inc(tags={"tier": tier, "reason": "abort"})
        self.vllm.finished("abort", None)
        self.flush_counts(tier)

    def on_first_token(self, tier: str, seconds: float) -> None:
        """An admitted request's first token, `seconds` after its arrival (TTFT, observed as it comes, as vLLM
        observes it: a request aborted later counts too, and the series does not wait for the reply's end)."""
        self.ttft.observe(seconds, tags={"tier": tier})
        self.vllm.ttft.observe(seconds)

    def on_itls(self, tier: str, gaps: Any) -> None:
        """For each (seconds, n) of `gaps`, `n` tokens that came `seconds` apart each (an item of n tokens, n x
        seconds after the one before): a read's tokens, the tags built once for all."""
        self._itl.record_many(gaps, tier)
        self.vllm.itls(gaps)

    def on_finished(self, tier: str, slo: SLO, final: RequestOutput, streamed: int) -> None:
        """An admitted request's end: per-request histograms from its final stream item; `streamed`: its tokens
        counted already (`on_tokens`)."""
        t = {"tier": tier}
        reason = final.finish_reason or "unknown"
        self.finished.inc(tags={"tier": tier, "reason": reason})
        self.vllm.finished(reason, final)
        self.on_tokens(tier, final.num_output_tokens - streamed)  # tokens the stream never carried (none, or a stop)
        self.flush_counts(tier)
        m = final.metrics
        ttft, tpot, e2e = (m.ttft_s, m.tpot_s, m.e2e_s) if m is not None else (None, None, None)
        queued = None if m is None or m.admitted_s is None else max(m.admitted_s - m.arrival_s, 0.0)
        for hist, v in ((self.tpot, tpot), (self.e2e, e2e), (self.queue_time, queued)):
            if v is not None:
                hist.observe(v, tags=t)
        if reason in ("stop", "length"):
            self.prompt_len.observe(final.num_prompt_tokens, tags=t)
            self.output_len.observe(final.num_output_tokens, tags=t)
        predicted = m.predicted_output_len if m is not None else None
        if reason == "stop" and predicted:  # (a reply its cap ended says only that it would have run longer)
            self.length_ratio.observe(final.num_output_tokens / predicted, tags=t)
        if reason not in ("stop", "length") or (slo.ttft_ms is None and slo.tpot_ms is None):
            return
        missed = []
        if slo.ttft_ms is not None and (ttft is None or ttft * 1000 > slo.ttft_ms):
            missed.append("ttft")
        if slo.tpot_ms is not None and tpot is not None and tpot * 1000 > slo.tpot_ms:
            missed.append("tpot")
        for which in missed:
            self.slo_missed.inc(tags={"tier": tier, "slo": which})
        if not missed:
            self.slo_met.inc(tags=t)


LOG_STATS_S = 10.0  # the period of an LLM replica's stats line (vLLM's engine logs its own as often)


class StatsLog:
    """An LLM replica's stats line, as vLLM's engine logs one (its LoggingStatLogger): every `period_s` while it
    serves, its prompt and generation throughput over the period, its running and waiting requests, KV cache usage
    and the period's prefix cache hit rate; once when it falls idle, then nothing until it serves again."""

    def __init__(self, period_s: float = LOG_STATS_S) -> None:
        self.period_s = period_s
        self._last: tuple[float, int, int, int, int] | None = None  # (time, prompt, generated, queries, hits)
        self._idle_told = False

    def line(self, now: float, metrics: ReplicaMetrics, st: Any) -> str | None:
        """The line to log at `now` (time.monotonic()) from the replica's `metrics` and its engine's stats `st`; None
        before a period has passed, and while idle once said."""
        prompt, generated = metrics.tokens_counted
        queries, hits = getattr(st, "prefix_cache_queries", 0), getattr(st, "prefix_cache_hits", 0)
        last = self._last
        if last is not None and now - last[0] < self.period_s:
            return None
        self._last = (now, prompt, generated, queries, hits)
        if last is None:
            return None
        t0, p0, g0, q0, h0 = last
        if queries < q0 or hits < h0:  # a new engine (its counts from 0 again)
            q0 = h0 = 0
        running, waiting = getattr(st, "num_running", 0), getattr(st, "num_waiting", 0)
        idle = prompt == p0 and generated == g0 and not running and not waiting
        if idle and self._idle_told:
            return None
        self._idle_told = idle
        dt = max(now - t0, 1e-9)
        total, used = getattr(st, "kv_blocks_total", 0), getattr(st, "kv_blocks_used", 0)
        hit_rate = (hits - h0) / (queries - q0) if queries > q0 else 0.0
        return (f"Avg prompt throughput: {(prompt - p0) / dt:.1f} tokens/s, Avg generation throughput: "
                f"{(generated - g0) / dt:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100.0 * used / total if total else 0.0:.1f}%, Prefix cache hit rate: "
                f"{100.0 * hit_rate:.1f}%")


SCRAPE_PREFIXES = ("ray_kairos_", "ray_serve_", "ray_vllm_")  # what `/metrics` on the serving port passes on
VLLM_RENAME = ("ray_vllm_", "vllm:")  # ...the vLLM series as vLLM's own server names them
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(.*)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _sample(line: str) -> tuple[str, frozenset, str, str] | None:
    """A sample line's name, labels (as a set of pairs), value and what follows it (a timestamp); None for another."""
    m = _SAMPLE.match(line)
    if m is None:
        return None
    return m.group(1), frozenset(_LABEL.findall(m.group(2) or "")), m.group(3), m.group(4)


def filter_exposition(text: str, prefixes: tuple[str, ...] = SCRAPE_PREFIXES,
                      rename: tuple[str, str] | None = VLLM_RENAME) -> str:
    """The lines of a Prometheus text exposition that belong to metrics named with one of `prefixes` (samples and
    their `# HELP` / `# TYPE` lines), in order; `rename` (old prefix, new prefix): the names of those metrics
    that begin with the old one begin with the new one instead. A histogram whose exact total a counter beside it
    keeps (`_Summed`: `<name>_exact_sum`, as Ray exports it `<name>_exact_sum_total`) has that total for its
    `_sum` (Ray's agent rebuilds it from the buckets), and the counter is left out."""
    lines = text.splitlines()
    exact: dict[tuple[str, frozenset], str] = {}
    for line in lines:
        if EXACT_SUM in line and not line.startswith("#") and (got := _sample(line)) is not None:
            name, labels, value, _ = got
            base = name.removesuffix("_total").removesuffix(EXACT_SUM)
            if base != name.removesuffix("_total"):
                exact[(base, labels)] = value
    out = []
    for line in lines:
        if line.startswith("#"):
            parts = line.split(None, 3)
            keep = len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2].startswith(prefixes) \
                and EXACT_SUM not in parts[2]
            if keep and rename is not None and parts[2].startswith(rename[0]):
                parts[2] = rename[1] + parts[2][len(rename[0]):]
                line = " ".join(parts)
        else:
            keep = line.startswith(prefixes)
            if keep and exact and "_sum" in line and (got := _sample(line)) is not None:
                name, labels, value, rest = got
                if EXACT_SUM in name:
                    keep = False
                elif name.endswith("_sum") and (total := exact.get((name[:-4], labels))) is not None:
                    line = line[:len(line) - len(value) - len(rest)] + total + rest
            if keep and rename is not None and line.startswith(rename[0]):
                line = rename[1] + line[len(rename[0]):]
        if keep:
            out.append(line)
    return "\n".join(out) + ("\n" if out else "")


class AgentScraper:
    """`/metrics` on the serving port: the series this node's Ray metrics agent exports (Serve's `ray_serve_*`,
    Kairos's `ray_kairos_*` and the vLLM series as vLLM names them, `vllm:*`, from every replica on the node), read
    from the agent's Prometheus endpoint on each
    scrape. The agent's address is looked up once (`ray.nodes()`: this node's `MetricsExportPort`). On a
    multi-node cluster each node's agent holds its own replicas' series: scrape every node's agent (Ray's
    service discovery file, /tmp/ray/prom_metrics_service_discovery.json) for the whole picture."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._url: str | None = None

    @staticmethod
    def agent_url() -> str:
        import ray  # noqa: PLC0415

        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
                return f"http://{node['NodeManagerAddress']}:{int(node['MetricsExportPort'])}/metrics"
        raise RuntimeError("this node's Ray metrics agent has no export port")

    def _fetch(self) -> str:
        import urllib.request  # noqa: PLC0415

        if self._url is None:
            self._url = self.agent_url()
        with urllib.request.urlopen(self._url, timeout=self.timeout_s) as r:  # noqa: S310 - the node's own agent
            return r.read().decode("utf-8", "replace")

    async def scrape(self) -> str:
        """The filtered exposition (the blocking read runs on a worker thread); raises where the agent is out of
        reach."""
        import asyncio  # noqa: PLC0415

        try:
            text = await asyncio.to_thread(self._fetch)
        except Exception:
            self._url = None  # look the agent up again next time (restarted on another port)
            raise
        return filter_exposition(text)
