"""Overload: open-loop arrivals at 3x measured capacity against a second app with a small engine queue.

Expected: the server keeps answering /health quickly, sheds load with 429 + Retry-After instead of queueing without
bound, every admitted request completes with its full token count, and the replica's RSS stays flat.

CI runs 10 s of overload; KAIROS_OVERLOAD_S=60 (or any number of seconds) gives the full run.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import threading
import time

import httpx
import pytest

from bench.metrics import percentile
from deployments import haproxy_ingress as H
from tests.serve.conftest import TEST_ARGS, SideApp, side_app, wait_idle

OVL_APP, OVL_PREFIX = "kairos-ovl", "/ovl"
MAX_NUM_SEQS, MAX_WAITING = 4, 4
# (vLLM's priority scheduling: the overload test's requests are all of priority 0, the default, as without it)
OVL_ARGS = {**TEST_ARGS, "num_replicas": 1, "max_num_seqs": MAX_NUM_SEQS, "max_waiting": MAX_WAITING,
            "max_ongoing_requests": 32, "max_queued_requests": 8, "retry_after_s": 1, "scheduling_policy": "priority"}
DURATION_S = float(os.environ.get("KAIROS_OVERLOAD_S", "10"))
OVERLOAD_FACTOR = 3.0
MAX_TOKENS = 64
CMPL = "/v1/completions"


def _ovl_app(_: object):
    """Built as a Ray Serve LLM config is (`deployments:build_openai_app`): OVL_ARGS as an LLMConfig, Kairos's own
    arguments among its engine_kwargs."""
    from deployments import build_openai_app

    serve_opts = ("num_replicas", "max_ongoing_requests", "max_queued_requests")
    engine = {k: v for k, v in OVL_ARGS.items() if k not in ("model", "served_model_name", *serve_opts)}
    return build_openai_app({"llm_configs": [{
        "model_loading_config": {"model_id": OVL_ARGS["served_model_name"], "model_source": OVL_ARGS["model"]},
        "engine_kwargs": engine, "deployment_config": {**{k: OVL_ARGS[k] for k in serve_opts},
                                                       "ray_actor_options": {"num_gpus": 0}}}]})


# (tests/serve/conftest.py: before the package's other tests, with the cores to itself: /health's latency and the
# replica's memory under an open loop of three times its capacity)
RUNS_ALONE = True
SIDE_APP = SideApp(OVL_APP, OVL_PREFIX, _ovl_app)


@pytest.fixture(scope="module")
def ovl_app(serve_app: dict):
    from ray import serve

    try:
        yield {"url": side_app(serve_app, SIDE_APP),
               "handle": serve.get_deployment_handle("LLMServer", app_name=OVL_APP)}
    finally:
        # blocking: the last test killed its replica, and the replacement Serve starts (loading and profiling its
        # model) would otherwise take the cores of the next tests
        serve.delete(OVL_APP)


def _body(i: int, stream: bool) -> dict:
    return {"prompt": f"request {i}: " + "lorem ipsum " * random.randint(1, 20), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True} if stream else None}


async def _one(ac: httpx.AsyncClient, i: int, stream: bool) -> dict:
    t0 = time.monotonic()
    res: dict = {"stream": stream, "status": None, "tokens": None, "error": None}
    try:
        if stream:
            async with ac.stream("POST", CMPL, json=_body(i, stream)) as r:
                res["status"], res["retry_after"] = r.status_code, r.headers.get("retry-after")
                if r.status_code == 200:
                    events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
                    chunks = [json.loads(e) for e in events[:-1]]
                    res["done"] = events[-1:] == ["[DONE]"] and not any("error" in c for c in chunks)
                    res["tokens"] = chunks[-1]["usage"]["completion_tokens"] if chunks else None
                else:
                    res["body"] = json.loads(await r.aread())
        else:
            r = await ac.post(CMPL, json=_body(i, stream))
            res["status"], res["retry_after"] = r.status_code, r.headers.get("retry-after")
            res["body"] = r.json()
            if r.status_code == 200:
                res["done"], res["tokens"] = True, res["body"]["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        res["error"] = repr(e)
    res["s"] = time.monotonic() - t0
    return res


async def _capacity(url: str, seconds: float = 4.0) -> float:
    """Closed loop with as many clients as the engine runs at once: completed requests per second."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
        await asyncio.gather(*(_one(ac, i, False) for i in range(MAX_NUM_SEQS)))  # warm-up
        done, t_end = 0, time.monotonic() + seconds
        t0 = time.monotonic()

        async def worker(w: int) -> None:
            nonlocal done
            while time.monotonic() < t_end:
                r = await _one(ac, w, False)
                assert r["status"] == 200, r
                done += 1

        await asyncio.gather(*(worker(w) for w in range(MAX_NUM_SEQS)))
        return done / (time.monotonic() - t0)


