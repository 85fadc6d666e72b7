"""Sampler: greedy, seeds, top-k/top-p/min-p masks, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sous.engine.input_batch import CachedRequestState, InputBatch
from sous.engine.sampler import SamplingMetadata, apply_top_k_top_p, sample
from sous.engine.sampling_params import SamplingParams

VOCAB = 100


def batch(params: list[SamplingParams], seeds: list[int | None] | None = None,
          outputs: list[list[int]] | None = None, eos: tuple[int, ...] = (),
          ) -> SamplingMetadata:
    """The metadata the runner builds: requests with prompt [1, 2] in an InputBatch."""
    n = len(params)
    ib = InputBatch(n + 1, 64, 4)
    ib.add(CachedRequestState("other", [5], SamplingParams(temperature=1.0, top_k=3), [0], 0))
    for i, p in enumerate(params):
        seed = None if seeds is None else seeds[i]
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        out = [] if outputs is None else outputs[i]
        ib.add(CachedRequestState(f"r{i}", [1, 2], p, [0], 0, list(out), gen))
    rows = np.arange(1, n + 1)  # a subset of the batch's rows, as in a step
    return ib.sampling_metadata(rows, VOCAB, torch.device("cpu"), list(eos))


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    out = sample(logits.clone(), batch([SamplingParams(temperature=0)] * 2))
    assert out.sampled.tolist() == [1, 0]


def test_seeded_sampling_is_reproducible_and_mixed_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[2] = logits[0]
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=7)]
    a = sample(logits.clone(), batch(params, seeds=[7, None, 7])).sampled.tolist()
    b = sample(logits.clone(), batch(params, seeds=[7, None, 7])).sampled.tolist()
    assert a == b
    assert a[1] == int(logits[1].argmax())
    assert a[0] == a[2]  # same seed, same row distribution


def test_top_k_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert torch.isinf(masked[0, 2:]).all() and torch.isfinite(masked[0, :2]).all()
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([[0.7]]))
    # nucleus: 0.5 + 0.3 >= 0.7 keeps the two most likely
    assert torch.isfinite(masked[0, :2]).all() and torch.isinf(masked[0, 2:]).all()


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    out = sample(logits.clone(), batch([SamplingParams(temperature=1.0, top_k=1)] * 4))
    assert out.sampled.tolist() == logits.argmax(-1).tolist()


def test_min_p_keeps_only_likely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05]]))
    for _ in range(20):
        out = sample(logits.clone(), batch([SamplingParams(temperature=1.0, min_p=0.5)]))
        assert out.sampled.tolist() == [0]


def test_penalties() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(logits.clone(), batch([p], outputs=[[0]])).sampled.tolist() == [1]
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 1 is in the prompt [1, 2]: 1.9 / 2 < 2.0 ... and token 0 stays best
    assert sample(logits.clone(), batch([p])).sampled.tolist() == [0]
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(logits.clone(), batch([p], outputs=[[0, 0]])).sampled.tolist() == [1]


def test_min_tokens_bans_stop_ids() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    out = sample(logits.clone(), batch([p], eos=(0,)))
    assert out.sampled.tolist() == [2]
    out = sample(logits.clone(), batch([p], outputs=[[2, 2]], eos=(0,)))  # min_tokens reached
    assert out.sampled.tolist() == [0]
    p = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits.clone(), batch([p], eos=(0,))).sampled.tolist() == [0]


def test_logprobs_are_raw_and_ranked() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    p = SamplingParams(temperature=0, logprobs=2)
    out = sample(logits.clone(), batch([p]))
    lp, rank, top_ids, top_lp = out.logprobs
    expected = torch.log_softmax(logits, -1)
    assert math.isclose(lp.item(), expected[0, 2].item(), rel_tol=1e-6)
    assert rank.tolist() == [1]
    assert top_ids.tolist() == [[2, 1]]
    assert torch.allclose(top_lp, expected[0, [2, 1]].unsqueeze(0))


@pytest.mark.parametrize("kw", [
    {"temperature": math.inf}, {"temperature": math.nan}, {"top_p": math.inf},
    {"min_p": math.nan}, {"repetition_penalty": math.inf}, {"presence_penalty": -math.inf},
    {"frequency_penalty": math.nan},
])
def test_non_finite_floats_rejected(kw: dict) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a finite number"):
        SamplingParams(**kw)


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**70, -(2**63) - 1])
def test_seed_outside_int64_rejected(seed: int) -> None:
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
def test_int64_seeds_seed_a_generator(seed: int) -> None:
    """The whole accepted range seeds torch generators (negative seeds as 2**64 + seed)."""
    p = SamplingParams(temperature=1.0, seed=seed)
    torch.Generator().manual_seed(p.seed)


def test_all_greedy_metadata_is_empty() -> None:
    """An all-greedy step builds no tensors (the fast path of every greedy benchmark)."""
    md = batch([SamplingParams(temperature=0)] * 3)
    assert md.all_greedy and md.temperature is None and md.top_k is None
    assert not md.generators and not md.penalties and md.max_num_logprobs is None
    mixed = batch([SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_p=0.9)],
                  seeds=[None, 3])
    assert not mixed.all_greedy and mixed.is_greedy.tolist() == [True, False]
    assert mixed.temperature.tolist() == [1.0, 0.5] and mixed.top_k is None
    assert list(mixed.generators) == [1]
