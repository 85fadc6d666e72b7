"""`approx-prefix-cache-producer`: which endpoint probably holds a request's prompt prefix,
remembered from the router's own decisions (llm-d's approximate prefix cache).

Hashing (llm-d router, token based): the prompt's token ids are cut into blocks of
`block_size` tokens (the trailing partial block is kept); a block's content hash is xxhash64
over its ids as little-endian uint32, and `h_i = xxhash64(LE64(content_i) || LE64(h_{i-1}))`
chained from `xxhash64(model + cache_salt)`. At most `max_blocks` blocks are hashed.

Index: hash -> endpoints, and per endpoint an LRU of hashes (capacity the endpoint's
`num_gpu_blocks` when auto-tuned, else `lruCapacityPerServer`); an evicted hash leaves its
endpoint's set. `produce` walks the hashes from block 0 and counts, per endpoint, the blocks
it holds, stopping at the first block no endpoint holds; `pre_request` records every hash on
the picked decode endpoint and, if a `prefill` profile ran, on its endpoint (tail first, so
eviction trims prompts from the tail).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from sous.router.framework import (
    CycleState,
    Endpoint,
    PrefixMatchInfo,
    RouterRequest,
    SchedulingResult,
)
from sous.router.plugins.registry import register

TYPE = "approx-prefix-cache-producer"
MIN_BLOCK_SIZE = 64
"""llm-d clamps the approximate index's block size up to 64 tokens (llm-d-router #1158)."""


@dataclass(frozen=True)
class Parameters:
    auto_tune: bool = True
    """Block size and LRU capacity from each endpoint's `vllm:cache_config_info`."""
    block_size_tokens: int = 16
    """Block size when not auto-tuned (at least 64 is used)."""
    max_prefix_blocks_to_match: int = 2048
    max_prefix_tokens_to_match: int = 131072
    """When > 0, takes precedence: max blocks = this / block size. Both 0: no limit."""
    lru_capacity_per_server: int = 31250
    """Hashes remembered per endpoint when not auto-tuned."""

    def __post_init__(self) -> None:
        for key in ("block_size_tokens", "lru_capacity_per_server"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0")


def prefix_hashes(token_ids: Sequence[int], block_size: int, seed_text: str,
                  max_blocks: int = 0) -> list[int]:
    """llm-d's chained block hashes of a prompt (see the module docstring)."""
    h = xxhash.xxh64_intdigest(seed_text.encode())
    out: list[int] = []
    n_blocks = -(-len(token_ids) // block_size)
    if max_blocks > 0:
        n_blocks = min(n_blocks, max_blocks)
    for i in range(n_blocks):
        chunk = token_ids[i * block_size:(i + 1) * block_size]
        content = xxhash.xxh64_intdigest(struct.pack(f"<{len(chunk)}I", *chunk))
        h = xxhash.xxh64_intdigest(struct.pack("<QQ", content, h))
        out.append(h)
    return out


class ApproxPrefixCacheProducer:
    """The index (owned here; mutated only by `pre_request`)."""

    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name
        self.params = params
        self.hash_to_endpoints: dict[int, set[str]] = {}
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def block_size(self, endpoints: Sequence[Endpoint]) -> int:
        size = self.params.block_size_tokens
        if self.params.auto_tune:
            size = next((e.metrics.block_size for e in endpoints if e.metrics.block_size), size)
        return max(size, MIN_BLOCK_SIZE)

    def _capacity(self, endpoint: Endpoint) -> int:
        if self.params.auto_tune and endpoint.metrics.num_blocks:
            return endpoint.metrics.num_blocks
        return self.params.lru_capacity_per_server

    def _max_blocks(self, block_size: int) -> int:
        if self.params.max_prefix_tokens_to_match > 0:
            return max(1, self.params.max_prefix_tokens_to_match // block_size)
        return self.params.max_prefix_blocks_to_match

    def produce(self, request: RouterRequest, state: CycleState,
                endpoints: Sequence[Endpoint]) -> None:
        block_size = self.block_size(endpoints)
        seed = request.model + (request.cache_salt or "")
        hashes = prefix_hashes(request.token_ids, block_size, seed, self._max_blocks(block_size))
        state.put(self.name, None, hashes)
        counts: dict[str, int] = {}
        for h in hashes:
            holders = self.hash_to_endpoints.get(h)
            if not holders:
                break
            for key in holders:
                counts[key] = counts.get(key, 0) + 1
        for e in endpoints:
            state.put(self.name, e, PrefixMatchInfo(counts.get(e.host_port, 0), len(hashes),
                                                    block_size))

    def pre_request(self, request: RouterRequest, state: CycleState,
                    result: SchedulingResult) -> None:
        hashes = state.get(self.name) or []
        targets = [result.primary_endpoint, result.endpoint("prefill")]
        for endpoint in {id(t): t for t in targets if t is not None}.values():
            self.record(endpoint, hashes)

    def record(self, endpoint: Endpoint, hashes: Sequence[int]) -> None:
        """Remember that `endpoint` now holds `hashes` (inserted tail first)."""
        key = endpoint.host_port
        lru = self.lru.setdefault(key, OrderedDict())
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self.hash_to_endpoints.setdefault(h, set()).add(key)
        capacity = self._capacity(endpoint)
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            holders = self.hash_to_endpoints.get(old)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self.hash_to_endpoints[old]


register(TYPE, Parameters, ApproxPrefixCacheProducer)
