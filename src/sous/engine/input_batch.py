"""The worker's persistent batch: preallocated host arrays for the requests it is running.

Rows `0..num_reqs-1` hold the requests in the batch, densely (`condense()` fills holes after
removals). Each row keeps the request's token ids (prompt, then outputs as the worker samples
them), its progress, its block table and its sampling settings, so a step's inputs are built
with a few vectorised gathers instead of from Python lists. Requests the worker knows but
that are paused (preempted) keep their `CachedRequestState` outside the batch.

Owned by the worker's ModelRunner; nothing else mutates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sous.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker knows of one request, whether or not it is in the batch now."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows of host arrays; see the module docstring. `max_num_blocks` is per request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max(max_num_blocks, 1)), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self._holes: list[int] = []
        self._num_rows = 0

    # ---------------------------------------------------------------- membership
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add(self, state: CachedRequestState) -> int:
        """Put `state` in a free row (a hole first); returns the row."""
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if self._holes:
            row = self._holes.pop()
        else:
            if self._num_rows >= self.max_num_reqs:
                raise ValueError(f"the batch holds at most {self.max_num_reqs} requests")
            row = self._num_rows
            self._num_rows += 1
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[row] = state
        n = state.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {n} tokens > max_model_len")
        self.token_ids[row, :len(state.prompt_token_ids)] = state.prompt_token_ids
        self.token_ids[row, len(state.prompt_token_ids):n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.set_block_ids(row, state.block_ids)
        p = state.sampling_params
        self.temperature[row] = 1.0 if p.greedy else p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        return row

    def remove(self, req_id: str) -> CachedRequestState | None:
        """Take `req_id` out of the batch (its row becomes a hole until `condense`)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        state = self.states[row]
        self.req_ids[row] = None
        self.states[row] = None
        self._holes.append(row)
        return state

    def condense(self) -> None:
        """Move the last rows into the holes so rows 0..num_reqs-1 are all in use."""
        holes = sorted(h for h in self._holes if h < self._num_rows)
        self._holes = []
        last = self._num_rows - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move(last, hole)
            last -= 1
        self._num_rows = self.num_reqs

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                    self.num_blocks, self.temperature, self.top_p, self.top_k, self.min_p):
            arr[dst] = arr[src]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = dst

    # ---------------------------------------------------------------- per-step updates
    def set_block_ids(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        if n > self.block_table.shape[1]:
            raise ValueError(f"{n} blocks > the block table's {self.block_table.shape[1]}")
        self.block_table[row, :n] = block_ids
        self.num_blocks[row] = n

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"{end} blocks > the block table's {self.block_table.shape[1]}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
