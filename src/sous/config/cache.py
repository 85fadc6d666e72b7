from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use for weights, activations and KV cache. On
    CPU the KV cache has a fixed size instead: --kv-cache-memory-bytes, else the environment
    variable VLLM_CPU_KVCACHE_SPACE (GiB), else 4 GiB, as in vLLM's CPU backend."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes; overrides --gpu-memory-utilization when set."""
    cpu_kvcache_space_bytes: int | None = None
    """KV cache size on CPU (from the environment variable VLLM_CPU_KVCACHE_SPACE, in GiB, as
    in vLLM; not a flag). --kv-cache-memory-bytes takes precedence."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (testing)."""
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3"] = "auto"
    """KV cache dtype: auto, bfloat16, fp8 (= fp8_e4m3, with per-layer scales). `auto` uses
    the model dtype, except for GGUF weights served quantised (the default for a GGUF file)
    with float32 activations, whose cache is bfloat16."""
    enable_prefix_caching: bool = True
    """Reuse the KV of identical prompt prefixes (full blocks)."""
    enable_sub_block_cache: bool = True
    """Sub-block prefix caching (vllm-rbln's, on by default): with prefix caching on and a
    block size that is a larger multiple of --max-num-batched-tokens, the partly matching block
    after the full-block hits is reused too, in sub-blocks of --max-num-batched-tokens tokens.
    Not a flag: `sous serve` takes it from the environment variable VLLM_RBLN_SUB_BLOCK_CACHE
    (1/0, true/false, yes/no, on/off); the offline `LLM` takes the keyword
    `enable_sub_block_cache`, else the variable."""
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    """Hash of a full block: sha256 (pickle) or sha256_cbor (canonical CBOR, cross-language)."""
