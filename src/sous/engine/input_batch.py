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

from sous.engine.sampler import RowPenalties, SamplingMetadata
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
        # Sampling settings, one entry per row (see `sampling_metadata`).
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no logprobs wanted."""
        self.needs_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.has_generator = np.zeros(max_num_reqs, dtype=bool)
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
        self._set_sampling(row, state)
        return row

    def _set_sampling(self, row: int, state: CachedRequestState) -> None:
        p = state.sampling_params
        self.greedy[row] = p.greedy
        self.temperature[row] = 1.0 if p.greedy else p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.needs_penalties[row] = p.needs_penalties
        self.has_generator[row] = state.generator is not None

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
                    self.num_blocks, self.greedy, self.temperature, self.top_p, self.top_k,
                    self.min_p, self.min_tokens, self.num_logprobs, self.needs_penalties,
                    self.has_generator):
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

    # ---------------------------------------------------------------- sampling
    def sampling_metadata(self, rows: np.ndarray, vocab_size: int, device: torch.device,
                          eos_token_ids: list[int]) -> SamplingMetadata:
        """The sampling settings of `rows` (in logits order) as tensors on `device`. Fields no
        row uses stay None, so an all-greedy step costs a few numpy reductions."""
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        md = SamplingMetadata(all_greedy=all_greedy)
        if not all_greedy:
            md.temperature = _tensor(self.temperature[rows], device)
            if greedy.any():
                md.is_greedy = torch.from_numpy(greedy).to(device)
            top_k = self.top_k[rows]
            if ((top_k > 0) & (top_k < vocab_size)).any():
                md.top_k = _tensor(np.where(top_k > 0, np.minimum(top_k, vocab_size),
                                            vocab_size), device)
            top_p = self.top_p[rows]
            if (top_p < 1.0).any():
                md.top_p = _tensor(top_p, device)
            min_p = self.min_p[rows]
            if (min_p > 0.0).any():
                md.min_p = _tensor(min_p, device)
            for i in np.nonzero(self.has_generator[rows])[0].tolist():
                md.generators[i] = self._state(rows[i]).generator  # type: ignore[assignment]
        k = self.num_logprobs[rows]
        if (k >= 0).any():
            md.max_num_logprobs = int(k.max())
        num_outputs = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        for i in np.nonzero(num_outputs < self.min_tokens[rows])[0].tolist():
            p = self._state(rows[i]).sampling_params
            md.banned_token_ids[i] = ([] if p.ignore_eos else list(eos_token_ids)) + list(
                p.stop_token_ids)
        for i in np.nonzero(self.needs_penalties[rows])[0].tolist():
            md.penalties.append(self._penalties(i, int(rows[i])))
        return md

    def _state(self, row: int) -> CachedRequestState:
        state = self.states[row]
        assert state is not None
        return state

    def _penalties(self, i: int, row: int) -> RowPenalties:
        p = self._state(row).sampling_params
        num_prompt, n = int(self.num_prompt_tokens[row]), int(self.num_tokens[row])
        ids = torch.from_numpy(self.token_ids[row, :n].copy())
        return RowPenalties(i, p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                            ids[:num_prompt], ids[num_prompt:])


def _tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)
