"""engine.backends.cuda.fused compiled on a GPU at the Llama-3.1-8B shape (hidden 4096, MLP 14336, 32 heads over 8
KV heads of 128, bf16) against the torch ops they replace; and CUDA-graph capture of all four with new inputs.

Skipped without CUDA. `KAIROS_GPU_TESTS_ON_CPU=1` together with `TRITON_INTERPRET=1` (set before the process
starts) dry-runs this module on the CPU through Triton's interpreter at reduced sizes.

Run as a script on a GPU (`python -m tests.gpu.test_cuda_fused_gpu`), it prints each op's time per call from a CUDA
graph and its effective bandwidth at batch 1 / 64 / 256.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from tests.gpu.timing import graph_seconds
from tests.paged_attention_reference import triton_device_or_skip

ON_CUDA, DEV = triton_device_or_skip("fused kernels")
ON_CPU = not ON_CUDA

from engine.backends.base import rms_norm as ref_rms_norm  # noqa: E402
from engine.backends.cuda import fused  # noqa: E402

HIDDEN, INTER, H, KV, HD, BS = 4096, 14336, 32, 8, 128, 16
if ON_CPU:  # the interpreter runs each program in numpy: a smaller MLP
    INTER = 1024
DT = torch.bfloat16
ROWS = [1, 64, 256] if ON_CUDA else [1, 9]


def _close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 1e-3) -> None:
    """Equal but for one rounding step in a few elements: the GPU's fp32 reductions, rsqrt and exp differ from
    torch's in the last bits, which moves a value next to a bf16 midpoint to the other side now and then."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2 ** -7)
    frac = (got != want).float().mean().item()
    assert frac <= max_mismatch, f"{frac:.2%} of the elements differ from the torch path"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_add_rms_norm_8b_hidden(rows):
    g = _gen(rows)
    x = (3 * torch.randn(rows, HIDDEN, device=DEV, generator=g)).to(DT)
    d = torch.randn(rows, HIDDEN, device=DEV, generator=g).to(DT)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEV, generator=g)).to(DT)
    _close(fused.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))
    h = x.clone()
    h_new, y = fused.add_rms_norm(h, d, w, 1e-5)
    assert h_new.data_ptr() == h.data_ptr() and torch.equal(h_new, x + d)
    _close(y, ref_rms_norm(x + d, w, 1e-5))


def test_rms_norm_wide_rows_one_pass_and_chunked():
    """70B's hidden (8192) from registers, and a row past MAX_BLOCK_N in chunks (two reads)."""
    g = _gen(7)
    for n in (8192, fused.MAX_BLOCK_N + 4096):
        x = torch.randn(8, n, device=DEV, generator=g).to(DT)
        d = torch.randn(8, n, device=DEV, generator=g).to(DT)
        w = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(DT)
        _close(fused.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
        h_new, y = fused.add_rms_norm(x.clone(), d, w, 1e-6)
        assert torch.equal(h_new, x + d)
        _close(y, ref_rms_norm(x + d, w, 1e-6))


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_8b_mlp(rows):
    gu = (3 * torch.randn(rows, 2 * INTER, device=DEV, generator=_gen(rows))).to(DT)
    _close(fused.silu_mul(gu, INTER), F.silu(gu[:, :INTER]) * gu[:, INTER:])


def _tables(n: int):
    inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=DEV).float() / HD))
    e = torch.outer(torch.arange(n, device=DEV).float(), inv)
    e = torch.cat((e, e), -1)
    return e.cos().to(DT), e.sin().to(DT)


