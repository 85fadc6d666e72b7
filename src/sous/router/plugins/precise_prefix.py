"""`precise-prefix-cache-producer`: which endpoints really hold a request's prompt prefix,
learned from their KV-cache events (llm-d's precise prefix cache).

Events: a ZMQ SUB socket bound on `kvEventsConfig.zmqEndpoint` (default `tcp://*:<socketPort>`;
engines connect to it, llm-d's centralized mode), subscribed to `topicFilter`, read by a
thread that `start()` launches and `close()` stops. Frames `[topic, seq (8 bytes BE),
msgpack(EventBatch)]` in vLLM's format (positional arrays, or maps tagged `type`); the topic
`kv@<host:port>@<model>` names the pod, matched to `Endpoint.host_port` (loopback names are
one host). A malformed message or event is logged and skipped; a sequence number that goes
back (an engine restart) drops the pod's entries.

Keys (llm-d's dual-key design): the router computes its own request keys from token ids:
full blocks of `tokenProcessorConfig.blockSize` tokens, `k_i = xxh64(uint32 ids, seed=k_{i-1})`
chained from `k_{-1} = xxh64(hashSeed + model [+ NUL + cache_salt])` (the LoRA name replaces the
topic's model when an event carries one). The index maps request key -> {pod: tiers} and, per
pod, engine key -> (request keys, tiers): an engine block of a multiple of the router's block
size covers several request keys; other engine block sizes are logged once and skipped. A
`BlockStored` chains from its parent engine key (unknown parent: skipped); one without token
ids (an offload tier) adds its tier to engine keys already known. Blocks with `extra_keys`
(multimodal content, cache salt) cannot be keyed from token ids and end the event's chain.
`BlockRemoved` drops a tier; `AllBlocksCleared` drops the pod. Only KV-cache group 0 is kept.
The index itself is `sous.router.prefix_index.PrefixIndex`.

`produce` walks the request's keys from block 0 and, per endpoint, sums over the consecutive
blocks it holds the highest weight among the block's tiers (`indexerConfig.
kvCacheBackendConfigs`, default gpu 1.0, cpu 0.8, shared_storage 0.4, storage 0.3, object_store
0.2, and for sous's LMCache media disk 0.3, remote 0.2; an unlisted tier weighs 1.0 as in
llm-d), writing `PrefixMatchInfo(weighted blocks, total blocks, blockSize)`. With
`speculativeIndexing`, `pre_request` adds the picked endpoints' keys as tier `speculative` for
`speculativeTTL`, so a burst of same-prefix requests sticks before the engine's events arrive.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq

from sous.router.framework import (
    CycleState,
    Endpoint,
    PrefixMatchInfo,
    RouterRequest,
    SchedulingResult,
)
from sous.router.plugins.registry import register
from sous.router.prefix_index import PrefixIndex, chain_keys, engine_key, seed_key

logger = logging.getLogger("sous.router")

TYPE = "precise-prefix-cache-producer"
DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "shared_storage": 0.4, "storage": 0.3,
                        "object_store": 0.2, "disk": 0.3, "remote": 0.2}
_SPECS: dict[str, dict[str, tuple[Any, Any]]] = {
    "tokenProcessorConfig": {"blockSize": (int, None), "blockSizeTokens": (int, None),
                             "hashSeed": (str, "")},
    "kvEventsConfig": {"zmqEndpoint": (str, ""), "topicFilter": (str, "kv@"),
                       "socketPort": (int, 5557), "concurrency": (int, 4),
                       "engineType": (str, "vllm"), "discoverPods": (bool, False)},
    "indexerConfig": {"kvCacheBackendConfigs": (list, None)},
    "kvCacheBackendConfigs[]": {"name": (str, None), "weight": ((int, float), 1.0)}}
_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
           "BlockRemoved": ("block_hashes", "medium", "group_idx"), "AllBlocksCleared": ()}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float) -> float:
    """Seconds in a Go duration (`"2s"`, `"500ms"`, `"1m30s"`) or a number of seconds."""
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    if not text or _DURATION.sub("", text):
        raise ValueError(f"speculativeTTL {value!r} is not a duration such as '2s' or '500ms'")
    return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text))


def _section(name: str, raw: Any, spec: str) -> dict[str, Any]:
    """`raw` (None: {}) checked against `_SPECS[spec]`, with the defaults filled in."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"{name} must be a mapping, got {raw!r}")
    known = _SPECS[spec]
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown} (known: {', '.join(known)})")
    out = {}
    for key, (kind, default) in known.items():
        value = out[key] = raw.get(key, default)
        if value is not None and (not isinstance(value, kind)
                                  or (isinstance(value, bool) and kind is not bool)):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise ValueError(f"{name}.{key} must be {' or '.join(k.__name__ for k in kinds)}, "
                             f"got {value!r}")
    return out


