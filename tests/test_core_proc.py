"""The engine in its own process (`engine.core_proc`): the same tokens as the in-process engine, errors raised in
the caller, KV freed on abort, and a child that dies or fails to start reported, never hung on."""
import dataclasses
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from core.messages import ErrorKind, GenerateRequest
from core.request import FinishReason
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.core_proc import EngineCoreClient
from engine.engine import LLMEngine
from engine.errors import EngineDeadError
from scheduling.config import SchedulerConfig


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _config(path):
    return EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, num_threads=1, chat_template=TEMPLATE,
                        scheduler=SchedulerConfig(policy="fcfs", prefill_max_tokens=256))


def _greedy(i, n):
    return GenerateRequest(request_id=f"r{i}", prompt=f"hello number {i} " * (i + 1),
                           params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def _tokens(stream):
    outs = list(stream)
    return [t for o in outs for t in o.token_ids], outs[-1]


def _text(stream):
    return "".join(o.text for o in stream)


ENGINES = ("shared", "killed", "fatal", "hung", "stopped", "shut_down", "unloadable")


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, tmp_path_factory):
    """The module's engine processes, started from the module's start as many at a time as there are cores (each
    start is mostly its child importing torch and transformers, on one core): the shared client, one per test that
    ends its engine, the one that cannot load, and the parent process of
    `test_the_engine_process_exits_when_its_parent_dies`. Futures of clients by name, and that parent."""
    cfg = _config(tiny_checkpoints["llama"])
    script = tmp_path_factory.mktemp("parent") / "parent.py"
    script.write_text(
        "import sys, time, traceback\n"
        "class Spy:  # where torch is first looked for, other than by a check that it is installed\n"
        "    where = None\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        stack = traceback.extract_stack()[:-1]\n"
        "        if name == 'torch' and Spy.where is None and not any(f.name == 'find_spec' for f in stack):\n"
        "            Spy.where = ' < '.join(f'{f.filename}:{f.lineno}' for f in reversed(stack)\n"
        "                                   if not f.filename.startswith('<frozen'))\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import logging\n"
        "said = []  # what the client logged of its tokenizer's preload\n"
        "logging.getLogger('kairos.engine').addHandler(logging.Handler())\n"
        "logging.getLogger('kairos.engine').handlers[-1].emit = lambda r: said.append(r.getMessage())\n"
        "logging.getLogger('kairos.engine').setLevel(logging.INFO)\n"
        "from engine.config import EngineConfig\n"
        "from engine.core_proc import EngineCoreClient\n"
        f"c = EngineCoreClient(EngineConfig(model={tiny_checkpoints['llama']!r}, dtype='float32', num_threads=1))\n"
        "from core.messages import GenerateRequest\n"
        "from core.sampling import SamplingParams\n"
        "list(c.generate(GenerateRequest(request_id='a', prompt='hello there', params=SamplingParams(\n"
        "    max_tokens=4, temperature=0.8, seed=1, logprobs=2, prompt_logprobs=1))))  # outputs, with logprobs\n"
        "print(c.pid, 'torch' in sys.modules, Spy.where, *said, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with ThreadPoolExecutor(min(len(ENGINES), os.cpu_count() or 1)) as pool:  # more would only queue for cores
        futures: dict[str, Future] = {
            name: pool.submit(EngineCoreClient, EngineConfig(model="/nonexistent/model-dir") if name == "unloadable"
                              else cfg.model_copy(update={"step_timeout_s": 5.0}) if name in ("hung", "stopped")
                              else cfg) for name in ENGINES}
        try:
            yield futures, parent
        finally:
            parent.kill()
            parent.wait()
            parent.stdout.close()
            for f in futures.values():
                if f.exception() is None:
                    f.result().shutdown()


@pytest.fixture(scope="module")
def client(engines):
    return engines[0]["shared"].result()


def _wait_free(client, total, timeout=10.0):
    deadline = time.monotonic() + timeout
    while client.stats().kv_blocks_free != total and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.stats().kv_blocks_free


LENGTHS = (5, 17, 9, 30)


@pytest.fixture(scope="module")
def in_process(tiny_checkpoints):
    """What the in-process engine answers to `_greedy(i, n)` for each n of LENGTHS: (token ids, text)."""
    eng = LLMEngine(_config(tiny_checkpoints["llama"]))
    try:
        reqs = [_greedy(i, n) for i, n in enumerate(LENGTHS)]
        return [(_tokens(eng.generate(r))[0], _text(eng.generate(r))) for r in reqs]
    finally:
        eng.shutdown()


def test_same_tokens_as_the_in_process_engine(tiny_checkpoints, client, in_process):
    reqs = [_greedy(i, n) for i, n in enumerate(LENGTHS)]
    streams = [client.generate(r) for r in reqs]
    got = [_tokens(s) for s in streams]
    assert [g[0] for g in got] == [w[0] for w in in_process]
    assert all(g[1].finish_reason is FinishReason.LENGTH for g in got)
    assert [_text(client.generate(r)) for r in reqs] == [w[1] for w in in_process]
    assert client.model_name == tiny_checkpoints["llama"] and client.max_model_len > 0
    assert client.sampling_defaults == {}  # said by the child (CoreInfo): this checkpoint recommends none


def test_the_apps_chat_template_renders_chats(client):
    """vLLM's --chat-template: chats are rendered with it in place of the tokenizer's, by the client's tokenizer
    (the engine process's tokens are its caller's; an in-process engine's is set as the child's)."""
    from core.messages import ChatTurn

    assert client.inputs.render_chat([ChatTurn("user", "hi")]) == "[user] hi\n"


def test_each_item_counts_the_tokens_so_far_and_the_prompt(client):
    """The child ships a turn's token items as columns (`TokenDeltas`), the client makes them its streams' items:
    each says the reply's tokens so far and the prompt's, as in-process, and the last comes after every token."""
    req = _greedy(3, 12)
    prompt_len = client.inputs.process(req.prompt, req.params, None, req.request_id).num_prompt_tokens
    seen = 0
    for out in client.generate(req):
        seen += len(out.token_ids)
        assert (out.num_output_tokens, out.num_prompt_tokens) == (seen, prompt_len)
    assert out.finished and seen == 12


def test_logprobs_cross_the_process_beside_their_tokens(client, in_process):
    """A request's logprobs ride the child's token columns (`TokenDeltas.logprobs`) and its last item: every item's
    are its tokens', the token's text its own; a request beside it without logprobs gets none."""
    with_lp = dataclasses.replace(_greedy(1, 10), request_id="lp", params=SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3))
    streams = [client.generate(with_lp), client.generate(_greedy(3, 10))]
    outs = [list(s) for s in streams]
    assert [t for o in outs[0] for t in o.token_ids] == in_process[1][0][:10]
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids) for o in outs[0])
    lps = [x for o in outs[0] for x in o.logprobs]
    assert len(lps) == 10 and all(x.rank == 1 and len(x.top) == 3 and x.top[0][2] == x.logprob for x in lps)
    assert all(o.logprobs is None for o in outs[1])


