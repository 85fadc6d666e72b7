from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (prefill chunks + decodes). Chunked prefill is always on."""
    max_model_len: int = 2048
    """Resolved max model length (copied from the model config once known)."""
    long_prefill_token_threshold: int = 0
    """Cap on the tokens one request prefills in a step, whether it is running or being
    admitted (0: no cap)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks across engine steps (always on in sous)."""
