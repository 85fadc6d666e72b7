"""MiniMax-M2 / M2.5 / M2.7 (`MiniMaxM2ForCausalLM`) on the paged KV cache.

Per layer: GQA attention whose q and k each go through one RMSNorm over their full width (all
heads, `qk_norm_type: per_layer`) *before* the head split, then partial rotary (NeoX
rotate-half on the first `rotary_dim` dims of each head), then `paged_attention`; and a routed
MoE (sigmoid scores + `e_score_correction_bias`, renormalised top-k, no shared expert) through
`FusedMoE`, whose router matmul runs in the model dtype and whose correction bias is rounded to
the model dtype, as in transformers' `MiniMaxM2TopKRouter` / `MiniMaxM2SparseMoeBlock` (vLLM
keeps both in float32; identical for float32 models).

Checkpoint names (Hub and transformers' `save_pretrained`): `block_sparse_moe.gate`,
`block_sparse_moe.e_score_correction_bias`, `block_sparse_moe.experts.{e}.w1|w2|w3` (gate, down,
up); transformers' in-memory names (`mlp.gate`, `mlp.experts.gate_up_proj`, ...) are accepted
too. MTP modules (`model.layers.{num_hidden_layers + k}.*`, `k < num_mtp_modules`; layout and
sources in `minimax_m2_mtp`) are loaded when present as real layers into `model.mtp` and run by
`forward_mtp` / `compute_mtp_logits`, never by `forward`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sous.engine.attention import AttentionMetadata, paged_attention
from sous.engine.kv_cache.spec import KVCacheSpec
from sous.models.layers.embedding import unloaded_embedding
from sous.models.layers.linear import make_linear
from sous.models.layers.moe import FusedMoE, MoEConfig
from sous.models.layers.norm import RMSNorm
from sous.models.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from sous.models.minimax_m2_mtp import MTP_OPTIONAL, MTP_REQUIRED, MiniMaxM2MTP, MiniMaxM2MTPLayer
from sous.models.pipeline import IntermediateTensors, PPStage, embed_or_resume

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(
    r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_KIND = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MOE_SIMPLE = {
    "block_sparse_moe.gate.weight": ("router", None),
    "mlp.gate.weight": ("router", None),
    "block_sparse_moe.e_score_correction_bias": ("correction_bias", None),
    "mlp.e_score_correction_bias": ("correction_bias", None),
    "mlp.experts.gate_up_proj": ("gate_up_proj", None),
    "mlp.experts.down_proj": ("down_proj", None),
}
_QKV = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 1, "self_attn.v_proj.weight": 2}
_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def rotary_dim_of(cfg: Any, head_dim: int) -> int:
    """Rotated dims per head: `rotary_dim` when the config has it, else `head_dim *
    partial_rotary_factor` (transformers' MiniMaxM2Config derives the factor from rotary_dim)."""
    rd = getattr(cfg, "rotary_dim", None)
    if rd is None:
        factor = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
        rd = int(head_dim * float(factor))
    if rd <= 0 or rd > head_dim or rd % 2:
        raise ValueError(f"rotary_dim {rd} must be even and in 1..head_dim ({head_dim})")
    return int(rd)


def _check_supported(cfg: Any) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"MiniMax-M2 expert activation {act!r} is not supported yet (only silu)")
    if any(int(t) != 1 for t in getattr(cfg, "attn_type_list", None) or []):
        raise ValueError("MiniMax lightning-attention layers (attn_type 0) are not supported yet")
    if int(getattr(cfg, "shared_intermediate_size", 0) or 0) > 0:
        raise ValueError("MiniMax-M2 shared experts are not supported yet")
    norm_type = getattr(cfg, "qk_norm_type", "per_layer")
    if getattr(cfg, "use_qk_norm", True) and norm_type != "per_layer":
        raise ValueError(f"qk_norm_type {norm_type!r} is not supported yet (only per_layer)")


