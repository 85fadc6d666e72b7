"""The runner's drafter seam: `Proposer`, the rows that may be drafted for, and the factory.

After a step has sampled, the runner asks its proposer for the next step's drafts of the
requests that sampled (`propose(batch, sampled)`); the scheduler schedules them after the
request's known tokens and the runner verifies them with `rejection_sample`. A proposer reads
the persistent `InputBatch` (token ids without drafts, `num_tokens`; the tokens just sampled
already appended) and never mutates it.

Requests drafted for (`draftable`): everything but structured-output requests (drafts would
have to be cut to the grammar-valid prefix), requests with penalties, and requests still short
of their `min_tokens` (their bans and penalties change each verified position's distribution,
so verifying them needs per-position state the rejection sampler does not keep). Those decode
one token per step, as without speculation; their output is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from sous.engine.input_batch import InputBatch
from sous.engine.spec_decode.config import SpeculativeConfig
from sous.engine.spec_decode.ngram_proposer import NgramProposer
from sous.engine.step_inputs import StepInputs


@dataclass
class TargetStep:
    """The target's forward pass of the step just run, for drafters that read its hidden
    states (`Proposer.uses_target_step`): its inputs (flattened token order), the hidden
    states of the runner's `aux_hidden_state_layers` and the final hidden states (after the
    last norm), `[T, H]` each."""

    inputs: StepInputs
    aux_hidden_states: list[torch.Tensor]
    hidden_states: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts speculative tokens after a step (n-gram, suffix, EAGLE-3, MTP)."""

    uses_target_step: bool
    """Called after every step with its `TargetStep` (even when nothing sampled: the drafter
    keeps per-position state), not only after steps that sampled."""

    def propose(self, batch: InputBatch, sampled: dict[str, list[int]],
                target: TargetStep | None, draft: bool = True) -> dict[str, list[int]]:
        """Drafts (1..k tokens; absent: no draft) for the requests of `sampled` (rows of
        `batch`, with the tokens this step appended to them). `target`: the step's forward
        pass when `uses_target_step` (None when the step was re-run request by request).
        `draft` False (`SchedulerOutput.drafting`): update per-request state, propose
        nothing."""
        ...

    def finish(self, req_ids: set[str]) -> None:
        """These requests are gone (finished or aborted): forget their state."""
        ...


def draftable(batch: InputBatch, req_ids: list[str]) -> tuple[list[str], np.ndarray]:
    """(ids, rows) of the requests of `req_ids` that may be drafted for (module docstring)."""
    rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64,
                       count=len(req_ids))
    num_outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    ok = ~batch.needs_penalties[rows] & (num_outputs >= batch.min_tokens[rows])
    keep = [i for i in np.flatnonzero(ok).tolist()
            if batch.states[rows[i]].sampling_params.structured_outputs is None]  # type: ignore[union-attr]
    return [req_ids[i] for i in keep], rows[keep]


class NgramDrafter:
    """`ngram`: prompt lookup over each request's tokens so far (`NgramProposer`)."""

    uses_target_step = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        assert config.num_speculative_tokens is not None
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.num_speculative_tokens, max_model_len)

    def propose(self, batch: InputBatch, sampled: dict[str, list[int]],
                target: TargetStep | None = None, draft: bool = True) -> dict[str, list[int]]:
        if not draft:
            return {}
        ids, rows = draftable(batch, list(sampled))
        if not ids:
            return {}
        drafts, counts = self.ngram.batch_propose(batch.token_ids, batch.num_tokens, rows)
        return {rid: drafts[i, :n].tolist()
                for i, (rid, n) in enumerate(zip(ids, counts.tolist(), strict=True)) if n}

    def finish(self, req_ids: set[str]) -> None:
        """Stateless."""


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> Proposer:
    """The drafter for `ngram` / `suffix` (ConfigError from a suffix drafter that cannot
    load). Drafters with a model of their own are built by the worker, which loads it."""
    if config.method == "ngram":
        return NgramDrafter(config, max_model_len)
    if config.method == "suffix":
        from sous.engine.spec_decode.suffix_proposer import SuffixProposer

        return SuffixProposer(config, max_model_len)
    raise ValueError(f"no drafter for method {config.method!r} yet")