def test_bad_input_is_a_value_error_in_the_caller(client):
    with pytest.raises(ValueError, match="must not be empty"):
        client.generate(GenerateRequest(request_id="bad", prompt="", params=SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="maximum context length"):
        client.generate(GenerateRequest(request_id="long", prompt=[1] * (client.max_model_len + 5),
                                        params=SamplingParams(max_tokens=2)))
    toks, last = _tokens(client.generate(_greedy(1, 3)))  # and it keeps serving
    assert len(toks) == 3 and last.finish_reason is FinishReason.LENGTH


# (a test that acts on a request in flight first holds the child's next step, the request's first, with
# `inject_fault(hang_s=...)`: the child works on while the test's thread waits to be scheduled, and would otherwise end
# a reply of a few hundred tokens within about a second)


def test_duplicate_request_id_is_refused_without_touching_the_first(client):
    client.inject_fault(hang_s=2.0)
    first = client.generate(_greedy(50, 40))
    dup = client.generate(_greedy(50, 4))
    out = dup.get(timeout=10)
    assert out.finished and out.error_kind is ErrorKind.INVALID_REQUEST and "duplicate" in out.error
    toks, last = _tokens(first)
    assert len(toks) == 40 and last.finish_reason is FinishReason.LENGTH


def test_abort_ends_the_stream_and_frees_its_kv(client):
    total = client.stats().kv_blocks_total
    client.inject_fault(hang_s=2.0)
    stream = client.generate(_greedy(7, 500))
    client.abort("r7")
    _, last = _tokens(stream)
    assert last.finish_reason is FinishReason.ABORT
    assert _wait_free(client, total) == total
    _tokens(client.generate(_greedy(8, 1)))  # (the hold, where the abort came before the request's first step)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(client):
    client.inject_fault(1)
    _, last = _tokens(client.generate(_greedy(9, 5)))
    assert last.finish_reason is FinishReason.ERROR and "injected fault" in last.error
    toks, last = _tokens(client.generate(_greedy(10, 4)))
    assert len(toks) == 4 and client.is_alive()


def test_a_dead_engine_process_fails_its_streams_and_refuses_new_requests(engines):
    c = engines[0]["killed"].result()
    try:
        c.inject_fault(hang_s=60.0)
        stream = c.generate(_greedy(3, 2000))
        os.kill(c._proc.pid, signal.SIGKILL)
        _, last = _tokens(stream)
        # the engine is gone, not a step of it: unavailable (503 and retry over HTTP), as a dead replica is
        assert last.finish_reason is FinishReason.ERROR and last.error_kind is ErrorKind.UNAVAILABLE
        assert not c.is_alive()
        with pytest.raises(EngineDeadError):
            c.generate(_greedy(4, 2))
    finally:
        c.shutdown()


def test_a_dead_engine_worker_ends_the_process_and_the_client_refuses_new_requests(engines):
    c = engines[0]["fatal"].result()
    try:
        c.inject_fault(1, fatal=True)  # (the request's first step breaks the worker's loop)
        stream = c.generate(_greedy(3, 2000))
        _, last = _tokens(stream)
        assert last.finish_reason is FinishReason.ERROR
        assert c._proc.wait(30) is not None  # the child hung up and exited
        deadline = time.monotonic() + 10
        while c.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not c.is_alive() and not c.stats().alive
        with pytest.raises(EngineDeadError):
            c.generate(_greedy(4, 2))
    finally:
        c.shutdown()


def test_a_hung_engine_process_exits_and_its_client_fails_the_streams_as_unavailable(engines):
    """The child's watchdog (step_timeout_s) ends a process whose worker is stuck in a step: the client fails
    what was open as unavailable, says why, and refuses new requests."""
    c = engines[0]["hung"].result()
    try:
        c.inject_fault(hang_s=120.0)  # the next step hangs: this request's first
        stream = c.generate(_greedy(3, 2000))
        t0 = time.monotonic()
        _, last = _tokens(stream)
        assert time.monotonic() - t0 < 60.0  # the watchdog, not the step's end
        assert last.finish_reason is FinishReason.ERROR and last.error_kind is ErrorKind.UNAVAILABLE
        assert "hung" in last.error
        assert c._proc.wait(10) == 75  # HUNG_EXIT_CODE
        assert not c.is_alive() and "hung" in c.dead_reason()
        with pytest.raises(EngineDeadError, match="hung"):
            c.generate(_greedy(4, 2))
    finally:
        c.shutdown()


def test_a_stopped_engine_process_is_killed_and_its_streams_fail_as_unavailable(engines):
    """A child that runs no Python (stopped here; or stuck in a call that holds its interpreter, where its own
    watchdog cannot run) misses its heartbeats: past step_timeout_s the client kills it and fails its streams."""
    c = engines[0]["stopped"].result()
    try:
        os.kill(c._proc.pid, signal.SIGSTOP)
        stream = c.generate(_greedy(3, 2000))
        # sending never waits for the child to read (a Serve replica sends on its event loop): far more than the
        # socket holds is sent, each call returning, while the child is still stopped
        ids = tuple(range(5, 205))
        more = [c.generate(GenerateRequest(request_id=f"bulk{i}", prompt=ids, params=SamplingParams(max_tokens=2)))
                for i in range(1500)]
        assert c._proc.poll() is None and c._conn._backlog
        t0 = time.monotonic()
        _, last = _tokens(stream)
        assert time.monotonic() - t0 < 60.0
        assert last.finish_reason is FinishReason.ERROR and last.error_kind is ErrorKind.UNAVAILABLE
        assert "sent nothing" in last.error
        assert all(_tokens(s)[1].error_kind is ErrorKind.UNAVAILABLE for s in more)
        assert c._proc.wait(10) == -signal.SIGKILL
        assert not c.is_alive()
        with pytest.raises(EngineDeadError, match="sent nothing"):
            c.generate(_greedy(4, 2))
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def parent_said(engines) -> tuple[int, bool, str]:
    """What the parent process printed once its client was up: its engine process's pid, whether the parent
    imported torch, and the stack that first imported it ("None") with what the client logged of its tokenizer."""
    pid, torch_imported, where = engines[1].stdout.readline().split(maxsplit=2)
    return int(pid), torch_imported == "True", where.strip()


def test_a_client_whose_tokenizer_is_a_generic_fast_one_imports_no_torch(parent_said):
    """A process that drives an engine in a child (a Serve replica) needs no torch: the client's tokenizer (the
    checkpoint's generic fast one) is loaded without AutoTokenizer, which imports it, and nothing the child sends
    (its setup, a reply with log-probabilities) holds a torch object."""
    assert parent_said[1] is False, f"torch imported at {parent_said[2]}"


def test_the_engine_process_exits_when_its_parent_dies(engines, parent_said):
    """A parent killed outright (no shutdown, no socket close by Python) leaves no engine process behind."""
    parent = engines[1]
    child = parent_said[0]
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 15
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_model_that_cannot_load_raises_value_error_from_the_child(engines):
    with pytest.raises(ValueError, match="cannot load model"):
        engines[0]["unloadable"].result()


def test_shutdown_aborts_what_is_in_flight(engines):
    c = engines[0]["shut_down"].result()
    c.inject_fault(hang_s=2.0)
    stream = c.generate(_greedy(5, 2000))
    c.shutdown()
    _, last = _tokens(stream)
    assert last.finished and last.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
    assert c._proc.poll() is not None and not c.is_alive()


def test_unnice_undoes_the_calling_threads_nice_value_only() -> None:
    """`unnice` (the engine process's thread, and a replica's event-loop thread with `loop_priority=engine`)
    lowers the calling thread's nice value to 0 where it may, and leaves the process's other threads alone."""
    import threading

    from engine.core_proc import unnice

    before = os.getpriority(os.PRIO_PROCESS, 0)
    low = min(19, max(before, 0) + 5)  # raising one's own nice value needs no privilege
    seen: dict[str, int] = {}

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, low)  # this thread only (Linux: a nice value is a thread's)
        seen["was"] = unnice()
        seen["now"] = os.getpriority(os.PRIO_PROCESS, 0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    if os.geteuid() == 0:  # may lower a nice value
        assert seen == {"was": low, "now": 0}
    else:
        assert seen == {"was": 0, "now": low}


def test_a_client_reading_on_an_event_loop_streams_the_same_tokens_and_fails_streams_of_a_dead_engine(
        tiny_checkpoints, in_process):
    """`reader_loop` (how a Serve replica runs its engine): the engine's outputs are read on the caller's asyncio
    loop, built from another thread as the replica does. Awaiting readers get the same tokens as the reader
    thread's; a killed engine process ends what is open as unavailable; shutdown ends what is left."""
    import asyncio

    reqs = [_greedy(i, n) for i, n in enumerate(LENGTHS[:3])]

    async def collect(stream):
        toks, last = [], None
        async for out in stream:
            toks += out.token_ids
            last = out
        return toks, last

    async def main():
        loop = asyncio.get_running_loop()
        c = await asyncio.to_thread(EngineCoreClient, _config(tiny_checkpoints["llama"]), reader_loop=loop)
        try:
            assert c._reader is None
            got = await asyncio.gather(*(collect(c.generate(r)) for r in reqs))
            c.inject_fault(hang_s=60.0)
            long = c.generate(_greedy(3, 2000))
            os.kill(c._proc.pid, signal.SIGKILL)
            _, last = await asyncio.wait_for(collect(long), 30)
            with pytest.raises(EngineDeadError):
                c.generate(_greedy(4, 2))
            return got, last
        finally:
            c.shutdown()

    got, last = asyncio.run(main())
    assert [g[0] for g in got] == [w[0] for w in in_process[:3]]
    assert all(g[1].finish_reason is FinishReason.LENGTH for g in got)
    assert last.finish_reason is FinishReason.ERROR and last.error_kind is ErrorKind.UNAVAILABLE


def test_shutdown_of_a_client_reading_on_an_event_loop_ends_what_is_in_flight(tiny_checkpoints):
    import asyncio

    async def main():
        c = EngineCoreClient(_config(tiny_checkpoints["llama"]), reader_loop=asyncio.get_running_loop())
        c.inject_fault(hang_s=2.0)
        stream = c.generate(_greedy(5, 2000))
        c.shutdown()
        last = None
        async for out in stream:
            last = out
        return c, last

    c, last = asyncio.run(main())
    assert last.finished and last.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
    assert c._proc.poll() is not None and not c.is_alive()


def test_shutdown_on_the_loop_that_reads_the_engine_reads_what_it_flushes_as_it_stops(tiny_checkpoints):
    """Serve runs a replica's destructor, and so its engine's shutdown, on the loop that reads the engine. The child
    sends each open request's last item as it stops (each with its token times): past the socket's buffer its send
    blocked while the shutdown waited for it to exit, and at the timeout it was killed, every request failing as an
    engine failure. Read meanwhile, they end aborted at once."""
    import asyncio

    async def main():
        c = await asyncio.to_thread(EngineCoreClient, _config(tiny_checkpoints["llama"]),
                                    reader_loop=asyncio.get_running_loop())
        streams = [c.generate(GenerateRequest(request_id=f"s{i}", prompt="hello there ", params=SamplingParams(
            max_tokens=480, temperature=0.0, ignore_eos=True))) for i in range(64)]
        counts, lasts = [0] * 64, [None] * 64

        async def read(i, stream):
            async for out in stream:
                counts[i] += len(out.token_ids)
                lasts[i] = out

        tasks = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
        deadline = time.monotonic() + 120
        while min(counts) < 400 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        c.shutdown(timeout=30.0)  # (on the loop's thread)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return c, counts, lasts

    c, counts, lasts = asyncio.run(main())
    assert c._proc.returncode == 0, c._proc.returncode  # it exited: not killed
    # a request the engine ended before the shutdown (its reader behind, on a loaded box) ends as it ended
    ends = {(last.finish_reason, last.error) for n, last in zip(counts, lasts) if n < 480}
    assert ends <= {(FinishReason.ABORT, "engine shut down")}, ends
    assert all(last.finish_reason == FinishReason.LENGTH for n, last in zip(counts, lasts) if n == 480)


def test_the_client_preloads_the_tokenizer_the_child_loads_and_no_other(tiny_checkpoints, tmp_path):
    """While the child starts, the client loads the tokenizer from where the child's loader will (a directory
    that exists already: nothing is built or downloaded for it), and keeps it only if the child's came from there,
    of the same class (a generic fast tokenizer is loaded without AutoTokenizer, which may choose another class)."""
    from transformers import AutoTokenizer

    from engine.core_proc import _TokenizerPreload
    from engine.default_model import is_complete, model_dir
    from engine.loader import load_model
    from engine.tokenizer_files import class_name, ready_tokenizer_dir

    path = tiny_checkpoints["llama"]
    here = os.path.abspath(path)
    assert ready_tokenizer_dir(path) == here == load_model(path, dtype="float32", device="cpu").tokenizer_path
    assert ready_tokenizer_dir("some-org/some-model") is None  # a hub id: the client loads it once the child has
    assert ready_tokenizer_dir(str(tmp_path / "missing")) is None
    assert ready_tokenizer_dir("some-org/some-model", tokenizer=path) == here  # a tokenizer of its own wins
    tiny = model_dir("kairos-tiny")
    assert ready_tokenizer_dir("kairos-tiny") == (str(tiny) if is_complete(tiny) else None)
    auto = AutoTokenizer.from_pretrained(path)
    tok = _TokenizerPreload(_config(path)).result(here, class_name(auto))
    assert tok is not None and tok("hello number 3").input_ids == auto("hello number 3").input_ids
    assert _TokenizerPreload(_config(path)).result(str(tmp_path), class_name(auto)) is None  # from elsewhere
    assert _TokenizerPreload(_config(path)).result(here, "transformers.SomeOtherTokenizer") is None
    assert _TokenizerPreload(_config("some-org/some-model")).result("some-org/some-model", class_name(auto)) is None
    # a Qwen2 checkpoint's config names the generic class, and AutoTokenizer builds Qwen2's own from it
    qwen2 = os.path.abspath(tiny_checkpoints["qwen2"])
    assert class_name(AutoTokenizer.from_pretrained(qwen2)) != class_name(auto)
    assert _TokenizerPreload(_config(qwen2)).result(qwen2, class_name(AutoTokenizer.from_pretrained(qwen2))) is None


def test_a_generic_fast_tokenizer_loads_without_auto_tokenizer_and_others_do_not(tiny_checkpoints, tmp_path):
    """`tokenizer_files.load_light`: the class AutoTokenizer builds from the same files (a Llama checkpoint's,
    the embedded models'), the same ids, specials and chat template; None for a config naming another class or code
    of its own, or with no tokenizer.json."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from engine.default_model import ensure_default_model
    from engine.tokenizer_files import class_name, load_light

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for path in (tiny_checkpoints["llama"], str(ensure_default_model("kairos-tiny"))):
        light, auto = load_light(path), AutoTokenizer.from_pretrained(path)
        assert class_name(light) == class_name(auto)
        assert light("hello number 3 <|im_end|>").input_ids == auto("hello number 3 <|im_end|>").input_ids
        assert light.all_special_ids == auto.all_special_ids and light.eos_token_id == auto.eos_token_id
        assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    src = tiny_checkpoints["llama"]
    for name, edit in (("other", {"tokenizer_class": "GPT2Tokenizer"}),
                       ("code", {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}})):
        shutil.copytree(src, tmp_path / name)
        cfg_path = tmp_path / name / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **edit}))
        assert load_light(str(tmp_path / name)) is None
    shutil.copytree(src, tmp_path / "no-json")
    (tmp_path / "no-json" / "tokenizer.json").unlink()
    assert load_light(str(tmp_path / "no-json")) is None
    assert load_light(str(tmp_path / "missing")) is None


def test_reconfigure_is_checked_in_the_caller_and_swaps_the_childs_scheduler(client):
    """`EngineCoreClient.reconfigure`: a bad knob is a ValueError here, sent nowhere; a good one reaches the child,
    whose stats say once its scheduler runs the new policy; the tokens are the same under either."""
    with pytest.raises(ValueError, match="max_num_seqs"):
        client.reconfigure({"max_num_seqs": 3})
    want = _tokens(client.generate(_greedy(0, 9)))[0]
    assert client.reconfigure({"policy": "edf"}).policy == "edf"
    try:
        deadline = time.monotonic() + 10
        while client.stats().policy != "edf" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().policy == "edf"
        assert _tokens(client.generate(_greedy(0, 9)))[0] == want
    finally:
        client.reconfigure({})
        deadline = time.monotonic() + 10
        while client.stats().policy != "fcfs" and time.monotonic() < deadline:
            time.sleep(0.05)
    assert client.stats().policy == "fcfs"


def test_a_change_the_child_cannot_take_leaves_the_fronts_ranking_as_the_childs(client, tmp_path):
    """A change the caller's check passes but the child cannot take (here its length predictor file is gone by then;
    the caller read it from its own copy) leaves the child's scheduler as it was: the front's requests then keep
    that scheduler's ranking (they took the asked one's, priority scheduling, for good)."""
    import shutil

    from scheduling.length_predictor import DEFAULT_PATH, load_cached

    path = tmp_path / "lengths.npz"
    shutil.copy(DEFAULT_PATH, path)
    load_cached(str(path))
    path.unlink()
    params = SamplingParams(max_tokens=2)
    assert client.inputs.process([1, 2, 3], params, None, None, priority=5).priority == 0
    client.reconfigure({"scheduling_policy": "priority", "length_predictor_path": str(path)})
    deadline = time.monotonic() + 10
    while client.stats().reconfigures != client._reconfigures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats().reconfigures == client._reconfigures
    assert client.inputs.process([1, 2, 3], params, None, None, priority=5).priority == 0
    assert client.stats().policy == "fcfs" and not client.stats().priority_scheduling


def test_a_turns_first_tokens_are_delivered_before_the_other_streams_tokens():
    """The client hands a turn's first tokens (a reply's token 1) to their streams before the rest, so that the
    readers they wake go first in the event loop's queue; a request's later tokens still come after its first, and
    each stream gets its own tokens in order."""
    import threading

    from engine.core_messages import Outputs, TokenDeltas

    got: list[tuple[str, int]] = []

    class Stream:
        def put_token(self, rid, text, tok, n_in, n_out, logprobs=None, prompt_logprobs=None, at=None):
            got.append((rid, n_out))

        def put(self, item, at=None):
            got.append((item.request_id, -1))

    client = object.__new__(EngineCoreClient)
    client._lock = threading.Lock()
    client._streams = {rid: Stream() for rid in ("a", "b", "c", "d")}
    client._stats = None
    t = TokenDeltas(["a", "b", "c", "b", "d"], ["x"] * 5, [7] * 5, [3] * 5, [5, 1, 9, 2, 1])
    client._deliver(Outputs(tokens=t))
    assert got == [("b", 1), ("d", 1), ("a", 5), ("c", 9), ("b", 2)]
    got.clear()
    client._deliver(Outputs(tokens=TokenDeltas(["a", "c"], ["x"] * 2, [7] * 2, [3] * 2, [6, 10])))
    assert got == [("a", 6), ("c", 10)]  # none first: in the turn's order


def test_tokens_from_the_engine_process_are_timed_when_it_sent_them_not_when_the_client_read_them():
    """A replica's TTFT and ITL read its streams' put times: the client puts a turn's items at the child's send time
    (`Outputs.sent_s`; the host's one monotonic clock), so a client loop that fell behind does not fold its own
    delay into them (three turns read at once were three tokens of one instant)."""
    import threading

    from core.messages import RequestOutput
    from engine.core_messages import Outputs, TokenDeltas
    from engine.stream import RequestStream

    client = object.__new__(EngineCoreClient)
    client._lock = threading.Lock()
    stream = RequestStream("a")
    stream.track_token_times()
    client._streams = {"a": stream}
    client._stats = None
    for n, sent in ((1, 10.0), (2, 10.02), (3, 10.3)):
        client._deliver(Outputs(tokens=TokenDeltas(["a"], ["x"], [7], [3], [n]), sent_s=sent))
    client._deliver(Outputs(items=[RequestOutput("a", "y", [8], finished=True, finish_reason="length",
                                                 num_output_tokens=4)], sent_s=10.31))
    assert stream.get(timeout=1).token_ids == [7, 7, 7, 8]
    assert stream.take_token_times() == [(10.0, 1), (10.02, 1), (10.3, 1), (10.31, 1)]


def test_a_queued_link_on_a_high_descriptor_sends_in_order_without_waiting_for_its_reader():
    """The client's end (`Link(queued=True)`): sends return while the reader reads nothing, far past what the socket
    holds, and the reader then gets every message whole and in order; on a descriptor past 1023 too (a Ray worker
    holds hundreds of files: select refuses those, poll does not)."""
    import resource
    import socket
    import threading

    from engine.core_proc import Link

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1500:
        pytest.skip("the process may not open a descriptor past 1500")
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1500)
    a.close()
    ours, theirs = Link(socket.socket(fileno=high), queued=True), Link(b)
    try:
        msgs = [("m", i, "x" * 4000) for i in range(400)]  # 1.6 MB
        for m in msgs:
            ours.send(m)
        assert ours._backlog  # (most of it waits for the reader)
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(theirs.recv() for _ in msgs))
        reader.start()
        reader.join(30)
        assert got == msgs
        assert theirs.poll(0.0) is False and ours.poll(0.0) is False
        theirs.sock.sendall(Link.HEADER.pack(1) + b"x")  # (a byte: readable now)
        assert ours.poll(1.0) is True
    finally:
        ours.close()
        theirs.close()


def test_the_first_item_says_where_the_prompt_leaves_the_thinking(client, tiny_checkpoints):
    """Asked (`read_thinking`: the app reads a reasoning model's thinking), the replica's stream says where the
    rendered prompt leaves the thinking: open (a template that opened `<think>`), closed (one that switched it off),
    or neither; in the engine process's client as in-process."""
    from core.messages import ChatTurn, GenerateRequest, PromptOptions

    ends = {"<think>\n": "open", "<think>\n\n</think>\n\n": "closed", "": None}
    eng = LLMEngine(_config(tiny_checkpoints["llama"]))
    try:
        for engine in (client, eng):
            for end, want in ends.items():
                options = PromptOptions(chat_template="{{ messages[0]['content'] }}" + end)
                for read in (True, False):
                    req = GenerateRequest(f"think-{len(end)}-{read}", messages=[ChatTurn("user", "hi")],
                                          options=options, params=SamplingParams(max_tokens=1), read_thinking=read)
                    stream = engine.generate(req)
                    assert stream.prompt_thinking == (want if read else None), (engine, end, read)
                    _tokens(stream)
    finally:
        eng.shutdown()
