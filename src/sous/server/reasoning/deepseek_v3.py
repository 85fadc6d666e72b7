"""`deepseek_v3` (DeepSeek-V3.1 and later hybrids): decided per request from
`chat_template_kwargs` — `thinking` or `enable_thinking` true: `deepseek_r1`; otherwise
no split (everything is content, reasoning has ended from the start)."""

from __future__ import annotations

from typing import Any

from sous.server.reasoning.base import IdentityStream, ReasoningParser, ReasoningStream
from sous.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


def thinking_enabled(chat_template_kwargs: dict[str, Any] | None) -> bool:
    kwargs = chat_template_kwargs or {}
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek_v3"

    def __init__(self) -> None:
        self.thinking = DeepSeekR1ReasoningParser()

    def stream(self, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningStream:
        if thinking_enabled(chat_template_kwargs):
            return self.thinking.stream(chat_template_kwargs)
        return IdentityStream()

    def reasoning_ended(self, text: str,
                        chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        if thinking_enabled(chat_template_kwargs):
            return self.thinking.reasoning_ended(text, chat_template_kwargs)
        return True
