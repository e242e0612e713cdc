"""Paged-KV bookkeeping: which cache blocks each request owns. Pure Python, no tensors; owned by the scheduler."""
from __future__ import annotations

from collections import deque
from typing import Protocol


class HasBlocks(Protocol):
    block_table: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq: HasBlocks, num_tokens: int) -> int:
        """Blocks `seq` still needs so that `num_tokens` tokens fit."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def holds(self, seq: HasBlocks, num_tokens: int) -> bool:
        """Whether `seq`'s blocks already have slots for `num_tokens` tokens (it needs no more)."""
        return len(seq.block_table) * self.block_size >= num_tokens

    def can_fit(self, seq: HasBlocks, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= len(self._free)

    def ensure(self, seq: HasBlocks, num_tokens: int) -> None:
        """Grow seq.block_table so that `num_tokens` tokens have slots. Callers check `can_fit` first."""
        need = self.extra_blocks_for(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV accounting bug: need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: HasBlocks) -> None:
        if seq.block_table:
            self._free.extend(seq.block_table)
            seq.block_table = []
