"""The P/D connector's worker side: this engine's NIXL agent over its KV cache, its side
channel, and the reads and leases in flight.

Reads (decode side) never block a step: a read whose remote engine is not known yet waits
for a handshake on a background thread (the side channel's ZMQ request, `fetch_metadata`);
the agent itself is only touched from the engine thread. `get_finished` advances them: a
read done is reported received; one that cannot start or fails (the prefill server is gone,
its layout differs) is reported received too and its request is in `get_load_errors()` with
the tokens it holds without the read, so the engine recomputes the rest. A remote engine
whose read failed is forgotten (a restarted server is handshaken again).

Leases (prefill side): the blocks of a finished prefill are released when its reader's
notification arrives (it may arrive before the lease: kept until then) or when the lease
ends (logged).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import zmq

from sous.config.errors import ConfigError
from sous.kv_transfer.base import add_counts
from sous.kv_transfer.pd.nixl_transport import KVLayout, NixlTransport
from sous.kv_transfer.pd.params import NixlConnectorMetadata, RecvSpec
from sous.kv_transfer.pd.side_channel import SideChannelServer, fetch_metadata

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
"""A read not done by then is given up (its request recomputes)."""
EARLY_NOTIF_TTL_S = 60.0


class PDWorker:
    """See the module docstring. `model` goes into the side channel's compatibility hash."""

    def __init__(self, engine_id: str, model: str, host: str, port: int) -> None:
        self.engine_id = engine_id
        self.model = model
        self.host, self.port = host, port
        self.transport: NixlTransport | None = None
        self.server: SideChannelServer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sous-nixl-handshake")
        self._handshakes: dict[str, Future[tuple[KVLayout, bytes]]] = {}
        self._waiting: list[RecvSpec] = []
        """Reads waiting for their remote engine's handshake."""
        self._reads: dict[str, tuple[Any, float, float]] = {}
        """Request -> (NIXL handle, start time, deadline)."""
        self._stats: dict[str, float] = {}
        self._specs: dict[str, RecvSpec] = {}
        self._done_recving: set[str] = set()
        self._errors: dict[str, int] = {}
        self._leases: dict[str, float] = {}
        self._released: set[str] = set()
        self._early_notifs: dict[str, float] = {}
        """Reader notifications for requests whose lease has not reached us yet -> when they
        came (forgotten after EARLY_NOTIF_TTL_S: a read of blocks whose lease had ended)."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.transport = NixlTransport(self.engine_id, kv_caches, block_size)
        try:
            self.server = SideChannelServer(self.host, self.port, self.model,
                                            self.transport.layout, self.transport.metadata())
        except zmq.ZMQError as e:
            self.transport.close()
            raise ConfigError(
                f"NIXL side channel: cannot listen on tcp://{self.host}:{self.port} ({e}); "
                "give each server its own VLLM_NIXL_SIDE_CHANNEL_PORT") from None
        logger.info("NIXL P/D: engine %s serves its KV side channel on tcp://%s:%d",
                    self.engine_id, self.host, self.port)

    def start_load_kv(self, meta: NixlConnectorMetadata) -> None:
        for rid, deadline in meta.sends.items():
            if self._early_notifs.pop(rid, None) is not None:
                self._released.add(rid)
            else:
                self._leases[rid] = deadline
        for spec in meta.recvs:
            self._specs[spec.req_id] = spec
            self._waiting.append(spec)
        self._advance()

    # ---- reads -------------------------------------------------------------------------
    def _advance(self) -> None:
        """Start the reads whose remote engine is known; handshake with the others."""
        transport = self.transport
        assert transport is not None
        still: list[RecvSpec] = []
        for spec in self._waiting:
            if spec.fail_reason:
                self._fail(spec, spec.fail_reason, forget=False)
                continue
            engine = spec.remote.engine_id
            if not transport.has_remote(engine):
                future = self._handshakes.get(engine)
                if future is None:
                    self._handshakes[engine] = self._pool.submit(
                        fetch_metadata, spec.remote.host, spec.remote.port, self.model,
                        transport.layout, 0, HANDSHAKE_TIMEOUT_S)
                    still.append(spec)
                    continue
                if not future.done():
                    still.append(spec)
                    continue
                del self._handshakes[engine]
                try:
                    layout, agent_metadata = future.result()
                    transport.add_remote(agent_metadata, layout)
                except Exception as e:
                    self._fail(spec, f"handshake with tcp://{spec.remote.host}:"
                                     f"{spec.remote.port} failed: {e}")
                    continue
            self._start(spec)
        self._waiting = still

    def _start(self, spec: RecvSpec) -> None:
        transport = self.transport
        assert transport is not None
        try:
            if not spec.local_block_ids:
                transport.notify(spec.remote.engine_id, spec.notif)
                self._specs.pop(spec.req_id, None)
                return
            start = time.monotonic()
            handle = transport.start_read(spec.remote.engine_id, spec.remote_block_ids,
                                          spec.local_block_ids, spec.notif)
        except Exception as e:
            self._fail(spec, f"read from engine {spec.remote.engine_id} failed to start: {e}")
            return
        self._reads[spec.req_id] = (handle, start, start + READ_TIMEOUT_S)

    def _fail(self, spec: RecvSpec, why: str, forget: bool = True) -> None:
        logger.warning("KV transfer for request %s: %s; recomputing its prompt locally",
                       spec.req_id, why)
        if forget and self.transport is not None:
            self.transport.forget_remote(spec.remote.engine_id)
        self._specs.pop(spec.req_id, None)
        if spec.local_block_ids:
            self._errors[spec.req_id] = spec.num_valid_on_failure
            self._done_recving.add(spec.req_id)

    def _poll_reads(self) -> None:
        transport = self.transport
        assert transport is not None
        now = time.monotonic()
        for rid, (handle, start, deadline) in list(self._reads.items()):
            spec = self._specs[rid]
            try:
                done = transport.done(handle)
            except Exception as e:
                del self._reads[rid]
                self._fail(spec, str(e))
                continue
            if done:
                del self._reads[rid]
                self._specs.pop(rid, None)
                self._done_recving.add(rid)
                self._count(len(spec.local_block_ids) * transport.layout.bytes_per_block,
                            now - start)
            elif now > deadline:
                del self._reads[rid]
                transport.abandon(handle)
                self._fail(spec, f"read not done in {READ_TIMEOUT_S:g} s")

    # ---- leases ------------------------------------------------------------------------
    def _poll_leases(self) -> set[str]:
        transport = self.transport
        assert transport is not None
        released, self._released = self._released, set()
        for msg in transport.take_notifs():
            rid = msg.decode(errors="replace").rpartition(":")[0]
            if self._leases.pop(rid, None) is not None:
                released.add(rid)
            else:
                self._early_notifs[rid] = time.monotonic()
        now = time.monotonic()
        for rid, seen in list(self._early_notifs.items()):
            if now - seen > EARLY_NOTIF_TTL_S:
                del self._early_notifs[rid]
        for rid, deadline in list(self._leases.items()):
            if now > deadline:
                del self._leases[rid]
                logger.warning("KV blocks of request %s were not read before their lease "
                               "ended; freeing them", rid)
                released.add(rid)
        return released

    def get_finished(self) -> tuple[set[str], set[str]]:
        self._advance()
        self._poll_reads()
        recving, self._done_recving = self._done_recving, set()
        return self._poll_leases(), recving

    def _count(self, num_bytes: int, seconds: float) -> None:
        add_counts(self._stats, {"kv_transfer_bytes": num_bytes,
                                 "kv_transfer_seconds": seconds, "kv_transfers": 1})

    def get_kv_connector_stats(self) -> dict[str, float]:
        """`kv_transfer_bytes`, `kv_transfer_seconds` (start to seen done) and `kv_transfers`
        of the reads finished since the last call."""
        stats, self._stats = self._stats, {}
        return stats

    def get_load_errors(self) -> dict[str, int]:
        errors, self._errors = self._errors, {}
        return errors

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        if self.transport is not None:
            self.transport.close()
