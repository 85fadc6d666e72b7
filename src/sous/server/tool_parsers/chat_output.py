"""One chat choice's output, parsed as it streams: reasoning first, then tool calls in the
content part. Used the same way for streamed (feed each delta) and non-streamed (feed the
whole text) responses, so both agree exactly.

`ChatParsing.for_request(...)` decides, once per request, what applies (the server's
`--reasoning-parser`, and the request's `tool_choice`: "auto" with `--tool-call-parser`,
"required", a named function, or none) and makes one `ChatOutputParser` per choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sous.server import reasoning as reasoning_parsers
from sous.server import tool_parsers
from sous.server.reasoning.base import ReasoningParser, ReasoningStream
from sous.server.tool_parsers.base import ToolCall, ToolCallDelta, ToolDelta, ToolStream, assemble
from sous.server.tool_parsers.forced import NamedToolStream, RequiredToolStream


@dataclass
class DeltaMessage:
    """What one piece of output adds: reasoning text, content text, call fragments."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def to_openai(self) -> dict[str, Any]:
        """The chunk's `delta` (only what is present; reasoning under both names)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        if self.content or not self:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out


class ChatOutputParser:
    """Per-choice state: `feed(delta_text)` / `finish()` -> DeltaMessage."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.called = False
        """Whether any tool call has been emitted."""

    def feed(self, text: str, final: bool = False) -> DeltaMessage:
        """The next piece of output text; `final`: it is the last one (flush everything)."""
        if self.reasoning is None:
            r, c = "", text
        else:
            r, c = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                r, c = r + r2, c + c2
        return self._tools(r, c, final)

    def finish(self) -> DeltaMessage:
        return self.feed("", final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> DeltaMessage:
        if self.tools is None:
            return DeltaMessage(reasoning, content)
        delta = self.tools.feed(content) if content else ToolDelta()
        if final:
            delta.extend(self.tools.finish())
        self.called = self.called or bool(delta.tool_calls)
        return DeltaMessage(reasoning, delta.content, delta.tool_calls)


@dataclass
class FullMessage:
    """A non-streamed choice: reasoning and content (None when absent), the calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ChatParsing:
    """What applies to one request's outputs."""

    reasoning: ReasoningParser | None
    tool_choice: str | dict[str, Any]
    """Effective choice: "none" | "auto" (with a parser) | "required" | named dict."""
    tool_parser: tool_parsers.ToolParser | None
    tools: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any] | None

    @classmethod
    def for_request(cls, reasoning_parser: str | None, tool_call_parser: str | None,
                    tool_choice: str | dict[str, Any], tools: list[dict[str, Any]] | None,
                    chat_template_kwargs: dict[str, Any] | None) -> ChatParsing | None:
        """None when the output is plain content (nothing to parse)."""
        reasoning = reasoning_parsers.get(reasoning_parser) if reasoning_parser else None
        parser = None
        if tool_choice == "auto" and tools and tool_call_parser:
            parser = tool_parsers.get(tool_call_parser)
        elif not tools or tool_choice in ("none", "auto"):
            tool_choice = "none"
        if reasoning is None and tool_choice == "none":
            return None
        return cls(reasoning, tool_choice, parser, tools, chat_template_kwargs)

    @property
    def named(self) -> bool:
        return isinstance(self.tool_choice, dict)

    @property
    def needs_special_tokens(self) -> bool:
        """The tool format's tags are special tokens (detokenize them)."""
        return self.tool_parser is not None and self.tool_parser.needs_special_tokens

    def new(self) -> ChatOutputParser:
        """A fresh per-choice parser."""
        reasoning = (self.reasoning.stream(self.chat_template_kwargs)
                     if self.reasoning is not None else None)
        tools: ToolStream | None = None
        if self.tool_parser is not None:
            tools = self.tool_parser.stream(self.tools)
        elif self.tool_choice == "required":
            tools = RequiredToolStream()
        elif isinstance(self.tool_choice, dict):
            tools = NamedToolStream(self.tool_choice["function"]["name"])
        return ChatOutputParser(reasoning, tools)

    def parse(self, text: str) -> tuple[FullMessage, bool]:
        """Non-streamed: the message parts and whether tools were called."""
        parser = self.new()
        deltas = [parser.feed(text), parser.finish()]
        reasoning = "".join(d.reasoning for d in deltas) or None
        content, calls = assemble([ToolDelta(d.content, d.tool_calls) for d in deltas])
        if self.named or (self.tool_choice == "required" and calls):
            content = ""  # vLLM's message for forced calls carries content ""
        return FullMessage(reasoning, content, calls), parser.called

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" when an auto parser found calls, or "required" calls
        ended normally; otherwise the engine's reason."""
        if engine_reason is None or not called:
            return engine_reason
        if self.tool_choice == "auto" or (self.tool_choice == "required"
                                          and engine_reason == "stop"):
            return "tool_calls"
        return engine_reason
