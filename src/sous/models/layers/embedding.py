"""The token embedding a model is built with before its weights load."""

from __future__ import annotations

import torch
from torch import nn

from sous.models.layers.linear import AnyWeight, GroupQuantWeight
from sous.models.layers.qgemm_linear import BlockQuantEmbedding, BlockQuantLinear, qgemm_ops


def unloaded_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Embedding:
    """An `nn.Embedding` whose weight is a meta tensor (no memory) the loader replaces.

    Built from an explicit weight so `nn.Embedding` skips its random init: on a meta tensor
    that init runs through torch's reference ops and imports torch._dynamo (over a second of
    start-up on a small CPU)."""
    weight = torch.empty(vocab_size, hidden_size, dtype=dtype, device="meta")
    return nn.Embedding(vocab_size, hidden_size, _weight=weight, _freeze=True)


def make_embedding(weight: AnyWeight, head: nn.Module | None, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
    """The token embedding for a loaded `weight`.

    A `GroupQuantWeight` (GGUF) stays in its blocks where `qgemm` runs on `device`
    (`BlockQuantEmbedding`): read from `head`'s packed weights when `head` (the tied output
    head) is a `BlockQuantLinear` over the same weight, else packed on its own. Anything else
    is one dense `[vocab, hidden]` table in `dtype`."""
    if isinstance(weight, GroupQuantWeight) and qgemm_ops(device) is not None:
        table = head if isinstance(head, BlockQuantLinear) else BlockQuantLinear(weight)
        return BlockQuantEmbedding(table, dtype)
    dense = weight.dequantize(dtype) if isinstance(weight, GroupQuantWeight) else weight
    dense = dense.to(device=device, dtype=dtype).contiguous()
    return nn.Embedding(dense.shape[0], dense.shape[1], _weight=dense, _freeze=True)
