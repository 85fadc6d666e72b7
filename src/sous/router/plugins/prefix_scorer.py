"""`prefix-cache-scorer`: scores endpoints by the prefix match a producer found for them.

score = (1 - w) * matchBlocks / totalBlocks + w * min(1, matchedTokens / scale)^2 with
`w = matchLengthWeight` (default 0: just the matched fraction) and `scale =
matchLengthScaleTokens`; 0 when the producer wrote nothing or the prompt has no block.
`prefixMatchInfoProducerName` names the producer (default: the one configured producer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sous.router.framework import CycleState, Endpoint, PrefixMatchInfo, RouterRequest
from sous.router.plugins.registry import register, resolve_producer

TYPE = "prefix-cache-scorer"


@dataclass(frozen=True)
class Parameters:
    prefix_match_info_producer_name: str = ""
    match_length_weight: float = 0.0
    match_length_scale_tokens: int = 8192

    def __post_init__(self) -> None:
        if not 0.0 <= self.match_length_weight <= 1.0:
            raise ValueError("matchLengthWeight must be in [0, 1]")
        if self.match_length_scale_tokens <= 0:
            raise ValueError("matchLengthScaleTokens must be > 0")


def prefix_score(info: PrefixMatchInfo | None, params: Parameters) -> float:
    if info is None or info.total_blocks == 0:
        return 0.0
    w = params.match_length_weight
    ratio = info.match_blocks / info.total_blocks
    length = min(1.0, info.matched_tokens / params.match_length_scale_tokens) ** 2
    return (1 - w) * ratio + w * length


class PrefixCacheScorer:
    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name
        self.params = params
        self.producer = params.prefix_match_info_producer_name

    def bind(self, plugins: Mapping[str, Any]) -> None:
        self.producer = resolve_producer(plugins, self.name, self.producer)

    def score(self, request: RouterRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> dict[int, float]:
        return {id(e): prefix_score(state.get(self.producer, e), self.params) for e in endpoints}


register(TYPE, Parameters, PrefixCacheScorer)
