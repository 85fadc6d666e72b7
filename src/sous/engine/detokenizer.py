"""Incremental detokenisation and stop-string handling for one output sequence."""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from sous.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PRIME_MAX = 24
"""Most tokens of context (prompt suffix, then recent output) a fresh decode stream gets."""


class IncrementalDetokenizer:
    """Turns token ids into text one step at a time and finds stop strings.

    `output_text` is the text so far (already truncated at a stop string). Text that could still
    turn into a stop string is held back from `pending_text()` until it can't.

    The request's `skip_special_tokens` and `spaces_between_special_tokens` apply to every
    stream this detokenizer builds, including the one that replaces a stream whose `step`
    raised; a replacement stream starts from the last clean tokens of context (the prompt's
    suffix, then the output so far), so the next token decodes as it would have in place.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._added_tokens: dict[int, str] = {}
        """Added token id -> its text, when spaces between them are suppressed (as vLLM:
        only when special tokens are kept and spaces_between_special_tokens is False)."""
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added_tokens = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._last_added = False
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in self.stop), default=1)
        self.holdback = 0 if self.include_stop else longest - 1
        self.output_text = ""
        self.sent_offset = 0
        self._context = list(prompt_token_ids[-_PRIME_MAX:])
        """The last tokens decoded (prompt, then output): context for a replacement stream."""
        self._stream = self._new_stream()

    def _new_stream(self) -> DecodeStream:
        """A stream primed with a short clean suffix of `_context`, so the next token decodes in
        context (leading spaces of SentencePiece-style tokens, WordPiece separators). No context
        when every suffix ends inside a character: a primed partial character would be decoded
        again, with the whole context, by the next step."""
        ctx = self._context
        suffix: list[int] | None = None
        for n in range(min(4, len(ctx)), len(ctx) + 1):
            if n and "\ufffd" not in self._tokenizer.decode(ctx[-n:]):
                suffix = ctx[-n:]
                break
        return DecodeStream(ids=suffix, skip_special_tokens=self._skip_special_tokens)

    def _protected_step(self, token_id: int) -> str:
        """The stream's text for one token; on an exception (tokenizers raises on invalid ids
        and on some non-monotonic byte sequences) a fresh stream from the recent context takes
        over and retries the token once; a token that still fails decodes to ""."""
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as e:
            logger.warning("Detokenizing token %r failed (%s); restarting the decode stream.",
                           token_id, e)
            self._stream = self._new_stream()
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:
                self._stream = self._new_stream()
                return ""
        self._context.append(token_id)
        if len(self._context) > 2 * _PRIME_MAX:
            del self._context[:-_PRIME_MAX]
        return text or ""

    def _step(self, token_id: int) -> str:
        text = self._protected_step(token_id)
        if self._added_tokens:
            added = self._added_tokens.get(token_id)
            if added is not None and self._last_added:
                text = added  # the raw token text, without the separator the decoder adds
            self._last_added = added is not None
        return text

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
