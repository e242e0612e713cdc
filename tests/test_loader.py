"""Model loading and the embedded random-weight models (offline). The trained default: test_trained_model.py."""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from engine import default_model as dm
from engine.default_model import RANDOM_MODELS, build_model_dir, ensure_default_model
from engine.file_lock import lock_path
from engine.backends.cpu.matmul import cpu_has_native_half
from engine.loader import ModelBundle, load_model, resolve_device, resolve_dtype
from engine.testing import TINY_VOCAB, build_tiny_checkpoint

TEXT = "héllo wörld ✓ 你好 🎉"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kairos_cache")


@pytest.fixture(autouse=True)
def _kairos_cache(cache_root, monkeypatch):
    monkeypatch.setenv("KAIROS_CACHE", str(cache_root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def default_bundle(cache_root) -> ModelBundle:
    os.environ["KAIROS_CACHE"] = str(cache_root)  # module fixtures run outside monkeypatch
    try:
        return load_model("kairos-random-42m")
    finally:
        os.environ.pop("KAIROS_CACHE", None)


# --------------------------------------------------------------------------- embedded models


def test_embedded_tiny_builds_once_and_reloads_identically(cache_root):
    rng_before = torch.get_rng_state()
    path = ensure_default_model("kairos-tiny")
    assert torch.equal(torch.get_rng_state(), rng_before)  # the build does not disturb the caller's RNG
    assert path.parent == cache_root and path.name.startswith("kairos-tiny-")
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_default_model("kairos-tiny") == path
    assert weights.stat().st_mtime_ns == mtime  # second call did not rebuild
    assert not [p for p in cache_root.iterdir() if ".tmp-" in p.name]  # no temp dirs left

    a, b = load_model("kairos-tiny", device="cpu"), load_model("kairos-tiny", device="cpu")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.path == str(path) and a.name == "kairos-tiny"
    cfg = a.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 8192)
    assert a.max_model_len == 1024 and a.dtype == resolve_dtype("auto", "cpu") and a.device == torch.device("cpu")
    assert not a.model.training and not any(p.requires_grad for p in a.model.parameters())
    assert 4.9e6 < sum(p.numel() for p in a.model.parameters()) < 5.2e6


def test_embedded_build_is_byte_deterministic(cache_root, tmp_path):
    cached = ensure_default_model("kairos-tiny")
    fresh = build_model_dir("kairos-tiny", tmp_path / "fresh")
    for f in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (cached / f).read_bytes() == (fresh / f).read_bytes(), f


def test_recipe_change_gives_a_new_directory(monkeypatch):
    before = dm.model_dir("kairos-tiny")
    monkeypatch.setattr(dm, "RECIPE_VERSION", dm.RECIPE_VERSION + 1)
    assert dm.model_dir("kairos-tiny") != before
    assert dm.model_dir("kairos-tiny", "/somewhere").parent == Path("/somewhere")


def test_lost_build_race_uses_the_winner(tmp_path, monkeypatch):
    root = tmp_path / "race"
    target = dm.model_dir("kairos-tiny", root)
    real_build = dm.build_model_dir

    def build_and_lose(name, out):  # another process publishes the target while we build
        real_build(name, target)
        return real_build(name, out)

    monkeypatch.setattr(dm, "build_model_dir", build_and_lose)
    assert ensure_default_model("kairos-tiny", root) == target
    assert sorted(p.name for p in root.iterdir()) == sorted([target.name, lock_path(target).name])  # no temp dir
    assert (target / "model.safetensors").is_file()


def test_embedded_random_42m_model(default_bundle):
    b = default_bundle
    cfg = b.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        512, 8, 8, 8
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1408, 32000, 2048)
    assert cfg.tie_word_embeddings
    n = sum(p.numel() for p in b.model.parameters())
    assert 42.0e6 < n < 42.2e6
    assert b.max_model_len == 2048
    with torch.no_grad():
        logits = b.model(torch.tensor([b.tokenizer.encode(TEXT)])).logits
    assert logits.shape[-1] == 32000 and torch.isfinite(logits).all()
    assert logits.float().std() > 0  # not degenerate


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_embedded_vocab_limit_and_special_ids(name, default_bundle):
    b = default_bundle if name == "kairos-random-42m" else load_model(name)
    tok = b.tokenizer
    assert b.vocab_limit == len(tok) < b.config.vocab_size
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == eot
    assert b.config.eos_token_id == b.config.bos_token_id == b.config.pad_token_id == eot
    assert b.eos_token_ids == [eot, im_end]


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_tokenizer_round_trip_and_streaming(name, default_bundle):
    from tokenizers.decoders import DecodeStream

    tok = default_bundle.tokenizer if name == "kairos-random-42m" else load_model(name).tokenizer
    assert tok.is_fast
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    stream = DecodeStream(skip_special_tokens=True)
    pieces = [stream.step(tok.backend_tokenizer, i) for i in ids]
    assert "".join(p for p in pieces if p) == TEXT
    assert None in pieces  # multi-byte characters are split across tokens and held back


