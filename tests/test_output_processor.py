"""Output processing end to end on the bundled SmolLM2 (offline `LLM`, greedy): finish reasons
when a stop string and a token-level finish (the length cap) land on the same token."""

from __future__ import annotations

from typing import Any

import pytest

from sous import LLM, SamplingParams
from sous.engine.outputs import CompletionOutput

PROMPT = "Write a short poem about the sea:"
N = 8


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20)


def greedy(llm: LLM, max_tokens: int, **kw: Any) -> CompletionOutput:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm: LLM,
                                                                   include: bool) -> None:
    """vLLM: a stop string found in the step's text makes the finish "stop" (stop_reason the
    string) even when the same token also reached max_tokens."""
    full = greedy(llm, N)
    before = greedy(llm, N - 1).text
    assert full.finish_reason == "length" and full.text.startswith(before)
    # The shortest tail of the text that contains the last token's text and occurs nowhere
    # earlier: only the N-th token completes it.
    start = next(s for s in range(len(before), -1, -1)
                 if full.text[s:].strip() and full.text.find(full.text[s:]) == s)
    stop = full.text[start:]
    out = greedy(llm, N, stop=[stop], include_stop_str_in_output=include)
    assert out.token_ids == full.token_ids
    assert out.text == (full.text if include else full.text[:start])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
