"""Verification of draft tokens against the target model (speculative sampling).

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"
(arXiv 2211.17192), as vLLM v1's rejection sampler applies it. Per request with n drafts
x_0..x_{n-1} (0 <= n <= k) and target distributions p_0..p_n from the verify step:

- greedy request (temperature 0): emit argmax(p_j) for j = 0, 1, ... while x_j equals it;
  the first mismatch emits the argmax (the correction) and stops; if all n drafts match, the
  bonus argmax(p_n) follows. Output: the argmaxes, as plain decoding would give.
- random request: draw u_j ~ U[0, 1) from the request's generator; accept x_j when
  q_j(x_j) > 0 and u_j < p_j(x_j) / q_j(x_j) (q_j the draft distribution; q = 1 for drafters
  without probabilities, n-gram and suffix). On the first rejection emit a token recovered
  from normalize(max(p_j - q_j, 0)) (q = 1: p_j with x_j zeroed) and stop; if all n drafts
  are accepted, emit the bonus token sampled from p_n. Every emitted token is then
  distributed as plain sampling from the target would be.

p_j is the distribution the plain sampler draws from: temperature, then top-k / top-p, then
softmax, then min-p (renormalised; vLLM's verification leaves min-p out, so there only its
bonus token honours it). vLLM writes the acceptance test as p/q >= u; with u < p/q
the acceptance probability is the same and a token with p = 0 is never accepted.

Randomness, per seeded request: the bonus first (exactly `sampler.sample`'s draw, so a
request with no drafts gets the same token and generator state as plain decoding), then, only
when it has drafts, n uniforms and one exponential per vocabulary entry (the recovered
token's exponential race, shared by its positions: at most one of them is emitted). Requests
without a generator use the global one.

Pure tensor code with static shapes ([num_reqs, k] / [num_reqs, k + 1]) on the logits'
device; the draft counts come from the host (the scheduler knows them), so nothing here waits
for the device. The caller's one sync is reading the result (`parse_output`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sous.engine.sampler import (
    SamplingMetadata,
    apply_top_k_top_p,
    compute_logprobs,
    sample,
)

PLACEHOLDER_TOKEN_ID = -1
"""Padding of `RejectionSamplerOutput.token_ids` after each request's emitted tokens."""

_GREEDY_EPS = 1e-5  # as SamplingParams.greedy


@dataclass
class RejectionSamplerOutput:
    token_ids: torch.Tensor
    """int64 [num_reqs, k + 1]: each request's accepted drafts, then its recovered (or
    corrected) or bonus token, then `PLACEHOLDER_TOKEN_ID` padding. Row i holds
    `num_accepted[i] + 1` tokens."""
    num_accepted: torch.Tensor
    """int64 [num_reqs]: accepted drafts per request (0..n_i)."""
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """When `max_num_logprobs` is set: `sampler.compute_logprobs`'s tuple per position,
    (token logprob [R, k+1], rank [R, k+1], top ids [R, k+1, N], top logprobs [R, k+1, N]),
    of the raw target distribution at each position (log-softmax of `target_logits`).
    Meaningful only where `token_ids` is not the placeholder."""


