"""`LLMServer`: one `LLMEngine` per Ray Serve replica, streamed to the ingress as plain dicts.

Protocol with the ingress (`generate(request: dict)`, called via `handle.options(stream=True)`):
  request: {request_id, kind: "completion"|"chat", prompt | messages, params: SamplingParams kwargs
            (no max_tokens: fill the context window), slo: {ttft_ms, tpot_ms, output_len_hint}, prompt_len_hint}
  items:   {"error", "status"} once for bad input / dead engine; else `_item(RequestOutput)` dicts, the first
           carrying "replica", "replica_ms" (call received -> first output: tokenize, queue, prefill) and
           "retry_after_s" when rejected; the last finished=True with latency fields.
The engine is imported lazily so that the ingress process never loads torch.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import statistics
import time
from collections import deque
from typing import Any, AsyncIterator

from ray import serve

from engine.config import EngineConfig
from engine.request import SLO
from engine.sampling import SamplingParams

from deployments.metrics import ReplicaMetrics

log = logging.getLogger("ray.serve")

PLAIN_CHAT_NOTE = "Models without a chat template get 'Role: content' lines and a final 'Assistant:' line."


def render_plain_chat(messages: list[dict[str, str]]) -> str:
    """The fallback chat format: one `Role: content` line per message, then `Assistant:`."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def _rss_bytes() -> int:
    """Resident set size of this process (0 where it cannot be read)."""
    try:
        import psutil  # noqa: PLC0415

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001
        return 0


def _item(out: Any) -> dict[str, Any]:
    """A `RequestOutput` as a small picklable dict."""
    d: dict[str, Any] = {"text": out.text, "n": len(out.token_ids), "finished": out.finished,
                         "finish_reason": out.finish_reason, "num_prompt_tokens": out.num_prompt_tokens,
                         "num_output_tokens": out.num_output_tokens}
    if out.finished:
        d["reject_reason"], d["error"] = out.reject_reason, out.error
        m = out.metrics
        if m is not None:
            d["ttft_s"], d["tpot_s"] = m.ttft_s, m.tpot_s
            d["e2e_s"] = None if m.finished_s is None or m.first_token_s is None else m.finished_s - m.arrival_s
    return d


