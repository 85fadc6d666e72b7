"""`DequantizedWeights`: a `(name, tensor)` stream of a quantised checkpoint -> dense weights.

The tensors of one quantised linear (the packed/fp8 weight and its scales) may arrive in any
order and from different shard files; each group is buffered only until it is complete, then
dequantised and yielded once as `<module>.weight`. Everything else passes through unchanged.

Each module's scheme comes from `QuantConfig.scheme_for` (one per checkpoint, or per layer for
ModelOpt MIXED_PRECISION). Per scheme, the tensors of a module `<m>`:

| scheme | grouped | dropped |
|---|---|---|
| fp8-block | `weight` (float8) + `weight_scale_inv` | `input_scale`, `activation_scale` |
| fp8-tensor | `weight` (float8) + `weight_scale` | `input_scale`, `activation_scale` |
| nvfp4 | `weight` (uint8) + `weight_scale` + `weight_scale_2` | `input_scale` |
| ct-nvfp4 | `weight_packed` + `weight_scale` + `weight_global_scale` | `input_global_scale`, all-zero `weight_zero_point` |

A module stored unquantised (ignore list, or absent from `quantized_layers`) must hold no
quantised tensor. KV-cache scales (`<attn>.k_scale`, `<attn>.k_proj.k_scale`, legacy
`kv_scale`, same for v) are collected into `kv_scales` for an fp8 KV cache and never yielded;
`q_scale`/`prob_scale` (fp8 attention activations) are dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from sous.models.quant.config import MODELOPT_MIXED, QuantConfig
from sous.models.quant.fp8_block import FP8_DTYPES, dequantize_fp8_block
from sous.models.quant.fp8_tensor import dequantize_fp8_tensor
from sous.models.quant.layers import (
    CT_NVFP4_SCHEME,
    FP8_BLOCK_SCHEME,
    FP8_TENSOR_SCHEME,
    NVFP4_SCHEME,
    LayerQuant,
)
from sous.models.quant.nvfp4 import dequantize_nvfp4

_FP8_DROPPED = ("input_scale", "activation_scale")
_GROUPED = {
    FP8_BLOCK_SCHEME: ("weight", "weight_scale_inv"),
    FP8_TENSOR_SCHEME: ("weight", "weight_scale"),
    NVFP4_SCHEME: ("weight", "weight_scale", "weight_scale_2"),
    CT_NVFP4_SCHEME: ("weight_packed", "weight_scale", "weight_global_scale"),
}
_DROPPED = {
    FP8_BLOCK_SCHEME: _FP8_DROPPED,
    FP8_TENSOR_SCHEME: _FP8_DROPPED,
    NVFP4_SCHEME: ("input_scale",),
    CT_NVFP4_SCHEME: ("input_global_scale",),
}
_QUANT_WEIGHT_DTYPES = {
    FP8_BLOCK_SCHEME: FP8_DTYPES,
    FP8_TENSOR_SCHEME: FP8_DTYPES,
    NVFP4_SCHEME: (torch.uint8,),
    CT_NVFP4_SCHEME: (),
}
_SCALE_LEAVES = frozenset(
    leaf for names in _GROUPED.values() for leaf in names if leaf != "weight"
)
_ANY_DROPPED = frozenset(leaf for names in _DROPPED.values() for leaf in names)
_ATTN_DROPPED = ("q_scale", "prob_scale")


class DequantizedWeights:
    """Iterable over dense `(hf_name, tensor)` pairs of a quantised checkpoint.

    `weights` is consumed once, lazily. Dequantised weights are new tensors in `dtype`; dense
    ones are the source tensors, untouched. After iteration `kv_scales` maps
    "<attention module>.k_scale" / ".v_scale" (e.g. "model.layers.0.self_attn.k_scale") to a
    float, `num_dequantized` counts the dequantised weights and `dequantized_by_scheme` splits
    that count by scheme ("fp8-tensor", "nvfp4", ...). Raises ValueError for a quantised tensor
    of a module stored unquantised, a malformed group, or groups still incomplete at the end
    of the stream."""

    def __init__(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: QuantConfig, dtype: torch.dtype
    ) -> None:
        self._weights = weights
        self.config = config
        self.dtype = dtype
        self.kv_scales: dict[str, float] = {}
        self.num_dequantized = 0
        self.dequantized_by_scheme: Counter[str] = Counter()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, tuple[LayerQuant, dict[str, torch.Tensor]]] = {}
        for name, t in self._weights:
            module, _, leaf = name.rpartition(".")
            layer = self.config.scheme_for(module)
            role = self._role(module, leaf, t, layer)
            if role == "dense":
                yield name, t
            elif role == "kv":
                self._record_kv_scale(module, leaf, t)
            elif role == "group":
                assert layer is not None
                parts = pending.setdefault(module, (layer, {}))[1]
                parts[leaf] = t
                if all(k in parts for k in _GROUPED[layer.scheme]):
                    del pending[module]
                    yield f"{module}.weight", self._dequantize(module, layer, parts)
                    self.num_dequantized += 1
                    self.dequantized_by_scheme[layer.scheme] += 1
        if pending:
            shown = "; ".join(
                f"{m}: has {sorted(p)}, {lq.algo} needs {', '.join(_GROUPED[lq.scheme])}"
                for m, (lq, p) in list(pending.items())[:5]
            )
            raise ValueError(
                f"{len(pending)} quantised module(s) lack tensors ({self.config.method}): {shown}"
            )

    def _role(self, module: str, leaf: str, t: torch.Tensor, layer: LayerQuant | None) -> str:
        """"group", "kv", "drop" or "dense" for one tensor of the stream."""
        if leaf in ("k_scale", "v_scale", "kv_scale"):
            return "kv"
        if leaf in _ATTN_DROPPED:
            return "drop"
        if layer is None:
            return self._unquantized_role(module, leaf, t)
        if leaf in _DROPPED[layer.scheme]:
            return "drop"
        if layer.scheme == CT_NVFP4_SCHEME and leaf == "weight_zero_point":
            if torch.count_nonzero(t):
                raise ValueError("asymmetric NVFP4 (non-zero weight_zero_point) is not supported")
            return "drop"
        if leaf == "weight":
            return "group" if t.dtype in _QUANT_WEIGHT_DTYPES[layer.scheme] else "dense"
        return "group" if leaf in _GROUPED[layer.scheme] else "dense"

    def _unquantized_role(self, module: str, leaf: str, t: torch.Tensor) -> str:
        """Role of a tensor of a module the config keeps unquantised: its weight must be
        dense; any scale tensor is an error naming why the module counts as unquantised."""
        quantized = leaf in _SCALE_LEAVES or (
            leaf == "weight" and (t.dtype in FP8_DTYPES or t.dtype == torch.uint8)
        )
        if leaf in _ANY_DROPPED and not quantized:
            return "drop"
        if not quantized:
            return "dense"
        if self.config.is_ignored(module):
            why = "is on the checkpoint's ignore list (modules kept unquantised)"
        elif self.config.method == MODELOPT_MIXED:
            why = "is not in the MIXED_PRECISION quantized_layers map (so kept unquantised)"
        else:
            why = "is not quantised by this checkpoint's config"
        raise ValueError(f"{module}.{leaf} is stored quantised but module {module!r} {why}")

    def _record_kv_scale(self, module: str, leaf: str, t: torch.Tensor) -> None:
        attn = module
        for proj in (".k_proj", ".v_proj"):
            if attn.endswith(proj):
                attn = attn[: -len(proj)]
        value = float(t.float().max())
        for kind in ("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,):
            self.kv_scales[f"{attn}.{kind}"] = value

    def _dequantize(
        self, module: str, layer: LayerQuant, parts: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        scheme = layer.scheme
        try:
            if scheme == FP8_BLOCK_SCHEME:
                block = self.config.weight_block_size
                assert block is not None
                return dequantize_fp8_block(
                    parts["weight"], parts["weight_scale_inv"], block, self.dtype
                )
            if scheme == FP8_TENSOR_SCHEME:
                return dequantize_fp8_tensor(parts["weight"], parts["weight_scale"], self.dtype)
            if scheme == NVFP4_SCHEME:
                return dequantize_nvfp4(
                    parts["weight"], parts["weight_scale"], parts["weight_scale_2"].float(),
                    self.dtype, layer.group_size,
                )
            global_scale = parts["weight_global_scale"].float().reshape(-1)
            return dequantize_nvfp4(
                parts["weight_packed"], parts["weight_scale"], global_scale.max(),
                self.dtype, layer.group_size, global_is_divisor=True,
            )
        except ValueError as e:
            raise ValueError(f"cannot dequantise {module} ({layer.algo}): {e}") from e
