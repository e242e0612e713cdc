"""Fixtures of the GPU tests: the `device` they run on, engines over the tiny checkpoints, and HF references.

Every test here takes `device`: "cuda" where torch sees a GPU, else the test is skipped, so CI (no GPU) stays
green. `KAIROS_GPU_TESTS_ON_CPU=1` runs them on the CPU instead (a dry run of the GPU check on a box without
one; `bench/device/gpu_check.sh`). Only the engine's public API is used: `LLMEngine`, `EngineConfig`,
`SamplingParams`, streams and step observers.
"""
from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence

import pytest

ON_CPU_ENV = "KAIROS_GPU_TESTS_ON_CPU"


@pytest.fixture(scope="session")
def device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get(ON_CPU_ENV) == "1":
        return "cpu"
    pytest.skip(f"no CUDA device: tests/gpu needs a GPU ({ON_CPU_ENV}=1 dry-runs them on the CPU)")


@pytest.fixture(scope="session")
def ckpts(device, tiny_checkpoints) -> dict[str, str]:
    """The tiny GPT-2 / Llama / Qwen2 / Qwen3 checkpoints, built only once a test is known to run."""
    return tiny_checkpoints


def make_engine(path: str, device: str, dtype: str = "float32", *, policy: str = "fcfs", **kw):
    """An engine over `path` on `device` with a 1 GiB KV cache unless told otherwise. Scheduler knobs
    (`prefill_max_tokens`, `chunked_prefill`, ...) go to the SchedulerConfig, the rest to EngineConfig."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduling.config import SchedulerConfig

    sched_keys = set(SchedulerConfig.model_fields)
    sched = {k: kw.pop(k) for k in list(kw) if k in sched_keys}
    sched.setdefault("prefill_max_tokens", 4096)
    sched.setdefault("max_num_seqs", 64)
    if not kw.get("num_kv_blocks") and "gpu_memory_utilization" not in kw:
        kw.setdefault("kv_cache_memory_gb", 1.0)  # not 85% of the card: test_memory_cuda checks that sizing
    return LLMEngine(EngineConfig(model=path, dtype=dtype, device=device,
                                  scheduler=SchedulerConfig(policy=policy, **sched), **kw))


def collect(stream) -> tuple[list[int], object]:
    """A stream's tokens and its final item."""
    toks: list[int] = []
    last = None
    for out in stream:
        toks.extend(out.token_ids)
        last = out
    return toks, last


def run_all(streams: Sequence, expect: str | tuple[str, ...] = "length") -> list[list[int]]:
    """Every stream's tokens; each must finish with `expect` (never an error: its message is shown)."""
    expect = (expect,) if isinstance(expect, str) else expect
    outs = []
    for s in streams:
        toks, last = collect(s)
        assert last is not None and last.finished, last
        assert last.finish_reason in expect, (last.finish_reason, last.error, last.reject_reason)
        outs.append(toks)
    return outs


def greedy(max_tokens: int):
    from core.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_model(path: str, device: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return m.to(device).eval().requires_grad_(False)


def hf_greedy(model, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], **generate) -> list[list[int]]:
    """HF `generate`, greedy, one prompt at a time, run to length (EOS ignored); `generate`: more of its knobs."""
    import torch

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    dev = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for ids, k in zip(prompts, max_tokens):
            x = torch.tensor([list(ids)], device=dev)
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                                 do_sample=False, **generate)
            out.append(gen[0, len(ids):].tolist())
    return out


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama_engine(device, ckpts) -> Iterator:
    """One fp32 engine over the tiny Llama for a module's tests (an engine start fits a latency profile)."""
    eng = make_engine(ckpts["llama"], device)
    try:
        yield eng
    finally:
        eng.shutdown()
        del eng
        free_device_memory()
