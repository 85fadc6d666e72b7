"""The data parallel wire: what the API server (`DPAsyncLLM`, a ZMQ ROUTER) and its engine
ranks (`sous.engine.dp.rank`, one DEALER each, identity `rank<N>`) say to each other.

Every message is one frame: a pickled tuple whose first item names it.

Rank -> API server:
* `("hello", rank)`: the rank reached the coordinator (before its model loads).
* `("ready", RankInfo)`: the engine is loaded and takes requests.
* `("out", request_id, RequestOutput)`, `("err", request_id, exception)`: a request's outputs;
  an error ends the request.
* `("stats", rank, SchedulerStats)`: every `HEARTBEAT_S` and after changes: load for the
  balancer, counters for /metrics, and the heartbeat (none for `DEAD_AFTER_S`: rank lost).
* `("reply", call_id, ok, value)`: the answer to a call.
* `("dead", rank, reason)`: the rank's engine loop ended on an error.

API server -> rank:
* `("welcome", settings)` or `("refused", reason)`: the answer to hello; `settings` may hold
  `group_port`, where expert parallel ranks form their process group.
* `("add", request_id, prompt_token_ids, SamplingParams, prompt)`, `("abort", request_id)`.
* `("call", call_id, name, args)`: `abort_all`, `reset_prefix_cache`, `close_to_new`.
* `("stop",)`: end the engine loop and exit.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_S = 0.5
"""Seconds between a rank's stats messages when nothing changes."""
DEAD_AFTER_S = 30.0
"""A rank (or the API server, as its ranks see it) silent for this long is lost; a local
rank's exit, or its parent's, is seen at once."""
DEFAULT_RPC_PORT = 29550
"""vLLM's default --data-parallel-rpc-port."""
CONNECT_TIMEOUT_ENV = "SOUS_DP_CONNECT_TIMEOUT_S"
"""Seconds a rank waits for the coordinator's welcome before it gives up (default 60)."""


def dumps(message: tuple[Any, ...]) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(frame: bytes) -> tuple[Any, ...]:
    return pickle.loads(frame)


def free_port(host: str) -> int:
    """A TCP port free on `host` now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def identity(rank: int) -> bytes:
    """The DEALER identity of data parallel rank `rank` (how the ROUTER addresses it)."""
    return f"rank{rank}".encode()


def connect_timeout_s(environ: dict[str, str] | None = None) -> float:
    raw = (os.environ if environ is None else environ).get(CONNECT_TIMEOUT_ENV, "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{CONNECT_TIMEOUT_ENV}={raw!r}: not a positive number of seconds")
    return value


@dataclass(frozen=True)
class RankInfo:
    """What the API server needs of a loaded engine (every rank serves the same model)."""

    rank: int
    pid: int
    served_model_name: str
    max_model_len: int
    max_num_seqs: int
    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    structured_outputs_config: dict[str, Any] | None
    cache_info: dict[str, str] = field(default_factory=dict)
    """Labels of `vllm:cache_config_info` (block size, blocks, dtype, prefix caching)."""
