"""LoRA adapters (engine.lora): PEFT adapters of tiny checkpoints, served beside the base model, give PEFT's own
replies token for token; their prefix cache is their own; what cannot be served as trained is refused."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from core.kv import BlockManager
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.lora import LoraError, LoraSpec
from engine.testing import build_tiny_lora
from scheduling.config import SchedulerConfig

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 99, 23, 41, 7, 300, 12] * 3, [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 200], list(range(40, 75))]
MAX_TOKENS = [12, 9, 14]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    """Per family: two adapters, `a` on every projection and `b` (rsLoRA, another rank) on three."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for fam in ("llama", "qwen2", "qwen3"):
        base = tiny_checkpoints[fam]
        out[fam] = {"a": str(build_tiny_lora(base, root / f"{fam}-a", seed=1)),
                    "b": str(build_tiny_lora(base, root / f"{fam}-b", seed=2, targets=("q_proj", "v_proj", "down_proj"),
                                             r=4, alpha=8, rslora=True))}
    return out


def _peft_greedy(base, adapter, prompts, max_tokens):
    """PEFT's own model (the base, or the base with the adapter unmerged) run greedily to each length."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model = model.eval()
    model.generation_config.eos_token_id = None  # run to length, like ignore_eos
    model.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for ids, k in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                                 do_sample=False)
            out.append(gen[0, len(ids):].tolist())
    return out


def _engine(base, adapters, **kw):
    sched = kw.pop("scheduler", SchedulerConfig(policy="fcfs", prefill_max_tokens=256))
    return LLMEngine(EngineConfig(model=base, dtype="float32", device="cpu", block_size=4, lora_modules=adapters,
                                  scheduler=sched, **kw))


def _run(eng, jobs):
    """jobs: (prompt, max_tokens, lora) all added at once; each one's tokens."""
    streams = [eng.add_request(p, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True), lora=lo)
               for p, k, lo in jobs]
    return [[t for o in s for t in o.token_ids] for s in streams]


@pytest.mark.parametrize("family,kw", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama", {"kernels": "off"}), ("llama", {"backend": "torch"}),
    ("llama", {"overlap": "on", "num_threads": 1}),
    ("llama", {"scheduler": SchedulerConfig(policy="fcfs", prefill_max_tokens=16, chunked_prefill=True)})])
def test_replies_through_adapters_equal_peft(tiny_checkpoints, adapters, family, kw):
    """Requests of the base model and of two adapters in the same steps (prefill and decode rows mixed): each reply
    is PEFT's, token for token."""
    base = tiny_checkpoints[family]
    want = {lo: _peft_greedy(base, adapters[family].get(lo), PROMPTS, MAX_TOKENS) for lo in (None, "a", "b")}
    assert want["a"] != want[None] and want["b"] != want[None]  # the adapters change the replies
    eng = _engine(base, adapters[family], **kw)
    try:
        jobs = [(p, k, lo) for lo in (None, "a", "b") for p, k in zip(PROMPTS, MAX_TOKENS)]
        got = _run(eng, jobs)
        for (p, k, lo), tokens in zip(jobs, got):
            assert tokens == want[lo][PROMPTS.index(p)], (lo, PROMPTS.index(p))
    finally:
        eng.shutdown()


def test_a_config_without_lora_alpha_scales_as_peft_s(tiny_checkpoints, adapters, tmp_path):
    """PEFT's LoraConfig default (lora_alpha 8) where adapter_config.json leaves it out."""
    from pathlib import Path

    base = tiny_checkpoints["llama"]
    src = Path(adapters["llama"]["a"])
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.pop("lora_alpha")
    dst = tmp_path / "no-alpha"
    dst.mkdir()
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    want = _peft_greedy(base, str(dst), PROMPTS[:1], [10])
    assert want != _peft_greedy(base, str(src), PROMPTS[:1], [10])  # (alpha 16 in the original)
    eng = _engine(base, {"x": str(dst)})
    try:
        assert _run(eng, [(PROMPTS[0], 10, "x")]) == want
    finally:
        eng.shutdown()


