"""The C++ elementwise layer ops (`sous_ops.rms_norm`, `rotary_interleaved`, `silu_and_mul`)
against the torch forms they replace on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sous.engine.ops.build import cpu_ops
from sous.models.layers.activation import silu_and_mul
from sous.models.layers.norm import RMSNorm
from sous.models.layers.rotary import apply_rotary_interleaved

OPS = cpu_ops("cpu")
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ ops are not built on this machine")
DTYPES = [torch.float32, torch.bfloat16]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: a few ulps; bfloat16: the same value up to one rounding step."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-6 if out.dtype == torch.float32 else 2**-7
    err = ((out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1.0)).max().item()
    assert err <= tol, err


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm's eager form: float32 in one op; bfloat16 normalised in float32, rounded, scaled."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, 1e-5)
    return F.rms_norm(x.float(), w.shape, None, 1e-5).to(x.dtype) * w


@pytest.mark.parametrize("hidden", [96, 40])  # 16-lane vector rows (AVX-512), scalar rows
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    wide = torch.randn(7, 200, generator=g).to(dtype)
    x = wide[:, 10:10 + hidden]  # rows of a wider tensor, as a slice of a fused projection
    res = torch.randn(7, hidden, generator=g).to(dtype)
    x0, res0 = x.clone(), res.clone()
    out, summed = norm(x, res)
    assert torch.equal(summed, x + res)
    _close(out, _torch_rms_norm(x + res, norm.weight))
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs are not modified
    _close(norm(x), _torch_rms_norm(x, norm.weight))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_interleaved_matches_the_complex_form(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 5, 300, 17])
    half = 32
    angles = torch.arange(400)[:, None] * torch.rand(half, generator=g)[None, :]
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(5, 7 * 64 + 64, generator=g).to(dtype)
    x = qkv[:, : 7 * 64].view(5, 7, 64)  # strided rows, as the models pass q/k
    out = OPS.rotary_interleaved(x, cos, sin, positions)
    ref = apply_rotary_interleaved(x, torch.complex(cos, sin)[positions].unsqueeze(1))
    _close(out, ref)
    with pytest.raises(RuntimeError, match="outside the table"):
        OPS.rotary_interleaved(x, cos, sin, torch.tensor([0, 1, 2, 3, 400]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    x = (torch.randn(9, 2 * 70, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    d = 70
    ref = F.silu(x[:, :d]) * x[:, d:]
    _close(silu_and_mul(x), ref)
    assert torch.equal(silu_and_mul(x[3:4]), silu_and_mul(x)[3:4])  # rows are independent
