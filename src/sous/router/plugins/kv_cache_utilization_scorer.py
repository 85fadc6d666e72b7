"""`kv-cache-utilization-scorer`: 1 - the scraped `vllm:kv_cache_usage_perc` (0..1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sous.router.framework import CycleState, Endpoint, RouterRequest
from sous.router.plugins.registry import register

TYPE = "kv-cache-utilization-scorer"


@dataclass(frozen=True)
class Parameters:
    pass


class KVCacheUtilizationScorer:
    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name

    def score(self, request: RouterRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> dict[int, float]:
        return {id(e): min(1.0, max(0.0, 1.0 - e.metrics.kv_usage)) for e in endpoints}


register(TYPE, Parameters, KVCacheUtilizationScorer)
