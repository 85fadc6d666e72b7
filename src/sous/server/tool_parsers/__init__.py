"""Tool-call parsers by name (vLLM's `--tool-call-parser`): `get(name)`, `names()`.

Each parser is one module holding a `ToolParser` subclass; add a module and a row to
`_PARSERS` to register another. `get` returns a shared, stateless parser: call
`parser.extract(text, tools)` for a whole output or `parser.stream(tools)` per streamed
request (see `base`).
"""

from __future__ import annotations

from sous.server.tool_parsers.base import (
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    ToolStream,
)
from sous.server.tool_parsers.hermes import HermesToolParser
from sous.server.tool_parsers.minimax_m2 import MinimaxM2ToolParser

__all__ = ["ToolCall", "ToolCallDelta", "ToolDelta", "ToolParser", "ToolStream", "get",
           "names"]

_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, MinimaxM2ToolParser)
}


def names() -> list[str]:
    """Registered parser names, sorted."""
    return sorted(_PARSERS)


def get(name: str) -> ToolParser:
    """The parser registered as `name`; KeyError naming the known ones otherwise."""
    cls = _PARSERS.get(name)
    if cls is None:
        raise KeyError(f"unknown tool call parser {name!r}; known: {', '.join(names())}")
    return cls()
