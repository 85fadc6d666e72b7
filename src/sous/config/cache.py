from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory (on CPU: of available RAM) the engine may use for weights,
    activations and KV cache."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes; overrides --gpu-memory-utilization when set."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (testing)."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    """KV cache dtype. `auto` uses the model dtype."""
    enable_prefix_caching: bool = True
    """Reuse the KV of identical prompt prefixes (full blocks)."""
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    """Hash of a full block: sha256 (pickle) or sha256_cbor (canonical CBOR, cross-language)."""
