"""One scheduling cycle: producers, then the profile handler running scheduling profiles
(filters in order, weighted scorers, picker), then producers hear the result.

Scores: each scorer's values are clamped to [0, 1] and summed with the profile's weights
(not normalised, as llm-d). A profile whose filters leave no endpoint raises
`SchedulingError`.

Public API: `RouterScheduler`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sous.router.config import RouterConfig, SchedulingProfile
from sous.router.framework import (
    CycleState,
    Endpoint,
    ProfileResult,
    RouterRequest,
    SchedulingError,
    SchedulingResult,
)

__all__ = ["RouterScheduler"]


def run_profile(profile: SchedulingProfile, request: RouterRequest, state: CycleState,
                candidates: Sequence[Endpoint]) -> ProfileResult:
    endpoints = list(candidates)
    for f in profile.filters:
        endpoints = f.filter(request, state, endpoints)
        if not endpoints:
            raise SchedulingError(f"profile {profile.name!r}: no endpoint left after "
                                  f"filter {f.name!r}")
    totals = {id(e): 0.0 for e in endpoints}
    for scorer, weight in profile.scorers:
        scores = scorer.score(request, state, endpoints)
        for e in endpoints:
            totals[id(e)] += weight * min(1.0, max(0.0, scores.get(id(e), 0.0)))
    picked = profile.picker.pick([(e, totals[id(e)]) for e in endpoints])
    if not picked:
        raise SchedulingError(f"profile {profile.name!r}: the picker chose no endpoint")
    return ProfileResult(profile.name, tuple(picked), {e.url: totals[id(e)] for e in endpoints})


class RouterScheduler:
    """Picks endpoints for requests with a `RouterConfig`'s plugins (stateful: producers
    remember what they learn)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    def schedule(self, request: RouterRequest, candidates: Sequence[Endpoint]
                 ) -> tuple[SchedulingResult, CycleState]:
        """Raises SchedulingError when the primary profile finds no endpoint."""
        if not candidates:
            raise SchedulingError("no healthy endpoint")
        state = CycleState()
        for producer in self.config.producers:
            producer.produce(request, state, candidates)
        profiles = self.config.profiles

        def run(name: str) -> ProfileResult:
            return run_profile(profiles[name], request, state, candidates)

        result = self.config.handler.schedule(request, state, run)
        for producer in self.config.producers:
            producer.pre_request(request, state, result)
        return result, state
