"""Which quantised checkpoint format a folder holds, from config.json `quantization_config`
(or ModelOpt's `hf_quant_config.json`), which modules its ignore list keeps unquantised, and,
per module, which on-disk tensor scheme (`LayerQuant`) its quantised weight uses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sous.models.quant.layers import (
    CT_NVFP4_SCHEME,
    FP8_BLOCK_SCHEME,
    FP8_TENSOR_SCHEME,
    NVFP4_SCHEME,
    LayerQuant,
    matches,
    parse_quantized_layers,
    resolve_layer,
)

FP8 = "fp8"
MODELOPT_FP8 = "modelopt-fp8"
MODELOPT_NVFP4 = "modelopt-nvfp4"
MODELOPT_MIXED = "modelopt-mixed"
CT_NVFP4 = "compressed-tensors-nvfp4"
SUPPORTED = (
    "fp8 (block-wise with weight_block_size, or per-tensor weight_scale)",
    "modelopt (quant_algo NVFP4, FP8, FP8_PER_CHANNEL_PER_TOKEN, or MIXED_PRECISION with "
    "per-layer NVFP4 / W4A16_NVFP4 / FP8 / FP8_PER_CHANNEL_PER_TOKEN)",
    "compressed-tensors (format nvfp4-pack-quantized)",
)
_CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
_MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


@dataclass(frozen=True)
class QuantConfig:
    """A supported on-disk quantisation: `method` is FP8, MODELOPT_FP8, MODELOPT_NVFP4,
    MODELOPT_MIXED or CT_NVFP4."""

    method: str
    weight_block_size: tuple[int, int] | None = None
    """FP8 only: `[rows, cols]` of one scale tile; None for per-tensor `weight_scale`."""
    group_size: int = 16
    """NVFP4 only: input elements per e4m3 block scale."""
    ignore: tuple[str, ...] = ()
    """Module patterns stored unquantised: exact names, dotted suffixes ("lm_head",
    "mlp.gate"), fnmatch wildcards ("model.layers.*.mlp.gate") or "re:<regex>"."""
    layers: dict[str, LayerQuant] = field(default_factory=dict, compare=False, repr=False)
    """MODELOPT_MIXED only: ModelOpt's `quantized_layers`, module name -> its scheme. A module
    resolves through `resolve_layer` (exact name, fused parent, expert-less name, ancestor);
    one that resolves to nothing is unquantised."""

    def is_ignored(self, module: str) -> bool:
        """True when `module` (e.g. "model.layers.0.mlp.gate") matches the ignore list."""
        return any(matches(p, module) for p in self.ignore)

    def scheme_for(self, module: str) -> LayerQuant | None:
        """How `module`'s weight is stored, or None when it is stored unquantised."""
        if self.is_ignored(module):
            return None
        if self.method == MODELOPT_MIXED:
            return resolve_layer(self.layers, module)
        if self.method == FP8:
            if self.weight_block_size is None:
                return LayerQuant(FP8_TENSOR_SCHEME, "fp8")
            return LayerQuant(FP8_BLOCK_SCHEME, "fp8")
        if self.method == MODELOPT_FP8:
            return LayerQuant(FP8_TENSOR_SCHEME, "FP8")
        if self.method == MODELOPT_NVFP4:
            return LayerQuant(NVFP4_SCHEME, "NVFP4", self.group_size)
        return LayerQuant(CT_NVFP4_SCHEME, "nvfp4-pack-quantized", self.group_size)


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"unsupported quantization: {what}. sous loads these quantised checkpoint formats: "
        f"{'; '.join(SUPPORTED)}"
    )


def _strings(*values: Any) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, list | tuple):
            out.extend(str(x) for x in v)
    return tuple(dict.fromkeys(out))


def _fp8(qc: dict[str, Any]) -> QuantConfig:
    block = qc.get("weight_block_size")
    ignore = _strings(qc.get("modules_to_not_convert"), qc.get("ignored_layers"))
    if not block:
        return QuantConfig(FP8, ignore=ignore)
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"invalid weight_block_size {block!r}: expected [rows, cols]")
    return QuantConfig(FP8, weight_block_size=(int(block[0]), int(block[1])), ignore=ignore)


def _section(qc: dict[str, Any]) -> dict[str, Any]:
    inner = qc.get("quantization")
    return inner if isinstance(inner, dict) else qc


def _modelopt(qc: dict[str, Any], side: dict[str, Any] | None) -> QuantConfig:
    """`qc` is config.json's `quantization_config` (or the side file itself); `side` is
    `hf_quant_config.json`, consulted for a MIXED_PRECISION map config.json lacks."""
    inner = _section(qc)
    algo = str(inner.get("quant_algo") or "").upper()
    ignore = _strings(inner.get("exclude_modules"), inner.get("ignore"))
    if algo == "NVFP4":
        size = int(inner.get("group_size") or 16)
        return QuantConfig(MODELOPT_NVFP4, group_size=size, ignore=ignore)
    if algo in _MODELOPT_FP8_ALGOS:
        return QuantConfig(MODELOPT_FP8, ignore=ignore)
    if algo != "MIXED_PRECISION":
        raise _unsupported(f"quant_method 'modelopt' with quant_algo {algo or None!r}")
    raw = inner.get("quantized_layers") or _section(side or {}).get("quantized_layers")
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            "modelopt quant_algo MIXED_PRECISION needs a non-empty 'quantized_layers' map "
            "(config.json quantization_config or hf_quant_config.json)"
        )
    try:
        layers = parse_quantized_layers(raw)
    except KeyError as e:
        raise _unsupported(f"quant_method 'modelopt' MIXED_PRECISION {e.args[0]}") from None
    return QuantConfig(MODELOPT_MIXED, ignore=ignore, layers=layers)


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    top = qc.get("format")
    groups = qc.get("config_groups") or {}
    formats = {g.get("format") or top for g in groups.values()} if groups else {top}
    if formats != {_CT_NVFP4_FORMAT}:
        shown = ", ".join(sorted(str(f) for f in formats))
        raise _unsupported(f"quant_method 'compressed-tensors' with format {shown}")
    sizes = {int((g.get("weights") or {}).get("group_size") or 16) for g in groups.values()}
    if len(sizes) > 1:
        raise ValueError(f"compressed-tensors config_groups mix group sizes {sorted(sizes)}")
    size = sizes.pop() if sizes else 16
    return QuantConfig(CT_NVFP4, group_size=size, ignore=_strings(qc.get("ignore")))


def detect_quant_config(folder: Path, raw_config: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's quantisation, or None for a dense checkpoint.

    Reads `raw_config["quantization_config"]`, falling back to `folder/hf_quant_config.json`
    (ModelOpt's own file; also used when config.json names `modelopt` without `quant_algo`, or
    MIXED_PRECISION without `quantized_layers`). Raises ValueError naming the method (for
    MIXED_PRECISION: the first layer with an unsupported algorithm, and that algorithm) and
    listing the supported ones when it is not one."""
    qc = raw_config.get("quantization_config")
    hf_quant = folder / "hf_quant_config.json"
    side = json.loads(hf_quant.read_text()) if hf_quant.is_file() else None
    if qc is None and side is None:
        return None
    if qc is None or (
        qc.get("quant_method") == "modelopt" and not qc.get("quant_algo") and side is not None
    ):
        return _modelopt(side or {}, None)
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "modelopt":
        return _modelopt(qc, side)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _unsupported(f"quant_method {method!r} (config.json quantization_config)")
