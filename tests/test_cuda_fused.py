"""engine.backends.cuda.fused (RMSNorm, residual add + RMSNorm, silu * up, RoPE + paged K/V write) against the torch
ops they replace, on CPU tensors through Triton's interpreter, and their wiring into the CUDA backend.

The kernels keep HF's numerics (each rounding where the torch path rounds), so in 16-bit they match the torch
path bit for bit here, and RoPE + cache write matches exactly in fp32 too. tests/gpu/test_cuda_fused_gpu.py runs
the same checks compiled on a GPU at the 8B shape.
"""
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("a GPU is present: tests/gpu/test_cuda_fused_gpu.py runs these kernels compiled",
                allow_module_level=True)
if "triton" not in sys.modules:  # triton.jit picks the interpreter when a kernel is decorated
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton); the CUDA backend's kernels need it")
import triton.language as tl  # noqa: E402

if type(tl.cdiv).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (set it in the environment to run "
                "these tests in a CPU-only process)", allow_module_level=True)

from tests.paged_attention_reference import patch_interpreter_for_numpy  # noqa: E402

patch_interpreter_for_numpy()
from engine.backends.base import rms_norm as ref_rms_norm  # noqa: E402
from engine.backends.cuda import fused  # noqa: E402
from engine.backends.cuda.backend import CudaBackend, CudaMatmuls  # noqa: E402
from engine.backends.torch_ref import TorchBackend, TorchMatmuls  # noqa: E402

assert fused.INTERPRETED

