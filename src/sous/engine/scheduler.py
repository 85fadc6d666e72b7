"""Scheduler in vLLM v1's style: no prefill/decode phases, only token budgets.

Every request has `num_computed_tokens` and a target (`num_tokens`); each step hands out at
most `max_num_batched_tokens` tokens so requests catch up. Chunked prefill, prefix-cache hits
and preemption are the same arithmetic. Running requests go first, in admission order; when
blocks run out the last-admitted running request is preempted (its KV freed, recomputed later).
Waiting requests are admitted only in steps without preemption.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sous.config.scheduler import SchedulerConfig
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.kv_cache.sub_block import KVCacheCopyOp
from sous.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from sous.engine.structured_output.bitmask import GrammarOutput


@dataclass
class ScheduledRequest:
    """One request's share of a step. `request` is read-only for the runner."""

    request: Request
    num_computed_tokens: int
    """Tokens already in the KV cache before this step."""
    num_scheduled_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so it yields a new token."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.request.num_tokens

    @property
    def input_token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.all_token_ids[start:start + self.num_scheduled_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_cache_copy_ops: list[KVCacheCopyOp] = field(default_factory=list)
    """Sub-block prefix-cache hits: KV slots to copy before the forward pass."""
    grammar: GrammarOutput | None = None
    """Token bitmask of the structured-output rows (set by the engine after scheduling)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class WaitGate(Protocol):
    """Holds back waiting requests that cannot run yet (e.g. WAITING_FOR_FSM while their
    grammar compiles). `ready` may move a request's status back to WAITING."""

    def ready(self, request: Request) -> bool: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = config.max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.gates: list[WaitGate] = []

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_scheduled_tokens
        out.kv_cache_copy_ops = self.kv.take_copy_ops()
        return out

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: int) -> int:
        """Tokens to schedule for `request` once `num_computed_tokens` are in the KV cache:
        what is left, capped by --long-prefill-token-threshold (running requests and new
        admissions alike, as vLLM) and by the step's remaining budget."""
        n = request.num_tokens - num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    return budget
            out.scheduled.append(self._scheduled(request, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: deque[Request] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not all(gate.ready(request) for gate in self.gates):
                skipped.append(self.waiting.popleft())
                continue
            computed, num_hit_tokens = self.kv.get_computed_blocks(request)
            n = self._num_new_tokens(request, num_hit_tokens, budget)
            if self.kv.allocate_slots(request, n, computed) is None:
                break
            self.kv.record_prefix_cache_stats(request, num_hit_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _scheduled(self, request: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(request, request.num_computed_tokens, n,
                                self.kv.get_block_ids(request.request_id))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, apply token-level stop conditions, free finished requests.
        Returns (request, new token ids) for every request that produced tokens."""
        self.kv.commit([(s.request, s.num_computed_tokens + s.num_scheduled_tokens)
                        for s in out.scheduled])
        produced: list[tuple[Request, list[int]]] = []
        finished: list[Request] = []
        for s in out.scheduled:
            request = s.request
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
        self._remove(finished)
        return produced

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
            self.kv.free(request)
            del self.requests[request.request_id]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
        )
