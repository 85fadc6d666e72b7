"""Connectors by name, as vLLM's `KVConnectorFactory`: `--kv-transfer-config`'s
`kv_connector` picks one; `kv_connector_module_path` imports an out-of-tree class."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from sous.config.errors import ConfigError
from sous.kv_transfer.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from sous.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from sous.config.engine import EngineConfig

_OFFLOAD = "sous.kv_transfer.offload.connector:LMCacheOffloadConnector"
_NIXL = "sous.kv_transfer.pd.connector:NixlConnector"
REGISTRY: dict[str, str] = {
    "LMCacheConnectorV1": _OFFLOAD,
    "RBLNLMCacheConnectorV1": _OFFLOAD,
    "NixlConnector": _NIXL,
    "RblnNixlConnector": _NIXL,
    "MultiConnector": "sous.kv_transfer.multi:MultiConnector",
}
"""Connector name -> `module:Class` (imported on first use). A registered name whose
`kv_connector_module_path` is not installed (the recipes name vllm-rbln's
`lmcache_rbln.integration.vllm.connector`) resolves here too."""


def connector_names(value: dict[str, Any] | None) -> list[str]:
    """Every connector name a raw `--kv-transfer-config` holds (MultiConnector children
    included), before it is parsed."""
    if not isinstance(value, dict):
        return []
    names = [value.get("kv_connector")]
    extra = value.get("kv_connector_extra_config")
    if isinstance(extra, dict) and isinstance(extra.get("connectors"), list):
        names += [c.get("kv_connector") for c in extra["connectors"] if isinstance(c, dict)]
    return [n for n in names if isinstance(n, str)]


def known_connectors() -> list[str]:
    return sorted(REGISTRY)


def check_connector_name(config: KVTransferConfig) -> None:
    """ValueError unless `config` (and, for `MultiConnector`, each child) names a connector
    that can be found; a module path must import."""
    if config.kv_connector_module_path and config.kv_connector not in REGISTRY:
        _import_class(config.kv_connector_module_path, config.kv_connector)
    elif config.kv_connector not in REGISTRY:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: "
                         f"{', '.join(known_connectors())} (or set kv_connector_module_path)")
    if config.kv_connector == "MultiConnector":
        for child in multi_children(config):
            check_connector_name(child)


def multi_children(config: KVTransferConfig) -> list[KVTransferConfig]:
    """A `MultiConnector`'s child configs, in order (ValueError if malformed)."""
    children = config.kv_connector_extra_config.get("connectors")
    if not isinstance(children, list) or not children:
        raise ValueError("MultiConnector needs kv_connector_extra_config.connectors: a "
                         "non-empty list of connector configs")
    out = []
    for i, child in enumerate(children):
        if isinstance(child, dict):
            child = {"kv_role": config.kv_role, "engine_id": config.engine_id, **child}
        out.append(KVTransferConfig.from_dict(child, f"MultiConnector connectors[{i}]"))
    return out


def create_connector(config: KVTransferConfig, role: KVConnectorRole,
                     context: KVConnectorContext) -> KVConnectorBase:
    """The connector `config` names, for `role`. ConfigError for a name or module that
    cannot be resolved."""
    try:
        if config.kv_connector_module_path and not _registered_fallback(config):
            cls = _import_class(config.kv_connector_module_path, config.kv_connector)
        elif config.kv_connector in REGISTRY:
            module, _, name = REGISTRY[config.kv_connector].partition(":")
            cls = getattr(importlib.import_module(module), name)
        else:
            check_connector_name(config)
            raise AssertionError("unreachable")
    except ValueError as e:
        raise ConfigError(f"--kv-transfer-config: {e}") from None
    return cls(config, role, context)


def check_placement(config: EngineConfig) -> None:
    """ConfigError, before anything loads, for an offload connector with the worker in
    another process: its scheduler and worker sides share one LMCache engine (pipeline
    stages answer the scheduler's lookups themselves)."""
    transfer = config.kv_transfer_config
    if (transfer is None or config.parallel.distributed_executor_backend != "mp"
            or config.parallel.pipeline_parallel_size > 1):
        return
    offload = [n for n in connector_names(transfer) if REGISTRY.get(n) == _OFFLOAD]
    if offload:
        raise ConfigError(f"--kv-transfer-config {offload[0]}: the offload connector runs in the "
                          "engine's process; drop --distributed-executor-backend mp")


def make_connector(config: EngineConfig, role: KVConnectorRole, kv_cache_spec: Any,
                   loaded: Any, pp_rank: int = 0) -> KVConnectorBase:
    """The connector `--kv-transfer-config` names, for `role`, in an engine serving
    `loaded` (a `LoadedModel` or `ModelInfo`: its served name names the offload keys); a
    worker-side connector of pipeline stage `pp_rank` moves that stage's layers
    (`kv_cache_spec`) only."""
    assert config.kv_transfer_config is not None
    transfer = KVTransferConfig.from_dict(config.kv_transfer_config)
    context = KVConnectorContext(
        model_name=config.model.model or loaded.served_model_name,
        kv_cache_spec=kv_cache_spec, block_size=config.cache.block_size,
        world_size=config.parallel.pipeline_parallel_size, rank=pp_rank,
        dp_rank=config.parallel.dp_rank,
        enable_kv_events=bool((config.kv_events_config or {}).get("enable_kv_cache_events")))
    return create_connector(transfer, role, context)


def _registered_fallback(config: KVTransferConfig) -> bool:
    """True when a registered connector's `kv_connector_module_path` is not installed: the
    registry's class serves it."""
    if config.kv_connector not in REGISTRY:
        return False
    top = (config.kv_connector_module_path or "").split(".")[0]
    return importlib.util.find_spec(top) is None


def _import_class(module_path: str, name: str) -> Any:
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"kv_connector_module_path {module_path!r} cannot be imported: "
                         f"{e}") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"{module_path} has no KV connector class {name!r}")
    return cls
