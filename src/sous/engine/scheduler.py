"""Scheduler in vLLM v1's style: no prefill/decode phases, only token budgets.

Every request has `num_computed_tokens` and a target (`num_tokens`); each step hands out at
most `max_num_batched_tokens` tokens so requests catch up. Chunked prefill, prefix-cache hits
and preemption are the same arithmetic. Running requests go first, in admission order; when
blocks run out the last-admitted running request is preempted (its KV freed, recomputed later).
Waiting requests are admitted only in steps without preemption.

A KV connector (`connector`, `sous.kv_transfer.base`) adds external hits: on admission the
tokens it can load beyond the local prefix cache count as computed, and it plans their load
(and its saves) in `SchedulerOutput.kv_connector_metadata`. An asynchronous load (P/D: KV
read from the prefill server) parks the admitted request in WAITING_FOR_REMOTE_KVS with its
blocks allocated (not yet indexed) until the worker reports it received (`finish_recving`);
then it re-enters the waiting queue with those tokens computed, less the last prompt token,
which is recomputed for its logits.

Speculative decoding is the same arithmetic too: a running request's drafts
(`Request.spec_token_ids`, from the previous step's proposer) are scheduled after its known
tokens (`SchedulerOutput.scheduled_spec_decode_tokens`) and count in `num_computed_tokens`;
when the step's output says how many were accepted, the rejected ones are taken back off
(their slots are rewritten next step; prefix-cache hashes only ever cover known tokens).

The scheduler owns the Request objects; what it hands the worker is a `SchedulerOutput` of
plain data: a request in full the first time it is scheduled, then per-step diffs (new
blocks, progress, resumption after preemption), and the ids finished since the last step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from sous.config.scheduler import SchedulerConfig
from sous.engine.kv_cache.manager import ComputedBlocks, KVCacheManager
from sous.engine.request import Request, RequestStatus
from sous.engine.scheduler_output import NewRequestData, SchedulerOutput
from sous.engine.spec_decode.metrics import SpecDecodingStats
from sous.kv_transfer.base import KVConnectorBase


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_kv_load_failures: int = 0
    kv_connector_stats: dict[str, float] = field(default_factory=dict)
    spec_decoding: SpecDecodingStats | None = None
    """Speculative decoding counters since start (None: not configured)."""


class WaitGate(Protocol):
    """Holds back waiting requests that cannot run yet (e.g. WAITING_FOR_FSM while their
    grammar compiles). `ready` may move a request's status back to WAITING."""

    def ready(self, request: Request) -> bool: ...


