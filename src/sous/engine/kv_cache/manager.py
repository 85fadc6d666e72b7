"""KVCacheManager: which blocks each request holds, prefix-cache lookups and allocation.

Contract with the scheduler: `get_computed_blocks` is side-effect free (it only extends the
request's block hashes); `allocate_slots` either reserves everything asked for (touching hit
blocks, popping new ones, caching newly full blocks, queueing a sub-block copy) or changes
nothing and returns None; `record_prefix_cache_stats` counts a lookup once its request is
admitted; `commit` runs after each forward pass; `free` releases a request's blocks tail-first.
"""

from __future__ import annotations

from dataclasses import dataclass

from sous.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from sous.engine.kv_cache.hashing import get_hash_fn, hash_request_blocks, none_hash
from sous.engine.kv_cache.sub_block import (
    KVCacheCopyOp,
    SubBlockHit,
    SubBlockIndex,
    longest_match,
)
from sous.engine.request import Request
from sous.kv_transfer.events import Event, all_blocks_cleared, block_removed, block_stored


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of admitted requests, counted once per admission (vLLM's
    semantics). Re-admissions after a preemption are counted apart, as in vLLM, so that
    recomputing a preempted request's own blocks does not inflate the hit rate."""

    requests: int = 0
    """Admissions of requests never preempted."""
    queries: int = 0
    """Tokens looked up (the whole prompt, output so far included) by those admissions."""
    hits: int = 0
    """Tokens found in the cache by those admissions."""
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class ComputedBlocks:
    """A prefix-cache lookup: shared full blocks, then optionally a sub-block match to copy."""

    blocks: list[KVCacheBlock]
    sub_block: SubBlockHit | None = None

    def num_tokens(self, block_size: int) -> int:
        sub = self.sub_block.num_tokens if self.sub_block else 0
        return len(self.blocks) * block_size + sub

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class KVCacheManager:
    """Blocks per request, prefix-cache lookups and KV events.

    With `sub_block_size` set (see `sub_block.resolve_sub_block_size`) the partly matching
    block after the full-block hits is reused by copy, and KV events are per sub-block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_kv_events: bool = False,
        sub_block_size: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events and enable_caching
        self.events: list[Event] = []
        """KV events since the last `take_events()` (only with enable_kv_events)."""
        self.sub_block_size = sub_block_size if enable_caching else None
        self.sub_index = SubBlockIndex()
        full_block_events = self.enable_kv_events and self.sub_block_size is None
        self.pool = BlockPool(num_blocks, enable_caching,
                              on_evict=self._on_evict if full_block_events else None)
        self.hash_fn = get_hash_fn(hash_algo)
        self.root_hash = none_hash(self.hash_fn) if enable_caching else b""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_indexed_sub_blocks: dict[str, int] = {}
        self.copy_ops: list[KVCacheCopyOp] = []
        """Sub-block copies of the step being scheduled (taken by `take_copy_ops`)."""
        self._copy_sources: list[KVCacheBlock] = []
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
        if self.sub_block_size is not None:
            hash_request_blocks(self.hash_fn, self.root_hash, request.all_token_ids,
                                self.sub_block_size, request.sub_block_hashes)

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Longest cached prefix (full blocks, then sub-blocks), capped so that at least one
        token is recomputed. Returns the lookup and its length in tokens."""
        if not self.enable_caching:
            return ComputedBlocks([]), 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        computed = ComputedBlocks(hits)
        sub = self.sub_block_size
        if sub is not None:
            per_block = self.block_size // sub
            room = (request.num_tokens - 1 - len(hits) * self.block_size) // sub
            computed.sub_block = longest_match(self.sub_index, request.sub_block_hashes,
                                               len(hits) * per_block,
                                               min(per_block - 1, room), sub)
        return computed, computed.num_tokens(self.block_size)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count the lookup of a request just admitted (its `allocate_slots` succeeded) that
        found `num_hits` tokens. The scheduler calls it once per admission: a request that
        waits for blocks looks up again each step but is counted only when it gets them."""
        if self.enable_caching:
            self.stats.record(request.num_tokens, num_hits,
                              preempted=request.num_preemptions > 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
        num_external_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Reserve blocks so `num_computed_tokens + hit tokens + external tokens (a KV
        connector loads them into the new blocks) + num_new_tokens (+ lookahead)` tokens fit.
        Returns the newly allocated blocks, or None when the pool is too small.
        `delay_cache_blocks`: index no new full block yet (an asynchronous load is still
        writing them; `cache_blocks` once it is done)."""
        computed = new_computed_blocks or ComputedBlocks([])
        hits, sub_hit = computed.blocks, computed.sub_block
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = (request.num_computed_tokens + computed.num_tokens(self.block_size)
                        + num_external_tokens)
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(hits)
        # Hit blocks (and a copy source) sitting in the free queue stop being free once touched.
        pinned = hits + [sub_hit.src] if sub_hit else hits
        num_evictable = sum(1 for b in pinned if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self.num_cached_blocks[request.request_id] = len(blocks)
        if sub_hit:
            self.pool.touch([sub_hit.src])
            self._copy_sources.append(sub_hit.src)
        new_blocks = self._get_new_blocks(max(num_new_blocks, 0))
        if sub_hit:
            self.copy_ops.append(KVCacheCopyOp(sub_hit.src.block_id, new_blocks[0].block_id,
                                               sub_hit.num_tokens))
        blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once its first `num_tokens` tokens are
        written (after an asynchronous load landed them)."""
        self._cache_full_blocks(request, num_tokens)

    def _get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        new_blocks = self.pool.get_new_blocks(n)
        if self.sub_block_size is not None:
            for block in new_blocks:
                gone = self.sub_index.pop_block(block)
                if gone and self.enable_kv_events:
                    self.events.append(block_removed(gone))
        return new_blocks

    def take_copy_ops(self) -> list[KVCacheCopyOp]:
        ops, self.copy_ops = self.copy_ops, []
        return ops

    def commit(self, computed: list[tuple[Request, int]]) -> None:
        """After a forward pass: release the step's copy sources and index the sub-blocks now
        computed (`(request, num_computed_tokens after the step)` per scheduled request)."""
        if self._copy_sources:
            self.pool.free_blocks(self._copy_sources)
            self._copy_sources = []
        if self.sub_block_size is None:
            return
        for request, num_tokens in computed:
            if request.request_id in self.req_to_blocks:
                self._index_sub_blocks(request, num_tokens)

    def _index_sub_blocks(self, request: Request, num_tokens: int) -> None:
        sub = self.sub_block_size
        assert sub is not None
        rid = request.request_id
        start = self.num_indexed_sub_blocks.get(rid, 0)
        end = min(num_tokens, request.num_tokens) // sub
        if end <= start:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[rid]
        per_block = self.block_size // sub
        stored = [j for j in range(start, end)
                  if self.sub_index.add(request.sub_block_hashes[j], blocks[j // per_block])]
        self.num_indexed_sub_blocks[rid] = end
        if self.enable_kv_events and stored:
            self._emit_stored(request, stored, request.sub_block_hashes, sub)

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
        if self.enable_kv_events and self.sub_block_size is None and stored:
            self._emit_stored(request, stored, request.block_hashes, self.block_size)

    def _emit_stored(
        self, request: Request, indices: list[int], hashes: list[bytes], bs: int
    ) -> None:
        """One BlockStored per run of consecutive newly cached (sub-)blocks of the request."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = hashes[first - 1] if first > 0 else None
            self.events.append(block_stored(
                [hashes[i] for i in run], parent,
                request.all_token_ids[first * bs:(last + 1) * bs], bs))

    def _on_evict(self, block_hash: bytes) -> None:
        self.events.append(block_removed([block_hash]))

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_indexed_sub_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def discard_unwritten(self, request: Request, num_written_tokens: int) -> None:
        """Un-index `request`'s blocks past its first `num_written_tokens` tokens (indexed at
        allocation, but their KV was never written: its step failed), so that no later
        request gets a prefix-cache hit on them. Call before `free`."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[num_written_tokens // self.block_size:]:
            if block.ref_cnt == 1:  # shared blocks were written by someone else
                self.pool._evict(block)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        self.sub_index.clear()
        if self.enable_kv_events:
            self.events.append(all_blocks_cleared())
        return True
