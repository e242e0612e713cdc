import itertools
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.run import AFTER_ENV, CLAIMS_ENV, SERVE_DONE_ENV  # noqa: E402

# Without a GPU, Triton kernels (the CUDA backend's) run in Triton's interpreter on CPU tensors. triton.jit picks the
# interpreter when a kernel is decorated, so this must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from tests.paged_attention_reference import patch_interpreter_for_numpy

        patch_interpreter_for_numpy()
    except ImportError:  # triton is not installed: the tests that need it skip
        pass


# An engine fits its latency model on its first start for each (checkpoint, dtype, threads, kernel build, ...) and
# caches the fit; any change to the kernels' source or to the profile's version makes every fit stale, and the suite
# starts engines of some forty such setups. In this process (not in Ray replicas or engine subprocesses) an engine
# profiles for TEST_PROFILE_S instead of the default budget, a real but shorter fit, and keeps it apart from the
# full-budget fits that serving and benchmarks use (`profiles-tests/` beside `profiles/`). An engine given its own
# `predictor_path` (a test that needs a fit of this machine, now) gets the full budget.
TEST_PROFILE_S = float(os.environ.get("KAIROS_TEST_PROFILE_S", "3"))


# A host engine's default KV cache is 1 GiB, zeroed at start and freed at shutdown: for a tiny checkpoint that is two
# million tokens, page-faulted in (most of an in-process engine's start on this box) by each of the suite's ~hundred
# engines. In this process (not in Ray replicas or engine subprocesses) an engine with no cache size of its own holds
# TEST_KV_TOKENS tokens where 1 GiB would hold more (a real checkpoint, e.g. SmolLM2, keeps the 1 GiB default; 0: off).
TEST_KV_TOKENS = int(os.environ.get("KAIROS_TEST_KV_TOKENS", "65536"))


