"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for `x` of last dimension `2d` (SwiGLU)."""
    d = x.shape[-1] // 2
    out = F.silu(x[..., :d])
    return out.mul_(x[..., d:])
