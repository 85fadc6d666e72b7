"""What the scheduler hands the worker each step: plain, picklable data, no live objects.

A request is described in full once (`NewRequestData`), the first step it is scheduled;
after that only what changed (`CachedRequestData`: blocks added this step, progress, and
for a request resumed after preemption its whole block table). The worker keeps its own
copy of every request's tokens (it appends what it samples), so token ids travel again only
on resumption. `finished_req_ids` tells the worker which requests to forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sous.engine.kv_cache.sub_block import KVCacheCopyOp
from sous.engine.outputs import Logprob
from sous.engine.sampling_params import SamplingParams
from sous.kv_transfer.base import add_counts

if TYPE_CHECKING:
    from sous.engine.structured_output.bitmask import GrammarOutput
    from sous.kv_transfer.base import KVConnectorMetadata


@dataclass
class NewRequestData:
    """A request the worker has not seen (or has forgotten): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Non-empty only for a request that produced tokens before it was forgotten."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens already in the KV cache (prefix-cache hits) before this step."""


@dataclass
class CachedRequestData:
    """Per-step changes of requests the worker already holds, as parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    """True: `new_block_ids` replaces the request's block table (its KV was freed)."""
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks allocated this step, appended to the block table (or replacing it)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens in the KV cache before this step."""

    def __len__(self) -> int:
        return len(self.req_ids)

    def add(self, req_id: str, resumed: bool, new_block_ids: list[int],
            num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    """One step's work. `num_scheduled_tokens` has an entry for every scheduled request
    (new and cached), in scheduling order; requests the worker holds but that are absent
    from it are paused this step (preempted, or waiting)."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished since the previous step: the worker drops their state."""
    preempted_req_ids: list[str] = field(default_factory=list)
    """Requests paused this step (their KV was freed): the worker takes them out of its
    batch but keeps their state for when they resume."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens scheduled after a request's known tokens (counted in its
    `num_scheduled_tokens`): the worker computes logits at each of them and at the token
    before them, to verify the drafts."""
    kv_cache_copy_ops: list[KVCacheCopyOp] = field(default_factory=list)
    """Sub-block prefix-cache hits: KV slots to copy before the forward pass."""
    grammar: GrammarOutput | None = None
    """Token bitmask of the structured-output rows (set by the engine after scheduling)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's plan for this step (loads, saves), for its worker side."""
    forward_required: bool = False
    """Expert parallel: another rank runs a forward pass this step, so this one must too (a
    one-token dummy pass when it has nothing to run): every MoE layer is a collective."""
    drafting: bool = True
    """False while `disable_by_batch_size` keeps drafts out (more requests running or
    waiting than it): the next step would drop drafts proposed after this one, so the worker's
    proposer only keeps its per-request state."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """What one step produced, per scheduled request that reached the end of its known
    tokens (requests in the middle of a chunked prefill sample nothing)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    """Per request, per sampled token: {token_id: Logprob}."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose part of the step raised (id -> error): they produced nothing, their
    new KV slots are not valid, and the engine must finish them (aborted)."""
    kv_load_errors: dict[str, int] = field(default_factory=dict)
    """Requests whose KV connector load came up short (id -> leading tokens whose KV is
    valid): they sat out the step; the engine rewinds them to recompute the rest. For a
    request not in the step, its asynchronous load (reported in `finished_recving`) ended
    short."""
    finished_sending: set[str] = field(default_factory=set)
    """Finished requests whose blocks a connector kept for a reader and now releases."""
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous KV load is over (WAITING_FOR_REMOTE_KVS ends)."""
    kv_connector_stats: dict[str, float] = field(default_factory=dict)
    """Counters the connector's worker side added this step (e.g. `kv_transfer_bytes`)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Drafts for the next step (speculative decoding), per request that sampled."""

    def merge(self, other: ModelRunnerOutput) -> None:
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.failed.update(other.failed)
        self.kv_load_errors.update(other.kv_load_errors)
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.spec_token_ids.update(other.spec_token_ids)
        add_counts(self.kv_connector_stats, other.kv_connector_stats)
