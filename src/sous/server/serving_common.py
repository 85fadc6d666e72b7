"""What /v1/completions and /v1/chat/completions share: model check, length validation,
request logging, the merged engine stream (with abort-on-close and metrics), client
disconnect detection, SSE framing, usage and logprobs formatting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sous.config.server import ServerConfig
from sous.engine.errors import EngineDeadError, RequestValidationError
from sous.engine.outputs import Logprob, RequestOutput
from sous.engine.sampling_params import SamplingParams
from sous.engine.validation import resolve_max_tokens as _resolve_max_tokens
from sous.server.errors import APIError, bad_request, model_not_found
from sous.server.guard import ServerState
from sous.server.limits import PromptBound, check_num_seqs
from sous.server.metrics import RequestMetrics, ServerMetrics

logger = logging.getLogger("sous.server")

_T = TypeVar("_T")
_LOGPROB_FLOOR = -9999.0

try:  # orjson is optional; json.dumps is the fallback
    import orjson

    def dumps(obj: Any) -> str:
        return orjson.dumps(obj).decode()
except ImportError:  # pragma: no cover - depends on the environment
    dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass
class ServingContext:
    """Everything a serving handler needs about the engine and the server."""

    engine: Any
    config: ServerConfig
    metrics: ServerMetrics
    state: ServerState = field(default_factory=ServerState)
    prompt_bound: PromptBound | None = None
    """Set in __post_init__ from the engine's tokenizer."""

    def __post_init__(self) -> None:
        if self.prompt_bound is None:
            self.prompt_bound = PromptBound(self.engine.tokenizer)

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served model name (None means the served model)."""
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def check_num_seqs(self, n: int, num_prompts: int = 1) -> None:
        """400 when a request would add more sequences than `--max-num-seqs`."""
        check_num_seqs(n, num_prompts, getattr(self.engine, "max_num_seqs", 256))

    def check_prompt_text(self, text: str, requested: int | None) -> None:
        """400 when `text` surely cannot fit in max_model_len (a cheap bound; call it before
        tokenizing, and `resolve_max_tokens` on the exact count after)."""
        assert self.prompt_bound is not None
        self.prompt_bound.check(text, requested, self.max_model_len)

    def log_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams) -> None:
        if not self.config.enable_log_requests or not logger.isEnabledFor(logging.INFO):
            return
        limit = self.config.max_log_len
        shown_prompt = prompt[:limit] if (prompt is not None and limit is not None) else prompt
        shown_ids = prompt_ids[:limit] if limit is not None else prompt_ids
        logger.info("Received request %s: prompt: %r, prompt_len: %d, params: %s, "
                    "prompt_token_ids: %s", request_id, shown_prompt, len(prompt_ids), params,
                    shown_ids)


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int) -> int:
    """vLLM's context-length check (`sous.engine.validation`, the same rule the engine
    applies); returns the max_tokens to use (default: all the room). 400 otherwise."""
    try:
        return _resolve_max_tokens(prompt_len, requested, max_model_len)
    except RequestValidationError as e:
        raise APIError(str(e), 400, e.param) from None


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams, with its ValueErrors turned into 400s."""
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e)) from None


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class EngineJob:
    """One engine request behind an API request (one per prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


class EngineStream:
    """The merged DELTA outputs of an API request's engine jobs, as `(job_index, output)`.

    `aclose()` (always called, also on error, cancellation or disconnect) stops every job
    that has not finished, so the engine frees its KV blocks, and records metrics.
    """

    def __init__(self, ctx: ServingContext, jobs: list[EngineJob]) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.cached_tokens = [0] * len(jobs)
        self.kv_transfer_params: dict[str, Any] | None = None
        """A finished job's KV connector parameters (the P/D prefill leg's answer)."""
        self.finished = [False] * len(jobs)
        self.errored = False
        self._reasons: list[dict[int, str]] = [{} for _ in jobs]
        self._metrics: list[RequestMetrics] = [
            ctx.metrics.start(len(j.prompt_token_ids)) for j in jobs]
        self._gens = [ctx.engine.generate(j.prompt_token_ids, j.params, j.request_id, j.prompt)
                      for j in jobs]
        self._iter = self._single() if len(jobs) == 1 else self._merged()

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        try:
            i, out = await self._iter.__anext__()
        except StopAsyncIteration:
            raise
        except Exception:
            self.errored = True  # rejected or failed: not a served request in the metrics
            raise
        self.cached_tokens[i] = out.num_cached_tokens
        self._metrics[i].cached(out.num_cached_tokens, out.num_external_computed_tokens)
        n_new = 0
        for c in out.outputs:
            n_new += len(c.token_ids)
            if c.finish_reason is not None:
                self._reasons[i][c.index] = c.finish_reason
        self._metrics[i].tokens(n_new)
        if out.finished:
            self.kv_transfer_params = out.kv_transfer_params or self.kv_transfer_params
            self.finished[i] = True
            self._metrics[i].finish(list(self._reasons[i].values()))
        return i, out

    async def _single(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for out in self._gens[0]:
            yield 0, out

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        done = object()

        async def pump(i: int) -> None:
            try:
                async for out in self._gens[i]:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, done))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self._gens))]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._iter.aclose()  # type: ignore[attr-defined]
        for i, gen in enumerate(self._gens):
            with contextlib.suppress(Exception):
                await gen.aclose()
            if not self.finished[i]:
                n = self.jobs[i].params.n
                if not self.errored:
                    self._metrics[i].finish([self._reasons[i].get(k, "abort") for k in range(n)])
                with contextlib.suppress(Exception):
                    await self.ctx.engine.abort(self.jobs[i].request_id)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[_T]) -> _T:
    """Await `work`, cancelling it and raising ClientDisconnected if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def first_output(request: Request, stream: EngineStream,
                       ) -> tuple[int, RequestOutput] | None:
    """The stream's first output (so request errors still become proper 4xx responses).

    Closes the stream and raises on errors or client disconnect; None if it was empty.
    """
    try:
        return await until_disconnect(request, stream.__anext__())
    except StopAsyncIteration:
        return None
    except BaseException:
        await stream.aclose()
        raise


