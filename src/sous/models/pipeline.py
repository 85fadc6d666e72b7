"""Pipeline parallel stages of a decoder model (`--pipeline-parallel-size N`).

A model is split into N stages of consecutive decoder layers, in vLLM's partition
(`get_pp_indices`): equal shares, the remainder one extra layer each for the stages just
before the last (the last also runs the final norm and the LM head), or the list
`VLLM_PP_LAYER_PARTITION` gives. Every model family keeps a `pp_stage` (`PPStage`; the whole
model by default) and runs only its layers: the first stage embeds the tokens; the others
start from the `IntermediateTensors` (hidden states and residual) the stage before returned;
every stage but the last returns its `IntermediateTensors` instead of normed hidden states.

`prune_to_stage` makes a loaded model one stage: the other stages' layers (and the embedding
off the first stage, the LM head off the last) are replaced by `PPMissingLayer`, so their
weights are freed; the model's KV cache spec then covers its own layers only.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sous.config.errors import ConfigError

logger = logging.getLogger(__name__)

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


class StagePosition:
    """Where stage `rank` of `size` sits in the pipeline."""

    rank: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


@dataclass(frozen=True)
class PPStage(StagePosition):
    """Stage `rank` of `size`: decoder layers `start_layer` to `end_layer` (exclusive)."""

    rank: int
    size: int
    start_layer: int
    end_layer: int

    @classmethod
    def whole(cls, num_layers: int) -> PPStage:
        return cls(0, 1, 0, num_layers)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def layers(self, all_layers: nn.ModuleList) -> nn.ModuleList:
        """This stage's share of the model's layer list."""
        return all_layers[self.start_layer:self.end_layer]  # type: ignore[return-value]


@dataclass
class IntermediateTensors:
    """What one stage hands the next: `[T, H]` hidden states and the residual stream (None
    only before the first layer)."""

    hidden_states: torch.Tensor
    residual: torch.Tensor | None


def embed_or_resume(embed: nn.Module, input_ids: torch.Tensor,
                    intermediate: IntermediateTensors | None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stage's starting `(h, residual)`: the token embeddings on the first stage, what the
    stage before handed over on the others."""
    if intermediate is None:
        return F.embedding(input_ids, embed.weight), None
    return intermediate.hidden_states, intermediate.residual


class PPMissingLayer(nn.Identity):
    """A layer (or embedding, or head) another pipeline stage holds."""


def get_pp_indices(num_layers: int, rank: int, size: int,
                   partition: str | None = None) -> tuple[int, int]:
    """`(start, end)` of stage `rank`'s layers, as vLLM splits them; `partition` (default:
    VLLM_PP_LAYER_PARTITION) is a comma-separated layer count per stage. ConfigError naming
    the flag or variable when the split is impossible."""
    if size > num_layers:
        raise ConfigError(f"--pipeline-parallel-size {size} is larger than the model's "
                          f"{num_layers} decoder layers: every stage needs at least one")
    spec = os.environ.get(PARTITION_ENV) if partition is None else partition
    if spec:
        try:
            parts = [int(p) for p in spec.split(",")]
        except ValueError:
            raise ConfigError(f"{PARTITION_ENV}={spec!r}: expected comma-separated layer "
                              "counts, one per stage") from None
        if len(parts) != size or sum(parts) != num_layers or min(parts) < 1:
            raise ConfigError(f"{PARTITION_ENV}={spec!r}: needs {size} positive counts (one per "
                              f"--pipeline-parallel-size stage) adding up to the model's "
                              f"{num_layers} layers")
    else:
        parts = [num_layers // size] * size
        for i in range(2, num_layers % size + 2):
            parts[-i] += 1
    start = sum(parts[:rank])
    return start, start + parts[rank]


def prune_to_stage(model: Any, rank: int, size: int) -> PPStage:
    """Make `model` (a loaded model with `model.layers`, `model.embed_tokens`, `lm_head`)
    stage `rank` of `size`: sets `model.pp_stage` and frees what other stages hold."""
    layers = model.model.layers
    start, end = get_pp_indices(len(layers), rank, size)
    stage = PPStage(rank, size, start, end)
    for i in range(len(layers)):
        if not start <= i < end:
            layers[i] = PPMissingLayer()
    if not stage.is_first:
        model.model.embed_tokens = PPMissingLayer()
    if not stage.is_last:
        model.lm_head = PPMissingLayer()
    model.pp_stage = stage
    getattr(model, "_stacks", {}).clear()
    gc.collect()
    logger.info("Pipeline stage %d of %d: decoder layers %d-%d of %d%s%s", rank + 1, size,
                start, end - 1, len(layers), " + embedding" if stage.is_first else "",
                " + final norm and LM head" if stage.is_last else "")
    return stage
