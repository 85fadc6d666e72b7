"""The precise prefix index behind `precise-prefix-cache-producer`: request keys computed
from token ids, which pods hold them in which tiers, and the engine keys they came from.

Keys: full blocks of `block_size` tokens, `k_i = xxh64(uint32 ids, seed=k_{i-1})` chained from
`seed_key(hash_seed, model, cache_salt)`. Per pod, an engine key stands for the request keys
its block covers (an engine block may span several router blocks) and the tiers holding it.

Public API: `PrefixIndex`, `seed_key`, `chain_keys`, `engine_key`, `SPECULATIVE`.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

__all__ = ["SPECULATIVE", "PrefixIndex", "chain_keys", "engine_key", "seed_key"]

logger = logging.getLogger("sous.router")

SPECULATIVE = "speculative"
UNLISTED_TIER_WEIGHT = 1.0
_U64 = (1 << 64) - 1


def seed_key(hash_seed: str, model: str, cache_salt: str | None = None) -> int:
    """The chain's root key for a model (or LoRA name) and optional cache salt."""
    text = hash_seed + model + (f"\0{cache_salt}" if cache_salt else "")
    return xxhash.xxh64_intdigest(text.encode())


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Request keys of the full blocks of `token_ids`, chained from `parent`."""
    n = len(token_ids) // block_size
    data = array("I", token_ids[:n * block_size]).tobytes()
    step, out = 4 * block_size, []
    for i in range(n):
        parent = xxhash.xxh64_intdigest(data[i * step:(i + 1) * step], parent)
        out.append(parent)
    return out


def engine_key(h: Any) -> int:
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h[-8:], "big")  # vLLM's raw digest: its low 64 bits
    if isinstance(h, int) and not isinstance(h, bool):
        return h & _U64
    raise ValueError(f"block hash {h!r} is neither int nor bytes")


class _Entry:
    """What one engine key of a pod stands for."""

    __slots__ = ("keys", "tiers")

    def __init__(self, keys: tuple[int, ...]) -> None:
        self.keys = keys
        self.tiers: set[str] = set()


class PrefixIndex:
    """Request key -> {pod: tiers}, per pod engine key -> `_Entry`, and speculative entries
    with their expiry. Thread-safe: the event thread writes, the request path reads."""

    def __init__(self, block_size: int, hash_seed: str, tier_weights: Mapping[str, float]) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.tier_weights = tier_weights
        self._lock = threading.Lock()
        self._holders: dict[int, dict[str, set[str]]] = {}
        self._engine: dict[str, dict[int, _Entry]] = {}
        self._spec: dict[tuple[str, int], float] = {}
        self._spec_queue: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._warned: set[tuple[str, int]] = set()

    def _add(self, key: int, pod: str, tier: str) -> None:
        self._holders.setdefault(key, {}).setdefault(pod, set()).add(tier)

    def _discard(self, key: int, pod: str, tier: str | None) -> None:
        pods = self._holders.get(key)
        tiers = pods.get(pod) if pods else None
        if tiers is None:
            return
        if tier is not None:
            tiers.discard(tier)
        if tier is None or not tiers:
            del pods[pod]
            if not pods:
                del self._holders[key]

    def store(self, pod: str, model: str, hashes: Sequence[int], parent: int | None,
              token_ids: Sequence[int] | None, engine_block_size: int, tier: str) -> int:
        """Index a `BlockStored`; returns the number of engine blocks indexed."""
        if not token_ids:
            with self._lock:
                entries = self._engine.get(pod, {})
                known = [(h, entries[h]) for h in hashes if h in entries]
                for _, entry in known:
                    entry.tiers.add(tier)
                    for k in entry.keys:
                        self._add(k, pod, tier)
            return len(known)
        if engine_block_size <= 0 or len(token_ids) != len(hashes) * engine_block_size:
            logger.debug("KV events from %s: BlockStored of %d hashes with %d tokens of block "
                         "size %s skipped", pod, len(hashes), len(token_ids), engine_block_size)
            return 0
        if engine_block_size % self.block_size:
            if (pod, engine_block_size) not in self._warned:
                self._warned.add((pod, engine_block_size))
                logger.warning("KV events from %s: engine block size %d is not a multiple of "
                               "the router's %d; its events are ignored", pod,
                               engine_block_size, self.block_size)
            return 0
        with self._lock:
            entry = self._engine.get(pod, {}).get(parent) if parent is not None else None
        if parent is not None and entry is None:
            logger.debug("KV events from %s: BlockStored after unknown parent %x skipped",
                         pod, parent)
            return 0
        root = entry.keys[-1] if entry is not None else seed_key(self.hash_seed, model)
        keys = chain_keys(root, token_ids, self.block_size)
        per = engine_block_size // self.block_size
        with self._lock:
            entries = self._engine.setdefault(pod, {})
            for i, h in enumerate(hashes):
                new = tuple(keys[i * per:(i + 1) * per])
                entry = entries.get(h)
                if entry is not None and entry.keys != new:
                    self._drop_entry(pod, h)
                    entry = None
                entry = entry or entries.setdefault(h, _Entry(new))
                entry.tiers.add(tier)
                for k in new:
                    self._add(k, pod, tier)
        return len(hashes)

    def _drop_entry(self, pod: str, h: int) -> None:
        entry = self._engine[pod].pop(h)
        for tier in entry.tiers:
            for k in entry.keys:
                self._discard(k, pod, tier)

    def remove(self, pod: str, hashes: Iterable[int], tier: str) -> None:
        """A `BlockRemoved`: the engine keys leave `tier` (and the index when in no tier)."""
        with self._lock:
            entries = self._engine.get(pod, {})
            for h in hashes:
                entry = entries.get(h)
                if entry is None:
                    continue
                entry.tiers.discard(tier)
                for k in entry.keys:
                    self._discard(k, pod, tier)
                if not entry.tiers:
                    del entries[h]

    def clear(self, pod: str) -> None:
        """`AllBlocksCleared`: drop everything the pod holds, speculative entries included."""
        with self._lock:
            for entry in self._engine.pop(pod, {}).values():
                for k in entry.keys:
                    self._discard(k, pod, None)
            for p, k in [pk for pk in self._spec if pk[0] == pod]:
                del self._spec[(p, k)]
                self._discard(k, pod, None)

    def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """Count `pod` as holding `keys` (tier `speculative`) for `ttl_s` seconds."""
        expiry = time.monotonic() + ttl_s
        with self._lock:
            self._expire(time.monotonic())
            for k in keys:
                self._spec[(pod, k)] = expiry
                self._add(k, pod, SPECULATIVE)
            self._spec_queue.append((expiry, pod, tuple(keys)))

    def _expire(self, now: float) -> None:
        while self._spec_queue and self._spec_queue[0][0] <= now:
            _, pod, keys = self._spec_queue.popleft()
            for k in keys:
                if self._spec.get((pod, k), now + 1) <= now:
                    del self._spec[(pod, k)]
                    self._discard(k, pod, SPECULATIVE)

    def match(self, keys: Sequence[int], pods: Iterable[str]) -> dict[str, float]:
        """Per pod, the tier-weighted count of the consecutive leading `keys` it holds."""
        scores = dict.fromkeys(pods, 0.0)
        alive = set(scores)
        weights = self.tier_weights
        with self._lock:
            self._expire(time.monotonic())
            for k in keys:
                holders = self._holders.get(k)
                if not holders:
                    break
                alive = {p for p in alive if p in holders}
                for p in alive:
                    scores[p] += max(weights.get(t, UNLISTED_TIER_WEIGHT) for t in holders[p])
                if not alive:
                    break
        return scores
