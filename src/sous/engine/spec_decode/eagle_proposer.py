"""`eagle3`: drafts from the target's hidden states with an EAGLE-3 head (vLLM's proposal).

After each target step the head runs over every position the target computed and kept (a
verified request's accepted tokens, a prefill chunk in full): at position i its input is the
token at i + 1 (for the last position of a request that sampled, the token just sampled) and
`fc(aux hidden states at i)`, and it writes its own KV cache layer at i with the target's block
table. Requests that sampled and may be drafted for (`draftable`) then draft greedily: the
argmax at their last position is draft 1; each further draft feeds the previous draft and the
head's pre-norm hidden state one position on, writing the head's KV into the lookahead slots
the scheduler allocated (`SpeculativeConfig.num_lookahead_tokens`). A request stops drafting
where its allocated blocks or `max_model_len` end.

The head's KV at a position is rewritten by the next step whenever the target revisits it
(rejected drafts' positions are recomputed), so every draft reads the head's KV of accepted
tokens and of its own earlier drafts only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sous.engine.attention import AttentionMetadata
from sous.engine.input_batch import InputBatch
from sous.engine.spec_decode.proposer import TargetStep, draftable
from sous.models.llama_eagle3 import Eagle3LlamaForCausalLM


@dataclass
class _Chains:
    """Requests drafting this step: ids, batch rows, the last position of each, and per
    request the pre-norm hidden state and draft token of that position (device tensors)."""

    req_ids: list[str]
    rows: np.ndarray
    positions: np.ndarray
    hidden: torch.Tensor
    tokens: torch.Tensor


class Eagle3Proposer:
    """See the module docstring. Owns the head's KV cache layer `kv_cache` (block layout and
    block ids shared with the target's cache)."""

    uses_target_step = True

    def __init__(self, head: Eagle3LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 num_speculative_tokens: int, max_model_len: int, device: torch.device) -> None:
        self.head = head
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device

    def propose(self, batch: InputBatch, sampled: dict[str, list[int]],
                target: TargetStep | None) -> dict[str, list[int]]:
        if target is None:  # the step was re-run request by request: no drafts this once
            return {}
        chains = self._first_pass(batch, sampled, target)
        if chains is None:
            return {}
        room = self._room(batch, chains)
        keep = np.flatnonzero(room >= 1)
        chains, room = _select(chains, keep), room[keep]
        steps = [chains]
        for j in range(1, self.k):
            live = np.flatnonzero(room > j)
            if not len(live):
                break
            chains = self._step(batch, chains, live)
            room = room[live]
            steps.append(chains)
        out: dict[str, list[int]] = {}
        for step in steps:
            for rid, token in zip(step.req_ids, step.tokens.tolist(), strict=True):
                out.setdefault(rid, []).append(token)
        return out

    # ---------------------------------------------------------------- passes
    def _first_pass(self, batch: InputBatch, sampled: dict[str, list[int]],
                    target: TargetStep) -> _Chains | None:
        """Run the head over the step's kept positions; the chains of the requests that draft
        (None when none does)."""
        inputs = target.inputs
        kept = _kept_lengths(inputs.req_ids, inputs.query_lens, inputs.num_logits, sampled)
        qsl = np.cumsum(inputs.query_lens) - inputs.query_lens
        some = np.flatnonzero(kept > 0)
        if not len(some):
            return None
        rows, kept, qsl = inputs.rows[some], kept[some], qsl[some]
        starts = (inputs.seq_lens - inputs.query_lens)[some]
        offsets = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)
        flat = np.repeat(qsl, kept) + offsets
        positions = np.repeat(starts, kept) + offsets
        ids = batch.token_ids[np.repeat(rows, kept), positions + 1]
        dev = self.device
        flat_t = torch.from_numpy(flat).to(dev)
        hidden = self.head.combine_hidden_states([a[flat_t] for a in target.aux_hidden_states])
        meta = self._metadata(batch, rows, kept, starts + kept)
        normed, prenorm = self.head.forward(torch.from_numpy(ids).to(dev),
                                            torch.from_numpy(positions).to(dev), hidden,
                                            self.kv_cache, meta)
        ends = {inputs.req_ids[i]: e - 1 for i, e in zip(some.tolist(), np.cumsum(kept).tolist(),
                                                         strict=True)}
        req_ids, chain_rows = draftable(batch, [r for r in ends if r in sampled])
        if not req_ids:
            return None
        last = np.array([ends[r] for r in req_ids], dtype=np.int64)
        last_t = torch.from_numpy(last).to(dev)
        return _Chains(req_ids, chain_rows, positions[last], prenorm[last_t],
                       self.head.draft_argmax(normed[last_t]))

    def _step(self, batch: InputBatch, chains: _Chains, live: np.ndarray) -> _Chains:
        """One more draft token for the chains `live` (indices into `chains`)."""
        dev = self.device
        live_t = torch.from_numpy(live).to(dev)
        rows, positions = chains.rows[live], chains.positions[live] + 1
        ones = np.ones(len(live), dtype=np.int64)
        meta = self._metadata(batch, rows, ones, positions + 1)
        normed, prenorm = self.head.forward(chains.tokens[live_t],
                                            torch.from_numpy(positions).to(dev),
                                            chains.hidden[live_t], self.kv_cache, meta)
        req_ids = [chains.req_ids[i] for i in live.tolist()]
        return _Chains(req_ids, rows, positions, prenorm, self.head.draft_argmax(normed))

    def _room(self, batch: InputBatch, chains: _Chains) -> np.ndarray:
        """Drafts each chain may make: draft j (1-based) writes the head's KV at the chain's
        position + j - 1, which must lie in its allocated blocks; its tokens must stay within
        `max_model_len`."""
        capacity = batch.num_blocks[chains.rows] * self.block_size
        by_blocks = capacity - chains.positions
        by_length = self.max_model_len - batch.num_tokens[chains.rows]
        return np.minimum(np.minimum(by_blocks, by_length), self.k)

    def _metadata(self, batch: InputBatch, rows: np.ndarray, query_lens: np.ndarray,
                  seq_lens: np.ndarray) -> AttentionMetadata:
        width = max(int(((seq_lens + self.block_size - 1) // self.block_size).max()), 1)
        return AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens,
                                       block_tables=batch.block_table[rows, :width],
                                       block_size=self.block_size, device=self.device)

    def finish(self, req_ids: set[str]) -> None:
        """Stateless across steps (the head's KV lives in the requests' blocks)."""


def _kept_lengths(req_ids: list[str], query_lens: np.ndarray, num_logits: np.ndarray,
                  sampled: dict[str, list[int]]) -> np.ndarray:
    """Per request of the step: its positions whose target hidden states stand (all but the
    rejected drafts' positions)."""
    kept = query_lens.copy()
    for i, rid in enumerate(req_ids):
        if num_logits[i] > 1:  # verified: 1 + accepted positions of its 1 + drafts stand
            kept[i] = query_lens[i] - (num_logits[i] - 1) + (len(sampled.get(rid, [])) - 1)
    return np.maximum(kept, 0)


def _select(chains: _Chains, keep: np.ndarray) -> _Chains:
    if len(keep) == len(chains.req_ids):
        return chains
    keep_t = torch.from_numpy(keep).to(chains.hidden.device)
    return _Chains([chains.req_ids[i] for i in keep.tolist()], chains.rows[keep],
                   chains.positions[keep], chains.hidden[keep_t], chains.tokens[keep_t])
