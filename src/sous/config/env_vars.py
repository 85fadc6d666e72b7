"""Settings vLLM reads from environment variables, parsed into config field values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TOKENIZER_CACHE_ENV", "env_flag", "env_values"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

TOKENIZER_CACHE_ENV = "SOUS_TOKENIZER_CACHE"
"""On (default) / off: the disk cache of converted GGUF tokenizers
(`sous.models.gguf_tokenizer`)."""


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean variable: 1 / true / yes / on or 0 / false / no / off (any case, spaces
    ignored); `default` when unset. Any other value is a ValueError naming the variable."""
    if name not in environ:
        return default
    raw = environ[name].strip().lower()
    if raw not in _TRUE + _FALSE:
        raise ValueError(f"{name}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")
    return raw in _TRUE


def _positive_seconds(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected seconds > 0")
    return value


def _cpu_kvcache_space_bytes(environ: Mapping[str, str]) -> int | None:
    """VLLM_CPU_KVCACHE_SPACE in GiB (0 or unset: the default)."""
    raw = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={raw!r}: expected GiB >= 0 (0: the default)")
    return int(gib * 2**30) if gib > 0 else None


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config field values from the environment; ValueError naming the variable when one is
    malformed. Only variables that are set appear in the result."""
    out: dict[str, Any] = {}
    timeout = _positive_seconds(environ, "VLLM_ENGINE_READY_TIMEOUT_S")
    if timeout is not None:
        out["engine_ready_timeout_s"] = timeout
    space = _cpu_kvcache_space_bytes(environ)
    if space is not None:
        out["cpu_kvcache_space_bytes"] = space
    raw = environ.get("VLLM_WORKER_MULTIPROC_METHOD", "").strip()
    if raw:
        if raw not in ("spawn", "fork"):
            raise ValueError(f"VLLM_WORKER_MULTIPROC_METHOD={raw!r}: expected spawn or fork")
        out["worker_multiproc_method"] = raw
    from sous.engine import cpu_threads

    if any(environ.get(name, "").strip() for name in cpu_threads.ENV_VARS):
        out["cpu_threads"] = cpu_threads.parse_cpu_threads_env(environ)
    from sous.engine.kv_cache.sub_block import ENV_VAR, env_enabled

    if ENV_VAR in environ:  # a bad value: `sous serve` exits 2 naming the variable
        out["enable_sub_block_cache"] = env_enabled(environ)
    env_flag(environ, TOKENIZER_CACHE_ENV, True)  # a bad value stops `sous serve` at once
    return out
