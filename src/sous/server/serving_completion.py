"""POST /v1/completions (legacy text completions), as vLLM's OpenAI server serves it.

Response: `{"id": "cmpl-<hex>", "object": "text_completion", "created", "model",
"choices": [{"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_logprobs"}],
"usage"}`. With several prompts, choice `index` = prompt_index * n + choice. Streaming sends
one `text_completion` chunk per choice update, a usage chunk with empty `choices` when
`stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sous.engine.outputs import CompletionOutput, RequestOutput
from sous.engine.sampling_params import RequestOutputKind
from sous.server.errors import bad_request
from sous.server.protocol import CompletionRequest, parse_request
from sous.server.serving_common import (
    EngineJob,
    EngineStream,
    ServingContext,
    completion_logprobs,
    dumps,
    engine_error,
    make_sampling_params,
    resolve_max_tokens,
    respond,
    usage_dict,
)
from sous.server.structured_request import structured_outputs_for


@dataclass
class _Choice:
    """Accumulated state of one output choice."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    offset: int = 0
    logprobs: dict[str, list] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


class CompletionServing:
    """Handler of /v1/completions."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def handle(self, request: Request) -> Response:
        req = parse_request(CompletionRequest, await request.body())
        self.ctx.check_model(req.model)
        req.check()
        structured = await structured_outputs_for(self.ctx.engine, req)
        prompts = self._prompts(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = []
        for i, (text, ids) in enumerate(prompts):
            max_tokens = resolve_max_tokens(len(ids), req.max_tokens, self.ctx.max_model_len)
            params = make_sampling_params(
                max_tokens=max_tokens, logprobs=req.logprobs,
                output_kind=RequestOutputKind.DELTA, structured_outputs=structured,
                **req.sampling_kwargs())
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            self.ctx.log_request(sub_id, text, ids, params)
            jobs.append(EngineJob(sub_id, ids, params, text))
        stream = EngineStream(self.ctx, jobs)
        run = _Run(self.ctx, req, request_id, prompts)
        return await respond(request, stream, run, bool(req.stream))

    def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt."""
        tok = self.ctx.tokenizer
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        out: list[tuple[str | None, list[int]]] = []
        self.ctx.check_num_seqs(req.n, len(items))
        for item in items:
            if isinstance(item, str):
                self.ctx.check_prompt_text(item, req.max_tokens)
                ids = list(tok.encode(item, add_special_tokens=req.add_special_tokens))
                out.append((item, ids))
            else:
                out.append((None, list(item)))
            if not out[-1][1]:
                raise bad_request("Prompt cannot be empty.", "prompt")
        return out


class _Run:
    """Turns one request's engine outputs into the response (full or streamed)."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str,
                 prompts: list[tuple[str | None, list[int]]]) -> None:
        self.ctx = ctx
        self.req = req
        self.n = req.n
        self.prompts = prompts
        self.choices = [_Choice() for _ in range(len(prompts) * req.n)]
        if req.logprobs is not None:
            for ch in self.choices:
                ch.logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [],
                               "top_logprobs": []}
        self.created = int(time.time())
        self.request_id = request_id
        self.head = (f'data: {{"id":"{request_id}","object":"text_completion",'
                     f'"created":{self.created},"model":{dumps(ctx.model_name)},"choices":[')

    def _echo(self, prompt_index: int) -> str:
        text, ids = self.prompts[prompt_index]
        return text if text is not None else self.ctx.tokenizer.decode(ids)

    def _update(self, prompt_index: int, c: CompletionOutput) -> tuple[int, _Choice, str, Any]:
        """Fold an output delta into its choice; returns (index, choice, delta text, logprobs)."""
        index = prompt_index * self.n + c.index
        ch = self.choices[index]
        text = c.text
        if not ch.started:
            ch.started = True
            if self.req.echo:
                text = self._echo(prompt_index) + text
        ch.num_tokens += len(c.token_ids)
        lp = None
        if self.req.logprobs is not None and c.logprobs:
            lp, ch.offset = completion_logprobs(self.ctx.tokenizer, c.token_ids, c.logprobs,
                                                self.req.logprobs, ch.offset)
        if c.finish_reason is not None:
            ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        return index, ch, text, lp

    def _usage(self, stream: EngineStream) -> dict:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(ch.num_tokens for ch in self.choices)
        return usage_dict(prompt, completion, sum(stream.cached_tokens))

    async def collect(self, first: tuple[int, RequestOutput] | None,
                      stream: EngineStream) -> dict:
        """The whole non-streaming response body."""
        if first is not None:
            self._fold(*first)
            async for i, out in stream:
                self._fold(i, out)
        choices = []
        for index, ch in enumerate(self.choices):
            choices.append({"index": index, "text": "".join(ch.text),
                            "logprobs": ch.logprobs, "finish_reason": ch.finish_reason,
                            "stop_reason": ch.stop_reason, "prompt_logprobs": None})
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices, "usage": self._usage(stream),
                "kv_transfer_params": stream.kv_transfer_params}

    def _fold(self, i: int, out: RequestOutput) -> None:
        for c in out.outputs:
            _, ch, text, lp = self._update(i, c)
            ch.text.append(text)
            if lp is not None and ch.logprobs is not None:
                for key, values in lp.items():
                    ch.logprobs[key].extend(values)

    def _chunks(self, i: int, out: RequestOutput) -> str:
        parts = []
        for c in out.outputs:
            pending_echo = self.req.echo and not self.choices[i * self.n + c.index].started
            if not (c.text or c.token_ids or c.finish_reason is not None or pending_echo):
                continue
            index, ch, text, lp = self._update(i, c)
            choice = {"index": index, "text": text, "logprobs": lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            tail = "]}\n\n"
            if self.req.continuous_usage:
                usage = usage_dict(len(self.prompts[i][1]), ch.num_tokens,
                                   out.num_cached_tokens)
                tail = ',"usage":'.join(("]", dumps(usage))) + "}\n\n"
            parts.append(self.head + dumps(choice) + tail)
        return "".join(parts)

    async def stream(self, first: tuple[int, RequestOutput] | None,
                     stream: EngineStream) -> AsyncIterator[str]:
        """SSE events of the streaming response; closing it aborts unfinished engine work."""
        try:
            if first is not None:
                text = self._chunks(*first)
                if text:
                    yield text
                async for i, out in stream:
                    text = self._chunks(i, out)
                    if text:
                        yield text
            if self.req.include_usage:
                yield "data: " + dumps({
                    "id": self.request_id, "object": "text_completion", "created": self.created,
                    "model": self.ctx.model_name, "choices": [],
                    "usage": self._usage(stream)}) + "\n\n"
        except Exception as e:
            yield engine_error(e).sse()
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"
