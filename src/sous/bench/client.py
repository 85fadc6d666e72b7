"""A light streaming client for OpenAI-compatible servers: raw SSE over aiohttp (the HTTP
client of vLLM's `benchmark_serving`).

Lighter than the `openai` client on purpose: the server under test may share the same few
CPU cores, so the load generator should spend as little CPU as it can. aiohttp's C parser
costs less than half the CPU of httpx for the same streams (16 streams of 128 tokens: 0.10 s
against 0.25 s).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

__all__ = [
    "RequestResult",
    "Target",
    "make_client",
    "normalize_base_url",
    "first_model",
    "run_concurrent",
    "stream_request",
]

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True)
class Target:
    """Where and what to send: one request per prompt, all with the same settings."""

    base_url: str
    """Server root without `/v1` (see `normalize_base_url`)."""
    model: str
    endpoint: Endpoint = "chat"
    max_tokens: int = 128
    ignore_eos: bool = True
    """Sent as vLLM's extra `ignore_eos`, so each request produces `max_tokens` tokens."""
    temperature: float = 0.0
    stream: bool = True
    """Stream (SSE; gives TTFT and ITL) or ask for the whole answer at once."""

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url}/v1/{path}"

    def payload(self, prompt: str) -> dict[str, Any]:
        """The JSON body of one streaming request for `prompt`."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, from just before sending)."""

    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive chunks that carried text."""
    output_tokens: int = 0
    """`usage.completion_tokens`, or the number of text chunks when usage is missing."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens`, when the server reports it."""
    text: str = ""
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmark_serving."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def normalize_base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/`, `http://h:p/v1` -> `http://h:p` (no trailing `/v1`)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def make_client(base_url: str, api_key: str | None, concurrency: int,
                timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A session with enough connections for `concurrency`; proxies are ignored for loopback
    servers. Create it inside the event loop that uses it (`async with make_client(...)`)."""
    host = urlsplit(base_url).hostname or ""
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=30.0),
        connector=aiohttp.TCPConnector(limit=concurrency + 2),
        trust_env=not loopback,
    )


async def first_model(client: aiohttp.ClientSession, base_url: str) -> str:
    """The id of the first model listed by `/v1/models`."""
    async with client.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or delta.get("reasoning_content")
            or delta.get("reasoning") or "")


async def _http_error(resp: aiohttp.ClientResponse, start: float) -> RequestResult:
    """A failed request's result: the status and the start of the body."""
    body = await resp.text(errors="replace")
    return RequestResult(False, time.perf_counter() - start,
                         error=f"HTTP {resp.status}: {body[:300]}")


async def _whole_request(client: aiohttp.ClientSession, target: Target, prompt: str,
                         start: float) -> RequestResult:
    async with client.post(target.url, json=target.payload(prompt)) as resp:
        if resp.status != 200:
            return await _http_error(resp, start)
        obj = await resp.json(content_type=None)
    e2e = time.perf_counter() - start
    usage = obj.get("usage") or {}
    choices = obj.get("choices") or [{}]
    text = (choices[0].get("message") or {}).get("content") if target.endpoint == "chat" \
        else choices[0].get("text")
    return RequestResult(True, e2e, output_tokens=int(usage.get("completion_tokens") or 0),
                         prompt_tokens=usage.get("prompt_tokens"), text=text or "")


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payloads of a response's `data:` lines, as they arrive (stripped bytes), up to
    `[DONE]`. Lines are split here rather than by aiohttp's readline, which caps a line's
    length."""
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield data


async def stream_request(client: aiohttp.ClientSession, target: Target,
                         prompt: str) -> RequestResult:
    """Send one request (streamed unless `target.stream` is false) and time it. Never
    raises for server or network errors: they come back as `ok=False` with `error` set."""
    chat = target.endpoint == "chat"
    start = time.perf_counter()
    ttft: float | None = None
    last = start
    itl: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        if not target.stream:
            return await _whole_request(client, target, prompt, start)
        async with client.post(target.url, json=target.payload(prompt)) as resp:
            if resp.status != 200:
                return await _http_error(resp, start)
            async for data in _sse_data(resp):
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    return RequestResult(False, now - start, error=f"stream error: {obj['error']}")
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or ():
                    piece = _chunk_text(choice, chat)
                    if piece:
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last = now
                        parts.append(piece)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, OSError) as e:
        return RequestResult(False, time.perf_counter() - start,
                             error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - start
    tokens = usage.get("completion_tokens") if usage else None
    return RequestResult(
        ok=True, e2e_s=e2e, ttft_s=ttft, itl_s=itl,
        output_tokens=int(tokens) if tokens is not None else len(parts),
        prompt_tokens=usage.get("prompt_tokens") if usage else None,
        cached_tokens=((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
        text="".join(parts),
    )


async def run_concurrent(client: aiohttp.ClientSession, target: Target, prompts: Sequence[str],
                         concurrency: int) -> tuple[list[RequestResult], float]:
    """Send one request per prompt, at most `concurrency` in flight; returns the results
    (in prompt order) and the wall time in seconds from first send to last answer."""
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> RequestResult:
        async with sem:
            return await stream_request(client, target, prompt)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - start
