"""Where a machine's CPU went over an interval: CPU time and run-queue wait per group of processes, from /proc.

Used by `bench.overhead --cpu`. On a box whose engine takes every core, whatever else runs (the serving processes,
Ray's control plane, the client) runs on the engine's cores: its CPU time is what a step loses, and its run-queue
wait is how long it was ready but waited for a core (latency it adds to whatever it was about to deliver). Linux
only: elsewhere `snapshot` is empty.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass

# (group, a substring of the command line), first match wins; the rest of Ray's processes are "ray (other)"
GROUPS = (
    ("engine process", "engine.core_proc"),
    ("replica", "ray::ServeReplica"),
    ("haproxy", "bin/haproxy"),
    ("serve controller", "ray::ServeController"),
)


@dataclass(frozen=True, slots=True)
class Times:
    cpu_s: float = 0.0
    wait_s: float = 0.0  # ready to run, waiting for a core

    def __add__(self, o: "Times") -> "Times":
        return Times(self.cpu_s + o.cpu_s, self.wait_s + o.wait_s)

    def __sub__(self, o: "Times") -> "Times":
        return Times(self.cpu_s - o.cpu_s, self.wait_s - o.wait_s)


def group_of(cmdline: str) -> str | None:
    for name, needle in GROUPS:
        if needle in cmdline:
            return name
    return "ray (other)" if "ray" in cmdline else None


def _process(pid: str) -> Times:
    total = Times()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue
        total += Times(run_ns / 1e9, wait_ns / 1e9)
    return total


def snapshot() -> dict[int, tuple[str, Times]]:
    """pid -> (group, its threads' times so far) for every process of a group (see `group_of`)."""
    out: dict[int, tuple[str, Times]] = {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    me = os.getpid()
    for pid in pids:
        if int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            group = group_of(cmd)
            if group is not None:
                out[int(pid)] = (group, _process(pid))
        except OSError:
            continue
    return out


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for (e.g. a benchmark client)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def usage(before: dict[int, tuple[str, Times]], after: dict[int, tuple[str, Times]]) -> dict[str, Times]:
    """Per group, what its processes took between two snapshots (processes that started meanwhile count whole;
    those that ended meanwhile are lost: wait for them with `children_cpu_s`)."""
    out: dict[str, Times] = {}
    for pid, (group, t) in after.items():
        prev = before.get(pid)
        d = t - prev[1] if prev is not None and prev[0] == group else t
        out[group] = out.get(group, Times()) + d
    return out
