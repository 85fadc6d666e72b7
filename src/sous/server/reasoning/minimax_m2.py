"""MiniMax-M2 reasoning.

- `minimax_m2`: `<think>`/`</think>`; M2's template opens `<think>` in the prompt, so
  everything before `</think>` is reasoning (M2.5 emits both tags; the start one is dropped).
- `minimax_m2_append_think`: no split; content is `"<think>" + output` (the first streamed
  content piece carries the `<think>`), reasoning is None — clients keep the thinking in the
  history, which M2 needs for interleaved thinking across turns.
"""

from __future__ import annotations

from typing import Any

from sous.server.reasoning.base import ReasoningParser, ReasoningStream, ThinkReasoningParser


class MiniMaxM2ReasoningParser(ThinkReasoningParser):
    name = "minimax_m2"


class AppendThinkStream(ReasoningStream):
    def __init__(self, start: str) -> None:
        self.prefix = start

    def feed(self, text: str) -> tuple[str, str]:
        prefix, self.prefix = self.prefix, ""
        return "", prefix + text

    def finish(self) -> tuple[str, str]:
        return self.feed("") if self.prefix else ("", "")


class MiniMaxM2AppendThinkReasoningParser(ReasoningParser):
    name = "minimax_m2_append_think"
    start_tag = "<think>"
    end_tag = "</think>"

    def stream(self, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningStream:
        return AppendThinkStream(self.start_tag)

    def reasoning_ended(self, text: str,
                        chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        return self.end_tag in text
