"""Block pool and KV cache manager: exact block ids, hit lengths and free-queue order."""

from __future__ import annotations

import pytest

from sous.engine.kv_cache.block_pool import BlockPool
from sous.engine.kv_cache.hashing import hash_block_tokens, sha256_cbor
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.request import Request
from sous.engine.sampling_params import SamplingParams
from sous.kv_transfer.events import hash_to_int


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), frozenset({0}), max_tokens=8)


@pytest.fixture(autouse=True)
def _seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def test_pool_reserves_null_block_and_hands_out_in_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 5
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1]


def test_allocate_and_prefix_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, hash_algo="sha256_cbor")
    r1 = make_request("a", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2
    hits, n = kv.get_computed_blocks(r1)
    assert (hits.block_ids, n) == ([], 0)
    new = kv.allocate_slots(r1, 10)
    kv.record_prefix_cache_stats(r1, n)  # the scheduler's call at admission
    assert [b.block_id for b in new] == [1, 2, 3]
    assert kv.pool.cached_blocks.keys() == set(r1.block_hashes)
    assert len(r1.block_hashes) == 2
    kv.free(r1)
    # Tail first, so the prefix is evicted last.
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]

    r2 = make_request("b", list(range(1, 9)) + [99, 98, 97])  # shares 2 full blocks
    hits, n = kv.get_computed_blocks(r2)
    assert hits.block_ids == [1, 2]
    assert n == 8
    new = kv.allocate_slots(r2, 3, hits)
    kv.record_prefix_cache_stats(r2, n)
    assert [b.block_id for b in new] == [4]
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert kv.pool.blocks[1].ref_cnt == 1
    assert kv.stats.queries == 10 + 11 and kv.stats.hits == 8


def test_hit_is_capped_below_prompt_length() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = make_request("a", list(range(1, 9)))  # exactly 2 blocks
    kv.allocate_slots(r1, 8)
    kv.free(r1)
    r2 = make_request("b", list(range(1, 9)))
    hits, n = kv.get_computed_blocks(r2)
    assert hits.block_ids == [1]  # the last block is recomputed
    assert n == 4


def test_eviction_of_cached_block_on_reuse() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable blocks
    r1 = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(r1, 5) is not None
    kv.free(r1)
    assert len(kv.pool.cached_blocks) == 2
    r2 = make_request("b", [7, 7, 7, 7, 7])
    hits, _ = kv.get_computed_blocks(r2)
    assert hits.block_ids == []
    kv.allocate_slots(r2, 5)
    # Free order was [3, 2, 1]: all three reused, both cached hashes evicted.
    assert kv.get_block_ids("b") == [3, 2, 1]
    assert set(kv.pool.cached_blocks) == set(r2.block_hashes)


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    r1 = make_request("a", [1, 2, 3])
    kv.allocate_slots(r1, 3)
    r2 = make_request("b", [5, 6, 7, 8, 9])
    assert kv.allocate_slots(r2, 5) is None
    assert kv.pool.num_free_blocks == 1
    assert "b" not in kv.req_to_blocks


def test_touch_counts_evictable_hits_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    r1 = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(r1, 5)
    kv.free(r1)
    r2 = make_request("b", [1, 2, 3, 4, 6, 6, 6])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 4
    # 7 tokens need 4 blocks: 2 hits + 2 new, but only 3 are free in all.
    assert kv.allocate_slots(r2, 3, hits) is None
    assert kv.pool.num_free_blocks == 3


def test_sha256_cbor_chain_matches_definition() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_algo="sha256_cbor")
    r = make_request("a", [5, 6, 7, 8, 9])
    kv.update_block_hashes(r)
    root = sha256_cbor("0")
    h1 = hash_block_tokens(sha256_cbor, root, [5, 6])
    h2 = hash_block_tokens(sha256_cbor, h1, [7, 8])
    assert r.block_hashes == [h1, h2]


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    r1 = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(r1, 5)
    kv.free(r1)
    r2 = make_request("b", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(r2)
    assert (hits.block_ids, n) == ([], 0)
    assert not kv.pool.cached_blocks


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    r1 = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(r1, 5)
    assert kv.reset_prefix_cache() is False
    kv.free(r1)
    assert kv.reset_prefix_cache() is True
    assert not kv.pool.cached_blocks


def test_every_holder_of_a_hash_is_indexed_and_events_follow_the_hash() -> None:
    """Two requests compute the same prefix before either is cached: both copies are indexed
    (vLLM), so evicting one keeps the prefix reusable. BlockStored is sent when a hash gets
    its first holder and BlockRemoved when it loses its last, once each."""
    kv = KVCacheManager(num_blocks=8, block_size=4, hash_algo="sha256_cbor",
                        enable_kv_events=True)  # 7 usable blocks
    r1 = make_request("a", list(range(1, 10)))
    assert [b.block_id for b in kv.allocate_slots(r1, 2)] == [1]  # a chunk: nothing full yet
    r1.num_computed_tokens = 2
    r2 = make_request("b", list(range(1, 10)))
    assert kv.get_computed_blocks(r2)[1] == 0
    assert [b.block_id for b in kv.allocate_slots(r2, 9)] == [2, 3, 4]  # caches 2, 3 first
    assert [b.block_id for b in kv.allocate_slots(r1, 7)] == [5, 6]  # 1 and 5: duplicates
    h = [hash_to_int(x) for x in r1.block_hashes]
    assert [e[:2] for e in kv.take_events()] == [["BlockStored", h]]

    kv.free(r2)  # free queue: 7, 4, 3, 2
    r3 = make_request("c", list(range(50, 66)))
    assert [b.block_id for b in kv.allocate_slots(r3, 16)] == [7, 4, 3, 2]
    assert [e[0] for e in kv.take_events()] == ["BlockStored"]  # r3's; a's hashes still held

    r4 = make_request("d", list(range(1, 10)))
    hits, n = kv.get_computed_blocks(r4)
    assert (hits.block_ids, n) == ([1, 5], 8)
    assert [list(kv.pool.cached_blocks[x]) for x in r1.block_hashes] == [[1], [5]]

    kv.free(r1)  # free queue: 6, 5, 1
    assert kv.allocate_slots(make_request("e", list(range(70, 82))), 12) is not None
    removed = [e for e in kv.take_events() if e[0] == "BlockRemoved"]
    assert removed == [["BlockRemoved", [h[1]], "GPU"], ["BlockRemoved", [h[0]], "GPU"]]
    assert r1.block_hashes[0] not in kv.pool.cached_blocks
