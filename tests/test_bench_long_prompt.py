"""bench.long_prompt against a stub server that stalls its stream while a long prompt is in: the gap it reports."""
import asyncio
import json

from bench import long_prompt
from tests.stub_http import stub_server


def test_it_reports_the_streams_longest_gap_and_the_long_requests_time(tmp_path):
    from aiohttp import web

    state = {"long": None}

    async def handle(request):
        body = await request.json()
        if not body.get("stream"):
            state["long"] = asyncio.Event()
            await asyncio.sleep(0.3)  # the long prompt's prefill
            state["long"].set()
            return web.json_response({"choices": [{"text": "ok"}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            if state["long"] is not None:
                await state["long"].wait()  # the stream stalls behind it
            await resp.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        state["long"] = None
        return resp

    with stub_server(handle) as url:
        res = long_prompt.measure(url, prompt_tokens=50, stream_tokens=30, delay_s=0.05)
        res = asyncio.run(res)
    assert set(res) == {"slo", "no_slo"}
    for r in res.values():
        assert r["chunks"] == 30 and r["long_status"] == 200
        assert r["max_gap_ms"] >= 250 and r["long_ms"] >= 300 and r["mean_gap_ms"] < r["max_gap_ms"]
