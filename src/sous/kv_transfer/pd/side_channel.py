"""The NIXL side channel, as vLLM's NixlConnector runs it: the engine whose blocks are read
(prefill) serves a ZMQ ROUTER on `tcp://VLLM_NIXL_SIDE_CHANNEL_HOST:PORT` (+ data-parallel
rank); a reader sends msgpack `[b"get_meta_msg", tp_rank]` (or vLLM's newer
`[b"get_meta_msg", pp_rank, tp_rank]`) and gets msgpack
`{"compatibility_hash": str, "agent_metadata_bytes": bytes}`, the latter msgpack of the agent
metadata (`engine_id`, `agent_metadata`, `kv_caches_base_addr`, `device_id`, `num_blocks`,
`block_lens`, `kv_cache_layout`, `block_size`, and sous' `num_layers`, `kv_size`, `dtype`,
`first_layer`, `model_layers`). An engine of pipeline stages (its answers carry `pp_size`)
has one agent per stage; its first stage serves the side channel and answers `pp_rank` with
that stage's agent (the older request form means stage 0).

The compatibility hash covers what must match for blocks to be read as they are (model,
layers, planes, block size and bytes, dtype): a reader refuses a peer whose hash differs.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from sous.kv_transfer.pd.nixl_transport import KVLayout

GET_META_MSG = b"get_meta_msg"
DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5600


def side_channel_address(dp_rank: int = 0, env: dict[str, str] | None = None) -> tuple[str, int]:
    """(host, port) from VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, the port offset by `dp_rank`;
    ValueError naming the variable for a bad port."""
    env = os.environ if env is None else env
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or DEFAULT_HOST
    raw = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", str(DEFAULT_PORT))
    try:
        port = int(raw) + dp_rank
    except ValueError:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT={raw!r}: not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT={raw!r}: port {port} out of range")
    return host, port


def compatibility_hash(model: str, layout: KVLayout) -> str:
    fields = [model, layout.total_layers, layout.kv_size, layout.block_size,
              layout.block_bytes, layout.dtype]
    return hashlib.sha256(msgpack.packb(fields)).hexdigest()


def encode_metadata(layout: KVLayout, agent_metadata: bytes) -> bytes:
    kv_layout = "NHD" if layout.kv_size == 2 else "MLA"
    return msgpack.packb({
        "engine_id": layout.engine_id, "agent_metadata": agent_metadata,
        "kv_caches_base_addr": list(layout.base_addrs), "device_id": 0,
        "num_blocks": layout.num_blocks, "block_lens": [layout.block_bytes] * layout.num_layers,
        "kv_cache_layout": kv_layout, "block_size": layout.block_size,
        "num_layers": layout.num_layers, "kv_size": layout.kv_size, "dtype": layout.dtype,
        "first_layer": layout.first_layer, "model_layers": layout.total_layers})


def decode_metadata(data: bytes) -> tuple[KVLayout, bytes]:
    """(layout, NIXL agent metadata) of a peer."""
    m = msgpack.unpackb(data)
    layout = KVLayout(m["engine_id"], m["num_layers"], m["kv_size"], m["num_blocks"],
                      m["block_size"], m["block_lens"][0], m["dtype"],
                      tuple(m["kv_caches_base_addr"]), m.get("first_layer", 0),
                      m.get("model_layers", 0))
    return layout, m["agent_metadata"]


class SideChannelServer:
    """Answers metadata requests on a daemon thread until `close()`: for `layout` /
    `agent_metadata` (stage 0), and for pipeline stages 1, 2, ... `more_stages`."""

    def __init__(self, host: str, port: int, model: str, layout: KVLayout,
                 agent_metadata: bytes,
                 more_stages: Sequence[tuple[KVLayout, bytes]] = ()) -> None:
        self._replies = [
            msgpack.packb({"compatibility_hash": compatibility_hash(model, stage_layout),
                           "agent_metadata_bytes": encode_metadata(stage_layout, metadata)})
            for stage_layout, metadata in [(layout, agent_metadata), *more_stages]]
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if host in ("0.0.0.0", "::") else host
        self._sock.bind(f"tcp://{bind_host}:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sous-nixl-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            identity, *frames = self._sock.recv_multipart()
            self._sock.send_multipart([identity, b"", self._answer(frames[-1])])

    def _answer(self, frame: bytes) -> bytes:
        """[msg, tp_rank] (stage 0), or vLLM's newer [msg, pp_rank, tp_rank]."""
        try:
            request = msgpack.unpackb(frame)
            ok = request[0] == GET_META_MSG
            pp_rank = int(request[1]) if len(request) > 2 else 0
        except Exception:
            ok, pp_rank = False, 0
        if not ok:
            return msgpack.packb({"error": "unknown request"})
        if not 0 <= pp_rank < len(self._replies):
            return msgpack.packb({"error": f"no pipeline stage {pp_rank} here "
                                           f"({len(self._replies)} stages)"})
        return self._replies[pp_rank]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def fetch_metadata(host: str, port: int, model: str, local: KVLayout,
                   pp_rank: int | None = None, timeout_s: float = 5.0) -> tuple[KVLayout, bytes]:
    """Ask a peer's side channel for its layout and agent metadata (of pipeline stage
    `pp_rank`; None: the older request, which any vLLM answers). TimeoutError if it does not
    answer; ValueError if its compatibility hash or layout differs from ours."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    request = [GET_META_MSG, 0] if pp_rank is None else [GET_META_MSG, pp_rank, 0]
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgpack.packb(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"NIXL side channel tcp://{host}:{port} did not answer in "
                               f"{timeout_s:g} s")
        reply: dict[str, Any] = msgpack.unpackb(sock.recv())
    finally:
        sock.close()
    if "error" in reply:
        raise ValueError(f"NIXL side channel tcp://{host}:{port}: {reply['error']}")
    layout, agent_metadata = decode_metadata(reply["agent_metadata_bytes"])
    local.check_compatible(layout)
    if reply["compatibility_hash"] != compatibility_hash(model, local):
        raise ValueError(f"NIXL side channel tcp://{host}:{port}: engine {layout.engine_id} "
                         "serves another model or KV cache configuration")
    return layout, agent_metadata
