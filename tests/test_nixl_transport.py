"""KV blocks read between two processes over NIXL (UCX, host memory), after a handshake over
the ZMQ side channel as vLLM's NixlConnector does it: bit-exact, only the named blocks
touched, the owner notified; a layout or model mismatch is refused by name."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from serve_process import free_port
from sous.kv_transfer.pd.nixl_transport import KVLayout, NixlTransport
from sous.kv_transfer.pd.side_channel import (
    SideChannelServer,
    fetch_metadata,
    side_channel_address,
)

MODEL = "tiny"

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 12, 16, 2, 8


def caches(seed: int | None) -> list[torch.Tensor]:
    """bf16 caches `[2, BLOCKS, BLOCK, HEADS, DIM]` per layer: seeded noise, or zeros."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) if gen else
            torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]


def owner(conn, port: int) -> None:  # the prefill side, in its own process
    kv = caches(seed=7)
    transport = NixlTransport("prefill-engine", kv, BLOCK)
    server = SideChannelServer("127.0.0.1", port, MODEL, transport.layout, transport.metadata())
    conn.send("ready")
    deadline = time.monotonic() + 60
    notifs: list[bytes] = []
    while not notifs and time.monotonic() < deadline:
        notifs = transport.take_notifs()
        time.sleep(0.01)
    conn.send(notifs)
    conn.recv()  # keep the memory registered until the reader is done
    server.close()
    transport.close()


def test_read_blocks_from_another_process() -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    port = free_port()
    proc = ctx.Process(target=owner, args=(there, port), daemon=True)
    proc.start()
    try:
        assert here.poll(120) and here.recv() == "ready", "the owner process did not start"
        kv = caches(seed=None)
        reader = NixlTransport("decode-engine", kv, BLOCK)
        with pytest.raises(ValueError, match="serves another model"):
            fetch_metadata("127.0.0.1", port, "other-model", reader.layout)
        layout, metadata = fetch_metadata("127.0.0.1", port, MODEL, reader.layout)
        assert layout.engine_id == "prefill-engine" and layout.num_blocks == BLOCKS
        reader.add_remote(metadata, layout)
        handle = reader.start_read("prefill-engine", [2, 5, 11], [0, 1, 3], notif=b"req-1")
        deadline = time.monotonic() + 60
        while not reader.done(handle):
            assert time.monotonic() < deadline, "the read did not finish"
            time.sleep(0.001)
        assert here.poll(60) and here.recv() == [b"req-1"]
        expected = caches(seed=7)
        for got, want in zip(kv, expected, strict=True):
            assert torch.equal(got[:, [0, 1, 3]], want[:, [2, 5, 11]])
            untouched = [b for b in range(BLOCKS) if b not in (0, 1, 3)]
            assert not got[:, untouched].any()
        with pytest.raises(ValueError, match="block_size 32 there, 16 here"):
            reader.add_remote(metadata, replace(layout, engine_id="other", block_size=32))
        with pytest.raises(ValueError, match="dtype 'float32' there, 'bfloat16' here"):
            reader.add_remote(metadata, replace(layout, engine_id="other", dtype="float32"))
        reader.close()
        here.send("done")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_layout_descriptors_address_each_block_of_each_plane() -> None:
    kv = caches(seed=None)
    layout = KVLayout.of("e", kv, BLOCK)
    assert layout.block_bytes == BLOCK * HEADS * DIM * 2
    rows = layout.descriptors()
    assert rows.shape == (LAYERS * 2 * BLOCKS, 3)
    # layer 1, V plane, block 4
    row = rows[(1 * 2 + 1) * BLOCKS + 4]
    assert row[0] == kv[1][1, 4].data_ptr() and row[1] == layout.block_bytes
    assert list(layout.indices([4])) == [(i * BLOCKS) + 4 for i in range(LAYERS * 2)]


def test_side_channel_address_and_an_unanswered_handshake() -> None:
    assert side_channel_address(0, {}) == ("localhost", 5600)
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700"}
    assert side_channel_address(3, env) == ("10.0.0.7", 5703)
    with pytest.raises(ValueError, match="VLLM_NIXL_SIDE_CHANNEL_PORT='x'"):
        side_channel_address(0, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})
    layout = KVLayout.of("e", caches(seed=None), BLOCK)
    with pytest.raises(TimeoutError, match=r"did not answer in 0.3 s"):
        fetch_metadata("127.0.0.1", free_port(), MODEL, layout, timeout_s=0.3)


