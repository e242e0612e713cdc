"""Kairos's own CPU kernels (`cpu_kernels.cpp`): RMSNorm, RoPE + paged-cache write, paged decode attention, and
(on CPUs with AMX or AVX512-BF16) the linear layers on bf16 weights packed once at load.

On CPU the decoder's small per-layer ops cost more in dispatch and in passes over memory than in arithmetic:
a decode step ran ~45 torch ops a layer, and decode attention gathered every context's blocks into a dense
copy before one SDPA call per group of similar lengths. These kernels do that work in three calls a layer and
read the paged cache through the block table directly. The GEMMs of a small decode step are bound by reading
the weights, which the packed GEMM streams faster than oneDNN's bf16 GEMM at 1-32 rows, and it fuses the bias, the
residual add and silu(gate) * up into its epilogue.
Where there is AVX512-BF16 but no AMX (AMD Zen 4) the same packed panels feed AVX-512's bf16 dot product; each
thread asks for its next panel pair while it computes on this one. A step whose tokens all attend through the paged kernel runs every layer in one call
(`decode_layers`), which can time its own phases (`phase_times`). fp32 weights run on a packed fp32 GEMM, stored in
fewer bytes wherever that gives the same output bit for bit: as bf16 where every value is a bf16 value ("compact"),
or as 4- / 8-bit q with per-block d and m where the values are a de-quantized GGUF's (`grid`, "grid4" / "grid8").

Built at first use with the system's C++ compiler (`g++ -O3 -march=native -fopenmp`, tens of seconds) into
the cache (`$KAIROS_CACHE/kernels`, else `~/.cache/kairos/kernels`), keyed by the source, the flags and the CPU's
flags, and called through ctypes (which releases the GIL). Where there is no compiler, or the build fails, or
the CPU or dtypes are not supported, the engine keeps its torch ops (`EngineConfig.kernels`: auto warns, on
refuses to start, off never builds). float32 and bfloat16 only, with the KV cache in the activations' dtype.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import TEAM_ENV, TEAM_NICE_ENV
from engine.file_lock import held

log = logging.getLogger("kairos.cpu")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off"]
ABI_VERSION = 10
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_INHERIT_NICE = 1000  # Team::kInheritNice: the team's workers keep the nice value of the thread that starts them
MAX_HEAD_DIM = 1024
MAX_HEADS_PER_KV = 64  # query heads sharing one KV head (decode_attn's per-head softmax scratch)
PLAIN, RESIDUAL, SILU_MUL = 0, 1, 2  # the packed GEMM's epilogues (`Epilogue` in cpu_kernels.cpp)
COMPACT = 2  # kairos_gemm_packed's dtype code for fp32 rows on a compact (bf16-packed) fp32 weight
GRID4, GRID8 = 3, 4  # kairos_gemm_packed's dtype codes for fp32 rows on a grid4 / grid8 fp32 weight
GRID_K = 32  # a grid weight's block of k (`kGridK` in cpu_kernels.cpp)
PACKED_ISAS = {1: "avx2_fma", 2: "avx512_bf16", 3: "amx"}  # `PackedIsa` in cpu_kernels.cpp (0: none)
# `Phase` in cpu_kernels.cpp: the parts of a layer that `decode_layers` times (`phase_times`)
PHASES = ("rms_norm", "qkv", "rope_write", "attention", "o_proj", "gate_up", "down")

_i64, _f32, _int, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


@functools.cache
def cpu_flag_line() -> str | None:
    """The "flags" line of /proc/cpuinfo, read once; None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None


def _cpu_flags() -> str:
    line = cpu_flag_line()
    return platform.processor() if line is None else line


def _library_path(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = tuple(FLAGS)) -> Path:
    root = Path(os.environ.get("KAIROS_CACHE", Path.home() / ".cache" / "kairos")).expanduser() / "kernels"
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), _cpu_flags().encode(), platform.machine().encode(),
                 subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout):
        key.update(part)
    return root / f"kairos_cpu-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path, source: Path = SOURCE, flags: tuple[str, ...] = tuple(FLAGS)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        proc = subprocess.run([compiler, *flags, str(source), "-o", str(out)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, path)  # atomic: a concurrent build by another process just wins or loses the rename


