"""Replica-level behaviour: both replicas get traffic; a client disconnect mid-stream frees the KV cache."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serve.conftest import replica_stats, wait_idle


def test_both_replicas_receive_traffic(base_url: str, llm_handle) -> None:
    # the router ranks by each replica's last stats report (every second) plus what it sent since: a report still
    # showing an earlier test's load sends a round of these short requests to the other replica; rounds a report
    # period apart until both served (a router that sends all to one never ends the loop)
    wait_idle(llm_handle, want=2)

    def one(i: int) -> str:
        r = httpx.post(f"{base_url}/v1/completions", json={"prompt": f"request {i}", "max_tokens": 24,
                                                             "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-kairos-replica"]

    replicas: list[str] = []
    deadline = time.monotonic() + 30
    with ThreadPoolExecutor(8) as pool:
        while True:
            replicas += pool.map(one, range(16))
            if len(set(replicas)) == 2 or time.monotonic() > deadline:
                break
            time.sleep(1.1)
    assert len(set(replicas)) == 2, replicas


def test_routing_stats_reported(llm_handle) -> None:
    # what record_routing_stats() returns is what the router reads as `RunningReplica.routing_stats`
    from core.messages import RoutingStats

    st = RoutingStats.from_dict(llm_handle.record_routing_stats.remote().result(timeout_s=10))
    for key in ("queue_len", "num_running", "vbs", "strictest_tpot_ms", "kv_blocks_free", "predicted_ttft_ms"):
        assert hasattr(st, key), st
    assert st.kv_blocks_free <= st.kv_blocks_total and st.predicted_ttft_ms > 0
    # the ITL the router projects is the engine's decode step time (None before any step decoded)
    assert (st.itl_ms is None) == (st.step_batch is None)


def test_metrics_exported(base_url: str) -> None:
    import ray

    httpx.post(f"{base_url}/v1/completions", json={"prompt": "m", "max_tokens": 3}, timeout=60)
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "m", "max_tokens": 3},
                   headers={"x-slo-ttft-ms": "0.001"}, timeout=60)
    assert r.status_code == 400  # slo_unattainable
    port = ray._private.worker.global_worker.node.metrics_export_port
    want = {"ray_kairos_ttft_s_bucket", "ray_kairos_tpot_s_bucket", "ray_kairos_itl_s_bucket", "ray_kairos_e2e_s_bucket",
            "ray_kairos_generation_tokens_total", "ray_kairos_prompt_tokens_total", "ray_kairos_kv_blocks_free",
            "ray_kairos_kv_blocks_used", "ray_kairos_queue_len", "ray_kairos_num_running", "ray_kairos_vbs",
            "ray_kairos_itl_correction", "ray_kairos_length_scale",
            "ray_kairos_requests_rejected_total", "ray_kairos_requests_admitted_total",
            # vLLM's, under the names Ray Serve LLM's engines give them: Ray's Serve LLM dashboard reads these
            "ray_vllm_request_prompt_tokens_sum", "ray_vllm_generation_tokens_total", "ray_vllm_num_requests_running",
            "ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_request_success_total"}
    deadline, names = time.monotonic() + 20, set()
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        names = {ln.split("{")[0] for ln in text.splitlines() if ln.startswith(("ray_kairos_", "ray_vllm_"))}
        if want <= names:
            break
        time.sleep(0.5)
    assert want <= names, want - names
    assert 'reason="slo_unattainable"' in text and 'deployment="LLMServer"' in text


def _aborted_since(llm_handle, before: int, timeout_s: float = 15.0) -> tuple[int, bool, dict]:
    """(requests the replicas aborted since `before`, whether they are idle with every KV block free, their stats),
    once one was aborted and they are idle, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = replica_stats(llm_handle)
        idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
                   for s in stats.values())
        aborted = sum(s["aborted"] for s in stats.values()) - before
        if (idle and aborted >= 1) or time.monotonic() > deadline:
            return aborted, idle, stats
        time.sleep(0.2)


def test_client_disconnect_frees_kv(base_url: str, llm_handle) -> None:
    before = sum(s["aborted"] for s in replica_stats(llm_handle).values())
    req = {"prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{base_url}/v1/completions", json=req) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 3:
                    break
        # leaving both context managers closes the connection mid-stream
    aborted, idle, stats = _aborted_since(llm_handle, before)
    assert aborted == 1, stats
    assert idle, stats


def test_a_client_gone_before_a_response_whose_body_came_after_its_headers_is_aborted(base_url: str,
                                                                                      llm_handle) -> None:
    """python-requests and urllib3 send a request's body in a TCP segment after its headers. HAProxy 2.8 spliced
    such a body and then missed the client's close: the request ran to its end (the launcher now drops the
    template's `option splice-request`). Here the body follows 50 ms after the headers and the client closes before
    any response: the replica aborts the request and frees its KV."""
    import json
    import socket
    from urllib.parse import urlsplit

    wait_idle(llm_handle, want=2)
    before = sum(s["aborted"] for s in replica_stats(llm_handle).values())
    host = urlsplit(base_url)
    body = json.dumps({"prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host.hostname, host.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(head)
        time.sleep(0.05)
        s.sendall(body)
        deadline = time.monotonic() + 10  # (the request runs in a replica: then the client goes)
        while sum(st["num_running"] for st in replica_stats(llm_handle).values()) < 1:
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.02)
    aborted, idle, stats = _aborted_since(llm_handle, before)
    assert aborted == 1 and idle, stats