def test_chat_template_renders():
    tok = load_model("kairos-tiny").tokenizer
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ✓<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n") and "assistant" not in no_prompt
    ids = tok.encode(text, add_special_tokens=False)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # special tokens are single ids
    assert tok.decode(ids) == text


# --------------------------------------------------------------------------- tiny checkpoints


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_tiny_checkpoints_load_and_run(family, tiny_checkpoints):
    b = load_model(tiny_checkpoints[family], device="cpu")
    assert b.config.model_type == family
    assert b.vocab_limit == len(b.tokenizer) == b.config.vocab_size == TINY_VOCAB
    assert b.max_model_len == 512 and b.dtype == resolve_dtype("auto", "cpu")
    assert 0 in b.eos_token_ids
    ids = b.tokenizer.encode(TEXT, add_special_tokens=False)
    assert b.tokenizer.decode(ids) == TEXT
    with torch.no_grad():
        logits = b.model(torch.tensor([ids, ids])).logits
    assert logits.shape == (2, len(ids), TINY_VOCAB)
    assert torch.isfinite(logits).all()
    if family != "gpt2":
        attn = b.model.model.layers[0].self_attn
        assert attn.k_proj.out_features == 2 * attn.head_dim  # GQA: 2 kv heads
        assert (attn.q_proj.bias is not None) == (family == "qwen2")


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a = build_tiny_checkpoint("llama", tmp_path / "a", seed=0)
    b = build_tiny_checkpoint("llama", tmp_path / "b", seed=0)
    c = build_tiny_checkpoint("llama", tmp_path / "c", seed=1)
    wa, wb, wc = ((p / "model.safetensors").read_bytes() for p in (a, b, c))
    assert wa == wb and wa != wc
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_max_model_len_and_dtype_options(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    b = load_model(path, max_model_len=100, dtype="bf16")
    assert b.max_model_len == 100
    assert b.dtype == torch.bfloat16 and next(b.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="exceeds the model's maximum context of 512"):
        load_model(path, max_model_len=513)


def _with_config(src: str, dst, **changes) -> str:
    """A copy of checkpoint `src` at `dst` with `changes` written into its config.json (the weights unchanged)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_a_sliding_window_caps_the_context_where_full_attention_equals_it(tiny_checkpoints, tmp_path):
    """Kairos attends to the whole context: a model whose layers attend within a window of W tokens is served up to W
    tokens (where the two agree exactly), and a larger max_model_len is refused by name; a window the config turns
    off (Qwen2's use_sliding_window false), or one at least the model's positions, changes nothing."""
    from engine.loader import sliding_window

    mistral = _with_config(tiny_checkpoints["llama"], tmp_path / "mistral", model_type="mistral",
                           architectures=["MistralForCausalLM"], sliding_window=64)
    b = load_model(mistral, device="cpu")
    assert sliding_window(b.config) == 64 and b.max_model_len == 64
    assert load_model(mistral, device="cpu", max_model_len=48).max_model_len == 48
    with pytest.raises(ValueError, match="exceeds model .*sliding attention window of 64 tokens"):
        load_model(mistral, max_model_len=65)
    wide = _with_config(tiny_checkpoints["llama"], tmp_path / "wide", model_type="mistral",
                        architectures=["MistralForCausalLM"], sliding_window=4096)
    assert load_model(wide, device="cpu").max_model_len == 512
    off = _with_config(tiny_checkpoints["qwen2"], tmp_path / "off", use_sliding_window=False, sliding_window=64)
    assert sliding_window(load_model(off, device="cpu").config) is None
    on = _with_config(tiny_checkpoints["qwen2"], tmp_path / "on", use_sliding_window=True, sliding_window=64,
                      max_window_layers=1, layer_types=None)  # a checkpoint saved before layer_types
    assert load_model(on, device="cpu").max_model_len == 64
    # a family whose attention never reads the key (Llama's, as HF's and vLLM's): its whole context
    stray = _with_config(tiny_checkpoints["llama"], tmp_path / "stray", sliding_window=64)
    assert load_model(stray, device="cpu").max_model_len == 512 and load_model(stray, max_model_len=512)


def test_a_rope_scaling_that_extends_the_positions_extends_the_context(tiny_checkpoints, tmp_path):
    """As vLLM derives a model's context: YaRN's original positions times its factor (Qwen2.5's long-context set-up
    adds YaRN to a config of 32,768 positions: 131,072), linear's positions times its factor; Llama 3's config gives
    its extended positions already, and dynamic NTK stays at the config's. (The tables there: transformers' own, as
    `test_our_loader_builds_the_tensors_from_pretrained_builds` checks to 4,096 positions.)"""
    llama = tiny_checkpoints["llama"]  # 512 positions
    for name, scaling, positions in (
            ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
            ("yarn-legacy", {"type": "yarn", "factor": 2.0}, 1024),
            ("linear", {"rope_type": "linear", "factor": 2.0}, 1024),
            ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 128}, 512),
            ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, 512)):
        path = _with_config(llama, tmp_path / name, rope_scaling=scaling)
        assert load_model(path, device="cpu").max_model_len == positions, name
        assert load_model(path, device="cpu", own_decoder=True, max_model_len=positions).max_model_len == positions
        with pytest.raises(ValueError, match=f"maximum context of {positions}"):
            load_model(path, max_model_len=positions + 1)


def test_an_unknown_rope_type_is_refused_by_name(tiny_checkpoints, tmp_path):
    path = _with_config(tiny_checkpoints["llama"], tmp_path / "foo", rope_scaling={"rope_type": "foo", "factor": 2.0})
    with pytest.raises(ValueError, match="its RoPE type 'foo' .rope_scaling. is none this transformers knows"):
        load_model(path, device="cpu")


def test_a_quantized_checkpoint_is_refused_by_name(tiny_checkpoints, tmp_path):
    """Kairos serves unquantized weights: a checkpoint with a quantization_config is a ValueError that says so (it was
    transformers' ImportError for the quantizer's library, or its quantized modules run by our decoder)."""
    for method in ("bitsandbytes", "gptq", "awq", "fp8", "compressed-tensors"):
        path = _with_config(tiny_checkpoints["llama"], tmp_path / method,
                            quantization_config={"quant_method": method, "bits": 4})
        for own in (False, True):
            with pytest.raises(ValueError, match=f"quantized checkpoint \\({method}\\)"):
                load_model(path, device="cpu", own_decoder=own)


def test_separate_tokenizer_path(tiny_checkpoints):
    b = load_model(tiny_checkpoints["llama"], tokenizer=tiny_checkpoints["gpt2"])
    assert b.tokenizer.name_or_path.endswith("gpt2")


# --------------------------------------------------------------------------- errors and options


def test_unknown_path_is_a_clear_value_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=r"cannot load model .*no-such-model.*: no such directory"):
        load_model(str(missing))
    with pytest.raises(ValueError, match=r"cannot load model 'nobody/no-such-model': not a local directory"):
        load_model("nobody/no-such-model")  # HF_HUB_OFFLINE=1: no network
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load model"):
        load_model(str(tmp_path / "empty"))
    # a config transformers' class cannot build (here Falcon's, whose head_dim is derived) is a ValueError too
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "falcon", "head_dim": 64}')
    with pytest.raises(ValueError, match="cannot load model .*bad"):
        load_model(str(tmp_path / "bad"))


def test_unsupported_family_lists_supported(tmp_path):
    from transformers import OPTConfig

    OPTConfig().save_pretrained(tmp_path / "opt")
    with pytest.raises(ValueError, match=r"unsupported model family 'opt'.*gpt2, llama, qwen2"):
        load_model(str(tmp_path / "opt"))


def test_unsupported_dtype_and_device():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model("kairos-tiny", dtype="int8")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("float64", torch.device("cpu"))
    with pytest.raises(ValueError):
        resolve_device("tpu")
    with pytest.raises(ValueError):
        resolve_device("not a device")


def test_resolve_dtype_and_device():
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) is torch.float32 and resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bf16", cpu) is torch.bfloat16 and resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("fp16", cpu) is torch.float16 and resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype("half", cpu) is torch.float16 and resolve_dtype("float", cpu) is torch.float32  # vLLM's
    from engine.config import EngineConfig

    assert EngineConfig(model="m", dtype="half").dtype == "half"
    # auto on CPU: bf16 where the CPU has native bf16 GEMMs, else fp32
    assert resolve_dtype("auto", cpu) is (torch.bfloat16 if cpu_has_native_half() else torch.float32)
    assert resolve_device("cpu") == cpu
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        expect = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        assert resolve_dtype("auto", torch.device("cuda")) is expect


def test_emulated_avx2_means_fp32_and_kernels_without_avx512(monkeypatch):
    """`bench.peer --emulate-avx2` (KAIROS_CPU_ISA=avx2): `auto` is fp32 and the kernels build without AVX-512, as on
    a CPU with AVX2 only."""
    from engine.backends.cpu import kernels as cpu_kernels

    monkeypatch.setenv("KAIROS_CPU_ISA", "avx2")
    assert not cpu_has_native_half() and resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert cpu_kernels.emulated_avx2() and cpu_kernels.isa_flags() == ("-mno-avx512f",)
    monkeypatch.delenv("KAIROS_CPU_ISA")
    assert cpu_kernels.isa_flags() == ()


def test_trust_remote_code_defaults_false(tmp_path):
    assert inspect.signature(load_model).parameters["trust_remote_code"].default is False
    repo = tmp_path / "custom"
    repo.mkdir()
    marker = tmp_path / "EXECUTED"
    (repo / "config.json").write_text(json.dumps({
        "model_type": "kairos_custom",
        "auto_map": {"AutoConfig": "custom.Cfg", "AutoModelForCausalLM": "custom.Model"},
    }))
    (repo / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    with pytest.raises(ValueError, match="cannot load model"):
        load_model(str(repo))
    assert not marker.exists()  # the checkpoint's code never ran


def test_cache_dtype_auto_is_bf16_for_bf16_models_where_the_kernels_read_it(monkeypatch):
    """kv_cache_dtype=auto: a bf16 model's cache is bf16 on CUDA, on CPUs with native bf16, and on AVX2 CPUs with
    Kairos's kernels on (their decode attention reads bf16 rows); fp32 on CPUs where SDPA would run it in bf16."""
    from engine.backends.cpu import backend as cpu_backend
    from engine.backends.cpu.backend import CpuBackend
    from engine.backends.torch_ref import TorchBackend
    from engine.kv_cache import choose_cache_dtype

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    on, off = CpuBackend(cpu, "auto"), CpuBackend(cpu, "off")
    monkeypatch.setattr(cpu_backend, "cpu_has_native_half", lambda: False)
    monkeypatch.setattr(cpu_backend, "cpu_has_avx2_fma", lambda: True)
    assert choose_cache_dtype("auto", bf16, on) is bf16
    assert choose_cache_dtype("auto", bf16, off) is torch.float32
    assert choose_cache_dtype("auto", torch.float32, on) is torch.float32
    monkeypatch.setattr(cpu_backend, "cpu_has_avx2_fma", lambda: False)
    assert choose_cache_dtype("auto", bf16, on) is torch.float32
    assert choose_cache_dtype("model", bf16, on) is bf16
    monkeypatch.setattr(cpu_backend, "cpu_has_native_half", lambda: True)
    assert choose_cache_dtype("auto", bf16, off) is bf16
    assert choose_cache_dtype("auto", bf16, TorchBackend(cpu)) is torch.float32  # the reference: fp32 on any CPU


def test_a_cuda_device_comes_back_with_its_index(monkeypatch):
    """torch.cuda.set_device and the memory queries refuse an unindexed "cuda" (the engine's worker sets its
    thread's device from the model's): "cuda" and "auto" name the current device by its index."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_the_models_generation_config_gives_its_sampling_defaults(tiny_checkpoints, tmp_path):
    """What a checkpoint's generation_config.json sets for temperature, top_p, top_k, min_p and the repetition
    penalty becomes the defaults of requests that leave them out (vLLM's --generation-config auto); an invalid value
    is set aside for the log. A checkpoint that sets none has none."""
    import shutil

    from engine.loader import sampling_defaults

    assert load_model(tiny_checkpoints["llama"], device="cpu").generation_sampling == {}
    path = tmp_path / "sampling"
    shutil.copytree(tiny_checkpoints["llama"], path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    given = load_model(str(path), device="cpu").generation_sampling
    assert given == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    assert sampling_defaults(given) == (
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}, {})
    assert sampling_defaults({"top_p": 1.5, "temperature": 0.7, "repetition_penalty": 0.0, "min_p": 0.1}) == (
        {"temperature": 0.7, "min_p": 0.1}, {"top_p": 1.5, "repetition_penalty": 0.0})


# --------------------------------------------------------------------------- our own loader (engine.own_model)


def _variant(tiny_checkpoints, tmp_path, name: str) -> str:
    """Tiny checkpoints of each kind our loader builds: the families, a tied LM head, RoPE of each table type."""
    if name in ("llama", "qwen2", "qwen3"):
        return tiny_checkpoints[name]
    if name == "mistral":
        return _with_config(tiny_checkpoints["llama"], tmp_path / name, model_type="mistral",
                            architectures=["MistralForCausalLM"])
    if name == "tied":  # a checkpoint with no LM head of its own
        from safetensors.torch import load_file, save_file

        path = _with_config(tiny_checkpoints["qwen3"], tmp_path / name, tie_word_embeddings=True)
        weights = load_file(f"{path}/model.safetensors")
        del weights["lm_head.weight"]
        save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
        return path
    scaling = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128},
               "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
               "linear": {"rope_type": "linear", "factor": 2.0}}[name]
    return _with_config(tiny_checkpoints["llama"], tmp_path / name, rope_scaling=scaling, rope_theta=50000.0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "tied", "llama3", "yarn", "linear"])
def test_our_loader_builds_the_tensors_from_pretrained_builds(name, tiny_checkpoints, tmp_path):
    """A checkpoint our decoder runs is read from its safetensors without transformers' modeling code: the same
    tensors under the same names, in the dtype asked for (a tied head: the embedding itself), the same RoPE tables,
    the same generation config, as `from_pretrained` gives; the engine's tokens are exact to HF's either way
    (tests/test_engine.py)."""
    from engine.own_model import CausalLM

    path = _variant(tiny_checkpoints, tmp_path, name)
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_model(path, device="cpu", dtype=dtype, own_decoder=True)
        hf = load_model(path, device="cpu", dtype=dtype)
        assert type(ours.model) is CausalLM and type(hf.model) is not CausalLM
        a, b = ours.model.state_dict(), hf.model.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype == dtype and torch.equal(a[k], b[k]), k
        tied = ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
        assert tied == (hf.model.lm_head.weight is hf.model.model.embed_tokens.weight) == (name == "tied")
        rot_a, rot_b = ours.model.model.rotary_emb, hf.model.model.rotary_emb
        assert rot_a.rope_type == rot_b.rope_type and rot_a.attention_scaling == rot_b.attention_scaling
        positions = torch.arange(0, 600, 7)[None]
        probe = torch.empty(0, dtype=dtype)
        for x, y in zip(rot_a(probe, positions), rot_b(probe, positions)):
            assert x.dtype == dtype and torch.equal(x, y)
        # and transformers' own model's: its frequencies stay in fp32 (cast with the weights, a long prompt's
        # angles turned, and its logits with them)
        raw = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model.rotary_emb
        assert rot_a.inv_freq.dtype == rot_b.inv_freq.dtype == raw.inv_freq.dtype == torch.float32
        far = torch.arange(0, 4096, 61)[None]
        for x, y in zip(rot_a(probe, far), raw(probe, far)):
            assert torch.equal(x, y)
        assert ours.model.generation_config.to_diff_dict() == hf.model.generation_config.to_diff_dict()
        assert (ours.eos_token_ids, ours.vocab_limit, ours.generation_sampling) == \
            (hf.eos_token_ids, hf.vocab_limit, hf.generation_sampling)
        with pytest.raises(RuntimeError, match="no forward"):
            ours.model(torch.tensor([[1, 2]]))


def test_our_loader_reads_shards_and_leaves_the_rest_to_from_pretrained(tiny_checkpoints, tmp_path):
    """Shards named by an index are read like one file; a checkpoint with a tensor the tree does not hold, one
    without safetensors, a RoPE that changes with the length, a family our decoder does not run, or an engine that
    runs HF's forward (model_impl=hf: `own_decoder` False) goes through `from_pretrained`, as before."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.own_model import CausalLM

    src = Path(tiny_checkpoints["llama"])
    whole = load_file(str(src / "model.safetensors"))

    def copy(name: str, tensors: dict | None = None, files: dict | None = None) -> str:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        if tensors is not None:
            save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        for f, text in (files or {}).items():
            (dst / f).write_text(text)
        return str(dst)

    sharded = copy("sharded")
    keys = sorted(whole)
    halves = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for f, ks in halves.items():
        save_file({k: whole[k] for k in ks}, str(tmp_path / "sharded" / f), metadata={"format": "pt"})
    (tmp_path / "sharded" / "model.safetensors").unlink()
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    got = load_model(sharded, device="cpu", dtype="float32", own_decoder=True).model
    assert type(got) is CausalLM
    assert all(torch.equal(got.state_dict()[k], v) for k, v in whole.items())
    stale = copy("stale")  # the one file beside an index and shards of other values: the one file, as HF reads
    save_file({k: 3 * v for k, v in whole.items()}, str(tmp_path / "stale" / "a.safetensors"), metadata={"format": "pt"})
    (tmp_path / "stale" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "a.safetensors" for k in whole}}))
    got = load_model(stale, device="cpu", dtype="float32", own_decoder=True).model
    assert type(got) is CausalLM and all(torch.equal(got.state_dict()[k], v) for k, v in whole.items())

    extra = copy("extra", {**whole, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    dynamic = _with_config(str(src), tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    named = _with_config(str(src), tmp_path / "named", transformers_weights="model.safetensors")
    for path in (extra, dynamic, named, tiny_checkpoints["gpt2"]):
        assert type(load_model(path, device="cpu", own_decoder=True).model) is not CausalLM, path
    # a checkpoint that lacks a tensor its config needs (from_pretrained would start it random), or holds one its
    # config leaves out (dropped: a bias of a config without attention_bias): refused, naming them, as vLLM refuses
    missing = copy("missing", {k: v for k, v in whole.items() if k != "model.norm.weight"})
    unused = copy("unused", {**whole, "model.layers.0.self_attn.q_proj.bias": torch.ones(
        whole["model.layers.0.self_attn.q_proj.weight"].shape[0])})
    for path, says in ((missing, "missing model.norm.weight"), (unused, "unused model.layers.0.self_attn.q_proj.bias")):
        for own in (True, False):
            with pytest.raises(ValueError, match=says):
                load_model(path, device="cpu", own_decoder=own)
    assert type(load_model(str(src), device="cpu").model) is not CausalLM
    bad = copy("bad")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not safetensors")
    outside = copy("outside")  # shards named outside the folder: refused, as from_pretrained refuses them
    (tmp_path / "outside" / "model.safetensors").unlink()
    (tmp_path / "outside" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "../sharded/a.safetensors" for k in whole}}))
    for path in (bad, outside):
        with pytest.raises(ValueError, match="cannot load model"):
            load_model(path, device="cpu", own_decoder=True)


