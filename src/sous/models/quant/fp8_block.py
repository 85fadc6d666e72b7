"""DeepSeek-style FP8 block quantisation (`quant_method: fp8`, `weight_block_size: [bo, bi]`).

A `[out, in]` weight is stored as float8_e4m3fn plus `weight_scale_inv` float32
`[ceil(out/bo), ceil(in/bi)]`, one scale per `bo x bi` tile (edge tiles are partial when a dim
is not a multiple of the block). Despite its name the scale is a multiplier:
`W[i, j] = float(w[i, j]) * weight_scale_inv[i // bo, j // bi]`.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_E4M3_MAX = 448.0


def expected_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the per-block scale of a `[out, in]` weight."""
    out_dim, in_dim = shape
    return -(-out_dim // block[0]), -(-in_dim // block[1])


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-block scale -> per-element `[out, in]` float32 (partial edge tiles cropped)."""
    out_dim, in_dim = shape
    s = scale.float().repeat_interleave(block[0], dim=0)[:out_dim]
    return s.repeat_interleave(block[1], dim=1)[:, :in_dim]


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """fp8 `[out, in]` * per-block `scale_inv` -> new `[out, in]` tensor in `dtype` (computed in
    float32). Raises ValueError when the scale shape does not match the weight and block."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block weight must be 2-D, got {tuple(weight.shape)}")
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    want = expected_scale_shape(shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {list(shape)}"
            f" with weight_block_size {list(block)} (expected {list(want)})"
        )
    return (weight.float() * _expand(scale_inv, shape, block)).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> `(float8_e4m3fn [out, in], scale_inv float32 [ceil(out/bo), ceil(in/bi)])`
    with `scale_inv = block_amax / 448` (1.0 for an all-zero block) and round-to-nearest-even
    e4m3 elements."""
    out_dim, in_dim = w.shape
    so, si = expected_scale_shape((out_dim, in_dim), block)
    wf = w.float()
    padded = wf.new_zeros(so * block[0], si * block[1])
    padded[:out_dim, :in_dim] = wf
    tiles = padded.view(so, block[0], si, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (wf / _expand(scale, (out_dim, in_dim), block)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale
