from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sous.config.cache import CacheConfig
from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.config.parallel import ParallelConfig
from sous.config.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped by area. Built by `sous.config.engine_args`
    (from `sous serve` flags or `LLM(...)` keyword arguments)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: str = "auto"
    """`cpu`, `cuda`, or `auto` (cuda when available)."""
    kv_transfer_config: dict[str, Any] | None = None
    """KV connector configuration as JSON, vLLM's shape: `{"kv_connector": ..., "kv_role": ...,
    "kv_connector_extra_config": {...}}`. Connectors: `LMCacheConnectorV1` /
    `RBLNLMCacheConnectorV1` (KV offload tiers, configured by LMCache's `LMCACHE_*` variables
    or `LMCACHE_CONFIG_FILE`) and `MultiConnector` (`{"connectors": [...]}`)."""
    kv_events_config: dict[str, Any] | None = None
    """KV cache event publishing as JSON, vLLM's shape: `{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": ..., "topic": ...}`."""
    structured_outputs_config: dict[str, Any] | None = None
    """Structured outputs as JSON, vLLM's fields: `{"backend": "auto"|"xgrammar",
    "disable_any_whitespace": bool, "disable_additional_properties": bool,
    "disable_fallback": bool, "reasoning_parser": str, "enable_in_reasoning": bool}` (see
    `sous.config.structured_outputs`)."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding as JSON, vLLM's shape: `{"method": "ngram"|"suffix"|"eagle3"|"mtp",
    "num_speculative_tokens": ..., "model": ...}`."""
    engine_ready_timeout_s: float = 600.0
    """Seconds the server waits for the engine to start (from the environment variable
    VLLM_ENGINE_READY_TIMEOUT_S, as in vLLM; not a flag)."""
