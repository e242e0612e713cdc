"""A pure-torch reference for engine.backends.cuda.triton_attention, and paged-cache fixtures, shared by
tests/test_triton_attention.py (Triton's CPU interpreter) and tests/gpu/test_triton_attention_cuda.py (compiled,
on a GPU). Importing this module imports neither triton nor the kernels: each test module controls how they load."""
import torch


def reference_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Per sequence: gather its tokens through the block table, expand GQA, causal softmax in fp32."""
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for s, L in enumerate(seq_lens.tolist()):
        a, b = qsl[s], qsl[s + 1]
        if b == a or L == 0:
            continue
        t = torch.arange(L, device=q.device)
        blocks = block_tables[s, t // bs].long()
        k = k_cache[blocks, t % bs].float().repeat_interleave(H // kvh, dim=1)  # [L, H, D]
        v = v_cache[blocks, t % bs].float().repeat_interleave(H // kvh, dim=1)
        qs = q[a:b].float()  # [n, H, D]
        n = b - a
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        qpos = L - n + torch.arange(n, device=q.device)
        scores = scores.masked_fill(t[None, None, :] > qpos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, extra_blocks=3, seed=0):
    """A cache holding the sequences in shuffled (non-contiguous) blocks. Every cache row that belongs to no
    sequence's context (free blocks, the rows past a context in its last block) is NaN, and each block-table row's
    tail past its context holds out-of-range ids: a kernel that reads either shows it."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // block_size) for L in seq_lens]
    max_blocks = max(nblk + [1]) + 2
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables = torch.randint(10**6, 2**30, (len(seq_lens), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for s, L in enumerate(seq_lens):
        blocks = perm[used:used + nblk[s]]
        used += nblk[s]
        tables[s, :nblk[s]] = blocks.to(torch.int32)
        valid[blocks] = (torch.arange(nblk[s] * block_size) < L).view(nblk[s], block_size)
    k[~valid] = float("nan")
    v[~valid] = float("nan")
    return k.to(device, dtype), v.to(device, dtype), tables.to(device)


TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "non-finite output: a kernel read a row or block it must not"
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def run_decode_case(seq_lens, group, head_dim, block_size, dtype, device, num_splits, num_kv_heads=2, seed=0,
                    workspace=None):
    """Decode through the kernels against the reference; returns the kernel's output."""
    from engine.backends.cuda import triton_attention as ta

    H = num_kv_heads * group
    k, v, tables = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    B = len(seq_lens)
    q = torch.randn(B, H, head_dim, generator=g).to(device, dtype)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    ta.paged_decode_attention(q, k, v, tables, ctx, scale, out, num_splits=num_splits, workspace=workspace)
    # One query per live sequence; a padded slot (context 0) has none, and its row must be zeros.
    ref = torch.zeros(B, H, head_dim, device=device)
    live = [i for i, L in enumerate(seq_lens) if L > 0]
    if live:
        ref[live] = reference_attention(q[live], k, v, tables[live], torch.arange(len(live) + 1, device=device),
                                        ctx[live], scale)
    assert_close(out, ref, dtype)
    return out


def run_prefill_case(q_lens, seq_lens, group, head_dim, block_size, dtype, device, num_kv_heads=2, seed=0):
    """Prefill (q_lens new tokens of sequences of seq_lens) through the kernels against the reference."""
    from engine.backends.cuda import triton_attention as ta

    H = num_kv_heads * group
    k, v, tables = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    T = sum(q_lens)
    q = torch.randn(T, H, head_dim, generator=g).to(device, dtype)
    qsl = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill_attention(q, k, v, tables, qsl, sl, scale, out, max_query_len=max(q_lens))
    ref = reference_attention(q, k, v, tables, qsl, sl, scale)
    assert_close(out, ref, dtype)
    return out


def patch_interpreter_for_numpy():
    """Triton <= 3.7's interpreter turns a scalar (a 1-element array there) into a loop bound with int(array),
    which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed in 3.8). Re-patch __index__ with an explicit
    element read on top of the interpreter's own patches (its scope restores both, last first)."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_kairos_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kairos_fix = True
    interpreter._patch_lang_tensor = patched


# Kernel variants that tests/test_triton_attention.py compiles for Hopper (sm_90) without a GPU: (kernel, heads,
# KV heads, head_dim, block_size, dtype, num_splits or max_query_len). They cover the 8B shape's decode with and
# without splits, head_dim 256, the fp32 paths (tiny checkpoints' decode, the 1B shape's prefill), and both 16-bit
# prefill tile shapes.
COMPILE_CASES = [
    ("decode", 32, 8, 128, 16, "bfloat16", 1),
    ("decode", 32, 8, 128, 16, "bfloat16", 8),
    ("decode", 8, 4, 256, 32, "float16", 4),
    ("decode", 4, 2, 16, 16, "float32", 2),
    ("prefill", 32, 8, 128, 16, "bfloat16", 1024),
    ("prefill", 32, 8, 128, 16, "bfloat16", 1),
    ("prefill", 32, 8, 64, 16, "float32", 512),
]


def compile_report(arch: int = 90) -> None:
    """Compile COMPILE_CASES' kernels ahead of time for CUDA `arch` with Triton's own compiler and ptxas (no GPU
    needed) and print one JSON line per kernel: registers, stack and local (spill) bytes, shared memory. Run in a
    process where TRITON_INTERPRET is unset. Exits 3 if this Triton lacks the ahead-of-time API."""
    import json
    import os
    import re
    import subprocess
    import sys
    import tempfile

    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"no ahead-of-time compile API in triton {triton.__version__}: {e}")
        sys.exit(3)
    from engine.backends.cuda import triton_attention as ta

    assert not ta.INTERPRETED, "unset TRITON_INTERPRET"
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def build(fn, meta, dtype):
        meta = dict(meta)
        opts = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
        sig = {}
        for name in fn.arg_names:
            if name in meta:
                sig[name] = "constexpr"
            elif name in ("part_acc_ptr", "part_ml_ptr"):
                sig[name] = "*fp32"
            elif name in ("bt_ptr", "ctx_ptr", "qsl_ptr", "seqlen_ptr"):
                sig[name] = "*i32"
            elif name.endswith("_ptr"):
                sig[name] = "*" + short[dtype]
            else:
                sig[name] = "fp32" if name == "qk_scale" else "i32"
        # Pointers and strides divisible by 16, as Triton's launcher specializes them for a real cache.
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in sig if sig[n].startswith("*") or n.startswith("stride")}
        kernel = triton.compile(ASTSource(fn, sig, constexprs=meta, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32), options=opts)
        row = {"kernel": fn.__name__, "dtype": short[dtype], **{k: v for k, v in meta.items() if k.isupper()},
               **opts, "shared": kernel.metadata.shared}
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", res)
        if m:
            row.update(regs=int(m[1]), stack=int(m[2]), local=int(m[3]))
        print(json.dumps(row), flush=True)

    for kind, h, kvh, d, bs, dt, n in COMPILE_CASES:
        dtype = getattr(torch, dt)
        if kind == "decode":
            meta1, meta2 = ta._decode_meta(h, kvh, d, bs, dtype, n)
            build(ta._decode_stage1_kernel, meta1, dtype)
            if n > 1:
                build(ta._decode_stage2_kernel, meta2, dtype)
        else:
            build(ta._prefill_kernel, ta._prefill_meta(h, kvh, d, bs, dtype, n), dtype)


def triton_device_or_skip(what: str) -> tuple[bool, str]:
    """For a module of tests/gpu that runs Triton kernels: (on CUDA, its device). Without CUDA the module is skipped,
    unless KAIROS_GPU_TESTS_ON_CPU=1 and TRITON_INTERPRET=1 (set before the process starts) dry-run it on the CPU
    through Triton's interpreter. `what` names the kernels in the skip reason."""
    import os

    import pytest
    import torch

    on_cuda = torch.cuda.is_available()
    on_cpu = (not on_cuda and os.environ.get("KAIROS_GPU_TESTS_ON_CPU") == "1"
              and os.environ.get("TRITON_INTERPRET") == "1")
    if not (on_cuda or on_cpu):
        pytest.skip("no CUDA device (KAIROS_GPU_TESTS_ON_CPU=1 TRITON_INTERPRET=1 dry-runs this module on the CPU)",
                    allow_module_level=True)
    pytest.importorskip("triton", reason=f"triton is not installed: the CUDA backend's {what} need it")
    if on_cpu:
        patch_interpreter_for_numpy()
    return on_cuda, "cuda" if on_cuda else "cpu"
