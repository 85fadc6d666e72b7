"""Request checks shared by the offline `LLM` and the OpenAI server: one rule, one message.

Pure functions of their arguments (no engine state), so any thread may call them.

Context length (vLLM v1's input processor and OpenAI server): a prompt longer than
`max_model_len` is rejected; with `max_tokens` unset the output may use all the room left,
so a prompt of exactly `max_model_len` tokens (room 0) is rejected too; with `max_tokens` set,
`prompt + max_tokens` must fit. The messages are the OpenAI server's ("This model's maximum
context length is ..."), which clients parse.
"""

from __future__ import annotations

from collections.abc import Sequence

from sous.engine.errors import RequestValidationError

__all__ = ["INT64_MAX", "INT64_MIN", "RequestValidationError", "check_prompt_token_ids",
           "check_token_ids_param", "resolve_max_tokens"]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
"""The accepted `seed` range (vLLM: torch.long); child `i` of an `n > 1` request uses
`seed + i`, which torch's generators accept up to 2**64 - 1."""


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       at_least: bool = False) -> int:
    """The output budget of a prompt of `prompt_len` tokens: `requested`, or all the room
    left when None. Raises RequestValidationError when it does not fit (`at_least`: the
    length is a lower bound, and the message says so)."""
    shown = f"at least {prompt_len}" if at_least else str(prompt_len)
    if prompt_len > max_model_len or (requested is None and prompt_len >= max_model_len):
        raise RequestValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {shown} input tokens. Please reduce the length of the input "
            f"messages.", "messages")
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise RequestValidationError(f"max_tokens must be at least 1, got {requested}.",
                                     "max_tokens")
    if prompt_len + requested > max_model_len:
        total = f"at least {prompt_len + requested}" if at_least else str(prompt_len + requested)
        raise RequestValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({shown} in the messages, {requested} in the "
            f"completion). Please reduce the length of the messages or completion.",
            "max_tokens")
    return requested


def check_prompt_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Non-empty, every id in [0, vocab_size)."""
    if len(ids) == 0:
        raise RequestValidationError("The prompt cannot be empty.", "prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise RequestValidationError(
            f"Token id out of vocabulary (size {vocab_size}) in the prompt.", "prompt")


def check_token_ids_param(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """A list of token ids in a sampling parameter (e.g. `stop_token_ids`): each in
    [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestValidationError(
            f"{name} must be token ids of the vocabulary (0 to {vocab_size - 1}), got "
            f"{bad[0]}.", name)
