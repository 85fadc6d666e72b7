"""Scheduler arithmetic without a model: budgets, chunked prefill, preemption, stop checks."""

from __future__ import annotations

import pytest

from sous.config.scheduler import SchedulerConfig
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.request import Request, RequestStatus
from sous.engine.sampling_params import SamplingParams
from sous.engine.scheduler import Scheduler

EOS = 0


@pytest.fixture(autouse=True)
def _seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                   max_seqs: int = 8, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=256), kv)


def req(rid: str, n: int, max_tokens: int = 4, first: int = 1, **kw: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(rid, list(range(first, first + n)), params, frozenset({EOS}), max_tokens)


def fake_step(s: Scheduler, token: int = 7) -> dict[str, int]:
    """One step with a fake worker: every request whose prompt is fully computed samples
    `token`. Returns the tokens scheduled per request."""
    out = s.schedule()
    sampled = {r.request_id: [token] for r in s.scheduled_requests(out)
               if r.num_computed_tokens >= r.num_tokens}
    s.update_from_output(out, sampled)
    return dict(out.num_scheduled_tokens)


def test_chunked_prefill_then_decode() -> None:
    s = make_scheduler(budget=16)
    r = req("a", 40)
    s.add_request(r)
    assert fake_step(s) == {"a": 16}
    assert r.num_output_tokens == 0
    assert fake_step(s) == {"a": 16}
    assert fake_step(s) == {"a": 8}
    assert r.output_token_ids == [7]
    assert fake_step(s) == {"a": 1}
    assert r.num_computed_tokens == 41


def test_budget_shared_running_first() -> None:
    s = make_scheduler(budget=10)
    a, b = req("a", 6), req("b", 6, first=100)
    s.add_request(a)
    s.add_request(b)
    assert fake_step(s) == {"a": 6, "b": 4}
    assert fake_step(s) == {"a": 1, "b": 2}


def test_max_num_seqs() -> None:
    s = make_scheduler(budget=100, max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 3))
    assert set(fake_step(s)) == {"0", "1"}
    assert len(s.waiting) == 1


def test_finishes_on_max_tokens_and_frees() -> None:
    s = make_scheduler()
    r = req("a", 5, max_tokens=2)
    s.add_request(r)
    fake_step(s)
    fake_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not s.has_unfinished_requests()
    assert s.kv.usage() == 0.0


def test_eos_and_min_tokens_and_stop_token_ids() -> None:
    s = make_scheduler()
    r = req("a", 3, max_tokens=10, min_tokens=2)
    s.add_request(r)
    fake_step(s, token=EOS)  # ignored: min_tokens not reached
    assert not r.is_finished()
    fake_step(s, token=EOS)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    s2 = make_scheduler()
    r2 = req("b", 3, max_tokens=10, stop_token_ids=[9])
    s2.add_request(r2)
    fake_step(s2, token=9)
    assert r2.status == RequestStatus.FINISHED_STOPPED and r2.stop_reason == 9


def test_preemption_by_recompute() -> None:
    # 6 usable blocks of 4 tokens. Two requests of 8 prompt tokens take 4 blocks; decoding
    # grows them until one must be preempted.
    s = make_scheduler(num_blocks=7, block_size=4, budget=32, caching=False)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    fake_step(s)
    for _ in range(4):
        fake_step(s)  # both cross into a 3rd block: 6 blocks used
    assert s.kv.pool.num_free_blocks == 0
    for _ in range(4):
        fake_step(s)
    assert b.status == RequestStatus.PREEMPTED or b.num_preemptions >= 1
    assert s.num_preemptions >= 1
    assert b in s.waiting or b in s.running
    # Everything finishes eventually and all blocks come back.
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        fake_step(s)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.kv.pool.num_free_blocks == 6


def test_abort_frees_blocks() -> None:
    s = make_scheduler()
    r = req("a", 10)
    s.add_request(r)
    fake_step(s)
    assert s.kv.usage() > 0
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.usage() == 0.0 and not s.has_unfinished_requests()


def test_prefix_hit_sets_num_cached_tokens() -> None:
    s = make_scheduler(budget=64)
    a = req("a", 12, max_tokens=1)
    s.add_request(a)
    fake_step(s)
    assert a.is_finished() and a.num_cached_tokens == 0
    b = req("b", 12, max_tokens=1)
    s.add_request(b)
    assert fake_step(s) == {"b": 4}
    assert b.num_cached_tokens == 8


def test_long_prefill_token_threshold_caps_admissions_too() -> None:
    """vLLM caps every prefill chunk at --long-prefill-token-threshold, new admissions
    included (a prefix hit counts as computed: the cap applies to what is left)."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256,
                                  long_prefill_token_threshold=5), kv)
    a = req("a", 12)
    s.add_request(a)
    assert fake_step(s) == {"a": 5}
    assert fake_step(s) == {"a": 5}
    assert fake_step(s) == {"a": 2}
    b = req("b", 20)  # shares a's 3 cached full blocks (12 tokens) -> 8 left, in 2 chunks
    s.add_request(b)
    assert fake_step(s) == {"a": 1, "b": 5}
    assert b.num_cached_tokens == 12
    assert fake_step(s) == {"a": 1, "b": 3}


def test_prefix_cache_stats_count_each_admission_once() -> None:
    """A request that waits several steps for blocks looks the cache up each step but is
    counted once, when admitted (vLLM); a re-admission after preemption counts apart."""
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)  # 5 usable blocks
    a = req("a", 16, max_tokens=2)
    b = Request("b", a.prompt_token_ids[:8] + list(range(100, 108)),
                SamplingParams(max_tokens=2), frozenset({EOS}), 2)
    s.add_request(a)
    s.add_request(b)
    assert fake_step(s) == {"a": 16}  # b: 2 hit blocks + 2 new > 1 free block
    assert fake_step(s) == {"a": 1}  # a takes the last block and finishes
    assert fake_step(s) == {"b": 8}
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (32, 8)
    stats = s.kv.stats
    assert (stats.requests, stats.preempted_requests) == (2, 0)


def test_readmissions_after_preemption_are_counted_apart() -> None:
    s = make_scheduler(num_blocks=7, block_size=4, budget=32)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12, first=50)
    s.add_request(a)
    s.add_request(b)
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        fake_step(s)
    stats = s.kv.stats
    assert s.num_preemptions >= 1
    assert (stats.requests, stats.queries) == (2, 16)
    assert stats.preempted_requests == s.num_preemptions


@pytest.mark.parametrize("limit, drafted", [(None, True), (3, True), (2, False)])
def test_disable_by_batch_size_stops_drafts(limit: int | None, drafted: bool) -> None:
    """`disable_by_batch_size`: with more requests running or waiting than the limit, the
    proposer's drafts are dropped and each request decodes one token."""
    s = make_scheduler()
    s.spec_disable_batch_size = limit
    for i in range(3):
        s.add_request(req(f"r{i}", 4, max_tokens=8, first=10 * i + 1))
    fake_step(s)  # prefill; every request samples its first token
    for r in s.running:
        r.spec_token_ids = [7, 7]
    out = s.schedule()
    assert out.drafting is drafted  # the worker's proposer is told to draft or not
    assert bool(out.scheduled_spec_decode_tokens) is drafted
    assert set(out.num_scheduled_tokens.values()) == ({3} if drafted else {1})
    assert all(not r.spec_token_ids for r in s.running)