@dataclass(frozen=True)
class Settings:
    """The validated parameters."""

    block_size: int
    hash_seed: str
    zmq_endpoint: str
    topic_filter: str
    tier_weights: Mapping[str, float]
    speculative: bool
    speculative_ttl_s: float


@dataclass(frozen=True)
class Parameters:
    token_processor_config: dict[str, Any] | None = None
    """{blockSize (or blockSizeTokens): 16, hashSeed: ""}."""
    kv_events_config: dict[str, Any] | None = None
    """{zmqEndpoint: "" = tcp://*:<socketPort>, socketPort: 5557, topicFilter: "kv@",
    engineType: "vllm", concurrency: 4 (one thread here), discoverPods: false}."""
    indexer_config: dict[str, Any] | None = None
    """{kvCacheBackendConfigs: [{name, weight}, ...]} (replaces the default tier weights)."""
    speculative_indexing: bool = False
    speculative_ttl: str | float = "2s"
    """`speculativeTTL`: a Go duration, or seconds."""

    def __post_init__(self) -> None:
        self.settings()

    def settings(self) -> Settings:
        """The parameters checked (ValueError naming the bad key) and resolved."""
        tp = _section("tokenProcessorConfig", self.token_processor_config, "tokenProcessorConfig")
        sizes = {v for v in (tp["blockSize"], tp["blockSizeTokens"]) if v is not None} or {16}
        if len(sizes) > 1 or min(sizes) <= 0:
            raise ValueError("tokenProcessorConfig.blockSize must be > 0 (and equal to "
                             "blockSizeTokens when both are set)")
        ev = _section("kvEventsConfig", self.kv_events_config, "kvEventsConfig")
        if ev["engineType"] != "vllm":
            raise ValueError("kvEventsConfig.engineType: only 'vllm' events are supported")
        if ev["concurrency"] <= 0:
            raise ValueError("kvEventsConfig.concurrency must be > 0")
        if ev["discoverPods"]:
            raise ValueError("kvEventsConfig.discoverPods: pod discovery is not supported; "
                             "engines connect to zmqEndpoint (centralized mode)")
        backends = _section("indexerConfig", self.indexer_config,
                            "indexerConfig")["kvCacheBackendConfigs"]
        weights = dict(DEFAULT_TIER_WEIGHTS) if backends is None else {}
        for i, raw in enumerate(backends or []):
            where = f"indexerConfig.kvCacheBackendConfigs[{i}]"
            b = _section(where, raw, "kvCacheBackendConfigs[]")
            if not b["name"]:
                raise ValueError(f"{where}.name is required")
            weights[b["name"].lower()] = float(b["weight"])
        ttl = parse_duration(self.speculative_ttl)
        if ttl <= 0:
            raise ValueError("speculativeTTL must be > 0")
        return Settings(sizes.pop(), tp["hashSeed"],
                        ev["zmqEndpoint"] or f"tcp://*:{ev['socketPort']}", ev["topicFilter"],
                        weights, self.speculative_indexing, ttl)


def normalize_pod(host_port: str) -> str:
    """`host:port` lower-cased, loopback names (localhost, ::1, 0.0.0.0) as 127.0.0.1."""
    url = urlsplit("//" + host_port.strip())
    host = url.hostname or ""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"{host}:{url.port}" if url.port is not None else host


