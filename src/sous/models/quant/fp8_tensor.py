"""Per-tensor (and per-output-channel) FP8 weights: ModelOpt `quant_algo: FP8` (also the FP8
layers of a MIXED_PRECISION checkpoint) and `quant_method: fp8` without `weight_block_size`.

A `[out, in]` weight is stored as float8_e4m3fn plus `weight_scale` float32, a MULTIPLIER:
one scalar (shape `[]` or `[1]`) for the whole tensor, or `[out]` / `[out, 1]` per output row
(ModelOpt `FP8_PER_CHANNEL_PER_TOKEN`): `W[i, j] = float(w[i, j]) * weight_scale[(i)]`.
`input_scale` (static activation scale) does not affect the weight.
"""

from __future__ import annotations

import torch

from sous.models.quant.fp8_block import FP8_E4M3_MAX


def dequantize_fp8_tensor(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """fp8 `[out, in]` * `scale` (one element, or one per output row) -> new `[out, in]` tensor
    in `dtype`, computed in float32 with one rounding. Raises ValueError on any other shape."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got {tuple(weight.shape)}")
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(())
    elif s.numel() == weight.shape[0] and s.dim() <= 2 and s.shape[0] == weight.shape[0]:
        s = s.reshape(-1, 1)
    else:
        raise ValueError(
            f"weight_scale shape {tuple(scale.shape)} does not match weight "
            f"{list(weight.shape)} (expected one scale, or one per output row)"
        )
    return (weight.float() * s).to(dtype)


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> `(float8_e4m3fn [out, in], weight_scale float32 scalar)` as ModelOpt does:
    `scale = amax / 448` (1.0 for an all-zero tensor), elements rounded to nearest-even e4m3."""
    wf = w.float()
    amax = wf.abs().amax()
    scale = amax / FP8_E4M3_MAX if amax > 0 else torch.tensor(1.0)
    q = (wf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.float().reshape(())
