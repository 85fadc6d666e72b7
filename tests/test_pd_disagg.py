"""Prefill/decode disaggregation over NIXL between real `sous serve` processes, the two legs
played as vLLM's toy proxy and llm-d's sidecar play them: the prefill leg with
`kv_transfer_params: {do_remote_decode: true}` and `max_tokens: 1`, then the original request
with the prefill answer's `kv_transfer_params` to the decode server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_process import free_port, sous_serve

NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
LEASE_S = 8
SMALL = ["--max-num-seqs", "32"]
SIDE_PORTS: dict[str, int] = {}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def server_env(side_port: int) -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), "VLLM_CPU_KVCACHE_SPACE": "0.5",
            "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(LEASE_S)}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(prefill URL, decode URL): two servers with the NIXL connector."""
    logs = tmp_path_factory.mktemp("pd")
    args = [*SMALL, "--kv-transfer-config", NIXL]
    SIDE_PORTS["prefill"] = free_port()
    with sous_serve(args, logs / "prefill.log", env=server_env(SIDE_PORTS["prefill"])) as p, \
            sous_serve(args, logs / "decode.log", env=server_env(free_port())) as d:
        yield p, d


def chat_body(text: str, max_tokens: int = 16, **extra: object) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}], **extra}


def prefill_leg(url: str, body: dict, path: str = "/v1/chat/completions") -> dict:
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        leg.pop(key, None)  # the proxy drops them for the prefill leg
    r = httpx.post(url + path, json=leg, timeout=120)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    return params


