"""The P/D connector's scheduler side (vLLM's NixlConnector, pull mode).

Decode leg: a request whose `kv_transfer_params` name a remote prefill reports every prompt
token beyond the local prefix cache as matched, loaded asynchronously; once admitted with
blocks, its read (the unhit tail of the prompt's blocks) goes into the next step's plan. A
request admitted on a full local hit, or finished before admission, still gets an empty read
so the prefill side frees its blocks at once. Only the first admission reads: the params are
marked done (`do_remote_prefill: false`), so a preempted request recomputes locally.

Prefill leg: a request carrying `do_remote_decode` that finishes by length or stop keeps its
blocks under a lease (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT` seconds, 480 by default as vLLM, or
`kv_connector_extra_config.kv_lease_duration`) until the reader's notification or the
lease's end; its answer carries the params a decode leg needs. An aborted one frees at once.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sous.engine.kv_cache.manager import cdiv
from sous.engine.request import RequestStatus
from sous.kv_transfer.pd.params import NixlConnectorMetadata, RecvSpec, remote_prefill

if TYPE_CHECKING:
    from sous.engine.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 480.0
"""vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` default."""
EXPIRY_MARGIN_S = 1.0
"""A read is not started this close to the end of the prefill's lease."""


def lease_seconds(extra: dict[str, Any], env: dict[str, str] | None = None) -> float:
    """How long a finished prefill keeps its blocks for a reader; ValueError naming the
    setting when it is not a positive number."""
    env = os.environ if env is None else env
    if "kv_lease_duration" in extra:
        raw, name = extra["kv_lease_duration"], "kv_connector_extra_config.kv_lease_duration"
    else:
        raw = env.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", DEFAULT_LEASE_S)
        name = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={raw!r}: not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: must be positive")
    return value


class PDScheduler:
    """See the module docstring. `engine_id` names this engine's NIXL agent; `host`/`port`
    its side channel, which prefill answers point readers to."""

    def __init__(self, engine_id: str, block_size: int, host: str, port: int,
                 lease_s: float, pp_size: int = 1) -> None:
        self.engine_id = engine_id
        self.pp_size = pp_size
        """This engine's pipeline stages: prefill answers say so; decode legs recompute."""
        self.block_size = block_size
        self.host, self.port = host, port
        self.lease_s = lease_s
        self._recvs: list[RecvSpec] = []
        self._sends: dict[str, float] = {}
        self.inflight: set[str] = set()
        """Requests whose read the worker has (or will get next step) and has not finished."""
        self._warned_invalid = False
        self._warned_stages = False

    # ---- decode leg --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if remote_prefill(request.kv_transfer_params) is None:
            self._warn_if_invalid(request)
            return 0, False
        if self.pp_size > 1:  # each stage would read its own layers: not built yet
            if not self._warned_stages:
                self._warned_stages = True
                logger.warning("A decode leg on a server of %d pipeline stages computes its "
                               "prompt itself (reading KV into pipeline stages is not "
                               "supported yet); the prefill's blocks are released.",
                               self.pp_size)
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        remote = remote_prefill(request.kv_transfer_params)
        if remote is None:
            return
        request.kv_transfer_params = {**(request.kv_transfer_params or {}),
                                      "do_remote_prefill": False}
        if num_external_tokens == 0:  # full local hit: only release the prefill's blocks
            self._recvs.append(RecvSpec(request.request_id, remote, [], [], 0))
            return
        num_hit = request.num_prompt_tokens - num_external_tokens
        first = num_hit // self.block_size
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        remote_ids = list(remote.block_ids[first:num_blocks])
        local_ids = block_ids[first:num_blocks]
        reason = ""
        if len(remote_ids) < len(local_ids):
            reason = (f"the prefill sent {len(remote.block_ids)} blocks for a "
                      f"{request.num_prompt_tokens}-token prompt")
        elif (remote.expiry_time is not None
              and time.time() > remote.expiry_time - EXPIRY_MARGIN_S):
            reason = "its prefill's lease ended before the read"
        self._recvs.append(RecvSpec(request.request_id, remote, local_ids, remote_ids,
                                    num_hit, reason))
        self.inflight.add(request.request_id)

    def _warn_if_invalid(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and not self._warned_invalid:
            self._warned_invalid = True
            logger.warning("Got invalid KVTransferParams: %s. This request will not utilize "
                           "KVTransfer", params)

    # ---- both legs ---------------------------------------------------------------------
    def build_connector_meta(self) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(self._recvs, self._sends)
        self._recvs, self._sends = [], {}
        return meta

    def update_connector_output(self, finished_recving: set[str]) -> None:
        self.inflight -= finished_recving

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        rid = request.request_id
        if not params:
            return False, None
        remote = remote_prefill(params)
        if remote is not None:  # a decode leg finished before admission
            self._recvs.append(RecvSpec(rid, remote, [], [], 0))
            return False, None
        if rid in self.inflight:  # a read still writes into its blocks
            return True, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None
        self._sends[rid] = time.monotonic() + self.lease_s
        return True, {
            "remote_blocks_expiry_time": time.time() + self.lease_s,
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)], "remote_engine_id": self.engine_id,
            "remote_request_id": rid, "remote_host": self.host, "remote_port": self.port,
            "tp_size": 1, "pp_size": self.pp_size,
            "remote_num_tokens": request.num_computed_tokens,
        }
