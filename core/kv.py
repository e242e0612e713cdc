"""Paged-KV bookkeeping: which cache blocks each request owns, and (prefix caching) which blocks hold which tokens'
KV for the requests that come after. Pure Python, no tensors; owned by the scheduler."""
from __future__ import annotations

from collections import OrderedDict
from heapq import heappop, heappush
from typing import Protocol


class HasBlocks(Protocol):
    block_table: list[int]


class CachedBlock:
    """A full block whose KV is kept for later requests: its tokens follow its parent's (the root: none). The
    cached blocks form a tree of token prefixes, one block a node, so that a hit compares the tokens themselves (no
    hash that two prompts could share)."""

    __slots__ = ("block", "parent", "tokens", "children")

    def __init__(self, block: int, parent: CachedBlock | None, tokens: tuple[int, ...]) -> None:
        self.block = block  # -1 once evicted (a request may still name it as where its own blocks would go on)
        self.parent = parent
        self.tokens = tokens
        self.children: dict[tuple[int, ...], CachedBlock] = {}


class BlockManager:
    """The free blocks and each request's. A request gets the lowest-numbered free blocks: the running requests' KV
    then stays in the low end of the cache, however many have come and gone, so a decode step reads a compact region
    (on a CPU, whose caches and TLB hold part of it) rather than blocks strewn over the whole cache, as handing out
    blocks in the order they were freed does once requests have cycled through it.

    With `caching` (vLLM's automatic prefix caching), a full block of computed tokens is kept, once its request has
    `register`ed it, under the tokens it holds and all before them: a later request whose tokens begin the same way
    shares it (`lookup`, `share`) instead of computing it again. Blocks are counted by their holders; one nobody holds
    stays cached, and free, until a request needs it: blocks never cached go first, then the cached ones least
    recently freed (a request's last blocks before its first), each with the cached blocks that follow it (no
    request holds those either: a holder of a block holds all before it)."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: list[int] = list(range(num_blocks))  # a min-heap (ascending: already one) of uncached free blocks
        self._refs = [0] * num_blocks if caching else None  # each block's holders
        self._node: dict[int, CachedBlock] = {}  # the cached blocks, by block
        self._idle: OrderedDict[int, None] = OrderedDict()  # the cached blocks nobody holds, least recently freed first
        self.root = CachedBlock(-1, None, ())
        # the roots of other namespaces (a LoRA adapter's requests, a cache_salt's), by their key: only requests of a
        # namespace share its blocks. A root is kept while it has cached blocks after it (its key as its `tokens`)
        self._roots: dict[object, CachedBlock] = {}
        # how many blocks were ever cached: a lookup made when it was as now, whose blocks are all still cached, holds
        # (an uncached block's node has block -1, and so has every node after it: `lookup`'s `after`)
        self.added = 0

    @property
    def num_free(self) -> int:
        """Blocks a request may take: uncached ones, and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose KV a later request may share (held or not)."""
        return len(self._node)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq: HasBlocks, num_tokens: int) -> int:
        """Blocks `seq` still needs so that `num_tokens` tokens fit."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def holds(self, seq: HasBlocks, num_tokens: int) -> bool:
        """Whether `seq`'s blocks already have slots for `num_tokens` tokens (it needs no more)."""
        return len(seq.block_table) * self.block_size >= num_tokens

    def can_fit(self, seq: HasBlocks, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= self.num_free

    def ensure(self, seq: HasBlocks, num_tokens: int) -> None:
        """Grow seq.block_table so that `num_tokens` tokens have slots. Callers check `can_fit` first."""
        need = self.extra_blocks_for(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV accounting bug: need {need} blocks, {self.num_free} free")
        free, table, refs = self._free, seq.block_table, self._refs
        for _ in range(need):
            if not free:
                self._evict_one()
            b = heappop(free)
            if refs is not None:
                refs[b] = 1
            table.append(b)

    def free(self, seq: HasBlocks, keep_cached: bool = True, shared: int = 0) -> None:
        """Give back `seq`'s blocks. A cached block nobody else holds stays cached, unless not `keep_cached`: a request
        that failed, whose KV may not be what its tokens say, leaves none of its own blocks to others (its first
        `shared` blocks, which it found cached, were not its own to write)."""
        if not seq.block_table:
            return
        free, refs = self._free, self._refs
        if refs is None:
            for b in seq.block_table:
                heappush(free, b)
        else:
            table = seq.block_table
            for i in range(len(table) - 1, -1, -1):  # its last blocks are the first to go
                b = table[i]
                refs[b] -= 1
                if refs[b]:
                    continue
                if b in self._node:
                    if keep_cached or i < shared:
                        self._idle[b] = None
                        continue
                    self._drop(self._node[b])
                heappush(free, b)
        seq.block_table = []

    # --- prefix caching ---
    def root_of(self, namespace: object = None) -> CachedBlock:
        """The root of `namespace`'s blocks (None: the default one): where a request of it that found none cached
        `register`s its first. A new namespace's root is kept once a block is cached after it."""
        if namespace is None:
            return self.root
        return self._roots.get(namespace) or CachedBlock(-1, None, namespace)  # type: ignore[arg-type]

    def lookup(self, token_ids: list[int], limit: int, after: list[CachedBlock] | None = None,
               namespace: object = None) -> list[CachedBlock]:
        """The cached blocks that hold the KV of `token_ids`' first full blocks, at most `limit` tokens of them, in
        order: a request that starts with those tokens may `share` them. `after`: an earlier lookup's of the same
        tokens, from whose blocks still cached this one goes on. `namespace`: only blocks its requests cached."""
        if not self._node:
            return []
        root = self.root if namespace is None else self._roots.get(namespace)
        if root is None:
            return []
        bs = self.block_size
        out = list(after) if after else []
        if out and out[-1].block < 0:  # some were uncached since: they and all after them (the first such, bisected)
            lo, hi = 0, len(out) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if out[mid].block >= 0 else (lo, mid)
            del out[lo:]
        node = out[-1] if out else root
        for start in range(len(out) * bs, limit - bs + 1, bs):
            node = node.children.get(tuple(token_ids[start:start + bs]))
            if node is None:
                break
            out.append(node)
        return out

    def blocks_to_share(self, hits: list[CachedBlock]) -> int:
        """The free blocks sharing `hits` takes (those nobody holds now)."""
        idle = self._idle
        return sum([1 for n in hits if n.block in idle])

    def share(self, seq: HasBlocks, hits: list[CachedBlock]) -> None:
        """`seq` (which holds no block yet) starts with the blocks of `hits` (`lookup`'s)."""
        assert not seq.block_table, "a request shares a cached prefix only as it starts"
        refs, idle = self._refs, self._idle
        for n in hits:
            b = n.block
            assert b >= 0, "a cached block shared after it was uncached"
            if not refs[b]:
                del idle[b]
            refs[b] += 1
            seq.block_table.append(b)

    def register(self, seq: HasBlocks, token_ids: list[int], start: int, end: int, after: CachedBlock
                 ) -> CachedBlock | None:
        """Cache `seq`'s full blocks [start, end) (block indices; their tokens' KV computed), the first following
        `after` (the cached block before it, or the root). Returns the cached block the next one follows; None where
        the chain broke off (`after` was evicted): the request caches no more. A block whose tokens are cached
        already, in another block, stays the request's own: the next follows the one cached."""
        if after.parent is None:  # a root: a namespace's is kept from its first block on (the one kept, if another)
            if after is not self.root:
                after = self._roots.setdefault(after.tokens, after)
        elif after.block < 0:
            return None
        bs, node = self.block_size, after
        for i in range(start, end):
            key = tuple(token_ids[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                b = seq.block_table[i]
                if b in self._node:  # (a block is cached once)
                    return None
                child = CachedBlock(b, node, key)
                node.children[key] = child
                self._node[b] = child
                self.added += 1
            node = child
        return node

    def clear_cache(self) -> None:
        """Uncache every block nobody holds (their KV is about to be overwritten: a profile on the idle engine)."""
        while self._idle:
            self._evict_one()

    def _evict_one(self) -> None:
        """Free the cached block least recently freed that nobody holds (into the uncached free blocks), and uncache
        the blocks after it."""
        b, _ = self._idle.popitem(last=False)
        self._drop(self._node[b])
        heappush(self._free, b)

    def _drop(self, node: CachedBlock) -> None:
        """Uncache `node` (its block is the caller's to place) and the blocks after it: each that nobody holds goes
        from the idle blocks to the free ones; one a request holds (its chain went on from a block cached by another,
        its own a copy) stays that request's, uncached."""
        parent = node.parent
        del parent.children[node.tokens]
        if parent.parent is None and not parent.children and parent is not self.root:
            self._roots.pop(parent.tokens, None)  # a namespace with no block cached: forgotten
        refs, idle, stack = self._refs, self._idle, [node]
        while stack:
            n = stack.pop()
            b = n.block
            del self._node[b]
            if n is not node and not refs[b]:
                del idle[b]
                heappush(self._free, b)
            n.block = -1
            stack.extend(n.children.values())
            n.children = {}
