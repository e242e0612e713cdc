"""Kairos's compiled CPU kernels against the torch ops they replace, on hand-made paged caches."""
import threading

import pytest
import torch
import torch.nn.functional as F

from engine.backends.cpu import kernels as cpu_kernels
from engine.config import EngineConfig
from engine.backends.base import rms_norm
from engine.engine import LLMEngine
from engine.testing import q4_1_round_trip, q8_0_round_trip

H, KV, HD, BS = 9, 3, 64, 16


def _on_thread(fn):
    """Like the engine: tensor work on a thread of its own (one OpenMP pool per thread that runs parallel ops)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_matches_hf_rmsnorm(kernels, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    got = _on_thread(lambda: kernels.rms_norm(x, w, 1e-5))
    ref = rms_norm(x, w, 1e-5)
    if dtype == torch.bfloat16:  # the fp32 statistics round to the same bf16 values
        assert torch.equal(got, ref)
    else:  # the mean's summation order differs in the last bit
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    strided = torch.cat([x, x], 1)[:, :576]  # a row stride other than the width
    assert torch.equal(_on_thread(lambda: kernels.rms_norm(strided, w, 1e-5)), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("hd", [HD, 40])  # 40: half a head not a multiple of 16 (the scalar rotation)
def test_rope_write_is_bit_exact_with_the_torch_ops_and_fills_the_slots(kernels, dtype, rows, hd):
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (H + 2 * KV) * hd, generator=g).to(dtype)
    cos, sin = (torch.randn(512, hd, generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(0, 512, (rows,), generator=g)
    slots = torch.randperm(20 * BS, generator=g)[:rows]
    kc = torch.zeros(20, BS, KV, hd, dtype=dtype)
    vc = torch.zeros_like(kc)
    heads = qkv.view(rows, H + 2 * KV, hd)
    qk = heads[:, :H + KV]
    c, s = cos[pos][:, None], sin[pos][:, None]
    ref = qk * c + torch.cat((-qk[..., hd // 2:], qk[..., :hd // 2]), -1) * s  # the decoder's torch RoPE
    v = heads[:, H + KV:].clone()
    got = qkv.clone()
    _on_thread(lambda: kernels.rope_write(got, H, KV, cos, sin, pos, slots, kc, vc))
    got = got.view(rows, H + 2 * KV, hd)
    assert torch.equal(got[:, :H + KV], ref)
    assert torch.equal(got[:, H + KV:], v)  # v untouched
    assert torch.equal(kc.view(-1, KV, hd)[slots], ref[:, H:])
    assert torch.equal(vc.view(-1, KV, hd)[slots], v)
    untouched = torch.ones(20 * BS, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(-1, KV, hd)[untouched].any() and not vc.view(-1, KV, hd)[untouched].any()


# one block, partial, full, odd, long; then enough requests that a task is a run of several (decode_attn asks for the
# next request's rows while one computes), of lengths that differ from one to the next; then one context longer than
# all the others together (the run that holds it takes most of the step)
LENS = {"few": [1, 7, 16, 17, 100, 250], "runs": [5, 250, 1, 33, 64, 17, 100, 2, 96, 96, 31, 200, 16, 9, 128, 3, 70,
                                                   250, 1, 48, 65, 7],
        "skewed": [3, 1000, 5, 9, 30, 2, 17, 40, 1, 64]}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 4, 4), (128, 16, 2), (64, 14, 2)])
@pytest.mark.parametrize("batch", sorted(LENS))
def test_decode_attention_reads_the_paged_cache_like_sdpa(kernels, dtype, tol, head_dim, heads, kv_heads, batch):
    g = torch.Generator().manual_seed(head_dim + heads)
    blocks = 64
    kc = torch.randn(blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(LENS[batch], dtype=torch.int32)
    width = -(-int(lens.max()) // BS)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    got = _on_thread(lambda: kernels.decode_attn(q, kc, vc, tables, lens, scale))
    for i, n in enumerate(lens.tolist()):
        blk = tables[i, :-(-n // BS)].long()
        k = kc[blk].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        v = vc[blk].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        ref = F.scaled_dot_product_attention(q[i].float().view(heads, 1, head_dim), k, v, scale=scale,
                                             enable_gqa=True).view(heads, head_dim)
        torch.testing.assert_close(got[i].float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_of_a_request_is_the_same_bits_whatever_its_batch(kernels, dtype):
    """How a batch is shared out among threads (runs of whole requests; a (request, KV head) a task where there are
    too few requests to share out, one request alone among them) changes no bit of any request's output."""
    g = torch.Generator().manual_seed(7)
    blocks, kv_heads, heads, head_dim = 160, 2, 8, 64
    kc = torch.randn(blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([2000, 3, 40, 17, 9, 300, 1, 64, 5, 120, 33, 2], dtype=torch.int32)
    width = -(-int(lens.max()) // BS)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    batch = _on_thread(lambda: kernels.decode_attn(q, kc, vc, tables, lens, 0.125))
    for picked in ([0], [5], [0, 1, 2, 3, 4], [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]):
        at = torch.tensor(picked)
        some = _on_thread(lambda: kernels.decode_attn(q[at].contiguous(), kc, vc, tables[at].contiguous(),
                                                      lens[at].contiguous(), 0.125))
        assert torch.equal(some, batch[at]), picked


def _kept_weights(x: torch.Tensor, temp: float, top_k: int, top_p: float) -> torch.Tensor:
    """The torch reference of one row: softmax of x / temp over the top-k, then the smallest prefix of the
    probabilities sorted from the largest that reaches top_p (of tokens tied at its last value, the first in
    vocabulary order), as weights in vocabulary order."""
    x = x.float() / temp
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    p = torch.softmax(x.double(), -1)
    if top_p < 1.0:
        vals, _ = torch.sort(p, descending=True)
        cum = torch.cumsum(vals, 0)
        at = int(torch.searchsorted(cum, torch.tensor([top_p], dtype=cum.dtype)).clamp(max=p.numel() - 1))
        ties = at + 1 - int((vals > vals[at]).sum())  # of the tokens of the last value, how many the prefix holds
        tied = (p == vals[at]).nonzero().flatten()
        p = torch.where(p > vals[at], p, torch.zeros_like(p))
        p[tied[:ties]] = vals[at]
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 40, 1.0), (1.0, 40, 0.5),
                                              (1.0, 0, 0.999), (1.0, 2000, 0.95)])
