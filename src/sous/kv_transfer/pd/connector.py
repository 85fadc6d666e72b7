"""`NixlConnector` / `RblnNixlConnector`: prefill/decode disaggregation as vLLM's
NixlConnector runs it (pull mode): the decode server reads the prompt's KV blocks out of the
prefill server's cache over NIXL (UCX, host memory here), after a handshake on the prefill
server's side channel (`VLLM_NIXL_SIDE_CHANNEL_HOST` / `_PORT`, + data-parallel rank).

The scheduler side (`PDScheduler`) decides what moves and keeps a finished prefill's blocks
under a lease; the worker side (`PDWorker`) owns the NIXL agent and the side channel. Both
legs run in any server with this connector (`kv_role` is a placeholder, as in vLLM): the
request's `kv_transfer_params` say which leg it is. `kv_buffer_device` `cpu`, `cuda` and
`rbln` are accepted; the KV cache is registered where it lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sous.config.errors import ConfigError
from sous.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from sous.kv_transfer.config import KVTransferConfig
from sous.kv_transfer.pd.params import NixlConnectorMetadata
from sous.kv_transfer.pd.scheduler_side import PDScheduler, lease_seconds
from sous.kv_transfer.pd.side_channel import side_channel_address
from sous.kv_transfer.pd.worker_side import PDWorker

if TYPE_CHECKING:
    from sous.engine.request import Request
    from sous.engine.scheduler_output import SchedulerOutput

BUFFER_DEVICES = ("cpu", "cuda", "rbln")


class NixlConnector(KVConnectorBase):
    """See the module docstring."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext) -> None:
        super().__init__(config, role, context)
        name = config.kv_connector
        if config.kv_buffer_device not in BUFFER_DEVICES:
            raise ConfigError(f"--kv-transfer-config {name}: kv_buffer_device "
                              f"{config.kv_buffer_device!r} is not one of {list(BUFFER_DEVICES)}")
        if not config.engine_id:
            raise ConfigError(f"--kv-transfer-config {name}: engine_id is missing")
        try:
            host, port = side_channel_address(context.dp_rank)
            lease_s = lease_seconds(config.kv_connector_extra_config)
        except ValueError as e:
            raise ConfigError(f"--kv-transfer-config {name}: {e}") from None
        self.scheduler: PDScheduler | None = None
        self.worker: PDWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler = PDScheduler(config.engine_id, context.block_size, host, port,
                                         lease_s, pp_size=context.world_size)
        else:
            self.worker = PDWorker(config.engine_id, context.model_name, host, port,
                                   pp_rank=context.rank, pp_size=context.world_size)

    # ---- scheduler side ------------------------------------------------------------------
    def _sched(self) -> PDScheduler:
        assert self.scheduler is not None, "scheduler-side call on the worker side"
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: list[Request]) -> KVConnectorMetadata:
        return self._sched().build_connector_meta()

    def update_connector_output(self, finished_sending: set[str],
                                finished_recving: set[str]) -> None:
        self._sched().update_connector_output(finished_recving)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # ---- worker side ---------------------------------------------------------------------
    def _work(self) -> PDWorker:
        assert self.worker is not None, "worker-side call on the scheduler side"
        return self.worker

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self._work().register_kv_caches(kv_caches, block_size)

    def start_load_kv(self) -> None:
        assert isinstance(self._metadata, NixlConnectorMetadata)
        self._work().start_load_kv(self._metadata)

    def get_load_errors(self) -> dict[str, int]:
        return self._work().get_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._work().get_finished()

    def get_kv_connector_stats(self) -> dict[str, float]:
        return self._work().get_kv_connector_stats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