def metric(url: str, name: str, source: str | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + "{") and (source is None or f'source="{source}"' in line):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_usage_zero(url: str, timeout_s: float) -> float:
    """Seconds until the server's KV usage is 0 (blocks held by no request)."""
    start = time.monotonic()
    while metric(url, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() - start < timeout_s, f"{url} still holds KV blocks"
        time.sleep(0.1)
    return time.monotonic() - start


def story(topic: str, repeat: int = 12) -> str:
    return f"Tell me a long story about {topic}. " * repeat


def test_pd_legs_equal_one_server_chat_and_completions(servers: tuple[str, str]) -> None:
    p, d = servers
    body = chat_body(story("a lighthouse keeper"), max_tokens=24)
    want = httpx.post(p + "/v1/chat/completions", json=body, timeout=120).json()
    before = {s: metric(d, "vllm:prompt_tokens_by_source_total", s)
              for s in ("local_compute", "external_kv_transfer")}
    recomputed = metric(d, "vllm:prompt_tokens_recomputed_total")
    params = prefill_leg(p, body)
    assert len(params["remote_block_ids"][0]) * 16 >= want["usage"]["prompt_tokens"]
    assert metric(p, "vllm:kv_cache_usage_perc") > 0  # held under the lease
    got = httpx.post(d + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                     timeout=120).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        want["usage"]["prompt_tokens"] - 1
    # The decode server computed no prompt token but the last one (recomputed for logits).
    computed = metric(d, "vllm:prompt_tokens_by_source_total", "local_compute")
    external = metric(d, "vllm:prompt_tokens_by_source_total", "external_kv_transfer")
    assert computed - before["local_compute"] == 1
    assert metric(d, "vllm:prompt_tokens_recomputed_total") - recomputed == 1
    assert external - before["external_kv_transfer"] == want["usage"]["prompt_tokens"]
    assert wait_usage_zero(p, 5) < LEASE_S - 2  # freed by the read, not the lease

    # Completions, streamed on the decode leg.
    cbody = {"model": body["model"], "prompt": story("a red kite", 10), "max_tokens": 20,
             "temperature": 0}
    want_text = httpx.post(p + "/v1/completions", json=cbody, timeout=120).json()[
        "choices"][0]["text"]
    params = prefill_leg(p, cbody, "/v1/completions")
    text = ""
    with httpx.stream("POST", d + "/v1/completions", timeout=120,
                      json={**cbody, "stream": True, "kv_transfer_params": params}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == want_text
    wait_usage_zero(p, 5)


def test_sixteen_concurrent_pd_requests(servers: tuple[str, str]) -> None:
    p, d = servers
    bodies = [chat_body(story(f"city number {i}", 2 + 2 * i), max_tokens=12) for i in range(16)]
    want: list[str] = [""] * 16
    got: list[str] = [""] * 16

    def run(i: int, through_pd: bool) -> None:
        body = bodies[i]
        if through_pd:
            body = {**body, "kv_transfer_params": prefill_leg(p, body)}
        r = httpx.post((d if through_pd else p) + "/v1/chat/completions", json=body,
                       timeout=300)
        assert r.status_code == 200, r.text
        (got if through_pd else want)[i] = r.json()["choices"][0]["message"]["content"]

    for through_pd in (False, True):
        threads = [threading.Thread(target=run, args=(i, through_pd)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(want) and got == want
    wait_usage_zero(p, 10)
    wait_usage_zero(d, 10)


def test_lease_expiry_frees_blocks_and_a_late_decode_recomputes(servers: tuple[str, str]) -> None:
    p, d = servers
    body = chat_body(story("an old clock"), max_tokens=12)
    want = httpx.post(p + "/v1/chat/completions", json=body, timeout=120).json()
    params = prefill_leg(p, body)
    assert metric(p, "vllm:kv_cache_usage_perc") > 0
    assert wait_usage_zero(p, LEASE_S + 5) > LEASE_S - 3  # nobody read: the lease frees them
    failures = metric(d, "sous:kv_load_failures_total")
    got = httpx.post(d + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                     timeout=120).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert metric(d, "sous:kv_load_failures_total") == failures + 1


def test_decode_client_abort_releases_the_prefill_lease(servers: tuple[str, str]) -> None:
    p, d = servers
    body = chat_body(story("a slow river"), max_tokens=200)
    params = prefill_leg(p, body)
    with httpx.stream("POST", d + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "kv_transfer_params": params}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the client goes away after the first chunk
    assert wait_usage_zero(p, 5) < LEASE_S - 2
    wait_usage_zero(d, 10)


def test_prefill_server_killed_between_legs(servers: tuple[str, str], tmp_path: Path) -> None:
    _, d = servers
    body = chat_body(story("a quiet harbour"), max_tokens=12)
    args = [*SMALL, "--kv-transfer-config", NIXL]
    with sous_serve(args, tmp_path / "prefill2.log", env=server_env(free_port())) as p2:
        want = httpx.post(p2 + "/v1/chat/completions", json=body, timeout=120).json()
        params = prefill_leg(p2, body)
    failures = metric(d, "sous:kv_load_failures_total")
    got = httpx.post(d + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                     timeout=120).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert metric(d, "sous:kv_load_failures_total") == failures + 1


def test_pipeline_stage_prefill_and_a_whole_decode_server(tmp_path: Path) -> None:
    """A prefill server of two pipeline stages (each its own NIXL agent over its 15 layers;
    stage 0 serves the side channel for both) and a decode server of one: the decode leg reads
    each layer from the stage holding it, computes only the last prompt token and answers as
    the prefill server does; both stages free their blocks on the reads, not the lease. A
    decode leg sent to the staged server computes its prompt itself and releases the other
    server's blocks."""
    args = [*SMALL, "--kv-transfer-config", NIXL]
    staged = [*args, "--pipeline-parallel-size", "2"]
    with sous_serve(staged, tmp_path / "p.log", env=server_env(free_port())) as p, \
            sous_serve(args, tmp_path / "d.log", env=server_env(free_port())) as d:
        body = chat_body(story("a pipeline"), max_tokens=16)
        want = httpx.post(p + "/v1/chat/completions", json=body, timeout=120).json()
        params = prefill_leg(p, body)
        assert params["pp_size"] == 2
        got = httpx.post(d + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                         timeout=120).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            want["usage"]["prompt_tokens"] - 1
        assert wait_usage_zero(p, 5) < LEASE_S - 2

        body = chat_body(story("a relay race"), max_tokens=16)
        want = httpx.post(d + "/v1/chat/completions", json=body, timeout=120).json()
        params = prefill_leg(d, body)
        got = httpx.post(p + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                         timeout=120).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert wait_usage_zero(d, 5) < LEASE_S - 2
    assert "computes its prompt itself" in (tmp_path / "p.log").read_text()


def test_mla_checkpoint_through_two_legs(tmp_path: Path) -> None:
    """DeepSeek-V3.2 (MLA latent and indexer keys in the cache) on a tiny random checkpoint."""
    from tiny_models import make_tiny_deepseek

    path = make_tiny_deepseek(tmp_path, "DeepseekV32ForCausalLM", seed=5)
    args = [str(path), "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
            "--kv-cache-memory-bytes", "16MiB", "--kv-transfer-config", NIXL]
    env = {"OMP_NUM_THREADS": "1"}
    body = {"model": str(path), "prompt": "the cat and the dog are big and the sun is red " * 3,
            "max_tokens": 10, "temperature": 0, "min_tokens": 10}
    with sous_serve(args, tmp_path / "p.log", env={**env, **server_env(free_port())}) as p, \
            sous_serve(args, tmp_path / "d.log", env={**env, **server_env(free_port())}) as d:
        want = httpx.post(p + "/v1/completions", json=body, timeout=120).json()
        params = prefill_leg(p, body, "/v1/completions")
        got = httpx.post(d + "/v1/completions", json={**body, "kv_transfer_params": params},
                         timeout=120).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert metric(d, "vllm:prompt_tokens_by_source_total", "local_compute") == 1
        wait_usage_zero(p, 5)


@pytest.mark.parametrize(("transfer", "env", "expected"), [
    ({"kv_connector": "RblnNixlConnector", "kv_role": "kv_both", "kv_buffer_device": "tpu"},
     {}, "kv_buffer_device 'tpu' is not one of ['cpu', 'cuda', 'rbln']"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"},
     {"VLLM_NIXL_SIDE_CHANNEL_PORT": "http"}, "VLLM_NIXL_SIDE_CHANNEL_PORT='http'"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"},
     {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "-1"}, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT='-1'"),
])
def test_bad_pd_settings_stop_start_up(tmp_path: Path, transfer: dict, env: dict,
                                       expected: str) -> None:
    out = subprocess.run([sys.executable, "-m", "sous.cli", "serve", "--kv-transfer-config",
                          json.dumps(transfer), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env}, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert expected in out.stderr


def test_side_channel_port_in_use_is_named(servers: tuple[str, str], tmp_path: Path) -> None:
    port = SIDE_PORTS["prefill"]
    out = subprocess.run([sys.executable, "-m", "sous.cli", "serve", "--kv-transfer-config", NIXL,
                          "--port", str(free_port())], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **server_env(port)}, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.search(rf"cannot listen on tcp://localhost:{port}", out.stderr)


def test_decode_leg_finished_before_admission_still_releases_the_prefill() -> None:
    """An aborted decode leg that never got blocks sends the prefill a bare notification
    (vLLM: an empty read), so the prefill frees its blocks without waiting for the lease."""
    from sous.engine.request import Request, RequestStatus
    from sous.engine.sampling_params import SamplingParams
    from sous.kv_transfer.pd.scheduler_side import PDScheduler

    sched = PDScheduler("decode-engine", 16, "localhost", 5600, 30.0)
    params = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "remote_engine_id": "p",
              "remote_request_id": "req-p", "remote_host": "localhost", "remote_port": 5601}
    request = Request("req-d", list(range(20)), SamplingParams(), frozenset(), 8,
                      kv_transfer_params=params)
    assert sched.get_num_new_matched_tokens(request, 0) == (20, True)
    request.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request, []) == (False, None)
    (spec,) = sched.build_connector_meta().recvs
    assert spec.local_block_ids == [] and spec.notif == b"req-p:1"
    # Admitted, then aborted while its read is in flight: its blocks wait for the read.
    request2 = Request("req-d2", list(range(40)), SamplingParams(), frozenset(), 8,
                       kv_transfer_params={**params, "remote_block_ids": [[5, 6, 7]]})
    sched.update_state_after_alloc(request2, [10, 11, 12], 40)
    (spec,) = sched.build_connector_meta().recvs
    assert (spec.local_block_ids, spec.remote_block_ids) == ([10, 11, 12], [5, 6, 7])
    request2.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request2, [10, 11, 12]) == (True, None)
    sched.update_connector_output({"req-d2"})
    assert sched.request_finished(request2, [10, 11, 12]) == (False, None)
    # A prefill that sent fewer blocks than the prompt needs: no read, the request recomputes.
    request3 = Request("req-d3", list(range(40)), SamplingParams(), frozenset(), 8,
                       kv_transfer_params={**params, "remote_block_ids": [[5, 6]]})
    sched.update_state_after_alloc(request3, [20, 21, 22], 40)
    (spec,) = sched.build_connector_meta().recvs
    assert spec.local_block_ids == [20, 21, 22] and "sent 2 blocks" in spec.fail_reason


def test_recipe_multi_connector_nixl_and_lmcache(tmp_path: Path) -> None:
    """The recipes' P/D + LMCache form: RblnNixlConnector next to RBLNLMCacheConnectorV1."""
    transfer = json.dumps({
        "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "RblnNixlConnector", "kv_role": "kv_both",
                 "kv_buffer_device": "rbln", "kv_connector_extra_config": {"name": "nixl"}},
                {"kv_connector": "RBLNLMCacheConnectorV1", "kv_role": "kv_both"}]}})
    lmcache = {"PYTHONHASHSEED": "0", "LMCACHE_LOCAL_CPU": "True",
               "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"}
    args = [*SMALL, "--kv-transfer-config", transfer]
    body = chat_body(story("a paper boat"), max_tokens=16)
    with sous_serve(args, tmp_path / "p.log", env={**server_env(free_port()), **lmcache}) as p, \
            sous_serve(args, tmp_path / "d.log", env={**server_env(free_port()), **lmcache}) as d:
        want = httpx.post(p + "/v1/chat/completions", json=body, timeout=120).json()
        for _ in range(2):  # the second time the decode server has the prompt cached
            params = prefill_leg(p, body)
            got = httpx.post(d + "/v1/chat/completions", timeout=120,
                             json={**body, "kv_transfer_params": params}).json()
            assert got["choices"][0]["message"]["content"] == \
                want["choices"][0]["message"]["content"]
            wait_usage_zero(p, 5)
        assert metric(d, "sous:kv_transfers_total") == 2
