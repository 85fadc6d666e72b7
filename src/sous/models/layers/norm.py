"""RMSNorm, optionally fused with the residual add.

On CPU, 2-D float32 / bfloat16 inputs run as one C++ pass (`sous_ops.rms_norm`, the same
roundings as the torch form below) instead of about eight torch ops."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from sous.engine.ops.build import cpu_ops_for

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _fused_ops(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The C++ ops when they take `x` (2-D CPU float32 / bfloat16 rows, weight alike)."""
    if x.dim() != 2 or x.dtype not in _FUSED_DTYPES or weight.dtype != x.dtype:
        return None
    return cpu_ops_for(x) if x.stride(-1) == 1 else None


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in float32 like transformers' LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; with `residual`, returns `(norm(x + residual), x + residual)`. Inputs are
        not modified."""
        ops = _fused_ops(x, self.weight)
        if ops is not None and (residual is None or residual.stride(-1) == 1):
            out, summed = ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, summed)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        y = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return y * self.weight