def test_prefix_cache_is_per_adapter_and_per_salt(tiny_checkpoints, adapters):
    """A prompt the base model cached is computed again through an adapter (and its reply is the adapter's), then
    found cached by the adapter's next request; a cache_salt likewise keeps its own."""
    base = tiny_checkpoints["llama"]
    prompt = PROMPTS[2]
    want = {lo: _peft_greedy(base, adapters["llama"].get(lo), [prompt], [6])[0] for lo in (None, "a")}
    eng = _engine(base, adapters["llama"])
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def one(**kw):
        items = list(eng.add_request(prompt, sp, **kw))
        return [t for o in items for t in o.token_ids], items[-1].metrics.num_cached_tokens

    try:
        assert one() == (want[None], 0)
        assert one() == (want[None], 32)  # (8 full blocks of 4; the last token is always computed)
        assert one(lora="a") == (want["a"], 0)
        assert one(lora="a") == (want["a"], 32)
        assert one(cache_salt="s1") == (want[None], 0)
        assert one(cache_salt="s1") == (want[None], 32)
        assert one(cache_salt="s2", lora="a") == (want["a"], 0)
        with pytest.raises(ValueError, match="no LoRA adapter named 'c'"):
            eng.add_request(prompt, sp, lora="c")
        with pytest.raises(ValueError, match="cache_salt"):
            eng.add_request(prompt, sp, cache_salt="")
    finally:
        eng.shutdown()


def test_block_manager_namespaces_share_only_their_own():
    bm = BlockManager(8, 2, caching=True)

    class Seq:
        def __init__(self):
            self.block_table = []

    ids = [1, 2, 3, 4, 5]
    a, b = Seq(), Seq()
    bm.ensure(a, 5)
    bm.register(a, ids, 0, 2, bm.root)
    bm.ensure(b, 5)
    ns_root = bm.root_of(("x",))
    assert bm.lookup(ids, 4, namespace=("x",)) == []
    tail = bm.register(b, ids, 0, 2, ns_root)
    assert tail is not None and [n.block for n in bm.lookup(ids, 4, namespace=("x",))] == b.block_table[:2]
    assert [n.block for n in bm.lookup(ids, 4)] == a.block_table[:2]
    assert bm.root_of(("x",)) is ns_root
    bm.free(b)
    bm.free(a)
    bm.clear_cache()  # every block uncached: the namespace is forgotten
    assert bm.num_cached == 0 and bm._roots == {}
    assert bm.lookup(ids, 4, namespace=("x",)) == []


def test_lora_spec_forms():
    import os

    assert LoraSpec.parse("a=/x, b=/y") == (LoraSpec("a", "/x"), LoraSpec("b", "/y"))
    assert LoraSpec.parse('[{"name": "a", "path": "/x"}]') == (LoraSpec("a", "/x"),)
    assert LoraSpec.parse({"a": "/x"}) == (LoraSpec("a", "/x"),)
    assert LoraSpec.parse({"name": "a", "path": "/x"}) == (LoraSpec("a", "/x"),)  # vLLM's one object
    assert LoraSpec.parse(["a=/x=y", '{"name": "b", "path": "/p,q"}']) == (LoraSpec("a", "/x=y"), LoraSpec("b", "/p,q"))
    assert LoraSpec.parse("a=rel") == (LoraSpec("a", os.path.abspath("rel")),)  # where the app is built
    # the validated form reads back the same, whatever the names
    cfg = EngineConfig(lora_modules={"name": "/x", "path": "/y", "b": "/z"})
    assert EngineConfig.model_validate(cfg.model_dump(mode="json", exclude_unset=True)).lora_paths() == \
        {"name": "/x", "path": "/y", "b": "/z"} == cfg.lora_paths()
    for bad, match in [("a", "name=path"), ("a=/x,a=/y", "more than once"), ("=/x", "empty"), ("[1]", "neither")]:
        with pytest.raises(LoraError, match=match):
            LoraSpec.parse(bad)