async def _open_loop(url: str, rate: float, seconds: float) -> list[dict]:
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60), limits=limits) as ac:
        rng = random.Random(7)
        tasks, t_next, t_end, i = [], time.monotonic(), time.monotonic() + seconds, 0
        while t_next < t_end:
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            tasks.append(asyncio.create_task(_one(ac, i, stream=(i % 2 == 0))))
            i += 1
            t_next += rng.expovariate(rate)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


class _Sampler(threading.Thread):
    """Every second: /health latency (own connection), replica RSS (psutil: the replica's process and its engine's)
    and engine queue (stats)."""

    def __init__(self, url: str, handle, pids: set[int]) -> None:
        super().__init__(daemon=True)
        import psutil

        self.url, self.handle, self.procs = url, handle, [psutil.Process(p) for p in pids]
        self.health: list[float] = []
        self.rss: list[int] = []
        self.queue: list[tuple[int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get(self.url + "/health").status_code == 200
                    self.health.append(time.monotonic() - t0 if ok else float("inf"))
                except httpx.HTTPError:
                    self.health.append(float("inf"))
                self.rss.append(sum(p.memory_info().rss for p in self.procs))
                try:
                    st = self.handle.stats.remote().result(timeout_s=5)
                    self.queue.append((st["num_waiting"], st["num_running"]))
                except Exception:  # noqa: BLE001 - a slow stats call is not what this test measures
                    pass
                self.stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))


