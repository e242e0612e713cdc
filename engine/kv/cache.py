"""KV-cache tensors: per layer [num_blocks, block_size, kv_heads, head_dim], on CPU or CUDA."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def choose_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: the model's dtype on CUDA; fp32 on CPU, where bf16/fp16 SDPA is 3-5x slower than fp32."""
    if setting == "model":
        return model_dtype
    if setting != "auto":
        return getattr(torch, setting)
    return model_dtype if device.type == "cuda" else torch.float32
