"""Which quantised checkpoint format a folder holds, from config.json `quantization_config`
(or ModelOpt's `hf_quant_config.json`), and which modules its ignore list keeps unquantised."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FP8 = "fp8"
MODELOPT_NVFP4 = "modelopt-nvfp4"
CT_NVFP4 = "compressed-tensors-nvfp4"
SUPPORTED = (
    "fp8 (block-wise, with weight_block_size)",
    "modelopt (quant_algo NVFP4)",
    "compressed-tensors (format nvfp4-pack-quantized)",
)
_CT_NVFP4_FORMAT = "nvfp4-pack-quantized"


@dataclass(frozen=True)
class QuantConfig:
    """A supported on-disk quantisation: `method` is FP8, MODELOPT_NVFP4 or CT_NVFP4."""

    method: str
    weight_block_size: tuple[int, int] | None = None
    """FP8 only: `[rows, cols]` of one scale tile."""
    group_size: int = 16
    """NVFP4 only: input elements per e4m3 block scale."""
    ignore: tuple[str, ...] = ()
    """Module patterns stored unquantised: exact names, dotted suffixes ("lm_head",
    "mlp.gate"), fnmatch wildcards ("model.layers.*.mlp.gate") or "re:<regex>"."""

    def is_ignored(self, module: str) -> bool:
        """True when `module` (e.g. "model.layers.0.mlp.gate") matches the ignore list."""
        return any(_matches(p, module) for p in self.ignore)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return (
        module == pattern
        or module.endswith("." + pattern)
        or module.startswith(pattern + ".")
    )


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
    if not block:
        raise _unsupported("quant_method 'fp8' without weight_block_size (per-tensor FP8)")
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"invalid weight_block_size {block!r}: expected [rows, cols]")
    ignore = _strings(qc.get("modules_to_not_convert"), qc.get("ignored_layers"))
    return QuantConfig(FP8, weight_block_size=(int(block[0]), int(block[1])), ignore=ignore)


def _modelopt(qc: dict[str, Any]) -> QuantConfig:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "")
    if algo.upper() != "NVFP4":
        raise _unsupported(f"quant_method 'modelopt' with quant_algo {algo or None!r}")
    ignore = _strings(inner.get("exclude_modules"), inner.get("ignore"))
    return QuantConfig(MODELOPT_NVFP4, group_size=int(inner.get("group_size") or 16), ignore=ignore)


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
    (ModelOpt's own file; also used when config.json names `modelopt` without `quant_algo`).
    Raises ValueError naming the method and listing the supported ones when it is not one."""
    qc = raw_config.get("quantization_config")
    hf_quant = folder / "hf_quant_config.json"
    side = json.loads(hf_quant.read_text()) if hf_quant.is_file() else None
    if qc is None and side is None:
        return None
    if qc is None or (
        qc.get("quant_method") == "modelopt" and not qc.get("quant_algo") and side is not None
    ):
        return _modelopt(side or {})
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "modelopt":
        return _modelopt(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _unsupported(f"quant_method {method!r} (config.json quantization_config)")
