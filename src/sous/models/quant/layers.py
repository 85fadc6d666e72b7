"""Per-module quantisation schemes and ModelOpt MIXED_PRECISION's `quantized_layers` map.

ModelOpt writes `quantized_layers` as module name (the checkpoint's, without ".weight") ->
`{"quant_algo": "FP8"}` or `{"quant_algo": "NVFP4", "group_size": 16}`; a module not in the
map is unquantised. vLLM's `ModelOptMixedPrecisionConfig` looks a runtime prefix up directly,
then through its fused shards (`qkv_proj` -> q/k/v), then through child keys (a fused
`experts` module takes its experts' algorithm). sous loads per-module checkpoint tensors, so
`resolve_layer` walks the other way: exact name, the fused parent name, the name without the
expert index, then ancestors (a map keyed by `...mlp.experts` covers every expert).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

FP8_BLOCK_SCHEME = "fp8-block"
"""`weight` float8 + `weight_scale_inv` per tile (`fp8_block`)."""
FP8_TENSOR_SCHEME = "fp8-tensor"
"""`weight` float8 + `weight_scale` per tensor or per output row (`fp8_tensor`)."""
NVFP4_SCHEME = "nvfp4"
"""ModelOpt: `weight` uint8 + `weight_scale` e4m3 + `weight_scale_2` multiplier (`nvfp4`)."""
CT_NVFP4_SCHEME = "ct-nvfp4"
"""compressed-tensors: `weight_packed` + `weight_scale` + `weight_global_scale` divisor."""

_MIXED_ALGOS = {
    "FP8": FP8_TENSOR_SCHEME,
    "FP8_PER_CHANNEL_PER_TOKEN": FP8_TENSOR_SCHEME,
    "NVFP4": NVFP4_SCHEME,
    "W4A16_NVFP4": NVFP4_SCHEME,
}
_FUSED_PARENT = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "q_a_proj": "fused_qkv_a_proj",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj",
}


@dataclass(frozen=True)
class LayerQuant:
    """How one module's weight is stored: `scheme` (one of the *_SCHEME names), the
    checkpoint's algorithm name (for messages) and, for NVFP4, the elements per block scale."""

    scheme: str
    algo: str
    group_size: int = 16


def matches(pattern: str, module: str) -> bool:
    """Ignore-list matching: "re:<regex>", fnmatch wildcards, or an exact / dotted-suffix /
    dotted-prefix name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return (
        module == pattern
        or module.endswith("." + pattern)
        or module.startswith(pattern + ".")
    )


def parse_quantized_layers(raw: Mapping[str, Any]) -> dict[str, LayerQuant]:
    """`quantized_layers` -> module name -> LayerQuant. Values are `{"quant_algo": ...,
    "group_size"?: ...}` or a bare algorithm string; keys may end in ".weight" (dropped).
    Raises KeyError("layer '<name>' with quant_algo '<algo>'") for the first entry whose
    algorithm sous cannot dequantise."""
    out: dict[str, LayerQuant] = {}
    for name, info in raw.items():
        entry = info if isinstance(info, dict) else {"quant_algo": info}
        algo = str(entry.get("quant_algo") or "").upper()
        scheme = _MIXED_ALGOS.get(algo)
        if scheme is None:
            raise KeyError(f"layer {name!r} with quant_algo {algo or None!r}")
        size = int(entry.get("group_size") or 16) if scheme == NVFP4_SCHEME else 16
        out[name.removesuffix(".weight")] = LayerQuant(scheme, algo, size)
    return out


def _candidates(module: str) -> Iterator[str]:
    parts = module.split(".")
    names = [module]
    for i in range(len(parts) - 2):
        if parts[i] == "experts" and parts[i + 1].isdigit():
            names.append(".".join(parts[: i + 1] + parts[i + 2 :]))
    for name in names:
        yield name
        base, _, leaf = name.rpartition(".")
        if leaf in _FUSED_PARENT:
            yield f"{base}.{_FUSED_PARENT[leaf]}" if base else _FUSED_PARENT[leaf]
    for n in range(len(parts) - 1, 0, -1):
        yield ".".join(parts[:n])


def resolve_layer(layers: Mapping[str, LayerQuant], module: str) -> LayerQuant | None:
    """The entry of `layers` that covers checkpoint module `module` (e.g.
    "model.layers.1.mlp.experts.3.gate_proj"), or None when it is unquantised."""
    for name in _candidates(module):
        hit = layers.get(name)
        if hit is not None:
            return hit
    return None
