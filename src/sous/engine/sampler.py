"""Batched sampling: penalties, temperature, top-k/top-p/min-p, seeds and logprobs.

Pure tensor functions over one step's batch; the only host sync is the caller's `.tolist()`
of the result. Logprobs are of the raw model distribution (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sous.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row sampling settings for the rows of one step's logits (built by the runner)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    stop_ids_for_min_tokens: list[list[int]]
    """Per row: token ids banned until min_tokens are produced (empty once reached)."""

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(wanted) if wanted else None


@dataclass
class SamplerOutput:
    sampled: torch.Tensor
    """[B] sampled token ids."""
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(sampled logprob [B], sampled rank [B], top ids [B, K], top logprobs [B, K])."""


def _rows(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def apply_min_tokens(logits: torch.Tensor, banned: list[list[int]]) -> None:
    for i, ids in enumerate(banned):
        if ids:
            logits[i, ids] = _NEG_INF


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output (divide positive logits, multiply negative);
    frequency/presence over output tokens only."""
    rows = [i for i, p in enumerate(batch.params) if p.needs_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    for i in rows:
        p = batch.params[i]
        out_ids = torch.tensor(batch.output_token_ids[i], dtype=torch.long, device=device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(batch.prompt_token_ids[i], dtype=torch.long, device=device)] = True
            seen[out_ids] = True
            row = logits[i]
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, row)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
            counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
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


def sample_random(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / q), q ~ Exp(1); seeded rows use their generator."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return probs.div(q).argmax(dim=-1)


def _sample_non_greedy(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    params = batch.params
    device = logits.device
    temps = [p.temperature if not p.greedy else 1.0 for p in params]
    logits = logits / _rows(temps, device)
    vocab = logits.shape[1]
    top_k = None
    if any(0 < p.top_k < vocab for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                             dtype=torch.long, device=device)
    top_p = _rows([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in params) else None
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = _rows([p.min_p for p in params], device)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return sample_random(probs, batch.generators)


def compute_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int):
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    rank = (raw_logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (
        raw_logprobs[:, :0], sampled.new_empty((sampled.shape[0], 0)))
    return sampled_lp, rank, top_ids, top_lp


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """`logits` [B, V] float32 (mutated). Returns the sampled ids and optional logprobs."""
    k = batch.max_num_logprobs
    raw_logprobs = logits.log_softmax(dim=-1) if k is not None else None
    apply_min_tokens(logits, batch.stop_ids_for_min_tokens)
    logits = apply_penalties(logits, batch)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        sampled = greedy
    else:
        random = _sample_non_greedy(logits, batch)
        is_greedy = torch.tensor([p.greedy for p in batch.params], device=logits.device)
        sampled = torch.where(is_greedy, greedy, random)
    logprobs = compute_logprobs(raw_logprobs, sampled, k) if raw_logprobs is not None else None
    return SamplerOutput(sampled, logprobs)
