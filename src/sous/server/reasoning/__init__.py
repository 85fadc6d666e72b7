"""Reasoning parsers by name (vLLM's `--reasoning-parser`): `get(name)`, `names()`.

One module per parser; add a row to `_PARSERS` to register another. `get` returns a shared,
stateless parser: `parser.split(text, chat_template_kwargs)` for a whole output,
`parser.stream(chat_template_kwargs)` per streamed request (see `base`).
"""

from __future__ import annotations

from sous.server.reasoning.base import ReasoningParser, ReasoningStream
from sous.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from sous.server.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser
from sous.server.reasoning.minimax_m2 import (
    MiniMaxM2AppendThinkReasoningParser,
    MiniMaxM2ReasoningParser,
)

__all__ = ["ReasoningParser", "ReasoningStream", "get", "names"]

_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser,
                              MiniMaxM2ReasoningParser, MiniMaxM2AppendThinkReasoningParser)
}


def names() -> list[str]:
    """Registered parser names, sorted."""
    return sorted(_PARSERS)


def get(name: str) -> ReasoningParser:
    """The parser registered as `name`; KeyError naming the known ones otherwise."""
    cls = _PARSERS.get(name)
    if cls is None:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {', '.join(names())}")
    return cls()
