"""KV cache events over a real ZMQ socket: BlockStored hashes equal the sha256_cbor chain the
test computes itself; eviction publishes BlockRemoved; reset publishes AllBlocksCleared; the
replay socket resends buffered batches; in sub-block mode the events carry the sub-block chain."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from serve_process import free_port
from sous import LLM, SamplingParams
from sous.engine.kv_cache.hashing import hash_block_tokens, sha256_cbor
from sous.kv_transfer.events import hash_to_int

BLOCK = 16


def chain(token_ids: list[int], block: int = BLOCK) -> list[int]:
    """The sha256_cbor block-hash chain of the full blocks, as ints (low 64 bits)."""
    parent = sha256_cbor("0")  # conftest sets PYTHONHASHSEED=0
    out = []
    for i in range(len(token_ids) // block):
        parent = hash_block_tokens(sha256_cbor, parent, token_ids[i * block:(i + 1) * block])
        out.append(hash_to_int(parent))
    return out


def receive(sub: zmq.Socket, timeout_s: float = 5.0) -> list[tuple[int, list]]:
    """Every batch that arrives until the socket stays quiet for 0.3 s."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sub.poll(300 if got else 1000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@test"
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank == 0
        got.append((int.from_bytes(seq, "big"), events))
    return got


@pytest.fixture(scope="module")
def setup():
    port, replay = free_port(), free_port()
    llm = LLM(dtype="float32", max_model_len=160, num_gpu_blocks_override=12,
              prefix_caching_hash_algo="sha256_cbor",
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "topic": "kv@test",
                                "replay_endpoint": f"tcp://*:{replay}"})
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # ZMQ slow joiner: let the subscription reach the publisher
    yield llm, sub, replay
    sub.close()
    llm.engine.shutdown()


def test_block_stored_hashes_match_sha256_cbor_chain(setup) -> None:
    llm, sub, _ = setup
    prompt = " ".join(f"word{i}" for i in range(40))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    batches = receive(sub)
    stored = [e for _, events in batches for e in events if e[0] == "BlockStored"]
    hashes = [h for e in stored for h in e[1]]
    expected = chain(tokens[:-1])  # the last sampled token's KV is never computed
    assert hashes == expected[:len(hashes)] and len(hashes) == len(tokens[:-1]) // BLOCK
    first = stored[0]
    assert first[2] is None and first[4] == BLOCK and first[6] == "GPU"
    assert first[3] == tokens[:BLOCK * len(first[1])]
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_eviction_publishes_block_removed(setup) -> None:
    llm, sub, _ = setup
    assert llm.engine.reset_prefix_cache()
    receive(sub, timeout_s=0.5)
    a = llm.generate("alpha " * 60, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    cached_a = chain(a.prompt_token_ids)
    stored = [h for _, events in receive(sub) for e in events if e[0] == "BlockStored"
              for h in e[1]]
    assert stored == cached_a
    # 11 usable blocks, 4 of them a's (3 full + 1 partial, freed tail first): a 150-token
    # prompt needs 10, so it reuses a's partial tail block and then evicts a's last two full
    # blocks, in that order; a's first block survives.
    llm.generate("omega " * 150, SamplingParams(max_tokens=1), use_tqdm=False)
    removed = [h for _, events in receive(sub) for e in events if e[0] == "BlockRemoved"
               for h in e[1]]
    assert removed == [cached_a[2], cached_a[1]]


def test_reset_and_replay(setup) -> None:
    llm, sub, replay = setup
    receive(sub, timeout_s=0.5)
    assert llm.engine.reset_prefix_cache()
    batches = receive(sub)
    assert batches and batches[-1][1] == [["AllBlocksCleared"]]
    last_seq = batches[-1][0]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while dealer.poll(3000):
        _, seq, payload = dealer.recv_multipart()
        s = int.from_bytes(seq, "big", signed=True)
        if s == -1:
            assert payload == b""
            break
        seqs.append(s)
    dealer.close()
    assert seqs == list(range(0, last_seq + 1))


def test_sub_block_mode_publishes_sub_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 64 tokens, sub-blocks of 16 (--max-num-batched-tokens): BlockStored carries
    the sub-block chain with block_size 16, so a router keyed on 16-token blocks matches it."""
    monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", "1")
    port = free_port()
    llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks_override=8, block_size=64,
              max_num_batched_tokens=16, prefix_caching_hash_algo="sha256_cbor",
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "topic": "kv@test"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    try:
        prompt = " ".join(f"word{i}" for i in range(30))
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)[0]
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        stored = [e for _, events in receive(sub) for e in events if e[0] == "BlockStored"]
    finally:
        sub.close()
        llm.engine.shutdown()
    hashes = [h for e in stored for h in e[1]]
    assert hashes == chain(tokens[:-1], 16) and len(hashes) >= 4  # crosses a 64-token block
    assert all(e[4] == 16 for e in stored)

