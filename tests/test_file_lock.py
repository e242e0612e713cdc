"""One builder at a time for the disk caches (engine/file_lock.py): the lock across processes, and its three users
(the CPU kernels' build, an embedded model's build, a latency fit) doing their work once when started together."""
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.file_lock import held, lock_path

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_process_waits_for_the_holder_and_gets_the_lock_when_the_holder_is_killed(tmp_path):
    entry = tmp_path / "cache" / "entry.json"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom engine.file_lock import held\n"
                               f"with held({str(entry)!r}):\n    print('in', flush=True)\n    time.sleep(60)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "in"
        got = threading.Event()

        def take():
            with held(entry):
                got.set()

        t = threading.Thread(target=take, daemon=True)
        t.start()
        assert not got.wait(0.5)  # the holder has it
        holder.kill()  # no release by the holder: the kernel's
        assert got.wait(10)
        t.join(10)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert lock_path(entry).exists() and not entry.exists()  # (the lock file stays; what it guards is the caller's)


def test_threads_take_it_in_turn_and_an_unlockable_place_runs_the_block_unlocked(tmp_path):
    inside, overlaps = [0], []

    def work():
        with held(tmp_path / "entry"):
            inside[0] += 1
            overlaps.append(inside[0])
            time.sleep(0.05)
            inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert overlaps == [1, 1, 1, 1]
    (tmp_path / "file").write_text("x")
    ran = []
    with held(tmp_path / "file" / "below" / "entry"):  # its folder cannot be made
        ran.append(1)
    assert ran == [1]


def test_cpu_kernels_started_together_on_an_empty_cache_are_built_once(tmp_path, monkeypatch):
    from engine.backends.cpu import kernels

    try:
        built = Path(kernels.load().lib._name)  # this box's build, to copy from
    except (kernels.KernelsUnavailable, AttributeError):
        pytest.skip("the CPU kernels do not build here")
    monkeypatch.setenv("KAIROS_CACHE", str(tmp_path))
    builds = []

    def build(compiler, path, source, flags):  # a build that takes a while, by copying this box's
        builds.append(path)
        time.sleep(0.5)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, path)

    monkeypatch.setattr(kernels, "_build", build)
    errors = []

    def load():
        try:
            kernels.load_source(kernels.SOURCE, kernels.isa_flags())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(builds) == 1


def test_engines_of_one_setup_started_together_profile_once(tiny_checkpoints, tmp_path, monkeypatch):
    """Two engines of the same setup starting at once on an empty cache: one profiles, the other waits for its fit
    and loads it (not a second profile timed against the first's)."""
    from engine import profiling
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    monkeypatch.setenv("KAIROS_CACHE", str(tmp_path))
    # (the lock is what is tested: a fit timed on a loaded box, one too rough to keep, is kept here all the same)
    monkeypatch.setattr(profiling, "untrusted", lambda report: None)
    engines, errors = [], []

    def start():
        try:
            engines.append(LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu",
                                                  kernels="off", scheduler=SchedulerConfig(policy="fcfs"))))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and len(engines) == 2
        assert sorted(e.profile_report["cached"] for e in engines) == [False, True]
        assert engines[0].profile_report["path"] == engines[1].profile_report["path"]
    finally:
        for e in engines:
            e.shutdown()
