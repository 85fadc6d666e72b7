"""`precise-prefix-cache-producer` fed over real ZMQ sockets: our engine's publisher (and a
raw PUB socket) connect to the plugin's bound SUB socket; then a real `sous serve` publishes
its KV events to it and the plugin reports the endpoint holding the prompt it just served."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from serve_process import free_port, sous_serve
from sous.kv_transfer.events import KVEventsConfig, ZmqEventPublisher
from sous.router.framework import (
    CycleState,
    Endpoint,
    ProfileResult,
    RouterRequest,
    SchedulingResult,
)
from sous.router.plugins.precise_prefix import PrecisePrefixCacheProducer, normalize_pod
from sous.router.plugins.registry import RouterConfigError, build_plugin
from sous.router.prompt import load_prompt_tokenizer

TYPE = "precise-prefix-cache-producer"
MODEL = "m"
A = list(range(1000, 1064))  # 4 blocks of 16
B = list(range(5000, 5048))  # 3 blocks
E1, E2, E3, E4 = (Endpoint(f"http://10.0.0.{i}:8000") for i in (1, 2, 3, 4))


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.01)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, size: int = 16,
           medium: str | None = "GPU") -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, size, None, medium]


def match(plugin: PrecisePrefixCacheProducer, tokens: list[int], *endpoints: Endpoint,
          model: str = MODEL) -> list[tuple[float, int]]:
    """(match_blocks, total_blocks) per endpoint for a request of `tokens`."""
    state = CycleState()
    plugin.produce(RouterRequest("r", "/v1/completions", {}, tokens, model), state, endpoints)
    return [(i.match_blocks, i.total_blocks) for i in (state.get(plugin.name, e)
                                                       for e in endpoints)]


class Pod:
    """Our engine's ZMQ publisher for one pod, connected to the plugin's socket."""

    def __init__(self, plugin: PrecisePrefixCacheProducer, endpoint: Endpoint) -> None:
        self.plugin = plugin
        self.pub = ZmqEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, endpoint=plugin.endpoint or "",
            topic=f"kv@{endpoint.host_port}@{MODEL}"))
        # ZMQ's slow joiner: a harmless batch until one arrives, then delivery is reliable.
        deadline = time.monotonic() + 15
        before = plugin.received
        while plugin.received == before:
            assert time.monotonic() < deadline, "the plugin never received a batch"
            self.pub.publish([["BlockRemoved", [0], "GPU"]])
            time.sleep(0.05)

    def send(self, *events: list[Any]) -> None:
        before = self.plugin.received
        self.pub.publish(list(events))
        wait_for(lambda: self.plugin.received > before, what="the batch")


@pytest.fixture
def plugin() -> Iterator[PrecisePrefixCacheProducer]:
    p = build_plugin(TYPE, None, {"kvEventsConfig": {"zmqEndpoint": "tcp://127.0.0.1:*"}})
    p.start()
    yield p
    p.close()


def test_two_pods_chains_tiers_removal_and_clear(plugin: PrecisePrefixCacheProducer) -> None:
    p1, p2 = Pod(plugin, E1), Pod(plugin, E2)
    p1.send(stored([1, 2, 3, 4], A))
    p2.send(stored([21], A[:16]), stored([22], A[16:32], parent=21), stored([11, 12, 13], B))
    request = A + [7] * 8  # the partial trailing block is not a key
    assert match(plugin, request, E1, E2, E3) == [(4, 4), (2, 4), (0, 4)]
    assert match(plugin, B, E1, E2) == [(0, 3), (3, 3)]
    assert match(plugin, request, E1, model="other") == [(0, 4)]  # keys are per model

    p2.send(stored([21, 22], [], medium="CPU"))  # offload: no tokens, known engine keys
    p2.send(["BlockRemoved", [22], "GPU"])
    assert match(plugin, A, E2) == [(1.8, 4)]  # GPU 1.0 + CPU 0.8
    p2.send(["BlockRemoved", [22], "CPU"])
    assert match(plugin, A, E2) == [(1.0, 4)]

    p1.send(["BlockRemoved", [3], "GPU"])
    assert match(plugin, A, E1) == [(2, 4)]  # block 4 no longer follows a held prefix
    p1.send(stored([5], list(range(16)), parent=999))  # unknown parent: cannot be chained
    assert match(plugin, list(range(16)), E1) == [(0, 1)]
    p1.send(["AllBlocksCleared"])
    assert match(plugin, A, E1, E2) == [(0, 4), (1.0, 4)]
    assert plugin.errors == 0


def test_engine_block_size_multiple_of_router_block(plugin: PrecisePrefixCacheProducer,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    pod = Pod(plugin, E3)
    pod.send(stored([31, 32], A, size=32))
    assert match(plugin, A, E3) == [(4, 4)]
    pod.send(["BlockRemoved", [32], None])  # medium nil: the GPU
    assert match(plugin, A, E3) == [(2, 4)]
    with caplog.at_level(logging.WARNING, logger="sous.router"):
        pod.send(stored([41, 42], B, size=24))
        pod.send(stored([43, 44], B, size=24))
    assert match(plugin, B, E3) == [(0, 3)]
    warned = [r for r in caplog.records if "not a multiple" in r.getMessage()]
    assert len(warned) == 1


def test_map_form_bytes_hashes_and_malformed_messages(plugin: PrecisePrefixCacheProducer) -> None:
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(plugin.endpoint)
    topic = b"kv@LOCALHOST:9000@" + MODEL.encode()
    seq = iter(range(10**6))

    def send(topic: bytes, payload: bytes) -> None:
        pub.send_multipart([topic, next(seq).to_bytes(8, "big"), payload])

    event = {"type": "BlockStored", "block_hashes": [b"\x07" * 32], "parent_block_hash": None,
             "token_ids": A[:16], "block_size": 16, "medium": "GPU"}
    mapped = msgpack.packb({"ts": time.time(), "events": [event]})
    local = Endpoint("http://127.0.0.1:9000")
    deadline = time.monotonic() + 15
    while match(plugin, A, local) != [(1, 4)]:  # resent until the subscription is up
        assert time.monotonic() < deadline, "the map-form event was never indexed"
        send(topic, mapped)
        time.sleep(0.05)
    errors = plugin.errors
    send(b"kv@no-model", msgpack.packb([time.time(), []]))
    send(topic, b"\xc1 not msgpack")
    send(topic, msgpack.packb([time.time(), [["BlockStored", "nope"], 42]]))
    wait_for(lambda: plugin.errors >= errors + 4, what="the errors")
    before = plugin.received
    send(topic, msgpack.packb([time.time(), [["BlockRemoved", [b"\x07" * 32], "GPU"]], 0]))
    wait_for(lambda: plugin.received > before)
    assert match(plugin, A, local) == [(0, 4)]  # the thread survived the bad messages
    pub.close()


def test_speculative_entries_expire() -> None:
    plugin = build_plugin(TYPE, "p", {"speculativeIndexing": True, "speculativeTTL": "300ms",
                                      "tokenProcessorConfig": {"blockSize": 8}})
    request = RouterRequest("r", "/v1/completions", {}, A, MODEL)
    state = CycleState()
    plugin.produce(request, state, [E1, E2])
    assert state.get("p", E1).match_blocks == 0 and state.get("p", E1).total_blocks == 8
    result = SchedulingResult({"decode": ProfileResult("decode", (E4,), {}),
                               "prefill": ProfileResult("prefill", (E1,), {})}, "decode")
    plugin.pre_request(request, state, result)
    assert match(plugin, A, E1, E2, E4) == [(8, 8), (0, 8), (8, 8)]
    wait_for(lambda: match(plugin, A, E1, E4) == [(0, 8), (0, 8)], timeout_s=10,
             what="the speculative entries to expire")
    quiet = build_plugin(TYPE, "q", {})
    state = CycleState()
    quiet.produce(request, state, [E1])
    quiet.pre_request(request, state, result)
    assert match(quiet, A, E1) == [(0, 4)]


def test_config_errors_name_the_key(plugin: PrecisePrefixCacheProducer) -> None:
    bad = [({"kvEventsConfig": {"topicFilter": "kv@", "bogus": 1}}, "'bogus'"),
           ({"tokenProcessorConfig": {"blockSize": 16, "hashseed": "x"}}, "'hashseed'"),
           ({"indexerConfig": {"kvBlockIndexConfig": {}}}, "'kvBlockIndexConfig'"),
           ({"kvEventsConfig": {"engineType": "sglang"}}, "engineType"),
           ({"speculativeTTL": "soon"}, "speculativeTTL"),
           ({"speculativeTTLs": "2s"}, "speculativeTTLs")]
    for params, named in bad:
        with pytest.raises(RouterConfigError, match=named):
            build_plugin(TYPE, None, params)
    tuned = build_plugin(TYPE, None, {
        "tokenProcessorConfig": {"blockSizeTokens": 64, "hashSeed": "42"},
        "kvEventsConfig": {"socketPort": 6000, "concurrency": 2},
        "indexerConfig": {"kvCacheBackendConfigs": [{"name": "GPU", "weight": 1},
                                                    {"name": "cpu", "weight": 0.5}]},
        "speculativeIndexing": True, "speculativeTTL": "1m30s"}).settings
    assert (tuned.block_size, tuned.zmq_endpoint, tuned.speculative_ttl_s) == \
        (64, "tcp://*:6000", 90.0)
    assert tuned.tier_weights == {"gpu": 1.0, "cpu": 0.5}
    taken = build_plugin(TYPE, None, {"kvEventsConfig": {"zmqEndpoint": plugin.endpoint}})
    with pytest.raises(RuntimeError, match="cannot bind"):
        taken.start()
    assert [normalize_pod(h) for h in ("localhost:80", "[::1]:80", "Host:1", "[fe80::1]:2")] \
        == ["127.0.0.1:80", "127.0.0.1:80", "host:1", "[fe80::1]:2"]


def test_real_server_events_locate_the_prompt(plugin: PrecisePrefixCacheProducer,
                                              tmp_path: Path) -> None:
    port = free_port()
    model = "SmolLM2-135M-Instruct"
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": plugin.endpoint,
                         "topic": f"kv@127.0.0.1:{port}@{model}"})
    args = ["--max-model-len", "1024", "--served-model-name", model,
            "--kv-events-config", events]
    with sous_serve(args, tmp_path / "serve.log", env={"VLLM_CPU_KVCACHE_SPACE": "0.2"},
                    port=port) as url:
        body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [
            {"role": "user", "content": " ".join(f"fact{i} is {i * 7}." for i in range(60))}]}
        tokens = load_prompt_tokenizer(None).token_ids("/v1/chat/completions", body)
        server, other = Endpoint(f"http://localhost:{port}"), Endpoint("http://127.0.0.1:1")
        assert match(plugin, tokens, server, model=model)[0][0] == 0
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                           trust_env=False)
        assert reply.status_code == 200, reply.text
        full = len(tokens) // 16
        assert full >= 10 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
        wait_for(lambda: match(plugin, tokens, server, model=model)[0] == (full, full),
                 timeout_s=30, what="the server's events")
        assert match(plugin, tokens, other, model=model) == [(0, full)]
    assert plugin.errors == 0
