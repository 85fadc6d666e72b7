"""Expert parallel routed experts: each rank of a process group holds a contiguous block of
the routed experts and the tokens of every rank pass through the experts' owners.

Contract of `ep_moe_forward` (called by `FusedMoE.forward` when it has a placement): every
rank of `group` calls it once per MoE layer per step, with its own tokens (any number, zero
included: an idle rank still takes part). It returns this rank's rows of the same weighted
expert sum `fused_experts` computes over all experts, with the same numerics: the routing is
computed for all ranks' tokens on every rank (the router is replicated), every routed
(token, expert) row is computed once, by the expert's owner, over all the tokens routed to
that expert, and each rank sums its tokens' rows in increasing expert id into a zero tensor,
as `fused_experts` does. Communication: two all-gathers of the tokens (sizes, then rows) and
one of the expert rows (dispatch and combine over gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertPlacement:
    """Which routed experts rank `rank` of `size` holds: a contiguous block, the first
    `num_experts % size` ranks one more than the others."""

    rank: int
    size: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"expert parallel rank {self.rank} outside 0..{self.size - 1}")
        if self.size > self.num_experts:
            raise ValueError(f"{self.size} expert parallel ranks for {self.num_experts} "
                             "experts: every rank needs at least one")

    def bounds(self, rank: int) -> tuple[int, int]:
        """`[start, end)` expert ids of `rank`."""
        per, extra = divmod(self.num_experts, self.size)
        start = rank * per + min(rank, extra)
        return start, start + per + (1 if rank < extra else 0)

    @property
    def start(self) -> int:
        return self.bounds(self.rank)[0]

    @property
    def end(self) -> int:
        return self.bounds(self.rank)[1]

    @property
    def count(self) -> int:
        return self.end - self.start

    def local_id(self, expert_id: int) -> int | None:
        """This rank's index of global expert `expert_id`, or None if another rank holds it."""
        return expert_id - self.start if self.start <= expert_id < self.end else None


_CURRENT: tuple[int, int, Any] | None = None
"""(rank, size, group) while `expert_parallel` is active."""


@contextmanager
def expert_parallel(rank: int, size: int, group: Any) -> Iterator[None]:
    """MoE layers built inside hold rank `rank`'s block of experts and run their experts over
    `group` (the worker wraps model loading in it: the model code needs no change)."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, (rank, size, group)
    try:
        yield
    finally:
        _CURRENT = previous


def current_placement(num_experts: int) -> tuple[ExpertPlacement | None, Any]:
    """(placement, group) for a MoE layer of `num_experts` built now; (None, None) outside
    `expert_parallel`."""
    if _CURRENT is None:
        return None, None
    rank, size, group = _CURRENT
    return ExpertPlacement(rank, size, num_experts), group


def _all_gather_rows(rows: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """Every rank's `rows` (rank r has `sizes[r]` of them), concatenated in rank order."""
    longest = max(sizes)
    if longest == 0:
        return rows.new_empty((0, *rows.shape[1:]))
    padded = rows.new_zeros((longest, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def ep_moe_forward(x: torch.Tensor, moe: Any, placement: ExpertPlacement, group: Any,
                   ) -> torch.Tensor:
    """This rank's `[T, H]` output of `moe` (a `FusedMoE` holding `placement`'s experts) for
    its tokens `x` `[T, H]` (see the module docstring)."""
    from sous.models.layers.moe import expert_rows, select_experts

    count = torch.tensor([x.shape[0]], dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(placement.size)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    x_all = _all_gather_rows(x, sizes, group)
    logits = torch.nn.functional.linear(x_all.to(moe.gate_weight.dtype), moe.gate_weight).float()
    weights, ids = select_experts(logits, moe.e_score_correction_bias, moe.cfg)
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_idx = order // k
    sorted_ids = flat_ids.index_select(0, order)
    sorted_weights = weights.reshape(-1).index_select(0, order)
    per_rank = [int(((sorted_ids >= lo) & (sorted_ids < hi)).sum())
                for lo, hi in (placement.bounds(r) for r in range(placement.size))]
    lo = sum(per_rank[: placement.rank])
    hi = lo + per_rank[placement.rank]
    local_counts = torch.bincount(sorted_ids[lo:hi] - placement.start,
                                  minlength=placement.count)
    ys = expert_rows(x_all.index_select(0, token_idx[lo:hi]), moe.w13, moe.w2,
                     sorted_weights[lo:hi], local_counts)
    ys_all = _all_gather_rows(ys, per_rank, group)
    out = torch.zeros_like(x_all)
    out.index_add_(0, token_idx, ys_all)
    first = sum(sizes[: placement.rank])
    return out[first: first + x.shape[0]]
