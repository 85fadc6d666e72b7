"""LMCache's configuration, read as LMCache reads it (`LMCACHE_<KEY>` variables, or the YAML
file `LMCACHE_CONFIG_FILE`, which then wins), but checked strictly: LMCache logs a bad value
and runs with None, sous stops at start-up naming the variable (ConfigError, exit 2).

Also here: the environment LMCache must see before it is imported (`LMCACHE_TRACK_USAGE`
false: LMCache reports usage to its authors otherwise; INFO logs off), the RDS plugin alias,
and the start-up checks a deployment gets wrong (a plugin module that does not import, a
disk directory that cannot be written, a Redis that does not answer).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from sous.config.errors import ConfigError

logger = logging.getLogger(__name__)

RDS_MODULE = "lmcache_rbln.storage_plugin.rds_backend"
"""The recipes' RDS plugin module; without the `lmcache_rbln` package it resolves to ours."""
SOUS_RDS_MODULE = "sous.kv_transfer.offload.rds_backend"
_BOOLS = {"true": True, "1": True, "yes": True, "on": True,
          "false": False, "0": False, "no": False, "off": False}
_NON_NEGATIVE = ("max_local_cpu_size", "max_local_disk_size")


def prepare_lmcache_environment() -> None:
    """Defaults LMCache reads at import: no usage reporting, warnings and up only."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def load_lmcache_config(env: dict[str, str] | None = None) -> Any:
    """An `LMCacheEngineConfig` from `env` (default: os.environ). ConfigError on a value
    LMCache would silently drop, a missing config file or a plugin module that does not
    import. Tiers that cannot work here (unwritable disk directory, unreachable Redis) are
    switched off with a warning, as LMCache keeps serving without them."""
    env = dict(os.environ if env is None else env)
    prepare_lmcache_environment()
    from lmcache.v1.config import _CONFIG_DEFINITIONS, LMCacheEngineConfig

    path = env.get("LMCACHE_CONFIG_FILE")
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"LMCACHE_CONFIG_FILE={path}: no such file")
        try:
            config = LMCacheEngineConfig.from_file(path)
        except Exception as e:
            raise ConfigError(f"LMCACHE_CONFIG_FILE={path}: {e}") from None
    else:
        for key, spec in _CONFIG_DEFINITIONS.items():
            raw = env.get(f"LMCACHE_{key.upper()}")
            if raw is not None:
                _check_value(f"LMCACHE_{key.upper()}", raw, spec)
        config = LMCacheEngineConfig.from_env()
    _check_ranges(config, "LMCACHE_CONFIG_FILE" if path else None)
    _resolve_plugins(config)
    _check_disk(config)
    _check_remote(config)
    return config


def _check_value(name: str, raw: str, spec: dict[str, Any]) -> None:
    value = raw.strip().strip("'\"")
    if spec.get("type") is bool:
        if value.lower() not in _BOOLS:
            raise ConfigError(f"{name}={raw!r}: not a boolean (true/false)")
        return
    converter = spec.get("env_converter")
    if converter is None or not value:
        return
    try:
        converter(value)
    except Exception as e:
        raise ConfigError(f"{name}={raw!r}: {e}") from None


def _check_ranges(config: Any, source: str | None) -> None:
    def where(key: str) -> str:
        return source or f"LMCACHE_{key.upper()}"

    if not isinstance(config.chunk_size, int) or config.chunk_size < 1:
        raise ConfigError(f"{where('chunk_size')}: chunk_size must be a positive integer, "
                          f"got {config.chunk_size!r}")
    for key in _NON_NEGATIVE:
        value = getattr(config, key)
        if not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{where(key)}: {key} must be a number of GB >= 0, got {value!r}")
    staged = [name for name, on in (("local_disk", _disk_tier(config)),
                                    ("remote_url", config.remote_url)) if on]
    if staged and config.max_local_cpu_size <= 0:
        raise ConfigError(f"{where('max_local_cpu_size')}: LMCache stages {staged[0]} reads and "
                          "writes in CPU memory: set max_local_cpu_size > 0 (with local_cpu "
                          "false it is only that staging buffer)")


def _resolve_plugins(config: Any) -> None:
    """Map the RDS alias and import every storage plugin's module now, so a typo stops the
    start (LMCache would log it and run without the tier)."""
    extra = dict(config.extra_config or {})
    for name in config.storage_plugins or []:
        key = f"storage_plugin.{name}.module_path"
        module = extra.get(key)
        if not module or not extra.get(f"storage_plugin.{name}.class_name"):
            raise ConfigError(f"LMCACHE_STORAGE_PLUGINS names {name!r} but LMCACHE_EXTRA_CONFIG "
                              f"has no storage_plugin.{name}.module_path and .class_name")
        if module == RDS_MODULE and importlib.util.find_spec("lmcache_rbln") is None:
            extra[key] = module = SOUS_RDS_MODULE
        try:
            cls = getattr(importlib.import_module(module),
                          extra[f"storage_plugin.{name}.class_name"], None)
        except Exception as e:
            raise ConfigError(f"storage plugin {name}: module {module!r} cannot be imported: "
                              f"{type(e).__name__}: {e}") from None
        if cls is None:
            raise ConfigError(f"storage plugin {name}: {module} has no class "
                              f"{extra[f'storage_plugin.{name}.class_name']!r}")
    config.extra_config = extra or config.extra_config


def _check_disk(config: Any) -> None:
    if not _disk_tier(config):
        return
    for directory in str(config.local_disk).split(","):
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            # one name per process: pipeline stages probe the same folder at once
            probe = Path(directory) / f".sous-write-probe-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            logger.warning("LMCache disk tier %s is not writable (%s): serving without it.",
                           directory, e)
            config.local_disk = None
            config.max_local_disk_size = 0.0
            return


def _check_remote(config: Any) -> None:
    url = config.remote_url
    if not url:
        return
    if not url.startswith(("redis://", "rediss://")):
        return  # other LMCache remotes (lm://, valkey://, ...) are LMCache's to check
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except Exception as e:
        logger.warning("LMCache remote tier %s does not answer (%s): serving without it; "
                       "restart to use it.", url, e)
        config.remote_url = None


def _cpu_tier(config: Any) -> bool:
    """A CPU tier that keeps chunks (with `local_cpu` false the buffer only stages)."""
    return bool(config.local_cpu and config.max_local_cpu_size > 0)


def _disk_tier(config: Any) -> bool:
    return bool(config.local_disk and config.max_local_disk_size > 0)


def tier_media(config: Any) -> list[str]:
    """The KV-event `medium` of each tier a stored chunk is written to (all of them)."""
    media = []
    if _cpu_tier(config):
        media.append("CPU")
    if _disk_tier(config) or config.storage_plugins:
        media.append("DISK")
    if config.remote_url:
        media.append("REMOTE")
    return media


def describe_tiers(config: Any, chunk_bytes: int) -> list[str]:
    """One line per tier LMCache will run, with its capacity."""
    def chunks(gb: float) -> str:
        return f"{gb:g} GB, {int(gb * 1e9 // max(chunk_bytes, 1))} chunks"

    tiers = []
    if _cpu_tier(config):
        tiers.append(f"CPU ({chunks(config.max_local_cpu_size)})")
    if _disk_tier(config):
        tiers.append(f"disk {config.local_disk} ({chunks(config.max_local_disk_size)})")
    if config.remote_url:
        tiers.append(f"remote {config.remote_url} (serde {config.remote_serde})")
    for name in config.storage_plugins or []:
        module = (config.extra_config or {}).get(f"storage_plugin.{name}.module_path")
        tiers.append(f"plugin {name} ({module})")
    return tiers
