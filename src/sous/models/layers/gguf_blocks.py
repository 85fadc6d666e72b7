"""A GGUF Q4_0 / Q4_1 / Q8_0 matrix as the file stores it: rows of blocks of 32 weights.

Block layouts (little-endian): Q4_0 = float16 `d` + 16 bytes of nibbles (18 bytes), weight
`(q - 8) * d`; Q4_1 = `d`, `m` + 16 bytes (20), weight `q * d + m`; Q8_0 = `d` + 32 int8
(34), weight `q * d`. In the nibble bytes, byte `j` holds element `j` (low nibble) and
element `j + 16` (high nibble).

`GgufBlocks` keeps those bytes (a row gather and a concatenation are byte copies), so a kernel
that reads the same bytes can be fed without unpacking every weight first; `planes()` gives the
unpacked `GroupQuantWeight` planes for the other paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
"""Bytes of one 32-weight block per GGUF type."""

Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GgufBlocks:
    """`raw`: uint8 `[N, K / 32, BLOCK_BYTES[qtype]]`, row `n` = output row `n` of the weight.
    Read-only: methods return new objects (copies where they reorder)."""

    raw: torch.Tensor
    qtype: str

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.raw.shape[1] * GROUP_SIZE))

    def take_rows(self, index: torch.Tensor) -> GgufBlocks:
        return GgufBlocks(self.raw[index], self.qtype)

    @staticmethod
    def cat(parts: list[GgufBlocks]) -> GgufBlocks:
        """Stacked along the output dimension (one type)."""
        if len({p.qtype for p in parts}) != 1:
            raise ValueError("GgufBlocks.cat needs one GGUF type")
        return GgufBlocks(torch.cat([p.raw for p in parts]), parts[0].qtype)

    @property
    def num_planes(self) -> int:
        """Planes of `planes()`: Q8_0 is two 4-bit planes."""
        return 2 if self.qtype == "Q8_0" else 1

    def half_field(self, offset: int) -> torch.Tensor:
        """The float16 at (even) byte `offset` of every block, as float32 `[N, K / 32]`."""
        return self.raw.contiguous().view(torch.float16)[..., offset // 2].float()

    def scales_and_zeros(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(scale, zero)` float32 `[N, K / 32]` per plane, as `planes()` has them: the weight is
        `sum_p (q_p - 8) * scale_p + zero_p`."""
        d = self.half_field(0)
        if self.qtype == "Q4_0":
            return [(d, torch.zeros_like(d))]
        if self.qtype == "Q4_1":
            return [(d, self.half_field(2) + 8.0 * d)]
        return [(16.0 * d, torch.zeros_like(d)), (d, 8.0 * d)]  # Q8_0: two 4-bit planes

    def quants(self) -> torch.Tensor:
        """The quant bytes of each block: uint8 `[N, K / 32, 16]` (Q4: nibble pairs, GGUF order)
        or int8 `[N, K / 32, 32]` (Q8_0)."""
        start = BLOCK_BYTES[self.qtype] - (32 if self.qtype == "Q8_0" else 16)
        q = self.raw[..., start:]
        return q.view(torch.int8) if self.qtype == "Q8_0" else q

    def planes(self) -> list[Plane]:
        """The `GroupQuantWeight` planes: `(q uint8 [N, K] in 0..15, scale, zero)`."""
        n = self.raw.shape[0]
        q = self.quants()
        if self.qtype == "Q8_0":  # int8 -> its high nibble + 8 and its low nibble
            hi = ((q >> 4) + 8).view(torch.uint8)
            qs = [hi, (q & 0x0F).view(torch.uint8)]
        else:
            nib = torch.empty((*q.shape[:-1], GROUP_SIZE), dtype=torch.uint8)
            torch.bitwise_and(q, 0x0F, out=nib[..., :16])
            torch.bitwise_right_shift(q, 4, out=nib[..., 16:])
            qs = [nib]
        return [(x.reshape(n, -1).contiguous(), s, z)
                for x, (s, z) in zip(qs, self.scales_and_zeros(), strict=True)]
