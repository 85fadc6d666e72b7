"""Structured output (JSON schema, regex, choice, grammar) with xgrammar token bitmasks.

Only the request-side parameters are exported here (importing them stays cheap and cycle-free);
the engine imports `manager.StructuredOutputManager` and `bitmask.GrammarOutput` directly.
Only `backend_xgrammar` imports xgrammar at module level, and the others import it on the first
structured request: a server that never gets one does not load xgrammar (about 20 MB resident
beyond what the server loads anyway, and 0.3 s of start-up).
"""

from sous.engine.structured_output.params import StructuredOutputKind, StructuredOutputsParams

__all__ = ["StructuredOutputKind", "StructuredOutputsParams"]
