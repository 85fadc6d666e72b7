"""Incremental detokenisation and stop strings, on the bundled model's real tokenizer."""

from __future__ import annotations

import pytest

from sous.engine.detokenizer import IncrementalDetokenizer
from sous.engine.sampling_params import SamplingParams
from tiny_models import make_tokenizer

TEXT = "Hello world! Ünïcödé → 東京 and emoji 🎉 done. The END is near."


def run(tok, params: SamplingParams, text: str = TEXT) -> tuple[str, list[str], str | None]:
    prompt = tok.encode("Say something:")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    stop = None
    for i, t in enumerate(ids):
        stop = d.add_token(t)
        finished = stop is not None or i == len(ids) - 1
        deltas.append(d.pending_text(finished))
        if stop is not None:
            break
    return d.output_text, deltas, stop


def test_incremental_equals_full_decode(smollm_tokenizer) -> None:
    text, deltas, stop = run(smollm_tokenizer, SamplingParams())
    assert stop is None
    assert text == TEXT
    assert "".join(deltas) == TEXT


def test_stop_string_truncates(smollm_tokenizer) -> None:
    text, deltas, stop = run(smollm_tokenizer, SamplingParams(stop=["END"]))
    assert stop == "END"
    assert text == TEXT[: TEXT.index("END")]
    assert "".join(deltas) == text


def test_stop_string_included(smollm_tokenizer) -> None:
    text, deltas, stop = run(smollm_tokenizer,
                             SamplingParams(stop=["emoji"], include_stop_str_in_output=True))
    assert text == TEXT[: TEXT.index("emoji") + len("emoji")]
    assert "".join(deltas) == text


def test_stream_never_emits_a_stop_string_prefix(smollm_tokenizer) -> None:
    # "near." is at the very end: no delta before finishing may leak "nea".
    _, deltas, stop = run(smollm_tokenizer, SamplingParams(stop=["near."]))
    assert stop == "near."
    assert all("nea" not in d for d in deltas)


def decode_all(tok, prompt: list[int], output: list[int], params: SamplingParams) -> str:
    d = IncrementalDetokenizer(tok, prompt, params)
    for t in output:
        assert d.add_token(t) is None
    return d.output_text


@pytest.mark.parametrize(("skip", "spaces", "expected"), [
    (False, True, " world <|im_start|> <|im_end|> how"),
    (False, False, " world <|im_start|><|im_end|> how"),
    (True, True, " world how"),
])
def test_failing_token_keeps_the_request_settings_and_context(
        skip: bool, spaces: bool, expected: str) -> None:
    """A token the tokenizer raises on (-1: fault injection) restarts the decode stream; the new
    stream keeps skip_special_tokens / spaces_between_special_tokens and the context (the
    WordPiece decoder of the tiny tokenizer puts a space only *between* tokens), so the text is
    the same as without the fault."""
    tok = make_tokenizer()
    prompt = tok.encode("hello", add_special_tokens=False)
    world, how = tok.encode("world how", add_special_tokens=False)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert decode_all(tok, prompt, [world, start, end, how], params) == expected
    # Faults on the first output token (prompt context) and later (output context).
    faulty = [-1, world, -1, start, end, how]
    assert decode_all(tok, prompt, faulty, params) == expected
