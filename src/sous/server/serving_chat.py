"""POST /v1/chat/completions, as vLLM's OpenAI server serves it.

Response: `{"id": "chatcmpl-<hex>", "object": "chat.completion", "created", "model",
"choices": [{"index", "message": {"role", "content", ...}, "logprobs", "finish_reason",
"stop_reason"}], "usage", "prompt_logprobs": null}`. Streaming: `chat.completion.chunk`s, the
first per choice with `delta = {"role": "assistant", "content": ""}`, then content deltas;
the last per choice carries `finish_reason`; then a usage chunk with empty `choices` when
`stream_options.include_usage`; then `data: [DONE]`.

With `--reasoning-parser` and/or tool calls (`tool_choice` "auto" with
`--enable-auto-tool-choice --tool-call-parser`, "required", or a named function) each choice's
text goes through a `ChatOutputParser` (`sous.server.tool_parsers.chat_output`): messages get
`reasoning` (and its alias `reasoning_content`), `content` (text before the first call, or
null) and `tool_calls`; deltas carry the same as fragments; `finish_reason` becomes
"tool_calls" when calls were made (see `ChatParsing.finish_reason`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sous.engine.outputs import CompletionOutput, RequestOutput
from sous.engine.sampling_params import RequestOutputKind
from sous.server.errors import APIError, bad_request
from sous.server.protocol import ChatCompletionRequest, ChatMessage, TextPart, parse_request
from sous.server.serving_common import (
    EngineJob,
    EngineStream,
    ServingContext,
    chat_logprobs,
    dumps,
    engine_error,
    make_sampling_params,
    resolve_max_tokens,
    respond,
    usage_dict,
)
from sous.server.structured_request import structured_outputs_for, tool_choice_schema
from sous.server.tool_parsers.chat_output import ChatParsing

_RESERVED_TEMPLATE_KWARGS = ("tokenize", "chat_template", "return_dict", "conversation")


def message_to_template(m: ChatMessage) -> dict[str, Any]:
    """An API message as the chat template sees it (text parts joined with newlines)."""
    content = m.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for part in content:
            if isinstance(part, TextPart):
                texts.append(part.text)
            else:
                kind = part.get("type")
                raise APIError(f"Content part type {kind!r} is not supported yet.", 400,
                               "messages")
        text = "\n".join(texts)
    msg: dict[str, Any] = {"role": m.role, "content": text}
    for key in ("name", "tool_calls", "tool_call_id"):
        value = getattr(m, key)
        if value is not None:
            msg[key] = value
    msg.update(m.model_extra or {})
    if m.role == "assistant" and m.tool_calls:
        msg["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    return msg


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A history tool call with its JSON `arguments` string parsed to a dict (what tool-use
    chat templates expect, as vLLM does); empty arguments become {}."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    args = function.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            raise bad_request(f"Tool call arguments are not valid JSON: {args!r}",
                              "messages") from None
    return {**call, "function": {**function, "arguments": args or {}}}


class ChatServing:
    """Handler of /v1/chat/completions."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def render(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """Apply the chat template; returns (prompt text, prompt token ids)."""
        messages = [message_to_template(m) for m in req.messages]
        kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt,
                                  "continue_final_message": req.continue_final_message}
        if req.tools:
            kwargs["tools"] = req.tools
        for key, value in (req.chat_template_kwargs or {}).items():
            if key not in _RESERVED_TEMPLATE_KWARGS:
                kwargs[key] = value
        tok = self.ctx.tokenizer
        try:
            prompt = tok.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors (e.g. raise_exception in the template) -> 400
            raise bad_request(f"Chat template error: {e}", "messages") from None
        self.ctx.check_prompt_text(prompt, req.requested_max_tokens)
        ids = list(tok.encode(prompt, add_special_tokens=req.add_special_tokens))
        if not ids:
            raise bad_request("The rendered prompt is empty.", "messages")
        return prompt, ids

    def output_parsing(self, req: ChatCompletionRequest) -> ChatParsing | None:
        """What to parse out of the outputs (reasoning, tool calls); None: plain content.

        400 for `tool_choice` "auto" (explicit, or the default with tools) unless the server
        runs with --enable-auto-tool-choice and --tool-call-parser. May turn
        `req.skip_special_tokens` off when the tool format's tags are special tokens."""
        cfg = self.ctx.config
        choice = req.effective_tool_choice
        if choice == "auto" and req.tools and not (cfg.enable_auto_tool_choice
                                                   and cfg.tool_call_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              '--tool-call-parser to be set', "tool_choice")
        parsing = ChatParsing.for_request(cfg.reasoning_parser, cfg.tool_call_parser, choice,
                                          req.tools, req.chat_template_kwargs)
        if parsing is not None and parsing.needs_special_tokens:
            req.skip_special_tokens = False
        return parsing

    async def handle(self, request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await request.body())
        self.ctx.check_model(req.model)
        req.check()
        self.ctx.check_num_seqs(req.n)
        parsing = self.output_parsing(req)
        structured = await structured_outputs_for(
            self.ctx.engine, req, tool_choice_schema(req.effective_tool_choice, req.tools))
        prompt, ids = self.render(req)
        max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens,
                                        self.ctx.max_model_len)
        params = make_sampling_params(
            max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            output_kind=RequestOutputKind.DELTA, structured_outputs=structured,
            **req.sampling_kwargs())
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.ctx.log_request(request_id, prompt, ids, params)
        stream = EngineStream(self.ctx, [EngineJob(request_id, ids, params, prompt)])
        role = self.ctx.config.response_role if req.add_generation_prompt else req.messages[-1].role
        run = _ChatRun(self.ctx, req, request_id, len(ids), role, parsing)
        return await respond(request, stream, run, bool(req.stream))


