"""Hugging Face-style folders: config.json + *.safetensors (optionally sharded) + tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_READ_CHUNK = 16 << 20


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files, from `model.safetensors.index.json` when present, else `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weight files")
    return files


def count_tensors(files: list[Path]) -> int:
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            n += len(list(h.keys()))
    return n


def _prefetch(path: Path) -> None:
    """Read the file sequentially so the OS page cache holds it before the mmap reads."""
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        while fh.readinto(view):
            pass


def iter_weights(files: list[Path], strategy: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of every tensor in the files.

    strategy `lazy`/None: mmap each file (`safe_open`); `eager`: read each whole file into memory
    and deserialise it from bytes; `prefetch`: read every file once to warm the page cache, then
    lazy."""
    from safetensors import safe_open
    from safetensors.torch import load as load_bytes

    strategy = strategy or "lazy"
    if strategy not in ("lazy", "eager", "prefetch"):
        raise ValueError(
            f"unknown --safetensors-load-strategy {strategy!r} (lazy, eager, prefetch)"
        )
    if strategy == "prefetch":
        for f in files:
            _prefetch(f)
    for f in files:
        if strategy == "eager":
            tensors = load_bytes(f.read_bytes())
            while tensors:
                name = next(iter(tensors))
                yield name, tensors.pop(name)
        else:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    yield name, h.get_tensor(name)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def generation_eos_ids(folder: Path) -> list[int]:
    """`eos_token_id` of generation_config.json (int or list), as a list."""
    v = read_json(folder / "generation_config.json").get("eos_token_id")
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]
