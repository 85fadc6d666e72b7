"""Carrying one OpenAI request through the picked endpoints (llm-d's EPP + P/D sidecar).

Disaggregated (the prefill profile ran): the prefill leg goes to the prefill endpoint with
`kv_transfer_params = {do_remote_decode: true, ...}`, `stream: false`, `max_tokens: 1` (and
`max_completion_tokens: 1` if set), without `stream_options`, `min_tokens` and
`min_completion_tokens`; its answer's `kv_transfer_params` go into the original body, which
is sent to the decode endpoint and streamed back as it comes. Both legs carry the same
`X-Request-Id` and the client's `Authorization`.

Retries: a leg that cannot connect, or gets 502/503/504, is re-sent to the next endpoint of
the same profile (best score first); the endpoint is marked down until its next good scrape.
Any other answer (a 400 included) goes back to the client as it is.

FailOpen (`inference_pool.failure_mode`): when picking fails or every prefill endpoint
fails, the whole request goes to the decode endpoint (or any healthy endpoint) and is
answered there; FailClose answers 503 instead.

Each answer names the endpoint that produced it in the response header
`x-gateway-destination-endpoint` (`host:port`, llm-d's destination key), and a disaggregated
one its prefill endpoint in `x-prefiller-host-port` (the header llm-d's sidecar reads).

Public API: `Proxy`, `PREFILL_PARAMS`.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sous.router.config import RouterConfig
from sous.router.framework import Endpoint, RouterRequest, SchedulingError, SchedulingResult
from sous.router.metrics import RouterMetrics
from sous.router.pool import EndpointPool
from sous.router.prompt import PromptTokenizer
from sous.router.scheduler import RouterScheduler
from sous.server.errors import error_body

__all__ = ["PREFILL_PARAMS", "Proxy"]

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
RETRY_STATUSES = frozenset({502, 503, 504})
_FORWARD_HEADERS = ("authorization",)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body (see the module docstring)."""
    leg = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        leg.pop(key, None)
    return leg


@dataclass
class _PrefillOutcome:
    """A prefill leg's result: the `kv_transfer_params` and the endpoint that gave them;
    or why there are none; or an answer to pass to the client as it is."""

    params: dict[str, Any] | None = None
    endpoint: Endpoint | None = None
    why: str = ""
    response: Response | None = None


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


