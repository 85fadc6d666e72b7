"""Sub-block prefix caching: exact hit lengths, copy ops, deferred indexing, eviction, events."""

from __future__ import annotations

import logging

import pytest

from sous.engine.kv_cache.hashing import hash_block_tokens, sha256_cbor
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.kv_cache.sub_block import KVCacheCopyOp, resolve_sub_block_size
from sous.engine.request import Request
from sous.engine.sampling_params import SamplingParams
from sous.kv_transfer.events import hash_to_int


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), frozenset({0}), max_tokens=8)


@pytest.fixture(autouse=True)
def _seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.delenv("VLLM_RBLN_SUB_BLOCK_CACHE", raising=False)


def manager(events: bool = False) -> KVCacheManager:
    """Blocks of 8 tokens, sub-blocks of 2 (4 per block), 9 usable blocks."""
    return KVCacheManager(num_blocks=10, block_size=8, hash_algo="sha256_cbor",
                          enable_kv_events=events, sub_block_size=2)


def run_prefill(kv: KVCacheManager, r: Request) -> list[KVCacheCopyOp]:
    """Schedule the whole prompt in one step, then commit it as the engine does."""
    computed, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, computed) is not None
    r.num_computed_tokens = r.num_tokens
    ops = kv.take_copy_ops()
    kv.commit([(r, r.num_tokens)])
    return ops


def sub_chain(tokens: list[int], size: int) -> list[bytes]:
    parent, out = sha256_cbor("0"), []
    for i in range(0, len(tokens) - size + 1, size):
        parent = hash_block_tokens(sha256_cbor, parent, tokens[i:i + size])
        out.append(parent)
    return out


