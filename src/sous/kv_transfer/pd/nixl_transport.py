"""Whole KV blocks read from another engine's cache over NIXL, the transport of vLLM's
NixlConnector, here on host memory (UCX backend).

Each engine registers its whole KV cache once (one region per layer tensor) and describes it
as a `KVLayout`. A reader adds a remote engine from its agent metadata and layout (the
handshake: block size, dtype, layers and block bytes must match, or a ValueError names the
field), then reads blocks by descriptor index: one descriptor per (layer, plane, block), so
a request's blocks move without a copy through Python. The read carries a notification
message that the owner sees in `take_notifs()` (vLLM: the decode side tells the prefill
side it may free the blocks).

Cache tensors: `[2, num_blocks, block_size, ...]` (K and V planes) or, for MLA,
`[num_blocks, block_size, entry]` (one plane); contiguous, on the host. Not thread-safe:
one thread drives a transport.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sous.kv_transfer.base import cache_planes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """An engine's registered KV cache, as the other side needs it (picklable)."""

    engine_id: str
    num_layers: int
    kv_size: int
    """Planes per layer: 2 (K, V) or 1 (MLA)."""
    num_blocks: int
    block_size: int
    block_bytes: int
    """Bytes of one block of one plane of one layer."""
    dtype: str
    base_addrs: tuple[int, ...]
    """Per layer: the address of its cache tensor."""
    first_layer: int = 0
    """The model's decoder layer this cache's layer 0 holds (a pipeline stage's first)."""
    model_layers: int = 0
    """The model's decoder layers (0: `num_layers`, the whole model is here)."""

    @property
    def layers(self) -> range:
        """The model's decoder layers this cache holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def total_layers(self) -> int:
        return self.model_layers or self.num_layers

    @classmethod
    def of(cls, engine_id: str, kv_caches: list[torch.Tensor], block_size: int,
           first_layer: int = 0, model_layers: int = 0) -> KVLayout:
        first = kv_caches[0]
        kv_size, num_slots = cache_planes(first)
        num_blocks = num_slots // block_size
        for cache in kv_caches:
            if not cache.is_contiguous() or cache.shape != first.shape:
                raise ValueError("KV cache tensors must be contiguous and of one shape")
        block_bytes = first.numel() * first.element_size() // (kv_size * num_blocks)
        return cls(engine_id, len(kv_caches), kv_size, num_blocks, block_size, block_bytes,
                   str(first.dtype).removeprefix("torch."),
                   tuple(c.data_ptr() for c in kv_caches), first_layer, model_layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds over all layers and planes."""
        return self.num_layers * self.kv_size * self.block_bytes

    def descriptors(self) -> np.ndarray:
        """`[layers * planes * blocks, 3]` rows of (address, bytes, device 0), row
        `(layer * kv_size + plane) * num_blocks + block`."""
        plane = np.arange(self.kv_size, dtype=np.int64) * self.num_blocks * self.block_bytes
        block = np.arange(self.num_blocks, dtype=np.int64) * self.block_bytes
        base = np.asarray(self.base_addrs, dtype=np.int64)
        addrs = (base[:, None, None] + plane[None, :, None] + block[None, None, :]).reshape(-1)
        out = np.empty((addrs.size, 3), dtype=np.int64)
        out[:, 0], out[:, 1], out[:, 2] = addrs, self.block_bytes, 0
        return out

    def indices(self, block_ids: list[int], layers: range | None = None) -> np.ndarray:
        """Descriptor rows of `block_ids` in every plane of `layers` (model layer numbers;
        default: all held here), layer-major."""
        layers = self.layers if layers is None else layers
        first = layers.start - self.first_layer
        rows = np.arange(first * self.kv_size, (first + len(layers)) * self.kv_size,
                         dtype=np.int64)[:, None]
        return (rows * self.num_blocks + np.asarray(block_ids, dtype=np.int64)).reshape(-1)

    def check_compatible(self, remote: KVLayout) -> None:
        """ValueError naming the field unless `remote` (a whole model's cache or a pipeline
        stage's) can be read into this whole cache."""
        for name in ("total_layers", "kv_size", "block_size", "block_bytes", "dtype"):
            mine, theirs = getattr(self, name), getattr(remote, name)
            if mine != theirs:
                raise ValueError(f"KV layout mismatch with engine {remote.engine_id}: {name} "
                                 f"{theirs!r} there, {mine!r} here")


PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def ucx_transports(env: dict[str, str], ptrace_scope_path: str = PTRACE_SCOPE) -> str | None:
    """The `UCX_TLS` to run NIXL's UCX backend with, or None to leave UCX's choice. UCX
    needs `tcp` among its transports here (shared-memory-only settings fail at agent
    creation), so a user list without it gets it added; and with no list, only `tcp` when
    cross-memory attach between sibling processes is not permitted (Yama ptrace_scope > 0:
    UCX's CMA reads would fail with EPERM)."""
    tls = env.get("UCX_TLS")
    if tls:
        names = [t.strip() for t in tls.split(",")]
        if tls.startswith("^") or "all" in names or "tcp" in names:
            return tls
        return ",".join([*names, "tcp"])
    try:
        with open(ptrace_scope_path) as f:
            scope = f.read().strip()
    except OSError:
        return None  # no Yama: CMA works between processes of one user
    return None if scope == "0" else "tcp"


def _set_ucx_transports() -> None:
    tls = ucx_transports(dict(os.environ))
    if tls is not None and tls != os.environ.get("UCX_TLS"):
        logger.info("NIXL: UCX_TLS=%s (was %s)", tls, os.environ.get("UCX_TLS", "unset"))
        os.environ["UCX_TLS"] = tls


class NixlTransport:
    """This engine's NIXL agent over its registered KV cache (see the module docstring)."""

    def __init__(self, engine_id: str, kv_caches: list[torch.Tensor], block_size: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        _set_ucx_transports()
        self.layout = KVLayout.of(engine_id, kv_caches, block_size)
        # No progress thread: NIXL's spins (no delay) and would take a core from the model;
        # transfers progress when the engine polls (`done`, `take_notifs`).
        self.agent = nixl_agent(engine_id, nixl_agent_config(enable_prog_thread=False,
                                                             backends=["UCX"]))
        self._reg = self.agent.get_reg_descs(kv_caches, "DRAM")
        self.agent.register_memory(self._reg)
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.agent.get_xfer_descs(self.layout.descriptors(), "DRAM"),
            "DRAM")
        self._remotes: dict[str, tuple[str, Any, KVLayout]] = {}

    def metadata(self) -> bytes:
        """This agent's metadata, for the other side's `add_remote`."""
        return self.agent.get_agent_metadata()

    def add_remote(self, metadata: bytes, layout: KVLayout) -> None:
        """Handshake with another engine (ValueError if its layout cannot be read into ours)."""
        self.layout.check_compatible(layout)
        if layout.engine_id in self._remotes:
            return
        name = self.agent.add_remote_agent(metadata)
        dlist = self.agent.prep_xfer_dlist(
            name, self.agent.get_xfer_descs(layout.descriptors(), "DRAM"), "DRAM")
        self._remotes[layout.engine_id] = (name, dlist, layout)

    def has_remote(self, engine_id: str) -> bool:
        return engine_id in self._remotes

    def forget_remote(self, engine_id: str) -> None:
        """Drop a remote engine (it died or restarted): the next read handshakes again."""
        entry = self._remotes.pop(engine_id, None)
        if entry is None:
            return
        name, dlist, _ = entry
        with contextlib.suppress(Exception):  # a dead peer's state may already be gone
            self.agent.release_dlist_handle(dlist)
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(name)

    def notify(self, remote_engine_id: str, notif: bytes) -> None:
        """Send a notification without reading (vLLM: free your blocks, I had them)."""
        name, _, _ = self._remotes[remote_engine_id]
        self.agent.send_notif(name, notif)

    def start_read(self, remote_engine_id: str, remote_block_ids: list[int],
                   local_block_ids: list[int], notif: bytes = b"") -> Any:
        """Start reading the remote blocks into ours (pairwise), in every layer the remote
        engine holds (a pipeline stage: its layers); returns a handle for `done`."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks for "
                             f"{len(local_block_ids)} local ones")
        _, dlist, layout = self._remotes[remote_engine_id]
        mine = self.layout.layers
        if layout.layers.start < mine.start or layout.layers.stop > mine.stop:
            raise ValueError(f"engine {remote_engine_id} holds layers {layout.layers.start}-"
                             f"{layout.layers.stop - 1}; this cache only "
                             f"{mine.start}-{mine.stop - 1}")
        handle = self.agent.make_prepped_xfer(
            "READ", self._local, self.layout.indices(local_block_ids, layout.layers), dlist,
            layout.indices(remote_block_ids), notif_msg=notif)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL read from {remote_engine_id} failed to start")
        return handle

    def done(self, handle: Any) -> bool:
        """True once the read finished (the handle is released then); RuntimeError if it
        failed."""
        state = self.agent.check_xfer_state(handle)
        if state == "PROC":
            return False
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL read failed: {state}")
        return True

    def abandon(self, handle: Any) -> None:
        """Give up a read still in progress (its peer stopped answering)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            logger.warning("NIXL: a stalled read could not be released")

    def take_notifs(self) -> list[bytes]:
        """Notification messages of reads other engines finished on our blocks."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        for name, dlist, _ in self._remotes.values():
            self.agent.release_dlist_handle(dlist)
            self.agent.remove_remote_agent(name)
        self._remotes.clear()
        self.agent.release_dlist_handle(self._local)
        self.agent.deregister_memory(self._reg)

