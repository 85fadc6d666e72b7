"""One step's flattened model inputs, gathered from the persistent InputBatch with numpy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sous.engine.input_batch import InputBatch


class StepInputs:
    """Per scheduled request (in step order): its batch row, query length (tokens computed
    now), sequence length after the step, and how many positions need logits; per token: its
    id and position. `logits_indices` are token indices into the flattened step."""

    def __init__(self, req_ids: list[str], rows: np.ndarray, query_lens: np.ndarray,
                 computed: np.ndarray, num_logits: np.ndarray, token_ids: np.ndarray,
                 positions: np.ndarray, logits_indices: np.ndarray) -> None:
        self.req_ids = req_ids
        self.rows = rows
        self.query_lens = query_lens
        self.seq_lens = computed + query_lens
        self.num_logits = num_logits
        self.token_ids = token_ids
        self.positions = positions
        self.logits_indices = logits_indices

    def num_blocks(self, block_size: int) -> np.ndarray:
        return (self.seq_lens + block_size - 1) // block_size

    def sampling_positions(self) -> list[int]:
        """Indices (into `req_ids`) of the requests that get logits this step."""
        return np.nonzero(self.num_logits)[0].tolist()


def logits_counts(seq_lens: np.ndarray, num_tokens: np.ndarray,
                  num_spec: np.ndarray) -> np.ndarray:
    """Per request: how many positions need logits this step. A request samples once the
    step reaches the end of its known tokens plus its drafts; it then needs logits at its
    k draft positions and at the token before them (1 + k); mid-prefill it needs none."""
    return np.where(seq_lens >= num_tokens + num_spec, 1 + num_spec, 0)


def build_step_inputs(batch: InputBatch, req_ids: list[str],
                      num_scheduled_tokens: Mapping[str, int],
                      spec_tokens: Mapping[str, list[int]]) -> StepInputs:
    """Gather the step's inputs for `req_ids` (each in the batch). Draft tokens are written
    into the rows after the known tokens (not counted in `num_tokens`)."""
    n = len(req_ids)
    rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=n)
    query_lens = np.fromiter((num_scheduled_tokens[r] for r in req_ids), dtype=np.int64,
                             count=n)
    num_spec = np.zeros(n, dtype=np.int64)
    for i, rid in enumerate(req_ids):
        drafts = spec_tokens.get(rid)
        if drafts:
            row = rows[i]
            known = int(batch.num_tokens[row])
            batch.token_ids[row, known:known + len(drafts)] = drafts
            num_spec[i] = len(drafts)
    computed = batch.num_computed_tokens[rows]
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    positions = (np.arange(num_tokens, dtype=np.int64)
                 - np.repeat(qsl[:-1] - computed, query_lens))
    token_ids = batch.token_ids[np.repeat(rows, query_lens), positions]
    num_logits = logits_counts(computed + query_lens, batch.num_tokens[rows], num_spec)
    # The last num_logits[i] token indices of each request, without a Python loop.
    starts = np.repeat(qsl[1:] - num_logits, num_logits)
    first = np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
    logits_indices = starts + np.arange(len(starts), dtype=np.int64) - first
    return StepInputs(req_ids, rows, query_lens, computed, num_logits, token_ids, positions,
                      logits_indices)