def test_open_loop_3x_capacity_sheds_load_and_stays_healthy(ovl_app: dict) -> None:
    url, handle = ovl_app["url"], ovl_app["handle"]
    random.seed(3)
    capacity = asyncio.run(_capacity(url))
    rate = OVERLOAD_FACTOR * capacity
    st0 = handle.stats.remote().result(timeout_s=10)
    sampler = _Sampler(url, handle, {st0["pid"], st0["engine_pid"]})
    sampler.start()
    t0 = time.monotonic()
    results = asyncio.run(_open_loop(url, rate, DURATION_S))
    elapsed = time.monotonic() - t0
    sampler.stop.set()
    sampler.join(10)

    ok = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    other = [r for r in results if r["status"] not in (200, 429)]
    rss_mb = [x / 2**20 for x in sampler.rss]
    e2e_ok = [r["s"] for r in ok]
    print(f"\n[overload] capacity {capacity:.2f} req/s (closed loop, {MAX_NUM_SEQS} clients); offered {rate:.2f} req/s "
          f"for {DURATION_S:.0f}s -> {len(results)} requests in {elapsed:.1f}s: {len(ok)} x 200, {len(shed)} x 429, "
          f"{len(other)} other; 200 e2e p50 {percentile(e2e_ok, 50):.2f}s p99 {percentile(e2e_ok, 99):.2f}s; "
          f"429 p50 {percentile([r['s'] for r in shed], 50) * 1000:.0f} ms; health max "
          f"{max(sampler.health) * 1000:.0f} ms over {len(sampler.health)} samples; engine max waiting/running "
          f"{max((q[0] for q in sampler.queue), default=-1)}/{max((q[1] for q in sampler.queue), default=-1)}; "
          f"replica RSS MB first {rss_mb[0]:.0f} max {max(rss_mb):.0f} last {rss_mb[-1]:.0f}")

    assert not other, other[:5]
    assert len(results) >= 0.6 * rate * DURATION_S
    # sheds load: a good share is refused, fast, with Retry-After; the queue never grows past its bound
    assert len(shed) >= 0.3 * len(results), (len(shed), len(results))
    assert all(r["retry_after"] and int(r["retry_after"]) >= 1 for r in shed)
    assert all(r["body"]["error"]["type"] == "rate_limit_error" for r in shed)
    assert percentile([r["s"] for r in shed], 50) < 1.0
    assert sampler.queue and max(q[0] for q in sampler.queue) <= MAX_WAITING
    assert max(q[1] for q in sampler.queue) <= MAX_NUM_SEQS
    # every admitted request completes in full
    assert len(ok) >= 0.5 * capacity * DURATION_S
    assert all(r.get("done") and r["tokens"] == MAX_TOKENS for r in ok), [r for r in ok if r["tokens"] != MAX_TOKENS]
    # bounded queueing: an admitted request waits for at most ~ (running + waiting) requests' worth of work
    assert percentile(e2e_ok, 99) < 15.0
    # stays responsive
    assert len(sampler.health) >= DURATION_S - 3
    assert max(sampler.health) < 1.0, sorted(sampler.health)[-5:]
    # flat memory: no growth trend over the run (first vs. last quarter of the samples)
    q = max(1, len(rss_mb) // 4)
    growth = statistics.median(rss_mb[-q:]) - statistics.median(rss_mb[:q])
    assert growth < 50, f"replica RSS grew by {growth:.0f} MB: {rss_mb}"
    # and nothing stays counted: every request's slot, queue place and in-flight count were given back (streams
    # the frontend left open once held them until the garbage collector ran: 4 still counted here, on an idle engine)
    (st,) = wait_idle(handle, want=1, timeout_s=10).values()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["inflight"] == 0, st


def _haproxy_stat(node_id: str) -> list[list[str]]:
    """`show stat` of the newest running HAProxy of this Ray node (Serve keeps its config and admin socket in a
    folder named by the node id), from its admin socket."""
    import socket
    from pathlib import Path

    procs = []
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        if d.name.isdigit() and os.path.basename(args[0]) == "haproxy" and "-f" in args[:-1] \
                and f"/{node_id}/" in args[args.index("-f") + 1]:
            procs.append((int(d.name), args))
    if not procs:
        return []
    _, args = max(procs)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.path.join(os.path.dirname(args[args.index("-f") + 1]), "admin.sock"))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [line.split(",") for line in data.decode().splitlines()]


