from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LoadConfig:
    safetensors_load_strategy: Literal["lazy", "eager", "prefetch"] | None = None
    """How safetensors files are read: lazy (mmap), eager (whole file into RAM first),
    prefetch (warm the OS page cache first). Default: lazy."""
    download_dir: str | None = None
    """Unused: sous never downloads; pass a local folder as MODEL."""
