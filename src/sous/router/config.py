"""The router config file, read as llm-d writes it, in either of its two shapes:

- helm values (`router-values.yaml` of the recipes): `endpoint_picker.plugins[]`
  (`type`, `name`, `parameters`), `endpoint_picker.scheduling_profiles[]` (`name`,
  `plugins[]` of `ref`, `weight`), and `inference_pool` (`failure_mode`, `match_labels`,
  `target_ports`); other helm keys (`image`, `ext_proc_port`, ...) are deployment details
  and are ignored;
- `EndpointPickerConfig` (`apiVersion: llm-d.ai/v1alpha1`): top-level `plugins[]` and
  `schedulingProfiles[]` with `pluginRef`.

`load_router_config` builds every plugin (unknown types or parameters raise
`RouterConfigError` naming them), resolves references, checks each profile has what it
needs, and adds a `single-profile-handler` when one profile and no handler are configured.

Public API: `RouterConfig`, `SchedulingProfile`, `load_router_config`, `parse_router_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import sous.router.plugins  # noqa: F401  (registers every plugin type)
from sous.router.plugins.profile_handlers import SINGLE
from sous.router.plugins.registry import RouterConfigError, bind_all, build_plugin

__all__ = ["RouterConfig", "SchedulingProfile", "load_router_config", "parse_router_config"]

FAIL_MODES = ("FailOpen", "FailClose")


@dataclass
class SchedulingProfile:
    """Filters (in order), weighted scorers and one picker."""

    name: str
    filters: list[Any] = field(default_factory=list)
    scorers: list[tuple[Any, float]] = field(default_factory=list)
    picker: Any = None


@dataclass
class RouterConfig:
    plugins: dict[str, Any]
    profiles: dict[str, SchedulingProfile]
    handler: Any
    producers: list[Any]
    failure_mode: str = "FailOpen"
    match_labels: dict[str, str] = field(default_factory=dict)
    target_ports: list[int] = field(default_factory=list)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RouterConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RouterConfigError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _build_plugins(entries: list[Any]) -> dict[str, Any]:
    plugins: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        entry = _mapping(entry, f"plugins[{i}]")
        unknown = set(entry) - {"type", "name", "parameters"}
        if unknown:
            raise RouterConfigError(f"plugins[{i}]: unknown key(s) {sorted(unknown)} "
                                    "(known: type, name, parameters)")
        if not isinstance(entry.get("type"), str):
            raise RouterConfigError(f"plugins[{i}]: 'type' is required")
        plugin = build_plugin(entry["type"], entry.get("name"), entry.get("parameters"))
        if plugin.name in plugins:
            raise RouterConfigError(f"plugins[{i}]: a plugin named {plugin.name!r} is "
                                    "already configured")
        plugins[plugin.name] = plugin
    return plugins


def _profile(entry: Any, i: int, plugins: Mapping[str, Any]) -> SchedulingProfile:
    entry = _mapping(entry, f"scheduling profile {i}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise RouterConfigError(f"scheduling profile {i}: 'name' is required")
    profile = SchedulingProfile(name)
    for j, ref_entry in enumerate(_list(entry.get("plugins"), f"profile {name!r} plugins")):
        ref_entry = _mapping(ref_entry, f"profile {name!r} plugins[{j}]")
        ref = ref_entry.get("ref", ref_entry.get("pluginRef"))
        unknown = set(ref_entry) - {"ref", "pluginRef", "weight"}
        if unknown or not isinstance(ref, str):
            raise RouterConfigError(f"profile {name!r} plugins[{j}]: expected 'ref' (or "
                                    f"'pluginRef') and optional 'weight', got {dict(ref_entry)}")
        plugin = plugins.get(ref)
        if plugin is None:
            raise RouterConfigError(f"profile {name!r}: plugin {ref!r} is not configured "
                                    f"(configured: {', '.join(sorted(plugins))})")
        weight = ref_entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise RouterConfigError(f"profile {name!r}: weight of {ref!r} must be a number "
                                    f">= 0, got {weight!r}")
        if callable(getattr(plugin, "filter", None)):
            profile.filters.append(plugin)
        elif callable(getattr(plugin, "score", None)):
            profile.scorers.append((plugin, float(weight)))
        elif callable(getattr(plugin, "pick", None)):
            if profile.picker is not None:
                raise RouterConfigError(f"profile {name!r}: more than one picker")
            profile.picker = plugin
        else:
            raise RouterConfigError(f"profile {name!r}: {ref!r} ({plugin.type_name}) is not a "
                                    "filter, scorer or picker")
    if profile.picker is None:
        profile.picker = build_plugin("max-score-picker", f"{name}-default-picker", None)
    return profile


def parse_router_config(data: Any) -> RouterConfig:
    """A `RouterConfig` from the parsed YAML document (see the module docstring)."""
    data = _mapping(data, "the router config")
    picker = _mapping(data.get("endpoint_picker"), "endpoint_picker")
    plugin_entries = _list(picker.get("plugins", data.get("plugins")), "plugins")
    profile_entries = _list(picker.get("scheduling_profiles",
                                       data.get("schedulingProfiles")), "scheduling_profiles")
    if not plugin_entries or not profile_entries:
        raise RouterConfigError("the router config needs plugins and scheduling profiles "
                                "(endpoint_picker.plugins and endpoint_picker.scheduling_profiles,"
                                " or plugins and schedulingProfiles)")
    plugins = _build_plugins(plugin_entries)
    handlers = [p for p in plugins.values() if callable(getattr(p, "schedule", None))]
    if not handlers:
        plugins[SINGLE] = build_plugin(SINGLE, None, None)
        handlers = [plugins[SINGLE]]
    if len(handlers) > 1:
        raise RouterConfigError(f"more than one profile handler: {[h.name for h in handlers]}")
    bind_all(plugins)
    profiles = {}
    for i, entry in enumerate(profile_entries):
        profile = _profile(entry, i, plugins)
        profiles[profile.name] = profile
    handlers[0].check_profiles(list(profiles))
    pool = _mapping(data.get("inference_pool", data.get("inferencePool")), "inference_pool")
    mode = pool.get("failure_mode", pool.get("failureMode", "FailOpen"))
    if mode not in FAIL_MODES:
        raise RouterConfigError(f"inference_pool.failure_mode {mode!r}: use FailOpen or "
                                "FailClose")
    ports = _list(pool.get("target_ports", pool.get("targetPorts")), "target_ports")
    return RouterConfig(
        plugins=plugins, profiles=profiles, handler=handlers[0],
        producers=[p for p in plugins.values() if callable(getattr(p, "produce", None))],
        failure_mode=mode, match_labels=dict(_mapping(pool.get("match_labels"), "match_labels")),
        target_ports=[int(p) for p in ports])


def load_router_config(path: str | Path) -> RouterConfig:
    """Read and build the config file at `path` (RouterConfigError naming the file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RouterConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RouterConfigError(f"{path}: not YAML: {e}") from None
    try:
        return parse_router_config(data)
    except RouterConfigError as e:
        raise RouterConfigError(f"{path}: {e}") from None
