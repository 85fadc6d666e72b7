"""One step's token bitmask for the structured rows, and its application to logits.

Bit j of row i set = token j allowed for request `req_ids[i]` (xgrammar's packed int32
layout, `ceil(vocab / 32)` words per row). Rows of requests not listed are left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarOutput:
    """Built by the StructuredOutputManager after scheduling; read by the runner."""

    req_ids: list[str]
    bitmask: torch.Tensor
    """[len(req_ids), ceil(vocab / 32)] int32 on CPU; row i belongs to `req_ids[i]`."""
    vocab_size: int

    def apply(self, logits: torch.Tensor, row_req_ids: list[str]) -> None:
        """Mask (to -inf, in place) the disallowed tokens of every structured row of `logits`
        [B, V] whose request id is `row_req_ids[b]`. Ids of the model's vocabulary beyond the
        bitmask's (`V > vocab_size`) are masked too for those rows."""
        where = {rid: i for i, rid in enumerate(row_req_ids)}
        src, dst = [], []
        for i, rid in enumerate(self.req_ids):
            b = where.get(rid)
            if b is not None:
                src.append(i)
                dst.append(b)
        if not dst:
            return
        import xgrammar as xgr  # only once a structured request runs
        full = self.bitmask.new_full((logits.shape[0], self.bitmask.shape[1]), -1)
        full[dst] = self.bitmask[src]
        full = full.to(logits.device, non_blocking=True)
        if logits.dtype != torch.float32:
            masked = logits.float()
            xgr.apply_token_bitmask_inplace(masked, full, vocab_size=self.vocab_size,
                                            indices=dst)
            logits.copy_(masked)
        else:
            xgr.apply_token_bitmask_inplace(logits, full, vocab_size=self.vocab_size,
                                            indices=dst)
        if logits.shape[1] > self.vocab_size:
            logits[dst, self.vocab_size:] = float("-inf")