class FinishHook(Protocol):
    """Told of every finished request before its blocks are freed (a KV connector's
    scheduler side). Returning True keeps the blocks: the hook must later call
    `Scheduler.free_delayed(request_id)` (e.g. once a remote reader has them, or a lease
    expired)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = config.max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_kv_load_failures = 0
        """KV connector loads that fell short (their requests recomputed or failed)."""
        self.kv_connector_stats: dict[str, float] = {}
        """The connector's worker-side counters, added up (`get_kv_connector_stats`)."""
        self.gates: list[WaitGate] = []
        self._num_sent_blocks: dict[str, int] = {}
        """Per request the worker holds: how many of its block ids it has been sent."""
        self._resumed: set[str] = set()
        """Preempted requests the worker holds: their next blocks replace the old ones."""
        self._finished_req_ids: set[str] = set()
        """Finished since the last `schedule()`: the worker forgets them."""
        self.finish_hooks: list[FinishHook] = []
        self.delayed: dict[str, Request] = {}
        """Finished requests whose blocks a FinishHook keeps (see `free_delayed`)."""
        self.connector: KVConnectorBase | None = None
        """A KV connector's scheduler side (set by the engine when one is configured)."""
        self.recving: dict[str, tuple[Request, int, int]] = {}
        """WAITING_FOR_REMOTE_KVS requests -> (request, local hit tokens, tokens computed once
        their load is done)."""
        self._loaded: set[str] = set()
        """Waiting requests whose KV an asynchronous load put in their blocks."""
        self.spec_decoding: SpecDecodingStats | None = None
        """Acceptance counters, set by the engine when speculative decoding is on."""
        self.num_lookahead_tokens = 0
        """KV slots allocated beyond each request's scheduled tokens, for a drafter that
        writes its own KV ahead of the model (EAGLE-3: k)."""
        self.spec_disable_batch_size: int | None = None
        """`disable_by_batch_size`: no drafts are scheduled while more requests than this
        are running or waiting."""

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.recving)

    def has_pending_kv_transfers(self) -> bool:
        """A connector is moving KV for requests here (loads in flight, finished requests'
        blocks kept for a reader): the worker must be polled even with nothing to run."""
        return bool(self.recving or self.delayed)

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Hand out this step's token budget, to at most `max_num_reqs` requests (a pipeline
        micro-batch; None: no cap); advances each scheduled request's `num_computed_tokens`
        by its share."""
        out = SchedulerOutput()
        scheduled: list[tuple[Request, int]] = []
        budget = self.config.max_num_batched_tokens
        limit = max_num_reqs or self.config.max_num_seqs
        budget = self._schedule_running(scheduled, out, budget, limit)
        if not out.preempted_req_ids:
            self._schedule_waiting(scheduled, budget, limit)
        for request, n in scheduled:
            self._describe(out, request, n)
            request.num_computed_tokens += n
        out.kv_cache_copy_ops = self.kv.take_copy_ops()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(
                out, [r for r, _ in scheduled])
        if scheduled:  # an empty step reaches no worker: the ids wait for the next one
            out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        out.drafting = self._drafting()
        return out

    def _drafting(self) -> bool:
        """Whether drafts are scheduled at the current number of requests
        (`spec_disable_batch_size`)."""
        limit = self.spec_disable_batch_size
        return limit is None or len(self.running) + len(self.waiting) <= limit

    def _describe(self, out: SchedulerOutput, request: Request, n: int) -> None:
        """Add `request`'s share of the step to `out`: in full if the worker does not hold
        it, else only what changed since it was last scheduled."""
        rid = request.request_id
        block_ids = self.kv.get_block_ids(rid)
        sent = self._num_sent_blocks.get(rid)
        if sent is None:
            out.scheduled_new_reqs.append(NewRequestData(
                rid, list(request.prompt_token_ids), list(request.output_token_ids),
                request.sampling_params, block_ids, request.num_computed_tokens))
        else:
            resumed = rid in self._resumed
            self._resumed.discard(rid)
            out.scheduled_cached_reqs.add(rid, resumed, block_ids if resumed else block_ids[sent:],
                                          request.num_computed_tokens)
        self._num_sent_blocks[rid] = len(block_ids)
        out.num_scheduled_tokens[rid] = n

    def scheduled_requests(self, out: SchedulerOutput) -> list[Request]:
        """The Request objects of `out`'s scheduled requests, in its order."""
        return [self.requests[rid] for rid in out.num_scheduled_tokens if rid in self.requests]

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: int,
                        num_drafts: int = 0) -> int:
        """Tokens to schedule for `request` once `num_computed_tokens` are in the KV cache:
        what is left (with `num_drafts` draft tokens after the known ones), capped by
        --long-prefill-token-threshold (running requests and new admissions alike, as vLLM)
        and by the step's remaining budget."""
        n = request.num_tokens + num_drafts - num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def _schedule_running(self, scheduled: list[tuple[Request, int]], out: SchedulerOutput,
                          budget: int, max_num_reqs: int) -> int:
        drafting = self._drafting()
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < max_num_reqs:
            request = self.running[i]
            drafts, request.spec_token_ids = request.spec_token_ids if drafting else [], []
            n = self._num_new_tokens(request, request.num_computed_tokens, budget, len(drafts))
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(
                    request, n, num_lookahead_tokens=self.num_lookahead_tokens) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    return budget
            num_drafts = request.num_computed_tokens + n - request.num_tokens
            if num_drafts > 0:
                out.scheduled_spec_decode_tokens[request.request_id] = drafts[:num_drafts]
            scheduled.append((request, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, scheduled: list[tuple[Request, int]], budget: int,
                          max_num_reqs: int) -> None:
        skipped: deque[Request] = deque()
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(scheduled) < max_num_reqs):
            request = self.waiting[0]
            if not all(gate.ready(request) for gate in self.gates):
                skipped.append(self.waiting.popleft())
                continue
            computed, num_hit_tokens, ext, load_async = self._lookup(request)
            if ext is None:  # the connector cannot tell yet: ask again next step
                skipped.append(self.waiting.popleft())
                continue
            num_external = ext
            if load_async and num_external > 0:
                if not self._admit_recving(request, computed, num_hit_tokens, num_external):
                    break
                continue
            n = self._num_new_tokens(request, num_hit_tokens + num_external, budget)
            if self.kv.allocate_slots(request, n, computed, num_external,
                                      num_lookahead_tokens=self.num_lookahead_tokens) is None:
                break
            if request.request_id in self._loaded:
                self._loaded.discard(request.request_id)
            else:
                self.kv.record_prefix_cache_stats(request, num_hit_tokens)
                if self.connector is not None:
                    self.connector.update_state_after_alloc(
                        request, self.kv.get_block_ids(request.request_id), num_external)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens + num_external
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
                request.num_external_computed_tokens += num_external
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _lookup(self, request: Request) -> tuple[ComputedBlocks | None, int, int | None, bool]:
        """(local prefix-cache hit blocks, their tokens, tokens a connector can load beyond
        them (None: ask again next step), whether that load is asynchronous)."""
        if request.request_id in self._loaded:  # its blocks already hold the loaded KV
            return None, request.num_computed_tokens, 0, False
        computed, num_hit_tokens = self.kv.get_computed_blocks(request)
        if self.connector is None:
            return computed, num_hit_tokens, 0, False
        ext, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        return computed, num_hit_tokens, ext, load_async

    def _admit_recving(self, request: Request, computed: ComputedBlocks | None,
                       num_hit_tokens: int, num_external: int) -> bool:
        """Allocate blocks for a request whose external tokens load asynchronously and park
        it in WAITING_FOR_REMOTE_KVS; False if the pool is too small."""
        if self.kv.allocate_slots(request, 0, computed, num_external,
                                  delay_cache_blocks=True) is None:
            return False
        self.kv.record_prefix_cache_stats(request, num_hit_tokens)
        assert self.connector is not None
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_external)
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        self.recving[request.request_id] = (request, num_hit_tokens,
                                            num_hit_tokens + num_external)
        return True

    def finish_recving(self, req_ids: Iterable[str], num_valid: dict[str, int]) -> None:
        """The worker finished loading these requests' KV (`num_valid`: those whose load
        came up short -> leading tokens that are valid; they recompute the rest). Requests
        finished meanwhile had their blocks kept for the load: they are freed now."""
        for rid in req_ids:
            if rid in self.delayed:
                self.free_delayed(rid)
                continue
            entry = self.recving.pop(rid, None)
            if entry is None:
                continue
            request, num_hit, num_loaded = entry
            if rid in num_valid:
                self.num_kv_load_failures += 1
            valid = min(num_valid.get(rid, num_loaded), num_loaded)
            self.kv.cache_blocks(request, valid)
            request.num_computed_tokens = min(valid, request.num_tokens - 1)
            request.num_external_computed_tokens = max(valid - num_hit, 0)
            request.status = RequestStatus.WAITING
            self._loaded.add(rid)
            self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        if request.request_id in self._num_sent_blocks:
            self._resumed.add(request.request_id)
        self._loaded.discard(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> list[tuple[Request, list[int]]]:
        """Take rejected drafts back off `num_computed_tokens`, append sampled tokens, apply
        token-level stop conditions, free finished requests and keep the next step's drafts
        (`spec_token_ids`). Returns (request, new token ids) for every request that produced
        tokens."""
        requests = self.scheduled_requests(out)
        self._apply_verification(out, sampled_token_ids)
        self.kv.commit([(r, r.num_computed_tokens) for r in requests])
        produced: list[tuple[Request, list[int]]] = []
        finished: list[Request] = []
        for request in requests:
            tokens = sampled_token_ids.get(request.request_id)
            if not tokens or request.is_finished():
                continue
            new: list[int] = []
            for token in tokens:
                request.append_output_token(token)
                new.append(token)
                if request.check_stop(self.max_model_len):
                    finished.append(request)
                    break
            produced.append((request, new))
            if spec_token_ids and not request.is_finished():
                request.spec_token_ids = spec_token_ids.get(request.request_id, [])
        self._remove(finished)
        return produced

    def _apply_verification(self, out: SchedulerOutput,
                            sampled_token_ids: dict[str, list[int]]) -> None:
        """Each verified request emitted its accepted drafts plus one token: the drafts it
        rejected are no longer computed."""
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            request = self.requests.get(rid)
            tokens = sampled_token_ids.get(rid)
            if request is None or not tokens or rid not in out.num_scheduled_tokens:
                continue
            num_accepted = len(tokens) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            if self.spec_decoding is not None:
                self.spec_decoding.observe(len(drafts), num_accepted)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (stop string, abort, ...) requests still held here; unknown ids are ignored.
        A status already set to finished (e.g. by the output processor) is kept."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if not request.is_finished():
                request.status = status
            finished.append(request)
        self._remove(finished)

    def _remove(self, finished: list[Request]) -> None:
        if not finished:
            return
        gone = {r.request_id for r in finished}
        self.running = [r for r in self.running if r.request_id not in gone]
        if any(r.request_id in gone for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
        for request in finished:
            self.recving.pop(request.request_id, None)
            self._loaded.discard(request.request_id)
            block_ids = self.kv.get_block_ids(request.request_id)
            delay = any([h.request_finished(request, block_ids) for h in self.finish_hooks])
            if self.connector is not None:
                keep, request.kv_transfer_params_out = self.connector.request_finished(
                    request, block_ids)
                delay = delay or keep
            if delay:
                self.delayed[request.request_id] = request
            else:
                self.kv.free(request)
            del self.requests[request.request_id]
            if self._num_sent_blocks.pop(request.request_id, None) is not None:
                self._finished_req_ids.add(request.request_id)
            self._resumed.discard(request.request_id)

    def free_delayed(self, request_id: str) -> None:
        """Free the blocks a FinishHook kept for a finished request (unknown ids: no-op)."""
        request = self.delayed.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def rewind(self, request: Request, num_valid_tokens: int) -> None:
        """A request's KV load came up short: only its first `num_valid_tokens` tokens are in
        its blocks. It recomputes the rest (its blocks past them are un-indexed)."""
        self.kv.discard_unwritten(request, num_valid_tokens)
        self.num_kv_load_failures += 1
        request.num_computed_tokens = num_valid_tokens
        request.num_cached_tokens = min(request.num_cached_tokens, num_valid_tokens)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.recving),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_kv_load_failures=self.num_kv_load_failures,
            kv_connector_stats=dict(self.kv_connector_stats),
            spec_decoding=None if self.spec_decoding is None else self.spec_decoding.copy(),
        )
