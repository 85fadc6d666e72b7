"""Start-up errors a user fixes by changing a flag, a path or an environment variable."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot start: the message is one line naming the flag, path or
    variable to change. `sous serve` prints it and exits 2 (no traceback); the offline `LLM`
    raises it (a ValueError, as vLLM raises)."""
