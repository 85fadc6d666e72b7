"""KV offload tiers on LMCache through real `sous serve` processes: a long prompt asked,
evicted from the (deliberately small) device cache by other traffic and asked again is
served from the CPU tier, the disk tier, the RDS plugin and a real Redis (also from a fresh
server process), with greedy output identical to the uncached answer and `cached_tokens` the
chunk-aligned hit. Faults: Redis down and back, corrupted values, bad start-up input."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import openai
import pytest
import zmq

from redis_server import RedisServer
from serve_process import free_port, serve_flag_error, sous_serve

CHUNK = 64
PROMPT_TOKENS = 422
HIT = PROMPT_TOKENS // CHUNK * CHUNK  # 384: the device cache alone would give 416
LMCACHE = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
RBLN = json.dumps({"kv_connector": "RBLNLMCacheConnectorV1", "kv_role": "kv_both"})
SMALL = ["--num-gpu-blocks-override", "40", "--max-model-len", "600"]
"""40 blocks of 16 tokens: three other prompts of ~420 tokens evict a prompt entirely."""
_WORDS = ["apple", "river", "stone", "cloud", "green", "music", "table", "seven", "north",
          "light"]


def prompt(seed: int) -> str:
    """~422 tokens of the bundled model's tokenizer."""
    rng = random.Random(seed)
    return f"Story {seed}: " + " ".join(rng.choice(_WORDS) for _ in range(419))


