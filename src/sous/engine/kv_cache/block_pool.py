"""The pool of physical KV blocks, its LRU free queue and the prefix-cache index.

Ownership: a block with `ref_cnt > 0` belongs to the requests that reference it. A block with
`ref_cnt == 0` sits in the free queue; if it still has a `block_hash` it is an *evictable cached*
block that a later request can revive with `touch`. Block 0 is the null block: never handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove from the middle.
    The head is evicted first (least recently freed)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free KV blocks left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail; for tests and debugging."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """Hands out blocks, takes them back, and indexes full blocks by hash.

    Several blocks can hold the same hash (requests that computed the same prefix before
    either was cached): every holder is indexed, as in vLLM, so the prefix stays reusable
    while any of them lives. `on_evict(hash)` is called when a hash loses its last holder
    (KV events hook in there), matching `cache_full_block` returning True for its first.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        on_evict: Callable[[bytes], None] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, dict[int, KVCacheBlock]] = {}
        """Block hash -> its holders by block id (never empty), oldest first."""
        self.on_evict = on_evict
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """A block holding `block_hash` (the oldest holder), or None."""
        holders = self.cached_blocks.get(block_hash)
        return next(iter(holders.values())) if holders else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the free head, evicting their cached hashes; ref_cnt becomes 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks; only {self.num_free_blocks} are free.")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving blocks that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free tail in the given order
        (callers pass a request's blocks tail-first so its prefix is evicted last)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Index a newly filled block under `block_hash`, also when other blocks already hold
        it. Returns True when the hash had no holder before (a new prefix: BlockStored)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        holders = self.cached_blocks.setdefault(block_hash, {})
        holders[block.block_id] = block
        return len(holders) == 1

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop `block` from the index; `on_evict` runs when its hash has no holder left."""
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        holders = self.cached_blocks.get(block_hash)
        if holders is None or holders.pop(block.block_id, None) is None or holders:
            return
        del self.cached_blocks[block_hash]
        if self.on_evict is not None:
            self.on_evict(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Allowed only when no request holds blocks."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
