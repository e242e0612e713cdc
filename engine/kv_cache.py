"""KV-cache tensors: per layer [num_blocks, block_size, kv_heads, head_dim], on CPU or CUDA."""
from __future__ import annotations

import torch

from engine.cpu_matmul import cpu_has_avx2_fma, cpu_has_native_half


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


def choose_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device,
                       cpu_kernels: str = "auto") -> torch.dtype:
    """`auto`: the model's dtype on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX: half the bytes to
    write and gather, SDPA as fast as fp32); for bf16 models also on AVX2 CPUs with Kairos's kernels on, whose decode
    attention reads bf16 rows as fast as fp32 ones (and half as many bytes); fp32 elsewhere, where bf16/fp16 SDPA is
    3-5x slower."""
    if setting == "model":
        return model_dtype
    if setting != "auto":
        return getattr(torch, setting)
    if device.type == "cuda" or (model_dtype == torch.bfloat16 and cpu_has_native_half()):
        return model_dtype
    if model_dtype == torch.bfloat16 and cpu_kernels != "off" and cpu_has_avx2_fma():
        return model_dtype
    return torch.float32


def cuda_cache_bytes(free: int, total: int, own: int, utilization: float) -> int:
    """Bytes of KV cache on a GPU: this process may hold `utilization` of the card, the `own` bytes it holds
    already (weights) included, as vLLM counts it; and the cache must fit in what is `free` now, less 2% of the
    card, so that replicas sharing a GPU (each with its own fraction) cannot take each other's room."""
    return max(0, int(min(utilization * total - own, free - 0.02 * total)))


def build_cache(config, bundle, max_model_len: int) -> KVCache:
    """Size and allocate the cache: an explicit block count or memory budget; on CUDA what
    `gpu_memory_utilization` leaves free; on CPU 1 GiB. It must hold at least one full context."""
    hf = bundle.config
    layers = hf.num_hidden_layers
    heads = hf.num_attention_heads
    kvh = getattr(hf, "num_key_value_heads", None) or heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    dtype = choose_cache_dtype(config.kv_cache_dtype, bundle.dtype, bundle.device, config.cpu_kernels)
    per_block = KVCache.bytes_per_block(layers, config.block_size, kvh, hd, dtype)
    if config.num_kv_blocks:
        n = config.num_kv_blocks
    elif config.kv_cache_memory_gb:
        n = int(config.kv_cache_memory_gb * 1024**3 // per_block)
    elif bundle.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(bundle.device)
        own = torch.cuda.memory_reserved(bundle.device)
        n = int(cuda_cache_bytes(free, total, own, config.gpu_memory_utilization) // per_block)
    else:
        n = int(1024**3 // per_block)  # 1 GiB on CPU
    min_blocks = -(-max_model_len // config.block_size)
    if n < min_blocks:
        raise ValueError(f"KV cache of {n} blocks cannot hold one full context ({min_blocks} blocks)")
    return KVCache(layers, n, config.block_size, kvh, hd, dtype, bundle.device)
