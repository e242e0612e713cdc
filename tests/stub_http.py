"""A real HTTP server for tests of the benchmark clients: aiohttp.web on 127.0.0.1, in a thread of its own."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any


@contextlib.contextmanager
def stub_server(handle: Callable[[Any], Awaitable[Any]]) -> Iterator[str]:
    """Serve every request with `handle(aiohttp.web.Request) -> aiohttp.web.Response`; yields the base URL."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, name="stub-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
