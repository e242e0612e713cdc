"""KV-cache tensors: per layer [num_blocks, block_size, kv_heads, head_dim], on the backend's device.

A cache may hold a few blocks beyond what the scheduler hands out (`scratch_blocks`, at the end): a backend that
replays captured steps padded to a fixed batch writes the padding rows' K/V there."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * \
            torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scratch_blocks: int = 0) -> None:
        shape = (num_layers, num_blocks + scratch_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size  # num_blocks: what the scheduler may use
        self.scratch_blocks = scratch_blocks
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device

    @classmethod
    def of(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device, scratch_blocks: int = 0) -> "KVCache":
        return cls(spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype,
                   device, scratch_blocks)

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch blocks (-1: none)."""
        return self.num_blocks * self.block_size if self.scratch_blocks else -1

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return KVCacheSpec(num_layers, block_size, num_kv_heads, head_dim, dtype).bytes_per_block

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def choose_cache_dtype(setting: str, model_dtype: torch.dtype, backend) -> torch.dtype:
    """`auto`: the backend's choice for this model dtype; `model`: the model's; else the named dtype."""
    if setting == "model":
        return model_dtype
    if setting != "auto":
        return getattr(torch, setting)
    return backend.cache_dtype(model_dtype)


def cache_spec(config, bundle, backend) -> KVCacheSpec:
    hf = bundle.config
    heads = hf.num_attention_heads
    kvh = getattr(hf, "num_key_value_heads", None) or heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    dtype = choose_cache_dtype(config.kv_cache_dtype, bundle.dtype, backend)
    return KVCacheSpec(hf.num_hidden_layers, config.block_size, kvh, hd, dtype)


def cuda_cache_bytes(free: int, total: int, own: int, utilization: float, peak: int = 0) -> int:
    """Bytes of KV cache on a GPU: this process may hold `utilization` of the card, the `own` bytes it holds
    already (weights, and the `peak` of the largest step's activations beyond them) included, as vLLM counts it; and
    the cache must fit in what is `free` now less that peak (freed since it was measured, and needed again by the
    largest step) and 2% of the card, so that replicas sharing a GPU (each with its own fraction) cannot take each
    other's room."""
    return max(0, int(min(utilization * total - own, free - peak - 0.02 * total)))


def configured_blocks(config, spec: KVCacheSpec) -> int | None:
    """The cache size the settings fix (an explicit block count or memory budget), else None."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_memory_gb:
        return int(config.kv_cache_memory_gb * 1024**3 // spec.bytes_per_block)
    return None


def host_cache_blocks(spec: KVCacheSpec) -> int:
    """A host cache's default size: 1 GiB."""
    return int(1024**3 // spec.bytes_per_block)


def cuda_cache_blocks(config, spec: KVCacheSpec, device: torch.device, peak_extra: int = 0) -> int:
    """A GPU cache's size from what `gpu_memory_utilization` leaves: the process's reserved memory now (the weights)
    plus `peak_extra`, the activations' peak beyond it measured in a warm-up at the largest step."""
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device) + peak_extra
    return int(cuda_cache_bytes(free, total, own, config.gpu_memory_utilization, peak_extra) // spec.bytes_per_block)


def check_blocks(n: int, spec: KVCacheSpec, max_model_len: int) -> None:
    min_blocks = -(-max_model_len // spec.block_size)
    if n < min_blocks:
        raise ValueError(f"KV cache of {n} blocks cannot hold one full context ({min_blocks} blocks)")
