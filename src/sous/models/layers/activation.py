"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sous.engine.ops.build import cpu_ops_for


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for `x` of last dimension `2d` (SwiGLU). 2-D float32 /
    bfloat16 CPU rows run as one C++ pass (`sous_ops.silu_and_mul`, the same roundings)."""
    if x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1:
        ops = cpu_ops_for(x)
        if ops is not None:
            return ops.silu_and_mul(x)
    d = x.shape[-1] // 2
    out = F.silu(x[..., :d])
    return out.mul_(x[..., d:])
