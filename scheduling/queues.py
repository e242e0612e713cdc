"""Waiting-queue ordering: FIFO (leave as is) or LDF (least deadline first, SCORPIO's TTFT-slack sort)."""
from __future__ import annotations

from collections import deque
from typing import Literal, TypeVar

T = TypeVar("T")

QueueOrder = Literal["fifo", "ldf"]


def order_waiting(waiting: deque[T], order: QueueOrder) -> None:
    """Reorder ``waiting`` in place.

    ``fifo`` keeps the caller's order (arrival order, preempted requests wherever the caller put
    them). ``ldf`` sorts stably by ``(deadline_s, arrival_s)``: least TTFT slack first, which is EDF
    on arrival + TTFT SLO; best-effort requests (deadline +inf) go last, in arrival order.
    """
    if order == "fifo":
        return
    if order != "ldf":
        raise ValueError("order must be fifo|ldf")
    ordered = sorted(waiting, key=lambda r: (r.deadline_s, r.arrival_s))
    waiting.clear()
    waiting.extend(ordered)
