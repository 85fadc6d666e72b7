"""Incremental detokenisation and stop strings, on the bundled model's real tokenizer."""

from __future__ import annotations

from sous.engine.detokenizer import IncrementalDetokenizer
from sous.engine.sampling_params import SamplingParams

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
