"""Plugin registry: type name -> (parameters dataclass, factory), as llm-d registers plugins.

Each plugin module calls `register(TYPE, Parameters, factory)`. Parameters are written in
the config with llm-d's camelCase keys (`nonCachedTokens`) and land in snake_case dataclass
fields (`non_cached_tokens`); an unknown key, a value of the wrong type or an unknown type
raises `RouterConfigError` naming the plugin. After every plugin is built, plugins that
reference others by name (a decider, a producer) resolve them in `bind(plugins)`.

Public API: `RouterConfigError`, `register`, `known_types`, `build_plugin`, `bind_all`,
`camel_to_snake`, `lookup`, `resolve_producer`.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

__all__ = ["RouterConfigError", "bind_all", "build_plugin", "camel_to_snake", "known_types",
           "lookup", "register", "resolve_producer"]


class RouterConfigError(ValueError):
    """A router config problem; `sous route` prints it and exits 2."""


@dataclass(frozen=True)
class _Registration:
    params: type
    factory: Callable[[str, Any], Any]


_REGISTRY: dict[str, _Registration] = {}


def register(type_name: str, params: type, factory: Callable[[str, Any], Any]) -> None:
    """Make `type_name` buildable: `factory(name, params_instance)` returns the plugin."""
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"{type_name}: parameters must be a dataclass")
    _REGISTRY[type_name] = _Registration(params, factory)


def known_types() -> list[str]:
    return sorted(_REGISTRY)


def camel_to_snake(key: str) -> str:
    """`nonCachedTokens` -> `non_cached_tokens`; acronyms stay whole (`speculativeTTL` ->
    `speculative_ttl`)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", key).lower()


def _snake_to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join("TTL" if p == "ttl" else p.title() for p in rest)


def _accepts(hint: Any, value: Any) -> bool:
    if hint is Any:
        return True
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_accepts(h, value) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _parameters(type_name: str, name: str, cls: type, raw: Mapping[str, Any] | None) -> Any:
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise RouterConfigError(f"plugin {name!r} ({type_name}): parameters must be a mapping")
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = camel_to_snake(str(key))
        if field not in fields:
            known = ", ".join(sorted(_snake_to_camel(f) for f in fields)) or "none"
            raise RouterConfigError(f"plugin {name!r} ({type_name}): unknown parameter "
                                    f"{key!r} (known: {known})")
        if not _accepts(hints[field], value):
            raise RouterConfigError(f"plugin {name!r} ({type_name}): parameter {key!r} "
                                    f"must be {hints[field]}, got {value!r}")
        values[field] = value
    try:
        return cls(**values)
    except ValueError as e:
        raise RouterConfigError(f"plugin {name!r} ({type_name}): {e}") from None


def build_plugin(type_name: str, name: str | None, raw_params: Mapping[str, Any] | None) -> Any:
    """A plugin instance from its config entry (`name` defaults to the type)."""
    reg = _REGISTRY.get(type_name)
    if reg is None:
        raise RouterConfigError(f"unknown plugin type {type_name!r} (known: "
                                f"{', '.join(known_types())})")
    name = name or type_name
    plugin = reg.factory(name, _parameters(type_name, name, reg.params, raw_params))
    plugin.name = name
    plugin.type_name = type_name
    return plugin


def bind_all(plugins: Mapping[str, Any]) -> None:
    """Let each plugin resolve the plugins it names (RouterConfigError if one is missing)."""
    for plugin in plugins.values():
        bind = getattr(plugin, "bind", None)
        if bind is not None:
            bind(plugins)


def lookup(plugins: Mapping[str, Any], owner: str, param: str, ref: str, method: str) -> Any:
    """The plugin named `ref` for `owner`'s parameter `param`; it must have `method`."""
    plugin = plugins.get(ref)
    if plugin is None:
        raise RouterConfigError(f"plugin {owner!r}: {param} names {ref!r}, which is not a "
                                f"configured plugin (configured: {', '.join(sorted(plugins))})")
    if not callable(getattr(plugin, method, None)):
        raise RouterConfigError(f"plugin {owner!r}: {param} names {ref!r}, a "
                                f"{plugin.type_name}, which has no {method}()")
    return plugin


def resolve_producer(plugins: Mapping[str, Any], owner: str, name: str,
                     required: bool = True) -> str:
    """The data producer `owner` reads: `name` when given (it must be a configured producer),
    else the only producer configured ("" when none and not `required`)."""
    if name:
        lookup(plugins, owner, "prefixMatchInfoProducerName", name, "produce")
        return name
    producers = [n for n, p in plugins.items() if callable(getattr(p, "produce", None))]
    if len(producers) == 1 or (not producers and not required):
        return producers[0] if producers else ""
    raise RouterConfigError(f"plugin {owner!r}: set prefixMatchInfoProducerName "
                            f"(producers configured: {producers or 'none'})")