def _torch_rope_write(qkv, cos, sin, positions, slots, k_cache, v_cache):
    """The decoder's path without the fused call + TorchBackend.write_kv's index_copy_."""
    T = qkv.shape[0]
    heads = qkv.view(T, H + 2 * KV, HD)
    c, s = (t.index_select(0, positions)[:, None] for t in (cos, sin))
    qk = heads[:, :H + KV]
    qk = qk * c + torch.cat((-qk[..., HD // 2:], qk[..., :HD // 2]), -1) * s
    k_cache.view(-1, KV, HD).index_copy_(0, slots, qk[:, H:].to(k_cache.dtype))
    v_cache.view(-1, KV, HD).index_copy_(0, slots, heads[:, H + KV:].to(v_cache.dtype))
    return qk


@pytest.mark.parametrize("rows", ROWS)
def test_rope_write_8b_heads(rows):
    g = _gen(rows + 1)
    blocks = 2 * rows + 4
    cos, sin = _tables(8192)
    qkv = torch.randn(rows, (H + 2 * KV) * HD, device=DEV, generator=g).to(DT)
    positions = torch.randint(0, 8192, (rows,), device=DEV, generator=g)
    slots = torch.randperm(blocks * BS, device=DEV, generator=g)[:rows]
    kc = torch.randn(blocks, BS, KV, HD, device=DEV, generator=g).to(DT)
    vc = torch.randn_like(kc)
    kr, vr = kc.clone(), vc.clone()
    want = _torch_rope_write(qkv.clone(), cos, sin, positions, slots, kr, vr)
    fused.rope_write(qkv, H, KV, cos, sin, positions, slots, kc, vc)
    heads = qkv.view(rows, H + 2 * KV, HD)
    _close(heads[:, :H + KV], want, max_mismatch=0.0)  # each rounding made explicitly, as torch's: exact
    _close(kc, kr, max_mismatch=0.0)
    assert torch.equal(vc, vr)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a GPU")
def test_fused_ops_cuda_graph_capture_and_replay_with_new_inputs():
    """All four ops captured once in one graph (outputs allocated inside it), replayed after their inputs, positions
    and slots change in place: bit-identical to eager calls on the same inputs."""
    B, blocks = 32, 80
    cos, sin = _tables(4096)
    x = torch.zeros(B, HIDDEN, device=DEV, dtype=DT)
    d = torch.zeros_like(x)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEV, generator=_gen(0))).to(DT)
    gu = torch.zeros(B, 2 * INTER, device=DEV, dtype=DT)
    qkv = torch.zeros(B, (H + 2 * KV) * HD, device=DEV, dtype=DT)
    pos = torch.zeros(B, dtype=torch.long, device=DEV)
    slots = torch.zeros(B, dtype=torch.long, device=DEV)
    kc = torch.zeros(blocks, BS, KV, HD, device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)

    def fill(seed: int) -> None:
        g = _gen(seed)
        for t in (x, d, gu, qkv):
            t.copy_(torch.randn(t.shape, device=DEV, generator=g).to(DT))
        pos.copy_(torch.randint(0, 4096, (B,), device=DEV, generator=g))
        slots.copy_(torch.randperm(blocks * BS, device=DEV, generator=g)[:B])
        pos[-4:] = 0  # padding rows of a decode graph

    def call():
        y = fused.rms_norm(x, w, 1e-5)
        h, y2 = fused.add_rms_norm(x, d, w, 1e-5, h_out=torch.empty_like(x))
        a = fused.silu_mul(gu, INTER)
        fused.rope_write(qkv, H, KV, cos, sin, pos, slots, kc, vc)
        return y, h, y2, a

    fill(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
    for seed in (2, 3):
        fill(seed)
        qkv0 = qkv.clone()
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs] + [qkv.clone(), kc.clone(), vc.clone()]
        qkv.copy_(qkv0)
        want = list(call()) + [qkv, kc, vc]
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Micro-benchmark (run as a script on a GPU; prints, asserts nothing)
# ---------------------------------------------------------------------------------------------------------------

def _time_graph(fn, reps: int = 50) -> float:
    """Seconds per call of `fn`, captured 20 times in one graph (no launch overhead, as in a decode graph)."""
    return graph_seconds([fn] * 20, reps)


def main() -> None:
    cos, sin = _tables(8192)
    w = torch.ones(HIDDEN, device=DEV, dtype=DT)
    print(f"{'op':<12}{'rows':>6}{'fused us':>10}{'torch us':>10}{'fused GB/s':>12}")
    for rows in (1, 64, 256):
        x = torch.randn(rows, HIDDEN, device=DEV, dtype=DT)
        d = torch.randn_like(x)
        gu = torch.randn(rows, 2 * INTER, device=DEV, dtype=DT)
        qkv = torch.randn(rows, (H + 2 * KV) * HD, device=DEV, dtype=DT)
        pos = torch.randint(0, 8192, (rows,), device=DEV)
        slots = torch.randperm(rows * 4, device=DEV)[:rows]
        kc = torch.zeros(rows * 4 // BS + 1, BS, KV, HD, device=DEV, dtype=DT)
        vc = torch.zeros_like(kc)
        e = x.element_size()
        cases = [
            ("rms_norm", lambda: fused.rms_norm(x, w, 1e-5), lambda: ref_rms_norm(x, w, 1e-5), 2 * x.numel() * e),
            ("add_norm", lambda: fused.add_rms_norm(x, d, w, 1e-5),
             lambda: (lambda s: ref_rms_norm(s, w, 1e-5))(x + d), 4 * x.numel() * e),
            ("silu_mul", lambda: fused.silu_mul(gu, INTER), lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:],
             gu.numel() * e * 3 // 2),
            ("rope_write", lambda: fused.rope_write(qkv, H, KV, cos, sin, pos, slots, kc, vc),
             lambda: _torch_rope_write(qkv, cos, sin, pos, slots, kc, vc),
             (2 * (H + KV) * HD + 2 * 2 * KV * HD + 4 * HD) * rows * e),
        ]
        for name, f, ref, nbytes in cases:
            t, tr = _time_graph(f), _time_graph(ref)
            print(f"{name:<12}{rows:>6}{t * 1e6:>10.2f}{tr * 1e6:>10.2f}{nbytes / t / 1e9:>12.0f}")


if __name__ == "__main__":
    if not ON_CUDA:
        raise SystemExit("needs a GPU")
    main()
