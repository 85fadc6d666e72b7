"""`MultiConnector`: several connectors behind one, as vLLM's (e.g. P/D transfer plus an
offload tier). `kv_connector_extra_config.connectors` lists the children's configs.

Loading: in config order the first child matching more than 0 tokens loads the request (any
child answering None makes the answer None); the others see `update_state_after_alloc(...,
0)`. Saving and the per-layer hooks fan out to every child. `request_finished` delays the
free if any child does (the worker reports done-sending per child: the union). The children's `kv_transfer_params` are merged; a key two children set is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sous.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    add_counts,
)
from sous.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    import torch

    from sous.engine.request import Request
    from sous.engine.scheduler_output import SchedulerOutput


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    children: list[KVConnectorMetadata] = field(default_factory=list)

    def has_loads(self) -> bool:
        return any(child.has_loads() for child in self.children)


class MultiConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext) -> None:
        from sous.kv_transfer.factory import create_connector, multi_children

        super().__init__(config, role, context)
        self.children = [create_connector(c, role, context) for c in multi_children(config)]
        self.uses_layer_hooks = any(c.uses_layer_hooks for c in self.children)
        self._loader: dict[str, KVConnectorBase] = {}
        """Request -> the child chosen to load it (scheduler side)."""

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        chosen: tuple[int, bool] | None = None
        for child in self.children:
            n, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n is None:
                return None, False
            if chosen is None and n > 0:
                chosen = (n, load_async)
                self._loader[request.request_id] = child
        if chosen is None:
            self._loader.pop(request.request_id, None)
            return 0, False
        return chosen

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        loader = self._loader.pop(request.request_id, None)
        for child in self.children:
            if child is loader:
                child.update_state_after_alloc(request, block_ids, num_external_tokens)
            else:
                child.update_state_after_alloc(request, [], 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: list[Request]) -> KVConnectorMetadata:
        return MultiKVConnectorMetadata(
            [c.build_connector_meta(scheduler_output, requests) for c in self.children])

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loader.pop(request.request_id, None)
        delay = False
        params: dict[str, Any] | None = None
        for child in self.children:
            child_delay, child_params = child.request_finished(request, block_ids)
            delay = delay or child_delay
            if child_params:
                params = params or {}
                clash = sorted(set(params) & set(child_params))
                if clash:
                    raise RuntimeError(f"MultiConnector: kv_transfer_params {clash} set by two "
                                       "connectors")
                params.update(child_params)
        return delay, params

    def update_connector_output(self, finished_sending: set[str],
                                finished_recving: set[str]) -> None:
        for c in self.children:
            c.update_connector_output(finished_sending, finished_recving)

    def take_events(self) -> list[list[Any]]:
        return [e for c in self.children for e in c.take_events()]

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        for c in self.children:
            c.register_kv_caches(kv_caches, block_size)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, MultiKVConnectorMetadata)
        for child, meta in zip(self.children, metadata.children, strict=True):
            child.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        for c in self.children:
            c.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for c in self.children:
            c.start_load_kv()

    def wait_for_layer_load(self, kv_cache: torch.Tensor) -> None:
        for c in self.children:
            c.wait_for_layer_load(kv_cache)

    def save_kv_layer(self, kv_cache: torch.Tensor) -> None:
        for c in self.children:
            c.save_kv_layer(kv_cache)

    def wait_for_save(self, skip_req_ids: Iterable[str] = ()) -> None:
        skip = set(skip_req_ids)
        for c in self.children:
            c.wait_for_save(skip)

    def get_load_errors(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.children:
            for rid, valid in c.get_load_errors().items():
                out[rid] = min(valid, out.get(rid, valid))
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        for c in self.children:
            s, r = c.get_finished(finished_req_ids)
            sending |= s
            recving |= r
        return sending, recving

    def get_kv_connector_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.children:
            add_counts(out, c.get_kv_connector_stats())
        return out

    def shutdown(self) -> None:
        for c in self.children:
            c.shutdown()
