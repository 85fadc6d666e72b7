"""Architecture name (config.json `architectures[0]`) -> sous model class.

Entries are `module:Class` strings, imported on first use, so registering a model family costs
nothing until it is served.
"""

from __future__ import annotations

import importlib

from torch import nn

from sous.config.errors import ConfigError

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "sous.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "sous.models.llama:LlamaForCausalLM",
    "DeepseekV3ForCausalLM": "sous.models.deepseek:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "sous.models.deepseek:DeepseekV32ForCausalLM",
    "AXK2ForCausalLM": "sous.models.deepseek:AXK2ForCausalLM",
    "MiniMaxM2ForCausalLM": "sous.models.minimax_m2:MiniMaxM2ForCausalLM",
}


def register_model(architecture: str, target: str) -> None:
    """Register `architecture` as served by `target` (`"package.module:ClassName"`)."""
    _MODELS[architecture] = target


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class serving `architecture`; ValueError listing the supported ones otherwise."""
    target = _MODELS.get(architecture)
    if target is None:
        raise ConfigError(
            f"Model architecture {architecture!r} is not supported by sous. "
            f"Supported architectures: {', '.join(supported_architectures())}"
        )
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def resolve_architecture(hf_config: object) -> str:
    """The first of the config's `architectures` that sous supports (ConfigError if none)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for a in archs:
        if a in _MODELS:
            return a
    shown = ", ".join(archs) if archs else "(none given in config.json)"
    raise ConfigError(
        f"Model architecture {shown} is not supported by sous. "
        f"Supported architectures: {', '.join(supported_architectures())}"
    )
