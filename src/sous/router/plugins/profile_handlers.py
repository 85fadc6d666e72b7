"""Profile handlers: which scheduling profiles run for a request.

`single-profile-handler`: the one profile (`profile`, default the only one configured).
`disagg-profile-handler` (llm-d, decode first): run the decode profile; if a prefill decider
is configured and says so for the chosen decode endpoint, run the prefill profile too. The
decode profile is primary (its endpoint answers). A prefill profile that finds no endpoint
is reported in `SchedulingResult.failed`, so the caller can fail open (prefill locally on
the decode endpoint) or closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sous.router.framework import (
    CycleState,
    RouterRequest,
    RunProfile,
    SchedulingError,
    SchedulingResult,
)
from sous.router.plugins.registry import RouterConfigError, lookup, register

SINGLE = "single-profile-handler"
DISAGG = "disagg-profile-handler"


@dataclass(frozen=True)
class SingleParameters:
    profile: str = ""


class SingleProfileHandler:
    def __init__(self, name: str, params: SingleParameters) -> None:
        self.name = name
        self.profile = params.profile

    def check_profiles(self, names: list[str]) -> None:
        if not self.profile and len(names) == 1:
            self.profile = names[0]
        if self.profile not in names:
            raise RouterConfigError(f"plugin {self.name!r}: name one of the scheduling "
                                    f"profiles {names} in its 'profile' parameter")

    def schedule(self, request: RouterRequest, state: CycleState,
                 run_profile: RunProfile) -> SchedulingResult:
        return SchedulingResult({self.profile: run_profile(self.profile)}, self.profile)


@dataclass(frozen=True)
class DisaggParameters:
    profiles: dict = field(default_factory=dict)
    """Profile names by stage: `decode` (default "decode"), `prefill` (default "prefill")."""
    deciders: dict = field(default_factory=dict)
    """Decider plugin names by stage: `prefill`; an unset decider skips that stage."""
    stage_order: str = "decode-first"
    prefill_decider_plugin_name: str = ""
    """Legacy spelling of deciders.prefill."""
    decider_plugin_name: str = ""
    """Legacy spelling of deciders.prefill."""

    def __post_init__(self) -> None:
        if self.stage_order != "decode-first":
            raise ValueError(f"stageOrder {self.stage_order!r}: only 'decode-first' is "
                             "supported (a prefill decider needs decode first)")
        for key, value in (("profiles", self.profiles), ("deciders", self.deciders)):
            extra = set(value) - {"decode", "prefill", "encode"}
            if extra:
                raise ValueError(f"{key}: unknown stage(s) {sorted(extra)} "
                                 "(known: decode, prefill, encode)")
        if "encode" in self.deciders:
            raise ValueError("deciders.encode: encode disaggregation is not supported")


class DisaggProfileHandler:
    def __init__(self, name: str, params: DisaggParameters) -> None:
        self.name = name
        self.decode = params.profiles.get("decode", "decode")
        self.prefill = params.profiles.get("prefill", "prefill")
        self.decider_name = (params.deciders.get("prefill") or params.prefill_decider_plugin_name
                             or params.decider_plugin_name)
        self.decider: Any = None

    def bind(self, plugins: Mapping[str, Any]) -> None:
        if self.decider_name:
            self.decider = lookup(plugins, self.name, "deciders.prefill", self.decider_name,
                                  "disaggregate")

    def check_profiles(self, names: list[str]) -> None:
        needed = [self.decode] + ([self.prefill] if self.decider else [])
        missing = [n for n in needed if n not in names]
        if missing:
            raise RouterConfigError(f"plugin {self.name!r}: scheduling profile(s) {missing} "
                                    f"not configured (configured: {names})")

    def schedule(self, request: RouterRequest, state: CycleState,
                 run_profile: RunProfile) -> SchedulingResult:
        result = SchedulingResult({self.decode: run_profile(self.decode)}, self.decode)
        decode = result.primary_endpoint
        if self.decider is not None and self.decider.disaggregate(request, state, decode):
            try:
                result.results[self.prefill] = run_profile(self.prefill)
            except SchedulingError as e:
                result.failed[self.prefill] = str(e)
        return result


register(SINGLE, SingleParameters, SingleProfileHandler)
register(DISAGG, DisaggParameters, DisaggProfileHandler)
