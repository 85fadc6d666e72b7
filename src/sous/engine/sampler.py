"""Batched sampling: penalties, temperature, top-k/top-p/min-p, seeds and logprobs.

Pure tensor functions over one step's `SamplingMetadata` (tensors gathered from the persistent
input batch, see `InputBatch.sampling_metadata`); the only host sync is the caller's
`.tolist()` of the result. Logprobs are of the raw model distribution (vLLM's default
`raw_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG_INF = float("-inf")


@dataclass
class RowPenalties:
    """Penalties of one row that has any (vLLM semantics, see `apply_penalties`)."""

    row: int
    repetition: float
    frequency: float
    presence: float
    prompt_token_ids: torch.Tensor
    """int64 [P]."""
    output_token_ids: torch.Tensor
    """int64 [O]."""


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for the rows of one step's logits, as tensors (vLLM's name).

    A field is None when no row of the step uses it, so an all-greedy step does no work."""

    all_greedy: bool
    temperature: torch.Tensor | None = None
    """float32 [B], 1.0 on greedy rows; None when `all_greedy`."""
    is_greedy: torch.Tensor | None = None
    """bool [B]; None when every row is greedy or every row is random."""
    top_k: torch.Tensor | None = None
    """int64 [B], the vocabulary size meaning "off"."""
    top_p: torch.Tensor | None = None
    """float32 [B], 1.0 meaning "off"."""
    min_p: torch.Tensor | None = None
    """float32 [B], 0.0 meaning "off"."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row -> the request's seeded generator (rows not listed use the global one)."""
    penalties: list[RowPenalties] = field(default_factory=list)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Row -> token ids banned until the request has `min_tokens` outputs."""
    max_num_logprobs: int | None = None


@dataclass
class SamplerOutput:
    sampled: torch.Tensor
    """[B] sampled token ids."""
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(sampled logprob [B], sampled rank [B], top ids [B, K], top logprobs [B, K])."""


def apply_min_tokens(logits: torch.Tensor, banned: dict[int, list[int]]) -> None:
    for row, ids in banned.items():
        if ids:
            logits[row, ids] = _NEG_INF


def apply_penalties(logits: torch.Tensor, penalties: list[RowPenalties]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output (divide positive logits, multiply negative);
    frequency/presence over output tokens only."""
    vocab = logits.shape[1]
    device = logits.device
    for p in penalties:
        i = p.row
        out_ids = p.output_token_ids.to(device)
        if p.repetition != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[p.prompt_token_ids.to(device)] = True
            seen[out_ids] = True
            row = logits[i]
            penalised = torch.where(row > 0, row / p.repetition, row * p.repetition)
            logits[i] = torch.where(seen, penalised, row)
        if p.frequency or p.presence:
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
            counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
            logits[i] -= p.frequency * counts + p.presence * (counts > 0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. `top_k` [B] long with
    vocab size meaning "off"; `top_p` [B, 1] float with 1.0 meaning "off"."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def sample_random(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / q), q ~ Exp(1); seeded rows use their generator."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for i, g in generators.items():
        q[i].exponential_(generator=g)
    return probs.div(q).argmax(dim=-1)


def _sample_non_greedy(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    assert md.temperature is not None
    logits = logits / md.temperature.unsqueeze(1)
    if md.top_k is not None or md.top_p is not None:
        top_p = None if md.top_p is None else md.top_p.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, top_p)
    probs = logits.softmax(dim=-1)
    if md.min_p is not None:
        min_p = md.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return sample_random(probs, md.generators)


def compute_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int):
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    rank = (raw_logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (
        raw_logprobs[:, :0], sampled.new_empty((sampled.shape[0], 0)))
    return sampled_lp, rank, top_ids, top_lp


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """`logits` [B, V] float32 (mutated). Returns the sampled ids and optional logprobs."""
    k = md.max_num_logprobs
    raw_logprobs = logits.log_softmax(dim=-1) if k is not None else None
    if md.banned_token_ids:
        apply_min_tokens(logits, md.banned_token_ids)
    if md.penalties:
        logits = apply_penalties(logits, md.penalties)
    if md.all_greedy:
        sampled = logits.argmax(dim=-1)
    else:
        sampled = _sample_non_greedy(logits, md)
        if md.is_greedy is not None:
            sampled = torch.where(md.is_greedy, logits.argmax(dim=-1), sampled)
    logprobs = compute_logprobs(raw_logprobs, sampled, k) if raw_logprobs is not None else None
    return SamplerOutput(sampled, logprobs)
