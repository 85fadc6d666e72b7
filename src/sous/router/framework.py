"""The router's plugin framework, llm-d's endpoint picker in small: the request and endpoint
types every plugin sees, and the plugin kinds.

One scheduling cycle per request: data producers write per-endpoint attributes
(`CycleState`), the profile handler runs scheduling profiles (filters, then weighted scorers,
then a picker) and decides which profiles run (decode first, prefill only if its decider says
so), then producers hear the result (`pre_request`). Plugins never mutate endpoints; the
endpoint pool owns them and their scraped metrics.

Public API: `RouterRequest`, `Endpoint`, `EndpointMetrics`, `PrefixMatchInfo`, `CycleState`,
`ProfileResult`, `SchedulingResult`, `SchedulingError`, and the plugin protocols `Filter`,
`Scorer`, `Picker`, `DataProducer`, `Decider`, `ProfileHandler`, `Plugin`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["CycleState", "DataProducer", "Decider", "Endpoint", "EndpointMetrics", "Filter",
           "Picker", "Plugin", "PrefixMatchInfo", "ProfileHandler", "ProfileResult",
           "RouterRequest", "Scorer", "SchedulingError", "SchedulingResult"]

ROLE_LABEL = "llm-d.ai/role"


class SchedulingError(Exception):
    """No endpoint could be picked for a required profile (llm-d: ResourceExhausted)."""


@dataclass
class EndpointMetrics:
    """What the pool last scraped from an endpoint's `/metrics` (vLLM's names)."""

    waiting: float = 0.0            # vllm:num_requests_waiting
    running: float = 0.0            # vllm:num_requests_running
    kv_usage: float = 0.0           # vllm:kv_cache_usage_perc (0..1)
    block_size: int | None = None   # vllm:cache_config_info{block_size}
    num_blocks: int | None = None   # vllm:cache_config_info{num_gpu_blocks}
    scraped_at: float | None = None  # time.monotonic() of the last good scrape


@dataclass(eq=False)
class Endpoint:
    """One model server (`url`, e.g. http://10.0.0.5:8000) with its pod labels. `healthy` and
    `metrics` are written only by the endpoint pool."""

    url: str
    labels: dict[str, str] = field(default_factory=dict)
    healthy: bool = False
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)

    @property
    def role(self) -> str | None:
        return self.labels.get(ROLE_LABEL)

    @property
    def host_port(self) -> str:
        """`host:port`, the pod id llm-d uses (topics `kv@<host:port>@<model>`)."""
        return self.url.split("://", 1)[-1].rstrip("/")

    def __repr__(self) -> str:
        return f"Endpoint({self.url}, role={self.role}, healthy={self.healthy})"


@dataclass
class RouterRequest:
    """One client request as the plugins see it: the API path, the JSON body, its prompt as
    token ids (the served model's tokenizer and chat template) and the target model."""

    request_id: str
    path: str
    body: dict[str, Any]
    token_ids: list[int]
    model: str
    cache_salt: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PrefixMatchInfo:
    """llm-d's `PrefixCacheMatchInfo`: how many of the request's prompt blocks an endpoint is
    believed to hold (a float for tier-weighted matches)."""

    match_blocks: float
    total_blocks: int
    block_size: int

    @property
    def matched_tokens(self) -> float:
        return self.match_blocks * self.block_size


class CycleState:
    """Per-request scratch space: attributes keyed (producer name, endpoint)."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, int], Any] = {}

    def put(self, key: str, endpoint: Endpoint | None, value: Any) -> None:
        """Store `value` for (`key`, `endpoint`); endpoint None: for the request itself."""
        self._data[(key, id(endpoint))] = value

    def get(self, key: str, endpoint: Endpoint | None = None) -> Any:
        return self._data.get((key, id(endpoint)))


@dataclass(frozen=True)
class ProfileResult:
    """What one scheduling profile picked (best first) and every candidate's total score."""

    profile: str
    targets: tuple[Endpoint, ...]
    scores: dict[str, float]


@dataclass
class SchedulingResult:
    """The profiles that ran (by name), the primary one (whose endpoint answers) and the
    profiles that were wanted but found no endpoint (name -> why)."""

    results: dict[str, ProfileResult]
    primary: str
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def primary_endpoint(self) -> Endpoint:
        return self.results[self.primary].targets[0]

    def endpoint(self, profile: str) -> Endpoint | None:
        result = self.results.get(profile)
        return result.targets[0] if result and result.targets else None


@runtime_checkable
class Plugin(Protocol):
    """Every plugin has its type (`TYPE`) and its configured name."""

    name: str


class Filter(Plugin, Protocol):
    def filter(self, request: RouterRequest, state: CycleState,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]: ...


class Scorer(Plugin, Protocol):
    def score(self, request: RouterRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> dict[int, float]:
        """Score per endpoint (keyed `id(endpoint)`), each in [0, 1]."""
        ...


class Picker(Plugin, Protocol):
    def pick(self, scored: Sequence[tuple[Endpoint, float]]) -> list[Endpoint]: ...


class DataProducer(Plugin, Protocol):
    def produce(self, request: RouterRequest, state: CycleState,
                endpoints: Sequence[Endpoint]) -> None: ...

    def pre_request(self, request: RouterRequest, state: CycleState,
                    result: SchedulingResult) -> None: ...


class Decider(Plugin, Protocol):
    def disaggregate(self, request: RouterRequest, state: CycleState,
                     decode: Endpoint) -> bool: ...


RunProfile = Callable[[str], ProfileResult]
"""Runs the named scheduling profile over the candidates; raises SchedulingError."""


class ProfileHandler(Plugin, Protocol):
    def schedule(self, request: RouterRequest, state: CycleState,
                 run_profile: RunProfile) -> SchedulingResult: ...
