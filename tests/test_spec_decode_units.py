"""Speculative decoding building blocks: `--speculative-config` parsing, the n-gram drafter
(against a slow obvious reference), the rejection sampler (greedy exactness, distribution
correctness of speculative sampling with and without draft probabilities, seeds, requests
without drafts, logprobs) and the acceptance counters' log line. Rejection-sampler tests also
run on CUDA where it is available."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sous.config.errors import ConfigError
from sous.engine.sampler import sample
from sous.engine.spec_decode.config import MAX_SPEC_LEN, SpeculativeConfig
from sous.engine.spec_decode.eagle_proposer import greedy_draft
from sous.engine.spec_decode.metrics import SpecDecodingStats
from sous.engine.spec_decode.ngram_proposer import NgramProposer
from sous.engine.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    make_sampling_metadata,
    parse_output,
    rejection_sample,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# ------------------------------------------------------------------------------ config


def cfg(**kw: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict(kw)


def test_ngram_window_defaults_and_inference() -> None:
    c = cfg(method="ngram", num_speculative_tokens=3)
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == ("ngram", 5, 5, None)
    assert cfg(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2).prompt_lookup_max == 2
    assert cfg(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4).prompt_lookup_min == 4
    for model in ("ngram", "[ngram]"):
        c = cfg(model=model, num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
        assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", None, 1, 3)
    assert cfg(method="ngram", num_speculative_tokens=2, enforce_eager=None,
               rejection_sample_method="standard", draft_sample_method="greedy",
               quantization=None).num_lookahead_tokens == 0


def test_model_based_methods() -> None:
    c = cfg(model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_speculative_tokens=3)
    assert (c.method, c.num_lookahead_tokens, c.use_eagle()) == ("eagle3", 3, True)
    assert cfg(model="yuhuili/EAGLE-LLaMA3-Instruct-8B", num_speculative_tokens=2).method == "eagle"
    assert cfg(method="eagle3", model="x/y", prompt_lookup_max=3).prompt_lookup_max is None
    for alias in ("deepseek_mtp", "qwen3_next_mtp", "mtp"):
        c = cfg(method=alias, num_speculative_tokens=1)
        assert (c.method, c.model, c.num_lookahead_tokens) == ("mtp", None, 1)
    c = cfg(method="mtp", model="org/ckpt")  # k from the checkpoint's n_predict
    assert c.num_speculative_tokens is None
    assert c.with_draft_n_predict(1).num_speculative_tokens == 1
    assert cfg(method="mtp", model="o/c", num_speculative_tokens=4).with_draft_n_predict(
        2).num_speculative_tokens == 4
    with pytest.raises(ConfigError, match="multiple of the draft checkpoint's n_predict=2"):
        cfg(method="mtp", model="o/c", num_speculative_tokens=3).with_draft_n_predict(2)
    with pytest.raises(ConfigError, match="num_speculative_tokens is required"):
        c.with_draft_n_predict(None)
    assert c.draft_confidence_threshold == 0.0
    assert cfg(method="eagle3", model="x/y",
               draft_confidence_threshold=0.4).draft_confidence_threshold == 0.4


def test_suffix_defaults() -> None:
    c = cfg(method="suffix")
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth,
            c.suffix_decoding_max_cached_requests, c.suffix_decoding_max_spec_factor,
            c.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    assert cfg(method="suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    assert cfg(method="suffix", suffix_decoding_max_tree_depth=64).num_speculative_tokens == 32
    c = cfg(method="suffix", num_speculative_tokens=3, suffix_decoding_max_cached_requests=0,
            suffix_decoding_max_spec_factor=0, suffix_decoding_min_token_prob=1)
    assert (c.num_speculative_tokens, c.suffix_decoding_max_cached_requests) == (3, 0)
    assert cfg(method="suffix", num_speculative_tokens=None).num_speculative_tokens == 24  # null


@pytest.mark.parametrize("data, words", [
    ({"method": "ngram"}, ["num_speculative_tokens", "required", "'ngram'"]),
    ({"method": "mtp"}, ["num_speculative_tokens", "required", "'mtp'"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens", "[1, 32]"]),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPEC_LEN + 1}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": "3"}, ["num_speculative_tokens", "integer"]),
    ({"method": "ngram", "num_speculative_tokens": True}, ["num_speculative_tokens", "integer"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, ["prompt_lookup_min=4", "prompt_lookup_max=2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     ["prompt_lookup_min", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     ["prompt_lookup_max", ">= 1"]),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ["suffix_decoding_max_tree_depth"]),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1},
     ["suffix_decoding_max_cached_requests"]),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5},
     ["suffix_decoding_max_spec_factor"]),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
     ["suffix_decoding_min_token_prob", "[0, 1]"]),
    ({"method": "suffix", "suffix_decoding_min_token_prob": "high"},
     ["suffix_decoding_min_token_prob", "number"]),
    ({"method": "eagle3", "num_speculative_tokens": 3}, ["'eagle3'", "needs 'model'"]),
    ({"method": "eagle", "num_speculative_tokens": 3}, ["'eagle'", "needs 'model'"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1},
     ["unknown field 'bogus'", "prompt_lookup_min", "suffix_decoding_max_tree_depth"]),
    ({"method": "foo", "num_speculative_tokens": 2},
     ["unknown method 'foo'", "ngram", "suffix", "eagle3", "mtp"]),
    ({"method": "medusa", "model": "m/x"}, ["'medusa'", "not supported yet"]),
    ({"method": "mlp_speculator", "model": "m/x"}, ["'mlp_speculator'", "not supported yet"]),
    ({"method": "draft_model", "model": "m/x"}, ["'draft_model'", "not supported yet"]),
    ({"method": "custom_class", "model": "pkg.Mine"}, ["'custom_class'", "not supported yet"]),
    ({"model": "pkg.MyProposer", "num_speculative_tokens": 2}, ["'custom_class'"]),
    ({"model": "org/small-draft", "num_speculative_tokens": 2}, ["'draft_model'", "method"]),
    ({"num_speculative_tokens": 2}, ["set 'method'"]),
    ({"method": 3}, ["method", "string"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_padded_drafter_batch": 1},
     ["disable_padded_drafter_batch", "true or false"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
     ["draft_sample_method", "not supported yet"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 1},
     ["tensor_parallel_size", "draft_tensor_parallel_size"]),
    ({"method": "eagle3", "model": "m/x", "draft_tensor_parallel_size": 0},
     ["draft_tensor_parallel_size", ">= 1"]),
    ({"method": "eagle3", "model": "m/x", "draft_tensor_parallel_size": 2},
     ["draft_tensor_parallel_size=2", "not supported yet"]),
    ({"method": "eagle3", "model": "m/x", "max_model_len": 0}, ["max_model_len", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
     ["disable_by_batch_size", "> 1"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "8"},
     ["disable_by_batch_size", "an integer"]),
    ({"method": "eagle3", "model": "m/x", "draft_confidence_threshold": 1.5},
     ["draft_confidence_threshold=1.5", "[0, 1]"]),
    ({"method": "eagle3", "model": "m/x", "draft_confidence_threshold": "high"},
     ["draft_confidence_threshold", "a number"]),
    ({"method": "suffix", "draft_confidence_threshold": 0.5},
     ["draft_confidence_threshold", "'suffix'", "suffix_decoding_min_token_prob"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_confidence_threshold": 0.5},
     ["draft_confidence_threshold", "'ngram'"]),
])
def test_config_errors_name_the_field(data: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.from_dict(data)
    msg = str(err.value)
    assert msg.startswith("--speculative-config") and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)
    assert isinstance(err.value, ValueError)


def test_config_not_an_object() -> None:
    with pytest.raises(ConfigError, match="must be a JSON object"):
        SpeculativeConfig.from_dict([1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ n-gram


def reference_propose(t: list[int], min_n: int, max_n: int, k: int, max_len: int) -> list[int]:
    """The obvious O(L * n) search: longest n first, earliest occurrence first."""
    size = len(t)
    room = min(k, max_len - size)
    if size < min_n or room <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = t[size - n:]
        for s in range(0, size - n):  # occurrences ending before the last token
            if t[s:s + n] == suffix:
                return t[s + n:s + n + room]
    return []


def test_ngram_examples() -> None:
    p = NgramProposer(2, 3, 4, 1000)
    assert p.propose([1, 2, 3, 4, 2, 3]).tolist() == [4, 2, 3]  # vLLM's docstring example
    # longest n wins over an earlier shorter match: [5, 6] occurs at 0, [4, 5, 6] at 3
    assert p.propose([5, 6, 9, 4, 5, 6, 7, 8, 4, 5, 6]).tolist() == [7, 8, 4, 5]
    # ties go to the earliest occurrence
    assert p.propose([1, 2, 10, 1, 2, 20, 1, 2]).tolist() == [10, 1, 2, 20]
    # overlapping occurrences (repetition): earliest one, continuation may reach the end
    assert NgramProposer(2, 3, 4, 1000).propose([7] * 6).tolist() == [7, 7, 7]
    assert p.propose([1, 2, 3, 4]).tolist() == []  # no match
    assert NgramProposer(3, 3, 4, 1000).propose([1, 2]).tolist() == []  # shorter than min
    assert p.propose([]).tolist() == []
    # caps: k, tokens available, max_model_len - L
    assert NgramProposer(1, 2, 2, 1000).propose([1, 2, 3, 4, 1]).tolist() == [2, 3]
    assert NgramProposer(1, 2, 9, 1000).propose([1, 2, 3, 1]).tolist() == [2, 3, 1]
    assert NgramProposer(1, 2, 9, 6).propose([1, 2, 3, 4, 1]).tolist() == [2]
    assert NgramProposer(1, 2, 9, 5).propose([1, 2, 3, 4, 1]).tolist() == []
    out = NgramProposer(1, 2, 3, 100).propose(np.array([4, 5, 4], dtype=np.int32))
    assert out.dtype == np.int32 and out.tolist() == [5, 4]


def test_ngram_matches_reference_on_random_sequences() -> None:
    rng = np.random.default_rng(0)
    for _ in range(3000):
        vocab = int(rng.integers(1, 6))
        size = int(rng.integers(0, 60))
        t = rng.integers(0, vocab, size).tolist()
        min_n = int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 8))
        max_len = size + int(rng.integers(-2, 10))
        want = reference_propose(t, min_n, max_n, k, max_len)
        got = NgramProposer(min_n, max_n, k, max_len).propose(np.array(t, dtype=np.int64))
        assert got.tolist() == want, (t, min_n, max_n, k, max_len)


def test_ngram_long_contexts_match_reference() -> None:
    rng = np.random.default_rng(1)
    for vocab in (2, 3, 50, 30000):  # dense (mask) and sparse (index) narrowing
        t = rng.integers(0, vocab, 3000).tolist()
        t[-6:] = t[1000:1006]
        for min_n, max_n in ((1, 5), (3, 8), (6, 6)):
            want = reference_propose(t, min_n, max_n, 5, 10**6)
            assert NgramProposer(min_n, max_n, 5, 10**6).propose(t).tolist() == want


def test_ngram_batch_equals_single() -> None:
    rng = np.random.default_rng(2)
    buf = rng.integers(0, 4, (6, 40))
    num_tokens = np.array([40, 10, 0, 3, 25, 1])
    p = NgramProposer(2, 4, 3, 45)
    drafts, counts = p.batch_propose(buf, num_tokens, rows=[4, 0, 2, 1, 5, 3])
    assert drafts.shape == (6, 3) and counts.dtype == np.int32
    for i, row in enumerate([4, 0, 2, 1, 5, 3]):
        single = p.propose(buf[row, :num_tokens[row]]).tolist()
        assert drafts[i, :counts[i]].tolist() == single
        assert (drafts[i, counts[i]:] == -1).all()
    assert p.batch_propose(buf, num_tokens)[1].shape == (6,)


# ------------------------------------------------------------------------------ rejection


def greedy_logits(ids: list[list[int]], vocab: int, device: str) -> torch.Tensor:
    """[R, P, V] logits whose argmax at [i, j] is ids[i][j]."""
    x = torch.randn(len(ids), len(ids[0]), vocab, generator=torch.Generator().manual_seed(0))
    for i, row in enumerate(ids):
        for j, t in enumerate(row):
            x[i, j, t] = 10.0
    return x.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_exactness(device: str) -> None:
    vocab = 16
    argmax = [[3, 5, 7, 9], [3, 5, 7, 9], [3, 5, 7, 9], [1, 2, 3, 4], [2, 2, 2, 2]]
    drafts = torch.tensor([[3, 5, 7], [3, 6, 7], [4, 5, 7], [1, 2, 0], [0, 0, 0]])
    counts = [3, 3, 3, 2, 0]  # row 3: 2 drafts, bonus at position 2; row 4: none
    md = make_sampling_metadata([0.0] * 5, vocab, device)
    out = rejection_sample(drafts.to(device), counts, greedy_logits(argmax, vocab, device), md)
    assert out.token_ids.tolist() == [[3, 5, 7, 9], [3, 5, -1, -1], [3, -1, -1, -1],
                                      [1, 2, 3, -1], [2, -1, -1, -1]]
    assert out.num_accepted.tolist() == [3, 1, 0, 2, 0]
    assert parse_output(out) == [[3, 5, 7, 9], [3, 5], [3], [1, 2, 3], [2]]
    assert out.logprobs is None


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_a_random_batch(device: str) -> None:
    vocab = 16
    argmax = [[3, 5, 7], [3, 5, 7]]
    md = make_sampling_metadata([0.0, 1.0], vocab, device)
    drafts = torch.tensor([[3, 4], [3, 5]], device=device)
    out = rejection_sample(drafts, [2, 2], greedy_logits(argmax, vocab, device), md)
    assert out.token_ids[0].tolist() == [3, 5, -1]
    assert out.num_accepted[0].item() == 1


def frequencies(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return np.bincount(tokens.cpu().numpy(), minlength=vocab) / max(tokens.numel(), 1)


def assert_close_to(freq: np.ndarray, p: torch.Tensor, n: int) -> None:
    p_np = p.cpu().double().numpy()
    tol = 5 * np.sqrt(p_np * (1 - p_np) / n) + 1e-3
    assert (np.abs(freq - p_np) <= tol).all(), (freq, p_np)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_q", [True, False])
def test_random_mode_is_distribution_correct(device: str, with_q: bool) -> None:
    """Emitted tokens follow the target: first token ~ p0; the next token, given the first
    draft was accepted, ~ p1; the bonus, given both were, ~ p2."""
    vocab, k, rows = 6, 2, 60000
    torch.manual_seed(0)  # the global generator draws for unseeded requests
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    p = logits.softmax(-1)
    q = torch.rand(k, vocab, generator=g) + 0.05
    q[0, 2] = 0.0  # a token the drafter never proposes
    q = q / q.sum(-1, keepdim=True)
    if with_q:
        drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=g)
                              for j in range(k)], dim=1)
        draft_probs = q.expand(rows, k, vocab).to(device)
    else:  # n-gram: drafts without probabilities, here a fixed guess per position
        drafts = torch.tensor([[1, 4]]).expand(rows, k)
        draft_probs = None
    md = make_sampling_metadata([1.0] * rows, vocab, device)
    out = rejection_sample(drafts.to(device), [k] * rows,
                           logits.expand(rows, k + 1, vocab).to(device), md, draft_probs)
    tok, acc = out.token_ids.cpu(), out.num_accepted.cpu()
    assert_close_to(frequencies(tok[:, 0], vocab), p[0], rows)
    sel = acc >= 1
    assert_close_to(frequencies(tok[sel, 1], vocab), p[1], int(sel.sum()))
    sel = acc >= 2
    assert_close_to(frequencies(tok[sel, 2], vocab), p[2], int(sel.sum()))
    assert ((tok >= 0).sum(1) == acc + 1).all()
    # acceptance rate at position 0 is sum_x min(p, q) (q = 1: p(draft))
    want = (torch.minimum(p[0], q[0]).sum() if with_q else p[0, 1]).item()
    assert abs((acc >= 1).float().mean().item() - want) < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_random_mode_applies_temperature_and_top_k(device: str) -> None:
    vocab, rows = 8, 40000
    torch.manual_seed(0)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    target = logits[0] / 0.7
    top = target.topk(4).indices
    masked = torch.full_like(target, float("-inf"))
    masked[top] = target[top]
    p = masked.softmax(-1)
    outside = int(target.argsort()[0])  # the least likely token: outside the top 4
    drafts = torch.full((rows, 1), outside)
    md = make_sampling_metadata([0.7] * rows, vocab, device, top_k=[4] * rows)
    out = rejection_sample(drafts.to(device), [1] * rows,
                           logits.expand(rows, 2, vocab).to(device), md)
    assert out.num_accepted.sum().item() == 0  # p(draft) = 0: never accepted
    assert_close_to(frequencies(out.token_ids[:, 0], vocab), p, rows)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_requests_reproduce(device: str) -> None:
    vocab, k = 50, 3
    logits = torch.randn(4, k + 1, vocab, generator=torch.Generator().manual_seed(4)).to(device)
    drafts = torch.randint(0, vocab, (4, k), generator=torch.Generator().manual_seed(5))
    q = torch.rand(4, k, vocab, generator=torch.Generator().manual_seed(6)).to(device)
    q = q / q.sum(-1, keepdim=True)

    def run() -> list[list[int]]:
        gens = [torch.Generator(device=device).manual_seed(s) for s in (1, 2, 3, 4)]
        md = make_sampling_metadata([1.0, 0.8, 1.2, 1.0], vocab, device, generators=gens,
                                    top_p=[1.0, 0.9, 1.0, 1.0])
        return rejection_sample(drafts.to(device), [3, 2, 3, 1], logits, md, q).token_ids.tolist()

    first = run()
    assert all(run() == first for _ in range(3))


@pytest.mark.parametrize("device", DEVICES)
def test_no_drafts_is_plain_sampling_and_consumes_no_randomness(device: str) -> None:
    vocab, k = 40, 2
    logits = torch.randn(3, k + 1, vocab, generator=torch.Generator().manual_seed(7)).to(device)
    drafts = torch.randint(0, vocab, (3, k)).to(device)
    temps = [0.9, 1.0, 0.0]
    g_spec = [torch.Generator(device=device).manual_seed(11 + i) for i in range(3)]
    g_plain = [torch.Generator(device=device).manual_seed(11 + i) for i in range(3)]
    out = rejection_sample(drafts, [0, 0, 0], logits,
                           make_sampling_metadata(temps, vocab, device, generators=g_spec,
                                                  top_k=[5, 0, 0]))
    plain = sample(logits[:, 0].clone(),
                   make_sampling_metadata(temps, vocab, device, generators=g_plain,
                                          top_k=[5, 0, 0])).sampled
    assert out.token_ids[:, 0].tolist() == plain.tolist()
    assert (out.token_ids[:, 1:] == PLACEHOLDER_TOKEN_ID).all()
    assert out.num_accepted.tolist() == [0, 0, 0]
    for a, b in zip(g_spec, g_plain, strict=True):
        assert torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_of_emitted_tokens(device: str) -> None:
    vocab = 12
    logits = greedy_logits([[3, 5, 7]], vocab, device)
    md = make_sampling_metadata([0.0], vocab, device, max_num_logprobs=2)
    out = rejection_sample(torch.tensor([[3, 5]], device=device), [2], logits, md)
    assert out.token_ids.tolist() == [[3, 5, 7]]
    assert out.logprobs is not None
    token_lp, rank, top_ids, top_lp = out.logprobs
    want = logits.log_softmax(-1)[0, [0, 1, 2], [3, 5, 7]]
    assert torch.allclose(token_lp[0], want)
    assert rank.tolist() == [[1, 1, 1]] and top_ids.shape == (1, 3, 2)
    assert top_ids[0, :, 0].tolist() == [3, 5, 7] and torch.allclose(top_lp[0, :, 0], want)


def test_rejection_sample_checks_its_inputs() -> None:
    md = make_sampling_metadata([0.0], 8)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), [2], torch.zeros(1, 2, 8), md)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), [3], torch.zeros(1, 3, 8), md)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), [2], torch.zeros(1, 3, 8), md,
                         torch.zeros(1, 2, 7))
    md.banned_token_ids[0] = [1]
    with pytest.raises(ValueError, match="penalties and min_tokens bans to requests without"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), [2], torch.zeros(1, 3, 8), md)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_apply_to_requests_without_drafts(temperature: float) -> None:
    """Requests under min_tokens (or with penalties) get no drafts; their bonus is plain
    sampling with the ban, next to requests that do verify drafts."""
    vocab = 8
    logits = greedy_logits([[5, 6, 7], [5, 6, 7]], vocab, "cpu")
    md = make_sampling_metadata([0.0, temperature], vocab)
    md.banned_token_ids[1] = [5]
    drafts = torch.tensor([[5, 6], [5, 6]])
    out = rejection_sample(drafts, [2, 0], logits, md)
    assert out.token_ids[0].tolist() == [5, 6, 7]
    assert out.token_ids[1, 0].item() != 5 and out.num_accepted[1].item() == 0
    if temperature == 0.0:
        banned = logits[1, 0].clone()
        banned[5] = float("-inf")
        assert out.token_ids[1].tolist() == [int(banned.argmax()), -1, -1]


# ------------------------------------------------------------------------------ metrics


def test_metrics_counts_and_log_line() -> None:
    a = SpecDecodingStats(num_spec_tokens=3)
    a.observe(3, 3)
    a.observe(3, 1)
    b = SpecDecodingStats(num_spec_tokens=3)
    b.observe(2, 0)
    b.observe(3, 2)
    a.merge(b)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (4, 11, 6)
    assert a.num_accepted_tokens_per_pos == [3, 2, 1]
    assert a.log_line() == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 6 tokens, Drafted: 11 "
        "tokens, Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft acceptance "
        "rate: 54.5%")
    assert a.log_line(elapsed_s=2.0).startswith(
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 "
        "tokens/s, Drafted throughput: 5.50 tokens/s, Accepted: 6 tokens")
    empty = SpecDecodingStats(num_spec_tokens=2)
    assert empty.mean_acceptance_length == 1.0 and "nan%" in empty.log_line()
    with pytest.raises(ValueError):
        empty.observe(3, 1)
    with pytest.raises(ValueError):
        empty.observe(1, 2)


def test_greedy_draft_gives_argmax_and_its_probability() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 5.0, -1.0]], dtype=torch.bfloat16)
    ids, probs = greedy_draft(logits, True)
    assert ids.tolist() == [1, 0]
    expected = torch.softmax(logits.float(), -1)[torch.arange(2), ids]
    assert probs is not None and probs.dtype == torch.float32 and torch.equal(probs, expected)
    assert torch.equal(greedy_draft(logits, False)[0], ids) and greedy_draft(logits, False)[1] is None

