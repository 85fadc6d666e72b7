"""NVFP4: 4-bit E2M1 elements, an e4m3 scale per 16 input elements and one fp32 global scale.

E2M1 code `[sign | e1 e0 | m]`; magnitudes by the low 3 bits `0, 0.5, 1, 1.5, 2, 3, 4, 6`. Two
codes per byte, the LOW nibble holding the even (first) element: `packed[..., j] = code[..., 2j]
| code[..., 2j+1] << 4`, so a `[out, in]` matrix is stored as uint8 `[out, in/2]` and its block
scales as float8_e4m3fn `[out, in/16]` (row-major, not the kernels' swizzled layout).

The global scale is a MULTIPLIER in ModelOpt checkpoints (`weight_scale_2 = amax / (6 * 448)`)
and a DIVISOR in compressed-tensors ones (`weight_global_scale = 6 * 448 / amax`); callers pass
the multiplier (`1 / weight_global_scale` for compressed-tensors).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 16
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
"""Value of each 4-bit code (index = code)."""
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., n]` -> codes uint8 `[..., 2n]` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed E2M1 data must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes (integers 0..15) `[..., 2n]` -> uint8 `[..., n]` (low nibble = even element)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 packing needs an even last dim, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Codes -> float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to the nearest E2M1 code, clamping
    magnitudes to 6; ties go to the smaller magnitude. Returns uint8 codes."""
    mag = x.abs().float().clamp(max=FP4_MAX)
    idx = torch.bucketize(mag, _MIDPOINTS.to(x.device))
    return (idx | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype,
    group_size: int = GROUP_SIZE,
    *,
    global_is_divisor: bool = False,
) -> torch.Tensor:
    """`W[i, j] = E2M1(code[i, j]) * float(block_scale[i, j // group_size]) * global_scale`
    (`/ global_scale` with `global_is_divisor`, compressed-tensors' convention).

    packed uint8 `[out, in/2]`, block_scale `[out, in/group_size]` (e4m3 or float), global_scale
    a scalar or one-element tensor. Returns a new `[out, in]` tensor in `dtype`, computed in
    float32 with one rounding (E2M1 x e4m3 products are exact in float32)."""
    codes = unpack_e2m1(packed)
    out_dim, in_dim = codes.shape
    if in_dim % group_size or tuple(block_scale.shape) != (out_dim, in_dim // group_size):
        raise ValueError(
            f"NVFP4 block scale shape {tuple(block_scale.shape)} does not match weight "
            f"[{out_dim}, {in_dim}] with groups of {group_size}"
        )
    g = torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
    vals = e2m1_to_float(codes).view(out_dim, in_dim // group_size, group_size)
    w = vals * block_scale.float().unsqueeze(-1)
    w = w / g if global_is_divisor else w * g
    return w.view(out_dim, in_dim).to(dtype)


def quantize_nvfp4(
    w: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise `[out, in]` (in divisible by group_size) as ModelOpt does.

    Returns `(packed uint8 [out, in/2], block_scale e4m3 [out, in/group_size], global_scale fp32
    scalar multiplier)` with `global_scale = amax / (6 * 448)` and each block scale
    `group_amax / 6 / global_scale` rounded to e4m3; elements round to the nearest E2M1 value."""
    out_dim, in_dim = w.shape
    if in_dim % group_size:
        raise ValueError(f"in dim {in_dim} is not a multiple of the group size {group_size}")
    wf = w.float().view(out_dim, in_dim // group_size, group_size)
    amax = wf.abs().amax()
    g = amax / (FP4_MAX * FP8_E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    block = (wf.abs().amax(-1) / FP4_MAX / g).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    eff = (block.float() * g).unsqueeze(-1)
    scaled = torch.where(eff > 0, wf / torch.where(eff > 0, eff, 1.0), 0.0)
    packed = pack_e2m1(float_to_e2m1(scaled).view(out_dim, in_dim))
    return packed, block, g.float()
