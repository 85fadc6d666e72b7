"""The endpoint pool: the model servers behind the router, their health and scraped metrics.

Every `interval` seconds each endpoint's `/health` and `/metrics` are fetched (concurrently);
an endpoint is healthy while both answer 200. From `/metrics` the pool reads vLLM's
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` and
`vllm:cache_config_info{block_size, num_gpu_blocks}` (summed over engines). A request that
cannot connect to an endpoint marks it unhealthy at once (`mark_down`); the next good
scrape brings it back. The pool owns `Endpoint.healthy` and `Endpoint.metrics`.

Public API: `EndpointPool`, `parse_endpoint`, `parse_metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence

import httpx

from sous.router.framework import ROLE_LABEL, Endpoint, EndpointMetrics
from sous.router.plugins.registry import RouterConfigError

__all__ = ["EndpointPool", "parse_endpoint", "parse_metrics"]

logger = logging.getLogger("sous.router")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_GAUGES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "vllm:kv_cache_usage_perc": "kv_usage"}


def parse_endpoint(text: str, target_ports: Sequence[int] = ()) -> list[Endpoint]:
    """`[role=]http://host:port` -> one Endpoint with the `llm-d.ai/role` label (none: the
    endpoint is unlabelled, which llm-d's decode filter keeps); `[role=]http://host` -> one
    per port of the pool's `target_ports` (a pod's ranks, as llm-d counts endpoints)."""
    role, sep, url = text.partition("=")
    if not sep:
        role, url = "", text
    match = re.match(r"^(https?://[^/\s:]+)(:\d+)?/?$", url)
    if not match:
        raise RouterConfigError(f"--endpoint {text!r}: expected [ROLE=]http://HOST[:PORT]")
    labels = {ROLE_LABEL: role} if role else {}
    if match.group(2):
        return [Endpoint(url=url.rstrip("/"), labels=labels)]
    if not target_ports:
        raise RouterConfigError(f"--endpoint {text!r}: no port, and the config has no "
                                "inference_pool.target_ports")
    return [Endpoint(url=f"{match.group(1)}:{p}", labels=dict(labels)) for p in target_ports]


def parse_metrics(text: str) -> EndpointMetrics:
    """The router's view of one `/metrics` page (Prometheus text format)."""
    m = EndpointMetrics()
    sums = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    kv_engines = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        if name in _GAUGES:
            sums[_GAUGES[name]] += float(value)
            kv_engines += name == "vllm:kv_cache_usage_perc"
        elif name == "vllm:cache_config_info" and labels:
            info = dict(_LABEL.findall(labels))
            if info.get("block_size", "").isdigit():
                m.block_size = int(info["block_size"])
            if info.get("num_gpu_blocks", "").isdigit():
                m.num_blocks = (m.num_blocks or 0) + int(info["num_gpu_blocks"])
    m.waiting, m.running = sums["waiting"], sums["running"]
    m.kv_usage = sums["kv_usage"] / max(kv_engines, 1)
    return m


class EndpointPool:
    def __init__(self, endpoints: Sequence[Endpoint], client: httpx.AsyncClient,
                 interval: float = 0.1) -> None:
        self.endpoints = list(endpoints)
        self.client = client
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy]

    def mark_down(self, endpoint: Endpoint, why: str) -> None:
        if endpoint.healthy:
            logger.warning("endpoint %s is down: %s", endpoint.url, why)
        endpoint.healthy = False

    async def scrape(self, endpoint: Endpoint) -> None:
        try:
            health, metrics = await asyncio.gather(
                self.client.get(endpoint.url + "/health", timeout=2.0),
                self.client.get(endpoint.url + "/metrics", timeout=2.0))
        except httpx.HTTPError as e:
            self.mark_down(endpoint, f"{type(e).__name__}: {e}")
            return
        if health.status_code != 200 or metrics.status_code != 200:
            self.mark_down(endpoint, f"/health {health.status_code}, "
                           f"/metrics {metrics.status_code}")
            return
        parsed = parse_metrics(metrics.text)
        parsed.scraped_at = time.monotonic()
        endpoint.metrics = parsed
        if not endpoint.healthy:
            logger.info("endpoint %s is up", endpoint.url)
        endpoint.healthy = True

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in self.endpoints))

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.scrape_all()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
