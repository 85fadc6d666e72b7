"""A request as the scheduler sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sous.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sous.engine.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1
    """Waiting for its structured-output grammar to compile; not schedulable yet."""
    WAITING_FOR_REMOTE_KVS = 2
    """Waiting for its KV to arrive from elsewhere (a P/D prefill server, an offload tier);
    a WaitGate holds it back until then."""
    RUNNING = 3
    PREEMPTED = 4
    # Everything from here on is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated. Owned by the scheduler; the KV cache manager keeps the
    request's blocks keyed by `request_id`.

    `num_computed_tokens` counts tokens whose KV is in the cache (or scheduled to be written
    this step); the scheduler brings it up to `num_tokens` step by step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    """Resolved output budget (sampling_params.max_tokens capped by max_model_len)."""
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling (-1: not yet scheduled)."""
    num_external_computed_tokens: int = 0
    """Prompt tokens whose KV a KV connector loaded (offload tier, P/D transfer)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of this request's full blocks, in order (filled by the KV cache manager)."""
    structured_output_request: StructuredOutputRequest | None = None
    """Grammar state when `sampling_params.structured_outputs` is set (owned by the
    StructuredOutputManager)."""
    kv_transfer_params: dict[str, Any] | None = None
    kv_transfer_params_out: dict[str, Any] | None = None
    """What the KV connector's `request_finished` returned: the answer's
    `kv_transfer_params` (P/D: where the decode leg reads this prefill's KV)."""
    """What the KV connector returned when the request finished (P/D: the remote blocks)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Drafts for the next step (speculative decoding): the scheduler schedules them after
    the known tokens, then clears them; they are never part of `all_token_ids`."""
    sub_block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the sub-blocks of `all_token_ids` (sub-block prefix caching only)."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.finished

    def check_stop(self, max_model_len: int) -> bool:
        """Apply token-level stop conditions after a new output token; sets status/stop_reason."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
