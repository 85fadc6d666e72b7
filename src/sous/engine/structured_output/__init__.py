"""Structured output (JSON schema, regex, choice, grammar) with xgrammar token bitmasks.

Only the request-side parameters are exported here (importing them stays cheap and cycle-free);
the engine imports `manager.StructuredOutputManager` and `bitmask.GrammarOutput` directly.
"""

from sous.engine.structured_output.params import StructuredOutputKind, StructuredOutputsParams

__all__ = ["StructuredOutputKind", "StructuredOutputsParams"]
