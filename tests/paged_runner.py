"""Drives a model step by step like the engine, for logit checks against a reference."""

from __future__ import annotations

import random

import torch

from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.engine.attention import AttentionMetadata
from sous.engine.kv_cache.cache_dtype import with_cache_dtype
from sous.models.loader import load_model

CPU = torch.device("cpu")

MIXED_PLANS = [
    {0: 12, 1: 20, 2: 16},
    {1: 1, 3: 7, 2: 1},
    {3: 10, 1: 1, 0: 6, 2: 1},
    {2: 1, 3: 9, 0: 1, 1: 1},
    {0: 1, 1: 1, 2: 1, 3: 1},
]
"""Tokens per sequence per step: a batch of three prefills; then prefill chunks (fresh, then
with cached context) alongside decodes, ordered so the decode tokens are not contiguous."""


class PagedRunner:
    """Drives a model step by step like the engine: per-sequence block tables (shuffled block
    ids, so tables are not contiguous), chunked prefill, decode, mixed batches."""

    def __init__(
        self, model: torch.nn.Module, block_size: int, num_blocks: int = 256, seed: int = 0,
        kv_cache_dtype: str = "auto",
    ):
        self.model = model
        self.block_size = block_size
        spec = with_cache_dtype(model.kv_cache_spec(), kv_cache_dtype)
        self.caches = spec.allocate(num_blocks, block_size, CPU)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute `chunks[seq]` (new token ids per sequence); returns per-sequence logits of
        every new token `[len(chunk), vocab]`."""
        seqs = list(chunks)
        qlens, slens, tables, ids = [], [], [], []
        for s in seqs:
            table = self.tables.setdefault(s, [])
            new_len = self.lens.get(s, 0) + len(chunks[s])
            while len(table) * self.block_size < new_len:
                table.append(self.free.pop())
            qlens.append(len(chunks[s]))
            slens.append(new_len)
            tables.append(list(table))
            ids.extend(chunks[s])
            self.lens[s] = new_len
        meta = AttentionMetadata.build(qlens, slens, tables, self.block_size, CPU)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), meta.positions, self.caches, meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for s, q in zip(seqs, qlens, strict=True):
            out[s] = logits[start : start + q]
            start += q
        return out


def load_ours(path, dtype: str = "float32") -> torch.nn.Module:
    """sous' model for a checkpoint folder, on the CPU."""
    return load_model(ModelConfig(model=str(path), dtype=dtype), LoadConfig(), CPU).model


def check_mixed_batches(runner: PagedRunner, seqs: dict[int, list[int]],
                        refs: dict[int, torch.Tensor], atol: float) -> dict[int, int]:
    """Run `MIXED_PLANS` over sequences 0-3 and compare every new token's logits with `refs`
    (full-sequence reference logits). Returns the tokens computed per sequence."""
    done = dict.fromkeys(seqs, 0)
    for plan in MIXED_PLANS:
        out = runner.step({s: seqs[s][done[s] : done[s] + n] for s, n in plan.items()})
        for s, n in plan.items():
            torch.testing.assert_close(out[s], refs[s][done[s] : done[s] + n], atol=atol, rtol=0)
            done[s] += n
    return done
