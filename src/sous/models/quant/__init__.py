"""Quantised safetensors checkpoints, dequantised on load to the model's dtype.

Formats: FP8 (`quant_method: fp8`, block-wise with `weight_block_size` or per-tensor
`weight_scale`), ModelOpt (`quant_method: modelopt` or `hf_quant_config.json`, `quant_algo`
NVFP4, FP8 / FP8_PER_CHANNEL_PER_TOKEN, or MIXED_PRECISION with a per-layer
`quantized_layers` map) and compressed-tensors NVFP4 (`format: nvfp4-pack-quantized`).
`detect_quant_config` reads the folder's config; `DequantizedWeights` wraps the weight iterator
handed to `model.load_weights`.
"""

from sous.models.quant.config import (
    CT_NVFP4,
    FP8,
    MODELOPT_FP8,
    MODELOPT_MIXED,
    MODELOPT_NVFP4,
    SUPPORTED,
    QuantConfig,
    detect_quant_config,
)
from sous.models.quant.dequant import DequantizedWeights
from sous.models.quant.layers import LayerQuant, resolve_layer

__all__ = [
    "CT_NVFP4",
    "FP8",
    "MODELOPT_FP8",
    "MODELOPT_MIXED",
    "MODELOPT_NVFP4",
    "SUPPORTED",
    "DequantizedWeights",
    "LayerQuant",
    "QuantConfig",
    "detect_quant_config",
    "resolve_layer",
]