def test_sample_rows_draws_the_token_whose_interval_holds_u(kernels, dtype, temp, top_k, top_p):
    """Each kept token owns the slice of [0, 1) that its weight takes in vocabulary order: a u in the middle of a
    token's slice draws that token, for peaked and flat rows, with the rows picked out of a wider batch."""
    g = torch.Generator().manual_seed(top_k + int(100 * top_p))
    width = 3000
    logits = torch.randn(4, width + 7, generator=g)[:, :width]  # rows strided past the vocabulary, as in the engine
    logits[0] *= 6.0  # peaked
    logits[1] *= 0.2  # flat
    logits[2, 17] = float("-inf")  # a banned token
    logits = logits.to(dtype)
    rows = [2, 0, 1]
    for i, row in enumerate(rows):
        w = _kept_weights(logits[row], temp, top_k, top_p)
        cum = torch.cumsum(w, 0)
        kept = w.nonzero().flatten()
        if top_p < 1.0:
            assert kept.numel() < width
        kept = kept[w[kept] > 1e-4 * cum[-1]]  # slices wide against the kernel's float sums
        assert kept.numel() > 0
        picks = kept[torch.linspace(0, kept.numel() - 1, min(25, kept.numel())).long()]
        for j in picks.tolist():
            mid = float((cum[j] - w[j] / 2) / cum[-1])
            u = torch.full((len(rows),), 0.5)
            u[i] = mid
            got = kernels.sample_rows(logits, rows, [temp] * 3, [top_k] * 3, [top_p] * 3, u)
            assert got[i] == j, (row, j, got[i])


