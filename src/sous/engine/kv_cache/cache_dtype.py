"""`--kv-cache-dtype`: the element type of the KV cache.

- `auto`: the model dtype, except GGUF weights served quantised (the default for a GGUF file)
  with float32 activations: their cache is bfloat16. The weights are 4-bit already; the cache
  halves the bytes decode attention reads per step (the larger part of a 64-sequence step on a
  2-core CPU), while an explicit `--dtype float32` keeps the exact float32 model and cache.
- `bfloat16`: bfloat16 whatever the model dtype (the attention op converts on read).
- `fp8` / `fp8_e4m3`: the cache stores `k / k_scale` and `v / v_scale` in float8_e4m3fn (1 byte
  per element); the attention op multiplies the scales back after reading. Scales default to
  1.0 and come from the checkpoint when it has them (`...self_attn.k_scale` / `v_scale`, read
  by the loader), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8_NAMES = ("fp8", "fp8_e4m3")
CACHE_DTYPES = {"bfloat16": torch.bfloat16, **dict.fromkeys(FP8_NAMES, torch.float8_e4m3fn)}
"""--kv-cache-dtype values other than `auto` (the model dtype) and the element type stored."""


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: str, quantization: str | None,
                        activation_dtype: torch.dtype) -> str:
    """`--kv-cache-dtype` with `auto` resolved where it is not simply the model dtype (see the
    module docstring): `bfloat16` for GGUF weights kept quantised under `--dtype auto` with
    float32 activations; otherwise the flag's value."""
    if (kv_cache_dtype == "auto" and quantization == "gguf" and model_dtype == "auto"
            and activation_dtype == torch.float32):
        return "bfloat16"
    return kv_cache_dtype


def with_cache_dtype(spec: Any, kv_cache_dtype: str) -> Any:
    """The model's KV spec (a dataclass with a `dtype` field) with the cache dtype applied."""
    if kv_cache_dtype == "auto":
        return spec
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported "
                         f"(auto, {', '.join(CACHE_DTYPES)})")
    return dataclasses.replace(spec, dtype=CACHE_DTYPES[kv_cache_dtype])


def apply_kv_scales(model: nn.Module, scales: dict[str, float]) -> int:
    """Set `k_scale` / `v_scale` on the attention modules named by the checkpoint's scale
    tensors (e.g. `model.layers.3.self_attn.k_scale`). Returns how many were applied; a scale
    whose module has no such attribute is reported and skipped."""
    applied = 0
    for name, value in scales.items():
        path, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if module is None or not hasattr(module, attr):
            logger.warning("KV cache scale %s has no matching attention layer; ignored", name)
            continue
        setattr(module, attr, float(value))
        applied += 1
    return applied
