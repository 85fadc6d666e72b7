"""`--kv-transfer-config`: vLLM's `KVTransferConfig` fields, parsed and checked once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector the engine runs, vLLM's shape. Fields sous has no use for yet (the
    legacy P2P `kv_rank`/`kv_ip`/... and the buffer settings) are accepted and ignored, as a
    vLLM command line carries them."""

    kv_connector: str
    """A registered connector name (`LMCacheConnectorV1`, `MultiConnector`, ...), or a class
    name in `kv_connector_module_path`."""
    kv_role: str | None = None
    """`kv_producer`, `kv_consumer` or `kv_both`; required when a connector is set."""
    kv_connector_module_path: str | None = None
    """Module to import `kv_connector` from (an out-of-tree connector)."""
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Connector-specific settings (`MultiConnector`: `{"connectors": [<config>, ...]}`)."""
    kv_load_failure_policy: str = "recompute"
    """What a failed KV load does: `recompute` the missing tokens (the request goes on), or
    `fail` the request."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "--kv-transfer-config") -> KVTransferConfig:
        """Parse one connector's JSON object; ValueError naming `where` and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {data!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {known}")
        if not data.get("kv_connector"):
            raise ValueError(f"{where}: kv_connector is required")
        config = cls(**data)
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"{where}: kv_role must be one of {list(KV_ROLES)} when a "
                             f"connector is set, got {config.kv_role!r}")
        if config.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"{where}: kv_load_failure_policy must be 'recompute' or 'fail', "
                             f"got {config.kv_load_failure_policy!r}")
        if not isinstance(config.kv_connector_extra_config, dict):
            raise ValueError(f"{where}: kv_connector_extra_config must be a JSON object")
        return config
