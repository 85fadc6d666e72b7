"""Copies between sous' paged KV cache and LMCache memory objects: LMCache's
`GPUConnectorInterface`, for any device torch runs on.

The cache is one tensor per layer whose slots (`block_id * block_size + offset`) are rows of
`kv_size` planes: `[2, num_blocks, block_size, heads, head_size]` (K and V) or, for MLA,
`[num_blocks, block_size, entry]`. A memory object holds one chunk as
`[kv_size, num_layers, num_tokens, hidden]` (LMCache's KV_2LTD layout). Callers pass
`slot_mapping`: a LongTensor over the request's tokens; a slot of -1 means "leave this
token's KV alone" (it is already in the device cache, maybe shared with other requests).
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface


class PagedKVIO(GPUConnectorInterface):
    def __init__(self, kv_caches: list[torch.Tensor], kv_size: int, hidden: int) -> None:
        self.kv_size = kv_size
        self.hidden = hidden
        self.views = [c.view(kv_size, -1, hidden) for c in kv_caches]
        """Per layer `[kv_size, num_slots, hidden]`, aliasing the cache."""

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([self.kv_size, len(self.views), num_tokens, self.hidden])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Cache slots of tokens [start, end) -> `memory_obj` (every slot must be valid)."""
        slots = kwargs["slot_mapping"][start:end].to(self.views[0].device)
        out = memory_obj.tensor
        for layer, view in enumerate(self.views):
            out[:, layer, :end - start].copy_(view.index_select(1, slots))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """`memory_obj` -> cache slots of tokens [start, end), skipping slots of -1."""
        slots = kwargs["slot_mapping"][start:end].to(self.views[0].device)
        src = memory_obj.tensor[:, :, :end - start]
        keep = slots >= 0
        if not bool(keep.all()):
            slots, src = slots[keep], src[:, :, keep]
        src = src.to(self.views[0].device)
        for layer, view in enumerate(self.views):
            view.index_copy_(1, slots, src[:, layer])

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(obj, start, end, **kwargs)
