"""The direct topology: LLM replicas that serve HTTP themselves (HTTP -> replica -> engine process).

The routed topology puts a hop between HTTP and the engine: the Ingress replica calls an `LLMServer` replica
through a streaming Serve handle, and every streamed token crosses Ray's streaming generator and serialization
in both processes. With one LLM replica there is nothing to route, so that hop is pure cost; `build_app` then
deploys `DirectLLMServer` (`topology=auto`, the default): an `LLMReplica` that also carries the
`OpenAIFrontend`, reached straight from Serve's HAProxy (or its Python proxy), as vLLM's API server talks to its
engine core and as Ray Serve LLM's direct-streaming mode skips its ingress. It keeps the deployment name
`LLMServer`, so handles, metrics and dashboards read the same in both topologies.

`topology=direct` with several replicas is also allowed: HAProxy then balances requests over them (least
connections), not Kairos's SLO router.

What the routed topology gets from Serve, the direct replica does itself: at most `max_ongoing_requests`
requests in its engine, up to `max_queued_requests` more waiting for a slot, and a 429 + Retry-After beyond that.
"""
# NB: no `from __future__ import annotations`: FastAPI must see real annotations on the inherited routes.

import asyncio
import dataclasses
import inspect
import time
from typing import Any, AsyncIterator

from ray import serve

from core.messages import GenerateRequest, RequestOutput
from deployments.args import load_api_keys
from deployments.errors import overloaded
from deployments.ingress import GenerateStream, OpenAIFrontend, openai_api
from deployments.pacing import StreamPacing
from deployments.replica import LLMReplica, scales_to_zero


class LocalStream:
    """A `GenerateStream` over an async generator of this process: `cancel` closes it, which runs its `finally`
    (the replica's abort of the request in the engine)."""

    _closing: set[asyncio.Task] = set()  # the event loop holds tasks weakly

    def __init__(self, agen: AsyncIterator[RequestOutput]) -> None:
        self._agen = agen

    def __anext__(self) -> Any:
        return self._agen.__anext__()

    def cancel(self) -> None:
        task = asyncio.get_running_loop().create_task(self._close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self) -> None:
        try:
            await self._agen.aclose()  # type: ignore[attr-defined]
        except RuntimeError:  # still running in the task being cancelled: that cancellation closes it
            pass


class DirectFrontend(OpenAIFrontend, LLMReplica):
    async def __init__(self, engine_config: dict[str, Any], settings: dict[str, Any], max_ongoing_requests: int,
                       max_queued_requests: int, metrics_interval_s: float = 0.5, log_prompts: bool = False,
                       share_cores_with: int | None = None, pacing: StreamPacing | None = None,
                       engine_process: bool = True, loop_priority: str = "engine",
                       served_name: str | None = None, log_stats_s: float = 0.0) -> None:
        if scales_to_zero():  # (a Serve config's `deployments:` may say so, which the app's arguments never saw)
            raise ValueError("autoscaling_config: min_replicas 0 needs the routed topology (topology=direct: the LLM "
                             "replicas answer HTTP themselves, and with none running each request, /health too, "
                             "waits for one to start); give the app's arguments topology: routed")
        # (the front's keys read before the model loads: a key file that is not there fails at once, not after a
        # load of minutes, again at each of Serve's restarts)
        load_api_keys(settings.get("api_keys_env"), settings.get("api_key_file"))
        await LLMReplica.__init__(self, engine_config, metrics_interval_s, log_prompts, share_cores_with,
                                  pacing, engine_process, loop_priority, served_name, log_stats_s)
        self._init_frontend(settings)
        self._info = self.model_info()  # the engine is up: this replica can serve from its first request
        self._slots = asyncio.Semaphore(max_ongoing_requests)
        self._cap = None if max_queued_requests < 0 else max_ongoing_requests + max_queued_requests
        self._calls = 0  # requests holding or waiting for a slot

    def _ready_info(self) -> dict[str, Any] | None:
        return self._info

    def reconfigure(self, user_config: dict[str, Any] | None, rank: Any = None) -> None:
        """`LLMReplica.reconfigure`, then the model's info again: what the requests are built with (priority
        scheduling turned on or off) follows the engine's new scheduler."""
        LLMReplica.reconfigure(self, user_config, rank)
        self._info = self.model_info()

    def _unavailable(self) -> str | None:
        return None if self.engine.is_alive() else "the replica's LLM engine exited"

    async def __del__(self) -> None:
        """Stop the engine, then let what follows `LLMReplica` in the deployed class's MRO (Serve's ASGI
        wrapper, which shuts the app's lifespan down) do its part."""
        LLMReplica.__del__(self)
        rest = getattr(super(LLMReplica, self), "__del__", None)
        if rest is not None:
            res = rest()
            if inspect.isawaitable(res):
                await res

    async def _replica_call(self, method: str, *args: Any) -> dict[str, Any]:
        """This replica's own engine's `LLMReplica` method; one that is not a coroutine on a thread, as Serve runs a
        routed replica's (/tokenize of a long text, a chat's template: they stalled every stream of the loop)."""
        fn = getattr(self, method)
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)

    def _open(self, req: GenerateRequest) -> GenerateStream:
        return LocalStream(self._bounded(req))

    async def _bounded(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """`generate` within the replica's caps. The check and the count sit in the generator's body, so a stream
        closed before it started counts nothing; a full queue raises at the first item (429). The slot and the
        count are given back before the last item is yielded: the frontend stops at a finished item without
        closing the stream, and a stream still referenced somewhere (a reference cycle) would otherwise hold its slot
        until the garbage collector ran (the overload test found some still counted)."""
        if self._cap is not None and self._calls >= self._cap:
            raise overloaded(self.retry_after_s)
        self._calls += 1
        last = None
        t_queued = time.perf_counter()
        try:
            async with self._slots:
                # the wait for a slot is off its TTFT SLO, as the time before it (GenerateRequest.waited_ms)
                req = dataclasses.replace(req, waited_ms=req.waited_ms + (time.perf_counter() - t_queued) * 1000.0)
                inner = self.generate(req)
                try:
                    async for out in inner:
                        if out.finished:
                            last = out
                            break
                        yield out
                finally:
                    await inner.aclose()  # type: ignore[attr-defined]
        finally:
            self._calls -= 1
        if last is not None:
            yield last


DirectLLMServer = serve.deployment(
    serve.ingress(openai_api())(DirectFrontend), name="LLMServer", ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1_000_000, health_check_period_s=5.0, health_check_timeout_s=30.0,
    graceful_shutdown_timeout_s=20.0)
