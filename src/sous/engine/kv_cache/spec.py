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


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On CPU the fill touches every page, so the memory is
    committed at start (the KV budget is held, not promised)."""
    return torch.zeros(shape, dtype=dtype, device=device)
