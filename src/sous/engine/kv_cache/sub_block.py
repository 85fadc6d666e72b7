"""Sub-block prefix caching: reuse the partly filled tail block of a cached prefix.

With large KV blocks (1024-4096 tokens) full-block prefix caching misses the partial last block,
where most of a shared prefix lives. Sub-block caching (vllm-rbln's `VLLM_RBLN_SUB_BLOCK_CACHE`)
hashes every request's tokens a second time in sub-blocks of `--max-num-batched-tokens` tokens,
chained from the same root as full blocks, and indexes which physical blocks hold each sub-block
prefix. A new request first takes its full-block hits; then the longest run of matching
sub-blocks of the next block is copied, slot by slot, from a block that holds it into a newly
allocated block before the forward pass.

Contracts:
- A sub-block hash chains from the root over the whole prefix, so every holder of hash `h` at
  the same offset in its block holds the same KV: any holder is a valid copy source.
- Sub-blocks are indexed only after the forward pass that computed them (`commit`), so a request
  admitted in the same step can never copy KV that does not exist yet.
- A copy source is referenced (ref_cnt + 1) from allocation until the runner has copied it, so
  the allocation that creates the destination cannot evict it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from sous.config.env_vars import env_flag
from sous.engine.kv_cache.block_pool import KVCacheBlock

logger = logging.getLogger(__name__)

ENV_VAR = "VLLM_RBLN_SUB_BLOCK_CACHE"


@dataclass(frozen=True)
class KVCacheCopyOp:
    """Copy the first `num_tokens` token slots of block `src_block_id` into `dst_block_id`, in
    every layer, before the step's forward pass."""

    src_block_id: int
    dst_block_id: int
    num_tokens: int


@dataclass(frozen=True)
class SubBlockHit:
    """A prefix match inside the block after the full-block hits."""

    src: KVCacheBlock
    num_tokens: int
    """Matched tokens: a multiple of the sub-block size, less than the block size."""




def env_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """`VLLM_RBLN_SUB_BLOCK_CACHE`: on unless 0 / false / no / off (vllm-rbln's default is
    on); any other value is a ValueError naming the variable. Read once, when the engine's
    configuration is parsed (`sous.config.engine_args`): the engine reads `CacheConfig`."""
    return env_flag(environ, ENV_VAR, True)


def resolve_sub_block_size(
    block_size: int, max_num_batched_tokens: int, enable_caching: bool,
    enable_sub_block_cache: bool = True,
) -> int | None:
    """The sub-block size when sub-block caching applies, else None; logs the mode either way.

    Applies when prefix caching is on, sub-block caching is on (`CacheConfig.
    enable_sub_block_cache`, which `VLLM_RBLN_SUB_BLOCK_CACHE` sets) and the block size is a
    larger multiple of `--max-num-batched-tokens` (the sub-block size). Reads no environment."""
    if not enable_caching:
        logger.info("Prefix caching: off")
        return None
    sub = max_num_batched_tokens
    if not enable_sub_block_cache:
        logger.info("Prefix caching: full blocks of %d tokens (sub-block caching is off: "
                    "%s=0 or enable_sub_block_cache=False)", block_size, ENV_VAR)
        return None
    if block_size <= sub or block_size % sub:
        logger.info(
            "Prefix caching: full blocks of %d tokens (sub-block caching needs a block size "
            "that is a larger multiple of --max-num-batched-tokens %d)", block_size, sub)
        return None
    logger.info("Prefix caching: full blocks of %d tokens and sub-blocks of %d tokens "
                "(KV events are published per sub-block)", block_size, sub)
    return sub


class SubBlockIndex:
    """Sub-block hash -> the blocks that hold that prefix (at a fixed offset in the block)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, dict[int, KVCacheBlock]] = {}
        self._hashes_of: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, block_hash: bytes, block: KVCacheBlock) -> bool:
        """Record that `block` holds `block_hash`. True when the hash had no holder before."""
        holders = self._holders.setdefault(block_hash, {})
        if block.block_id in holders:
            return False
        holders[block.block_id] = block
        self._hashes_of.setdefault(block.block_id, []).append(block_hash)
        return len(holders) == 1

    def holder(self, block_hash: bytes) -> KVCacheBlock | None:
        holders = self._holders.get(block_hash)
        return next(iter(holders.values())) if holders else None

    def pop_block(self, block: KVCacheBlock) -> list[bytes]:
        """Forget everything `block` held (it is being reused). Returns the hashes that no
        block holds any more."""
        gone = []
        for h in self._hashes_of.pop(block.block_id, ()):
            holders = self._holders[h]
            del holders[block.block_id]
            if not holders:
                del self._holders[h]
                gone.append(h)
        return gone

    def clear(self) -> None:
        self._holders.clear()
        self._hashes_of.clear()


def longest_match(
    index: SubBlockIndex, sub_hashes: list[bytes], first: int, limit: int, sub_block_size: int
) -> SubBlockHit | None:
    """Match sub-blocks `first, first+1, ...` (at most `limit` of them) against the index.

    Every holder of the last matched hash also holds the earlier ones (hashes are chained), so it
    is the copy source."""
    src: KVCacheBlock | None = None
    n = 0
    for j in range(first, min(first + limit, len(sub_hashes))):
        holder = index.holder(sub_hashes[j])
        if holder is None:
            break
        src, n = holder, n + 1
    if src is None:
        return None
    return SubBlockHit(src, n * sub_block_size)
