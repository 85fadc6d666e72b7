"""`deepseek_r1`: `<think>`/`</think>`; R1's template puts `<think>` in the prompt, so
output without the start tag is reasoning until `</think>` (all reasoning without it)."""

from __future__ import annotations

from sous.server.reasoning.base import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