def test_mode_selection(caplog: pytest.LogCaptureFixture,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    with caplog.at_level(logging.INFO):
        assert resolve_sub_block_size(1024, 128, True) == 128
        assert resolve_sub_block_size(16, 8192, True) is None  # vLLM's default block size
        assert resolve_sub_block_size(1024, 1024, True) is None  # not a *larger* multiple
        assert resolve_sub_block_size(1024, 384, True) is None  # not a multiple
        assert resolve_sub_block_size(1024, 128, False) is None
        assert resolve_sub_block_size(1024, 128, True, enable_sub_block_cache=False) is None
        monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", "0")  # the config decides, not this
        assert resolve_sub_block_size(1024, 128, True) == 128
    text = caplog.text
    assert "sub-blocks of 128 tokens" in text
    assert "full blocks of 16 tokens" in text and "VLLM_RBLN_SUB_BLOCK_CACHE=0" in text


def test_tail_hit_copies_matched_slots_into_a_new_block() -> None:
    kv = manager()
    r1 = make_request("a", list(range(1, 14)))  # block 1 full, 5 tokens in block 2
    assert run_prefill(kv, r1) == []
    assert kv.get_block_ids("a") == [1, 2]

    r2 = make_request("b", list(range(1, 13)) + [50, 51])
    computed, n = kv.get_computed_blocks(r2)
    assert computed.block_ids == [1]
    assert computed.sub_block is not None and computed.sub_block.src.block_id == 2
    assert n == 12  # 8 from the full block + two sub-blocks (9..12)
    new = kv.allocate_slots(r2, 2, computed)
    assert [b.block_id for b in new] == [3]
    assert kv.pool.blocks[2].ref_cnt == 2  # pinned as copy source until the step ran
    assert kv.take_copy_ops() == [KVCacheCopyOp(src_block_id=2, dst_block_id=3, num_tokens=4)]
    kv.commit([(r2, 14)])
    assert kv.pool.blocks[2].ref_cnt == 1
    kv.record_prefix_cache_stats(r2, n)  # the scheduler's call at admission
    assert (kv.stats.queries, kv.stats.hits) == (14, 12)


def test_hit_is_capped_below_prompt_length() -> None:
    kv = manager()
    run_prefill(kv, make_request("a", list(range(1, 14))))
    r2 = make_request("b", list(range(1, 13)))  # 12 tokens: all cached, one must be recomputed
    computed, n = kv.get_computed_blocks(r2)
    assert computed.block_ids == [1] and n == 10  # sub-blocks stop at 10 < 12 - 1


def test_sub_blocks_are_indexed_only_after_the_forward_pass() -> None:
    kv = manager()
    r1 = make_request("a", list(range(1, 14)))
    computed, _ = kv.get_computed_blocks(r1)
    kv.allocate_slots(r1, 13, computed)
    r2 = make_request("b", list(range(1, 13)) + [50, 51])
    computed, n = kv.get_computed_blocks(r2)  # same step as r1's prefill
    assert computed.sub_block is None and n == 8  # the full block is shared, the tail is not
    r1.num_computed_tokens = 13
    kv.commit([(r1, 13)])
    computed, n = kv.get_computed_blocks(r2)
    assert n == 12


def test_freed_blocks_stay_matchable_until_reused() -> None:
    kv = manager(events=True)
    r1 = make_request("a", list(range(1, 14)))
    run_prefill(kv, r1)
    kv.free(r1)
    kv.take_events()
    assert kv.pool.free_queue.block_ids()[-2:] == [2, 1]
    computed, n = kv.get_computed_blocks(make_request("b", list(range(1, 13)) + [7]))
    assert n == 12 and computed.sub_block is not None
    # A 72-token request takes all 9 free blocks: blocks 2 and 1 are reused last.
    big = make_request("c", [99] * 72)
    assert kv.allocate_slots(big, 72) is not None
    removed = [e for e in kv.take_events() if e[0] == "BlockRemoved"]
    gone = {h for e in removed for h in e[1]}
    assert gone == {hash_to_int(h) for h in r1.sub_block_hashes}
    assert len(kv.sub_index) == 0


def test_events_are_per_sub_block_with_their_own_size() -> None:
    kv = manager(events=True)
    tokens = list(range(1, 14))
    r1 = make_request("a", tokens)
    run_prefill(kv, r1)
    events = kv.take_events()
    chain = sub_chain(tokens, 2)
    assert events == [["BlockStored", [hash_to_int(h) for h in chain], None,
                       tokens[:12], 2, None, "GPU"]]
    r2 = make_request("b", tokens[:12] + [50, 51])
    run_prefill(kv, r2)
    # Only the one sub-block no block held before is announced.
    chain2 = sub_chain(tokens[:12] + [50, 51], 2)
    assert kv.take_events() == [["BlockStored", [hash_to_int(chain2[6])],
                                 hash_to_int(chain2[5]), [50, 51], 2, None, "GPU"]]


def test_reset_clears_the_sub_block_index() -> None:
    kv = manager(events=True)
    r1 = make_request("a", list(range(1, 14)))
    run_prefill(kv, r1)
    kv.free(r1)
    assert kv.reset_prefix_cache()
    assert len(kv.sub_index) == 0
    assert kv.take_events()[-1] == ["AllBlocksCleared"]
    _, n = kv.get_computed_blocks(make_request("b", list(range(1, 14))))
    assert n == 0


def test_bad_env_value_is_an_error(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from sous.config.engine_args import engine_config_from_kwargs, parse_serve_args

    monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", "maybe")
    with pytest.raises(ValueError, match="VLLM_RBLN_SUB_BLOCK_CACHE='maybe'"):
        engine_config_from_kwargs()
    with pytest.raises(SystemExit) as e:
        parse_serve_args([], environ={"VLLM_RBLN_SUB_BLOCK_CACHE": "maybe"})
    assert e.value.code == 2
    assert "VLLM_RBLN_SUB_BLOCK_CACHE='maybe'" in capsys.readouterr().err


def test_the_mode_comes_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CacheConfig.enable_sub_block_cache`: set by VLLM_RBLN_SUB_BLOCK_CACHE when flags are
    parsed, by the keyword offline (which wins over the variable); the engine reads only it."""
    from dataclasses import replace

    from sous import LLM
    from sous.config.engine_args import engine_config_from_kwargs, parse_serve_args
    from sous.engine.core import EngineCore

    assert parse_serve_args([], environ={})[0].cache.enable_sub_block_cache is True
    for raw, on in [("0", False), ("off", False), ("1", True), ("yes", True)]:
        config = parse_serve_args([], environ={"VLLM_RBLN_SUB_BLOCK_CACHE": raw})[0]
        assert config.cache.enable_sub_block_cache is on
    assert engine_config_from_kwargs().cache.enable_sub_block_cache is True
    monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", "0")
    assert engine_config_from_kwargs().cache.enable_sub_block_cache is False
    assert engine_config_from_kwargs(enable_sub_block_cache=True).cache.enable_sub_block_cache
    with pytest.raises(TypeError, match="enable_sub_block_cache"):
        engine_config_from_kwargs(enable_sub_block_cache="no")

    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
              block_size=64, max_num_batched_tokens=16)
    llm = LLM(enable_sub_block_cache=True, **kw)  # the keyword wins over the variable
    assert llm.engine.kv_cache_manager.sub_block_size == 16
    monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", "1")
    assert LLM(enable_sub_block_cache=False, **kw).engine.kv_cache_manager.sub_block_size is None
    # EngineCore reads the config it is given, whatever the environment says.
    off = replace(llm.engine.config, cache=replace(llm.engine.config.cache,
                                                   enable_sub_block_cache=False))
    engine = EngineCore(off, loaded=llm.engine.loaded)
    assert engine.kv_cache_manager.sub_block_size is None
