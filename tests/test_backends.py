"""The backend seam (engine/backends): the same greedy tokens from the torch reference, CPU and CUDA backends (the
CUDA backend's Triton kernels run in Triton's interpreter on a CPU device here), a mixed greedy + sampled batch,
seeded draws that do not depend on the batch, one bad request failing alone, and a shut-down engine that frees what
it held. The generic engine modules import only the seam's base."""
import re
from pathlib import Path

import pytest
import torch

from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from scheduling.config import SchedulerConfig

ENGINE = Path(__file__).resolve().parents[1] / "engine"


def test_generic_modules_import_only_the_seam():
    """Device-specific code lives behind the seam: engine/*.py names no CPU or CUDA backend module."""
    for path in ENGINE.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"cpu_kernels|cpu_matmul", text), path.name
        for line in text.splitlines():
            if re.match(r"\s*(from|import) engine\.backends\.(cpu|cuda|torch_ref)", line):
                pytest.fail(f"{path.name} imports a backend directly: {line.strip()}")


def _run(path, prompts, params, **cfg):
    eng = LLMEngine(EngineConfig(model=path, device="cpu", block_size=4, **cfg))
    try:
        streams = eng.add_requests(prompts, params) if not isinstance(params, list) else \
            [eng.add_request(p, q) for p, q in zip(prompts, params)]
        out = []
        for s in streams:
            toks, err = [], None
            for item in s:
                toks.extend(item.token_ids or [])
                err = err or item.error
            out.append(err if err else toks)
        return out, eng
    finally:
        eng.shutdown()


PROMPTS = [list(range(3, 5)), list(range(7, 30)), list(range(11, 70)), list(range(2, 9)) * 3]


def _tokens_of(streams) -> list[list[int]]:
    """Each stream's tokens, every item without an error."""
    got = []
    for s in streams:
        toks = []
        for item in s:
            assert item.error is None, item.error
            toks.extend(item.token_ids or [])
        got.append(toks)
    return got


def _triton_interpreted() -> bool:
    try:
        import triton.language as tl
    except ImportError:
        return False
    return type(tl.cdiv).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_backends_decode_the_same_greedy_tokens(tiny_checkpoints, backend):
    """Mixed prompt lengths (decodes over contexts of different lengths in one step), fp32: the torch reference
    backend and the CUDA backend's Triton path (interpreted on CPU) give the CPU backend's tokens."""
    if backend == "cuda" and not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want, ref = _run(tiny_checkpoints["llama"], PROMPTS, params, dtype="float32", backend="cpu")
    got, eng = _run(tiny_checkpoints["llama"], PROMPTS, params, dtype="float32", backend=backend)
    assert type(eng.backend).__name__.lower().startswith(backend)
    if backend == "cuda":
        assert eng.backend.ops is not None  # the Triton path ran, not the reference fallback
    assert got == want


def test_cuda_backend_chunked_prefill_over_the_paged_prefill_kernel(tiny_checkpoints):
    """A prompt prefilled in chunks attends over its cached prefix through the Triton prefill kernel: the same
    tokens as the CPU backend."""
    if not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    sched = SchedulerConfig(chunked_prefill=True, prefill_max_tokens=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 45)), list(range(9, 30))]
    want, _ = _run(tiny_checkpoints["qwen2"], prompts, params, dtype="float32", backend="cpu", scheduler=sched)
    got, _ = _run(tiny_checkpoints["qwen2"], prompts, params, dtype="float32", backend="cuda", scheduler=sched)
    assert got == want


def test_cuda_mixed_graph_path_gives_the_cpu_backends_tokens(tiny_checkpoints):
    """Steps with prefill rows through the mixed graphs' buffers and metadata (`MixedGraphs`, run eagerly here: the
    capture needs a GPU): the decodes riding with prompt chunks first, through the decode kernel over the size's
    fixed entries, the chunks (over their cached prefix) through the prefill kernel after, the sampled rows first.
    Chunks of up to 40 tokens and a 64-token ladder (16, 32, 64): steps of every size, padded, and longer ones eager;
    the CPU backend's tokens."""
    if not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    from engine.backends.cuda.graphs import MixedGraphs, mixed_ladder

    assert mixed_ladder(0) == [] and mixed_ladder(64) == [16, 32, 64] and mixed_ladder(100) == [16, 32, 64, 96, 100]
    sched = SchedulerConfig(chunked_prefill=True, prefill_max_tokens=40, hybrid_steps=True, max_num_seqs=6)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 45)), list(range(9, 30)), list(range(3, 6)), list(range(2, 80)), list(range(7, 20)),
               list(range(5, 45))]
    want, _ = _run(tiny_checkpoints["llama"], prompts, params, dtype="float32", backend="cpu", scheduler=sched)
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", block_size=4, dtype="float32",
                                 backend="cuda", scheduler=sched))
    try:
        be = eng.backend
        be.mixed = MixedGraphs(be, eng.runner.decoder, eng.cache, 64, sched.max_num_seqs, eng.max_model_len)
        sizes, real = [], be.mixed.run

        def run(step, prev=None):
            sizes.append((step.num_tokens(), len(step.decode)))
            return real(step, prev)
        be.mixed.run = run
        got = _tokens_of(eng.add_requests(prompts, params))
    finally:
        eng.shutdown()
    assert got == want
    assert sizes and all(n <= 64 for n, _ in sizes)
    assert any(d for _, d in sizes), sizes  # decodes rode with a prefill
    assert any(n not in (16, 32, 64) for n, _ in sizes)  # padded


