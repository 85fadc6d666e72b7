"""Finishing a JSON answer within `max_tokens` ("closing").

A JSON-constrained request that runs out of output budget mid-document would end with
`finish_reason: "length"` and text that does not parse. The manager avoids that: near the end
of the budget it computes a short completion of the document from the matcher's state (a
greedy depth-first search over single bytes that prefers closing characters and tries
whitespace last, then re-tokenized) and, once the remaining budget is down to the completion's
length plus `CLOSING_MARGIN`, forces that completion token by token, ending with a stop token.
So the answer is valid JSON whenever the budget allows it; when the budget cannot hold even
the completion (a too small `max_tokens`), nothing is forced and the answer is cut honestly
(`"length"`).

The margin is how many tokens one freely sampled token may add to the completion (e.g. `[[[`
opens three arrays) between two checks; a token that adds more (say, one that opens an object
with many required properties) can still leave the document unfinished, then `"length"`.
Only JSON constraints (`json`, `json_object`, forced tool calls) close; regex, choice and
grammar constraints never change the model's choice of tokens this way.

Threading: engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

CLOSING_MARGIN = 8
"""Tokens of slack before the completion is forced (see the module docstring)."""

_MAX_BYTES = 256
_MAX_TRIES = 4000
_WHITESPACE = b" \n\t\r"
_ORDER: tuple[int, ...] = tuple(dict.fromkeys(
    b'"}],0:' + b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_.[{"
    + bytes(b for b in range(32, 127) if b not in _WHITESPACE)
    + bytes(range(127, 256)) + bytes(b for b in range(32) if b not in _WHITESPACE)
    + _WHITESPACE))
"""Bytes in the order the search tries them: closers first, whitespace last."""


def completion_bytes(matcher: xgr.GrammarMatcher) -> bytes | None:
    """A short string that completes the grammar from `matcher`'s state (b"" if it is already
    complete), or None if the bounded search finds none. `matcher` is not changed."""
    m = matcher.fork()
    out = bytearray()
    tries = 0

    def search() -> bool:
        nonlocal tries
        if m.is_completed():
            return True
        if len(out) >= _MAX_BYTES or tries >= _MAX_TRIES:
            return False
        forced = m.find_jump_forward_string().encode()
        if forced:
            if not m.accept_string(forced):
                return False
            out.extend(forced)
            if search():
                return True
            m.rollback(1)
            del out[-len(forced):]
            return False
        for b in _ORDER:
            tries += 1
            if tries >= _MAX_TRIES:
                return False
            if m.accept_string(bytes((b,))):
                out.append(b)
                if search():
                    return True
                m.rollback(1)
                out.pop()
        return False

    return bytes(out) if search() else None


class Closer:
    """Completions as token ids for one tokenizer. `byte_tokens[b]` is a token whose text is
    the single byte `b` (the fallback when re-tokenizing the completion's text fails)."""

    def __init__(self, tokenizer: Any, info: xgr.TokenizerInfo, stop_token: int) -> None:
        self.tokenizer = tokenizer
        self.stop_token = stop_token
        self.byte_tokens: dict[int, int] = {}
        special = set(info.special_token_ids)
        for token_id, piece in enumerate(info.decoded_vocab):
            if len(piece) == 1 and piece[0] not in self.byte_tokens and token_id not in special:
                self.byte_tokens[piece[0]] = token_id

    def completion(self, matcher: xgr.GrammarMatcher) -> list[int] | None:
        """Token ids that complete the grammar from `matcher`'s state, ending with the stop
        token; None if no completion is found. `matcher` is not changed."""
        data = completion_bytes(matcher)
        if data is None:
            return None
        for ids in (self._encoded(data), self._bytewise(data)):
            if ids is not None and self._accepts(matcher, ids):
                return ids + [self.stop_token]
        return None

    def _encoded(self, data: bytes) -> list[int] | None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _bytewise(self, data: bytes) -> list[int] | None:
        if not all(b in self.byte_tokens for b in data):
            return None
        return [self.byte_tokens[b] for b in data]

    def _accepts(self, matcher: xgr.GrammarMatcher, ids: list[int]) -> bool:
        m = matcher.fork()
        return all(m.accept_token(t) for t in ids) and m.accept_token(self.stop_token)


def next_check(remaining: int, plan_len: int) -> int:
    """The remaining budget at which to search again, if each freely sampled token adds at
    most `CLOSING_MARGIN` tokens to a completion of `plan_len` tokens (at least one step
    later, and before the completion could stop fitting)."""
    steps = (remaining - plan_len - CLOSING_MARGIN) // (CLOSING_MARGIN + 1)
    return remaining - max(1, steps)


def force_row(bitmask: Any, row: int, token_id: int) -> None:
    """Allow only `token_id` in `bitmask[row]` (xgrammar's packed int32 layout)."""
    bitmask[row].zero_()
    value = 1 << (token_id & 31)
    bitmask[row, token_id >> 5] = value - (1 << 32) if value >= 1 << 31 else value