HALF = (torch.bfloat16, torch.float16)


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    """16-bit: bit for bit (`exact`), else at most one rounding step apart in under 1% of the elements (an fp32 exp
    one ulp apart can round a value that lies next to a midpoint the other way); fp32: within a few ulps (the fp32
    reductions and exp run in another order)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype in HALF:
        if exact:
            assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        else:
            ulp = 2.0 ** -(7 if want.dtype == torch.bfloat16 else 10)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=2 * ulp)
            assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (37, 200), (5, 8192)])
def test_rms_norm_matches_hf(dtype, rows, hidden):
    g = _gen(0)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    _same(fused.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))


def test_rms_norm_leading_dims_fp32_weight_chunked_rows_and_no_rows():
    g = _gen(1)
    x = torch.randn(2, 3, 96, generator=g).to(torch.bfloat16)
    w32 = 1 + 0.1 * torch.randn(96, generator=g)
    y = fused.rms_norm(x, w32, 1e-5)  # the weight in fp32: the product in fp32, as torch promotes it
    assert y.shape == x.shape and y.dtype == torch.float32
    _same(y, ref_rms_norm(x, w32, 1e-5))
    # a row longer than one block: normalised in chunks (two reads of the row)
    x = torch.randn(9, 200, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(200, generator=g)).to(torch.bfloat16)
    _same(fused.rms_norm(x, w, 1e-6, _max_block=64), ref_rms_norm(x, w, 1e-6))
    assert fused.rms_norm(x[:0], w, 1e-6).shape == (0, 200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_block", [fused.MAX_BLOCK_N, 64])
def test_add_rms_norm_in_place_and_into_out(dtype, max_block):
    g = _gen(2)
    h0 = (4 * torch.randn(13, 320, generator=g)).to(dtype)
    delta = torch.randn(13, 320, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(320, generator=g)).to(dtype)
    want_h = h0 + delta
    want_y = ref_rms_norm(want_h, w, 1e-6)

    h = h0.clone()
    got_h, got_y = fused.add_rms_norm(h, delta, w, 1e-6, _max_block=max_block)
    assert got_h.data_ptr() == h.data_ptr()  # in place by default
    assert torch.equal(got_h, want_h)  # the add rounds once, as torch's
    _same(got_y, want_y)

    h = h0.clone()
    out = torch.empty_like(h)
    got_h, got_y = fused.add_rms_norm(h, delta, w, 1e-6, h_out=out, _max_block=max_block)
    assert got_h is out and torch.equal(h, h0) and torch.equal(out, want_h)
    _same(got_y, want_y)


# ---------------------------------------------------------------------------------------------------------------
# silu(gate) * up
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_torch(dtype):
    g = _gen(3)
    n = 300
    wide = (4 * torch.randn(21, 2 * n + 8, generator=g)).to(dtype)
    gu = wide[:, :2 * n]  # rows strided, as a view of a wider buffer
    want = F.silu(gu[:, :n]) * gu[:, n:]
    _same(fused.silu_mul(gu, n), want, exact=False)
    out = torch.full((21, n + 5), 7.0, dtype=dtype)
    fused.silu_mul(gu, n, out=out[:, :n])
    _same(out[:, :n], want, exact=False)
    assert (out[:, n:] == 7).all()
    assert fused.silu_mul(gu[:0], n).shape == (0, n)


# ---------------------------------------------------------------------------------------------------------------
# RoPE + cache write
# ---------------------------------------------------------------------------------------------------------------

def _tables(n: int, hd: int, dtype: torch.dtype, distinct_halves: bool = False):
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.outer(torch.arange(n).float(), inv)
    e = torch.cat((f, 1.3 * f if distinct_halves else f), -1)
    return e.cos().to(dtype), e.sin().to(dtype)


def _torch_rope_write(qkv, H, KV, cos, sin, positions, slots, cache, layer):
    """The decoder's path without the fused call (KairosDecoder.__call__'s other branch) + TorchBackend.write_kv."""
    T, hd = qkv.shape[0], cos.shape[1]
    heads = qkv.view(T, H + 2 * KV, hd)
    c, s = (t.index_select(0, positions)[:, None] for t in (cos, sin))
    qk = heads[:, :H + KV]
    half = hd // 2
    qk = qk * c + torch.cat((-qk[..., half:], qk[..., :half]), -1) * s
    meta = SimpleNamespace(cache=cache, slot_mapping=slots)
    TorchBackend.write_kv(None, layer, qk[:, H:], heads[:, H + KV:], meta)
    return qk


def _cache(layers, blocks, bs, KV, hd, dtype):
    k = torch.randn(layers, blocks, bs, KV, hd).to(dtype)
    return SimpleNamespace(k=k, v=torch.randn_like(k), num_kv_heads=KV, head_dim=hd, dtype=dtype, block_size=bs)


@pytest.mark.parametrize("H,KV,hd,dtype,table_dtype", [
    (4, 2, 16, torch.float32, torch.float32),
    (4, 2, 16, torch.bfloat16, torch.bfloat16),
    (8, 2, 80, torch.bfloat16, torch.bfloat16),  # half a head (40) not a power of two
    (32, 8, 128, torch.bfloat16, torch.bfloat16),  # the 8B shape's heads
    (6, 6, 32, torch.float16, torch.float32),  # MHA, tables in fp32: the rotation rounds to fp32
])
def test_rope_write_matches_the_decoders_torch_path(H, KV, hd, dtype, table_dtype):
    torch.manual_seed(4)
    T, bs, blocks, layer = 11, 4, 9, 1
    cos, sin = _tables(64, hd, table_dtype, distinct_halves=True)
    qkv = torch.randn(T, (H + 2 * KV) * hd).to(dtype)
    positions = torch.randint(0, 64, (T,))
    positions[-3:] = 0  # padding rows of a graph's batch: position 0, the scratch block's slot
    slots = torch.randperm((blocks - 1) * bs)[:T]
    slots[-3:] = (blocks - 1) * bs  # the scratch block (written more than once: any of the rows may land)
    want_cache = _cache(2, blocks, bs, KV, hd, dtype)
    got_cache = SimpleNamespace(**{**vars(want_cache), "k": want_cache.k.clone(), "v": want_cache.v.clone()})
    v_before = qkv.view(T, H + 2 * KV, hd)[:, H + KV:].clone()

    want_qk = _torch_rope_write(qkv.clone(), H, KV, cos, sin, positions, slots, want_cache, layer)
    fused.rope_write(qkv, H, KV, cos, sin, positions, slots, got_cache.k[layer], got_cache.v[layer])

    heads = qkv.view(T, H + 2 * KV, hd)
    assert torch.equal(heads[:, :H + KV], want_qk.to(dtype))  # exact, fp32 included
    assert torch.equal(heads[:, H + KV:], v_before)  # v is not touched
    real = slice(0, T - 3)
    for got, want in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        flat_g, flat_w = got[layer].view(-1, KV, hd), want[layer].view(-1, KV, hd)
        assert torch.equal(flat_g[slots[real]], flat_w[slots[real]])
        keep = torch.ones(flat_g.shape[0], dtype=torch.bool)
        keep[slots] = False
        assert torch.equal(flat_g[keep], flat_w[keep])  # nothing else written
        assert torch.equal(got[1 - layer], want[1 - layer])  # nor another layer
    scratch = got_cache.k[layer].view(-1, KV, hd)[slots[-1]]
    assert any(torch.equal(scratch, want_qk[r, H:].to(dtype)) for r in range(T - 3, T))


def test_rope_write_casts_into_an_fp32_cache_and_rejects_bad_shapes():
    torch.manual_seed(5)
    H, KV, hd, T = 4, 2, 16, 5
    cos, sin = _tables(16, hd, torch.bfloat16)
    qkv = torch.randn(T, (H + 2 * KV) * hd).to(torch.bfloat16)
    cache = _cache(1, 4, 4, KV, hd, torch.float32)
    want = SimpleNamespace(**{**vars(cache), "k": cache.k.clone(), "v": cache.v.clone()})
    positions, slots = torch.arange(T) + 3, torch.arange(T) + 2
    _torch_rope_write(qkv.clone(), H, KV, cos, sin, positions, slots, want, 0)
    fused.rope_write(qkv, H, KV, cos, sin, positions, slots, cache.k[0], cache.v[0])
    assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)
    with pytest.raises(ValueError, match="qkv"):
        fused.rope_write(qkv[:, 1:], H, KV, cos, sin, positions, slots, cache.k[0], cache.v[0])
    with pytest.raises(ValueError, match="k_cache"):
        fused.rope_write(qkv, H, KV, cos, sin, positions, slots, cache.k[0, :, :, :1], cache.v[0, :, :, :1])
    with pytest.raises(ValueError, match="cos"):
        fused.rope_write(qkv, H, KV, cos[:, :8], sin[:, :8], positions, slots, cache.k[0], cache.v[0])
    with pytest.raises(ValueError, match="slot_mapping"):
        fused.rope_write(qkv, H, KV, cos, sin, positions[:2], slots, cache.k[0], cache.v[0])


# ---------------------------------------------------------------------------------------------------------------
# The CUDA backend's wiring
# ---------------------------------------------------------------------------------------------------------------

def test_cuda_backend_uses_the_fused_ops_where_triton_runs():
    on = CudaBackend(torch.device("cpu"))
    assert on.fused is fused and on.fused_rope_write and on.identity()["fused"]
    mm = on.matmuls(torch.bfloat16, False, (64,))
    assert isinstance(mm, CudaMatmuls)
    for off in (CudaBackend(torch.device("cpu"), kernels="off"), CudaBackend(torch.device("cpu"), fused_ops=False)):
        assert off.fused is None and not off.fused_rope_write
        assert type(off.matmuls(torch.float32, False, (64,))) is TorchMatmuls

    g = _gen(6)
    dt, D, inner, T = torch.bfloat16, 64, 96, 7
    x = torch.randn(T, D, generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dt)
    assert torch.equal(on.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
    gate, up = (torch.nn.Linear(D, inner, bias=False).to(dt) for _ in range(2))
    down = (0.1 * torch.randn(D, inner, generator=g)).to(dt)
    ref = TorchMatmuls()
    packed = mm.pack_mlp(gate, up)
    h = torch.randn(T, D, generator=g).to(dt)
    _same(mm.mlp(x, packed, down, h), ref.mlp(x, packed, down, h), exact=False)
    # the proposed decoder hook: each residual add fused with the RMSNorm after it (h updated in place)
    o_w = (0.1 * torch.randn(D, D, generator=g)).to(dt)
    want_h = ref.residual(x, o_w, None, h)
    got_h, got_y = mm.residual_norm(x, o_w, None, h.clone(), w, 1e-6)
    assert torch.equal(got_h, want_h) and torch.equal(got_y, ref_rms_norm(want_h, w, 1e-6))
    d = ref.linear(fused.silu_mul(ref.linear(x, packed[0]), packed[1]), down)
    got_h, got_y = mm.mlp_norm(x, packed, down, h.clone(), w, 1e-6)
    assert torch.equal(got_h, h + d) and torch.equal(got_y, ref_rms_norm(h + d, w, 1e-6))


def test_engine_over_the_fused_ops_gives_the_cpu_backends_tokens(tiny_checkpoints, monkeypatch):
    """Qwen3 (per-head q/k norms before the fused RoPE + cache write), fp32, prefill then decodes: the CUDA
    backend's path (interpreted on CPU) runs every fused op and gives the CPU backend's greedy tokens."""
    from core.sampling import SamplingParams
    from tests.test_backends import _run

    calls = {n: 0 for n in ("rms_norm", "silu_mul", "rope_write")}
    for name in calls:
        real = getattr(fused, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(fused, name, counted)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 12)), list(range(20, 41))]
    want, _ = _run(tiny_checkpoints["qwen3"], prompts, params, dtype="float32", backend="cpu")
    got, eng = _run(tiny_checkpoints["qwen3"], prompts, params, dtype="float32", backend="cuda")
    assert eng.backend.fused is fused
    assert got == want
    assert all(n > 0 for n in calls.values()), calls


# ---------------------------------------------------------------------------------------------------------------
# Compiled for Hopper, without a GPU
# ---------------------------------------------------------------------------------------------------------------

_COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
import triton
import triton.language as tl
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(f"no ahead-of-time compile API in triton {triton.__version__}: {e}")
    sys.exit(3)
from engine.backends.cuda import fused as fz
from engine.backends.cuda import sampling as sm

assert not fz.INTERPRETED and not sm._INTERPRETED, "unset TRITON_INTERPRET"
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def build(fn, meta, ptrs, warps, **options):
    sig = {n: "constexpr" if n in meta else ptrs.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    # pointers, strides and sizes divisible by 16, as Triton's launcher specializes them for the 8B shape
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n][0] in "*i"}
    k = triton.compile(ASTSource(fn, sig, constexprs=meta, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, **options})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", res)
    row = {"kernel": fn.__name__, **{k: str(v) for k, v in meta.items() if k.startswith(("BLOCK", "ADD", "ONE"))},
           "v4": len(re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.v4", k.asm["ptx"])),
           "scalar16": len(re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.b16", k.asm["ptx"])),
           "fma": len(re.findall(r"\bfma\.", k.asm["ptx"]))}
    if m:
        row.update(regs=int(m[1]), stack=int(m[2]), local=int(m[3]))
    print(json.dumps(row), flush=True)


bf = "*bf16"
norm_ptrs = {n: bf for n in ("x_ptr", "d_ptr", "s_ptr", "w_ptr", "y_ptr")}
for n, add in ((4096, False), (4096, True), (8192, True), (2 * fz.MAX_BLOCK_N, True)):
    bm, bn, one, w = fz._norm_config(64, n, fz.MAX_BLOCK_N)
    build(fz._rms_norm_kernel, dict(ADD=add, BLOCK_M=bm, BLOCK_N=bn, ONE_PASS=one, FIX_BF16=False), norm_ptrs, w)
build(fz._silu_mul_kernel, dict(BLOCK_M=1, BLOCK_N=1024, FIX_BF16=False), {"gu_ptr": bf, "out_ptr": bf}, 4)
build(fz._rope_write_kernel, dict(NUM_HEADS=32, NUM_KV=8, HEAD_DIM=128, HALF=64, BLOCK_SIZE=16, RND=tl.bfloat16,
                                  BLOCK_R=1024 // 64, BLOCK_HALF=64, FIX_BF16=False),
      {"qkv_ptr": bf, "cos_ptr": bf, "sin_ptr": bf, "pos_ptr": "*i64", "slot_ptr": "*i64", "k_cache_ptr": bf,
       "v_cache_ptr": bf}, 4, **fz.ROPE_COMPILE)
# the sampler's top-p draw (engine/backends/cuda/sampling.py) over fp32 rows of the 128k vocabulary
build(sm._top_p_kernel, dict(ROUNDS=sm.ROUNDS, BLOCK=2048), {"p_ptr": "*fp32", "total_ptr": "*fp32",
      "top_p_ptr": "*fp32", "u_ptr": "*fp32", "out_ptr": "*i64"}, 8)
'''


def test_kernels_compile_for_hopper_vectorised_without_spills():
    """The interpreter accepts code the GPU compiler may not: Triton's compiler and ptxas build the 8B shape's
    kernels for sm_90 here (no GPU), in a process without TRITON_INTERPRET, and the sampler's top-p draw
    (sampling.py). Each must compile without register spills and move its rows with 16-byte loads and stores (no
    2-byte accesses). RoPE compiles without fused multiply-adds (its roundings are torch's)."""
    import json
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 7, r.stdout
    for row in rows:
        assert row.get("local", 0) == 0 and row.get("stack", 0) == 0, row
        assert row["v4"] > 0 and row["scalar16"] == 0, row
    # RoPE rounds each product and the sum as torch does: no fused multiply-add may skip a rounding
    assert [row["fma"] for row in rows if row["kernel"] == "_rope_write_kernel"] == [0], rows
