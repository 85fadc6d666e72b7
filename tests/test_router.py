"""`sous route` over real `sous serve` processes (one prefill, two decode, NIXL between them),
with the recipe's P/D router config and with an aggregated decode-only config.

The last test kills servers: it runs last in this file and leaves the topology broken.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from openai import OpenAI

from serve_process import free_port, sous_route, sous_serve
from test_router_plugins import RECIPE_ROUTER

MODEL = "SmolLM2-135M-Instruct"
NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
SERVER_ARGS = ["--max-num-seqs", "4", "--max-model-len", "4096", "--kv-transfer-config", NIXL]
DECODE_ONLY = """
plugins:
- type: decode-filter
- type: approx-prefix-cache-producer
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins:
  - {pluginRef: decode-filter}
  - {pluginRef: prefix-cache-scorer, weight: 2}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


@dataclass
class Topology:
    prefill: str
    decodes: list[str]
    pd_router: str
    decode_router: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)


def _env() -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_CPU_KVCACHE_SPACE": "0.2"}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    logs = tmp_path_factory.mktemp("router")
    (logs / "pd.yaml").write_text(RECIPE_ROUTER)
    (logs / "decode.yaml").write_text(DECODE_ONLY)
    procs: dict[str, subprocess.Popen] = {}
    with sous_serve(SERVER_ARGS, logs / "prefill.log", env=_env(), procs=procs) as p, \
            sous_serve(SERVER_ARGS, logs / "decode1.log", env=_env(), procs=procs) as d1, \
            sous_serve(SERVER_ARGS, logs / "decode2.log", env=_env(), procs=procs) as d2, \
            sous_route(logs / "pd.yaml", [f"prefill={p}", f"decode={d1}", f"decode={d2}"],
                       logs / "pd-router.log") as pd, \
            sous_route(logs / "decode.yaml", [f"decode={d1}", f"decode={d2}"],
                       logs / "decode-router.log") as dr:
        yield Topology(p, [d1, d2], pd, dr, procs)


def chat(url: str, text: str, max_tokens: int = 16, system: str | None = None,
         stream: bool = False) -> tuple[str, int, str]:
    """(answer, cached prompt tokens, serving endpoint host:port) of a greedy chat."""
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": text}]
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text_out, cached = "", 0
        for chunk in raw.parse():
            if chunk.choices:
                text_out += chunk.choices[0].delta.content or ""
            if chunk.usage:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return text_out, cached, raw.headers.get("x-gateway-destination-endpoint", "")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    out = raw.parse()
    details = out.usage.prompt_tokens_details
    return (out.choices[0].message.content, details.cached_tokens if details else 0,
            raw.headers.get("x-gateway-destination-endpoint", ""))


def router_metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def host_port(url: str) -> str:
    return url.split("://", 1)[1]


PROMPTS = [f"Write two sentences about {t}." for t in
           ("a lighthouse", "the moon", "green tea", "a violin", "snow", "a red kite",
            "old maps", "bees", "a river", "copper", "a library", "thunder", "salt",
            "a bicycle", "owls", "glass")]


def test_greedy_through_both_routers_equals_one_server(topo: Topology) -> None:
    want = {p: chat(topo.prefill, p)[0] for p in PROMPTS[:2]}
    before = router_metric(topo.pd_router, "sous:router_decisions_total",
                           decision="disaggregated")
    for p in PROMPTS[:2]:
        assert chat(topo.pd_router, p)[0] == want[p]
        assert chat(topo.decode_router, p, stream=True)[0] == want[p]
    assert router_metric(topo.pd_router, "sous:router_decisions_total",
                         decision="disaggregated") - before >= 2
    # Completions, streamed and not, through the P/D router.
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0}
    ref = httpx.post(topo.prefill + "/v1/completions", json=body, timeout=120).json()
    got = httpx.post(topo.pd_router + "/v1/completions", json=body, timeout=120).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", topo.pd_router + "/v1/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == ref["choices"][0]["text"]


def test_sixteen_concurrent_through_pd_router_equal_alone(topo: Topology) -> None:
    want = {p: chat(topo.prefill, p, max_tokens=12)[0] for p in PROMPTS}
    with ThreadPoolExecutor(16) as pool:
        got = dict(zip(PROMPTS, pool.map(
            lambda p: chat(topo.pd_router, p, max_tokens=12)[0], PROMPTS), strict=True))
    assert got == want