def test_sample_rows_fails_a_row_with_a_nan_alone(kernels):
    logits = torch.randn(3, 100)
    logits[1, 5] = float("nan")
    logits[2, :] = float("-inf")  # nothing left to draw
    got = kernels.sample_rows(logits, [0, 1, 2], [1.0] * 3, [0] * 3, [0.9] * 3, torch.rand(3))
    assert 0 <= got[0] < 100 and got[1:] == [-1, -1]


def test_unsupported_combinations_fall_back_or_refuse():
    cpu = torch.device("cpu")
    assert cpu_kernels.choose("off", cpu, torch.float32, torch.float32, 64) is None
    assert cpu_kernels.choose("auto", cpu, torch.bfloat16, torch.float32, 64) is None  # cache in another dtype
    with pytest.raises(ValueError, match="kernels='on'"):
        cpu_kernels.choose("on", cpu, torch.float16, torch.float16, 64)
    assert cpu_kernels.choose("on", cpu, torch.float32, torch.float32, 64) is not None


def _decode_logits(eng, prompts):
    """Prefill the prompts, then decode their last token again from the cache: the decode step's logits."""
    from engine.profiling import Prober

    def job(e):
        reqs, _ = Prober(e)._requests(prompts, 0)
        e.runner.execute(reqs, [])
        for r in reqs:
            r.num_computed_tokens = r.num_tokens - 1
        return e.runner.execute([], reqs).float()
    return eng.run_idle(job)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_step_with_kernels_matches_torch_ops(tiny_checkpoints, dtype):
    prompts = [list(range(3 + i, 40 + 37 * i)) for i in range(5)]
    logits = {}
    for setting in ("on", "off"):
        eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype=dtype, device="cpu", block_size=4,
                                     kv_cache_dtype="model", kernels=setting))
        try:
            assert (eng.backend.kernels is not None) == (setting == "on")
            logits[setting] = _decode_logits(eng, prompts)
        finally:
            eng.shutdown()
    scale = logits["off"].abs().max().item()
    tol = 1e-5 if dtype == "float32" else 0.03  # bf16: rounding of a different summation order
    assert (logits["on"] - logits["off"]).abs().max().item() <= tol * scale
    if dtype == "float32":
        assert torch.equal(logits["on"].argmax(-1), logits["off"].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_first_maximum(kernels, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5000, generator=g).to(dtype)
    x[3, 100] = x[3, 4000] = 50.0  # a tie: the first wins
    x[5] = -float("inf")
    x[6, 77] = float("nan")  # a NaN counts as the maximum
    view = x[:, :4500]  # a row stride other than the width, as the sampler's vocab-limit slice
    got = _on_thread(lambda: kernels.argmax_rows(view))
    assert got == view.max(dim=-1).indices.tolist()
    assert got[3] == 100 and got[6] == 77


@pytest.fixture(params=["float32", "amx", "avx512_bf16", "avx2_fma"])
def packed_dtype(kernels, request):
    """The packed GEMM's variants this CPU runs: fp32 (AVX2 or AVX-512 FMA), and bf16 on each instruction set it
    has (AMX CPUs run both)."""
    if request.param == "float32":
        if not kernels.packed_f32:
            pytest.skip("the fp32 packed GEMM needs AVX2 with FMA")
        yield torch.float32
        return
    if request.param not in kernels.packed_isas:
        pytest.skip(f"this CPU or OS has no {request.param}")
    best = kernels.packed_isa
    kernels.use_packed_isa(request.param)
    yield torch.bfloat16
    kernels.use_packed_isa(best)


def _check_packed_linear(kernels, dtype, rows, n, k=192):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    xs = torch.randn(rows, 2 * k, generator=g).to(dtype)
    x = xs[:, :k]  # rows with a stride
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    h = torch.randn(rows, n, generator=g).to(dtype)
    pw = kernels.pack_weight(w)

    def run():
        plain, biased = kernels.linear(x, pw), kernels.linear(x, pw, b)
        res = h.clone()
        out = kernels.linear(x, pw, b, residual=res)
        return plain, biased, res, out

    plain, biased, res, out = _on_thread(run)
    ref = x.float() @ w.float().t()  # fp32 accumulation, then (bf16) one rounding, as oneDNN does
    tol = 1e-5 if dtype == torch.float32 else 0.01  # fp32: another summation order
    assert plain.shape == (rows, n) and plain.dtype == dtype
    assert (plain.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert (biased.float() - (ref + b.float())).abs().max().item() <= tol * ref.abs().max().item()
    assert out is res  # in place
    assert (res.float() - (h.float() + biased.float())).abs().max().item() <= 2 * tol * res.float().abs().max().item()


def _check_packed_gated(kernels, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    k, inter = 128, 200  # 200 features: 12 full 16-column panels and a partial one
    x = torch.randn(rows, k, generator=g).to(dtype)
    gate, up = ((torch.randn(inter, k, generator=g) / k ** 0.5).to(dtype) for _ in range(2))
    pw = kernels.pack_gated(gate, up)
    got = _on_thread(lambda: kernels.linear(x, pw))
    ref = F.silu(F.linear(x, gate)) * F.linear(x, up)  # the HF MLP's ops
    assert got.shape == (rows, inter)
    # bf16: each product rounds once from fp32, as torch's ops do; a different summation order moves ~1 bf16 ulp
    tol = 1e-5 if dtype == torch.float32 else 0.02
    assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 12, 16, 17, 32, 45, 300])
@pytest.mark.parametrize("n", [96, 100, 576])
def test_packed_linear_matches_f_linear(kernels, packed_dtype, rows, n):
    """Kairos's GEMM on packed weights: plain, with a bias, and adding into a residual in place, for row counts
    around its 16-row AMX tiles and 12-row AVX-512 blocks (6 with AVX2), and output widths that are not a multiple
    of its 32-column blocks."""
    _check_packed_linear(kernels, packed_dtype, rows, n)


@pytest.mark.parametrize("rows", [1, 20])
def test_packed_gated_linear_is_silu_gate_times_up(kernels, packed_dtype, rows):
    _check_packed_gated(kernels, packed_dtype, rows)


def test_packed_fp32_gemm_with_8_lane_vectors(kernels, tmp_path):
    """The fp32 packed GEMM as a CPU with AVX2 but no AVX-512 runs it (8-lane vectors: 1-3 rows over both panels of
    a pair at once, else 6-row blocks a panel at a time): the kernels built again without AVX-512."""
    if "avx512f" not in cpu_kernels._cpu_flags().split():
        pytest.skip("the default build already has 8-lane vectors (no AVX-512 here)")
    avx2 = cpu_kernels.load_source(cpu_kernels.SOURCE, extra_flags=("-mno-avx512f",))
    # no AVX-512: no bf16 dot product nor AMX; bf16 weights run widened in registers on fp32 FMAs
    assert avx2.packed_f32 and avx2.packed_isa == "avx2_fma" and avx2.packed_isas == ["avx2_fma"]
    # 1-3 rows: both panels at once; else a panel at a time, 6 rows a group; below 32 rows in chunks of 32 k, below 64
    # in chunks of 128, then the whole K (K = 192 and 100: a last chunk that is partial, or the only one)
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 40, 70):
        _check_packed_linear(avx2, torch.float32, rows, 100)
    for rows in (2, 8, 40):
        _check_packed_linear(avx2, torch.float32, rows, 100, k=100)
    _check_packed_gated(avx2, torch.float32, 1)
    _check_packed_gated(avx2, torch.float32, 7)
    _check_packed_gated(avx2, torch.float32, 40)
    for bits in (4, 8):  # grid weights: 1-3 rows straight from the blocks, more from unpacked chunks
        _check_grid_gemm(avx2, bits)


