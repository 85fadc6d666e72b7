"""`--kv-cache-dtype fp8`: e4m3 KV cache with per-layer k/v scales.

The cache stores `k / k_scale` and `v / v_scale` in float8_e4m3fn (1 byte per element); the
attention op multiplies the scales back after reading. Scales default to 1.0 and come from the
checkpoint when it has them (`...self_attn.k_scale` / `v_scale`, read by the loader), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8_NAMES = ("fp8", "fp8_e4m3")


def with_cache_dtype(spec: Any, kv_cache_dtype: str) -> Any:
    """The model's KV spec (a dataclass with a `dtype` field) with the cache dtype applied."""
    if kv_cache_dtype == "auto":
        return spec
    if kv_cache_dtype not in FP8_NAMES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported "
                         f"(auto, {', '.join(FP8_NAMES)})")
    return dataclasses.replace(spec, dtype=torch.float8_e4m3fn)


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
