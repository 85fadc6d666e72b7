"""The `qgemm` C++ kernels (AVX-512 VNNI or AVX2 CPUs): GGUF block-quantised weights times int8 block
activations (`BlockQuantLinear`, llama.cpp's numerics) and per-channel int8 (`Int8Linear`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sous.models.layers.int8_linear import Int8Linear, quantize_rows
from sous.models.layers.linear import DenseLinear, GroupQuantWeight
from sous.models.layers.qgemm_linear import (
    BlockQuantEmbedding,
    BlockQuantLinear,
    block_form,
    packed_form,
    qgemm_ops,
)
from sous.models.loader_gguf import _group_quant

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(qgemm_ops(CPU) is None,
                                reason="qgemm needs the C++ ops on an AVX-512 VNNI or AVX2 CPU")


def _gguf_weight(qtype: str, n: int, k: int, seed: int = 0):
    import gguf

    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
    w = _group_quant(gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype]), qtype, n)
    assert w is not None
    return w


def _reference(x: torch.Tensor, w) -> torch.Tensor:
    """llama.cpp's arithmetic in float64: x quantised per block of 32 to int8 (scale
    max|x| / 127, round half even), times the exact dequantised weight."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True).float().div(127).double()
    xq = torch.where(d > 0, xb * (1 / d.float()).double(), torch.zeros_like(xb)).round()
    return (xq * d).view(m, k) @ w.dequantize(torch.float64).t()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (7, 96, 33), (70, 64, 50)])
def test_block_kernel_matches_llama_cpp_arithmetic(qtype: str, m: int, k: int, n: int) -> None:
    w = _gguf_weight(qtype, n, k)
    _, _, _, bits = block_form(w)
    assert bits == (8 if qtype == "Q8_0" else 4)
    bias = torch.randn(n)
    lin = BlockQuantLinear(w, bias)
    x = torch.randn(m, k) * 2
    x[0, :32] = 0.0  # an all-zero block quantises to zeros, not NaN
    y = lin(x)
    ref = _reference(x, w) + bias.double()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    exact = x @ w.dequantize().t() + bias  # the activation rounding costs little
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packing_gguf_bytes_equals_packing_unpacked_planes(qtype: str) -> None:
    """The loader hands over the file's blocks; packing their bytes directly (row gathers and
    concatenations included) gives exactly the buffers that unpacking to planes first gives."""
    a, b = _gguf_weight(qtype, 40, 96, seed=1), _gguf_weight(qtype, 24, 96, seed=2)
    assert a.blocks is not None
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    direct = GroupQuantWeight.cat([a.permute_rows(perm), b])
    assert direct.blocks is not None and direct.shape == (64, 96)
    unpacked = GroupQuantWeight.cat([GroupQuantWeight(a.planes).permute_rows(perm),
                                     GroupQuantWeight(b.planes)])
    assert unpacked.blocks is None
    torch.testing.assert_close(direct.dequantize(), unpacked.dequantize(), rtol=0, atol=0)
    for x, y in zip(packed_form(direct), packed_form(unpacked), strict=True):
        assert x == y if isinstance(x, int) else torch.equal(x, y)
    lin_direct, lin_unpacked = BlockQuantLinear(direct), BlockQuantLinear(unpacked)
    for name in ("packed", "scale", "min"):
        assert torch.equal(getattr(lin_direct, name), getattr(lin_unpacked, name))


def test_scales_are_float16_when_exact_else_float32() -> None:
    gguf_lin = BlockQuantLinear(_gguf_weight("Q4_1", 16, 64))
    assert gguf_lin.scale.dtype == gguf_lin.min.dtype == torch.float16  # GGUF's own precision
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (20, 64), dtype=torch.uint8, generator=g)
    scale, zero = torch.rand(20, 2, generator=g) / 7, torch.rand(20, 2, generator=g) / 3
    w = GroupQuantWeight([(q, scale, zero)])  # not representable in float16
    lin = BlockQuantLinear(w)
    assert lin.scale.dtype == torch.float32
    x = torch.randn(3, 64, generator=g)
    ref = _reference(x, w)
    assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    lin = BlockQuantLinear(_gguf_weight("Q4_1", 40, 160))
    x = torch.randn(70, 160).to(dtype)  # 70 rows: every tile shape and two row passes
    y = lin(x)
    assert y.dtype == dtype
    for i in (0, 3, 4, 63, 64, 69):
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1])
    assert torch.equal(lin(x[5:12]), y[5:12])


def test_int8_kernel_is_bit_identical_to_the_torch_form() -> None:
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(50, 96, generator=g), torch.randn(50, generator=g)
    lin = Int8Linear(DenseLinear(w, b).weight_t.data, b)
    assert lin.qgemm is not None and lin.w_packed.dtype == torch.uint8
    w8, w_scale = quantize_rows(w)
    x = torch.randn(70, 96, generator=g) * 3
    x[4] = 0.0
    x8, x_scale = quantize_rows(x)
    want = (x8.int() @ w8.int().t()).float().mul_(x_scale).mul_(w_scale.view(-1)) + b
    assert torch.equal(lin(x), want)
    xb = x.bfloat16()  # bfloat16 in and out: the float32 result, rounded once
    assert torch.equal(lin(xb), lin(xb.float()).bfloat16())
    for i in (0, 4, 69):
        assert torch.equal(lin(x[i:i + 1]), want[i:i + 1])


def test_bad_shapes_are_refused() -> None:
    ops = qgemm_ops(CPU)
    lin = BlockQuantLinear(_gguf_weight("Q4_0", 16, 64))
    with pytest.raises(RuntimeError, match="columns"):
        ops.qgemm(torch.randn(2, 32), lin.packed, lin.scale, lin.min, 16, 4, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.qgemm(torch.randn(2, 64).half(), lin.packed, lin.scale, lin.min, 16, 4, None)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_embedding_rows_are_gguf_dequantisation(qtype: str) -> None:
    """`BlockQuantEmbedding` reads rows out of the packed layout: GGUF's own dequantisation,
    for rows in full and partial groups of 16, in any order and repeated."""
    import gguf

    n, k = 37, 96
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype])
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).copy())
    lin = BlockQuantLinear(_group_quant(raw, qtype, n))
    ids = torch.tensor([36, 0, 15, 16, 31, 32, 5, 5, 36])
    assert torch.equal(BlockQuantEmbedding(lin, torch.float32)(ids), ref[ids])
    emb = BlockQuantEmbedding(lin, torch.bfloat16)
    assert torch.equal(emb(ids), ref[ids].bfloat16())
    assert emb(ids[:0]).shape == (0, k)
    assert emb.table is lin  # shares the head's blocks: no copy
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([3, 37]))  # 37 rows (packed as 48): the padding rows are no ids