def _edited(src, dst, config=None, weights=None):
    """A copy of adapter `src` with its config updated by `config` and its weights by `weights(dict)`."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    w = load_file(str(src / "adapter_model.safetensors"))
    if weights is not None:
        weights(w)
    save_file(w, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_adapters_not_served_as_trained_are_refused(tiny_checkpoints, adapters, tmp_path):
    from pathlib import Path

    base = tiny_checkpoints["llama"]
    src = Path(adapters["llama"]["a"])

    def lm_head(w):
        w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)

    def shrink(w):
        key = next(k for k in w if "q_proj.lora_A" in k)
        w[key] = w[key][:, :32].contiguous()

    cases = [
        ({"use_dora": True}, None, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"bias": "all"}, None, "biases"),
        ({"alora_invocation_tokens": [5, 6]}, None, "activated LoRA"),
        ({"layer_replication": [[0, 2]]}, None, "layer replication"),
        ({"init_lora_weights": "pissa_niter_4"}, None, "changes the base weights"),
        ({"a_key_from_a_later_peft": {"on": 1}}, None, "a_key_from_a_later_peft"),
        (None, lm_head, "the LM head"),
        (None, shrink, "another model"),
    ]
    for i, (config, weights, match) in enumerate(cases):
        path = _edited(src, tmp_path / f"bad{i}", config, weights)
        with pytest.raises(ValueError, match=match):
            _engine(base, {"x": path})
    # keys that are set but change nothing served, and new keys left unset, load
    quiet = _edited(src, tmp_path / "quiet", {"lora_dropout": 0.1, "runtime_config": {"ephemeral_gpu_offload": False},
                                              "a_key_from_a_later_peft": None, "bias": "none"})
    _engine(base, {"q": quiet}).shutdown()
    with pytest.raises(ValueError, match="above max_lora_rank 4"):
        _engine(base, {"a": str(src)}, max_lora_rank=4)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        _engine(base, {"a": str(tmp_path)})
    cut = Path(_edited(src, tmp_path / "cut"))  # a truncated file: an error that names the adapter (a bare one)
    (cut / "adapter_model.safetensors").write_bytes((cut / "adapter_model.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="LoRA adapter .*cut.*do not read"):
        _engine(base, {"c": str(cut)})
    with pytest.raises(ValueError, match="Kairos's own decoder"):
        _engine(tiny_checkpoints["gpt2"], {"a": str(src)})
    with pytest.raises(ValueError, match="Kairos's own decoder"):
        _engine(base, {"a": str(src)}, model_impl="hf")


def test_adapters_of_a_folder_load_on_demand_and_the_idle_ones_unload(tiny_checkpoints, adapters, tmp_path):
    """Ray Serve LLM's multi-LoRA: a request names a folder of dynamic_lora_loading_path; it loads at the first such
    request; past max_loras the least recently used adapter no request holds is unloaded (and loads again, as a
    new namespace of the prefix cache, when named again). A folder that is no adapter fails its request alone."""
    import shutil

    base = tiny_checkpoints["llama"]
    root = tmp_path / "adapters"
    for name in ("a", "b"):
        shutil.copytree(adapters["llama"][name], root / name)
    # a folder named as an adapter of lora_modules is another adapter: the ingress names it `<model>:<folder>`
    eng = _engine(base, {"a": adapters["llama"]["b"]}, dynamic_lora_loading_path=str(root))
    try:
        want_b = _peft_greedy(base, adapters["llama"]["b"], PROMPTS[:1], [6])
        assert _run(eng, [(PROMPTS[0], 6, "a")]) == want_b
        assert _run(eng, [(PROMPTS[0], 6, "m:a")]) == _peft_greedy(base, adapters["llama"]["a"], PROMPTS[:1], [6])
    finally:
        eng.shutdown()
    root = tmp_path / "more"
    for name in ("a", "b"):
        shutil.copytree(adapters["llama"][name], root / name)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text('{"r": 8, "use_dora": true}')
    shutil.copytree(adapters["llama"]["a"], root / "cut")  # its weights cut short (an upload in progress)
    st = root / "cut" / "adapter_model.safetensors"
    st.write_bytes(st.read_bytes()[:200])
    want = {lo: _peft_greedy(base, adapters["llama"][lo], PROMPTS[:2], MAX_TOKENS[:2]) for lo in ("a", "b")}
    eng = _engine(base, {}, dynamic_lora_loading_path=str(root), max_loras=1)
    try:
        for lo in ("a", "b", "a"):
            assert _run(eng, [(p, k, lo) for p, k in zip(PROMPTS[:2], MAX_TOKENS[:2])]) == want[lo]
            assert eng.run_idle(lambda e: e.loras.loaded) == [lo]
            assert eng.run_idle(lambda e: e.runner.decoder.lora_stacks._key) is None  # (nothing stacked left over)
            assert eng.run_idle(lambda e: set(e.runner.decoder.lora_stacks._single) <= set(e.runner.decoder.loras))
        items = list(eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3), lora="broken"))
        assert items[-1].error is not None and "DoRA" in items[-1].error
        items = list(eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3), lora="cut"))
        assert "do not read" in items[-1].error and eng.is_alive()
        assert _run(eng, [(PROMPTS[1], 4, "b"), (PROMPTS[1], 4, None)])[0] == want["b"][1][:4]
        for bad in ("../a", "c", ".", "a/../b", "m:../a"):
            with pytest.raises(ValueError, match="no LoRA adapter named"):
                eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3), lora=bad)
    finally:
        eng.shutdown()


def test_the_check_before_a_run_time_load_refuses_what_a_load_refuses(tiny_checkpoints, adapters, tmp_path):
    """/v1/load_lora_adapter's check (`InputProcessor.check_lora`: the config, the tensors' names and shapes, none
    read in full) says what loading would."""
    from pathlib import Path

    src = Path(adapters["llama"]["a"])
    eng = _engine(tiny_checkpoints["llama"], {}, enable_lora=True, max_lora_rank=8)
    try:
        assert eng.inputs.check_lora("a", str(src)) == 8
        assert eng.inputs.check_lora("b", adapters["llama"]["b"]) == 4

        def lm_head(w):
            w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)

        def shrink(w):
            key = next(k for k in w if "q_proj.lora_A" in k)
            w[key] = w[key][:, :32].contiguous()

        def drop_b(w):
            del w[next(k for k in w if "o_proj.lora_B" in k)]

        def rank_0(w):
            for k in [k for k in w if "q_proj" in k]:
                w[k] = w[k][:0].contiguous() if "lora_A" in k else w[k][:, :0].contiguous()

        # (each of the last four passed the check, and the load then failed with a ZeroDivisionError, a ValueError,
        # an AttributeError, a re.error)
        for i, (config, weights, match) in enumerate([
                ({"use_dora": True}, None, "DoRA"), (None, lm_head, "LM head"), (None, shrink, "another model"),
                (None, drop_b, "lacks"), (None, rank_0, "rank 0"), ({"lora_alpha": "sixteen"}, None, "lora_alpha"),
                ({"alpha_pattern": ["q_proj"]}, None, "alpha_pattern"),
                ({"alpha_pattern": {"q_proj(": 4}}, None, "no regex")]):
            with pytest.raises(LoraError, match=match):
                eng.inputs.check_lora("x", _edited(src, tmp_path / f"bad{i}", config, weights))
        # PEFT serves an adapter saved with fan_in_fan_out true on Linear layers as with false (it sets it back)
        assert eng.inputs.check_lora("f", _edited(src, tmp_path / "fan", {"fan_in_fan_out": True})) == 8
        with pytest.raises(LoraError, match="no adapter_config.json"):
            eng.inputs.check_lora("x", str(tmp_path / "nowhere"))
        cut = Path(_edited(src, tmp_path / "cut"))
        st = cut / "adapter_model.safetensors"
        st.write_bytes(st.read_bytes()[:100])
        with pytest.raises(LoraError, match="do not read"):
            eng.inputs.check_lora("x", str(cut))
    finally:
        eng.shutdown()
    eng = _engine(tiny_checkpoints["llama"], {}, enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(LoraError, match="above max_lora_rank 4"):
            eng.inputs.check_lora("a", str(src))
    finally:
        eng.shutdown()


def test_adapters_loaded_at_run_time_and_loaded_again_in_place(tiny_checkpoints, adapters, tmp_path):
    """A request of an adapter loaded at run time brings its folder (`LoraSource`); a later load of that name (vLLM's
    load_inplace) serves the requests after it from the folder as it is then, while a request that holds the
    earlier load finishes on it, and an earlier load is unloaded once no request holds it."""
    import shutil

    from core.request import LoraSource

    base = tiny_checkpoints["llama"]
    folder = tmp_path / "rt"
    shutil.copytree(adapters["llama"]["a"], folder)
    want = {lo: _peft_greedy(base, adapters["llama"][lo], PROMPTS[:1], [24])[0] for lo in ("a", "b")}
    eng = _engine(base, {"s": adapters["llama"]["b"]}, enable_lora=True)

    def start(source, name="rt", k=24):
        return eng.add_request(PROMPTS[0], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True), lora=name,
                               lora_source=source)

    def loads():
        return eng.run_idle(lambda e: sorted(e.loras._names.values()))

    try:
        with pytest.raises(ValueError, match="no LoRA adapter named"):
            eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3), lora="rt")  # (not without its folder)
        assert [t for o in start(LoraSource(str(folder), 1), k=6) for t in o.token_ids] == want["a"][:6]
        held = start(LoraSource(str(folder), 1))
        first = next(iter(held))  # it runs: it holds the first load
        shutil.rmtree(folder)
        shutil.copytree(adapters["llama"]["b"], folder)  # the folder written again, then loaded in place
        again = [t for o in start(LoraSource(str(folder), 2)) for t in o.token_ids]
        assert first.token_ids + [t for o in held for t in o.token_ids] == want["a"]
        assert again == want["b"]
        assert loads() == ["rt", "s"]  # the first load went with the request that held it
        # a request sent before the later load, arriving after it, runs through the later one
        assert [t for o in start(LoraSource(str(folder), 1), k=6) for t in o.token_ids] == want["b"][:6]
        # an adapter of lora_modules loaded again at run time under its name, from another folder
        assert [t for o in start(LoraSource(adapters["llama"]["a"], 3), name="s", k=6) for t in o.token_ids] \
            == want["a"][:6]
        assert loads() == ["rt", "s"]
    finally:
        eng.shutdown()


def test_an_adapter_loads_beside_the_steps_while_its_requests_wait(tiny_checkpoints, adapters, tmp_path):
    """An adapter loaded on demand is read on the engine's loader thread: the running requests keep stepping while
    it loads (a base request runs to its end with the load held back), the requests that name it wait and then run
    through it, and one aborted while it waited ends then."""
    import shutil
    import threading
    import time

    base = tiny_checkpoints["llama"]
    root = tmp_path / "on-demand"
    shutil.copytree(adapters["llama"]["a"], root / "a")
    eng = _engine(base, {}, dynamic_lora_loading_path=str(root))
    gate, started = threading.Event(), threading.Event()
    decoder = eng.run_idle(lambda e: e.runner.decoder)
    build = decoder.build_lora

    def held_back(*args, **kw):
        started.set()
        gate.wait(60)
        return build(*args, **kw)

    decoder.build_lora = held_back
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        running = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        waits = eng.add_request(PROMPTS[0], greedy, lora="m:a")
        gone = eng.add_request(PROMPTS[0], greedy, lora="m:a", request_id="gone")
        assert started.wait(60)
        assert len([t for o in running for t in o.token_ids]) == 40 and not gate.is_set()
        t_end = time.monotonic() + 10
        while eng.stats().num_waiting != 2 and time.monotonic() < t_end:  # (the stats are published between steps)
            time.sleep(0.01)
        assert eng.stats().num_waiting == 2
        eng.abort("gone")
        gate.set()
        want = _peft_greedy(base, adapters["llama"]["a"], PROMPTS[:1], [6])[0]
        assert [t for o in waits for t in o.token_ids] == want
        last = list(gone)[-1]
        assert last.finished and last.finish_reason.value == "abort" and not last.token_ids
        assert eng.run_idle(lambda e: (e.loras.loaded, e.loras.loading, e._lora_waiting)) == (["m:a"], 0, {})
    finally:
        gate.set()
        eng.shutdown()


def test_a_lora_engine_s_latency_model_prices_the_adapters_of_a_step(tiny_checkpoints):
    """The profile of an engine that serves adapters times decode steps with rows of random adapters of
    max_lora_rank, and fits what they take more (`LatencyModel.lora_ms`); the scheduler reads it for the batch's
    adapters. Another engine's fit has no such price."""
    eng = _engine(tiny_checkpoints["llama"], {}, enable_lora=True, max_lora_rank=8)
    try:
        rep = eng.profile_report
        assert rep["lora_adapters"] == [1, 2, 4] and rep["n_lora"] > 0 and len(rep["lora_coef"]) == 3
        assert all(c >= 0 for c in eng.latency_model.lora_coef) and eng.latency_model.meta["lora"]
        assert eng.run_idle(lambda e: e.runner.decoder.loras) == {}  # (the probes' adapters are gone)
    finally:
        eng.shutdown()
    eng = _engine(tiny_checkpoints["llama"], {})
    try:
        assert not eng.latency_model.prices_adapters and "lora_coef" not in eng.profile_report
    finally:
        eng.shutdown()