def test_ucx_transports_keep_tcp_and_avoid_cma_when_ptrace_is_scoped(tmp_path: Path) -> None:
    from sous.kv_transfer.pd.nixl_transport import ucx_transports

    scope = tmp_path / "ptrace_scope"
    missing = str(tmp_path / "absent")
    assert ucx_transports({}, missing) is None  # no Yama: UCX picks (CMA works)
    scope.write_text("0\n")
    assert ucx_transports({}, str(scope)) is None
    scope.write_text("1\n")
    assert ucx_transports({}, str(scope)) == "tcp"
    assert ucx_transports({"UCX_TLS": "sm,self"}, missing) == "sm,self,tcp"
    assert ucx_transports({"UCX_TLS": "tcp,cma"}, str(scope)) == "tcp,cma"
    assert ucx_transports({"UCX_TLS": "^ib"}, missing) == "^ib"


def test_side_channel_answers_both_request_forms() -> None:
    """`[get_meta_msg, tp_rank]` and vLLM's newer `[get_meta_msg, pp_rank, tp_rank]`; anything
    else gets an error reply, not silence."""
    import msgpack
    import zmq

    layout = KVLayout.of("e", caches(seed=None), BLOCK)
    port = free_port()
    server = SideChannelServer("127.0.0.1", port, MODEL, layout, b"agent-bytes")
    try:
        for request, key in (([b"get_meta_msg", 0], "compatibility_hash"),
                             ([b"get_meta_msg", 0, 0], "compatibility_hash"),
                             ([b"hello"], "error")):
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(msgpack.packb(request))
            assert sock.poll(5000)
            assert key in msgpack.unpackb(sock.recv())
            sock.close()
    finally:
        server.close()


def test_pipeline_stages_answer_by_pp_rank_and_read_their_own_layers() -> None:
    """A server of two stages answers `[get_meta_msg, pp_rank, tp_rank]` with that stage's
    layout (its first layer, the model's layers); a whole reader accepts each stage and reads
    only that stage's layers from it; a stage past the last is an error reply."""
    from dataclasses import replace

    whole = KVLayout.of("reader", caches(seed=None), BLOCK)
    half = whole.num_layers // 2
    stage0 = replace(KVLayout.of("e", caches(seed=None)[:half], BLOCK),
                     model_layers=whole.num_layers)
    stage1 = replace(KVLayout.of("e-pp1", caches(seed=None)[half:], BLOCK),
                     first_layer=half, model_layers=whole.num_layers)
    assert stage1.layers == range(half, whole.num_layers)
    rows = whole.indices([3], stage1.layers)
    assert rows.tolist() == [(layer * whole.kv_size + plane) * whole.num_blocks + 3
                             for layer in stage1.layers for plane in range(whole.kv_size)]
    port = free_port()
    server = SideChannelServer("127.0.0.1", port, MODEL, stage0, b"a0",
                               more_stages=[(stage1, b"a1")])
    try:
        got = [fetch_metadata("127.0.0.1", port, MODEL, whole, pp_rank=r) for r in (0, 1)]
        assert [(lay.engine_id, lay.layers, meta) for lay, meta in got] == [
            ("e", range(0, half), b"a0"), ("e-pp1", range(half, whole.num_layers), b"a1")]
        assert fetch_metadata("127.0.0.1", port, MODEL, whole)[0].engine_id == "e"
        with pytest.raises(ValueError, match="no pipeline stage 2 here"):
            fetch_metadata("127.0.0.1", port, MODEL, whole, pp_rank=2)
    finally:
        server.close()


@pytest.mark.parametrize(("pp_size", "expected"), [
    (None, 1), (2, 2), ("3", 3), (-1, None), ("two", None)])
def test_pp_size_in_transfer_params(pp_size: object, expected: int | None) -> None:
    """Absent means one stage; a negative or non-numeric `pp_size` makes the params invalid
    (the decode leg then computes the prompt itself, as for any invalid params)."""
    from sous.kv_transfer.pd.params import remote_prefill

    params = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "remote_engine_id": "p",
              "remote_request_id": "r", "remote_host": "h", "remote_port": 5600}
    if pp_size is not None:
        params["pp_size"] = pp_size
    remote = remote_prefill(params)
    assert (remote and remote.pp_size) == expected
