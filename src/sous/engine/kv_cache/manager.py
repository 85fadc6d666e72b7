"""KVCacheManager: which blocks each request holds, prefix-cache lookups and allocation.

Contract with the scheduler: `get_computed_blocks` is side-effect free; `allocate_slots` either
reserves everything asked for (touching hit blocks, popping new ones, caching newly full
blocks) or changes nothing and returns None; `free` releases a request's blocks tail-first.
"""

from __future__ import annotations

from dataclasses import dataclass

from sous.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from sous.engine.kv_cache.hashing import get_hash_fn, hash_request_blocks, none_hash
from sous.engine.request import Request
from sous.kv_transfer.events import Event, all_blocks_cleared, block_removed, block_stored


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Prompt tokens found."""


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_kv_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events and enable_caching
        self.events: list[Event] = []
        """KV events since the last `take_events()` (only with enable_kv_events)."""
        on_evict = self._on_evict if self.enable_kv_events else None
        self.pool = BlockPool(num_blocks, enable_caching, on_evict=on_evict)
        self.hash_fn = get_hash_fn(hash_algo)
        self.root_hash = none_hash(self.hash_fn) if enable_caching else b""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def usage(self) -> float:
        return self.pool.usage()

    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            hash_request_blocks(self.hash_fn, self.root_hash, request.all_token_ids,
                                self.block_size, request.block_hashes)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, capped so at least one token is recomputed."""
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Reserve blocks so `num_computed_tokens + len(hits)*bs + num_new_tokens (+ lookahead)`
        tokens fit. Returns the newly allocated blocks, or None when the pool is too small."""
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(hits)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once `num_tokens` tokens are written.
        Only tokens already known (prompt + sampled output) are hashed, never drafts."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        stored = [i for i in range(start, num_full)
                  if self.pool.cache_full_block(blocks[i], request.block_hashes[i])]
        self.num_cached_blocks[request.request_id] = num_full
        if self.enable_kv_events and stored:
            self._emit_stored(request, stored)

    def _emit_stored(self, request: Request, indices: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks of the request."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = request.block_hashes[first - 1] if first > 0 else None
            self.events.append(block_stored(
                [request.block_hashes[i] for i in run], parent,
                request.all_token_ids[first * bs:(last + 1) * bs], bs))

    def _on_evict(self, block_hash: bytes) -> None:
        self.events.append(block_removed([block_hash]))

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.enable_kv_events:
            self.events.append(all_blocks_cleared())
        return True