def test_adapters_packed_alike_stack_as_packed_and_others_packed_again(tiny_checkpoints, adapters, tmp_path):
    """A step's adapters are stacked from their packed pairs as they are where packed alike (the CPU's packed GEMMs),
    else the stacked matrices are packed anew (here: one adapter's values all bf16's, packed compact, beside one
    packed as fp32): either way each reply is PEFT's."""
    from pathlib import Path

    base = tiny_checkpoints["llama"]
    rounded = _edited(Path(adapters["llama"]["a"]), tmp_path / "rounded",
                      weights=lambda w: w.update({k: v.bfloat16().float() for k, v in w.items()}))
    for names in (("a", "b"), ("a", "rounded")):
        paths = {"a": adapters["llama"]["a"], "b": adapters["llama"]["b"], "rounded": rounded}
        want = {lo: _peft_greedy(base, paths[lo], PROMPTS[:2], MAX_TOKENS[:2]) for lo in names}
        eng = _engine(base, {lo: paths[lo] for lo in names})
        try:
            jobs = [(p, k, lo) for lo in names for p, k in zip(PROMPTS[:2], MAX_TOKENS[:2])]
            got = _run(eng, jobs)
            assert got == [want[lo][i] for lo in names for i in range(2)]
            assert eng.run_idle(lambda e: e.runner.decoder.lora_stacks._key) is not None  # (steps stacked the two)
        finally:
            eng.shutdown()


