"""`queue-scorer`: fewer waiting requests score higher, min-max normalised over the
candidates: (maxQ - q) / (maxQ - minQ); every endpoint scores 1 when the queues are equal.
`q` is the scraped `vllm:num_requests_waiting`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sous.router.framework import CycleState, Endpoint, RouterRequest
from sous.router.plugins.registry import register

TYPE = "queue-scorer"


@dataclass(frozen=True)
class Parameters:
    pass


class QueueScorer:
    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name

    def score(self, request: RouterRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> dict[int, float]:
        queues = {id(e): e.metrics.waiting for e in endpoints}
        if not queues:
            return {}
        low, high = min(queues.values()), max(queues.values())
        if high == low:
            return dict.fromkeys(queues, 1.0)
        return {k: (high - q) / (high - low) for k, q in queues.items()}


register(TYPE, Parameters, QueueScorer)