class _ChatRun:
    """Turns one chat request's engine outputs into the response (full or streamed)."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str,
                 prompt_len: int, role: str, parsing: ChatParsing | None = None) -> None:
        self.ctx = ctx
        self.parsing = parsing
        self.parsers = None if parsing is None else [parsing.new() for _ in range(req.n)]
        self.req = req
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.role = role
        self.created = int(time.time())
        n = req.n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.num_tokens = [0] * n
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        self.top_n = (req.top_logprobs or 0) if req.logprobs else None
        self.head = (f'data: {{"id":"{request_id}","object":"chat.completion.chunk",'
                     f'"created":{self.created},"model":{dumps(ctx.model_name)},"choices":[')

    def _update(self, c: CompletionOutput) -> list[dict] | None:
        self.num_tokens[c.index] += len(c.token_ids)
        if c.finish_reason is not None:
            self.finish[c.index] = (c.finish_reason, c.stop_reason)
        if self.top_n is None:
            return None
        return chat_logprobs(self.ctx.tokenizer, c.token_ids, c.logprobs or [], self.top_n)

    def _usage(self, stream: EngineStream) -> dict:
        return usage_dict(self.prompt_len, sum(self.num_tokens), stream.cached_tokens[0])

    async def collect(self, first: tuple[int, RequestOutput] | None,
                      stream: EngineStream) -> dict:
        """The whole non-streaming response body."""
        outs = [] if first is None else [first[1]]
        async for _, out in stream:
            outs.append(out)
        for out in outs:
            for c in out.outputs:
                lps = self._update(c)
                self.texts[c.index].append(c.text)
                if lps:
                    self.logprobs[c.index].extend(lps)
        choices = []
        for i in range(self.req.n):
            message, finish_reason = self._message("".join(self.texts[i]), self.finish[i][0])
            logprobs = None if self.top_n is None else {"content": self.logprobs[i]}
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": finish_reason, "stop_reason": self.finish[i][1]})
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices, "usage": self._usage(stream),
                "prompt_logprobs": None, "kv_transfer_params": stream.kv_transfer_params}

    def _message(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """A non-streamed choice's message and finish_reason."""
        message: dict[str, Any] = {
            "role": self.role, "content": text, "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "tool_calls": [], "reasoning": None,
            "reasoning_content": None}
        if self.parsing is None:
            return message, engine_reason
        parsed, called = self.parsing.parse(text)
        message["content"] = parsed.content
        message["reasoning"] = message["reasoning_content"] = parsed.reasoning
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message, self.parsing.finish_reason(engine_reason, called)

    def _delta(self, c: CompletionOutput) -> tuple[dict, str | None]:
        """A streamed output's `delta` and finish_reason ({} delta: nothing to send yet)."""
        if self.parsers is None or self.parsing is None:
            return {"content": c.text}, c.finish_reason
        parser = self.parsers[c.index]
        msg = parser.feed(c.text, final=c.finish_reason is not None)
        delta = msg.to_openai() if msg else {}
        return delta, self.parsing.finish_reason(c.finish_reason, parser.called)

    def _event(self, choice: dict, completion_tokens: int, cached: int) -> str:
        if not self.req.continuous_usage:
            return self.head + dumps(choice) + "]}\n\n"
        usage = usage_dict(self.prompt_len, completion_tokens, cached)
        return self.head + dumps(choice) + '],"usage":' + dumps(usage) + "}\n\n"

    def _chunks(self, out: RequestOutput) -> str:
        parts = []
        for c in out.outputs:
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            lps = self._update(c)
            delta, finish_reason = self._delta(c)
            if not delta and lps is None and finish_reason is None:
                continue
            choice: dict[str, Any] = {
                "index": c.index, "delta": delta or {"content": ""},
                "logprobs": None if lps is None else {"content": lps},
                "finish_reason": finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            parts.append(self._event(choice, self.num_tokens[c.index], out.num_cached_tokens))
        return "".join(parts)

    async def stream(self, first: tuple[int, RequestOutput] | None,
                     stream: EngineStream) -> AsyncIterator[str]:
        """SSE events of the streaming response; closing it aborts unfinished engine work."""
        try:
            cached = first[1].num_cached_tokens if first is not None else 0
            yield "".join(self._event(
                {"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                 "finish_reason": None}, 0, cached) for i in range(self.req.n))
            if first is not None:
                text = self._chunks(first[1])
                if text:
                    yield text
                async for _, out in stream:
                    text = self._chunks(out)
                    if text:
                        yield text
            if self.req.include_usage:
                yield "data: " + dumps({
                    "id": self.request_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.ctx.model_name, "choices": [],
                    "usage": self._usage(stream)}) + "\n\n"
        except Exception as e:
            yield engine_error(e).sse()
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"
