"""tests/run.py's split of the suite over two pytest processes (`make test`): every test runs once, each file's tests
in one process, and a second process takes files only from the first process's signal on."""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.run import CLAIMS_ENV, SERVE_DONE_ENV

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_reserve.py", "tests/test_autoscaling_policy.py", "tests/test_tier_floor.py",
         "tests/test_stream.py"]
# (run in both processes below, with the variables set: each process takes them out of its environment)
POPPED = "tests/test_run.py::test_a_process_a_test_starts_is_not_part_of_the_split"


def _ran(xml: Path) -> list[tuple[str, str]]:
    """(file's module, test) of each test case in a JUnit report that ran (passed, failed or skipped)."""
    return [(c.get("classname"), c.get("name")) for c in ET.parse(xml).getroot().iter("testcase")]


def _pytest(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_two_processes_run_each_file_once_and_whole(tmp_path: Path) -> None:
    claims, done = tmp_path / "claims", tmp_path / "serve-done"
    claims.mkdir()
    (claims / FILES[-1].replace("/", "__")).touch()  # a file another process took already: neither runs it
    env = {**os.environ, CLAIMS_ENV: str(claims), SERVE_DONE_ENV: str(done)}
    procs = [_pytest([*FILES, POPPED, f"--junitxml={tmp_path / f'{i}.xml'}"], env) for i in range(2)]
    outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ran = [_ran(tmp_path / f"{i}.xml") for i in range(2)]
    alone = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                            "--collect-only", *FILES[:-1], POPPED], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    collected = sorted((f.removesuffix(".py").replace("/", "."), t.split("[")[0])
                       for f, t in (line.split("::") for line in alone.splitlines() if "::" in line))
    assert sorted((m, t.split("[")[0]) for m, t in ran[0] + ran[1]) == collected  # each test once
    modules = [{m for m, _ in r} for r in ran]
    assert not modules[0] & modules[1]  # a file's tests all in one process
    assert sorted(os.listdir(claims)) == sorted(f.replace("/", "__") for f in [*FILES, "tests/test_run.py"])
    assert done.exists()  # no serving package collected: its end is the first test's start


def test_a_process_a_test_starts_is_not_part_of_the_split(tmp_path: Path) -> None:
    """The variables are taken out of the environment the tests (and what they start) see (the test above runs this
    one in processes started with them)."""
    assert CLAIMS_ENV not in os.environ and SERVE_DONE_ENV not in os.environ


def test_a_process_told_to_wait_collects_then_takes_no_file_until_the_signal(tmp_path: Path) -> None:
    """The second process of `make test` starts with the first and waits, once collected, for the first's signal
    (the file AFTER_ENV names) before it claims a file or runs a test."""
    import time

    from tests.run import AFTER_ENV

    claims, done, go = tmp_path / "claims", tmp_path / "serve-done", tmp_path / "go"
    claims.mkdir()
    env = {**os.environ, CLAIMS_ENV: str(claims), SERVE_DONE_ENV: str(done), AFTER_ENV: str(go)}
    proc = _pytest([FILES[0]], env)
    try:
        while b"waiting for the serving package" not in (line := proc.stdout.readline()):  # (collected)
            assert line, "the process ended before it waited"
        time.sleep(0.5)
        assert proc.poll() is None and not os.listdir(claims)
        go.touch()
        out = proc.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert os.listdir(claims) == [FILES[0].replace("/", "__")]
