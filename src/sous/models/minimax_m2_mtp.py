"""MiniMax-M2 multi-token-prediction (MTP) modules, loaded as real layers for speculative decoding.

Checkpoint layout (what was found, 2026-12; sources below). MiniMax-M2 / M2.5 / M2.7 configs say
`use_mtp: true, num_mtp_modules: 3, mtp_transformer_layers: 1`, but **no published checkpoint
carries MTP weights**: MiniMax-AI/MiniMax-M2.7 issue #16 ("0 of the ~1369 tensor keys" are MTP
weights), MiniMax-AI/MiniMax-M2 issue #47 and MiniMax-M2.5 issue #8 (unanswered requests), and
sgl-project/sglang PR #13981 ("weight_map only has layers 0-61"); Megatron Bridge: "MTP modules
are not currently mapped"; transformers' and the Hub's remote modeling code have no MTP class.
So the real names **cannot be confirmed**. The layout accepted here is the one vLLM assumes:

- upstream vLLM `vllm/model_executor/models/minimax_m2.py` `get_spec_layer_idx_from_weight_name`
  treats every weight under `model.layers.{num_hidden_layers + i}.` (`i < num_mtp_modules`) as
  MTP module `i` and skips it when loading the main model;
- RBLN-SW/vllm-rbln `vllm_rbln/models/minimax_m2_mtp.py` (`MiniMaxM2MTP`, model type
  `minimax_m2_mtp`) loads those names DeepSeek-MTP style: `enorm`, `hnorm`, `eh_proj` [H, 2H]
  (input columns `[enorm(embed) | hnorm(hidden)]`), `shared_head.norm`, `shared_head.head`,
  optional `embed_tokens`, and the block's weights under the same names as a main decoder layer
  (`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
  `post_attention_layernorm`, `block_sparse_moe.gate|e_score_correction_bias|experts.{e}.w1..3`).

Not accepted (raise as unexpected): the closed sglang PR #13795/#13981 `minimax_m2_nextn.py`
layout `model.mtp_layers.{i}.{e_norm,h_norm,linear_projection}` (+ block), whose projection
input is `[h_norm(hidden) | e_norm(embed)]` and which reuses `model.norm` as the final norm.

Computation of module `k` (vLLM's DeepSeek/MiniMax MTP): `e = embed(next_token)` zeroed where
`position == 0`; `x = eh_proj([enorm(e) | hnorm(h)])`; `out = block(x) + residual` (one
attention + MoE layer of the main model's kind, with its own KV cache); logits =
`head(shared_head.norm(out))` where `head` is the module's `shared_head.head` when the checkpoint
has it, else the main `lm_head`. `out` (before the norm) is the `h` of the next draft step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from sous.engine.attention import AttentionMetadata
from sous.models.layers.linear import make_linear
from sous.models.layers.norm import RMSNorm

if TYPE_CHECKING:
    from sous.models.minimax_m2 import MiniMaxM2DecoderLayer

MTP_NORMS = {
    "enorm.weight": "enorm",
    "hnorm.weight": "hnorm",
    "shared_head.norm.weight": "shared_head_norm",
}
MTP_REQUIRED = (*MTP_NORMS, "eh_proj.weight")
"""Per-module names (after `model.layers.{N + k}.`) besides the block's that must be present."""
MTP_OPTIONAL = ("shared_head.head.weight", "embed_tokens.weight")
"""Per-module copies of the lm_head / embedding; the main model's are used when absent."""


class _Unloaded(nn.Module):
    """Placeholder for a linear whose weights have not been loaded yet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard only
        raise RuntimeError("MTP weights were not loaded")


class MiniMaxM2MTPLayer(nn.Module):
    """One MTP module: `enorm`, `hnorm`, `eh_proj`, one decoder `block` (built by the caller as a
    `MiniMaxM2DecoderLayer`), `shared_head_norm`, and optional own `shared_head` / `embed_tokens`
    (None when the checkpoint omits them; the main model's are used then)."""

    def __init__(
        self, hidden_size: int, eps: float, block: MiniMaxM2DecoderLayer, dtype: torch.dtype
    ):
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps, dtype)
        self.hnorm = RMSNorm(hidden_size, eps, dtype)
        self.eh_proj: nn.Module = _Unloaded()
        self.block = block
        self.shared_head_norm = RMSNorm(hidden_size, eps, dtype)
        self.shared_head: nn.Module | None = None
        self.embed_tokens: torch.Tensor | None = None

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`embeds` `[T, H]` of the next tokens, `hidden_states` `[T, H]` of the previous step
        -> block output `[T, H]` before `shared_head_norm`. Writes K/V of the T tokens into
        `kv_cache` (this module's own cache) at `meta`'s slots."""
        e = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = torch.cat((self.enorm.forward(e), self.hnorm.forward(hidden_states)), dim=-1)
        x = self.eh_proj.forward(x)
        out, residual = self.block.forward(x, None, cos_sin, kv_cache, meta)
        return out + residual

    def load_own(self, rest: str, w: torch.Tensor, dtype: torch.dtype, dev: torch.device) -> None:
        """Load one of `MTP_REQUIRED` / `MTP_OPTIONAL` (`rest` is the name inside the module)."""
        hidden = self.enorm.weight.shape[0]
        if rest in MTP_NORMS:
            norm = getattr(self, MTP_NORMS[rest])
            if tuple(w.shape) != (hidden,):
                raise ValueError(f"MTP {rest}: shape {tuple(w.shape)} != ({hidden},)")
            norm.weight.data.copy_(w.to(norm.weight.dtype))
        elif rest == "eh_proj.weight":
            if tuple(w.shape) != (hidden, 2 * hidden):
                raise ValueError(f"MTP eh_proj: shape {tuple(w.shape)} != {(hidden, 2 * hidden)}")
            self.eh_proj = make_linear([w], None, dtype, dev)
        elif rest == "shared_head.head.weight":
            self.shared_head = make_linear([w], None, dtype, dev)
        elif rest == "embed_tokens.weight":
            self.embed_tokens = w.to(device=dev, dtype=dtype).contiguous()
        else:
            raise ValueError(f"not an MTP module weight: {rest!r}")


class MiniMaxM2MTP(nn.Module):
    """The model's MTP modules: `num_modules` from the config (`num_mtp_modules`), `layers` the
    modules the checkpoint actually has (modules 0..len-1; empty for the public checkpoints).
    Owned and filled by `MiniMaxM2ForCausalLM.load_weights`; read-only afterwards."""

    def __init__(self, num_modules: int):
        super().__init__()
        self.num_modules = num_modules
        self.layers = nn.ModuleList()

    @property
    def num_loaded(self) -> int:
        return len(self.layers)

    def __getitem__(self, k: int) -> MiniMaxM2MTPLayer:
        if not 0 <= k < len(self.layers):
            raise IndexError(
                f"MTP module {k} is not loaded ({len(self.layers)} of {self.num_modules} "
                "modules have weights in the checkpoint)"
            )
        layer = self.layers[k]
        assert isinstance(layer, MiniMaxM2MTPLayer)
        return layer
