"""Offload lookups across pipeline stages (`--pipeline-parallel-size N` with LMCache).

Each stage process keeps its own layers' KV, so each builds its own LMCache engine (worker
`rank` of `N` in LMCache's metadata: its keys are its own, as LMCache keys a rank's chunks)
and stores and retrieves its layers' chunks there. The scheduler, in the engine's process,
reaches those engines through a `StageLookupServer` thread in every stage (a ZMQ REP socket
on an `ipc://` path named after the engine's pid and the stage rank), as LMCache's own lookup
server does for vLLM's scheduler: a prompt's hit is the shortest of the stages' hits (a
chunk counts only where every stage holds its layers of it), and KV events are stage 0's
(every stage stores the same chunks).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
from typing import Any

import zmq

logger = logging.getLogger(__name__)

_TIMEOUT_MS = 30_000
"""A stage that has not answered a lookup by then counts as a miss (it is likely gone; the
executor reports a dead stage on its own)."""


def event_tuple(event: Any) -> tuple:
    """An LMCache KV event as (block_hashes, parent_block_hash, token_ids, block_size,
    lora_id)."""
    return (list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
            event.block_size, event.lora_id)


def lookup_address(engine_pid: int, rank: int) -> str:
    return f"ipc://{tempfile.gettempdir()}/sous-lmcache-lookup-{engine_pid}-{rank}"


class StageLookupServer:
    """Answers the scheduler's lookups against `engine` (this stage's LMCache engine) on a
    daemon thread until `close()`. Requests: ("lookup", token_ids, lookup_id) -> hit tokens;
    ("events",) -> the engine's new KV events as plain tuples."""

    def __init__(self, engine: Any, rank: int, engine_pid: int | None = None) -> None:
        self.engine = engine
        self.address = lookup_address(os.getppid() if engine_pid is None else engine_pid, rank)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-stage-lookup",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            request = pickle.loads(self._sock.recv())
            try:
                reply: Any = self._answer(request)
            except Exception as e:  # a failed lookup is a miss
                logger.debug("LMCache stage lookup failed: %s", e)
                reply = 0 if request[0] == "lookup" else []
            self._sock.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))

    def _answer(self, request: tuple) -> Any:
        if request[0] == "lookup":
            _, tokens, lookup_id = request
            return int(self.engine.lookup(tokens=tokens, lookup_id=lookup_id, pin=False))
        return [event_tuple(e) for e in self.engine.get_kv_events()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


class StageLookupClient:
    """The scheduler's side: one REQ socket per stage of the engine in this process."""

    def __init__(self, num_stages: int, engine_pid: int | None = None) -> None:
        pid = os.getpid() if engine_pid is None else engine_pid
        self._addresses = [lookup_address(pid, r) for r in range(num_stages)]
        self._ctx = zmq.Context()
        self._socks = [self._connect(a) for a in self._addresses]

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def _send(self, rank: int, request: tuple) -> None:
        self._socks[rank].send(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))

    def _reply(self, rank: int, default: Any) -> Any:
        """Stage `rank`'s answer, or `default` if it gives none in time."""
        sock = self._socks[rank]
        if sock.poll(_TIMEOUT_MS):
            return pickle.loads(sock.recv())
        logger.warning("KV offload: pipeline stage %d did not answer a lookup in %d s; "
                       "counting a miss", rank, _TIMEOUT_MS // 1000)
        sock.close()  # a REQ socket that got no reply cannot send again
        self._socks[rank] = self._connect(self._addresses[rank])
        return default

    def lookup(self, token_ids: list[int], lookup_id: str) -> int:
        """Tokens whose KV every stage holds (from the start of `token_ids`)."""
        for rank in range(len(self._socks)):  # every stage looks up at once
            self._send(rank, ("lookup", token_ids, lookup_id))
        return min(int(self._reply(rank, 0)) for rank in range(len(self._socks)))

    def events(self) -> list[tuple]:
        """Stage 0's new KV events (`event_tuple`)."""
        self._send(0, ("events",))
        return self._reply(0, [])

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()
