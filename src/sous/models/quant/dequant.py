"""`DequantizedWeights`: a `(name, tensor)` stream of a quantised checkpoint -> dense weights.

The tensors of one quantised linear (the packed/fp8 weight and its scales) may arrive in any
order and from different shard files; each group is buffered only until it is complete, then
dequantised and yielded once as `<module>.weight`. Everything else passes through unchanged.

Per method, the tensors of a module `<m>`:

| method | grouped | dropped |
|---|---|---|
| fp8 | `weight` (float8) + `weight_scale_inv` | `input_scale`, `activation_scale` |
| modelopt-nvfp4 | `weight` (uint8) + `weight_scale` + `weight_scale_2` | `input_scale` |
| compressed-tensors-nvfp4 | `weight_packed` + `weight_scale` + `weight_global_scale` | `input_global_scale`, all-zero `weight_zero_point` |

KV-cache scales (`<attn>.k_scale`, `<attn>.k_proj.k_scale`, legacy `kv_scale`, same for v) are
collected into `kv_scales` for an fp8 KV cache and never yielded; `q_scale`/`prob_scale`
(fp8 attention activations) are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from sous.models.quant.config import CT_NVFP4, FP8, MODELOPT_NVFP4, QuantConfig
from sous.models.quant.fp8_block import FP8_DTYPES, dequantize_fp8_block
from sous.models.quant.nvfp4 import dequantize_nvfp4

_GROUPED = {
    FP8: ("weight", "weight_scale_inv"),
    MODELOPT_NVFP4: ("weight", "weight_scale", "weight_scale_2"),
    CT_NVFP4: ("weight_packed", "weight_scale", "weight_global_scale"),
}
_DROPPED = {
    FP8: ("input_scale", "activation_scale"),
    MODELOPT_NVFP4: ("input_scale",),
    CT_NVFP4: ("input_global_scale",),
}
_ATTN_DROPPED = ("q_scale", "prob_scale")


class DequantizedWeights:
    """Iterable over dense `(hf_name, tensor)` pairs of a quantised checkpoint.

    `weights` is consumed once, lazily. Dequantised weights are new tensors in `dtype`; dense
    ones are the source tensors, untouched. After iteration `kv_scales` maps
    "<attention module>.k_scale" / ".v_scale" (e.g. "model.layers.0.self_attn.k_scale") to a
    float, and `num_dequantized` counts the dequantised weights. Raises ValueError for a
    quantised tensor of a module on the ignore list, a malformed group, or groups still
    incomplete at the end of the stream."""

    def __init__(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: QuantConfig, dtype: torch.dtype
    ) -> None:
        self._weights = weights
        self.config = config
        self.dtype = dtype
        self.kv_scales: dict[str, float] = {}
        self.num_dequantized = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        grouped = _GROUPED[self.config.method]
        for name, t in self._weights:
            module, _, leaf = name.rpartition(".")
            role = self._role(leaf, t)
            if role == "dense":
                yield name, t
            elif role == "kv":
                self._record_kv_scale(module, leaf, t)
            elif role == "group":
                if self.config.is_ignored(module):
                    raise ValueError(
                        f"{name} is stored quantised but module {module!r} is on the "
                        "checkpoint's ignore list (modules kept unquantised)"
                    )
                parts = pending.setdefault(module, {})
                parts[leaf] = t
                if all(k in parts for k in grouped):
                    del pending[module]
                    yield f"{module}.weight", self._dequantize(module, parts)
                    self.num_dequantized += 1
        if pending:
            shown = "; ".join(f"{m}: has {sorted(p)}" for m, p in list(pending.items())[:5])
            raise ValueError(
                f"{len(pending)} quantised module(s) lack tensors ({self.config.method} needs "
                f"{', '.join(grouped)} per module): {shown}"
            )

    def _role(self, leaf: str, t: torch.Tensor) -> str:
        """"group", "kv", "drop" or "dense" for one tensor of the stream."""
        method = self.config.method
        if leaf in ("k_scale", "v_scale", "kv_scale"):
            return "kv"
        if leaf in _ATTN_DROPPED or leaf in _DROPPED[method]:
            return "drop"
        if method == CT_NVFP4 and leaf == "weight_zero_point":
            if torch.count_nonzero(t):
                raise ValueError("asymmetric NVFP4 (non-zero weight_zero_point) is not supported")
            return "drop"
        if leaf == "weight":
            if method == FP8:
                return "group" if t.dtype in FP8_DTYPES else "dense"
            if method == MODELOPT_NVFP4:
                return "group" if t.dtype == torch.uint8 else "dense"
            return "dense"
        return "group" if leaf in _GROUPED[method] else "dense"

    def _record_kv_scale(self, module: str, leaf: str, t: torch.Tensor) -> None:
        attn = module
        for proj in (".k_proj", ".v_proj"):
            if attn.endswith(proj):
                attn = attn[: -len(proj)]
        value = float(t.float().max())
        for kind in ("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,):
            self.kv_scales[f"{attn}.{kind}"] = value

    def _dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.config
        try:
            if cfg.method == FP8:
                assert cfg.weight_block_size is not None
                return dequantize_fp8_block(
                    parts["weight"], parts["weight_scale_inv"], cfg.weight_block_size, self.dtype
                )
            if cfg.method == MODELOPT_NVFP4:
                return dequantize_nvfp4(
                    parts["weight"], parts["weight_scale"], parts["weight_scale_2"].float(),
                    self.dtype, cfg.group_size,
                )
            global_scale = parts["weight_global_scale"].float().reshape(-1)
            return dequantize_nvfp4(
                parts["weight_packed"], parts["weight_scale"], global_scale.max(),
                self.dtype, cfg.group_size, global_is_divisor=True,
            )
        except ValueError as e:
            raise ValueError(f"cannot dequantise {module} ({cfg.method}): {e}") from e
