"""`mtp`: drafts with the target checkpoint's own multi-token-prediction module (a
`DraftModel` for `EagleProposer`).

Step 0 feeds the module the target's final hidden states (after its last norm) and the next
tokens; every further draft step feeds it its own output, one position on. All steps run MTP
module 0, as vLLM v1 does (it warns that k > 1 re-runs the same layer and accepts less); the
module's one KV cache layer is the drafter's. Models qualify when they run their MTP modules
(`forward_mtp` / `compute_mtp_logits`, MiniMax-M2) and the checkpoint holds module 0's weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sous.config.errors import ConfigError
from sous.engine.attention import AttentionMetadata
from sous.engine.spec_decode.config import FLAG
from sous.engine.spec_decode.eagle_proposer import greedy_draft
from sous.engine.spec_decode.proposer import TargetStep


class MTPDrafter:
    """The target model's MTP module 0 (see the module docstring); shares the target's
    weights, owns nothing."""

    def __init__(self, model: Any) -> None:
        if not hasattr(model, "forward_mtp"):
            raise ConfigError(f"{FLAG}: method 'mtp' needs a model whose MTP modules sous runs "
                              f"(MiniMax-M2); {type(model).__name__} has none")
        if model.mtp.num_loaded == 0:
            raise ConfigError(f"{FLAG}: method 'mtp': the checkpoint holds no MTP module "
                              f"weights (config num_mtp_modules={model.mtp.num_modules})")
        self.model = model

    @property
    def n_predict(self) -> int:
        """MTP modules the checkpoint holds (vLLM's `n_predict`)."""
        return int(self.model.mtp.num_loaded)

    def kv_cache_spec(self) -> Any:
        """One layer shaped like the target's."""
        return dataclasses.replace(self.model.kv_cache_spec(), num_layers=1)

    def first_hidden(self, target: TargetStep, index: torch.Tensor) -> torch.Tensor:
        assert target.hidden_states is not None
        return target.hidden_states[index]

    def forward_step(self, j: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.forward_mtp(0, input_ids, positions, hidden, kv_caches[0], meta)
        return out, out

    def draft_tokens(self, j: int, out: torch.Tensor, with_probs: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return greedy_draft(self.model.compute_mtp_logits(0, out), with_probs)