def test_cuda_decode_graph_path_gives_the_cpu_backends_tokens(tiny_checkpoints):
    """Decode-only steps through the decode graphs' buffers, staging sets and metadata (`DecodeGraphs`, run eagerly
    here: the capture needs a GPU), with overlap scheduling's placeholders: a batch padded to its ladder size (6
    decodes at most: sizes 1, 2, 4, 6), block tables written row by row as they grow, the LM head on the step's rows
    only (the graphs hold hidden states, not logits per size); the CPU backend's tokens."""
    if not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    from engine.backends.cuda.graphs import DecodeGraphs

    sched = SchedulerConfig(max_num_seqs=6)
    # (replies of 2 to 8 tokens: batches of five down to one, each step in Triton's interpreter)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (5, 2, 8, 4, 6)]
    prompts = [list(range(5, 45)), list(range(9, 30)), list(range(3, 6)), list(range(2, 50)), list(range(7, 20))]
    want, _ = _run(tiny_checkpoints["qwen2"], prompts, params, dtype="float32", backend="cpu", scheduler=sched)
    for overlap in ("off", "on"):
        eng = LLMEngine(EngineConfig(model=tiny_checkpoints["qwen2"], device="cpu", block_size=4, dtype="float32",
                                     backend="cuda", scheduler=sched, overlap=overlap))
        try:
            if eng._stream is not None:  # overlap as on a GPU (steps launched through the backend), not the host's
                eng._stream.close()
                eng._stream = None
            be = eng.backend
            be.graphs = DecodeGraphs(be, eng.runner.decoder, eng.cache, sched.max_num_seqs, eng.max_model_len)
            assert be.graphs.sizes == [1, 2, 4, 6]
            sizes, real = [], be.graphs.replay

            def replay(decode, prev=None):
                sizes.append(len(decode))
                return real(decode, prev)
            be.graphs.replay = replay
            got = _tokens_of([eng.add_request(p, q) for p, q in zip(prompts, params)])
        finally:
            eng.shutdown()
        assert got == want, overlap
        assert any(n in (3, 5) for n in sizes) and 1 in sizes, sizes  # padded, and down to one


def test_steps_with_prompt_rows_run_eagerly_on_the_cuda_backend_and_give_the_cpu_backends_logprobs(tiny_checkpoints):
    """A step whose prefills give prompt logprobs returns more rows than it samples: on the CUDA backend it runs
    eagerly, never through the mixed graphs (whose rows are the sampled ones), and its prompt logprobs and tokens are
    the CPU backend's; steps without such rows still take the mixed graphs."""
    if not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    from engine.backends.cuda.graphs import MixedGraphs

    sched = SchedulerConfig(chunked_prefill=True, prefill_max_tokens=40, hybrid_steps=True, max_num_seqs=6)
    prompts = [list(range(5, 45)), list(range(9, 30)), list(range(2, 80)), list(range(7, 20))]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
              for k in (2, None, 0, None)]

    def serve(backend):
        eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", block_size=4, dtype="float32",
                                     backend=backend, scheduler=sched))
        spans = []
        try:
            if backend == "cuda":
                be = eng.backend
                be.mixed = MixedGraphs(be, eng.runner.decoder, eng.cache, 64, sched.max_num_seqs, eng.max_model_len)
                real = be.mixed.run

                def run(step, prev=None):
                    spans.append(step.prompt_spans)
                    return real(step, prev)
                be.mixed.run = run
            out = []
            for st in [eng.add_request(p, q) for p, q in zip(prompts, params)]:
                items = list(st)
                assert all(item.error is None for item in items)
                prompt = next((o.prompt_logprobs for o in items if o.prompt_logprobs is not None), None)
                out.append(([t for o in items for t in o.token_ids],
                            None if prompt is None else [(x.id, x.logprob, x.rank) for x in prompt]))
            return out, spans
        finally:
            eng.shutdown()
    want, _ = serve("cpu")
    got, spans = serve("cuda")
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [p is None for _, p in got] == [False, True, False, True]
    for (_, g), (_, w) in zip(got, want):
        if g is not None:
            assert [i for i, _, _ in g] == [i for i, _, _ in w]
            assert [v for _, v, _ in g[1:]] == pytest.approx([v for _, v, _ in w[1:]], abs=1e-4)
    assert spans and not any(spans)  # the mixed graphs ran, never a step with prompt rows


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_mixed_greedy_and_sampled_batch_and_seeds_independent_of_the_batch(tiny_checkpoints, backend):
    """The API's default temperature 1.0 batched with greedy requests: the greedy ones keep their solo tokens, and a
    seeded request draws the same tokens alone and in a batch (the torch sampler on the logits' device; the CUDA
    backend's top-p rows through its Triton draw, interpreted here)."""
    if backend == "cuda" and not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    default = SamplingParams(max_tokens=6, ignore_eos=True)
    solo_g, _ = _run(path, [PROMPTS[1]], greedy, dtype="float32", backend=backend)
    solo_s, eng = _run(path, [PROMPTS[2]], seeded, dtype="float32", backend=backend)
    mixed, _ = _run(path, [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]], [greedy, seeded, default, default],
                    dtype="float32", backend=backend)
    assert (eng.sampler.top_p_draw is not None) is (backend == "cuda")
    assert mixed[0] == solo_g[0]
    assert mixed[1] == solo_s[0]
    assert all(isinstance(t, list) and len(t) == 6 for t in mixed)


