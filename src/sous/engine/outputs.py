"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# One entry per generated token: {token_id: Logprob}; the sampled token is always present.
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """1-based rank among the vocabulary (1 = most likely)."""
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """None while running; then "stop" or "length" (or "abort")."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output, if any."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    num_external_computed_tokens: int = 0
    """Of those, tokens a KV connector loaded (offload tier, P/D transfer)."""
    kv_transfer_params: dict[str, Any] | None = None
    """On the final output: the KV connector's parameters for the next leg (P/D)."""
    metrics: dict[str, float] = field(default_factory=dict)
