"""The CUDA backend's own paths on a GPU: decode steps replayed from CUDA graphs (padded to the ladder's batch sizes,
the padding rows writing into the scratch block) give the tokens of the torch reference backend, which runs no
graphs and no Triton; the graphs were captured and replayed; a shut-down engine hands its memory back."""
from __future__ import annotations

import pytest

from tests.gpu.conftest import collect, make_engine

PROMPTS = [list(range(3, 9)), list(range(7, 60)), list(range(11, 40)), list(range(2, 130)), list(range(5, 21))]


def _tokens(eng, prompts, max_tokens=12):
    from core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [collect(s)[0] for s in eng.add_requests(prompts, params)]


def _reference_tokens(ckpts, device) -> list[list[int]]:
    """PROMPTS' greedy tokens from the torch reference backend (no graphs, no Triton)."""
    ref = make_engine(ckpts["llama"], device, backend="torch", max_num_seqs=8)
    try:
        return _tokens(ref, PROMPTS)
    finally:
        ref.shutdown()


def test_graph_replays_equal_the_torch_reference(device, ckpts):
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    want = _reference_tokens(ckpts, device)
    eng = make_engine(ckpts["llama"], device, max_num_seqs=8)
    try:
        assert type(eng.backend).__name__ == "CudaBackend" and eng.backend.ops is not None
        assert eng.graph_report.get("graphs", 0) >= 4, eng.graph_report  # 1, 2, 4, 8
        assert eng.graph_report.get("kernel_variants", 0) >= 4, eng.graph_report  # compiled at start
        graphs = eng.backend.graphs
        replays = []
        real = graphs.replay
        graphs.replay = lambda decode, prev=None: replays.append(len(decode)) or real(decode, prev)
        got = _tokens(eng, PROMPTS)
        assert replays and max(replays) <= len(PROMPTS)
        assert got == want
        # five running requests replay the graph of 8 rows: three padding rows each step
        assert any(n == 5 for n in replays)
    finally:
        eng.shutdown()


def test_enforce_eager_runs_every_step_without_a_graph(device, ckpts):
    """vLLM's enforce_eager: no CUDA graph is captured (Triton attention stays), and the tokens are the reference's."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    want = _reference_tokens(ckpts, device)
    eng = make_engine(ckpts["llama"], device, max_num_seqs=8, enforce_eager=True)
    try:
        assert eng.graph_report.get("graphs") == 0 and eng.backend.graphs is None and eng.backend.mixed is None
        assert eng.graph_report.get("kernel_variants", 0) >= 4, eng.graph_report  # (Triton's, compiled at start)
        assert _tokens(eng, PROMPTS) == want
    finally:
        eng.shutdown()


def test_mixed_graph_replays_equal_the_torch_reference(device, ckpts):
    """Steps with prefill rows (16-token chunks, and the decodes riding with them) replay the mixed graphs of up to
    64 tokens, padded to 16 / 32 / 64, longer steps eager: the torch reference backend's tokens."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    sched = dict(chunked_prefill=True, prefill_max_tokens=40, hybrid_steps=True, max_num_seqs=8)
    prompts = [*PROMPTS, list(range(4, 90))]
    ref = make_engine(ckpts["llama"], device, backend="torch", **sched)
    try:
        want = _tokens(ref, prompts)
    finally:
        ref.shutdown()
    eng = make_engine(ckpts["llama"], device, mixed_graph_tokens=64, **sched)
    try:
        assert eng.graph_report.get("mixed_graphs") == 3 and "mixed_error" not in eng.graph_report, eng.graph_report
        mixed = eng.backend.mixed
        runs = []
        real = mixed.run
        mixed.run = lambda step, prev=None: runs.append((step.num_tokens(), len(step.decode))) or real(step, prev)
        got = _tokens(eng, prompts)
        assert runs and all(n <= 64 for n, _ in runs) and any(d for _, d in runs), runs
        assert got == want
    finally:
        eng.shutdown()


def test_mixed_graphs_at_serving_sizes_and_their_eager_fallback(device, ckpts):
    """The default ladder (to 512 tokens) with 64 requests a step: sizes whose entries differ (min(t, 64) decodes,
    up to 32 prompts), a first round of 40 prompts (over 32: eager), then rounds and hybrid steps that replay; the
    torch reference backend's tokens."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    sched = dict(chunked_prefill=True, prefill_max_tokens=512, hybrid_steps=True, max_num_seqs=64)
    prompts = [list(range(3, 3 + 4 + (7 * i) % 9)) for i in range(40)] + [list(range(5, 300))]  # 4-12, then 295
    ref = make_engine(ckpts["llama"], device, backend="torch", **sched)
    try:
        want = _tokens(ref, prompts, max_tokens=6)
    finally:
        ref.shutdown()
    eng = make_engine(ckpts["llama"], device, **sched)
    try:
        assert eng.graph_report.get("mixed_max_tokens") == 512 and "mixed_error" not in eng.graph_report
        mixed = eng.backend.mixed
        runs = []
        real = mixed.run
        mixed.run = lambda step, prev=None: runs.append((len(step.prefill), len(step.decode))) or real(step, prev)
        eager = []
        prepare = eng.backend.prepare
        eng.backend.prepare = lambda step: eager.append(len(step.prefill)) or prepare(step)
        got = _tokens(eng, prompts, max_tokens=6)
        assert runs and all(p <= 32 for p, _ in runs) and any(d for _, d in runs), runs
        assert any(p > 32 for p in eager), eager  # the first round: 40 prompts
        assert got == want
    finally:
        eng.shutdown()


def test_bf16_graphs_with_fused_ops_agree_with_the_reference(device, ckpts):
    """bf16 through the fused Triton ops and the graphs: the first greedy tokens agree with the torch reference
    backend in bf16 (near ties may differ later)."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    outs = {}
    for backend in ("torch", "auto"):
        eng = make_engine(ckpts["qwen3"], device, dtype="bfloat16", backend=backend, max_num_seqs=8)
        try:
            outs[backend] = _tokens(eng, PROMPTS, max_tokens=4)
        finally:
            eng.shutdown()
    same = sum(a[0] == b[0] for a, b in zip(outs["torch"], outs["auto"]))
    assert same >= len(PROMPTS) - 1, outs
