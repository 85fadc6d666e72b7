"""`EagleProposer`: drafts from the target's hidden states (EAGLE-3 heads, MTP modules), as
vLLM's EAGLE proposer does, over a `DraftModel` that says how the drafter computes.

After each target step the drafter runs (step 0) over every position the target computed and
kept (a verified request's accepted tokens, a prefill chunk in full): at position i its input
is the token at i + 1 (for the last position of a request that sampled, the token just
sampled) and the target's hidden state at i (`DraftModel.first_hidden`), and it writes its own
KV cache at i with the target's block table. Requests that sampled and may be drafted for
(`draftable`) then draft greedily: the argmax at their last position is draft 1; draft j + 1
feeds draft j and the drafter's step-j hidden state one position on (step j), writing the
drafter's KV into the lookahead slots the scheduler allocated
(`SpeculativeConfig.num_lookahead_tokens`). A request stops drafting where its allocated
blocks or `max_model_len` end, and (with a `confidence_threshold`, vLLM's
`draft_confidence_threshold`) at its first draft token whose probability under the drafter is
below the threshold: that token and the rest of its chain are not proposed, so a request the
drafter is unsure of costs the next step nothing to verify.

The drafter's KV at a position is rewritten by the next step whenever the target revisits it
(rejected drafts' positions are recomputed), so every draft reads the drafter's KV of accepted
tokens and of its own earlier drafts only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from sous.engine.attention import AttentionMetadata
from sous.engine.input_batch import InputBatch
from sous.engine.spec_decode.proposer import TargetStep, draftable


class DraftModel(Protocol):
    """How a drafter computes (EAGLE-3 head: `sous.models.llama_eagle3`; MTP modules:
    `sous.engine.spec_decode.mtp`). Step j's `kv_caches` are the drafter's own layers."""

    def first_hidden(self, target: TargetStep, index: torch.Tensor) -> torch.Tensor:
        """Step 0's hidden input `[N, H]` from the target's step at token indices `index`."""
        ...

    def forward_step(self, j: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Step j over `[T]` tokens: (output for `draft_tokens`, hidden input of step j + 1)."""
        ...

    def draft_tokens(self, j: int, out: torch.Tensor, with_probs: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy draft tokens (target ids) `[N]` from step j's outputs `[N, ...]`, and with
        `with_probs` each one's probability under the drafter (`greedy_draft`)."""
        ...


def greedy_draft(logits: torch.Tensor, with_probs: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Argmax ids `[N]` of `logits` `[N, V]` and, with `with_probs`, their softmax
    probabilities `[N]` (float32)."""
    ids = logits.argmax(dim=-1)
    if not with_probs:
        return ids, None
    return ids, torch.softmax(logits.float(), dim=-1).gather(1, ids[:, None])[:, 0]


@dataclass
class _Chains:
    """Requests drafting this step: ids, batch rows, the last position of each, per request
    the drafter's next hidden input and draft token of that position (device tensors), and
    whether that token clears the confidence threshold."""

    req_ids: list[str]
    rows: np.ndarray
    positions: np.ndarray
    hidden: torch.Tensor
    tokens: torch.Tensor
    confident: np.ndarray


class EagleProposer:
    """See the module docstring. Owns the drafter's KV cache layers `kv_caches` (block layout
    and block ids shared with the target's cache)."""

    uses_target_step = True

    def __init__(self, model: DraftModel, kv_caches: list[torch.Tensor], block_size: int,
                 num_speculative_tokens: int, max_model_len: int, device: torch.device,
                 confidence_threshold: float = 0.0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.confidence_threshold = confidence_threshold

    def propose(self, batch: InputBatch, sampled: dict[str, list[int]],
                target: TargetStep | None, draft: bool = True) -> dict[str, list[int]]:
        if target is None:  # the step was re-run request by request: no drafts this once
            return {}
        chains = self._first_pass(batch, sampled, target, draft)
        if chains is None:
            return {}
        room = self._room(batch, chains)
        keep = np.flatnonzero((room >= 1) & chains.confident)
        chains, room = _select(chains, keep), room[keep]
        steps = [chains]
        for j in range(1, self.k):
            live = np.flatnonzero(room > j)
            if not len(live):
                break
            chains = self._step(j, batch, chains, live)
            keep = np.flatnonzero(chains.confident)
            chains, room = _select(chains, keep), room[live][keep]
            steps.append(chains)
        out: dict[str, list[int]] = {}
        for step in steps:
            for rid, token in zip(step.req_ids, step.tokens.tolist(), strict=True):
                out.setdefault(rid, []).append(token)
        return out

    # ---------------------------------------------------------------- passes
    def _first_pass(self, batch: InputBatch, sampled: dict[str, list[int]],
                    target: TargetStep, draft: bool) -> _Chains | None:
        """Run step 0 over the step's kept positions (the drafter's KV must cover every
        position, drafting or not); the chains of the requests that draft (None when none
        does, or not `draft`)."""
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
        hidden = self.model.first_hidden(target, torch.from_numpy(flat).to(dev))
        meta = self._metadata(batch, rows, kept, starts + kept)
        out, hidden = self.model.forward_step(0, torch.from_numpy(ids).to(dev),
                                              torch.from_numpy(positions).to(dev), hidden,
                                              self.kv_caches, meta)
        if not draft:
            return None
        ends = {inputs.req_ids[i]: e - 1 for i, e in zip(some.tolist(), np.cumsum(kept).tolist(),
                                                         strict=True)}
        req_ids, chain_rows = draftable(batch, [r for r in ends if r in sampled])
        if not req_ids:
            return None
        last = np.array([ends[r] for r in req_ids], dtype=np.int64)
        last_t = torch.from_numpy(last).to(dev)
        return self._chains(0, req_ids, chain_rows, positions[last], hidden[last_t], out[last_t])

    def _step(self, j: int, batch: InputBatch, chains: _Chains, live: np.ndarray) -> _Chains:
        """Draft j + 1 (step j) for the chains `live` (indices into `chains`)."""
        dev = self.device
        live_t = torch.from_numpy(live).to(dev)
        rows, positions = chains.rows[live], chains.positions[live] + 1
        ones = np.ones(len(live), dtype=np.int64)
        meta = self._metadata(batch, rows, ones, positions + 1)
        out, hidden = self.model.forward_step(j, chains.tokens[live_t],
                                              torch.from_numpy(positions).to(dev),
                                              chains.hidden[live_t], self.kv_caches, meta)
        req_ids = [chains.req_ids[i] for i in live.tolist()]
        return self._chains(j, req_ids, rows, positions, hidden, out)

    def _chains(self, j: int, req_ids: list[str], rows: np.ndarray, positions: np.ndarray,
                hidden: torch.Tensor, out: torch.Tensor) -> _Chains:
        """The chains after step j, with their draft tokens from the step's outputs `out`."""
        threshold = self.confidence_threshold
        tokens, probs = self.model.draft_tokens(j, out, threshold > 0)
        confident = (np.ones(len(req_ids), dtype=bool) if probs is None
                     else (probs >= threshold).cpu().numpy())
        return _Chains(req_ids, rows, positions, hidden, tokens, confident)

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
        """Stateless across steps (the drafter's KV lives in the requests' blocks)."""


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
                   chains.positions[keep], chains.hidden[keep_t], chains.tokens[keep_t],
                   chains.confident[keep])
