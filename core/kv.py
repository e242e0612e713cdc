"""Paged-KV bookkeeping: which cache blocks each request owns. Pure Python, no tensors; owned by the scheduler."""
from __future__ import annotations

from heapq import heappop, heappush
from typing import Protocol


class HasBlocks(Protocol):
    block_table: list[int]


class BlockManager:
    """The free blocks and each request's. A request gets the lowest-numbered free blocks: the running requests' KV
    then stays in the low end of the cache, however many have come and gone, so a decode step reads a compact region
    (on a CPU, whose caches and TLB hold part of it) rather than blocks strewn over the whole cache, as handing out
    blocks in the order they were freed does once requests have cycled through it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a min-heap (ascending: already one)

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
        free, table = self._free, seq.block_table
        for _ in range(need):
            table.append(heappop(free))

    def free(self, seq: HasBlocks) -> None:
        if seq.block_table:
            free = self._free
            for b in seq.block_table:
                heappush(free, b)
            seq.block_table = []
