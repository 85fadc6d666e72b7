"""`BlockQuantLinear`: GGUF Q4_0 / Q4_1 / Q8_0 weights on the `qgemm` C++ kernel, llama.cpp's
numerics (block-quantised weights times activations quantised to int8 per block of 32).

The kernel (`engine/ops/csrc/qgemm.cpp`) runs on AVX-512 VNNI or AVX2 (bit-identical
results); `qgemm_ops` says whether this machine has either (elsewhere `make_linear` keeps
torch's int4 kernel). Weights are packed once at load (`packed_form`: a GGUF file's blocks
as they are, else `pack_weights`): output rows in groups of 16, interleaved in 4-byte steps so
one `vpdpbusd` advances 16 rows at once. The same layout carries the per-channel int8 weights of
`--quantization int8` (`Int8Linear`), whose kernel `qgemm_i8` sums over all of K in int32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sous.engine.ops.build import cpu_ops
from sous.models.layers.linear import GROUP_SIZE, GroupQuantWeight

LANES = 16
"""Output rows per packed group."""
CPU = torch.device("cpu")


def qgemm_ops(device: torch.device) -> Any:
    """The C++ ops module with `qgemm` / `qgemm_i8` for tensors on `device` when they run on
    AVX-512 VNNI or AVX2 there, else None (`sous.engine.ops.build.cpu_ops`)."""
    mod = cpu_ops(device)
    return mod if mod is not None and mod.qgemm_simd() else None


def pack_weights(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `q` `[N, K]` (values below `2**bits`) -> the kernel's layout: uint8
    `[ceil(N / 16), K / 32, 64 * bits]` (see `qgemm.cpp`); missing rows of the last group are 0."""
    n, k = q.shape
    if k % GROUP_SIZE:
        raise ValueError(f"qgemm needs K % {GROUP_SIZE} == 0, got K = {k}")
    if bits not in (4, 8):
        raise ValueError(f"qgemm packs 4- or 8-bit weights, not {bits}")
    nb = k // GROUP_SIZE
    q = q.to(torch.uint8).reshape(n, nb, GROUP_SIZE)
    if bits == 4:  # byte j of a block holds elements j and j + 16 (GGUF's Q4 order)
        q = q[..., :GROUP_SIZE // 2] | (q[..., GROUP_SIZE // 2:] << 4)
    return _interleave_lanes(q, bits)


def _interleave_lanes(block_bytes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[N, K / 32, 4 * bits]` bytes per block -> `[ceil(N / 16), K / 32, 64 * bits]`: rows in
    groups of 16 lanes, each block's bytes in `bits` steps of 4 bytes, lane-interleaved."""
    n, nb, _ = block_bytes.shape
    groups = -(-n // LANES)
    if n != groups * LANES:
        padded = torch.zeros(groups * LANES, nb, 4 * bits, dtype=torch.uint8)
        padded[:n] = block_bytes
        block_bytes = padded
    # 4-byte words [group, lane, block, step] -> [group, block, step, lane]
    words = block_bytes.contiguous().view(torch.int32).view(groups, LANES, nb, bits)
    return words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(groups, nb, 64 * bits)


def pack_scales(s: torch.Tensor) -> torch.Tensor:
    """Per-block `[N, K / 32]` -> `[ceil(N / 16), K / 32, 16]` (one lane per row), same dtype."""
    n, nb = s.shape
    groups = -(-n // LANES)
    padded = torch.zeros(groups * LANES, nb, dtype=s.dtype)
    padded[:n] = s
    return padded.view(groups, LANES, nb).transpose(1, 2).contiguous()


def block_form(weight: GroupQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`(q, scale, min, bits)` with `W = q * scale + min` per block, from the planes of a GGUF
    Q4_0/Q4_1 (one plane, 4 bits) or Q8_0 (two planes whose scales differ by 16, 8 bits)."""
    planes = weight.planes
    scale, mins = _scale_and_min([(s, z) for _, s, z in planes])
    if len(planes) == 1:
        return planes[0][0], scale, mins, 4
    (hi, _, _), (lo, _, _) = planes
    return hi.mul(16).add_(lo), scale, mins, 8  # <= 15 * 16 + 15: exact in uint8


def _scale_and_min(planes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-block `(scale, min)` of one 4-bit plane or a Q8_0 pair (`(scale, zero)` each)."""
    mins = sum((z - 8.0 * s) for s, z in planes)
    if len(planes) == 1:
        return planes[0][0], mins
    if len(planes) != 2 or not torch.equal(planes[0][0], 16.0 * planes[1][0]):
        raise ValueError("qgemm takes one 4-bit plane or a Q8_0 pair of planes")
    return planes[1][0], mins


def packed_form(weight: GroupQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`(packed, scale, min, bits)`: `pack_weights(block_form(weight))`. A weight that holds
    its GGUF blocks is packed from their bytes (the same bytes, moved: no unpacking)."""
    blocks = weight.blocks
    if blocks is None:
        q, scale, mins, bits = block_form(weight)
        return pack_weights(q, bits), scale, mins, bits
    scale, mins = _scale_and_min(blocks.scales_and_zeros())
    q = blocks.quants()
    if blocks.qtype == "Q8_0":  # int8 q -> q + 128 = (high nibble + 8) * 16 + low nibble
        return _interleave_lanes(q.view(torch.uint8) ^ 0x80, 8), scale, mins, 8
    return _interleave_lanes(q, 4), scale, mins, 4


def compact_scales(scale: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and minimums as float16 when that is exact (GGUF stores them in float16: an
    eighth less to read per weight than float32), else float32."""
    scale, mins = scale.float(), mins.float()
    half = scale.half(), mins.half()
    if torch.equal(half[0].float(), scale) and torch.equal(half[1].float(), mins):
        return half
    return scale, mins


class BlockQuantLinear(nn.Module):
    """`y = x @ W^T + b` for a `GroupQuantWeight` on `qgemm` (module docstring). Buffers:
    `packed` uint8, `scale` and `min` `[ceil(N / 16), K / 32, 16]` (`compact_scales`)."""

    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        self.ops = qgemm_ops(CPU)
        if self.ops is None:
            raise RuntimeError("BlockQuantLinear needs the C++ qgemm kernel (AVX-512 VNNI or AVX2)")
        packed, scale, mins, self.bits = packed_form(weight)
        self.register_buffer("packed", packed)
        scale, mins = compact_scales(scale, mins)
        self.register_buffer("scale", pack_scales(scale))
        self.register_buffer("min", pack_scales(mins))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        y = self.ops.qgemm(xk.contiguous(), self.packed, self.scale, self.min, self.out_features,
                      self.bits, self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class BlockQuantEmbedding(nn.Module):
    """A token embedding read from a `BlockQuantLinear`'s packed blocks (`table`: the tied
    output head, or one of its own), dequantising the rows it looks up (`qgemm_rows`: GGUF's
    `q * scale + min`): no dense copy of the vocabulary is kept. `table` is shared, never
    mutated; rows come out in `dtype` (float32 or bfloat16)."""

    def __init__(self, table: BlockQuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        return t.ops.qgemm_rows(t.packed, t.scale, t.min, t.out_features, t.bits, input_ids,
                                self.dtype)