class _FakeDecoder:
    """What `LoraRegistry` asks of a decoder, without tensors."""

    def __init__(self):
        self.loras = {}

    def build_lora(self, spec, adapter_id, max_rank):
        from engine.lora import LoraAdapter

        return LoraAdapter(adapter_id, spec.name, spec.path, 4)

    def install_lora(self, adapter):
        self.loras[adapter.id] = adapter
        return adapter

    def remove_lora(self, adapter_id):
        del self.loras[adapter_id]


def test_the_registry_serves_the_latest_load_and_unloads_what_no_request_holds(tmp_path):
    """Loads on the loader, in order: requests of a load wait for it or for a later one of the name; a later load
    replaces an earlier one (unloaded once no request holds it); a load no request waits for any more stays idle,
    and goes as idle ones go past max_loras."""
    from core.request import LoraSource
    from engine.lora import LoraRegistry

    jobs, done = [], []
    reg = LoraRegistry(_FakeDecoder(), {}, None, max_loras=1, max_rank=16, loader=jobs.append, post=done.append)
    v1, v2, v3 = (LoraSource(str(tmp_path / "x"), v) for v in (1, 2, 3))
    assert reg.acquire("x", v2) == ("x", v2) and reg.loading == 1
    assert reg.acquire("x", v1) == ("x", v2)  # an earlier load's request waits for the later one
    assert reg.acquire("x", v3) == ("x", v3) and reg.loading == 2  # a later load starts
    for job in jobs:
        job()
    first = reg.installed(done[0])
    assert set(reg.decoder.loras) == {first}  # no request held it (all aborted): idle
    last = reg.installed(done[1])
    assert last != first and set(reg.decoder.loras) == {last} and reg.loading == 0
    assert reg.acquire("x", v1) == reg.acquire("x", v3) == last  # held twice
    reg.release(last)
    v4 = LoraSource(str(tmp_path / "x"), 4)
    key = reg.acquire("x", v4)
    jobs[-1]()
    newest = reg.installed(done[-1])
    assert set(reg.decoder.loras) == {last, newest}  # the replaced load stays while a request holds it
    reg.release(last)
    assert set(reg.decoder.loras) == {newest} and key == ("x", v4)
    reg.acquire("y", LoraSource(str(tmp_path / "y"), 5))
    jobs[-1]()
    other = reg.installed(done[-1])
    assert set(reg.decoder.loras) == {other} and reg.loaded == ["y"]  # past max_loras 1: the idle one went


