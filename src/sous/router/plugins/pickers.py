"""Pickers: `max-score-picker` (shuffle, then a stable sort by score, best first: ties fall at
random) and `random-picker` (ignores scores). Both keep `maxNumOfEndpoints` (default 1)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from sous.router.framework import Endpoint
from sous.router.plugins.registry import register

MAX_SCORE = "max-score-picker"
RANDOM = "random-picker"


@dataclass(frozen=True)
class Parameters:
    max_num_of_endpoints: int = 1

    def __post_init__(self) -> None:
        if self.max_num_of_endpoints <= 0:
            raise ValueError("maxNumOfEndpoints must be > 0")


class MaxScorePicker:
    def __init__(self, name: str, params: Parameters, rng: random.Random | None = None) -> None:
        self.name = name
        self.keep = params.max_num_of_endpoints
        self.rng = rng or random.Random()

    def pick(self, scored: Sequence[tuple[Endpoint, float]]) -> list[Endpoint]:
        shuffled = list(scored)
        self.rng.shuffle(shuffled)
        shuffled.sort(key=lambda pair: pair[1], reverse=True)
        return [e for e, _ in shuffled[:self.keep]]


class RandomPicker:
    def __init__(self, name: str, params: Parameters, rng: random.Random | None = None) -> None:
        self.name = name
        self.keep = params.max_num_of_endpoints
        self.rng = rng or random.Random()

    def pick(self, scored: Sequence[tuple[Endpoint, float]]) -> list[Endpoint]:
        endpoints = [e for e, _ in scored]
        return self.rng.sample(endpoints, min(self.keep, len(endpoints)))


register(MAX_SCORE, Parameters, MaxScorePicker)
register(RANDOM, Parameters, RandomPicker)
