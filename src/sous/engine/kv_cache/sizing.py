"""How many KV blocks the engine gets (vLLM's `determine_available_memory` + block count)."""

from __future__ import annotations

import logging

import psutil
import torch

from sous.config.cache import CacheConfig
from sous.engine.kv_cache.manager import cdiv
from sous.engine.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)


def activation_bytes_estimate(hidden_size: int, vocab_size: int, max_num_batched_tokens: int,
                              max_num_seqs: int) -> int:
    """Rough peak activation memory of one step (hidden states, MLP intermediates, logits)."""
    per_token = hidden_size * 4 * 12
    return max_num_batched_tokens * per_token + min(max_num_seqs, max_num_batched_tokens) * vocab_size * 4 * 3


def kv_cache_budget_bytes(cache: CacheConfig, device: torch.device, activation_bytes: int) -> int:
    """Bytes left for the KV cache: `--kv-cache-memory-bytes`, else `--gpu-memory-utilization`
    of device memory minus what is already used and the activation estimate. On CPU the base
    is the memory available (weights are already loaded, so they are not counted twice)."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return int(total * cache.gpu_memory_utilization) - used - activation_bytes
    available = psutil.virtual_memory().available
    return int(available * cache.gpu_memory_utilization) - activation_bytes


def num_kv_blocks(cache: CacheConfig, spec: KVCacheSpec, device: torch.device,
                  activation_bytes: int) -> int:
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    budget = kv_cache_budget_bytes(cache, device, activation_bytes)
    blocks = budget // spec.page_bytes(cache.block_size)
    if blocks < 2:
        raise ValueError(
            f"No memory left for the KV cache ({budget / 2**30:.2f} GiB after weights and "
            "activations). Raise --gpu-memory-utilization or set --kv-cache-memory-bytes.")
    return int(blocks)


def check_max_model_len_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """One request of max_model_len tokens must fit (block 0 is the reserved null block)."""
    usable_tokens = (num_blocks - 1) * block_size
    if cdiv(max_model_len, block_size) > num_blocks - 1:
        raise ValueError(
            f"The model's max seq len ({max_model_len}) is larger than the maximum number of "
            f"tokens that can be stored in the KV cache ({usable_tokens}). Try increasing "
            "--gpu-memory-utilization or --kv-cache-memory-bytes, or decreasing --max-model-len "
            f"(estimated maximum: {usable_tokens}).")
