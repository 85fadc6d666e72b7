"""Cheap request limits checked before the expensive work (tokenizing, queueing sequences).

- `check_num_seqs`: one request may add at most `max_num_seqs` sequences (`n`, times the
  number of prompts of a /v1/completions request): all of a request's sequences must be able
  to run side by side, and nobody can queue a million sequences with one call. vLLM has no
  such cap; in sous it follows `--max-num-seqs`.
- `PromptBound`: a lower bound on a text's token count without tokenizing it,
  `ceil(len(utf8 bytes) / longest token in bytes)`, so a prompt that cannot fit in
  `max_model_len` is rejected in microseconds instead of after seconds of tokenizing. Only
  used with tokenizers that never shrink text before matching tokens (no normalizer, or only
  ones that insert characters; no added token that swallows surrounding whitespace).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from sous.engine.validation import RequestValidationError, resolve_max_tokens
from sous.server.errors import APIError, bad_request

logger = logging.getLogger("sous.server")

_GROWING_NORMALIZERS = {"Prepend", "Replace"}
"""Normalizer types that never make text shorter in bytes (Replace only for the
SentencePiece space -> "▁", checked below)."""


def check_num_seqs(n: int, num_prompts: int, max_num_seqs: int) -> None:
    """400 unless `n * num_prompts <= max_num_seqs`."""
    if n > max_num_seqs:
        raise bad_request(f"n must be at most {max_num_seqs} (the server's --max-num-seqs: "
                          f"every sequence of a request runs at once), got {n}.", "n")
    if n * num_prompts > max_num_seqs:
        raise bad_request(
            f"This request asks for {n * num_prompts} sequences ({num_prompts} prompts x n={n});"
            f" at most {max_num_seqs} (the server's --max-num-seqs) are allowed per request. "
            "Split it into several requests.", "prompt")


class PromptBound:
    """The lower-bound check of a text prompt's token count (see the module docstring).
    The longest token is measured once (~0.1 s), on first use."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._max_token_bytes: int | None = None
        self._measured = False

    @property
    def max_token_bytes(self) -> int | None:
        """Bytes of the longest token, or None when the bound is not safe for this
        tokenizer."""
        if not self._measured:
            self._measured = True
            self._max_token_bytes = longest_token_bytes(self.tokenizer)
        return self._max_token_bytes

    def check(self, text: str, requested: int | None, max_model_len: int) -> None:
        """400 (the context-length message, "at least N input tokens") when `text` surely
        does not fit; otherwise nothing (tokenize it and check exactly)."""
        per_token = self.max_token_bytes
        if per_token is None:
            return
        at_least = math.ceil(len(text.encode("utf-8", "surrogatepass")) / per_token)
        try:
            resolve_max_tokens(at_least, requested, max_model_len, at_least=True)
        except RequestValidationError as e:
            raise APIError(str(e), 400, e.param) from None


def longest_token_bytes(tokenizer: Any) -> int | None:
    """UTF-8 bytes of the longest vocabulary entry (as stored: byte-level symbols take 1-2
    bytes per byte they stand for, so this over-estimates, which keeps the bound safe), or
    None when the tokenizer may shrink text before matching."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        normalizer = backend.normalizer
        spec = None if normalizer is None else json.loads(normalizer.__getstate__())
        if not _never_shrinks(spec):
            return None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False)
               for t in added.values()):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab),
                      default=0)
    except Exception:  # an unusual tokenizer: no fast bound, exact checks only
        logger.debug("No prompt-length bound for this tokenizer", exc_info=True)
        return None
    return longest or None


def _never_shrinks(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shrinks(n) for n in normalizer.get("normalizers", []))
    if kind not in _GROWING_NORMALIZERS:
        return False
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        return pattern == " " and normalizer.get("content") == "\u2581"
    return True
