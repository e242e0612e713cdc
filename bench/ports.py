"""A port for a server that a test or a benchmark starts in a subprocess (`serve run`).

A port the OS hands out (bind to port 0) is in its ephemeral range, and so are the ports Ray's own processes take
while the app starts (metrics exporters, gRPC servers: bound to 0, or drawn at random above such a port): one of
them could take the port between the caller choosing it and the app binding it, and the caller then talks to Ray's
server (a metrics exporter answered /health with 200 and a completion with 405). So the port is drawn below the
ephemeral range, above Ray's worker ports (10002-19999 by default) and below Serve's direct-ingress ports
(30000-31000), and checked free as a server binds it.
"""
from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 29999


def free_port(host: str = "127.0.0.1", exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A port in LOW..HIGH that binds now, not one of `exclude` (those already chosen)."""
    for _ in range(200):
        port = random.randint(LOW, HIGH)
        if port in exclude:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH}")
