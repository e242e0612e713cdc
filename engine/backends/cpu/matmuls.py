"""The CPU backend's matmul strategies for the decoder: oneDNN's packed bf16 GEMM with fused post-ops, and Kairos's
own packed GEMM (`kernels.CpuKernels.linear`). Both pack the weights once at load (copies: the decoder drops the
originals)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.cpu.kernels import CpuKernels, PackedWeight, stack_packed


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

    def gate_up(self, x: torch.Tensor, mlp: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """gate|up before the activation, [T, 2 * intermediate] (a LoRA step adds its updates there)."""
        return torch.cat([self.linear(x, mlp[0]), self.linear(x, mlp[1])], 1)

    def silu_mul(self, gu: torch.Tensor, n: int) -> torch.Tensor:
        return F.silu(gu[:, :n]) * gu[:, n:]


class PackedMatmuls:
    """Kairos's own GEMM (`CpuKernels.linear`) on weights packed once at load, the bias, the residual adds and
    silu(gate) * up fused into its epilogue. bf16 on CPUs with AMX or AVX512-BF16 (AMX's layout, which AVX512-BF16's
    dot product reads as it is); fp32 on AVX-512 or AVX2 FMAs, which reads the weights once for all of a small
    step's rows."""

    copies_weights = True

    def __init__(self, kernels: CpuKernels, gated: bool = True) -> None:
        """`gated` False (an engine that serves LoRA adapters): gate|up packed as one plain projection, whose
        output before the activation a LoRA step adds its updates to; the activation then runs after it."""
        self.kernels = kernels
        self.gated = gated

    def pack(self, w: torch.Tensor) -> PackedWeight:
        w = w.detach()
        return self.kernels.pack_exact(w)

    def pack_plain(self, w: torch.Tensor) -> PackedWeight:
        """`w` packed as is (bf16, or fp32 compact where exact), without `pack_exact`'s search for a grid: a LoRA
        adapter's weights, packed on a loader thread beside the steps (the search runs on the kernels' thread team)."""
        w = w.detach()
        return self.kernels.pack_weight(w, self.kernels.compactable(w))

    def stack(self, ws: list[PackedWeight], along_k: bool) -> PackedWeight | None:
        """Packed weights stacked as packed (`stack_packed`: rows one after another, or `along_k` columns side by
        side), None where their packing does not allow it (the caller packs the stacked matrix then)."""
        return stack_packed(ws, along_k)

    def linear(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.linear(x, w, b)

    def pack_mlp(self, gate: nn.Linear, up: nn.Linear) -> PackedWeight | tuple[PackedWeight, int]:
        g, u = gate.weight.detach(), up.weight.detach()
        if not self.gated:
            return self.pack(torch.cat([g, u])), g.shape[0]
        return self.kernels.pack_exact_gated(g, u)

    def residual(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, w, b, residual=h)  # h += x @ W^T + b, in place

    def mlp(self, x: torch.Tensor, mlp: PackedWeight, down: PackedWeight, h: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.kernels.linear(self.silu_mul(self.gate_up(x, mlp), mlp[1]), down, residual=h)
        return self.kernels.linear(self.kernels.linear(x, mlp), down, residual=h)

    def gate_up(self, x: torch.Tensor, mlp: tuple[PackedWeight, int]) -> torch.Tensor:
        """gate|up before the activation (`gated` False only), [T, 2 * intermediate]."""
        return self.kernels.linear(x, mlp[0])

    def silu_mul(self, gu: torch.Tensor, n: int) -> torch.Tensor:
        return F.silu(gu[:, :n]) * gu[:, n:]
