"""KV cache events on ZMQ, in vLLM's wire format (`--kv-events-config`).

Frames per batch: `[topic utf-8, seq uint64 big-endian, msgpack(EventBatch)]`, where
`EventBatch = [ts, events, dp_rank]` and events are positional arrays:
`["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]`. Hashes are the low 64 bits of the
block digest. The PUB socket binds when the endpoint contains `*`, `::`, `ipc://` or
`inproc://`, otherwise it connects. An optional ROUTER replay socket answers
`[b"", start_seq]` with every buffered batch from `start_seq` on, then `seq = -1`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
"""vLLM's medium name for the device-resident cache (used on CPU too, as vLLM's CPU backend)."""

Event = list[Any]


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; "
                             f"known: {sorted(known)}")
        config = cls(**data)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not "
                             "supported; use 'zmq' or 'null'.")
        return config


def hash_to_int(block_hash: bytes) -> int:
    """The low 64 bits of a block digest (vLLM's integer block hash on the wire)."""
    return int.from_bytes(block_hash[-8:], "big")


def block_stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int],
                 block_size: int, medium: str = MEDIUM_GPU) -> Event:
    return ["BlockStored", [hash_to_int(h) for h in hashes],
            None if parent is None else hash_to_int(parent), token_ids, block_size, None, medium]


def block_removed(hashes: list[bytes], medium: str = MEDIUM_GPU) -> Event:
    return ["BlockRemoved", [hash_to_int(h) for h in hashes], medium]


def all_blocks_cleared() -> Event:
    return ["AllBlocksCleared"]


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """`endpoint` for data parallel rank `dp_rank`, as vLLM offsets it: a tcp port plus the
    rank, an ipc/inproc path with `_dp<rank>` appended; rank 0 keeps it as given."""
    if not dp_rank or not endpoint:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{dp_rank}"
    head, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit():
        return f"{head}:{int(port) + dp_rank}"
    return endpoint


class ZmqEventPublisher:
    """Publishes one batch per engine step that produced events. `publish` is called from the
    engine thread only; the replay socket is served by its own thread."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0) -> None:
        config = replace(config, endpoint=offset_endpoint(config.endpoint, dp_rank),
                         replay_endpoint=offset_endpoint(config.replay_endpoint or "", dp_rank)
                         or config.replay_endpoint)
        self.config = config
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if config.replay_endpoint:
            self._replay_thread = threading.Thread(target=self._serve_replay, daemon=True,
                                                   name="sous-kv-events-replay")
            self._replay_thread.start()
        logger.info("KV events: publishing on %s (topic %r, replay %s)", config.endpoint,
                    config.topic, config.replay_endpoint)

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        seq = self.seq
        self.seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.config.replay_endpoint)
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) < 3:
                    continue
                identity, start = frames[0], int.from_bytes(frames[-1], "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in batches:
                    sock.send_multipart([identity, b"", s.to_bytes(8, "big"), p])
                sock.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close()