class CpuKernels:
    """The loaded library; every method takes torch tensors and checks what the C code assumes."""

    def __init__(self, lib: ctypes.CDLL, build: str = "") -> None:
        self.lib = lib
        self.build = build  # the library's name: a hash of the source, the flags and the CPU
        lib.kairos_rms_norm.argtypes = [_int, _p, _i64, _p, _p, _i64, _i64, _f32, _int]
        lib.kairos_rope_write.argtypes = [_int, _p, _i64, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _int]
        lib.kairos_decode_attn.argtypes = [_int, _p, _i64, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64,
                                           _f32, _int]
        lib.kairos_argmax_rows.argtypes = [_int, _p, _i64, _i64, _i64, _p, _int]
        lib.kairos_sample_rows.argtypes = [_int, _p, _i64, _p, _i64, _i64, _p, _p, _p, _p, _p, _int]
        for fn in (lib.kairos_rms_norm, lib.kairos_rope_write, lib.kairos_decode_attn, lib.kairos_argmax_rows,
                   lib.kairos_sample_rows):
            fn.restype = None
        lib.kairos_gemm_packed.argtypes = [_int, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _p, _p, _i64, _int, _int]
        lib.kairos_gemm_packed.restype = _int
        lib.kairos_packed_f32.restype = _int
        lib.kairos_packed_gemm_enable.argtypes = [_int]
        lib.kairos_packed_gemm_enable.restype = _int
        lib.kairos_layer_fields.restype = _int
        lib.kairos_grid_find.argtypes = [_p, _i64, _i64, _int, _p, _p, _p, _int]
        lib.kairos_grid_find.restype = _int
        self.layer_fields = lib.kairos_layer_fields()
        lib.kairos_decode_layers.argtypes = [_int, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _p, _p, _p,
                                             _p, _p, _i64, _p, _i64, _f32, _p, _int]
        lib.kairos_decode_layers.restype = _int
        lib.kairos_phase_times.argtypes = [_int, _p]
        lib.kairos_phase_times.restype = _int
        assert lib.kairos_phase_times(-1, None) == len(PHASES)
        # what the packed GEMM runs on: "amx" (built with AMX, and the OS grants this process its tile state),
        # "avx512_bf16" (AVX-512's bf16 dot product), "avx2_fma" (bf16 weights widened in registers, fp32 FMAs: CPUs
        # without a bf16 dot product), or None (no packed GEMM)
        best = lib.kairos_packed_gemm_enable(-1)  # -1: the best this CPU and OS have
        self.packed_isa = PACKED_ISAS.get(best)
        self.packed_isas = [name for isa, name in PACKED_ISAS.items() if isa <= best]
        # fp32 layers on the packed fp32 GEMM (built with AVX2 or AVX-512 FMA); `use_packed_f32` turns it off
        self.packed_f32_built = bool(lib.kairos_packed_f32())
        self.packed_f32 = self.packed_f32_built
        # fp32 weights whose values are all bf16 values (a bf16 checkpoint run in fp32) packed as bf16 ("compact"):
        # the same output bit for bit from half the bytes (`compactable`); `use_compact_weights` turns it off
        self.use_compact_weights(True)
        # fp32 weights whose blocks of 32 k hold values d * q + m with 4-bit q (a Q4_1 GGUF de-quantized, as the default
        # model's layers are) or 8-bit q (Q8_0, as its embedding) packed as their q ("grid4", "grid8", `grid`): the
        # same output bit for bit from a fraction of the bytes; `use_grid_weights` turns it off
        self.use_grid_weights(True)
        lib.kairos_set_team.argtypes = [_int, _int]
        lib.kairos_set_team.restype = None
        nice = os.environ.get(TEAM_NICE_ENV, "")
        self.set_team(os.environ.get(TEAM_ENV) == "1", int(nice) if nice.lstrip("-").isdigit() else None)

    def set_team(self, on: bool, worker_nice: int | None = None) -> None:
        """Parallel loops on Kairos's thread team (`on`) or as OpenMP regions; `worker_nice`: the nice value the
        team's workers take when they start (None: their creator's). For the whole process: the library is one."""
        self.team = on
        self.lib.kairos_set_team(int(on), _INHERIT_NICE if worker_nice is None else worker_nice)

    def use_packed_isa(self, name: str | None) -> None:
        """Run the packed GEMM on `name` (one of `packed_isas`: what this CPU and OS offer; None: no packed GEMM, so
        decoders built from now on use oneDNN or torch) for the whole process; tests and benchmarks compare with it."""
        assert name is None or name in self.packed_isas, (name, self.packed_isas)
        code = next((isa for isa, n in PACKED_ISAS.items() if n == name), 0)
        self.packed_isa = PACKED_ISAS.get(self.lib.kairos_packed_gemm_enable(code))

    def use_packed_f32(self, on: bool) -> None:
        """fp32 decoders built from now on use the packed fp32 GEMM (`on`, where built) or torch's linear; tests and
        benchmarks compare the two."""
        self.packed_f32 = bool(on) and self.packed_f32_built

    def packed_linear_supported(self, dtype: torch.dtype, *inner_dims: int) -> bool:
        """Whether `pack_weight` + `linear` can run layers of this dtype whose input widths (K) are `inner_dims`:
        bf16 on AMX or AVX512-BF16 with K a multiple of 32, fp32 on AVX2 or AVX-512 FMA."""
        if dtype == torch.float32:
            return self.packed_f32 and all(k > 0 for k in inner_dims)
        return self.packed_isa is not None and dtype == torch.bfloat16 and all(k % 32 == 0 for k in inner_dims)

    def use_compact_weights(self, on: bool) -> None:
        """Pack compactable fp32 weights as bf16 from now on (where this build can; weights packed already stay)."""
        self.compact_weights = bool(on) and self.packed_f32_built and "avx2_fma" in self.packed_isas

    def compactable(self, *ws: torch.Tensor) -> bool:
        """Whether fp32 weights may be packed compact: every value a bf16 value (so bf16 holds it exactly), K a
        multiple of 32 (the bf16 layout), and compact packing on."""
        return self.compact_weights and all(
            w.dtype == torch.float32 and w.shape[-1] % 32 == 0 and torch.equal(w, w.bfloat16().float()) for w in ws)

    def use_grid_weights(self, on: bool) -> None:
        """Pack fp32 weights that lie on a 4- or 8-bit grid (`grid`) as such from now on (where this build can; weights
        packed already stay)."""
        self.grid_weights = bool(on) and self.packed_f32_built

    def pack_exact(self, w: torch.Tensor) -> PackedWeight:
        """`w` packed in the fewest bytes that give the fp32 (or bf16) GEMM's output bit for bit: grid4 or grid8
        where its values lie on such a grid (`grid`), else compact where they are bf16 values (`compactable`), else
        as is."""
        for bits in GRID_BITS if self.grid_weights else ():
            found = self.find_grid(w, bits)
            if found is not None:
                return pack_grid(w, *found)
        return self.pack_weight(w, self.compactable(w))

    def pack_exact_gated(self, gate: torch.Tensor, up: torch.Tensor) -> PackedWeight:
        """`pack_gated` in the fewest exact bytes: each weight as `pack_exact` packs it where both come out in one
        format, else both in the best format they share."""
        g, u = self.pack_exact(gate), self.pack_exact(up)
        if g.data.dtype == u.data.dtype:
            return stack_gated(g, u)
        return self.pack_gated(gate, up, self.compactable(gate, up))

    def find_grid(self, w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`grid(w, bits)`, searched by the kernels in one pass on every thread (the same d, m and q: op for op the
        same search), or by `grid` where this build cannot."""
        if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % GRID_K or w.numel() == 0 or w.device.type != "cpu":
            return None
        w = w.detach().contiguous()
        n, k = w.shape
        d, m = torch.empty(n, k // GRID_K, dtype=torch.float32), torch.empty(n, k // GRID_K, dtype=torch.float32)
        q = torch.empty(n, k // GRID_K, GRID_K, dtype=torch.uint8 if bits == 4 else torch.int8)
        found = self.lib.kairos_grid_find(w.data_ptr(), n, k, bits, d.data_ptr(), m.data_ptr(), q.data_ptr(),
                                          torch.get_num_threads())
        if found < 0:
            return grid(w, bits)
        return (d, m, q) if found == 1 else None

    @staticmethod
    def pack_weight(w: torch.Tensor, compact: bool = False) -> PackedWeight:
        """W [N, K] -> panels of 16 output columns (N padded to a multiple of 32): bf16, each K/2 rows of (16 columns
        x 2 consecutive k); fp32, each K rows of 16 columns, or with `compact` (see `compactable`) as bf16, which
        fp32 rows multiply through the same FMAs."""
        if compact:
            assert w.dtype == torch.float32  # its values were checked by `compactable`
            w = w.bfloat16()
        n, k = w.shape
        assert w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and k % 32 == 0)
        padded = -(-n // 32) * 32
        wp = w.new_zeros((padded, k))
        wp[:n] = w
        if w.dtype == torch.float32:
            data = wp.view(padded // 16, 16, k).permute(0, 2, 1).contiguous()
        else:
            data = wp.view(padded // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return PackedWeight(data, n, k, padded // 32)

    @classmethod
    def pack_gated(cls, gate: torch.Tensor, up: torch.Tensor, compact: bool = False) -> PackedWeight:
        """gate, up [I, K] -> one weight whose panel pairs are (gate, up) of the same 16 features; `linear` with it
        returns silu(x @ gate^T) * (x @ up^T) [., I]."""
        assert up.shape == gate.shape
        return stack_gated(cls.pack_weight(gate, compact), cls.pack_weight(up, compact))

    def linear(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (rows may be strided; W's dtype) @ W^T (+ bias) [M, N]; with `residual` [M, N] contiguous, adds
        the (rounded) product to it in place and returns it. A gated weight returns silu(gate) * up instead."""
        m, k = x.shape
        code = weight_code(x.dtype, w)
        assert code is not None and x.stride(1) == 1 and k == w.k, (x.dtype, w.data.dtype)
        if residual is not None:
            assert residual.shape == (m, w.n) and residual.is_contiguous() and residual.dtype == x.dtype
            out, mode = residual, RESIDUAL
        else:
            out, mode = torch.empty((m, w.n), dtype=x.dtype), SILU_MUL if w.gated else PLAIN
        assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype and not w.gated)
        rc = self.lib.kairos_gemm_packed(code, x.data_ptr(), x.stride(0), m, k,
                                         w.data.data_ptr(),
                                         w.pairs, w.n, None if bias is None else bias.data_ptr(),
                                         None if residual is None else residual.data_ptr(), out.data_ptr(), w.n,
                                         mode, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"kairos_gemm_packed failed ({rc})")
        return out

    @staticmethod
    def supports(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, heads_per_kv: int = 1) -> bool:
        return (dtype in DTYPES and cache_dtype == dtype and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0
                and heads_per_kv <= MAX_HEADS_PER_KV)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [n, d] with unit stride along d; returns a new contiguous [n, d]."""
        n, d = x.shape
        assert x.stride(1) == 1 and w.is_contiguous() and w.dtype == x.dtype
        y = torch.empty((n, d), dtype=x.dtype)
        self.lib.kairos_rms_norm(DTYPES[x.dtype], x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), n, d, eps,
                                 torch.get_num_threads())
        return y

    def rope_write(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """qkv [n, (H + 2 KV) * hd] (rows may be strided): RoPE on its q and k heads in place, then k and v
        into the layer's cache [blocks, block_size, KV, hd] at `slots`. cos/sin: [max_position, hd] tables."""
        n = qkv.shape[0]
        hd = cos.shape[-1]
        assert qkv.stride(1) == 1 and positions.dtype == slots.dtype == torch.int64
        assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * hd and kc.shape[-1] == hd  # full-width RoPE only
        assert cos.dtype == sin.dtype == kc.dtype == vc.dtype == qkv.dtype
        assert cos.is_contiguous() and sin.is_contiguous() and kc.is_contiguous() and vc.is_contiguous()
        self.lib.kairos_rope_write(DTYPES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                                   positions.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(), n,
                                   num_heads, num_kv_heads, hd, torch.get_num_threads())

    def decode_attn(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                    ctx_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [n, H, hd] (rows may be strided, heads contiguous), one query token per request; tables [n, max
        blocks] int32; ctx_lens [n] int32 (the context including this token). Returns [n, H, hd]: `out` (a
        contiguous tensor of that shape, written in place) when given."""
        n, nh, hd = q.shape
        _, bs, nkv, _ = kc.shape
        assert q.stride(2) == 1 and q.stride(1) == hd and tables.dtype == ctx_lens.dtype == torch.int32
        assert tables.is_contiguous() and ctx_lens.is_contiguous() and nh % nkv == 0
        assert nh // nkv <= MAX_HEADS_PER_KV and kc.is_contiguous() and vc.is_contiguous() and kc.dtype == q.dtype
        if out is None:
            out = torch.empty((n, nh, hd), dtype=q.dtype)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        self.lib.kairos_decode_attn(DTYPES[q.dtype], q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(),
                                    tables.data_ptr(), tables.shape[1], ctx_lens.data_ptr(), out.data_ptr(), n, nh,
                                    nkv, hd, bs, scale, torch.get_num_threads())
        return out

    def layer_table(self, layers: list[tuple]) -> torch.Tensor:
        """The per-layer int64 table `decode_layers` reads: for each layer (ln_in, ln_post, qkv PackedWeight, qkv
        bias or None, o PackedWeight, o bias or None, gate|up PackedWeight, down PackedWeight, k cache, v cache).
        The caller keeps every tensor alive as long as the table."""
        rows = []
        for ln_in, ln_post, qkv, qkv_b, o, o_b, gu, down, kc, vc in layers:
            assert gu.gated and not qkv.gated and kc.is_contiguous() and vc.is_contiguous()
            ptr = (lambda t: 0 if t is None else t.data_ptr())
            codes = [weight_code(ln_in.dtype, pw) for pw in (qkv, o, gu, down)]
            assert None not in codes, (ln_in.dtype, [pw.data.dtype for pw in (qkv, o, gu, down)])
            formats = sum(WEIGHT_FORMATS[c] << 4 * i for i, c in enumerate(codes))  # `FormatShift` in cpu_kernels.cpp
            rows.append([ptr(ln_in), ptr(ln_post), ptr(qkv.data), qkv.pairs, ptr(qkv_b), ptr(o.data), o.pairs, ptr(o_b),
                         ptr(gu.data), gu.pairs, ptr(down.data), down.pairs, ptr(kc), ptr(vc), formats])
            assert len(rows[-1]) == self.layer_fields
        return torch.tensor(rows, dtype=torch.int64)

    def decode_layers(self, table: torch.Tensor, shape: DecoderShape, h: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                      lens: torch.Tensor, block_size: int, scratch: torch.Tensor) -> None:
        """Every decoder layer of a step whose tokens all attend through the paged kernel (decodes, and prefill tokens
        as rows whose context ends at themselves; bf16 or fp32, packed weights) in one call: h [n, hidden] is updated
        in place; the step's K/V go into the caches named in `table`."""
        n = h.shape[0]
        assert h.is_contiguous() and h.dtype in DTYPES and h.shape[1] == shape.hidden
        assert positions.dtype == slots.dtype == torch.int64 and tables.dtype == lens.dtype == torch.int32
        assert tables.is_contiguous() and lens.shape == (n,) and tables.shape[0] == n
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == shape.head_dim
        assert scratch.dtype == h.dtype and scratch.numel() >= shape.scratch_elems(n)
        rc = self.lib.kairos_decode_layers(DTYPES[h.dtype], table.shape[0], table.data_ptr(), h.data_ptr(), n,
                                           shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.inter,
                                           shape.eps, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                           slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                           block_size, shape.scale, scratch.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"kairos_decode_layers failed ({rc})")

    def phase_times(self, on: bool | None = None) -> dict[str, float]:
        """ms that `decode_layers` has spent in each of `PHASES` (summed over layers and calls, wall time of the
        calling thread) since timing last went on; `on` True/False turns timing on (restarting the sums) or off
        for the whole process. Off by default: it costs two clock reads a phase."""
        out = torch.zeros(len(PHASES), dtype=torch.int64)
        self.lib.kairos_phase_times(-1 if on is None else int(on), out.data_ptr())
        return {name: ns / 1e6 for name, ns in zip(PHASES, out.tolist())}

    def argmax_rows(self, x: torch.Tensor) -> list[int]:
        """Each row's first maximum (torch's `max(-1).indices`; a NaN counts as the maximum) of a 2-D float32 or
        bfloat16 tensor with unit stride along the row, as a list. One pass to find the maximum, one to find it."""
        n, width = x.shape
        if x.dtype not in DTYPES or x.stride(1) != 1 or x.device.type != "cpu":
            return x.max(dim=-1).indices.tolist()
        out = torch.empty(n, dtype=torch.int64)
        self.lib.kairos_argmax_rows(DTYPES[x.dtype], x.data_ptr(), x.stride(0), n, width, out.data_ptr(),
                                    torch.get_num_threads())
        return out.tolist()

    def sample_rows(self, x: torch.Tensor, rows: list[int], temperature: list[float], top_k: list[int],
                    top_p: list[float], u: torch.Tensor) -> list[int] | None:
        """One token for each of x's `rows` (logits [n, width], float32 or bfloat16, unit stride along the row):
        temperature, top-k (0: off), top-p (1: off) and an inverse-CDF draw with the row's uniform number u, as
        `engine.sampler`'s torch path does; -1 for a row whose logits hold a NaN or +inf. None where x does not
        fit (the caller then runs the torch path)."""
        if x.dtype not in DTYPES or x.stride(1) != 1 or x.device.type != "cpu":
            return None
        m = len(rows)
        idx = torch.tensor(rows, dtype=torch.int64)
        temp, p = torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_p, dtype=torch.float32)
        k, u = torch.tensor(top_k, dtype=torch.int64), u.to(torch.float32).contiguous()
        out = torch.empty(m, dtype=torch.int64)
        self.lib.kairos_sample_rows(DTYPES[x.dtype], x.data_ptr(), x.stride(0), idx.data_ptr(), m, x.shape[1],
                                    temp.data_ptr(), k.data_ptr(), p.data_ptr(), u.data_ptr(), out.data_ptr(),
                                    torch.get_num_threads())
        return out.tolist()


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear layer's weight in panels of 16 output columns (`CpuKernels.pack_weight`): for bf16 the layout of AMX's
    tiles, which AVX512-BF16's dot product reads as it is too; for fp32 K rows of 16 columns; compact fp32 as bf16;
    grid4 / grid8 fp32 (uint8 / int8 data) as blocks of 32 k (`pack_grid`). data's first dimension is the panels."""
    data: torch.Tensor
    n: int  # output features
    k: int  # input features
    pairs: int  # pairs of 16-column panels
    gated: bool = False  # (gate, up) panel pairs: the product is silu(gate) * up, n features