class MiniMaxM2Attention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, rotary_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.k_scale = 1.0
        self.v_scale = 1.0
        """fp8 KV cache scales (set by the engine from the checkpoint, default 1.0)."""
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", True))
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, dtype)
        self.qkv_proj: nn.Module = nn.Identity()
        self.o_proj: nn.Module = nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q = self._rotate(q.reshape(t, self.num_heads, self.head_dim), cos_sin)
        k = self._rotate(k.reshape(t, self.num_kv_heads, self.head_dim), cos_sin)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return self.o_proj.forward(o.reshape(t, self.q_size))

    def _rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate the first `rotary_dim` dims of each head of `x` `[T, H, D]` (new tensor)."""
        rd = self.rotary_dim
        rot = apply_rotary(x[..., :rd], *cos_sin)
        return rot if rd == self.head_dim else torch.cat((rot, x[..., rd:]), dim=-1)


class MiniMaxM2DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, rotary_dim: int, dtype: torch.dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = MiniMaxM2Attention(cfg, head_dim, rotary_dim, dtype)
        moe = MoEConfig(
            num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            scoring_func=getattr(cfg, "scoring_func", "sigmoid"),
            has_correction_bias=bool(getattr(cfg, "use_routing_bias", True)),
            renormalize=True,
        )
        device = torch.empty(0).device
        self.block_sparse_moe = FusedMoE(moe, dtype, device, router_dtype=dtype)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            x = self.input_layernorm.forward(h)
        else:
            x, residual = self.input_layernorm.forward(h, residual)
        x = self.self_attn.forward(x, cos_sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.block_sparse_moe.forward(x), residual


class MiniMaxM2Model(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, rotary_dim: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = unloaded_embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            MiniMaxM2DecoderLayer(cfg, head_dim, rotary_dim, dtype)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg, rotary_dim, cfg.max_position_embeddings)


class MiniMaxM2ForCausalLM(nn.Module):
    """MiniMax-M2 decoder on the paged KV cache (model interface of `LlamaForCausalLM`):
    `forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, H]` (after the
    final norm; a pipeline stage as `LlamaForCausalLM`'s); `compute_logits(hidden [N, H]) -> float32 [N, vocab]`; MTP drafting through
    `forward_mtp(k, ...)` / `compute_mtp_logits(k, ...)` over the modules in `self.mtp`."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        _check_supported(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        self.rotary_dim = rotary_dim_of(hf_config, self.head_dim)
        self.num_kv_heads = hf_config.num_key_value_heads
        self.model = MiniMaxM2Model(hf_config, self.head_dim, self.rotary_dim, dtype)
        self.lm_head: nn.Module = nn.Identity()
        num_mtp = int(getattr(hf_config, "num_mtp_modules", 0) or 0)
        self.mtp = MiniMaxM2MTP(num_mtp)
        self.pp_stage = PPStage.whole(hf_config.num_hidden_layers)

    def new_mtp_layer(self) -> MiniMaxM2MTPLayer:
        """Append an (unloaded) MTP module whose block is a decoder layer of the main kind."""
        cfg = self.config
        block = MiniMaxM2DecoderLayer(cfg, self.head_dim, self.rotary_dim, self.dtype)
        layer = MiniMaxM2MTPLayer(cfg.hidden_size, cfg.rms_norm_eps, block, self.dtype)
        self.mtp.layers.append(layer)
        return layer

    def kv_cache_spec(self) -> KVCacheSpec:
        """Full-width K and V per layer: `2 * layers * kv_heads * head_dim * elem` B/token."""
        return KVCacheSpec(
            num_layers=self.pp_stage.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> Any:
        m = self.model
        h, residual = embed_or_resume(m.embed_tokens, input_ids, intermediate)
        cos_sin = m.rotary.lookup(positions, self.dtype)
        for layer, kv_cache in zip(self.pp_stage.layers(m.layers), kv_caches, strict=True):
            h, residual = layer.forward(h, residual, cos_sin, kv_cache, attn_metadata)
        if not self.pp_stage.is_last:
            return IntermediateTensors(h, residual)
        h, _ = m.norm.forward(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()

    def forward_mtp(
        self,
        k: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run MTP module `k` (draft step `k` of a speculative decoder).

        `input_ids` [T]: for each token, the token that follows it (for step 0: the main model's
        next token); `positions` [T]: the positions of `hidden_states` [T, H], which are the
        main model's `forward` output (step 0) or the previous `forward_mtp` output (step k>0).
        `kv_cache` is module k's own one-layer cache (shape of one entry of the main model's
        `kv_caches`; the caller allocates it, `kv_cache_spec` does not count it) and is written
        at `attn_metadata`'s slots. Returns [T, H] before the module's final norm; logits via
        `compute_mtp_logits(k, ...)`. Raises IndexError when module `k` has no weights."""
        layer = self.mtp[k]
        table = self.model.embed_tokens.weight if layer.embed_tokens is None else layer.embed_tokens
        embeds = F.embedding(input_ids, table)
        cos_sin = self.model.rotary.lookup(positions, self.dtype)
        return layer.forward(embeds, positions, hidden_states, cos_sin, kv_cache, attn_metadata)

    def compute_mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [N, vocab] of MTP module `k` for `forward_mtp` output `hidden` [N, H]."""
        layer = self.mtp[k]
        head = self.lm_head if layer.shared_head is None else layer.shared_head
        return head.forward(layer.shared_head_norm.forward(hidden)).float()

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named weights (dense tensors). q/k/v are fused as they arrive; MTP
        modules are built as their weights arrive (a module the checkpoint lacks stays absent,
        one it has must be complete); raises ValueError on unknown or missing names."""
        cfg = self.config
        dev = self.model.norm.weight.device
        pending: dict[int, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        embed = lm_head = None
        for name, w in weights:
            if not isinstance(w, torch.Tensor):
                raise ValueError(f"{name}: only dense weights are supported for MiniMax-M2 yet")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "model.embed_tokens.weight":
                embed = w
            elif name == "lm_head.weight":
                lm_head = w
            elif name == "model.norm.weight":
                _copy_norm(self.model.norm, w)
                loaded.add(name)
            else:
                self._load_layer_weight(name, w, pending, loaded, dev)
        if pending:
            raise ValueError(f"incomplete q/k/v weights for layers {sorted(pending)}")
        if embed is None:
            raise ValueError("missing weight model.embed_tokens.weight")
        self.model.embed_tokens.weight = nn.Parameter(
            embed.to(device=dev, dtype=self.dtype).contiguous(), requires_grad=False
        )
        if lm_head is None and not getattr(cfg, "tie_word_embeddings", False):
            raise ValueError("missing weight lm_head.weight (and tie_word_embeddings is false)")
        self.lm_head = make_linear([embed if lm_head is None else lm_head], None, self.dtype, dev)
        self._check_complete(loaded)

    def _load_layer_weight(
        self,
        name: str,
        w: torch.Tensor,
        pending: dict[int, dict[int, torch.Tensor]],
        loaded: set[str],
        dev: torch.device,
    ) -> None:
        m = _LAYER_RE.match(name)
        if m is None:
            raise ValueError(f"unexpected weight {name!r} for MiniMaxM2ForCausalLM")
        idx, rest = int(m.group(1)), m.group(2)
        n_layers = self.config.num_hidden_layers
        if idx < n_layers:
            layer = self.model.layers[idx]
        else:
            k = idx - n_layers
            if k >= self.mtp.num_modules:
                raise ValueError(
                    f"unexpected weight {name!r}: layer {idx} is beyond num_hidden_layers "
                    f"({n_layers}) + num_mtp_modules ({self.mtp.num_modules})"
                )
            while len(self.mtp.layers) <= k:
                self.new_mtp_layer()
            if rest in MTP_REQUIRED or rest in MTP_OPTIONAL:
                self.mtp[k].load_own(rest, w, self.dtype, dev)
                loaded.add(f"{idx}.{rest}")
                return
            layer = self.mtp[k].block
        if not self._load_block_weight(layer, idx, rest, w, pending, dev):
            raise ValueError(f"unexpected weight {name!r} for MiniMaxM2ForCausalLM")
        loaded.add(f"{idx}.{'self_attn.qkv_proj' if rest in _QKV else rest}")

    def _load_block_weight(
        self,
        layer: MiniMaxM2DecoderLayer,
        idx: int,
        rest: str,
        w: torch.Tensor,
        pending: dict[int, dict[int, torch.Tensor]],
        dev: torch.device,
    ) -> bool:
        """Load `rest` (a name inside a decoder layer) into `layer` (main layer or MTP block
        `idx`); q/k/v wait in `pending[idx]` until all three arrived. False if unknown."""
        if rest in _NORMS:
            owner = layer.self_attn if rest.startswith("self_attn.") else layer
            _copy_norm(getattr(owner, rest.split(".")[-2]), w)
        elif rest in _QKV:
            slot = pending.setdefault(idx, {})
            slot[_QKV[rest]] = w
            if len(slot) == 3:
                parts = [slot[i] for i in range(3)]
                layer.self_attn.qkv_proj = make_linear(parts, None, self.dtype, dev)
                del pending[idx]
        elif rest == "self_attn.o_proj.weight":
            layer.self_attn.o_proj = make_linear([w], None, self.dtype, dev)
        elif rest in _MOE_SIMPLE:
            kind = _MOE_SIMPLE[rest][0]
            if kind == "correction_bias":  # transformers keeps the bias in the model dtype
                w = w.to(self.dtype)
            layer.block_sparse_moe.load_weight(kind, w)
        elif (e := _EXPERT_RE.match(rest)) is not None:
            kind = _EXPERT_KIND.get(e.group(2), e.group(2))
            layer.block_sparse_moe.load_weight(kind, w, int(e.group(1)))
        else:
            return False
        return True

    def _check_complete(self, loaded: set[str]) -> None:
        names = (*_NORMS, "self_attn.qkv_proj", "self_attn.o_proj.weight")
        if not getattr(self.config, "use_qk_norm", True):
            qk_norms = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
            names = tuple(n for n in names if n not in qk_norms)
        n_layers = self.config.num_hidden_layers
        mtp_idx = range(n_layers, n_layers + self.mtp.num_loaded)
        expected = {"model.norm.weight"} | {
            f"{i}.{n}" for i in range(n_layers + self.mtp.num_loaded) for n in names
        } | {f"{i}.{n}" for i in mtp_idx for n in MTP_REQUIRED}
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(
                n if n.startswith("model.") else f"model.layers.{n}" for n in missing[:8]
            )
            raise ValueError(f"missing weights: {shown}{' ...' if len(missing) > 8 else ''}")
        blocks = [*self.model.layers, *(layer.block for layer in self.mtp.layers)]
        for i, layer in enumerate(blocks):
            try:
                layer.block_sparse_moe.check_loaded()
            except ValueError as err:
                raise ValueError(f"model.layers.{i}.block_sparse_moe: {err}") from None


def _copy_norm(norm: RMSNorm, w: torch.Tensor) -> None:
    if tuple(w.shape) != tuple(norm.weight.shape):
        raise ValueError(f"norm weight shape {tuple(w.shape)} != {tuple(norm.weight.shape)}")
    norm.weight.data.copy_(w.to(norm.weight.dtype))
