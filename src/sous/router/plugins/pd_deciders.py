"""P/D deciders: whether a request's prompt is prefilled on a prefill endpoint.

`prefix-based-pd-decider` (llm-d): with `nonCachedTokens` N > 0, disaggregate iff the prompt
has at least N tokens that the chosen decode endpoint does not hold (prompt tokens minus
the prefix producer's matched blocks x block size); N = 0 never disaggregates, and prompts
shorter than `promptTokens` (when > 0) or than N stay on the decode endpoint.
`always-disagg-pd-decider` always disaggregates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sous.router.framework import CycleState, Endpoint, PrefixMatchInfo, RouterRequest
from sous.router.plugins.registry import register, resolve_producer

PREFIX_BASED = "prefix-based-pd-decider"
ALWAYS = "always-disagg-pd-decider"


@dataclass(frozen=True)
class PrefixBasedParameters:
    non_cached_tokens: int = 0
    """Uncached prompt tokens on the decode endpoint that justify a remote prefill."""
    prompt_tokens: int = 0
    """Shorter prompts are never disaggregated (0: no minimum)."""
    prefix_match_info_producer_name: str = ""
    """The producer whose match the decider reads (default: the one configured)."""

    def __post_init__(self) -> None:
        if self.non_cached_tokens < 0 or self.prompt_tokens < 0:
            raise ValueError("nonCachedTokens and promptTokens must be >= 0")


class PrefixBasedPDDecider:
    def __init__(self, name: str, params: PrefixBasedParameters) -> None:
        self.name = name
        self.params = params
        self.producer = params.prefix_match_info_producer_name

    def bind(self, plugins: Mapping[str, Any]) -> None:
        self.producer = resolve_producer(plugins, self.name, self.producer, required=False)

    def disaggregate(self, request: RouterRequest, state: CycleState, decode: Endpoint) -> bool:
        n = self.params.non_cached_tokens
        prompt = request.prompt_tokens
        if n == 0 or prompt < n or prompt < self.params.prompt_tokens:
            return False
        info: PrefixMatchInfo | None = state.get(self.producer, decode) if self.producer else None
        if info is None:
            return False
        return prompt - info.matched_tokens >= n


@dataclass(frozen=True)
class AlwaysParameters:
    pass


class AlwaysDisaggPDDecider:
    def __init__(self, name: str, params: AlwaysParameters) -> None:
        self.name = name

    def disaggregate(self, request: RouterRequest, state: CycleState, decode: Endpoint) -> bool:
        return True


register(PREFIX_BASED, PrefixBasedParameters, PrefixBasedPDDecider)
register(ALWAYS, AlwaysParameters, AlwaysDisaggPDDecider)