def weight_code(rows: torch.dtype, w: PackedWeight) -> int | None:
    """kairos_gemm_packed's dtype code for rows of dtype `rows` on `w`, or None where they do not go together."""
    if rows == w.data.dtype and rows in DTYPES:
        return DTYPES[rows]
    if rows == torch.float32:
        return {torch.bfloat16: COMPACT, torch.uint8: GRID4, torch.int8: GRID8}.get(w.data.dtype)
    return None


def stack_packed(ws: list[PackedWeight], along_k: bool) -> PackedWeight | None:
    """Weights packed alike (`pack_weight`: the same data dtype, not gated, no grid) stacked in their packed form: their
    output features one after another (each a whole number of panel pairs: N a multiple of 32), or with `along_k`
    their inputs side by side (the same N, each K even): the weight `pack_weight` would make of the stacked matrix,
    for a few copies instead of a pack. None where they are not packed so."""
    first = ws[0].data
    if any(type(w) is not PackedWeight or w.gated or w.data.dtype != first.dtype for w in ws) \
            or first.dtype not in (torch.float32, torch.bfloat16):
        return None
    if along_k:
        if any(w.n != ws[0].n or w.k % 2 for w in ws):
            return None
        return PackedWeight(torch.cat([w.data for w in ws], 1), ws[0].n, sum(w.k for w in ws), ws[0].pairs)
    if any(w.k != ws[0].k or w.n != 32 * w.pairs for w in ws):
        return None
    return PackedWeight(torch.cat([w.data for w in ws], 0), sum(w.n for w in ws), ws[0].k, sum(w.pairs for w in ws))


