"""Data parallel serving end to end: `sous serve --data-parallel-size 2` (one API server, two
engine-rank processes) and the multi-node layout (a rank started with `--headless` joining the
API server's coordinator), against a one-process server, over HTTP with the official client.
Greedy output must be token-for-token the same alone and among 16 concurrent requests; both
ranks must serve (per-engine /metrics); each rank publishes its own KV events (port + rank,
`dp_rank` in the batch); a killed rank makes the server unhealthy and exit non-zero at once;
a rank that cannot reach its coordinator exits 2 naming the flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import zmq

from serve_process import free_port, sous_serve

MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "1024"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "0.25"}
PROMPTS = [f"In one sentence, what is {topic}?" for topic in (
    "rain", "a violin", "Paris", "a prime number", "bread", "the moon", "a river", "chess",
    "a glacier", "an owl", "copper", "a comet", "tea", "a bridge", "a volcano", "jazz")]


def chat(client: openai.OpenAI, text: str, max_tokens: int = 32) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0,
        max_tokens=max_tokens)
    return r.choices[0].message.content, r.choices[0].finish_reason


def engine_counters(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="')[1].split('"')[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with sous_serve(ARGS, tmp_path_factory.mktemp("dp") / "one.log", env=ENV) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """An API server running rank 0 (`--data-parallel-size-local 1`) and rank 1 joining it
    from a `--headless` process, as on two machines; KV events on a tcp port (rank r binds
    port + r). Yields (base URL, events port)."""
    tmp = tmp_path_factory.mktemp("dp")
    rpc, events = free_port(), free_port()
    while events + 1 == rpc or events == rpc:
        events = free_port()
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://*:{events}", "topic": "kv@dp"})
    headless = subprocess.Popen(
        [sys.executable, "-m", "sous.cli", "serve", *ARGS, *dp, "--headless",
         "--data-parallel-start-rank", "1", "--kv-events-config", kv_events],
        stdout=(tmp / "headless.log").open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, **ENV})
    try:
        with sous_serve([*ARGS, *dp, "--kv-events-config", kv_events], tmp / "api.log",
                        env=ENV) as url:
            yield url, events
        assert headless.wait(timeout=60) == 0, (tmp / "headless.log").read_text()[-3000:]
    finally:
        if headless.poll() is None:
            headless.kill()


def test_two_node_ranks_answer_as_one_process_alone_and_sixteen_way(baseline, two_nodes):
    url, _ = two_nodes
    dp = openai.OpenAI(base_url=url + "/v1", api_key="x")
    expected = [chat(baseline, p) for p in PROMPTS]
    for p, want in zip(PROMPTS[:3], expected, strict=False):
        assert chat(dp, p) == want, p
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: chat(dp, p), PROMPTS))
    assert got == expected
    served = engine_counters(url, "vllm:prefix_cache_queries_total")
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert set(engine_counters(url, "vllm:num_requests_running")) == {"0", "1"}


def test_each_rank_publishes_its_kv_events_on_port_plus_rank(two_nodes):
    url, events = two_nodes
    ctx = zmq.Context.instance()
    subs = []
    for rank in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@dp")
        sub.connect(f"tcp://127.0.0.1:{events + rank}")
        subs.append(sub)
    time.sleep(0.5)  # let the subscriptions reach the publishers
    dp = openai.OpenAI(base_url=url + "/v1", api_key="x")
    with ThreadPoolExecutor(4) as pool:  # four new prompts: both ranks get some
        list(pool.map(lambda i: chat(dp, f"Name {i} colours of the rainbow, please.", 4),
                      range(4)))
    for rank, sub in enumerate(subs):
        assert sub.poll(10_000), f"no KV events from rank {rank}"
        topic, _seq, payload = sub.recv_multipart()
        ts, batch_events, dp_rank = msgpack.unpackb(payload)
        assert topic == b"kv@dp" and dp_rank == rank and batch_events[0][0] == "BlockStored"
        sub.close(linger=0)


def kill_child_mid_stream(args: list[str], log: Path, victim: int) -> int:
    """Serve `args` (an API server with two engine child processes), start a long greedy
    stream, `kill -9` child `victim` (pgrep order); the stream must fail and the server exit
    within 30 s. Returns its exit status."""
    procs: dict[str, subprocess.Popen] = {}
    with sous_serve(args, log, env=ENV, procs=procs) as url:
        server = procs[url]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert chat(client, PROMPTS[0], 4)[0]
        children = subprocess.run(["pgrep", "-P", str(server.pid), "-f", "spawn_main"],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 2, children
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=400, temperature=0, stream=True)
        next(iter(stream))
        subprocess.run(["kill", "-9", children[victim]], check=True)
        start = time.monotonic()
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                pass
        code = server.wait(timeout=30)
        assert time.monotonic() - start < 30
    return code


def test_killed_rank_fails_clients_and_the_server_exits_non_zero(tmp_path: Path):
    # The stream runs on rank 0 (the first pick on a tie); rank 1's death must fail it.
    assert kill_child_mid_stream([*ARGS, "--data-parallel-size", "2"], tmp_path / "dp.log",
                                 victim=-1) != 0
    assert "exited with code -9" in (tmp_path / "dp.log").read_text()


def test_rank_that_cannot_reach_its_coordinator_exits_2_naming_the_flags(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "sous.cli", "serve", *ARGS, "--headless",
         "--data-parallel-size", "2", "--data-parallel-start-rank", "1",
         "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "SOUS_DP_CONNECT_TIMEOUT_S": "2"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "--data-parallel-address / --data-parallel-rpc-port" in r.stderr
    assert "got no answer" in r.stderr and "Loading GGUF" not in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--data-parallel-size", "2", "--data-parallel-rank", "2"],
     "--data-parallel-rank 2: must be below --data-parallel-size 2"),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "3"],
     "--data-parallel-start-rank 0 --data-parallel-size-local 3: ranks past"),
    (["--headless"], "--headless runs data parallel ranks"),
    (["--data-parallel-size", "2", "--data-parallel-start-rank", "1"],
     "--data-parallel-start-rank 1: only with --headless"),
    (["--data-parallel-size", "2", "--distributed-executor-backend", "mp"],
     "--distributed-executor-backend mp with --data-parallel-size > 1 is not supported yet"),
])
def test_contradictory_parallel_flags_exit_2_naming_them(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sous.config.engine_args import parse_serve_args

    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv, environ={})
    assert exc.value.code == 2 and needle in capsys.readouterr().err
