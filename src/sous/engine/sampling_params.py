"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from sous.engine.structured_output.params import StructuredOutputsParams
from sous.engine.validation import INT64_MAX, INT64_MIN


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0
    """Every output carries all text and tokens so far (the offline `LLM` default)."""
    DELTA = 1
    """Every output carries only what is new since the previous one (streaming servers)."""
    FINAL_ONLY = 2
    """Only the finished output is produced."""


_GREEDY_EPS = 1e-5
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k."""
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None: up to the room left in max_model_len."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Number of top logprobs returned per generated token (the sampled token is always included)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output (JSON schema, regex, choice, grammar); a dict of
    StructuredOutputsParams fields is accepted too."""
    extra_args: dict[str, Any] | None = None
    """Arguments for engine plug-ins, as vLLM's: `kv_transfer_params` (a KV connector's
    per-request parameters, P/D disaggregation)."""

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            so: dict[str, Any] = self.structured_outputs
            self.structured_outputs = StructuredOutputsParams(**so)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            check(isinstance(value, int | float) and not isinstance(value, bool),
                  f"{name} must be a number, got {value!r}.")
            check(math.isfinite(value), f"{name} must be a finite number, got {value}.")
        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                    and INT64_MIN <= self.seed <= INT64_MAX),
              f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed}.")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(self.repetition_penalty > 0.0,
              f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        check(self.temperature >= 0.0,
              f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(self.top_k >= 0, f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(self.max_tokens is None or self.max_tokens >= 1,
              f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
              f"got {self.min_tokens}.")
        check(self.logprobs is None or self.logprobs >= 0,
              f"logprobs must be non-negative, got {self.logprobs}.")
        check(all(s for s in self.stop), "stop cannot contain an empty string.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes: object) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **changes)
