"""StageLink: how a pipeline stage hands its hidden states to the next one.

The stages of one engine form a torch.distributed process group (gloo on CPU; NCCL when
every stage has its own CUDA device), rank = stage. After its layers, a stage sends the
next one a header `[num_tokens, hidden_size, has_residual, dtype]` and then the hidden
states and the residual (`IntermediateTensors`), with non-blocking sends so it can start its
next micro-batch at once; the next send waits for the previous one. A stage receives in the
same order, so the k-th batch a stage runs is the k-th its predecessor sent: every stage
runs every batch of the engine in the order the engine submitted them.

With a KV connector, the stages agree on a step's failed loads (`agree_load_errors`, an
all-gather) before its forward pass whenever the step loads KV; such a step waits for the
stage behind, so its micro-batch does not overlap the one before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from sous.engine.dp.lockstep import init_dp_group
from sous.models.pipeline import IntermediateTensors, StagePosition

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def group_backend(device: torch.device, size: int) -> str:
    """NCCL when each of `size` stages can have its own CUDA device, else gloo."""
    if device.type == "cuda" and torch.cuda.device_count() >= size:
        return "nccl"
    return "gloo"


class StageLink(StagePosition):
    """Point-to-point sends between consecutive stages (module docstring). Owns the process
    group of this process; `close()` leaves it."""

    def __init__(self, rank: int, size: int, host: str, port: int,
                 device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        backend = group_backend(device, size)
        self.wire_device = device if backend == "nccl" else torch.device("cpu")
        """Where the tensors travel from (gloo sends host memory)."""
        init_dp_group(host, port, rank, size, label="Pipeline parallel", backend=backend)
        self._sending: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensors: IntermediateTensors) -> None:
        """Hand `tensors` to the next stage; returns once the previous send has completed."""
        self.wait_sent()
        h, residual = tensors.hidden_states, tensors.residual
        header = torch.tensor([h.shape[0], h.shape[1], residual is not None,
                               _DTYPES.index(h.dtype)], dtype=torch.long,
                              device=self.wire_device)
        parts = [header, h] + ([] if residual is None else [residual])
        dst = self.rank + 1
        for t in parts:
            t = t.to(self.wire_device).contiguous()
            self._sending.append((dist.isend(t, dst), t))

    def wait_sent(self) -> None:
        """Block until every send so far has completed."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()

    def recv(self) -> IntermediateTensors:
        """The next `IntermediateTensors` the previous stage sent, on this stage's device."""
        src = self.rank - 1
        header = torch.empty(4, dtype=torch.long, device=self.wire_device)
        dist.recv(header, src)
        num_tokens, hidden_size, has_residual, dtype = header.tolist()
        shape, dtype = (num_tokens, hidden_size), _DTYPES[dtype]
        h = torch.empty(shape, dtype=dtype, device=self.wire_device)
        dist.recv(h, src)
        residual = None
        if has_residual:
            residual = torch.empty(shape, dtype=dtype, device=self.wire_device)
            dist.recv(residual, src)
        to = self.device
        return IntermediateTensors(h.to(to), None if residual is None else residual.to(to))

    def agree_load_errors(self, errors: dict[str, int]) -> dict[str, int]:
        """Every stage's KV load errors (request -> tokens whose KV is valid), merged: a
        request any stage could not load sits the step out on every stage, so the stages
        run the same batch. A collective: every stage calls it in the same step."""
        gathered: list[dict[str, int] | None] = [None] * self.size
        dist.all_gather_object(gathered, errors)
        merged: dict[str, int] = {}
        for stage_errors in gathered:
            for rid, valid in (stage_errors or {}).items():
                merged[rid] = min(valid, merged.get(rid, valid))
        return merged

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