def make_sampling_metadata(temperature: Sequence[float], vocab_size: int,
                           device: torch.device | str = "cpu",
                           top_k: Sequence[int] | None = None,
                           top_p: Sequence[float] | None = None,
                           min_p: Sequence[float] | None = None,
                           generators: Sequence[torch.Generator | None] | None = None,
                           max_num_logprobs: int | None = None) -> SamplingMetadata:
    """`SamplingMetadata` from per-request lists, the encoding `InputBatch.sampling_metadata`
    uses: temperature 0 (below 1e-5) is greedy; top_k 0 or -1 is off; top_p 1.0 and min_p
    0.0 are off; a None generator means the global one."""
    greedy = [t < _GREEDY_EPS for t in temperature]
    md = SamplingMetadata(all_greedy=all(greedy), max_num_logprobs=max_num_logprobs)
    if md.all_greedy:
        return md
    md.temperature = torch.tensor([1.0 if g else t for g, t in zip(greedy, temperature,
                                                                   strict=True)],
                                  dtype=torch.float32, device=device)
    if any(greedy):
        md.is_greedy = torch.tensor(greedy, device=device)
    if top_k is not None and any(0 < k < vocab_size for k in top_k):
        md.top_k = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_k],
                                dtype=torch.int64, device=device)
    if top_p is not None and any(p < 1.0 for p in top_p):
        md.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)
    if min_p is not None and any(p > 0.0 for p in min_p):
        md.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)
    md.generators = {i: g for i, g in enumerate(generators or []) if g is not None}
    return md


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distributions plain sampling draws from, normalised: `logits` [R, P, V] (one row
    of settings in `md` per request, applied to its P positions) -> float32 [R, P, V].
    Temperature, top-k / top-p (`sampler.apply_top_k_top_p`), softmax, min-p. Greedy rows
    get temperature 1 (they are decided by argmax, not by these probabilities)."""
    num_reqs, num_pos, vocab = logits.shape
    flat = logits.reshape(num_reqs * num_pos, vocab).float()
    if md.temperature is not None:
        flat = flat / md.temperature.repeat_interleave(num_pos).unsqueeze(1)
    if md.top_k is not None or md.top_p is not None:
        top_k = None if md.top_k is None else md.top_k.repeat_interleave(num_pos)
        top_p = None if md.top_p is None else md.top_p.repeat_interleave(num_pos).unsqueeze(1)
        flat = apply_top_k_top_p(flat, top_k, top_p)
    probs = flat.softmax(dim=-1)
    if md.min_p is not None:
        min_p = md.min_p.repeat_interleave(num_pos).unsqueeze(1)
        probs = probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs.view(num_reqs, num_pos, vocab)


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                     target_logits: torch.Tensor, md: SamplingMetadata,
                     draft_probs: torch.Tensor | None = None) -> RejectionSamplerOutput:
    """Verify each request's drafts and emit its accepted drafts plus one more token (module
    docstring for the rules).

    `draft_token_ids` [R, k]: request i's drafts in its first `num_draft_tokens[i]` columns
    (host ints in [0, k]; the rest is padding, any value). `target_logits` [R, k + 1, V]
    (not modified): position j < n_i holds the target's logits after draft j - 1 (verifying
    draft j), position n_i gives the bonus token, later positions are padding. `md`: one row
    per request, as `sampler.sample` takes it; penalties and min-tokens bans are applied
    as plain sampling does, and only to requests without drafts (ValueError otherwise: they
    would change each verified position's distribution). `draft_probs` [R, k, V]: the
    draft distributions over the target vocabulary, or None for drafters without them
    (q = 1: n-gram, suffix, greedy EAGLE / MTP)."""
    num_reqs, k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    if target_logits.shape != (num_reqs, k + 1, vocab):
        raise ValueError(f"target_logits must be [{num_reqs}, {k + 1}, V], got "
                         f"{tuple(target_logits.shape)}")
    if draft_probs is not None and draft_probs.shape != (num_reqs, k, vocab):
        raise ValueError(f"draft_probs must be [{num_reqs}, {k}, {vocab}], got "
                         f"{tuple(draft_probs.shape)}")
    counts = [int(n) for n in num_draft_tokens]
    if len(counts) != num_reqs or not all(0 <= n <= k for n in counts):
        raise ValueError(f"num_draft_tokens must be {num_reqs} ints in [0, {k}], got {counts}")
    constrained = {p.row for p in md.penalties} | {r for r, ids in md.banned_token_ids.items()
                                                   if ids}
    if any(counts[r] for r in constrained):
        raise ValueError("rejection_sample applies penalties and min_tokens bans to requests "
                         "without drafts only: give such requests no drafts")
    device = target_logits.device
    n = torch.tensor(counts, dtype=torch.int64, device=device)
    valid = torch.arange(k, device=device) < n.unsqueeze(1)
    drafts = torch.where(valid, draft_token_ids.to(device=device, dtype=torch.int64), 0)
    rows = torch.arange(num_reqs, device=device)

    verify = target_logits[:, :k]
    if md.all_greedy and not constrained:  # one argmax serves the drafts and the bonus
        argmax = target_logits.argmax(dim=-1)
        bonus = argmax.gather(1, n.unsqueeze(1)).squeeze(1)
    else:
        # The bonus: exactly plain sampling at each request's position n_i (consumes its
        # generator first, as vLLM's sampler runs before the rejection sampler).
        bonus_md = dataclasses.replace(md, max_num_logprobs=None)
        bonus = sample(target_logits[rows, n].float(), bonus_md).sampled
        argmax = verify.argmax(dim=-1) if md.all_greedy or md.is_greedy is not None else None
    if md.all_greedy:
        assert argmax is not None
        corrected = argmax[:, :k]
        accepted = drafts == corrected
    else:
        accepted, corrected = _random_verify(verify, drafts, counts, md, draft_probs)
        if md.is_greedy is not None:
            assert argmax is not None
            greedy = md.is_greedy.unsqueeze(1)
            accepted = torch.where(greedy, drafts == argmax, accepted)
            corrected = torch.where(greedy, argmax, corrected)
    accepted &= valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    pad = torch.zeros((num_reqs, 1), dtype=torch.int64, device=device)
    at_stop = torch.cat([corrected, pad], dim=1).gather(1, num_accepted.unsqueeze(1))
    last = torch.where(num_accepted == n, bonus, at_stop.squeeze(1))
    pos = torch.arange(k + 1, device=device)
    token_ids = torch.where(pos < num_accepted.unsqueeze(1), torch.cat([drafts, pad], dim=1),
                            PLACEHOLDER_TOKEN_ID)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))

    logprobs = None
    if md.max_num_logprobs is not None:
        raw = target_logits.float().log_softmax(dim=-1).view(num_reqs * (k + 1), vocab)
        lp = compute_logprobs(raw, token_ids.clamp(min=0).view(-1), md.max_num_logprobs)
        logprobs = (lp[0].view(num_reqs, k + 1), lp[1].view(num_reqs, k + 1),
                    lp[2].view(num_reqs, k + 1, -1), lp[3].view(num_reqs, k + 1, -1))
    return RejectionSamplerOutput(token_ids, num_accepted, logprobs)


def _random_verify(verify: torch.Tensor, drafts: torch.Tensor, counts: list[int],
                   md: SamplingMetadata, draft_probs: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [R, k] bool, recovered [R, k] int64) of the speculative-sampling test."""
    num_reqs, k, vocab = verify.shape
    probs = target_probs(verify, md)
    p_draft = probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand((num_reqs, k), device=verify.device)
    for i, g in md.generators.items():
        if counts[i]:
            uniform[i, :counts[i]].uniform_(generator=g)
    if draft_probs is None:
        accepted = uniform < p_draft
        residual = probs.scatter_(-1, drafts.unsqueeze(-1), 0.0)
    else:
        q = draft_probs.to(probs.dtype)
        q_draft = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        accepted = (q_draft > 0) & (uniform * q_draft < p_draft)
        residual = probs.sub_(q).clamp_(min=0.0)
    # Exponential race: argmax(r / E), E ~ Exp(1), samples normalize(r) without normalising.
    race = torch.empty((num_reqs, vocab), dtype=probs.dtype, device=verify.device)
    race.exponential_()
    for i, g in md.generators.items():
        if counts[i]:
            race[i].exponential_(generator=g)
    recovered = residual.div_(race.unsqueeze(1)).argmax(dim=-1)
    return accepted, recovered


def parse_output(out: RejectionSamplerOutput) -> list[list[int]]:
    """Each request's emitted token ids, read with one device-to-host copy."""
    rows = out.token_ids.cpu().tolist()
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in rows]
