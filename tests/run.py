"""`make test`: the suite in two pytest processes, so that both cores of a small CI box work.

The serving package (tests/serve: one Ray cluster, the Serve apps on port 8000, tests of latency under load) runs
first, in the first process, as in one process: its tests that need the cores to themselves (its modules'
RUNS_ALONE) alone, the rest beside the second process. From the end of those, the other test files, most of them
in-process tests on one core, are shared by two processes (the first joins once its package has ended): each takes
the next file no process has taken yet (tests/conftest.py: `pytest_runtestloop` with KAIROS_TEST_CLAIMS), so they
end within about one file of each other whatever the files' durations, with no table of them to keep. The second
process starts with the first: it imports and collects the suite beside the first's collection, then waits
(KAIROS_TEST_AFTER) for that signal before it runs a test, so that its collection is not on the way then; it is
stopped if the first process ends without the signal (stopped, or failed to collect). The first process's output
streams here; the second's follows when both have ended. The exit status is the first nonzero of the two.

`python -m tests.run ARGS` with any pytest arguments (`make test PYTEST_ARGS=...`), or with KAIROS_TEST_PROCESSES=1
or one core: a single `python -m pytest ARGS`, as before.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVE_PACKAGE = Path(__file__).resolve().parent / "serve"
# (read by tests/conftest.py) the directory where a process claims a file by creating its name, and the file the first
# process creates when its serving package has ended
CLAIMS_ENV, SERVE_DONE_ENV = "KAIROS_TEST_CLAIMS", "KAIROS_TEST_SERVE_DONE"
# (read by tests/conftest.py) a file whose existence a process waits for, once collected, before it runs a test
AFTER_ENV = "KAIROS_TEST_AFTER"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pytest(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *args]


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.0f} s"


def _wait(procs: list[subprocess.Popen], t0: float) -> list[float]:
    """Wait for `procs` to end; when each did, in seconds from `t0`."""
    ended: list[float | None] = [None] * len(procs)
    while None in ended:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.2)
    return ended


def main(argv: list[str]) -> int:
    if argv or os.environ.get("KAIROS_TEST_PROCESSES") == "1" or _cores() < 2:
        os.execv(sys.executable, _pytest(argv))
    with tempfile.TemporaryDirectory(prefix="kairos-test-") as tmp:
        claims, done, log = Path(tmp) / "claims", Path(tmp) / "serve-done", Path(tmp) / "second.log"
        claims.mkdir()
        env = {**os.environ, CLAIMS_ENV: str(claims), SERVE_DONE_ENV: str(done)}
        t0 = time.monotonic()
        first = subprocess.Popen(_pytest([]), env=env)
        second, started = None, None
        try:
            with open(log, "wb") as out:
                second = subprocess.Popen(_pytest([f"--ignore={SERVE_PACKAGE}"]), env={**env, AFTER_ENV: str(done)},
                                          stdout=out, stderr=subprocess.STDOUT)
            while first.poll() is None and not done.exists():
                time.sleep(0.5)
            if done.exists():
                started = time.monotonic() - t0
            else:  # the first process ended before the package did: it was stopped, or failed to collect
                second.terminate()
            ended = _wait([first, second], t0)
            rc_first, rc_second = first.returncode, second.returncode if started is not None else None
        except KeyboardInterrupt:  # (the processes got the terminal's SIGINT too)
            for p in (first, second):
                if p is not None:
                    p.wait()
            raise
        if started is not None:
            print(f"\n===== the second pytest process (the files it took), exit status {rc_second} =====", flush=True)
            sys.stdout.write(log.read_text(errors="replace"))
        print(f"\n===== pytest exit statuses: {rc_first} (serving package and files), {rc_second} (files); the second "
              f"started its tests at {_s(started)}, they ended at {', '.join(_s(t) for t in ended)} =====", flush=True)
        return rc_first or (rc_second or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
