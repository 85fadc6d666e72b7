"""Incremental detokenisation and stop-string handling for one output sequence."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from sous.engine.sampling_params import SamplingParams

_PRIME_MAX = 24


class IncrementalDetokenizer:
    """Turns token ids into text one step at a time and finds stop strings.

    `output_text` is the text so far (already truncated at a stop string). Text that could still
    turn into a stop string is held back from `pending_text()` until it can't.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self.output_text = ""
        self.sent_offset = 0
        self._prime(tokenizer, prompt_token_ids)

    def _prime(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]) -> None:
        """Feed a short clean suffix of the prompt so the first output token decodes in context
        (leading spaces of SentencePiece-style tokens)."""
        suffix = prompt_token_ids[-4:]
        for n in range(4, min(len(prompt_token_ids), _PRIME_MAX) + 1):
            candidate = prompt_token_ids[-n:]
            if "\ufffd" not in tokenizer.decode(candidate):
                suffix = candidate
                break
        for token_id in suffix:
            self._step(token_id)

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception:  # tokenizers raises on invalid ids; restart the stream
            self._stream = DecodeStream(skip_special_tokens=True)
            return ""

    def add_token(self, token_id: int) -> str | None:
        """Decode one token; returns the stop string hit, if any (text is then truncated)."""
        before = len(self.output_text)
        self.output_text += self._step(token_id)
        if not self.stop or len(self.output_text) == before:
            return None
        start = max(0, before - max(len(s) for s in self.stop) + 1)
        for stop in self.stop:
            idx = self.output_text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.output_text = self.output_text[:end]
                return stop
        return None

    def pending_text(self, finished: bool) -> str:
        """Text not yet handed out, keeping back a possible stop-string prefix unless finished."""
        end = len(self.output_text) if finished else max(self.sent_offset,
                                                         len(self.output_text) - self.holdback)
        text = self.output_text[self.sent_offset:end]
        self.sent_offset = end
        return text
