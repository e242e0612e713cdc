"""The CPU backend's matmul strategies for the decoder: oneDNN's packed bf16 GEMM with fused post-ops, and Kairos's
own packed GEMM (`kernels.CpuKernels.linear`). Both pack the weights once at load (copies: the decoder drops the
originals)."""
from __future__ import annotations

import torch
from torch import nn

from engine.backends.cpu.kernels import CpuKernels, PackedWeight


class OneDNNMatmuls:
    """bf16 on CPUs with native bf16 (AVX512-BF16 / AMX): oneDNN weights packed once at load, with the
    step's elementwise work fused into the GEMMs as post-ops: silu into the gate projection, the product
    into the up projection, the residual adds into o_proj and down_proj."""

    copies_weights = True  # the packed tensors are copies: the decoder drops the originals

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pack(gate.weight), self.pack(up.weight)

    def residual(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, h, w, b, "add")

    def mlp(self, x: torch.Tensor, mlp: tuple[torch.Tensor, torch.Tensor], down: torch.Tensor,
            h: torch.Tensor) -> torch.Tensor:
        gate, up = mlp
        g = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
        a = torch.ops.mkldnn._linear_pointwise.binary(x, g, up, None, "mul")
        return torch.ops.mkldnn._linear_pointwise.binary(a, h, down, None, "add")


class PackedMatmuls:
    """Kairos's own GEMM (`CpuKernels.linear`) on weights packed once at load, the bias, the residual adds and
    silu(gate) * up fused into its epilogue. bf16 on CPUs with AMX or AVX512-BF16 (AMX's layout, which AVX512-BF16's
    dot product reads as it is); fp32 on AVX-512 or AVX2 FMAs, which reads the weights once for all of a small
    step's rows."""

    copies_weights = True

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def pack(self, w: torch.Tensor) -> PackedWeight:
        w = w.detach()
        return self.kernels.pack_exact(w)

    def linear(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.linear(x, w, b)

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> PackedWeight:
        g, u = gate.weight.detach(), up.weight.detach()
        return self.kernels.pack_exact_gated(g, u)

    def residual(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, w, b, residual=h)  # h += x @ W^T + b, in place

    def mlp(self, x: torch.Tensor, mlp: PackedWeight, down: PackedWeight, h: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(self.kernels.linear(x, mlp), down, residual=h)