@serve.deployment(name="LLMServer", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                  health_check_period_s=5.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=20.0)
class LLMServer:
    async def __init__(self, engine_config: dict[str, Any], metrics_interval_s: float = 0.5,
                       log_prompts: bool = False, share_cores_with: int | None = None,
                       stream_interval_ms: float = 50.0) -> None:
        from engine.engine import LLMEngine  # noqa: PLC0415 - heavy (torch); only LLM replicas load it

        cfg = EngineConfig.model_validate(engine_config)
        if cfg.num_threads is None and share_cores_with:
            # num_cpus=0 replicas get OMP_NUM_THREADS=1 from Ray; share the node's cores among the replicas instead
            cfg = cfg.model_copy(update={"num_threads": max(1, (os.cpu_count() or 1) // share_cores_with)})
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (unit use)
            self.replica_id = "local"
        self.engine = await asyncio.to_thread(LLMEngine, cfg)
        self.model_name = self.engine.model_name
        self.log_prompts = log_prompts
        self.stream_interval_s = max(0.0, stream_interval_ms) / 1000.0
        self.metrics = ReplicaMetrics(str(cfg.model))
        self.inflight = 0
        self.aborted = 0  # requests the caller abandoned (client disconnects), aborted in the engine
        self.itl_ms: float | None = None  # EWMA of observed inter-token gaps
        self._prompt_lens: deque[int] = deque([64], maxlen=256)
        self._closed = False
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop(metrics_interval_s))
        log.info("LLMServer %s ready: model=%s max_model_len=%d threads=%s", self.replica_id, self.model_name,
                 self.engine.max_model_len, cfg.num_threads)

    # ------------------------------------------------------------------ request path
    def _prompt(self, req: dict[str, Any]) -> str | list[int]:
        if req.get("kind") != "chat":
            return req["prompt"]
        tok = self.engine.tokenizer
        msgs = [{"role": m["role"], "content": m["content"]} for m in req["messages"]]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = render_plain_chat(msgs)
        return tok.encode(text, add_special_tokens=False)  # as the engine tokenizes strings

    def _prepare(self, req: dict[str, Any]) -> tuple[str | list[int], SamplingParams, SLO]:
        prompt = self._prompt(req)
        kw = dict(req["params"])
        if kw.get("max_tokens") is None:  # OpenAI chat default: the rest of the context window
            n = len(prompt) if isinstance(prompt, list) else len(self.engine.tokenizer.encode(prompt))
            kw["max_tokens"] = max(1, self.engine.max_model_len - n)
            kw["min_tokens"] = min(kw.get("min_tokens", 0), kw["max_tokens"])
        return prompt, SamplingParams(**kw).validate(), SLO(**(req.get("slo") or {})).validate()

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from engine.engine import EngineDeadError  # noqa: PLC0415

        rid = req["request_id"]
        t_in = time.monotonic()
        try:
            prompt, params, slo = self._prepare(req)
            stream = self.engine.add_request(prompt, params, slo, request_id=rid)
        except (ValueError, TypeError, UnicodeError) as e:  # TypeError: the tokenizer refusing odd text
            yield {"error": str(e)[:500], "status": 400, "replica": self.replica_id}
            return
        except EngineDeadError as e:
            yield {"error": f"engine unavailable: {e}", "status": 503, "replica": self.replica_id}
            return
        tier = slo.tier
        n_prompt = len(prompt) if isinstance(prompt, list) else -1
        if self.log_prompts:
            log.info("request %s prompt=%r", rid, prompt)
        else:
            log.debug("request %s: %s prompt tokens, slo=%s", rid, n_prompt, req.get("slo"))
        self.inflight += 1
        finished, first, last_t = False, True, time.monotonic()
        try:
            while True:
                if not first and self.stream_interval_s:
                    # stream batching: after the first token, at most one message per interval; aget() then
                    # merges every delta queued meanwhile (fewer hops through Ray, same tokens, same TPOT)
                    wait = last_t + self.stream_interval_s - time.monotonic()
                    if wait > 0:  # ...but the final tokens go out as soon as the request finishes
                        await stream.wait_closed(wait)
                out = await stream.aget()
                item = _item(out)
                now = time.monotonic()
                if first:
                    first = False
                    item["replica"] = self.replica_id
                    item["replica_ms"] = (now - t_in) * 1000.0  # for the ingress's Server-Timing header
                    self._prompt_lens.append(out.num_prompt_tokens or max(n_prompt, 1))
                    if out.finish_reason == "rejected":
                        item["retry_after_s"] = self._retry_after_s(out.num_prompt_tokens)
                        self.metrics.on_rejected(tier, out.reject_reason or "unknown")
                    else:
                        self.metrics.on_admitted(tier)
                elif item["n"] > 0:
                    gap = (now - last_t) / item["n"]
                    self.itl_ms = gap * 1e3 if self.itl_ms is None else 0.9 * self.itl_ms + 0.1 * gap * 1e3
                    self.metrics.on_itl(tier, gap, item["n"])
                last_t = now
                if out.finished:
                    finished = True
                    if out.finish_reason != "rejected":
                        self.metrics.on_finished(tier, req.get("slo") or {}, item)
                yield item
                if out.finished:
                    break
        finally:  # client went away (CancelledError / GeneratorExit) or an error: free the KV now
            self.inflight -= 1
            if not finished:
                self.aborted += 1
                self.engine.abort(rid)
                log.info("request %s aborted (caller cancelled)", rid)

    def _retry_after_s(self, num_prompt_tokens: int) -> int:
        try:
            return max(1, math.ceil(self.engine.predict_ttft_ms(max(num_prompt_tokens, 1)) / 1000.0))
        except Exception:  # noqa: BLE001
            return 1

    # ------------------------------------------------------------------ control plane
    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the controller every `request_routing_stats_period_s`; read by `router.SLORouter`."""
        st = self.engine.stats()
        median = int(statistics.median(self._prompt_lens))
        try:
            queue_ms = self.engine.predict_ttft_ms(1)
            median_ms = self.engine.predict_ttft_ms(median)
        except Exception:  # noqa: BLE001 - predictor not ready: fall back to load only
            queue_ms = median_ms = None
        return {
            "queue_len": st.num_waiting + st.num_running, "num_waiting": st.num_waiting,
            "num_running": st.num_running, "inflight": self.inflight, "vbs": st.vbs,
            "strictest_tpot_ms": st.strictest_tpot_ms, "kv_free_blocks": st.kv_blocks_free,
            "kv_total_blocks": st.kv_blocks_total, "predicted_ttft_ms": median_ms,
            "predicted_queue_ms": queue_ms, "median_prompt_tokens": median, "itl_ms": self.itl_ms,
            "alive": st.alive, "ts": time.time(),
        }

    def inject_fault(self, count: int = 1, replica: str | None = None) -> str:
        """Test hook (deployment handle only, never routed over HTTP): the next `count` model steps of this
        replica's engine raise. With `replica`, only that replica arms the fault (handle calls land on a random
        replica: call until the returned id matches). Returns this replica's id."""
        if replica is None or replica == self.replica_id:
            self.engine.inject_fault(int(count))
        return self.replica_id

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError(f"LLM engine worker of replica {self.replica_id} is dead")

    def stats(self) -> dict[str, Any]:
        """For tests and debugging: `handle.stats.remote()` (routed to any replica)."""
        st = self.engine.stats()
        return {"replica": self.replica_id, "num_running": st.num_running, "num_waiting": st.num_waiting,
                "kv_blocks_free": st.kv_blocks_free, "kv_blocks_total": st.kv_blocks_total,
                "inflight": self.inflight, "aborted": self.aborted, "steps": st.steps, "rejected": dict(st.rejected),
                "pid": os.getpid(), "rss_bytes": _rss_bytes()}

    def model_info(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.engine.max_model_len}

    async def _metrics_loop(self, period_s: float) -> None:
        while not self._closed:
            try:
                self.metrics.update_engine(self.engine.stats(), self.inflight)
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                log.exception("metrics update failed")
            await asyncio.sleep(period_s)

    def __del__(self) -> None:
        self._closed = True
        task = getattr(self, "_metrics_task", None)
        if task is not None:
            task.cancel()
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.shutdown(timeout=5.0)
