"""Device backends behind one seam (`base.Backend`): `torch_ref` (any device, plain torch ops: the fallback and the
oracle in tests), `cpu` (Kairos's compiled CPU kernels and packed GEMMs) and `cuda` (Triton paged attention, CUDA
graphs, on-device sampling). `create` picks one for a device; generic engine code imports only this package's
`base` and these functions."""
from __future__ import annotations

import torch

from engine.backends.base import Backend

BACKENDS = ("auto", "torch", "cpu", "cuda")


def backend_class(name: str, device: torch.device) -> type[Backend]:
    """The backend class `name` names (auto: the device's own)."""
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "cpu"
    if name == "torch":
        from engine.backends.torch_ref import TorchBackend
        return TorchBackend
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' needs device='cpu', not {device}")
        from engine.backends.cpu.backend import CpuBackend
        return CpuBackend
    if name == "cuda":
        from engine.backends.cuda.backend import CudaBackend
        return CudaBackend
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")


def create(name: str, device: torch.device, kernels: str = "auto") -> Backend:
    return backend_class(name, device)(device, kernels)


def default_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """The activations' dtype that `dtype="auto"` means on this device."""
    return backend_class(name, device).default_dtype(device)
