"""Rotary position embedding (NeoX / Llama "rotate half" layout) with a precomputed table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sous.engine.ops.build import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one dict with `rope_type` and `rope_theta`
    (transformers >= 5 keeps them in `rope_parameters`; older configs in `rope_theta` +
    `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def inv_freq_for(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq [head_dim/2] float32, attention_scaling)` exactly as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported yet; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv.float().to(torch.empty(0).device), float(scaling)  # the default device


class RotaryEmbedding(nn.Module):
    """RoPE tables for `max_positions` positions: `cos`/`sin` `[P, head_dim/2]` (float32) for the
    rotate-half layout and `freqs_cis` `[P, head_dim/2]` (complex64) for the interleaved one.
    Look the step's positions up once (`lookup` / `lookup_complex`), apply per layer."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = inv_freq_for(hf_config, head_dim)
        factors = getattr(hf_config, "rope_freq_factors", None)
        if factors is not None:  # llama.cpp's per-frequency divisors (Llama 3 long-context rope)
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
        self.head_dim = head_dim
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("freqs_cis", torch.complex(cos, sin), persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` of shape `[T, 1, head_dim/2]` in `dtype` for the given positions."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def lookup_complex(self, positions: torch.Tensor) -> torch.Tensor:
        """`cos + i sin` `[T, 1, head_dim/2]` (complex64) for the given positions."""
        return self.freqs_cis.index_select(0, positions).unsqueeze(1)

    def step(self, positions: torch.Tensor) -> RopeStep:
        """The step's angles for the interleaved layout, applied per layer by
        `RopeStep.rotate_interleaved`: on CPU one C++ pass over the rows, reading the tables by
        position; elsewhere the complex multiply of `apply_rotary_interleaved`."""
        ops = cpu_ops(positions.device)
        freqs_cis = None if ops is not None else self.lookup_complex(positions)
        return RopeStep(self, positions, freqs_cis, ops)


@dataclass
class RopeStep:
    """One step's rotary angles (see `RotaryEmbedding.step`), shared by the step's layers;
    the torch path fills `freqs_cis` on first use."""

    rotary: RotaryEmbedding
    positions: torch.Tensor
    freqs_cis: torch.Tensor | None
    """`[T, 1, head_dim/2]` complex64 (None: the C++ pass reads the tables itself)."""
    ops: Any = None

    def rotate_interleaved(self, x: torch.Tensor) -> torch.Tensor:
        """`apply_rotary_interleaved(x, freqs of the step's positions)`: a new tensor."""
        if self.ops is not None and x.dtype in (torch.float32, torch.bfloat16):
            r = self.rotary
            return self.ops.rotary_interleaved(x, r.cos, r.sin, self.positions)
        if self.freqs_cis is None:
            self.freqs_cis = self.rotary.lookup_complex(self.positions)
        return apply_rotary_interleaved(x, self.freqs_cis)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, H, D]` (rotate-half layout) by `cos`/`sin` `[T, 1, D/2]`; returns a new
    contiguous tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


def apply_rotary_interleaved(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, H, D]` whose rotary pairs are adjacent (`x[..., 2i]`, `x[..., 2i+1]`) by
    `freqs_cis` `[T, 1, D/2]`: one complex multiply. Returns a new contiguous tensor."""
    t, h, d = x.shape
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.view_as_real(torch.view_as_complex(xf.view(t, h, d // 2, 2)) * freqs_cis)
    return out.view(t, h, d) if x.dtype == torch.float32 else out.view(t, h, d).to(x.dtype)


def interleave_rows(n_rows: int, head_dim: int) -> torch.Tensor:
    """Row order turning q/k projection rows from the rotate-half layout (pairs `i`, `i + D/2`)
    into the interleaved layout (pairs `2i`, `2i+1`) per head -- llama.cpp's permutation. Dot
    products of q and k are unchanged when both get it."""
    n_head = n_rows // head_dim
    idx = torch.arange(n_rows)
    return idx.reshape(n_head, 2, head_dim // 2).transpose(1, 2).reshape(-1)