def _small_host_caches(mp: pytest.MonkeyPatch) -> None:
    try:
        from engine import engine as engine_mod
    except ImportError:
        return
    full = getattr(engine_mod, "host_cache_blocks", None)
    if full is None or TEST_KV_TOKENS <= 0:
        return

    def test_host_cache_blocks(spec):
        return min(full(spec), -(-TEST_KV_TOKENS // spec.block_size))

    mp.setattr(engine_mod, "host_cache_blocks", test_host_cache_blocks)


@pytest.fixture(scope="session", autouse=True)
def _short_test_profiles():
    try:
        from engine import profiling
    except ImportError:
        yield
        return
    load, default_path = profiling.load_or_profile, getattr(profiling, "_default_path", None)
    defaults = load.__defaults__

    def test_path(meta):
        path = default_path(meta)
        return path.parent.with_name(path.parent.name + "-tests") / path.name

    def short_default(engine, time_budget_s=None, **kw):
        if time_budget_s is None:
            explicit = getattr(engine.config.scheduler, "predictor_path", None)
            time_budget_s = defaults[0] if explicit else TEST_PROFILE_S
        return load(engine, time_budget_s, **kw)

    with pytest.MonkeyPatch.context() as mp:
        _small_host_caches(mp)
        if default_path is not None and defaults:
            mp.setattr(profiling, "_default_path", test_path)
            mp.setattr(profiling, "load_or_profile", short_default)
            engine_mod = sys.modules.get("engine.engine") or __import__("engine.engine", fromlist=["_"])
            if getattr(engine_mod, "load_or_profile", None) is load:
                mp.setattr(engine_mod, "load_or_profile", short_default)
        yield


# An engine collects garbage when it starts and when it stops, a full collection each (engine/engine.py); in this
# process the collector then walks the half-million objects of everything the suite imported (torch, transformers,
# Ray, Serve, the test libraries): about 0.3 s a collection, some forty seconds over the engine modules. Before each
# test they are moved out of its reach (the permanent generation, as the engine does with its own objects), so an
# engine's first collection walks only what the test made since. An engine's stop undoes it (it unfreezes all).
@pytest.fixture(autouse=True)
def _freeze_what_is_already_there():
    import gc

    gc.freeze()
    yield


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random GPT-2 / Llama (GQA) / Qwen2 / Qwen3 checkpoints written with save_pretrained."""
    from engine.testing import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {fam: str(build_tiny_checkpoint(fam, root / fam)) for fam in ("gpt2", "llama", "qwen2", "qwen3")}


# `serve run` stopped by SIGTERM and started again (tests/serve/test_shutdown.py) is two cold starts of a Ray cluster,
# most of a minute spent waiting on processes that start. It runs in a thread from the first test after the serving
# package (whose Ray cluster has stopped by then) beside the in-process tests, and its test goes last, to report it
# (KAIROS_TEST_SIGTERM_INLINE=1: in its place instead).
SIGTERM_TEST = "test_sigterm_stops_everything_and_the_same_port_serves_again"
_SERVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve")
# `make test` (tests/run.py) runs the suite in two pytest processes: the first runs the serving package, as one
# process does, and once the package's tests that must run alone (its modules' RUNS_ALONE) are done, says so by
# creating the file SERVE_DONE_ENV names; from then the second takes the other test files, and the first too once its
# package has ended, one file at a time, each claiming a file by creating its name in the directory CLAIMS_ENV names
# (a file's tests run in one process, in order, with its module's fixtures), so the core that one process left idle
# runs half of them.


def pytest_configure(config) -> None:
    # (taken out of the environment: a process a test starts is no part of the split)
    config._kairos_claims = os.environ.pop(CLAIMS_ENV, None)
    config._kairos_serve_done = os.environ.pop(SERVE_DONE_ENV, None)
    config._kairos_after = os.environ.pop(AFTER_ENV, None)


def _in_serve_package(item) -> bool:
    return os.path.dirname(os.path.abspath(str(item.path))) == _SERVE_DIR


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    last = [it for it in items if it.name == SIGTERM_TEST and _in_serve_package(it)]
    rest = [it for it in items if it not in last]
    after = [i for i, it in enumerate(rest) if _in_serve_package(it)]
    start = (after[-1] + 1) if after else 0  # the first test after the serving package
    moved = bool(last) and start < len(rest) and os.environ.get("KAIROS_TEST_SIGTERM_INLINE") != "1"
    if moved:
        items[:] = rest + last
    config._kairos_sigterm_moved = moved
    config._kairos_serve_left = len(after)  # the serving package's tests still to start (the moved one not counted)
    config._kairos_past_serve = False


def _signal_serve_done(config) -> None:
    """Tell the second process (tests/run.py) that it may take files now: once only."""
    if config._kairos_serve_done and not os.path.exists(config._kairos_serve_done):
        open(config._kairos_serve_done, "a").close()


def pytest_runtest_setup(item) -> None:
    config = item.config
    if _in_serve_package(item):
        if item.name != SIGTERM_TEST or not config._kairos_sigterm_moved:
            config._kairos_serve_left -= 1
        # the package's tests that need its cores to themselves (a module's RUNS_ALONE: latency under load, kills,
        # autoscaling on what is turned away) run first (tests/serve/conftest.py); the rest of it runs beside the
        # second process's files
        if "serve_app" in item.fixturenames and not getattr(item.module, "RUNS_ALONE", False):
            _signal_serve_done(config)
        return
    if config._kairos_serve_left > 0 or config._kairos_past_serve:
        return
    config._kairos_past_serve = True  # the first test after the serving package, whichever file it is in
    if config._kairos_sigterm_moved:
        from tests.serve import test_shutdown

        test_shutdown.start_in_background()
    _signal_serve_done(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """With CLAIMS_ENV set: run the serving package's tests and the other files this process claims (pytest's own
    loop, but over the files claimed as it goes; the next file is claimed before the last test of the one running,
    so that the test's teardown knows what comes next)."""
    claims = session.config._kairos_claims
    if not claims or session.config.option.collectonly:
        return None  # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    if session.config._kairos_after:
        _wait_for(session.config._kairos_after)
    todo = _claimed(session.items, claims, str(session.config.rootpath))
    item = next(todo, None)
    while item is not None:
        nextitem = next(todo, None)
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        item = nextitem
    return True


def _wait_for(path: str) -> None:
    """Until the file `path` exists (the first process's signal); a process whose parent is gone (tests/run.py,
    which stops it where no signal will come) exits instead of waiting on."""
    parent = os.getppid()
    print("[kairos tests] collected; waiting for the serving package's tests that run alone to end", file=sys.stderr,
          flush=True)
    while not os.path.exists(path):
        if os.getppid() != parent:
            pytest.exit("the process that started this one is gone", returncode=1)
        time.sleep(0.2)


def _claimed(items, claims: str, root: str):
    """`items` (in order) of the serving package and of the files this process claims as it reaches them."""
    for path, tests in itertools.groupby(items, key=lambda it: str(it.path)):
        tests = list(tests)
        name = os.path.relpath(path, root).replace(os.sep, "__")
        if _in_serve_package(tests[0]) or _claim(os.path.join(claims, name)):
            yield from tests


def _claim(marker: str) -> bool:
    """Whether this process claimed the file `marker` stands for (it created `marker`; another process did not)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def pytest_sessionfinish(session, exitstatus) -> None:
    mod = sys.modules.get("tests.serve.test_shutdown")
    if mod is not None:  # an interrupted session: let the scenario stop what it started
        mod.wait_for_background(120)
