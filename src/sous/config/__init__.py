"""Frozen configuration dataclasses, one per area.

Each field's docstring (the string literal right after it) becomes the flag's
`--help` text; see `sous.config.engine_args`.
"""

from sous.config.cache import CacheConfig
from sous.config.engine import EngineConfig
from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.config.parallel import ParallelConfig
from sous.config.scheduler import SchedulerConfig
from sous.config.server import ServerConfig

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
]
