"""How many KV blocks the engine gets (vLLM's `determine_available_memory` + block count).

On CUDA the budget is `--gpu-memory-utilization` of device memory minus what is in use; on
CPU it is a fixed size, as in vLLM's CPU backend: `--kv-cache-memory-bytes`, else
`VLLM_CPU_KVCACHE_SPACE` GiB, else 4 GiB. The CPU cache is allocated zeroed (touched) at
start, so the budget logged then is memory really held, not promised.
"""

from __future__ import annotations

import logging

import psutil
import torch

from sous.config.cache import CacheConfig
from sous.config.errors import ConfigError
from sous.engine.kv_cache.manager import cdiv

logger = logging.getLogger(__name__)

CPU_KVCACHE_SPACE_DEFAULT_BYTES = 4 << 30
"""vLLM-CPU's default KV cache space when VLLM_CPU_KVCACHE_SPACE is not set."""


def activation_bytes_estimate(hidden_size: int, vocab_size: int, max_num_batched_tokens: int,
                              max_num_seqs: int) -> int:
    """Rough peak activation memory of one step (hidden states, MLP intermediates, logits)."""
    per_token = hidden_size * 4 * 12
    return max_num_batched_tokens * per_token + min(max_num_seqs, max_num_batched_tokens) * vocab_size * 4 * 3


def budget_source(cache: CacheConfig, device: torch.device) -> str:
    """The flag or variable the KV budget comes from, as a user would change it."""
    if cache.kv_cache_memory_bytes is not None:
        return f"--kv-cache-memory-bytes {cache.kv_cache_memory_bytes}"
    if device.type == "cuda":
        return f"--gpu-memory-utilization {cache.gpu_memory_utilization}"
    if cache.cpu_kvcache_space_bytes is not None:
        return f"VLLM_CPU_KVCACHE_SPACE={cache.cpu_kvcache_space_bytes / 2**30:g}"
    return "the CPU default of 4 GiB (set VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes)"


def kv_cache_budget_bytes(cache: CacheConfig, device: torch.device, activation_bytes: int) -> int:
    """Bytes for the KV cache (see the module docstring). On CPU a budget larger than the
    memory available is a ConfigError naming where it came from."""
    if device.type == "cuda" and cache.kv_cache_memory_bytes is None:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return int(total * cache.gpu_memory_utilization) - used - activation_bytes
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif cache.cpu_kvcache_space_bytes is not None:
        budget = cache.cpu_kvcache_space_bytes
    else:
        budget = CPU_KVCACHE_SPACE_DEFAULT_BYTES
    if device.type == "cpu":
        available = psutil.virtual_memory().available
        if budget > available:
            raise ConfigError(
                f"KV cache budget {budget / 2**30:.2f} GiB ({budget_source(cache, device)}) is "
                f"more than the memory available ({available / 2**30:.2f} GiB): lower it.")
    return budget


def num_kv_blocks(cache: CacheConfig, page: int, device: torch.device,
                  activation_bytes: int) -> int:
    """Blocks of `page` bytes (one block across every KV layer) the budget holds."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    budget = kv_cache_budget_bytes(cache, device, activation_bytes)
    blocks = budget // page
    if blocks < 2:
        raise ConfigError(
            f"KV cache budget {max(budget, 0):,} B ({budget_source(cache, device)}) holds fewer "
            f"than 2 blocks of {page:,} B (--block-size {cache.block_size}); give it at least "
            f"{2 * page:,} B.")
    return int(blocks)


def check_max_model_len_fits(num_blocks: int, block_size: int, max_model_len: int,
                             source: str = "--kv-cache-memory-bytes") -> None:
    """One request of max_model_len tokens must fit (block 0 is the reserved null block)."""
    usable_tokens = (num_blocks - 1) * block_size
    if cdiv(max_model_len, block_size) > num_blocks - 1:
        raise ConfigError(
            f"--max-model-len {max_model_len} does not fit the KV cache, which holds "
            f"{usable_tokens} tokens ({source}): lower --max-model-len to at most "
            f"{usable_tokens} or give the KV cache more memory.")
