"""The engine end to end on the bundled SmolLM2 (offline `LLM` API): batching invariance,
chunked prefill, preemption, stop handling, n, seeds and logprobs. float32 so that greedy
results do not depend on batch shapes."""

from __future__ import annotations

import pytest

from sous import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
    "List three colours:",
    "Once upon a time, in a small village,",
    "The theory of relativity says that",
    "My favourite food is",
    "In 1969, the first man on the moon",
    "Python is a programming language that",
    "The best way to learn to cook is",
    "Here is a recipe for pancakes:",
    "The sun rises in the",
    "Q: What is 2 + 2?\nA:",
    "Translate to French: good morning ->",
    "A haiku about autumn:",
    "The quick brown fox",
    "Explain photosynthesis in one sentence:",
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20,
               max_num_seqs=32)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_batched_equals_alone(llm: LLM, alone: list[list[int]]) -> None:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(len(t) == 24 for t in alone)
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])
    assert outs[0].outputs[0].text == llm.get_tokenizer().decode(alone[0])


def test_chunked_prefill_equals_alone(alone: list[list[int]]) -> None:
    small = LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                max_num_batched_tokens=5, enable_prefix_caching=False)
    outs = small.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone[:4]


def test_preemption_keeps_results(alone: list[list[int]]) -> None:
    # 12 usable blocks of 16 tokens cannot hold 8 sequences at once: some are preempted and
    # recomputed, and every output is still the same.
    tight = LLM(dtype="float32", max_model_len=128, num_gpu_blocks_override=13,
                enable_prefix_caching=False)
    outs = tight.generate(PROMPTS[:8], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone[:8]
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv_cache_manager.usage() == 0.0


def test_stop_and_max_tokens(llm: LLM, alone: list[list[int]]) -> None:
    tok = llm.get_tokenizer()
    full = tok.decode(alone[0])
    stop = full.strip().split()[2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.startswith(out.text)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == alone[0][:3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24,
                                                  stop_token_ids=[alone[0][5]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == alone[0][5] and out.token_ids[-1] == alone[0][5]


def test_n_and_seed(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, n=3, seed=123, max_tokens=12)
    a = llm.generate(PROMPTS[1], p, use_tqdm=False)[0]
    b = llm.generate(PROMPTS[1], p, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_logprobs(llm: LLM, alone: list[list[int]]) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1
        assert len(entry) == 3
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)))


def test_chat(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_prefix_cache_hit_counts(llm: LLM) -> None:
    prompt = " ".join(["shared prefix words"] * 30)
    first = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    second = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens % 16 == 0


def test_bad_request_does_not_disturb(llm: LLM) -> None:
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=5000), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_greedy_identical_with_prefix_caching_off_on_and_sub_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sharing 1.6 blocks of a 64-token-block cache: the second and third reuse one
    full block (caching on), plus the matching sub-blocks of the next block (sub-block on)."""
    monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", "1")
    shared = "Here is a long shared system prompt about the history of bread. " * 8
    prompts = [shared + "Question one: what is yeast?", shared + "Question two: who baked?",
               shared + "Question three: why salt?"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = {}
    for name, caching, env in [("off", False, "1"), ("on", True, "0"), ("sub", True, "1")]:
        monkeypatch.setenv("VLLM_RBLN_SUB_BLOCK_CACHE", env)
        llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20,
                  block_size=64, max_num_batched_tokens=16, enable_prefix_caching=caching)
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
        results[name] = ([o.outputs[0].token_ids for o in outs],
                         [o.num_cached_tokens for o in outs])
    assert results["on"][0] == results["off"][0] == results["sub"][0]
    ids = [llm.get_tokenizer().encode(p) for p in prompts]

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))

    expected_sub = [0]
    for i in (1, 2):
        match = min(max(common(ids[i], ids[j]) for j in range(i)), len(ids[i]) - 1)
        full = match // 64 * 64
        expected_sub.append(full + min((match - full) // 16, 3) * 16)
    assert results["off"][1] == [0, 0, 0]
    assert results["on"][1] == [0, 64, 64]
    assert results["sub"][1] == expected_sub
    assert expected_sub[1] > 64


# ---- one validation for both paths; one request's fault fails only that request ----------

def test_prompt_filling_max_model_len_rejected_offline(llm: LLM) -> None:
    """vLLM: with max_tokens unset the room left must be at least one token, so a prompt of
    exactly max_model_len tokens is an error (the server's message); one token less yields
    exactly one token."""
    n = llm.engine.max_model_len
    with pytest.raises(ValueError, match=f"maximum context length is {n} tokens. However, "
                       f"your request has {n} input tokens"):
        llm.generate({"prompt_token_ids": [1000] * n}, SamplingParams(max_tokens=None),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [1000] * (n - 1)},
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_invalid_request_in_a_batch_adds_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="stop_token_ids must be token ids"):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(stop_token_ids=[2**70])],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


POISON = 49151
"""A token id no prompt of PROMPTS contains: the injected fault fires on any forward pass
whose input holds it."""


class _FaultyModel:
    """Fault injection: the bundled model, except that a forward pass whose input ids contain
    POISON raises (as a kernel bug triggered by one request would)."""

    def __init__(self, model: object) -> None:
        self._model = model

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def __call__(self, ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204
        if POISON in ids.tolist():
            raise RuntimeError("injected fault")
        return self._model(ids, *args, **kwargs)


def test_fault_in_one_request_fails_only_that_request(
        llm: LLM, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The poisoned request is scheduled in the same step as four others: the batched forward
    raises, the runner re-runs the requests one by one, only the culprit fails (aborted, no
    tokens); the others' greedy outputs equal their no-fault runs and the engine goes on."""
    poisoned = [POISON] + llm.get_tokenizer().encode(" ".join(["unshared words"] * 20))
    monkeypatch.setattr(llm.engine.runner, "model", _FaultyModel(llm.engine.runner.model))
    outs = llm.generate(PROMPTS[:2] + [{"prompt_token_ids": poisoned}] + PROMPTS[2:4],
                        GREEDY, use_tqdm=False)
    bad = outs.pop(2)
    assert bad.outputs[0].finish_reason == "abort" and bad.outputs[0].token_ids == []
    assert [o.outputs[0].token_ids for o in outs] == alone[:4]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors and all(f"Request {bad.request_id} failed" in m for m in errors), errors
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage() == 0.0
    monkeypatch.undo()
    # The culprit's blocks were never written: they must not serve as a prefix-cache hit.
    again = llm.generate({"prompt_token_ids": poisoned}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and len(again.outputs[0].token_ids) == 24


def test_bad_seed_reaching_the_runner_fails_only_its_request(llm: LLM,
                                                             alone: list[list[int]]) -> None:
    """Per-request set-up is guarded: a seed torch cannot take (validation bypassed by
    mutating the params after it) fails its own request only."""
    engine, tok = llm.engine, llm.get_tokenizer()
    bad = SamplingParams(temperature=1.0, seed=1, max_tokens=4)
    bad.seed = 2**70
    outs: dict[str, object] = {}
    for rid, prompt, params in [("a", PROMPTS[0], GREEDY), ("bad", PROMPTS[1], bad),
                                ("b", PROMPTS[2], GREEDY)]:
        engine.add_request(rid, tok.encode(prompt), params,
                           lambda out: outs.__setitem__(out.request_id, out))
    while engine.has_unfinished_requests():
        engine.step()
    assert outs["bad"].finished and outs["bad"].outputs[0].finish_reason == "abort"
    assert [outs["a"].outputs[0].token_ids, outs["b"].outputs[0].token_ids] == [alone[0],
                                                                                alone[2]]



def test_freeze_startup_heap(llm: LLM) -> None:
    """`sous serve` freezes its start-up heap once the engine is up (vLLM's engine process
    does the same): the objects alive then leave the collector's generations, and the engine
    keeps serving. The offline `LLM` leaves a library caller's heap alone."""
    import gc

    from sous.engine.core import freeze_startup_heap

    before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > max(before, 100_000)
        assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        gc.unfreeze()
