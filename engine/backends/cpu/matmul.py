"""bf16/fp16 linears on CPUs without native half-precision GEMM (no AVX512-BF16 / AMX, e.g. AVX2-only EPYC).

There oneDNN emulates bf16 GEMM, several times slower than its fp32 GEMM. Like a weight-only
quantized kernel, we keep the weights in bf16 (half the memory) and, for matmuls with >= MIN_ROWS rows,
upcast the weight into a reused fp32 workspace and run the fp32 GEMM. Single-row GEMVs are bandwidth-bound
and stay native. Numerically this is at least as accurate as a bf16 GEMM (fp32 accumulation, fp32 inputs).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.cpu.kernels import cpu_flag_line, emulated_avx2

MIN_ROWS = 4


def cpu_has_native_half() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16, AMX); not while a benchmark emulates an AVX2-only CPU
    (KAIROS_CPU_ISA=avx2, `cpu_kernels.emulated_avx2`)."""
    if emulated_avx2():
        return False
    return _cpu_flags_native_half()


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA: Kairos's kernels then run bf16 models (packed ISA "avx2_fma")."""
    flags = _cpu_flag_set()
    return flags is not None and {"avx2", "fma"} <= flags


@functools.cache
def _cpu_flag_set() -> frozenset[str] | None:
    line = cpu_flag_line()
    return None if line is None else frozenset(line.split())


def _cpu_flags_native_half() -> bool:
    flags = _cpu_flag_set()
    if flags is None:
        return True  # unknown platform: do not second-guess the vendor kernels
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16"))


class _Workspace:
    buf: torch.Tensor | None = None

    @classmethod
    def fp32(cls, like: torch.Tensor) -> torch.Tensor:
        n = like.numel()
        if cls.buf is None or cls.buf.numel() < n:
            cls.buf = torch.empty(n, dtype=torch.float32)
        return cls.buf[:n].view(like.shape).copy_(like)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear that runs multi-row matmuls in fp32 from half-precision weights."""
    if x.numel() < MIN_ROWS * x.shape[-1]:
        return F.linear(x, weight, bias)
    w = _Workspace.fp32(weight)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


class UpcastLinear(nn.Linear):
    """nn.Linear whose multi-row matmuls run in fp32 from half-precision weights (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return upcast_linear(x, self.weight, self.bias)


def install(model: nn.Module, mode: str = "auto") -> int:
    """Swap eligible nn.Linear modules to UpcastLinear. Returns how many were swapped."""
    p = next(model.parameters())
    if mode == "off" or p.device.type != "cpu" or p.dtype not in (torch.bfloat16, torch.float16):
        return 0
    if mode == "auto" and cpu_has_native_half():
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = UpcastLinear
            n += 1
    return n