WEIGHT_FORMATS = {DTYPES[torch.float32]: 0, DTYPES[torch.bfloat16]: 0, COMPACT: 1, GRID4: 2, GRID8: 3}  # `WeightFormat`


def stack_gated(gate: PackedWeight, up: PackedWeight) -> PackedWeight:
    """One weight whose panel pairs are (gate, up) of the same 16 features, from the two packed alike: `linear`
    with it returns silu(x @ gate^T) * (x @ up^T) [., I]."""
    assert (gate.n, gate.k, gate.data.dtype, gate.data.shape) == (up.n, up.k, up.data.dtype, up.data.shape)
    panels = -(-gate.n // 16)
    g, u = (w.data.view(w.data.shape[0], -1)[:panels] for w in (gate, up))
    return PackedWeight(torch.stack([g, u], 1).contiguous(), gate.n, gate.k, panels, gated=True)


GRID_BITS = (4, 8)
_GRID_Q = {4: (0, 15), 8: (-128, 127)}  # q's range


def grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """d, m [N, K/32] fp32 and q [N, K/32, 32] (bits 4: uint8 0..15; 8: int8, with m = 0) such that every value of the
    fp32 weight w [N, K] is fl(fl(d * q) + m) of its block of 32 k, bit for bit; None where some block is not so (or
    K is not a multiple of 32). A de-quantized GGUF is so: Q4_1's blocks hold d * q + m with d and m fp16 and their
    minimum at q = 0, Q8_0's d * q with d fp16. A weight that is not is refused after its first 64 rows."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % GRID_K or w.numel() == 0 or w.device.type != "cpu":
        return None
    if w.shape[0] > 64 and _grid_blocks(w[:64], bits) is None:
        return None
    return _grid_blocks(w, bits)


def _grid_blocks(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    n, k = w.shape
    b = w.detach().reshape(n, k // GRID_K, GRID_K)
    if not torch.isfinite(b).all():
        return None
    q_lo, q_hi = _GRID_Q[bits]
    if bits == 4:  # Q4_1: the block's minimum is m (q = 0), its maximum q = 15
        m = b.amin(-1, keepdim=True)
        step = (b.amax(-1, keepdim=True) - m) / q_hi
    else:  # Q8_0: m = 0, the largest magnitude q = +-127
        m = torch.zeros_like(b[..., :1])
        step = b.abs().amax(-1, keepdim=True) / 127
    half = step.to(torch.float16).view(torch.int16)  # GGUF's d is fp16: that, its neighbours, then the fp32 quotient
    candidates = [(half + i).view(torch.float16).float() for i in (0, 1, -1)] + [step]
    bits_of = b.view(torch.int32)
    d, q = torch.zeros_like(m), torch.zeros(b.shape, dtype=torch.float32)
    done = torch.zeros(m.shape, dtype=torch.bool)
    for c in candidates:
        c = torch.where(torch.isfinite(c) & (c > 0), c, torch.zeros_like(c))
        qc = torch.where(c > 0, (b - m) / torch.where(c > 0, c, torch.ones_like(c)), torch.zeros_like(b))
        qc = qc.round().clamp(q_lo, q_hi)
        good = (((c * qc) + m).view(torch.int32) == bits_of).all(-1, keepdim=True) & ~done
        d, q = torch.where(good, c, d), torch.where(good, qc, q)
        done |= good
        if bool(done.all()):
            return d.squeeze(-1), m.squeeze(-1), q.to(torch.uint8 if bits == 4 else torch.int8)
    return None


def pack_grid(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> PackedWeight:
    """The fp32 weight w [N, K] as a grid weight (`grid_block_bytes` in cpu_kernels.cpp), from `grid(w, bits)`: per
    panel of 16 columns and block of 32 k, d[16] and m[16] fp32, then per k the columns' q: 4-bit (uint8 q; data
    uint8), column j's in the low nibble of byte j and column j + 8's in its high one; or 8-bit (int8 q; data int8),
    a byte each. N padded with zero columns to a multiple of 32."""
    n, k = w.shape
    padded, blocks = -(-n // 32) * 32, k // GRID_K
    panels = padded // 16

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((padded, *t.shape[1:]))
        out[:n] = t
        return out

    d, m, q = pad(d), pad(m), pad(q)
    scales = [t.view(panels, 16, blocks).permute(0, 2, 1).contiguous().view(q.dtype) for t in (d, m)]
    cols = q.view(panels, 16, blocks, GRID_K).permute(0, 2, 3, 1)  # [panel, block, k, column]
    if q.dtype == torch.uint8:
        cols = cols[..., :8] | (cols[..., 8:] << 4)
    codes = cols.reshape(panels, blocks, -1)
    return PackedWeight(torch.cat([*scales, codes], -1).contiguous(), n, k, padded // 32)


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What `decode_layers` needs to know of a Llama/Qwen2-shaped decoder besides its weights."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float

    def scratch_elems(self, n: int) -> int:
        """Elements of scratch (the activations' dtype) for n tokens: the normed input, q|k|v, the attention output, the MLP product."""
        return n * (self.hidden + (2 * self.heads + 2 * self.kv_heads) * self.head_dim + self.inter)


class KernelsUnavailable(RuntimeError):
    pass


# KAIROS_CPU_ISA=avx2 builds and chooses as on a CPU with AVX2 but no AVX-512 (no bf16 dot product either): what
# a benchmark sets to measure, on an AVX-512 CPU, the paths such a CPU runs (`bench.peer --emulate-avx2`)
EMULATE_ISA_ENV = "KAIROS_CPU_ISA"


def emulated_avx2() -> bool:
    return os.environ.get(EMULATE_ISA_ENV, "").strip().lower() == "avx2"


def isa_flags() -> tuple[str, ...]:
    """The build flags beyond FLAGS that `emulated_avx2` asks for."""
    return ("-mno-avx512f",) if emulated_avx2() else ()


@functools.cache
def load() -> CpuKernels:
    """The kernels, built at first use (once per process); KernelsUnavailable says why not."""
    return load_source(SOURCE, isa_flags())


def load_source(source: Path, extra_flags: tuple[str, ...] = ()) -> CpuKernels:
    """The kernels built from `source` (this tree's `cpu_kernels.cpp`, or another version of it, which a benchmark
    compares with), with the same flags (and `extra_flags` after them, e.g. -mno-avx512f to build what an AVX2 CPU
    runs) and cache; each call loads the library anew."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelsUnavailable("no C++ compiler (g++ or c++; or set CXX)")
    try:
        flags = (*FLAGS, *extra_flags)
        path = _library_path(compiler, source, flags)
        if not path.exists():
            with held(path, "build of the CPU kernels"):  # (the others wait, then load its build)
                if not path.exists():
                    _build(compiler, path, source, flags)
        lib = ctypes.CDLL(str(path))
        if lib.kairos_abi_version() != ABI_VERSION:
            raise KernelsUnavailable(f"{path} is stale (ABI {lib.kairos_abi_version()}, want {ABI_VERSION})")
        return CpuKernels(lib, path.stem)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(str(e)) from e


def choose(setting: str, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
           head_dim: int, heads_per_kv: int = 1) -> CpuKernels | None:
    """The kernels `EngineConfig.kernels` asks for on this device and model: None means torch ops."""
    if setting == "off" or device.type != "cpu":
        if setting == "on" and device.type != "cpu":
            raise ValueError("kernels='on' with the CPU backend needs device='cpu'")
        return None
    why = None
    if not CpuKernels.supports(dtype, cache_dtype, head_dim, heads_per_kv):
        why = f"dtype {dtype} with a {cache_dtype} KV cache, head_dim {head_dim}, {heads_per_kv} heads per KV head"
    else:
        try:
            return load()
        except KernelsUnavailable as e:
            why = str(e)
    if setting == "on":
        raise ValueError(f"kernels='on' but Kairos's CPU kernels cannot run here: {why}")
    log.warning("Kairos CPU kernels not used (%s): the engine runs torch ops instead (slower)", why)
    return None
