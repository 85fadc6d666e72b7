"""int8 weights with dynamic int8 activations (`--quantization int8`): W8A8 on the CPU.

`Int8Linear` stores each output channel's weights as symmetric int8 with one float32 scale
(`W ~ w8 * w_scale`), and quantises each input row (token) at run time to symmetric int8 with
its own scale (`x ~ x8 * x_scale`). The product runs as an exact int8 x int8 -> int32 matmul
(`torch._int_mm`, oneDNN with VNNI on x86) and is rescaled: `y = (x8 @ w8^T) * x_scale *
w_scale + b`. Integer accumulation is exact and every scale is per row, so a row's result does
not depend on the other rows of the batch: greedy output is the same alone and batched.
Where the CPU has AVX-512 VNNI or AVX2 the whole product is one call of sous' `qgemm_i8` kernel on
weights packed at load (bit-identical to the form below, several times faster for decode
batches: no per-call weight reorder).

This is the scheme llama.cpp uses for its quantised dot products (activations quantised to 8
bits) and OpenVINO's default on VNNI CPUs. Its cost in accuracy is measured in the README.
`quantize_linears` swaps every `DenseLinear` of a loaded model for an `Int8Linear` (the float
weight is dropped), so model code stays unaware of it. With the C++ ops built (`engine/ops/`),
the activation quantisation and the rescale each run as one fused pass with the same
arithmetic (bit-identical results); otherwise as the torch ops below.
"""

from __future__ import annotations

import torch
from torch import nn

from sous.engine.ops.build import cpu_ops
from sous.models.layers.linear import GROUP_SIZE, DenseLinear
from sous.models.layers.qgemm_linear import pack_weights, qgemm_ops

_QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation of a 2-D float tensor: `(x8 [M, K] int8,
    scale [M, 1] float32)` with `x ~ x8 * scale`. All-zero rows get scale 1."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    return (xf / scale).round_().to(torch.int8), scale


class Int8Linear(nn.Module):
    """`y = x @ W^T + b` in W8A8 (module docstring). Buffers: `w_scale` float32 `[out]` and
    either `w_packed` (qgemm's layout, on a VNNI or AVX2 CPU) or `w8_t` int8 `[in, out]`; the float
    weight is not kept."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        w8, scale = quantize_rows(weight_t.t())
        self.register_buffer("w_scale", scale.view(-1).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.qgemm = qgemm_ops(weight_t.device)
        if self.qgemm is not None and self.in_features % GROUP_SIZE == 0:
            self.register_buffer("w_packed", pack_weights((w8.to(torch.int16) + 128).to(
                torch.uint8), 8))
            self.register_buffer("w8_t", None)
        else:
            self.qgemm = None
            self.register_buffer("w8_t", w8.t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qgemm is not None:
            xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            y = self.qgemm.qgemm_i8(xk.contiguous(), self.w_packed, self.w_scale,
                                    self.out_features, self.bias)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        assert self.w8_t is not None
        ops = cpu_ops(x.device)
        if ops is None:
            x8, x_scale = quantize_rows(x)
            y = torch._int_mm(x8, self.w8_t).float().mul_(x_scale).mul_(self.w_scale)
            if self.bias is not None:
                y += self.bias
            return y.to(x.dtype)
        x8, x_scale = ops.quantize_rows_int8(x.float().contiguous())
        y = ops.rescale_int32(torch._int_mm(x8, self.w8_t), x_scale, self.w_scale, self.bias)
        return y.to(x.dtype)


def quantize_linears(model: nn.Module) -> int:
    """Replace every `DenseLinear` in `model` (in place) by an `Int8Linear`; returns how many.
    Tied weights: each linear gets its own quantised copy (embeddings stay float)."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, DenseLinear)]
    for parent, name, child in swaps:
        setattr(parent, name, Int8Linear(child.weight_t.data, child.bias))
    return len(swaps)