def _wait_haproxy_sends_to_a_replica(backend: str, timeout_s: float = 60.0) -> None:
    """Until HAProxy has a replica of `backend` UP: before that (a replica just started, or HAProxy not yet told of
    it) it sends the app's requests to its backup, Serve's Python proxy, whose errors are Ray's own."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows = _haproxy_stat(node_id)
        except OSError:
            rows = []
        if any(r[0] == backend and r[1].startswith("SERVE_REPLICA") and r[17] == "UP" for r in rows if len(r) > 17):
            return
        time.sleep(0.2)
    pytest.fail(f"HAProxy has no replica of {backend} UP after {timeout_s} s")


def test_a_request_of_a_lower_priority_value_takes_the_next_seat_over_http(ovl_app: dict) -> None:
    """vLLM's `priority` with the app's scheduling_policy priority: three long replies run, the engine's next step
    hangs (a test hook) while two light requests of priority 1 arrive, then one of priority -1 with the most work:
    the free seat goes to it, and the others start only once a seat frees again (least work first, or arrival
    order, would have taken them first). The urgent one's priority is in vLLM's X-Vllm-Priority header."""
    url, handle = ovl_app["url"], ovl_app["handle"]
    wait_idle(handle, want=1)

    async def run() -> tuple[dict[str, float], list[int]]:
        firsts: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            async def stream(name: str, priority: int, max_tokens: int, started: asyncio.Event | None = None) -> int:
                body = {"prompt": f"request {name}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                        "priority": priority}
                # the urgent one's by vLLM's header X-Vllm-Priority, which wins over its body's
                headers = {"x-vllm-priority": str(priority)} if priority < 0 else {}
                async with ac.stream("POST", CMPL, json={**body, "priority": 5} if headers else body,
                                     headers=headers) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and name not in firsts:
                            firsts[name] = time.monotonic()
                            if started is not None:
                                started.set()
                    return r.status_code

            started = [asyncio.Event() for _ in range(MAX_NUM_SEQS - 1)]
            # (their KV, 3 x 600 tokens, and the others' fit the app's 2,048 without a preemption)
            blockers = [asyncio.create_task(stream(f"blocker{i}", 0, 600, e)) for i, e in enumerate(started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            await asyncio.to_thread(lambda: handle.inject_fault.remote(hang_s=3.0).result(timeout_s=10))
            await asyncio.sleep(0.2)  # (the hang has begun: the replies' next step)
            queued = []
            for name, priority, max_tokens in (("low1", 1, 8), ("low2", 1, 8), ("high", -1, 100)):
                queued.append(asyncio.create_task(stream(name, priority, max_tokens)))
                await asyncio.sleep(0.1)  # (in this order)
            statuses = await asyncio.wait_for(asyncio.gather(*queued, *blockers), 60)
            return firsts, statuses

    firsts, statuses = asyncio.run(run())
    assert statuses == [200] * 6
    assert firsts["high"] < firsts["low1"] and firsts["high"] < firsts["low2"], firsts


def test_a_replica_that_dies_under_a_request_answers_it_in_openai_json(ovl_app: dict) -> None:
    """The direct topology: HTTP goes from Serve's HAProxy straight to the replica, so when the replica dies under a
    request HAProxy answers it itself. Ray's template makes that a text/plain 500, or no answer at all where the
    server connection had carried a request before; Kairos's launcher makes it the 503 `replica_failed` with
    Retry-After the routed topology answers (`haproxy_ingress.with_openai_errors`, `without_connection_reuse`)."""
    import ray

    url = ovl_app["url"]
    names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors(all_namespaces=True)]
    (replica,) = [n for n in names if n.startswith("SERVE_REPLICA::") and f"::{OVL_APP}#LLMServer#" in n]
    got: dict = {}
    first_done = threading.Event()

    def in_flight() -> None:  # a client that keeps its connection: this is its second request on it
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                got["first"] = c.post(CMPL, json={"prompt": "first", "max_tokens": 2}).status_code
                first_done.set()
                r = c.post(CMPL, json={"prompt": "in flight when the replica dies", "max_tokens": 900,
                                       "ignore_eos": True})
            got.update(status=r.status_code, headers=r.headers, body=r.text)
        except httpx.HTTPError as e:
            got.update(error=repr(e))

    _wait_haproxy_sends_to_a_replica(f"http-{OVL_APP}")
    t = threading.Thread(target=in_flight)
    t.start()
    assert first_done.wait(30) and got["first"] == 200, got
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until the replica runs it
        if ovl_app["handle"].stats.remote().result(timeout_s=10)["num_running"] == 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the request did not start running: {got}")
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=False)
    t.join(timeout=60)
    assert got.get("status") == 503, got
    assert got["headers"]["content-type"] == "application/json" and got["headers"]["retry-after"] == "1", got
    err = json.loads(got["body"])["error"]
    assert (err["type"], err["code"]) == ("server_error", "replica_failed") and "retry" in err["message"], err
    # mostly HAProxy's answer; where the replica saw its engine process go first, the replica's own (a race)
    assert err["message"] in (H.HAPROXY_ERRORS[502][3], H.HAPROXY_ERRORS[503][3]) \
        or err["message"].startswith("generation failed: the LLM replica serving this request died"), err