def ask(url: str, text: str) -> tuple[str, int]:
    """Greedy completion: (text, cached_tokens)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.completions.create(model=client.models.list().data[0].id, prompt=text,
                                  max_tokens=12, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].text, details.cached_tokens if details else 0


def evict(url: str, seed: int) -> None:
    for i in range(3):
        ask(url, prompt(10_000 + seed * 10 + i))


def env(**values: object) -> dict[str, str]:
    return {"LMCACHE_CHUNK_SIZE": str(CHUNK), **{k: str(v) for k, v in values.items()}}


def assert_served_again(url: str, seed: int) -> None:
    first, cached = ask(url, prompt(seed))
    assert cached == 0
    evict(url, seed)
    assert ask(url, prompt(seed)) == (first, HIT)


@pytest.mark.parametrize("pp", [1, 2])
def test_cpu_tier_from_config_file_publishes_kv_events(tmp_path: Path, pp: int) -> None:
    """With `pp` 2, each pipeline stage keeps its own layers' chunks in its own LMCache
    engine and the scheduler looks up through both."""
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.2\n")
    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{port}", "topic": "kv"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    log = tmp_path / "serve.log"
    stages = ["--pipeline-parallel-size", str(pp)] if pp > 1 else []
    with sous_serve([*SMALL, *stages, "--kv-transfer-config", LMCACHE, "--kv-events-config",
                     events], log, env={"LMCACHE_CONFIG_FILE": str(config)}) as url:
        assert_served_again(url, 1)
        stored = []
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
    sub.close()
    text = log.read_text()
    assert text.count("KV offload (LMCache LMCacheConnectorV1, chunks of 64 tokens") == pp
    assert "CPU (0.2 GB, " in text
    offload = [e for e in stored if e[6] == "CPU"]
    assert offload and all(e[4] == CHUNK and len(e[3]) == CHUNK for e in offload)
    assert any(e[6] == "GPU" for e in stored)  # the device prefix cache's own events


def test_disk_tier_with_cpu_tier_off_inside_multi_connector(tmp_path: Path) -> None:
    child = {"kv_connector": "RBLNLMCacheConnectorV1", "kv_role": "kv_both",
             "kv_connector_module_path": "lmcache_rbln.integration.vllm.connector",
             "kv_connector_extra_config": {"name": "lmcache"}}  # as the recipes' P/D mode
    multi = json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"connectors": [child]}})
    disk = tmp_path / "disk"
    with sous_serve([*SMALL, "--kv-transfer-config", multi], tmp_path / "serve.log",
                    env=env(LMCACHE_LOCAL_CPU="False", LMCACHE_MAX_LOCAL_CPU_SIZE=0.1,
                            LMCACHE_LOCAL_DISK=f"file://{disk}",
                            LMCACHE_MAX_LOCAL_DISK_SIZE=0.2)) as url:
        assert_served_again(url, 2)
        assert len(list(disk.iterdir())) >= HIT // CHUNK
    assert "disk " + str(disk) in (tmp_path / "serve.log").read_text()


def test_rds_plugin_as_the_recipe_configures_it(tmp_path: Path) -> None:
    extra = {"storage_plugin.RDSBackend.module_path": "lmcache_rbln.storage_plugin.rds_backend",
             "storage_plugin.RDSBackend.class_name": "RDSBackend",
             "storage_plugin.RDSBackend.path": str(tmp_path / "rds"),
             "storage_plugin.RDSBackend.rds_max_chunks": 64}
    with sous_serve([*SMALL, "--kv-transfer-config", RBLN], tmp_path / "serve.log",
                    env=env(LMCACHE_LOCAL_CPU="False", LMCACHE_MAX_LOCAL_CPU_SIZE=0,
                            LMCACHE_STORAGE_PLUGINS="RDSBackend",
                            LMCACHE_EXTRA_CONFIG=json.dumps(extra))) as url:
        assert_served_again(url, 3)
    assert "plugin RDSBackend (sous.kv_transfer.offload.rds_backend)" in \
        (tmp_path / "serve.log").read_text()


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path / "redis.log").start()
    yield server
    server.stop()


def wait_for_keys(server: RedisServer, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.client().dbsize() < n:
        assert time.monotonic() < deadline, "nothing reached Redis"
        time.sleep(0.2)


def wait_for_reconnect(url: str, server: RedisServer, timeout_s: float = 30.0) -> None:
    """Ask fresh prompts until one's KV is in `server`, all of it (LMCache retries a lost
    remote at most every 10 s, on its next use)."""
    deadline = time.monotonic() + timeout_s
    for seed in itertools.count(20_000):
        ask(url, prompt(seed))
        time.sleep(0.5)
        if server.client().dbsize():
            wait_for_keys(server, 2 * (HIT // CHUNK))
            return
        assert time.monotonic() < deadline, "LMCache did not reconnect to Redis"


def test_redis_tier_across_processes_and_faults(tmp_path: Path, redis_server: RedisServer) -> None:
    remote = env(LMCACHE_LOCAL_CPU="False", LMCACHE_MAX_LOCAL_CPU_SIZE=0.1,
                 LMCACHE_REMOTE_URL=redis_server.url)
    args = [*SMALL, "--kv-transfer-config", LMCACHE]
    client = redis_server.client()
    answers, keys = {}, {}
    with sous_serve(args, tmp_path / "first.log", env=remote) as url:
        for seed in (4, 5, 6):
            before = set(client.keys("*"))
            answers[seed] = ask(url, prompt(seed))[0]
            wait_for_keys(redis_server, len(before) + 2 * (HIT // CHUNK))
            keys[seed] = sorted(k.decode() for k in set(client.keys("*")) - before)
    # LMCache's layout: "<model>@<world size>@<rank>@<chunk hash hex>@<dtype>" + two suffixes.
    assert all(k.startswith("SmolLM2-135M-Instruct@1@0@") for k in keys[4])
    # the KV cache's dtype: the bundled GGUF's default cache is bfloat16 on every CPU
    assert all(k.endswith(("@bfloat16kv_bytes", "@bfloat16metadata")) for k in keys[4]), keys[4]
    # Prompt 5: a truncated value; prompt 6: metadata of another dtype. Misses, never garbage.
    truncated = next(k for k in keys[5] if k.endswith("kv_bytes"))
    client.set(truncated, client.get(truncated)[:1000])
    for key in keys[6]:
        if key.endswith("metadata"):
            client.set(key, _with_dtype(client.get(key), "float16"))
    log = tmp_path / "second.log"
    with sous_serve(args, log, env=remote) as url:  # a fresh process: only Redis has the KV
        assert ask(url, prompt(4)) == (answers[4], HIT)
        assert ask(url, prompt(5))[0] == answers[5]
        assert ask(url, prompt(6))[0] == answers[6]
        redis_server.stop()
        for seed in (7, 8, 9):  # Redis down: uncached, and still correct
            assert ask(url, prompt(seed))[1] == 0
        evict(url, 4)
        assert ask(url, prompt(4)) == (answers[4], 0)
        redis_server.start()
        wait_for_reconnect(url, redis_server)
        stored = client.dbsize()
        first = ask(url, prompt(11))[0]
        wait_for_keys(redis_server, stored + 2 * (HIT // CHUNK))
        evict(url, 11)
        assert ask(url, prompt(11)) == (first, HIT)
    text = log.read_text()
    assert text.count("remote tier redis://") == 2  # down once, back once: not per request
    assert "is down" in text and "answers again" in text


def _with_dtype(metadata: bytes, dtype: str) -> bytes:
    """LMCache's RemoteMetadata (int32s: length, format, then dtype and a 4-d shape per
    group) with its dtype replaced."""
    import struct

    import torch
    from lmcache.v1.protocol import DTYPE_TO_INT

    fields = list(struct.unpack(f"<{len(metadata) // 4}i", metadata))
    assert fields[2] != DTYPE_TO_INT[getattr(torch, dtype)]
    fields[2] = DTYPE_TO_INT[getattr(torch, dtype)]
    return struct.pack(f"<{len(fields)}i", *fields)


def run_serve(args: list[str], extra_env: dict[str, str], tmp_path: Path,
              timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "sous.cli", "serve", *args, "--port",
                           str(free_port())], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **extra_env}, cwd=tmp_path)


@pytest.mark.parametrize(("transfer", "expected"), [
    ({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"},
     "unknown kv_connector 'NoSuchConnector'; known: LMCacheConnectorV1, MultiConnector, "
     "NixlConnector, RBLNLMCacheConnectorV1, RblnNixlConnector"),
    ({"kv_connector": "LMCacheConnectorV1"}, "kv_role must be one of"),
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "bogus": 1},
     "unknown field(s) ['bogus']"),
])
def test_bad_transfer_config_is_refused_with_the_flags(transfer: dict, expected: str) -> None:
    err = serve_flag_error([*SMALL, "--kv-transfer-config", json.dumps(transfer)])
    assert "--kv-transfer-config" in err and expected in err, err


@pytest.mark.parametrize(("extra_env", "expected"), [
    ({"LMCACHE_CHUNK_SIZE": "lots"}, "LMCACHE_CHUNK_SIZE='lots'"),
    ({"LMCACHE_LOCAL_CPU": "maybe"}, "LMCACHE_LOCAL_CPU='maybe': not a boolean"),
    ({"LMCACHE_STORAGE_PLUGINS": "X", "LMCACHE_EXTRA_CONFIG": json.dumps(
        {"storage_plugin.X.module_path": "no_such_module.backend",
         "storage_plugin.X.class_name": "B"})},
     "storage plugin X: module 'no_such_module.backend' cannot be imported"),
    ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "0", "LMCACHE_LOCAL_DISK": "/tmp/x",
      "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}, "LMCache stages local_disk reads and writes"),
])
def test_bad_input_stops_start_up(tmp_path: Path, extra_env: dict, expected: str) -> None:
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    out = run_serve([*SMALL, "--kv-transfer-config", json.dumps(transfer)], extra_env, tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert expected in out.stderr


def test_offload_with_a_worker_process_stops_start_up(tmp_path: Path) -> None:
    out = run_serve(["--distributed-executor-backend", "mp", "--kv-transfer-config", LMCACHE],
                    {}, tmp_path)
    assert out.returncode == 2
    assert "the offload connector runs in the engine's process" in out.stderr


def test_unreachable_redis_and_unwritable_disk_warn_and_serve(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    log = tmp_path / "serve.log"
    with sous_serve([*SMALL, "--kv-transfer-config", LMCACHE], log,
                    env=env(LMCACHE_MAX_LOCAL_CPU_SIZE=0.2,
                            LMCACHE_LOCAL_DISK=str(blocker / "disk"),
                            LMCACHE_MAX_LOCAL_DISK_SIZE=0.1,
                            LMCACHE_REMOTE_URL=f"redis://127.0.0.1:{free_port()}")) as url:
        assert_served_again(url, 12)  # the CPU tier still works
    text = log.read_text()
    assert "does not answer" in text and "serving without it" in text
    assert "is not writable" in text


def test_recipe_launch_runs_the_lmcache_rds_selection(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    from sous.recipes.cli import main

    code = main(["launch", "minimax-m2.7", "--strategy", "aggregated-data-expert-parallel",
                 "--target", "Throughput", "--set", "lmcache=rds",
                 "--duration", "0.2", "--log-dir", str(tmp_path), "--ready-timeout", "240",
                 "--kv-cache-gib", "0.5"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "chat reply: " in err and "DROPPED" not in err
    assert "VLLM_CPU_KVCACHE_SPACE=0.5 (KV cache GiB: --kv-cache-gib)" in err
    log = (tmp_path / "main.log").read_text()
    assert "KV offload (LMCache RBLNLMCacheConnectorV1, chunks of 4096 tokens" in log
    assert "plugin RDSBackend (sous.kv_transfer.offload.rds_backend)" in log


@pytest.mark.parametrize(("policy", "pp"), [("recompute", 1), ("fail", 1), ("recompute", 2)])
def test_truncated_disk_chunk_is_a_miss_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                policy: str, pp: int) -> None:
    """LMCache's disk tier would serve a truncated chunk file as whatever its buffer held;
    here it is a miss: the request recomputes from the last good chunk (identical output),
    or with `kv_load_failure_policy: fail` it is aborted. With two pipeline stages the
    truncated chunk is one stage's: both stages skip the request's load alike."""
    from sous import LLM, SamplingParams

    disk = tmp_path / "disk"
    for name, value in env(LMCACHE_LOCAL_CPU="False", LMCACHE_MAX_LOCAL_CPU_SIZE=0.1,
                           LMCACHE_LOCAL_DISK=str(disk), LMCACHE_MAX_LOCAL_DISK_SIZE=0.2).items():
        monkeypatch.setenv(name, value)
    llm = LLM(num_gpu_blocks_override=40, max_model_len=600, pipeline_parallel_size=pp,
              kv_transfer_config={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                  "kv_load_failure_policy": policy})
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0)
        first = llm.generate([prompt(13)], greedy)[0].outputs[0]
        deadline = time.monotonic() + 30
        while len(stored := list(disk.iterdir())) < pp * HIT // CHUNK:  # in LMCache's thread
            assert time.monotonic() < deadline, stored
            time.sleep(0.1)
        for i in range(3):
            llm.generate([prompt(13_000 + i)], greedy)
        with stored[0].open("r+b") as f:  # one of the prompt's chunks
            f.truncate(1000)
        again = llm.generate([prompt(13)], greedy)[0]
    finally:
        llm.engine.shutdown()
    if policy == "recompute":
        assert again.outputs[0].text == first.text
        # the chunks before the truncated one were loaded, the rest recomputed
        assert again.num_cached_tokens % CHUNK == 0 and again.num_cached_tokens < HIT
    else:
        assert again.outputs[0].finish_reason == "abort"