def test_our_loader_reads_the_generation_config_from_pretrained_reads(tiny_checkpoints, tmp_path):
    """Without a generation_config.json (or with one that cannot be read), the generation keys of config.json: the
    requests' sampling defaults are the same either way."""
    keys = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    for name, text in (("none", None), ("corrupt", "{not json")):
        path = _with_config(tiny_checkpoints["llama"], tmp_path / name, **keys)
        if text is None:
            (tmp_path / name / "generation_config.json").unlink()
        else:
            (tmp_path / name / "generation_config.json").write_text(text)
        ours = load_model(path, device="cpu", own_decoder=True)
        hf = load_model(path, device="cpu")
        assert ours.generation_sampling == hf.generation_sampling == keys, name
        assert ours.model.generation_config.to_diff_dict() == hf.model.generation_config.to_diff_dict()
        assert ours.eos_token_ids == hf.eos_token_ids


def test_offline_a_hub_ids_cached_files_are_read_by_our_loader(tiny_checkpoints, tmp_path, monkeypatch):
    """Offline, a hub id is loaded from its files in the hub cache (as `from_pretrained` reads them there), by our
    loader where the engine's decoder runs it; one not in the cache is still a clear error."""
    import shutil

    from huggingface_hub import constants

    from engine.own_model import CausalLM

    repo = tmp_path / "hub" / "models--kairos-test--tiny-llama"
    shutil.copytree(tiny_checkpoints["llama"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    ours = load_model("kairos-test/tiny-llama", device="cpu", dtype="float32", own_decoder=True)
    hf = load_model("kairos-test/tiny-llama", device="cpu", dtype="float32")
    assert type(ours.model) is CausalLM and type(hf.model) is not CausalLM and ours.path == "kairos-test/tiny-llama"
    assert all(torch.equal(v, hf.model.state_dict()[k]) for k, v in ours.model.state_dict().items())
    with pytest.raises(ValueError, match="cannot load model 'kairos-test/absent'"):
        load_model("kairos-test/absent", device="cpu", own_decoder=True)


def test_a_rotary_narrower_than_the_heads_of_a_llama_family_model_is_refused_at_load(tiny_checkpoints, tmp_path):
    """A partial_rotary_factor under a scaled RoPE in a Llama config builds a rotary of fewer dimensions than a head,
    which this family's attention (ours, and HF's) turns whole: a ValueError naming it at load, where the engine's
    first step failed with a bare AssertionError."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    path = _with_config(tiny_checkpoints["llama"], tmp_path / "partial", rope_parameters=rope, rope_scaling=None)
    for own in (True, False):
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            load_model(path, device="cpu", dtype="float32", own_decoder=own)


def test_a_broken_checkpoint_folder_is_refused_naming_what_is_wrong(tiny_checkpoints, tmp_path):
    """What a helper's broken folders got instead: a tensor of another shape than its config describes named none
    (transformers' ignore_mismatched_sizes, a knob Kairos has not); no tokenizer files, or a SentencePiece model
    alone, said to install sentencepiece or tiktoken; no config.json said it should have a model_type; a shard index
    that is not JSON named no file. The app's build refuses a file, a folder without config.json, and a config.json
    that is not JSON, before any replica tries (they passed)."""
    import importlib.util
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.config import check_local_model

    src = Path(tiny_checkpoints["llama"])

    def copy(name: str) -> Path:
        return Path(shutil.copytree(src, tmp_path / name))
    wide = copy("wide")
    tensors = load_file(str(wide / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = torch.cat([tensors["model.embed_tokens.weight"]] * 2)
    save_file(tensors, str(wide / "model.safetensors"), metadata={"format": "pt"})
    for own in (False, True):  # (transformers' from_pretrained, and Kairos's own reader)
        with pytest.raises(ValueError, match=r"its tensor model.embed_tokens.weight is \[1024, .*config.json "
                                             r"describes \[512, "):
            load_model(str(wide), own_decoder=own)
    bare = copy("no-tokenizer")
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    with pytest.raises(ValueError, match="no tokenizer files in"):
        load_model(str(bare))
    if importlib.util.find_spec("sentencepiece") is None:
        (bare / "tokenizer.model").write_bytes(b"\0")
        with pytest.raises(ValueError, match="a SentencePiece tokenizer.model and no tokenizer.json"):
            load_model(str(bare))
    unconfigured = copy("no-config")
    (unconfigured / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json in"):
        load_model(str(unconfigured))
    with pytest.raises(ValueError, match="no config.json in"):
        check_local_model(str(unconfigured))
    with pytest.raises(ValueError, match="it is a file"):
        check_local_model(str(src / "config.json"))
    garbled = copy("garbled")
    (garbled / "config.json").write_text("{model_type: llama")
    with pytest.raises(ValueError, match="its config.json is not a JSON object"):
        check_local_model(str(garbled))
    # a context past the checkpoint's positions: the loader's refusal, at the app's build (its replicas failed)
    top = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"max_model_len={2 * top} exceeds the model's maximum context of {top}"):
        check_local_model(str(src), 2 * top)
    check_local_model(str(src), top)
    from pydantic import ValidationError

    from deployments.args import AppArgs
    with pytest.raises(ValidationError, match="exceeds the model's maximum context"):
        AppArgs.model_validate({"model": str(src), "max_model_len": 2 * top})
    # as the loader reads it: a YaRN rope_scaling added beside the rope_parameters transformers wrote (Qwen2.5's
    # long-context set-up) extends the positions
    yarn = copy("yarn")
    cfg = json.loads((yarn / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": top}
    (yarn / "config.json").write_text(json.dumps(cfg))
    check_local_model(str(yarn), 4 * top)
    with pytest.raises(ValueError, match=f"maximum context of {4 * top} positions"):
        check_local_model(str(yarn), 4 * top + 1)
    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_model(str(truncated))
    sharded = copy("sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text("{weight_map: ")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not JSON"):
        load_model(str(sharded))


def test_tokenizer_folders_of_other_layouts_and_built_in_names_pass_the_new_checks(tiny_checkpoints, tmp_path):
    """The checks above refuse only what is wrong: a Mistral tekken.json, a WordPiece vocab.txt and other
    SentencePiece names count as tokenizer files; a built-in model's name is the loader's, whatever folder is
    named so where the app is built."""
    from engine.config import check_local_model
    from engine.loader import _check_tokenizer_files

    for name in ("tekken.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "cl100k.tiktoken"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / name).write_text("{}")
        _check_tokenizer_files(str(folder), "m")  # (no refusal)
    (tmp_path / "kairos-tiny").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        check_local_model("kairos-tiny")
    finally:
        os.chdir(cwd)
