"""n-gram (prompt lookup) drafting, vLLM's semantics, vectorised with numpy.

For a context `t` of length L (all tokens so far, no drafts), find the longest n in
[min_n, max_n] such that the last n tokens `t[L-n:]` also occur earlier in `t` (an occurrence
that ends before the last token; it may overlap the suffix). Among the occurrences of that
longest n-gram take the earliest one, and propose the tokens that followed it: at most k,
at most what the context holds after it, and at most `max_model_len - L`. Nothing is
proposed when L < min_n, when the room `max_model_len - L` is not positive, or when no
suffix of length >= min_n occurs earlier.

vLLM computes this with a KMP scan over the reversed context; here candidate occurrences are
found with one vectorised comparison against the last token and then narrowed one position
back per round (at most `max_n - 1` rounds): with full-length boolean masks while candidates
are dense (repetitive text), then on the surviving index list. The cost is one pass over the
context plus work proportional to the partial matches (at most `max_n` passes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_DENSE = 8
"""Narrow candidates with full-length masks while more than 1/_DENSE of positions match."""


class NgramProposer:
    """Prompt-lookup drafter (`--speculative-config '{"method": "ngram", ...}'`).

    `prompt_lookup_min` <= `prompt_lookup_max`, both >= 1; `k` >= 1 drafts at most per
    request; `max_model_len` caps context + drafts."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, k: int,
                 max_model_len: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = k
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Draft tokens for one request's context (1-D), as a new 1-D array of the context's
        dtype (int64 for a list) with 0..k entries (see the module docstring)."""
        t = np.asarray(token_ids)
        if t.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {t.shape}")
        start, count = self._match(t)
        return t[start:start + count].copy()

    def batch_propose(self, token_ids: np.ndarray, num_tokens: np.ndarray | Sequence[int],
                      rows: Sequence[int] | np.ndarray | None = None,
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for several requests held in a token buffer, e.g. the input batch's
        `token_ids` [max_reqs, max_model_len] with `num_tokens` [max_reqs] (the tokens without
        drafts). `rows` selects and orders the requests (default: all rows).

        Returns (drafts [R, k] of the buffer's dtype, padded with -1; num_drafts int32 [R])
        where R = len(rows); row i's drafts are `drafts[i, :num_drafts[i]]`, equal to
        `propose(token_ids[rows[i], :num_tokens[rows[i]]])`. Rows are matched one after
        another (each vectorised), so the cost is about the sum of their `propose` costs."""
        n = np.asarray(num_tokens)
        rows_arr = np.arange(len(token_ids)) if rows is None else np.asarray(rows)
        drafts = np.full((len(rows_arr), self.k), -1, dtype=token_ids.dtype)
        num_drafts = np.zeros(len(rows_arr), dtype=np.int32)
        for i, row in enumerate(rows_arr.tolist()):
            t = token_ids[row, :int(n[row])]
            start, count = self._match(t)
            if count:
                drafts[i, :count] = t[start:start + count]
                num_drafts[i] = count
        return drafts, num_drafts

    def _match(self, t: np.ndarray) -> tuple[int, int]:
        """(start, count) of the proposal in `t`; count 0 when there is none."""
        size = t.shape[0]
        room = min(self.k, self.max_model_len - size)
        if size < self.min_n or room <= 0 or size < 2:
            return 0, 0
        last = size - 1
        # Candidate ends e < last of occurrences of the longest suffix matched so far. While
        # they are many (repetitive text), narrow a boolean mask with contiguous compares;
        # once few, narrow the index list with gathers. `length` grows by one per round.
        mask = t[:last] == t[last]
        length = 1
        while length < self.max_n and np.count_nonzero(mask) * _DENSE > last:
            longer = np.zeros_like(mask)
            np.logical_and(mask[length:], t[:last - length] == t[last - length],
                           out=longer[length:])
            if not longer.any():
                break
            mask, length = longer, length + 1
        ends = np.flatnonzero(mask)
        if not ends.size:
            return 0, 0
        while length < self.max_n:
            longer = ends[ends >= length]
            longer = longer[t[longer - length] == t[last - length]]
            if not longer.size:
                break
            ends, length = longer, length + 1
        if length < self.min_n:
            return 0, 0
        start = int(ends[0]) + 1  # the earliest occurrence
        return start, min(room, size - start)