def _fields(event: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(event, Mapping):
        tag = event.get("type")
        return (tag, dict(event)) if isinstance(tag, str) else ("", {})
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        return event[0], dict(zip(_FIELDS.get(event[0], ()), event[1:], strict=False))
    raise ValueError(f"event {event!r:.80} is neither an array nor a map")


class PrecisePrefixCacheProducer:
    """The producer; `start()`/`close()` run its event subscriber thread."""

    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name
        self.settings = params.settings()
        s = self.settings
        self.index = PrefixIndex(s.block_size, s.hash_seed, s.tier_weights)
        self.endpoint: str | None = None
        """The address the subscriber bound (resolves a `*` port), once started."""
        self.received = 0
        self.errors = 0
        self._seq: dict[tuple[str, Any], int] = {}
        self._stop = threading.Event()
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the SUB socket (errors raise here) and start the subscriber thread."""
        if self._thread is not None:
            return
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.settings.topic_filter.encode())
        try:
            sock.bind(self.settings.zmq_endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(f"{self.name}: cannot bind {self.settings.zmq_endpoint}: {e}") \
                from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-kv-events",
                                        daemon=True)
        self._thread.start()
        logger.info("%s: KV events on %s (topics %r)", self.name, self.endpoint,
                    self.settings.topic_filter)

    def close(self) -> None:
        """Stop the thread (within ~0.1 s) and close the socket."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=5)
        if thread.is_alive():
            logger.warning("%s: KV-event thread did not stop", self.name)
        elif self._sock is not None:
            self._sock.close()
        self._sock = None

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    break
                self._error(f"receive failed: {e}")
                continue
            try:
                self.handle(frames)
            except Exception as e:  # noqa: BLE001 - a bad message must not stop the thread
                self._error(f"message skipped: {e}")

    def _error(self, message: str) -> None:
        self.errors += 1
        logger.log(logging.WARNING if self.errors <= 20 else logging.DEBUG, "%s: KV events: %s",
                   self.name, message)

    def handle(self, frames: Sequence[bytes]) -> None:
        """Apply one message `[topic, seq, payload]` (ValueError etc. when malformed)."""
        if len(frames) < 2:
            raise ValueError(f"{len(frames)} frame(s)")
        topic = bytes(frames[0]).decode()
        parts = topic.split("@", 2)
        if len(parts) != 3 or not parts[1]:
            raise ValueError(f"topic {topic!r} is not kv@<host:port>@<model>")
        pod, model = normalize_pod(parts[1]), parts[2]
        batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
        if isinstance(batch, Mapping):
            events, rank = batch.get("events"), batch.get("data_parallel_rank")
        elif isinstance(batch, list | tuple) and len(batch) >= 2:
            events, rank = batch[1], batch[2] if len(batch) > 2 else None
        else:
            raise ValueError(f"batch {batch!r:.80} is not [ts, events, dp_rank?]")
        if not isinstance(events, list):
            raise ValueError("batch events is not a list")
        if len(frames) >= 3 and len(frames[1]) == 8:
            seq, last = int.from_bytes(frames[1], "big"), self._seq.get((pod, rank))
            self._seq[(pod, rank)] = seq
            if last is not None and seq <= last:
                logger.info("%s: KV events from %s restarted (seq %d after %d): its entries "
                            "are dropped", self.name, pod, seq, last)
                self.index.clear(pod)
        for event in events:
            try:
                self._apply(pod, model, event)
            except Exception as e:  # noqa: BLE001
                self._error(f"event from {pod} skipped: {e}")
        self.received += 1

    def _apply(self, pod: str, model: str, event: Any) -> None:
        tag, f = _fields(event)
        if f.get("group_idx") not in (None, 0):
            return
        tier = str(f.get("medium") or "gpu").lower()
        if tag == "BlockStored":
            hashes = [engine_key(h) for h in f.get("block_hashes") or []]
            parent = f.get("parent_block_hash")
            tokens = f.get("token_ids") or []
            size = int(f.get("block_size") or 0)
            extra = f.get("extra_keys")
            if tokens and isinstance(extra, list):
                cut = next((i for i, x in enumerate(extra) if x), len(hashes))
                hashes, tokens = hashes[:cut], tokens[:cut * size]
            self.index.store(pod, f.get("lora_name") or model, hashes,
                             None if parent is None else engine_key(parent), tokens, size, tier)
        elif tag == "BlockRemoved":
            self.index.remove(pod, [engine_key(h) for h in f.get("block_hashes") or []], tier)
        elif tag == "AllBlocksCleared":
            self.index.clear(pod)
        else:
            logger.debug("%s: unknown KV event %r from %s skipped", self.name, tag, pod)

    def request_keys(self, request: RouterRequest) -> list[int]:
        """The request's router keys (full blocks of its prompt)."""
        root = seed_key(self.settings.hash_seed, request.model, request.cache_salt)
        return chain_keys(root, request.token_ids, self.settings.block_size)

    def produce(self, request: RouterRequest, state: CycleState,
                endpoints: Sequence[Endpoint]) -> None:
        keys = self.request_keys(request)
        state.put(self.name, None, keys)
        pods = {id(e): normalize_pod(e.host_port) for e in endpoints}
        scores = self.index.match(keys, pods.values()) if keys else {}
        for e in endpoints:
            state.put(self.name, e, PrefixMatchInfo(scores.get(pods[id(e)], 0.0), len(keys),
                                                    self.settings.block_size))

    def pre_request(self, request: RouterRequest, state: CycleState,
                    result: SchedulingResult) -> None:
        keys = state.get(self.name)
        if not self.settings.speculative or not keys:
            return
        targets = [result.primary_endpoint, result.endpoint("prefill")]
        for pod in {normalize_pod(t.host_port) for t in targets if t is not None}:
            self.index.speculate(pod, keys, self.settings.speculative_ttl_s)


register(TYPE, Parameters, PrecisePrefixCacheProducer)
