"""Waiting-queue ordering: FIFO (leave as is), LDF (least deadline first, SCORPIO's TTFT-slack sort), or least work
first (kairos's `short_first`); and, with priority scheduling, by priority over any of them."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Literal, TypeVar

T = TypeVar("T")

QueueOrder = Literal["fifo", "ldf"]


def order_waiting(waiting: deque[T], order: QueueOrder, ranked: bool = False) -> None:
    """Reorder ``waiting`` in place.

    ``fifo`` keeps the caller's order (arrival order, preempted requests wherever the caller put
    them). ``ldf`` sorts stably by ``(deadline_s, arrival_s)``: least TTFT slack first, which is EDF
    on arrival + TTFT SLO; best-effort requests (deadline +inf) go last, in arrival order. Requests
    already started (preempted mid-reply) go first, as vLLM resumes them: one without a TTFT SLO
    (deadline +inf) went behind every fresh one with a deadline, and under load never resumed.
    ``ranked`` (priority scheduling): by ``priority`` first, lowest first, that order within each.
    """
    if order == "fifo":
        return
    if order != "ldf":
        raise ValueError("order must be fifo|ldf")
    if len(waiting) < 2:
        return
    ordered = sorted(waiting, key=lambda r: (r.priority if ranked else 0, r.first_token_s is None, r.deadline_s,
                                             r.arrival_s))
    waiting.clear()
    waiting.extend(ordered)


def order_least_work(waiting: deque[T], work: Callable[[T], float], urgent_before: float = -math.inf,
                     ranked: bool = False) -> None:
    """Reorder ``waiting`` in place: requests already started (preempted mid-reply) first, in their order; then the
    fresh ones by ``work(r)``, least first, ties by ``(deadline_s, arrival_s)``. With goodput counted in requests,
    the least work per request is the most requests a replica's decode rate completes (kairos's `short_first`).
    Fresh requests whose TTFT deadline falls before ``urgent_before`` (those that cannot wait for the next room:
    reserve.py) go before the other fresh ones, least work first among them. ``ranked`` (priority scheduling): by
    ``priority`` first, lowest first, that order within each."""
    if len(waiting) < 2:
        return

    def key(r: T) -> tuple:
        rank = r.priority if ranked else 0  # type: ignore[attr-defined]
        if r.first_token_s is not None:  # type: ignore[attr-defined] - started: a stable sort keeps their order
            return (rank, 0)
        return (rank, 1 if r.deadline_s < urgent_before else 2, work(r), r.deadline_s, r.arrival_s)  # type: ignore
    ordered = sorted(waiting, key=key)
    waiting.clear()
    waiting.extend(ordered)


def order_by_priority(waiting: deque[T]) -> bool:
    """Sort ``waiting`` in place stably by ``priority``, lowest first (vLLM's priority scheduling): the order within
    each priority stays the policy's. Returns whether the queue holds more than one priority (else it is left as
    it is)."""
    if len(waiting) < 2:
        return False
    first = waiting[0].priority
    if all(r.priority == first for r in waiting):
        return False
    ordered = sorted(waiting, key=lambda r: r.priority)
    waiting.clear()
    waiting.extend(ordered)
    return True
