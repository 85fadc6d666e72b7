"""DeepSeek-V3, DeepSeek-V3.2 and A.X-K2 on the latent paged KV cache.

Shared skeleton (transformers 5.24's `DeepseekV3ForCausalLM` numerics): embeddings, decoder
layers of MLA attention (`layers/mla.py`) + a dense SwiGLU MLP or a MoE block (sigmoid routing
with correction bias, optional grouped top-k, routed experts from `layers/moe.py` plus dense
shared experts), final RMSNorm, LM head.

* `DeepseekV32ForCausalLM` adds the sparse-attention indexer (`layers/indexer.py`) to every
  layer; its keys share the layer's cache row.
* `AXK2ForCausalLM` adds the attention output gate (fused into `q_b_proj`, see `MLAAttention`)
  and the low-rank gated RMSNorm on `input_layernorm` (every layer) and
  `post_attention_layernorm` (MoE layers).

Checkpoint layers past `num_hidden_layers` are multi-token-prediction modules; they are loaded
into `model.mtp` when present (not run by `forward`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sous.engine.attention import AttentionMetadata
from sous.models.layers.activation import silu_and_mul
from sous.models.layers.embedding import unloaded_embedding
from sous.models.layers.indexer import Indexer
from sous.models.layers.linear import AnyWeight
from sous.models.layers.mla import MLAAttention, MLAKVCacheSpec, RopeTables, _Unloaded
from sous.models.layers.moe import FusedMoE, MoEConfig
from sous.models.layers.norm import RMSNorm
from sous.models.layers.rotary import RotaryEmbedding
from sous.models.pipeline import IntermediateTensors, PPStage, embed_or_resume


@dataclass(frozen=True)
class _Arch:
    """What distinguishes the three architectures."""

    indexer: bool = False
    """V3.2 sparse-attention indexer in every layer."""
    output_gate: bool = False
    """A.X-K2 attention output gate fused into `q_b_proj`."""
    gated_norm: bool = False
    """A.X-K2 low-rank gated RMSNorm."""
    zero_fill_groups: bool = False
    """A.X-K2 grouped routing masks dropped groups' experts with 0.0 instead of -inf."""
    always_interleave: bool = False
    """RoPE pairs interleaved regardless of the config's `rope_interleave`."""

    def interleaved(self, cfg: Any) -> bool:
        return self.always_interleave or bool(getattr(cfg, "rope_interleave", True))


class DenseMLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` with gate/up fused (`gate_up_proj`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = _Unloaded()
        self.down_proj: nn.Module = _Unloaded()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class DeepseekMoE(nn.Module):
    """Routed experts (`FusedMoE`, routed scaling included) plus the dense shared experts."""

    def __init__(self, cfg: Any, dtype: torch.dtype, zero_fill_groups: bool = False):
        super().__init__()
        n_group = getattr(cfg, "n_group", None)
        mcfg = MoEConfig(
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            scoring_func="sigmoid",
            has_correction_bias=True,
            n_group=n_group,
            topk_group=getattr(cfg, "topk_group", None) if n_group else None,
            # A.X-K2's reference scores experts of dropped groups 0.0, not -inf.
            dropped_group_score=0.0 if zero_fill_groups else float("-inf"),
            renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0)),
        )
        self.experts = FusedMoE(mcfg, dtype, torch.get_default_device())
        self.shared_experts = DenseMLP() if getattr(cfg, "n_shared_experts", 0) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward(x)
        return out


class GatedRMSNorm(nn.Module):
    """A.X-K2's `y = RMSNorm(x); y * sigmoid(W_up(silu(W_down(y))))` (gate in float32)."""

    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.w_down: nn.Module = _Unloaded()
        self.w_up: nn.Module = _Unloaded()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Same contract as `RMSNorm.forward` (with `residual`: `(out, x + residual)`)."""
        if residual is not None:
            y, residual = self.norm.forward(x, residual)
        else:
            y = self.norm.forward(x)
        g = self.w_up.forward(F.silu(self.w_down.forward(y)))
        out = (y * torch.sigmoid(g.float())).to(y.dtype)
        return out if residual is None else (out, residual)


def mlp_layer_types(cfg: Any) -> list[str]:
    """"dense" / "sparse" per layer: the config's `mlp_layer_types`, else from
    `first_k_dense_replace` (and `moe_layer_freq`)."""
    types = getattr(cfg, "mlp_layer_types", None)
    if types:
        return list(types)
    first = getattr(cfg, "first_k_dense_replace", None)
    first = 0 if first is None else int(first)
    freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
    return [
        "sparse" if i >= first and i % freq == 0 else "dense" for i in range(cfg.num_hidden_layers)
    ]


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, arch: _Arch, sparse: bool):
        super().__init__()
        indexer = None
        if arch.indexer:
            indexer = Indexer(cfg, dtype, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.self_attn = MLAAttention(cfg, dtype, output_gate=arch.output_gate,
                                      interleaved=arch.interleaved(cfg), indexer=indexer)
        eps = cfg.rms_norm_eps
        norm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.input_layernorm = GatedRMSNorm(cfg, dtype) if arch.gated_norm else norm
        post_gated = arch.gated_norm and sparse
        self.post_attention_layernorm = (
            GatedRMSNorm(cfg, dtype) if post_gated else RMSNorm(cfg.hidden_size, eps, dtype)
        )
        self.mlp: nn.Module = (
            DeepseekMoE(cfg, dtype, zero_fill_groups=arch.zero_fill_groups) if sparse else DenseMLP()
        )

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rt: RopeTables,
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            x = self.input_layernorm.forward(h)
        else:
            x, residual = self.input_layernorm.forward(h, residual)
        x = self.self_attn.forward(x, rt, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class DeepseekMTPLayer(nn.Module):
    """One multi-token-prediction module of a DeepSeek checkpoint (`model.layers.{N + k}`):
    `h' = block(eh_proj([enorm(embed(next_token)) | hnorm(h)]))`, logits =
    `shared_head.head(shared_head.norm(h'))`. Loaded for speculative decoding; its optional
    `embed_tokens` / `shared_head.head` copies stay None when the checkpoint omits them."""

    def __init__(self, cfg: Any, dtype: torch.dtype, arch: _Arch, sparse: bool):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj: nn.Module = _Unloaded()
        self.block = DeepseekDecoderLayer(cfg, dtype, arch, sparse)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.shared_head: nn.Module | None = None
        self.embed_tokens: torch.Tensor | None = None


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 decoder on the latent paged KV cache.

    `forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, H]` (after
    the final norm; a pipeline stage as `LlamaForCausalLM`'s); `compute_logits(hidden [N, H]) -> float32 [N, vocab]`;
    `kv_cache_spec() -> MLAKVCacheSpec`; `load_weights` takes Hugging Face names."""

    ARCH = _Arch()

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.dtype = dtype
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if (self.ARCH.output_gate or self.ARCH.indexer) and not cfg.q_lora_rank:
            raise ValueError(f"{type(self).__name__} needs a q_lora_rank (got none)")
        self.layer_types = mlp_layer_types(cfg)
        self.model = nn.Module()
        self.model.embed_tokens = unloaded_embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.model.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, dtype, self.ARCH, t == "sparse") for t in self.layer_types
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        self.lm_head: nn.Module = _Unloaded()
        self.mtp = nn.ModuleList()
        self.pp_stage = PPStage.whole(cfg.num_hidden_layers)

    def new_mtp_layer(self) -> DeepseekMTPLayer:
        """Append an (unloaded) MTP module; its block is MoE when the model has MoE layers."""
        sparse = "sparse" in self.layer_types
        layer = DeepseekMTPLayer(self.config, self.dtype, self.ARCH, sparse)
        self.mtp.append(layer)
        return layer

    def kv_cache_spec(self) -> MLAKVCacheSpec:
        cfg = self.config
        return MLAKVCacheSpec(
            num_layers=self.pp_stage.num_layers,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            index_head_dim=cfg.index_head_dim if self.ARCH.indexer else 0,
            dtype=self.dtype,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None) -> Any:
        m = self.model
        h, residual = embed_or_resume(m.embed_tokens, input_ids, intermediate)
        cos, sin = self.rotary.lookup(positions, h.dtype)
        rt = RopeTables(self.rotary.lookup_complex(positions), cos, sin)
        for layer, kv_cache in zip(self.pp_stage.layers(m.layers), kv_caches, strict=True):
            h, residual = layer.forward(h, residual, rt, kv_cache, attn_metadata)
        if not self.pp_stage.is_last:
            return IntermediateTensors(h, residual)
        h, _ = m.norm.forward(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> None:
        """Load Hugging Face-named weights (per-expert or fused expert tensors; A.X-K2's
        `W_down`/`W_up` or `mlp.fc1`/`mlp.fc2`; `q_b_proj` or `q_gate_proj`); MTP layers go to
        `self.mtp`. Raises ValueError on unknown, misshapen or missing weights."""
        from sous.models.deepseek_weights import DeepseekWeightLoader

        DeepseekWeightLoader(self).load(weights)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3 + the sparse-attention indexer in every layer."""

    ARCH = _Arch(indexer=True, always_interleave=True)


class AXK2ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K2: DeepSeek-V3.2 + attention output gate + low-rank gated RMSNorm."""

    ARCH = _Arch(indexer=True, output_gate=True, gated_norm=True, zero_fill_groups=True,
                 always_interleave=True)
