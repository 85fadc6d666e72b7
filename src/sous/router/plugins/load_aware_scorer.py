"""`load-aware-scorer`: 0.5 for an empty queue, falling linearly to 0 at `threshold` waiting
requests: 0.5 * (1 - q / threshold), 0 at or beyond it (llm-d's load-aware scorer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sous.router.framework import CycleState, Endpoint, RouterRequest
from sous.router.plugins.registry import register

TYPE = "load-aware-scorer"


@dataclass(frozen=True)
class Parameters:
    threshold: int = 128
    """Waiting requests at which an endpoint scores 0."""

    def __post_init__(self) -> None:
        if self.threshold <= 0:
            raise ValueError("threshold must be > 0")


class LoadAwareScorer:
    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name
        self.threshold = params.threshold

    def score(self, request: RouterRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> dict[int, float]:
        return {id(e): max(0.0, 0.5 * (1.0 - e.metrics.waiting / self.threshold))
                for e in endpoints}


register(TYPE, Parameters, LoadAwareScorer)