class SSEResponse(StreamingResponse):
    """`text/event-stream`; the body generator is always closed, so the engine aborts."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def respond(request: Request, stream: EngineStream, run: Any, want_stream: bool) -> Response:
    """Wait for the first engine output (so request errors still get their status), then
    either stream SSE (`run.stream(first, stream)`) or collect one JSON body
    (`run.collect(first, stream)`). A disconnected client gets 499 and its requests aborted."""
    try:
        first = await first_output(request, stream)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        return engine_error(e).response()
    if want_stream:
        return SSEResponse(run.stream(first, stream))
    try:
        body = await until_disconnect(request, run.collect(first, stream))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        return engine_error(e).response()
    finally:
        await stream.aclose()
    return JSONResponse(body)


def engine_error(e: BaseException) -> APIError:
    """Map an engine exception to an API error: ValueError -> 400, EngineDeadError -> 503,
    anything else -> 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestValidationError):
        return APIError(str(e), 400, e.param)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503)
    logger.error("Engine error", exc_info=e)
    return APIError(f"Internal server error: {type(e).__name__}: {e}", 500)


# ---- logprobs ----------------------------------------------------------------------------

def _decoded(tokenizer: Any, token_id: int, lp: Logprob) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    items = sorted(entry.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
    return items[:k]


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  top_n: int) -> list[dict]:
    """OpenAI chat `logprobs.content` entries: {token, logprob, bytes, top_logprobs}."""
    content = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        lp = entry.get(tid)
        tok = _decoded(tokenizer, tid, lp) if lp else tokenizer.decode([tid])
        tops = []
        for t, tlp in _top(entry, top_n):
            s = _decoded(tokenizer, t, tlp)
            tops.append({"token": s, "logprob": max(tlp.logprob, _LOGPROB_FLOOR),
                         "bytes": list(s.encode("utf-8"))})
        content.append({"token": tok,
                        "logprob": max(lp.logprob, _LOGPROB_FLOOR) if lp else _LOGPROB_FLOOR,
                        "bytes": list(tok.encode("utf-8")), "top_logprobs": tops})
    return content


def completion_logprobs(tokenizer: Any, token_ids: list[int],
                        logprobs: list[dict[int, Logprob]], top_n: int,
                        offset: int) -> tuple[dict, int]:
    """Legacy completion logprobs {tokens, token_logprobs, top_logprobs, text_offset}.

    `top_logprobs[i]` maps the sampled token and the `top_n` most likely ones to their
    logprobs (as vLLM). Returns the dict and the text offset after the last token.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        lp = entry.get(tid)
        tok = _decoded(tokenizer, tid, lp) if lp else tokenizer.decode([tid])
        tokens.append(tok)
        token_lps.append(max(lp.logprob, _LOGPROB_FLOOR) if lp else _LOGPROB_FLOOR)
        top = {tok: token_lps[-1]}
        for t, tlp in _top(entry, top_n):
            top.setdefault(_decoded(tokenizer, t, tlp), max(tlp.logprob, _LOGPROB_FLOOR))
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return ({"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
             "top_logprobs": tops}, offset)
