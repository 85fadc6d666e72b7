"""How much KV a model keeps per token, and the tensors that hold it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Full-attention KV layout: per layer one tensor `[2, num_blocks, block_size, num_kv_heads,
    head_size]` (index 0 = keys, 1 = values). Slot `s` of the cache is block `s // block_size`,
    offset `s % block_size`. The runner owns the tensors; attention layers write new K/V into the
    slots named by `slot_mapping` and read only the blocks named in `block_tables`."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * elem

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers."""
        return self.bytes_per_token * block_size

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_size)
        return [_zeroed(shape, self.dtype, device) for _ in range(self.num_layers)]

    @staticmethod
    def copy_slots(caches: list[torch.Tensor], src: int, dst: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` slots of block `src` into block `dst`, in every layer."""
        for cache in caches:
            cache[:, dst, :num_tokens] = cache[:, src, :num_tokens]


_LAZY_ZERO_BYTES = 64 << 20
"""Above glibc's largest mmap threshold (32 MiB) a fresh CPU allocation is always a new
anonymous mapping, whose pages the kernel zeroes on first touch: `torch.empty` is then as
zeroed as `torch.zeros` but commits memory only as blocks are used."""


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu" and nbytes >= _LAZY_ZERO_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
