"""`kv_transfer_params` of vLLM's NixlConnector, and the plan its scheduler side hands its
worker side each step.

Prefill leg (the request carries `do_remote_decode: true`): the answer carries
`do_remote_prefill: true, do_remote_decode: false, remote_block_ids, remote_engine_id,
remote_request_id, remote_host, remote_port, tp_size, pp_size, remote_num_tokens`. Decode
leg: a request carrying those reads the prompt's KV from `remote_block_ids` instead of
computing it (from every one of `pp_size` prefill stages, each holding some layers).
`remote_block_ids` is a list per KV cache group (vLLM's current form, `[[ids]]`); a flat
list (its earlier form) is read too. sous' prefill answers also carry
`remote_blocks_expiry_time` (wall clock): a decode leg that would read after it recomputes
instead of reading blocks the prefill may have reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sous.kv_transfer.base import KVConnectorMetadata

REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                 "remote_port")
"""What a decode leg needs; without any of them it computes the prompt itself (vLLM: "Got
invalid KVTransferParams")."""


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode leg's prompt KV lives (validated `kv_transfer_params`)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    expiry_time: float | None = None
    """`remote_blocks_expiry_time` (wall clock, `time.time()`): when the prefill frees its
    blocks unread."""
    pp_size: int = 1
    """`pp_size`: the prefill's pipeline stages, each holding some layers' KV."""

def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The remote prefill a request's params name, or None (not a decode leg, or invalid)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    if any(params.get(f) is None for f in REMOTE_FIELDS):
        return None
    ids = params["remote_block_ids"]
    if isinstance(ids, list | tuple) and ids and isinstance(ids[0], list | tuple):
        ids = ids[0]  # one KV cache group
    try:
        expiry = params.get("remote_blocks_expiry_time")
        pp_size = int(params.get("pp_size") or 1)
        if pp_size < 1:
            return None
        return RemotePrefill(str(params["remote_engine_id"]), str(params["remote_request_id"]),
                             str(params["remote_host"]), int(params["remote_port"]),
                             tuple(int(i) for i in ids),
                             None if expiry is None else float(expiry), pp_size)
    except (TypeError, ValueError):
        return None


@dataclass
class RecvSpec:
    """Read `remote_block_ids` of a remote engine into `local_block_ids` (pairwise; both
    empty: only tell the remote it may free its blocks)."""

    req_id: str
    remote: RemotePrefill
    local_block_ids: list[int]
    remote_block_ids: list[int]
    num_valid_on_failure: int
    """Leading tokens whose KV is valid without the read (the local prefix-cache hit)."""
    fail_reason: str = ""
    """Why the read must not happen (its lease ended, the block lists do not match): the
    worker fails it at once and the request recomputes; empty: read."""

    @property
    def notif(self) -> bytes:
        """vLLM's completion notification: `"{remote_request_id}:{tp_size}"`."""
        return f"{self.remote.request_id}:1".encode()


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    recvs: list[RecvSpec] = field(default_factory=list)
    """Reads to start (decode side)."""
    sends: dict[str, float] = field(default_factory=dict)
    """Finished prefill requests whose blocks wait for a reader -> lease deadline
    (`time.monotonic()`)."""

    def has_loads(self) -> bool:
        return bool(self.recvs)
