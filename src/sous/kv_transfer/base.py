"""The KV connector seam, vLLM v1's split: a scheduler side in the engine core and a worker
side next to the KV cache tensors. Offload tiers (LMCache) and P/D transfer plug in here.

Scheduler side, called by the `Scheduler` on the engine thread:
- `get_num_new_matched_tokens(request, num_computed_tokens)`: tokens beyond the local prefix
  cache the connector can load; no side effects (it is asked again while a request waits);
- `update_state_after_alloc(request, block_ids, num_external_tokens)`: the request was
  admitted with blocks for those tokens: the connector plans their load;
- `build_connector_meta(scheduler_output, requests)`: the step's plan (loads, saves) for the
  worker, as plain picklable data; resets the step state;
- `request_finished(request, block_ids) -> (delay_free, kv_transfer_params)`: True keeps the
  blocks until the worker reports the request in `get_finished`;
- `update_connector_output(finished_sending, finished_recving)`: what the worker reported.

Worker side, called by the `ModelRunner` around each forward pass:
- `register_kv_caches(kv_caches, block_size)` once;
- `bind_connector_metadata(meta)`, `start_load_kv()` (loads land in the blocks the scheduler
  allocated), `wait_for_layer_load(kv_cache)` / `save_kv_layer(kv_cache)` from attention,
  `wait_for_save(skip_req_ids)` after the forward, `clear_connector_metadata()`;
- `get_load_errors()`: per request whose load fell short, how many leading tokens are valid;
- `get_finished(finished_req_ids) -> (done_sending, done_recving)`, called every step (also
  steps that run nothing while transfers are pending); a request whose asynchronous load
  failed is done receiving and is in the next `get_load_errors()`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sous.engine.request import Request
    from sous.engine.scheduler_output import SchedulerOutput
    from sous.kv_transfer.config import KVTransferConfig


def cache_planes(cache: torch.Tensor) -> tuple[int, int]:
    """(planes, slots) of one layer's paged cache: `[2, num_blocks, block_size, heads,
    head_size]` has 2 planes (K, V), MLA's `[num_blocks, block_size, entry]` one; slots are
    num_blocks * block_size."""
    if cache.dim() == 5:
        return 2, cache.shape[1] * cache.shape[2]
    return 1, cache.shape[0] * cache.shape[1]


def add_counts(total: dict[str, float], more: dict[str, float]) -> None:
    """Add the counters `more` into `total` (connector stats, `get_kv_connector_stats`)."""
    for name, value in more.items():
        total[name] = total.get(name, 0) + value


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """What a connector's scheduler side tells its worker side for one step (subclassed)."""

    def has_loads(self) -> bool:
        """False only when the step surely loads no KV (pipeline stages then skip agreeing
        on failed loads)."""
        return True


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector may know of the engine it serves."""

    model_name: str
    """The served model name (part of offload keys)."""
    kv_cache_spec: Any
    """The model's KV layout (`KVCacheSpec`: layers, heads, head size, dtype)."""
    block_size: int
    world_size: int = 1
    """Pipeline stages (`--pipeline-parallel-size`): each holds its own layers' KV."""
    rank: int = 0
    """The pipeline stage of a worker-side connector (0 on the scheduler side)."""
    dp_rank: int = 0
    """Data-parallel rank (offsets the P/D side channel port, as vLLM)."""
    enable_kv_events: bool = False
    """`--kv-events-config` publishes: connectors report what they store as KV events."""


class KVConnectorBase:
    """Base of every connector; each hook defaults to "nothing to do"."""

    uses_layer_hooks = False
    """True: attention calls `wait_for_layer_load` / `save_kv_layer` for every layer (a
    connector moving KV layer by layer); False spares those calls."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext) -> None:
        self.config = config
        self.role = role
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens loadable beyond `num_computed_tokens`, load is asynchronous); None: ask
        again next step."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: list[Request]) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def update_connector_output(self, finished_sending: set[str],
                                finished_recving: set[str]) -> None:
        """The worker side's `get_finished` of the last step."""
        return None

    def take_events(self) -> list[list[Any]]:
        """KV events (`sous.kv_transfer.events` wire form) since the last call."""
        return []

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        return None

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        return None

    def wait_for_layer_load(self, kv_cache: torch.Tensor) -> None:
        return None

    def save_kv_layer(self, kv_cache: torch.Tensor) -> None:
        return None

    def wait_for_save(self, skip_req_ids: Iterable[str] = ()) -> None:
        return None

    def get_load_errors(self) -> dict[str, int]:
        """Requests of the bound step whose load fell short -> valid leading tokens."""
        return {}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests done sending, requests done receiving) since the last call."""
        return set(), set()

    def get_kv_connector_stats(self) -> dict[str, float]:
        """Counters since the last call (added up by the engine, shown in `/metrics`)."""
        return {}

    def shutdown(self) -> None:
        return None
