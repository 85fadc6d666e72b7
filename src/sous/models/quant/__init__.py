"""Quantised safetensors checkpoints, dequantised on load to the model's dtype.

Formats: DeepSeek-style FP8 block (`quant_method: fp8` + `weight_block_size`), ModelOpt NVFP4
(`quant_method: modelopt`, `quant_algo: NVFP4`, or `hf_quant_config.json`) and compressed-tensors
NVFP4 (`format: nvfp4-pack-quantized`). `detect_quant_config` reads the folder's config;
`DequantizedWeights` wraps the weight iterator handed to `model.load_weights`.
"""

from sous.models.quant.config import (
    CT_NVFP4,
    FP8,
    MODELOPT_NVFP4,
    SUPPORTED,
    QuantConfig,
    detect_quant_config,
)
from sous.models.quant.dequant import DequantizedWeights

__all__ = [
    "CT_NVFP4",
    "FP8",
    "MODELOPT_NVFP4",
    "SUPPORTED",
    "DequantizedWeights",
    "QuantConfig",
    "detect_quant_config",
]