def test_models_health_metrics_and_bad_requests(topo: Topology) -> None:
    models = httpx.get(topo.pd_router + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(topo.pd_router + "/health", timeout=10).status_code == 200
    r = httpx.post(topo.pd_router + "/v1/chat/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = httpx.post(topo.pd_router + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": -3})
    assert r.status_code == 400 and "max_tokens" in r.text  # the server's own error
    info = [line for line in httpx.get(topo.prefill + "/metrics", timeout=10).text.splitlines()
            if line.startswith("vllm:cache_config_info{")]  # what autoTune reads
    assert len(info) == 1 and 'block_size="16"' in info[0] and "num_gpu_blocks=" in info[0]
    for endpoint in (topo.prefill, *topo.decodes):
        assert router_metric(topo.pd_router, "sous:router_endpoint_healthy",
                             endpoint=endpoint) == 1
        age = router_metric(topo.pd_router, "sous:router_endpoint_scrape_age_seconds",
                            endpoint=endpoint)
        assert 0 <= age < 30


SYSTEM = ("You are a meticulous assistant for a maritime museum. " * 40).strip()


def test_repeated_prefix_goes_where_it_is_cached(topo: Topology) -> None:
    _, cached, first = chat(topo.decode_router, "Who built the first lighthouse?",
                            system=SYSTEM)
    assert first in {host_port(d) for d in topo.decodes}
    for q in ("What is a fresnel lens?", "Name a famous shipwreck."):
        _, cached, where = chat(topo.decode_router, q, system=SYSTEM)
        assert where == first
        assert cached >= 400  # the shared system prompt was a local prefix-cache hit
    other = next(d for d in topo.decodes if host_port(d) != first)
    _, cached_elsewhere, _ = chat(other, "What is a tide table?", system=SYSTEM)
    assert cached_elsewhere == 0  # where round-robin would have sent the second request
    # The P/D router keeps a conversation on one decode endpoint too.
    system2 = SYSTEM.replace("maritime", "railway")
    _, _, first = chat(topo.pd_router, "Who built the first train?", system=system2)
    assert all(chat(topo.pd_router, q, system=system2)[2] == first
               for q in ("What is a gauge?", "Name a famous station."))


def _load(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streamed completions on `url`, each dropped (so aborted) once `stop` is set."""
    def one() -> None:
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 1000,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_new_prefix_spreads_by_queue_depth(topo: Topology) -> None:
    busy, idle = topo.decodes
    stop = threading.Event()
    threads = _load(busy, 10, stop)  # 4 running, 6 waiting on the busy endpoint
    deadline = time.monotonic() + 60
    while router_metric(topo.decode_router, "sous:router_endpoint_waiting_requests",
                        endpoint=busy) < 2:
        assert time.monotonic() < deadline, "the busy endpoint never queued"
        time.sleep(0.1)
    wheres = {chat(topo.decode_router, f"Fresh topic {i}: describe a {w}.")[2]
              for i, w in enumerate(("kettle", "canyon", "drum"))}
    assert wheres == {host_port(idle)}
    stop.set()
    for t in threads:
        t.join(timeout=300)


def test_dead_decode_then_dead_prefill(topo: Topology) -> None:
    """A decode endpoint killed under load: only requests in flight on it may fail; every
    later one is answered (by the other). Every prefill endpoint killed: FailOpen answers
    from a decode endpoint, with the same greedy text."""
    fresh = [f"Name three facts about {t}." for t in ("zinc", "ferns", "comets", "gulls")]
    want = {p: chat(topo.prefill, p)[0] for p in fresh}  # unknown to the router's index
    victim, survivor = topo.decodes
    results: list[tuple[float, bool]] = []
    stop = threading.Event()

    def client_loop(i: int) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                ok = chat(topo.pd_router, PROMPTS[i % 16], max_tokens=24)[0] is not None
            except Exception:  # noqa: BLE001 - counted below
                ok = False
            results.append((start, ok))

    loops = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(4)]
    for t in loops:
        t.start()
    time.sleep(4)
    killed_at = time.monotonic()
    topo.procs[victim].send_signal(signal.SIGKILL)
    time.sleep(6)
    stop.set()
    for t in loops:
        t.join(timeout=120)
    after = [ok for start, ok in results if start > killed_at]
    failures = [start for start, ok in results if not ok]
    assert after and all(after), f"requests started after the kill failed: {after}"
    assert len(failures) <= 4  # at most the in-flight ones
    assert all(chat(topo.pd_router, p)[2] == host_port(survivor) for p in PROMPTS[:3])

    topo.procs[topo.prefill].send_signal(signal.SIGKILL)
    before = router_metric(topo.pd_router, "sous:router_decisions_total", decision="fail-open")
    for p in fresh:
        text, _, where = chat(topo.pd_router, p)
        assert (text, where) == (want[p], host_port(survivor))
    assert router_metric(topo.pd_router, "sous:router_decisions_total",
                         decision="fail-open") - before == len(fresh)
