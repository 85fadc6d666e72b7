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

Pipeline stages (`--pipeline-parallel-size N`): every stage registers its own layers' cache
with its own agent (`<engine_id>-pp<rank>` beyond stage 0); the stages exchange their
layouts over their process group and stage 0 serves the side channel for all of them. A
reader of such an engine (its params carry `pp_size`) handshakes with every stage and reads
each stage's layers from that stage; each stage frees its blocks on its own notification.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
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

    def __init__(self, engine_id: str, model: str, host: str, port: int, pp_rank: int = 0,
                 pp_size: int = 1) -> None:
        self.engine_id = engine_id
        self.model = model
        self.host, self.port = host, port
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self._remote_stages: dict[str, list[str]] = {}
        """Remote engine -> the agents of its stages (one for an engine without stages)."""
        self.transport: NixlTransport | None = None
        self.server: SideChannelServer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sous-nixl-handshake")
        self._handshakes: dict[str, Future[list[tuple[KVLayout, bytes]]]] = {}
        self._waiting: list[RecvSpec] = []
        """Reads waiting for their remote engine's handshake."""
        self._reads: dict[str, tuple[list[Any], float, float]] = {}
        """Request -> (NIXL handles not done yet, one per remote stage; start; deadline)."""
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
        name = self.engine_id if self.pp_rank == 0 else f"{self.engine_id}-pp{self.pp_rank}"
        self.transport = NixlTransport(name, kv_caches, block_size)
        stages = [(self.transport.layout, self.transport.metadata())]
        if self.pp_size > 1:
            stages = _exchange_stage_layouts(stages[0])
            self.transport.layout = stages[self.pp_rank][0]
            if self.pp_rank > 0:
                return
        try:
            self.server = SideChannelServer(self.host, self.port, self.model, *stages[0],
                                            more_stages=stages[1:])
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
            if engine not in self._remote_stages:
                future = self._handshakes.get(engine)
                if future is None:
                    self._handshakes[engine] = self._pool.submit(
                        self._fetch_stages, spec.remote.host, spec.remote.port,
                        spec.remote.pp_size)
                    still.append(spec)
                    continue
                if not future.done():
                    still.append(spec)
                    continue
                del self._handshakes[engine]
                try:
                    stages = future.result()
                    self._remote_stages[engine] = [lay.engine_id for lay, _ in stages]
                    for layout, agent_metadata in stages:  # a failure forgets those added
                        transport.add_remote(agent_metadata, layout)
                except Exception as e:
                    self._fail(spec, f"handshake with tcp://{spec.remote.host}:"
                                     f"{spec.remote.port} failed: {e}")
                    continue
            self._start(spec)
        self._waiting = still

    def _fetch_stages(self, host: str, port: int, pp_size: int) -> list[tuple[KVLayout, bytes]]:
        """Every stage's layout and agent metadata (handshake thread); ValueError unless the
        stages' layers make up the whole model, in order."""
        assert self.transport is not None
        local = self.transport.layout
        if pp_size == 1:
            return [fetch_metadata(host, port, self.model, local, None, HANDSHAKE_TIMEOUT_S)]
        stages = [fetch_metadata(host, port, self.model, local, r, HANDSHAKE_TIMEOUT_S)
                  for r in range(pp_size)]
        ranges = [layout.layers for layout, _ in stages]
        if [r.start for r in ranges] != [0, *(r.stop for r in ranges[:-1])] or \
                ranges[-1].stop != local.total_layers:
            raise ValueError(f"the prefill's {pp_size} stages hold layers "
                             f"{[(r.start, r.stop - 1) for r in ranges]}, not all "
                             f"{local.total_layers} in order")
        return stages

    def _start(self, spec: RecvSpec) -> None:
        transport = self.transport
        assert transport is not None
        stages = self._remote_stages[spec.remote.engine_id]
        handles: list[Any] = []
        try:
            if not spec.local_block_ids:
                for stage in stages:
                    transport.notify(stage, spec.notif)
                self._specs.pop(spec.req_id, None)
                return
            start = time.monotonic()
            for stage in stages:
                handles.append(transport.start_read(stage, spec.remote_block_ids,
                                                    spec.local_block_ids, spec.notif))
        except Exception as e:
            for handle in handles:
                transport.abandon(handle)
            self._fail(spec, f"read from engine {spec.remote.engine_id} failed to start: {e}")
            return
        self._reads[spec.req_id] = (handles, start, start + READ_TIMEOUT_S)

    def _fail(self, spec: RecvSpec, why: str, forget: bool = True) -> None:
        logger.warning("KV transfer for request %s: %s; recomputing its prompt locally",
                       spec.req_id, why)
        if forget and self.transport is not None:
            for stage in self._remote_stages.pop(spec.remote.engine_id, []):
                self.transport.forget_remote(stage)
        self._specs.pop(spec.req_id, None)
        if spec.local_block_ids:
            self._errors[spec.req_id] = spec.num_valid_on_failure
            self._done_recving.add(spec.req_id)

    def _poll_reads(self) -> None:
        transport = self.transport
        assert transport is not None
        now = time.monotonic()
        for rid, (handles, start, deadline) in list(self._reads.items()):
            spec = self._specs[rid]
            pending, failure = [], None
            for handle in handles:
                try:
                    if not transport.done(handle):
                        pending.append(handle)
                except Exception as e:  # this stage's read failed (its handle is released)
                    failure = e
            handles[:] = pending
            if failure is not None:
                del self._reads[rid]
                for handle in pending:
                    transport.abandon(handle)
                self._fail(spec, str(failure))
                continue
            if not handles:
                del self._reads[rid]
                self._specs.pop(rid, None)
                self._done_recving.add(rid)
                self._count(len(spec.local_block_ids) * transport.layout.bytes_per_block,
                            now - start)
            elif now > deadline:
                del self._reads[rid]
                for handle in handles:
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


def _exchange_stage_layouts(mine: tuple[KVLayout, bytes]) -> list[tuple[KVLayout, bytes]]:
    """Every pipeline stage's (layout, agent metadata), each layout numbered in the model's
    layers (`first_layer`, `model_layers`): an all-gather over the stages' process group
    (torch.distributed's default group in a stage process)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    total = sum(layout.num_layers for layout, _ in gathered)
    out, first = [], 0
    for layout, metadata in gathered:
        out.append((replace(layout, first_layer=first, model_layers=total), metadata))
        first += layout.num_layers
    return out
