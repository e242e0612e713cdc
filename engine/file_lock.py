"""One builder at a time for what Kairos caches on disk (an embedded model, the CPU kernels' build, a latency fit).

Each of those is written privately and published atomically, so processes that build it at once stay correct; but
each does the whole work (a model's conversion, a compile, a profile), and a host's replicas start together: on a
CPU host they also share its cores, so every profile is timed against the others. `held(path)` is an exclusive
lock across processes and threads (`flock` on a lock file beside what it guards, left in place), so the first
builds and the others wait and then find the cache. The kernel releases it when its holder exits, however it exits.
Where the lock file cannot be opened or locked (a read-only cache, no `fcntl`), the block runs unlocked: the
callers' atomic publish keeps that correct, as before.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX platform
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("kairos.engine")


def lock_path(path: str | os.PathLike[str]) -> Path:
    """The lock file of cache entry `path`: a hidden file beside it."""
    p = Path(path)
    return p.with_name(f".{p.name}.lock")


@contextmanager
def held(path: str | os.PathLike[str], what: str = "") -> Iterator[None]:
    """Hold the lock of cache entry `path` (`lock_path`) for the block; `what` names the work in the log line of
    a process that waits for another's."""
    fd = None
    if fcntl is not None:
        try:
            lock = lock_path(path)
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                t0 = time.monotonic()
                log.info("waiting for another process's %s (%s)", what or "build", path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:
                    pass
                else:
                    log.info("waited %.1f s for another process's %s", time.monotonic() - t0, what or "build")
            except OSError:  # a file system without locks
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)