def test_packed_linear_refuses_what_it_cannot_run(kernels):
    assert not kernels.packed_linear_supported(torch.bfloat16, 48)  # K must be a multiple of 32
    with pytest.raises(AssertionError):
        kernels.pack_weight(torch.zeros(32, 48, dtype=torch.bfloat16))
    assert not kernels.packed_linear_supported(torch.float16, 64)
    assert kernels.packed_linear_supported(torch.float32, 48) == kernels.packed_f32_built  # fp32: any K
    kernels.use_packed_f32(False)
    try:
        assert not kernels.packed_linear_supported(torch.float32, 64)
    finally:
        kernels.use_packed_f32(True)


@pytest.mark.parametrize("on", [True, False])
def test_fp32_decoder_uses_the_packed_gemm_where_built(tiny_checkpoints, kernels, on):
    kernels.use_packed_f32(on)
    try:
        eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype="float32", device="cpu"))
        try:
            dec = eng.runner.decoder
            assert type(dec.mm).__name__ == ("PackedMatmuls" if on and kernels.packed_f32_built else "TorchMatmuls")
            assert dec.whole_step == (on and kernels.packed_f32_built)
        finally:
            eng.shutdown()
    finally:
        kernels.use_packed_f32(True)


def test_bf16_decoder_uses_the_packed_gemm_where_the_cpu_has_amx_or_avx512_bf16(tiny_checkpoints, kernels):
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["qwen2"], dtype="bfloat16", device="cpu",
                                 kv_cache_dtype="model"))
    try:
        packed = type(eng.runner.decoder.mm).__name__ == "PackedMatmuls"
        assert packed == (kernels.packed_isa is not None)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_whole_step_decode_equals_the_per_op_decoder(tiny_checkpoints, kernels, packed_dtype, family):
    """A decode-only step runs every layer in one kernel call (`decode_layers`): the same kernels in the same
    order as the per-op Python loop, so the logits are bit-identical (Qwen2: with the q|k|v bias)."""
    prompts = [list(range(3 + i, 40 + 37 * i)) for i in range(5)]
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints[family], dtype=str(packed_dtype).removeprefix("torch."),
                                 device="cpu", block_size=4, kv_cache_dtype="model"))
    try:
        dec = eng.runner.decoder
        assert dec.whole_step
        calls = []
        real = kernels.decode_layers
        eng.backend.kernels = type("Spy", (), {"__getattr__": lambda s, name: getattr(kernels, name),
                                               "decode_layers": lambda s, *a: calls.append(1) or real(*a)})()
        kernels.phase_times(on=True)
        whole = _decode_logits(eng, prompts)
        phases = kernels.phase_times(on=False)
        assert calls  # the whole-step path ran
        # and timed its phases
        assert list(phases) == list(cpu_kernels.PHASES) and all(ms > 0 for ms in phases.values()), phases
        assert kernels.phase_times() == phases  # off: the sums stay
        dec.whole_step = False
        per_op = _decode_logits(eng, prompts)
    finally:
        eng.shutdown()
    assert torch.equal(whole, per_op)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thread_team_computes_what_openmp_computes(tiny_checkpoints, kernels, dtype):
    """The thread team (`CpuKernels.set_team`) runs the same chunks as the OpenMP loops, only on other threads:
    the decode step's logits are bit-identical, on the whole-step and the per-op paths."""
    prompts = [list(range(3 + i, 40 + 37 * i)) for i in range(5)]
    eng = LLMEngine(EngineConfig(model=tiny_checkpoints["llama"], dtype=dtype, device="cpu", block_size=4,
                                 kv_cache_dtype="model", num_threads=2))
    was = kernels.team
    try:
        logits = {}
        for team in (False, True):
            kernels.set_team(team)
            logits[team] = _decode_logits(eng, prompts)
            if eng.runner.decoder.whole_step:
                eng.runner.decoder.whole_step = False
                logits[team, "per op"] = _decode_logits(eng, prompts)
                eng.runner.decoder.whole_step = True
    finally:
        kernels.set_team(was)
        eng.shutdown()
    assert torch.equal(logits[True], logits[False])
    if (False, "per op") in logits:
        assert torch.equal(logits[True, "per op"], logits[False, "per op"])