def break_inputs_of(eng, request_id: str) -> None:
    """Every step with `request_id` in it raises in the backend's `prepare` (as a kernel a bad input breaks)."""
    real = eng.backend.prepare

    def prepare(step):
        if any(r.request_id == request_id for r in (*step.prefill, *step.decode)):
            raise RuntimeError("this request's inputs break the kernel")
        return real(step)
    eng.backend.prepare = prepare


def test_a_request_whose_forward_fails_fails_alone(tiny_checkpoints):
    """A step whose forward raises is run again request by request: only the request that fails again fails."""
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", dtype="float32", backend="torch"))
    try:
        break_inputs_of(eng, "bad")
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        streams = [eng.add_request(PROMPTS[i], params, request_id=rid) for i, rid in enumerate(["a", "bad", "c"])]
        last = {}
        for s in streams:
            for item in s:
                last[s.request_id] = item
        assert last["a"].error is None and last["c"].error is None
        assert last["bad"].error and "model step failed" in last["bad"].error
    finally:
        eng.shutdown()


def test_shutdown_frees_the_engine_and_a_second_engine_gets_the_same_cache(tiny_checkpoints):
    cfg = EngineConfig(model=tiny_checkpoints["llama"], device="cpu", dtype="float32")
    first = LLMEngine(cfg)
    blocks = first.cache.num_blocks
    first.shutdown()
    assert first.cache.k is None and first.bundle.model is None and first.runner.decoder is None
    second = LLMEngine(cfg)
    try:
        assert second.cache.num_blocks == blocks
        s = second.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0))
        assert [i for i in s][-1].error is None
    finally:
        second.shutdown()


def test_rope_tables_do_not_move_once_graphs_were_captured_over_them(tiny_checkpoints):
    """CUDA graphs read the decoder's RoPE tables where they were at capture: a step past their end then fails with a
    clear error instead of growing new tables under the graphs (which would read freed memory)."""
    from types import SimpleNamespace

    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", dtype="float32", backend="torch"))
    try:
        dec = eng.runner.decoder
        assert dec.table_rope
        tables, n = dec.rope_tables, dec.rope_tables[0].shape[0]
        dec.tables_captured = True
        ids = torch.zeros(1, dtype=torch.long)
        with pytest.raises(ValueError, match=f"position {n} is past the {n} positions of the RoPE tables"):
            dec(ids, ids, ids, SimpleNamespace(max_position=n))
        assert dec.rope_tables is tables
    finally:
        eng.shutdown()


def test_cuda_backend_compiles_its_kernel_variants_at_start(tiny_checkpoints):
    """The CUDA backend's start-up launch of each Triton kernel variant a step can need (every decode split count,
    both prefill configurations, a top-p draw), here through the interpreter over the engine's own cache: it runs
    without touching what the cache holds, and the engine still gives the CPU backend's greedy tokens after it."""
    if not _triton_interpreted():
        pytest.skip("triton is not installed, or not in interpreter mode on this CPU-only process")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want, _ = _run(tiny_checkpoints["llama"], PROMPTS, params, dtype="float32", backend="cpu")
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], device="cpu", dtype="float32", backend="cuda"))
    try:
        k0 = eng.cache.k.clone()
        report = eng.run_idle(lambda e: e.backend.compile_kernels(e.max_model_len))
        ops = eng.backend.ops
        counts = ops.split_counts(eng.cache.num_kv_heads, eng.max_model_len, ops.num_sms_of(eng.cache.k.device))
        assert report["kernel_variants"] == len(counts) + 3
        assert torch.equal(eng.cache.k, k0)
        streams = eng.add_requests(PROMPTS, params)
        assert [[t for item in s for t in (item.token_ids or [])] for s in streams] == want
    finally:
        eng.shutdown()
