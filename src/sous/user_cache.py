"""Where sous keeps what it builds once per machine (C++ ops, converted tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/sous`, default `~/.cache/sous` (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sous"