def test_team_workers_take_the_nice_value_they_are_given():
    """A favoured engine process runs its own thread at nice 0 and its team's workers where Ray put it
    (engine/core_proc.py hands the value over in TEAM_NICE_ENV)."""
    import os
    import subprocess
    import sys

    from engine.config import TEAM_ENV, TEAM_NICE_ENV
    code = """
import os, time, torch
from engine.backends.cpu import kernels as cpu_kernels
k = cpu_kernels.load()
assert k.team
torch.set_num_threads(2)
x, w = torch.randn(4096, 64), torch.ones(64)
for _ in range(20):
    k.rms_norm(x, w, 1e-6)
deadline = time.monotonic() + 10  # a worker sets its nice value once the OS first runs it: on a busy box, later
while True:
    nice = {int(open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[16])
            for t in os.listdir("/proc/self/task")}
    if nice - {os.getpriority(os.PRIO_PROCESS, 0)} or time.monotonic() > deadline:
        break
    k.rms_norm(x, w, 1e-6)
    time.sleep(0.01)
print(sorted(nice - {os.getpriority(os.PRIO_PROCESS, 0)}))
"""
    env = dict(os.environ, **{TEAM_ENV: "1", TEAM_NICE_ENV: "7"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[7]"


@pytest.mark.parametrize("rows", [1, 3, 7, 40, 70])
def test_bf16_gemm_on_avx2_fma_is_the_fp32_gemm_of_the_widened_values(kernels, rows):
    """The "avx2_fma" packed ISA (CPUs without a bf16 dot product) widens the bf16 weights and rows to fp32 and sums k
    by k as the fp32 GEMM does: its output is the fp32 GEMM's on the same values, rounded once to bf16, bit for bit
    (1-3 rows, 6-row groups, k chunks of 32 and 128, the whole K); with a bias, within a bf16 rounding."""
    if "avx2_fma" not in kernels.packed_isas or not kernels.packed_f32:
        pytest.skip("needs AVX2 with FMA")
    g = torch.Generator().manual_seed(rows)
    k, n = 192, 100
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    best = kernels.packed_isa
    try:
        kernels.use_packed_isa("avx2_fma")
        got = _on_thread(lambda: kernels.linear(x, kernels.pack_weight(w)))
        got_b = _on_thread(lambda: kernels.linear(x, kernels.pack_weight(w), b))
    finally:
        kernels.use_packed_isa(best)
    ref = _on_thread(lambda: kernels.linear(x.float(), kernels.pack_weight(w.float())))
    assert torch.equal(got, ref.bfloat16())
    ref_b = _on_thread(lambda: kernels.linear(x.float(), kernels.pack_weight(w.float()), b.float()))
    assert (got_b.float() - ref_b).abs().max().item() <= 0.01 * ref_b.abs().max().item()


def _checkpoint_with(src, dst, values):
    """A copy of the checkpoint folder src at dst whose every tensor is values(name, tensor)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: values(k, v) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return dst


def _packed_logits(ckpt):
    """An fp32 engine's whole-step decode logits after a prefill (`_decode_logits`) for 5 prompts and for 1, the
    dtypes of its first layer's packed weights (q|k|v, o, gate|up, down), and its LM head's."""
    prompts = [list(range(3 + i, 40 + 37 * i)) for i in range(5)]
    eng = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu", block_size=4,
                                 kv_cache_dtype="model"))
    try:
        dec = eng.runner.decoder
        assert dec.whole_step
        layer = dec.layers[0]
        dtypes = tuple(w.data.dtype for w in (layer.qkv_w, layer.o_w, layer.mlp, layer.down_w))
        logits = torch.cat([_decode_logits(eng, prompts), _decode_logits(eng, prompts[-1:])])
        return logits, dtypes, dec.lm_head.data.dtype
    finally:
        eng.shutdown()


def _packed_logits_on_and_off(ckpt, use):
    """`_packed_logits` with a packing on, then with it off (`use(False)`); on again after."""
    try:
        on = _packed_logits(ckpt)
        use(False)
        return on, _packed_logits(ckpt)
    finally:
        use(True)


def test_fp32_weights_with_bf16_values_run_compact_with_the_same_logits(tiny_checkpoints, kernels, tmp_path):
    """An fp32 model whose weights are all bf16 values (a bf16 checkpoint run in fp32) is packed as bf16 where AVX2's
    FMAs can widen it ("compact"): the decoder's weights take half the bytes, and the logits of a prefill and of a
    whole-step decode are bit-identical to the fp32 packing's."""
    if not kernels.compact_weights:
        pytest.skip("needs the fp32 packed GEMM and AVX2 with FMA")
    ckpt = _checkpoint_with(tiny_checkpoints["llama"], tmp_path / "llama-bf16-values",
                            lambda k, v: v.bfloat16().float())
    (compact, compact_dtypes, _), (plain, plain_dtypes, _) = _packed_logits_on_and_off(
        ckpt, kernels.use_compact_weights)
    assert set(compact_dtypes) == {torch.bfloat16} and set(plain_dtypes) == {torch.float32}
    assert torch.equal(compact, plain)


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_finds_the_blocks_of_a_de_quantized_gguf_weight_and_refuses_others(bits):
    """`grid` (pure): a de-quantized Q4_1 (bits 4) or Q8_0 (bits 8) weight gives d, m and q that rebuild every value
    bit for bit; a weight with one value off the grid, random values, or K not a multiple of 32 gives None."""
    g = torch.Generator().manual_seed(bits)
    quant, qtype, qmax = (q4_1_round_trip, torch.uint8, 15) if bits == 4 else (q8_0_round_trip, torch.int8, 127)
    w = quant(torch.randn(70, 96, generator=g))
    d, m, q = cpu_kernels.grid(w, bits)
    assert d.shape == m.shape == (70, 3) and q.shape == (70, 3, 32) and q.dtype == qtype
    assert int(q.max()) <= qmax and (bits == 4 or not m.any())
    rebuilt = ((d.unsqueeze(-1) * q.float()) + m.unsqueeze(-1)).reshape(70, 96)
    assert torch.equal(rebuilt.view(torch.int32), w.view(torch.int32))
    d, m, q = cpu_kernels.grid(torch.zeros(40, 32), bits)  # all-zero blocks (padding): d = m = q = 0
    assert not (d.any() or m.any() or q.any())
    off = w.clone()
    off[69, 95] = torch.nextafter(off[69, 95], torch.tensor(1.0))  # one ulp off, in the last row: past the probe
    assert cpu_kernels.grid(off, bits) is None
    assert cpu_kernels.grid(torch.randn(100, 64, generator=g), bits) is None
    assert cpu_kernels.grid(quant(torch.randn(10, 64, generator=g))[:, :48], bits) is None
    assert cpu_kernels.grid(w.bfloat16(), bits) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_gemm_is_the_fp32_gemm_bit_for_bit(kernels, bits):
    """fp32 rows on a grid weight (its q, d and m: 19% / 31% of fp32's bytes) give the packed fp32 GEMM's output bit
    for bit, for every walk (with 8-lane vectors 1-3 rows straight from the blocks, k chunks of 32 and 128, the whole
    K) and epilogue, with a partial panel pair (100 columns)."""
    if not kernels.grid_weights:
        pytest.skip("needs the fp32 packed GEMM")
    _check_grid_gemm(kernels, bits)


def _check_grid_gemm(kernels, bits):
    g = torch.Generator().manual_seed(1)
    quant, dtype = (q4_1_round_trip, torch.uint8) if bits == 4 else (q8_0_round_trip, torch.int8)
    for n, k in ((100, 96), (64, 192)):
        w, up = (quant(torch.randn(n, k, generator=g) / k ** 0.5) for _ in range(2))
        packed, plain = kernels.pack_exact(w), kernels.pack_weight(w)
        assert packed.data.dtype == dtype and packed.data.numel() * (5 if bits == 4 else 3) < plain.data.numel() * 4
        gated = kernels.pack_exact_gated(w, up)
        assert gated.data.dtype == dtype and gated.gated
        b = torch.randn(n, generator=g)
        for rows in (1, 2, 3, 5, 7, 13, 40, 70, 300):  # 300: two passes of 256 rows, each unpacking again
            x = torch.randn(rows, 2 * k, generator=g)[:, :k]  # rows with a stride
            h = torch.randn(rows, n, generator=g)

            def run(w1, w2):
                res = h.clone()
                return (kernels.linear(x, w1), kernels.linear(x, w1, b), kernels.linear(x, w1, b, residual=res),
                        kernels.linear(x, w2))
            got = _on_thread(lambda: run(packed, gated))
            ref = _on_thread(lambda: run(plain, kernels.pack_gated(w, up)))
            for a, r in zip(got, ref):
                assert torch.equal(a, r), (n, k, rows)


def test_fp32_weights_of_a_de_quantized_gguf_run_as_grid_weights_with_the_same_logits(tiny_checkpoints, kernels,
                                                                                      tmp_path):
    """An fp32 model de-quantized from a GGUF (as the default model is: Q4_1 layers, a Q8_0 embedding that is also
    its LM head) is packed as grid4 and grid8, each weight in its own format: here with a Q8_0 down_proj and a
    bf16-valued o_proj (compact) among Q4_1 weights, the whole-step decode's logits after a prefill are bit-identical
    to the fp32 packing's."""
    if not kernels.grid_weights:
        pytest.skip("needs the fp32 packed GEMM")

    def gguf_values(name, v):
        if v.dim() != 2:
            return v
        if "o_proj" in name:
            return v.bfloat16().float()
        return q8_0_round_trip(v) if "embed" in name or "lm_head" in name or "down_proj" in name else q4_1_round_trip(v)
    ckpt = _checkpoint_with(tiny_checkpoints["llama"], tmp_path / "llama-gguf-values", gguf_values)
    (grid, grid_dtypes, grid_head), (plain, plain_dtypes, plain_head) = _packed_logits_on_and_off(
        ckpt, kernels.use_grid_weights)
    assert grid_dtypes == (torch.uint8, torch.bfloat16, torch.uint8, torch.int8) and grid_head == torch.int8
    assert plain_dtypes == (torch.float32, torch.bfloat16, torch.float32, torch.float32)
    assert plain_head == torch.float32
    assert torch.equal(grid, plain)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernels_find_the_grid_that_grid_finds(kernels, bits):
    """`CpuKernels.find_grid` (one pass in the kernels) returns what `grid` (torch, the reference) returns, d, m and q
    bit for bit, or None alike: on-grid weights, one value off, random values, zero blocks, steps past fp16's range."""
    g = torch.Generator().manual_seed(10 + bits)
    quant = q4_1_round_trip if bits == 4 else q8_0_round_trip
    on = quant(torch.randn(300, 128, generator=g))
    off = on.clone()
    off[150, 77] = torch.nextafter(off[150, 77], torch.tensor(-1.0))
    cases = [on, off, torch.randn(70, 64, generator=g), torch.zeros(40, 32),
             quant(torch.randn(80, 96, generator=g)) * 1e6, quant(torch.randn(64, 32, generator=g) * 1e-6),
             q4_1_round_trip(torch.randn(50, 64, generator=g)), q8_0_round_trip(torch.randn(50, 64, generator=g))]
    # a step past fp16's range: d from the fp32 quotient (its fp16 rounding is inf, and the neighbours fail)
    q = torch.randint(0, 16 if bits == 4 else 128, (16, 32), generator=g).float()
    q[:, 0], q[:, 1] = 0, 15 if bits == 4 else 127
    wide = (torch.full((16, 1), 2e37 if bits == 4 else 2e36) * q) + (-1.5e38 if bits == 4 else 0.0)
    assert cpu_kernels.grid(wide, bits) is not None
    cases.append(wide)
    for w in cases:
        want, got = cpu_kernels.grid(w, bits), kernels.find_grid(w, bits)
        assert (want is None) == (got is None)
        if want is not None:
            for a, b in zip(want, got):
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert kernels.find_grid(on, bits) is not None and kernels.find_grid(off, bits) is None