class Proxy:
    def __init__(self, config: RouterConfig, pool: EndpointPool, tokenizer: PromptTokenizer,
                 metrics: RouterMetrics, client: httpx.AsyncClient) -> None:
        self.config = config
        self.scheduler = RouterScheduler(config)
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.client = client
        self.fail_open = config.failure_mode == "FailOpen"

    def _request(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> RouterRequest:
        salt = body.get("cache_salt")
        return RouterRequest(request_id=headers.get("x-request-id") or str(uuid.uuid4()),
                             path=path, body=body, token_ids=self.tokenizer.token_ids(path, body),
                             model=str(body.get("model", "")),
                             cache_salt=salt if isinstance(salt, str) else None)

    def _headers(self, request: RouterRequest, headers: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in headers.items() if k in _FORWARD_HEADERS}
        out["x-request-id"] = request.request_id
        return out

    def _order(self, result: SchedulingResult, profile: str) -> list[Endpoint]:
        """The profile's pick first, then its other candidates, best score first."""
        picked = result.results[profile]
        by_url = {e.url: e for e in self.pool.endpoints}
        rest = sorted((u for u in picked.scores if u not in {t.url for t in picked.targets}),
                      key=lambda u: -picked.scores[u])
        return [*picked.targets, *(by_url[u] for u in rest)]

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        request = self._request(path, body, headers)
        fwd = self._headers(request, headers)
        try:
            result, _ = self.scheduler.schedule(request, self.pool.healthy())
        except SchedulingError as e:
            return await self._fail_open(request, fwd, str(e))
        decode = self._order(result, result.primary)
        if "prefill" in result.failed:
            prefill = _PrefillOutcome(why=result.failed["prefill"])
        elif result.endpoint("prefill") is not None:
            prefill = await self._prefill(path, body, fwd, self._order(result, "prefill"))
        else:
            self.metrics.decisions["decode-only"] += 1
            return await self._send(path, body, fwd, decode, result.primary)
        if prefill.response is not None:
            return prefill.response  # the prefill endpoint's own error (e.g. a 400)
        if prefill.params is None or prefill.endpoint is None:
            if not self.fail_open:
                self.metrics.decisions["rejected"] += 1
                return _error(f"No prefill endpoint could serve the request: {prefill.why}", 503)
            self.metrics.decisions["fail-open"] += 1
            return await self._send(path, body, fwd, decode, "fail-open")
        self.metrics.decisions["disaggregated"] += 1
        return await self._send(path, {**body, "kv_transfer_params": prefill.params}, fwd,
                                decode, result.primary,
                                {"x-prefiller-host-port": prefill.endpoint.host_port})

    async def _fail_open(self, request: RouterRequest, fwd: dict[str, str], why: str) -> Response:
        healthy = self.pool.healthy()
        if not self.fail_open or not healthy:
            self.metrics.decisions["rejected"] += 1
            return _error(f"No endpoint can serve the request: {why}", 503)
        self.metrics.decisions["fail-open"] += 1
        random.shuffle(healthy)
        return await self._send(request.path, request.body, fwd, healthy, "fail-open")

    async def _prefill(self, path: str, body: dict[str, Any], fwd: dict[str, str],
                       targets: Sequence[Endpoint]) -> _PrefillOutcome:
        """The prefill leg on the first of `targets` that answers (see the module docstring)."""
        leg, why = prefill_body(body), "no prefill endpoint"
        for i, endpoint in enumerate(targets):
            if i:
                self.metrics.retries["prefill"] += 1
            self.metrics.requests[(endpoint.url, "prefill")] += 1
            try:
                r = await self.client.post(endpoint.url + path, json=leg, headers=fwd)
            except httpx.TransportError as e:
                why = f"{endpoint.url}: {type(e).__name__}"
                self.pool.mark_down(endpoint, why)
                continue
            if r.status_code in RETRY_STATUSES:
                why = f"{endpoint.url}: HTTP {r.status_code}"
                self.pool.mark_down(endpoint, why)
                continue
            if r.status_code != 200:
                return _PrefillOutcome(response=Response(
                    r.content, r.status_code, media_type=r.headers.get("content-type")))
            params = r.json().get("kv_transfer_params")
            if not params:
                return _PrefillOutcome(why=f"{endpoint.url} returned no kv_transfer_params")
            return _PrefillOutcome(params=params, endpoint=endpoint)
        return _PrefillOutcome(why=why)

    async def _send(self, path: str, body: dict[str, Any], fwd: dict[str, str],
                    targets: Sequence[Endpoint], profile: str,
                    headers: dict[str, str] | None = None) -> Response:
        """Stream the first answer that is not a connection error or 502/503/504."""
        why = "no endpoint"
        for i, endpoint in enumerate(targets):
            if i:
                self.metrics.retries["decode"] += 1
            self.metrics.requests[(endpoint.url, profile)] += 1
            req = self.client.build_request("POST", endpoint.url + path, json=body, headers=fwd)
            try:
                upstream = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                why = f"{endpoint.url}: {type(e).__name__}"
                self.pool.mark_down(endpoint, why)
                continue
            if upstream.status_code in RETRY_STATUSES:
                await upstream.aclose()
                why = f"{endpoint.url}: HTTP {upstream.status_code}"
                self.pool.mark_down(endpoint, why)
                continue
            out = {**(headers or {}), "x-gateway-destination-endpoint": endpoint.host_port}
            return StreamingResponse(_relay(upstream), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type"),
                                     headers=out)
        return _error(f"No endpoint could serve the request: {why}", 503)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream body as it arrives; closing it (client gone) closes the upstream, so
    the model server aborts the request and frees its KV blocks."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.TransportError:
        return  # the endpoint died mid-answer: the client sees the stream end
    finally:
        await upstream.aclose()