def test_a_folders_adapter_never_runs_through_a_run_time_load_of_its_name(tmp_path):
    """`<model>:<folder>` loaded at run time from another folder (vLLM's /v1/load_lora_adapter), then unloaded at the
    front: its requests (no run-time source any more) run through the folder's adapter, not the unloaded weights
    (they did until that load went idle past max_loras)."""
    from core.request import LoraSource
    from engine.lora import LoraRegistry

    (tmp_path / "d0").mkdir()
    (tmp_path / "d0" / "adapter_config.json").write_text("{}")
    reg = LoraRegistry(_FakeDecoder(), {}, str(tmp_path), max_loras=4, max_rank=16)
    run_time = reg.acquire("m:d0", LoraSource(str(tmp_path / "c"), 1))
    assert reg.decoder.loras[run_time].path == str(tmp_path / "c")
    folder = reg.acquire("m:d0")  # (unloaded at the front: a request brings no source)
    assert folder != run_time and reg.decoder.loras[folder].path == str(tmp_path / "d0")
    assert run_time in reg.decoder.loras  # (its request still holds it)
    reg.release(run_time)
    assert set(reg.decoder.loras) == {folder} and reg.acquire("m:d0") == folder


def test_an_adapter_whose_files_hang_fails_its_requests_at_its_deadline_and_later_loads_go_on(tiny_checkpoints,
                                                                                              adapters, tmp_path):
    """lora_load_timeout_s: a load stuck reading its files (a hung mount) fails the requests waiting for it as
    unavailable (503: retry) at its deadline, not never; a request after it loads the adapter again on a new loader
    thread and is served; what the stuck read brings when it ends is dropped."""
    import shutil
    import threading

    from core.messages import ErrorKind

    base = tiny_checkpoints["llama"]
    root = tmp_path / "adapters"
    shutil.copytree(adapters["llama"]["a"], root / "a")
    eng = _engine(base, {}, dynamic_lora_loading_path=str(root), lora_load_timeout_s=0.5)
    try:
        decoder = eng.run_idle(lambda e: e.loras.decoder)
        build, hung, calls = decoder.build_lora, threading.Event(), []

        def stuck_once(*args, **kw):
            calls.append(threading.current_thread().ident)
            if len(calls) == 1:
                hung.wait(30)  # (the first read hangs)
            return build(*args, **kw)

        decoder.build_lora = stuck_once
        items = list(eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3), lora="a"))
        assert items[-1].error_kind is ErrorKind.UNAVAILABLE and "lora_load_timeout_s" in items[-1].error
        # (the next loads get a minute: the loader thread runs at the lowest priority, and on a box whose cores
        # are busy its read may take longer than half a second)
        eng.run_idle(lambda e: setattr(e, "config", e.config.model_copy(update={"lora_load_timeout_s": 60.0})))
        want = _peft_greedy(base, adapters["llama"]["a"], PROMPTS[:1], [4])
        assert _run(eng, [(PROMPTS[0], 4, "a")]) == want  # loaded again, on a new thread
        assert len(calls) == 2 and calls[0] != calls[1]
        hung.set()  # the stuck read ends: dropped, nothing breaks
        assert _run(eng, [(PROMPTS[0], 4, "a")]) == want and eng.is_alive()
    finally:
        eng.shutdown()
