"""The refusals an ingress sees, for the SLO routers of its process (deployments/router.py).

A replica's routing stats are up to a routing-stats period old: every request routed on them meanwhile went to the
replica that had just turned a request as strict away. The ingress reports each refusal here (`note_refusal`); every
`SLORouter` of the process subscribed its table, and passes that replica over for requests as strict until a newer
report comes from it. A module of its own, imported by name: Serve may load the router class's module as a copy of
its own (by value), whose globals the ingress would not see.
"""
from __future__ import annotations

import time
from core.request import SLO

# the routers' tables (replica unique id -> (wall time, SLO, reason, priority)); a router lives as long as its handle
_TABLES: list[dict[str, tuple[float, SLO, str, int]]] = []


def subscribe(table: dict[str, tuple[float, SLO, str, int]]) -> None:
    """Have `table` (an SLORouter's) receive every refusal noted in this process from now on."""
    _TABLES.append(table)


def note_refusal(replica: str, slo: SLO, reason: str, priority: int = 0) -> None:
    """`replica` (its unique id) turned a request of `slo` away for its load (`reason`: a RejectReason value);
    `priority`: the request's (with priority scheduling, one of a lower value would have gone before it)."""
    now = time.time()
    for table in _TABLES:
        table[replica] = (now, slo, reason, priority)
