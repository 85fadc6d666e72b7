"""When reasoning has ended, on token ids: what structured output waits for.

vLLM's structured output is enforced only after reasoning ends (the reasoning parser's
`is_reasoning_end(ids)`). Here the ids are decoded and the parser's own text rule decides
(`</think>` after the last `<think>` for the think-tag parsers), so tags that a BPE tokenizer
splits differently in context are still found; decoding is ~1 ms per 5,000 tokens and stops
once reasoning has ended. Parsers that never hold output back as reasoning by default
(`deepseek_v3` without `thinking`, `minimax_m2_append_think`) get no detector, so output is
constrained from the first token, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sous.server.reasoning.base import ReasoningParser, ThinkReasoningParser


class ThinkEndDetector:
    """`is_reasoning_end(ids)` of a think-tag parser over `tokenizer`'s text."""

    def __init__(self, parser: ThinkReasoningParser, tokenizer: Any) -> None:
        self.parser = parser
        self.tokenizer = tokenizer

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)
        return self.parser.reasoning_ended(text)


def reasoning_end_detector(parser: ReasoningParser, tokenizer: Any) -> ThinkEndDetector | None:
    """The detector for `parser`, or None (see above)."""
    if not isinstance(parser, ThinkReasoningParser):
        return None
    return ThinkEndDetector(parser, tokenizer)
