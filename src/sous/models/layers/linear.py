"""Linear layers for the hot path.

`DenseLinear` keeps its weight transposed (`[in, out]`, contiguous) and calls `torch.mm`: on
x86 CPUs MKL is several times faster this way than `F.linear` for the 2-32 row inputs of a
decode batch.

Group-quantised weights (GGUF Q4_0 / Q4_1 exactly, Q8_0 as the sum of two 4-bit planes) run on
sous' `qgemm` kernel (`BlockQuantLinear`, llama.cpp's numerics) where the CPU has AVX-512 VNNI
or AVX2; elsewhere `Int4Linear` runs them through torch's CPU int4 weight-only kernel. That kernel is
fast only with bfloat16 activations, so inputs are rounded to bfloat16 and outputs come back
in the caller's dtype: the numerics are those of a bfloat16 matmul over the exact quantised
weights.
"""

from __future__ import annotations

import torch
from torch import nn

from sous.models.layers.gguf_blocks import GROUP_SIZE, GgufBlocks, Plane


class GroupQuantWeight:
    """A weight `W[n, k] = sum_p (q_p[n, k] - 8) * scale_p[n, k // 32] + zero_p[n, k // 32]`
    with `q_p` in 0..15: the exact form of GGUF Q4_0/Q4_1 (one plane) and Q8_0 (two planes).
    Loaders hand these to `load_weights` instead of a dense tensor when the 4-bit path is on.

    Built from `planes`, or from the file's own bytes (`blocks`, `GgufBlocks`): then `planes`
    is unpacked from them on first use, and kernels that read GGUF blocks take `blocks` as they
    are (row gathers and concatenations stay byte copies)."""

    def __init__(self, planes: list[Plane] | None = None, dense_fallback: bool = False,
                 blocks: GgufBlocks | None = None) -> None:
        if (planes is None) == (blocks is None):
            raise ValueError("GroupQuantWeight takes planes or blocks")
        self._planes = planes
        self.blocks = blocks
        self.dense_fallback = dense_fallback
        """Also keep a dense copy for large batches (prefill), where dense MKL beats the int4
        kernel (which scales linearly with rows)."""

    @property
    def planes(self) -> list[Plane]:
        """`(q uint8 [N, K], scale float32 [N, K/32], zero float32 [N, K/32])` per plane."""
        if self._planes is None:
            assert self.blocks is not None
            self._planes = self.blocks.planes()
        return self._planes

    @property
    def shape(self) -> torch.Size:
        return self.blocks.shape if self.blocks is not None else self.planes[0][0].shape

    @property
    def num_planes(self) -> int:
        return self.blocks.num_planes if self.blocks is not None else len(self.planes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[N, K]` weight (float32 arithmetic, then cast)."""
        out = None
        for q, scale, zero in self.planes:
            w = (q.float() - 8.0).view(q.shape[0], -1, GROUP_SIZE)
            w = w * scale.unsqueeze(-1) + zero.unsqueeze(-1)
            out = w if out is None else out + w
        assert out is not None
        return out.reshape(self.shape).to(dtype)

    def permute_rows(self, index: torch.Tensor) -> GroupQuantWeight:
        if self.blocks is not None:
            return GroupQuantWeight(None, self.dense_fallback, self.blocks.take_rows(index))
        planes = [(q[index], s[index], z[index]) for q, s, z in self.planes]
        return GroupQuantWeight(planes, self.dense_fallback)

    @staticmethod
    def cat(weights: list[GroupQuantWeight]) -> GroupQuantWeight:
        """Stack along the output dimension (all with the same number of planes)."""
        fallback = all(w.dense_fallback for w in weights)
        blocks = [w.blocks for w in weights]
        if all(b is not None for b in blocks) and len({b.qtype for b in blocks}) == 1:  # type: ignore[union-attr]
            return GroupQuantWeight(None, fallback, GgufBlocks.cat(blocks))  # type: ignore[arg-type]
        n = weights[0].num_planes
        planes = [
            tuple(torch.cat([w.planes[p][j] for w in weights]) for j in range(3)) for p in range(n)
        ]
        return GroupQuantWeight(planes, fallback)  # type: ignore[arg-type]


AnyWeight = torch.Tensor | GroupQuantWeight


def int4_kernel_available(device: torch.device) -> bool:
    """True where torch has the CPU int4 weight-only matmul and `device` is the CPU."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class DenseLinear(nn.Module):
    """`y = x @ W^T + b` with `W^T` stored contiguous as `weight_t` `[in, out]`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class Int4Linear(nn.Module):
    """`y = x @ W^T + b` for a `GroupQuantWeight` on the CPU int4 kernel (see module docstring).

    With `weight.dense_fallback`, inputs of `dense_min_rows` rows or more use a dense float32
    copy of the (exact) dequantised weight instead."""

    dense_min_rows = 16
    """Row count from which the dense copy is used (measured crossover on AVX-512: ~16 rows for
    one plane, ~8 for two)."""

    def __init__(
        self,
        weight: GroupQuantWeight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        n, k = weight.shape
        if n % 16 or k % GROUP_SIZE:
            raise ValueError(f"int4 kernel needs out % 16 == 0 and in % 32 == 0, got {n}x{k}")
        self.in_features, self.out_features = k, n
        self.num_planes = len(weight.planes)
        if self.num_planes > 1:
            self.dense_min_rows = 8
        for i, (q, scale, zero) in enumerate(weight.planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scale_zero{i}", sz)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.weight_t: torch.Tensor | None = None
        if weight.dense_fallback:
            self.weight_t = nn.Parameter(
                weight.dequantize(dtype).t().contiguous(), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.shape[0] >= self.dense_min_rows:
            w = self.weight_t if x.dtype == self.weight_t.dtype else self.weight_t.to(x.dtype)
            return torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)
        xb = x.to(torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(xb, self.packed0, GROUP_SIZE, self.scale_zero0)
        if self.num_planes > 1:
            y = y.float()
            for i in range(1, self.num_planes):
                y += mm(
                    xb, getattr(self, f"packed{i}"), GROUP_SIZE, getattr(self, f"scale_zero{i}")
                )
        y = y.to(x.dtype)
        if self.bias is not None:
            y += self.bias
        return y


def make_linear(
    weights: list[AnyWeight],
    biases: list[torch.Tensor] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """One linear computing the given weights (stacked along the output dimension) fused.

    When every part is a `GroupQuantWeight` with the same plane count: `BlockQuantLinear` where
    `qgemm` runs on `device`, else `Int4Linear` where torch's int4 kernel is available;
    otherwise dense in `dtype`."""
    bias = None
    if biases is not None:
        bias = torch.cat([b.to(device=device, dtype=dtype) for b in biases])
    qs = [w for w in weights if isinstance(w, GroupQuantWeight)]
    if len(qs) == len(weights) and len({w.num_planes for w in qs}) == 1:
        from sous.models.layers.qgemm_linear import BlockQuantLinear, qgemm_ops

        fused = GroupQuantWeight.cat(qs)
        n, k = fused.shape
        if k % GROUP_SIZE == 0 and qgemm_ops(device) is not None:
            return BlockQuantLinear(fused, bias)
        if n % 16 == 0 and k % GROUP_SIZE == 0 and int4_kernel_available(device):
            return Int4Linear(fused, bias, dtype)
    dense = [
        w.dequantize(dtype) if isinstance(w, GroupQuantWeight) else w.to(dtype) for w in weights
    ]
    w = dense[0] if len(dense) == 1 else torch.cat(dense)
    return DenseLinear(w.to(device), bias)
