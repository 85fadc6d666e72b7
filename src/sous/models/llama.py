"""Llama family (Llama 2/3, SmolLM, Mistral without sliding window) on the paged KV cache.

Tokens of all sequences are flattened (`[T]`, no batch dimension); `AttentionMetadata` says
which sequence each belongs to. Q/K/V and gate/up are fused into one matmul each. Weights are
loaded from Hugging Face parameter names by `load_weights`; q/k projection rows are stored in
the interleaved rotary layout (llama.cpp's), so RoPE is one complex multiply and cached keys are
in that layout too (attention scores are unchanged).

Hot path: submodules are called through `.forward` directly, skipping `nn.Module.__call__`
(~1.4 us x ~300 calls per step on CPU); no hooks are used on these modules.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sous.engine.attention import AttentionMetadata, paged_attention
from sous.engine.kv_cache.spec import KVCacheSpec
from sous.models.layers.activation import silu_and_mul
from sous.models.layers.embedding import make_embedding, unloaded_embedding
from sous.models.layers.linear import AnyWeight, GroupQuantWeight, make_linear
from sous.models.layers.norm import RMSNorm
from sous.models.layers.rotary import (
    RopeStep,
    RotaryEmbedding,
    interleave_rows,
)
from sous.models.llama_stack import build_llama_stack, stack_runs
from sous.models.pipeline import IntermediateTensors, PPStage

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0, 1),
    "mlp.down_proj": ("mlp.down_proj", 0, 1),
}


def _interleave(w: AnyWeight, head_dim: int) -> AnyWeight:
    """q/k weight or bias rows -> interleaved rotary layout (K in the cache is stored so)."""
    perm = interleave_rows(w.shape[0], head_dim)
    return w.permute_rows(perm) if isinstance(w, GroupQuantWeight) else w[perm]


class _Unloaded(nn.Module):
    """Placeholder for a linear whose weights have not been loaded yet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard only
        raise RuntimeError("model weights were not loaded")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.k_scale = 1.0
        self.v_scale = 1.0
        """fp8 KV cache scales (set by the engine from the checkpoint, default 1.0)."""
        self.qkv_proj: nn.Module = _Unloaded()
        self.o_proj: nn.Module = _Unloaded()

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        qk_size = self.q_size + self.kv_size
        # q/k rows are stored in the interleaved rotary layout (see load_weights).
        qk = rope.rotate_interleaved(qkv[:, :qk_size].view(t, -1, self.head_dim))
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return self.o_proj.forward(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Llama MLP activation {act!r} is not supported yet (only silu)")
        self.gate_up_proj: nn.Module = _Unloaded()
        self.down_proj: nn.Module = _Unloaded()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, dtype: torch.dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(cfg, head_dim)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            x = self.input_layernorm.forward(h)
        else:
            x, residual = self.input_layernorm.forward(h, residual)
        x = self.self_attn.forward(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = unloaded_embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, head_dim, dtype) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """Llama decoder on the paged KV cache.

    `forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, H]` (after
    the final norm); `compute_logits(hidden [N, H]) -> float32 [N, vocab]`. A pipeline stage
    (`pp_stage`, `sous.models.pipeline`) runs its own layers over its own `kv_caches`.
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        self.num_kv_heads = (
            getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, self.head_dim, dtype)
        self.lm_head: nn.Module = _Unloaded()
        self.pp_stage = PPStage.whole(hf_config.num_hidden_layers)
        self._stacks: dict[tuple[int, ...], list[tuple[int, int, Any]] | None] = {}
        """`_layer_stacks`' cache, per set of aux layers."""

    def kv_cache_spec(self) -> KVCacheSpec:
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
        aux_hidden_state_layers: tuple[int, ...] = (),
        intermediate: IntermediateTensors | None = None,
    ) -> Any:
        """With `aux_hidden_state_layers`, also returns the residual stream entering each of
        those layers (`[T, H]` each, in layer order), as EAGLE-3 drafts read it. A stage
        after the first starts from `intermediate`; one before the last returns its
        `IntermediateTensors`."""
        m = self.model
        stage = self.pp_stage
        if intermediate is None:
            h, residual = m.embed_tokens.forward(input_ids), None
        else:
            h, residual = intermediate.hidden_states, intermediate.residual
        if h.dtype == self.dtype and stack_runs(attn_metadata, h):
            aux_layers = tuple(sorted(set(aux_hidden_state_layers)))
            stacks = self._layer_stacks(aux_layers)
            if stacks is not None:
                return self._forward_stacks(stacks, h, residual, positions, kv_caches,
                                            attn_metadata, aux_layers)
        rope = m.rotary.step(positions)
        aux: list[torch.Tensor] = []
        layers = stage.layers(m.layers)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True),
                                              stage.start_layer):
            if i in aux_hidden_state_layers:
                aux.append(h if residual is None else h + residual)
            h, residual = layer.forward(h, residual, rope, kv_cache, attn_metadata)
        if not stage.is_last:
            return IntermediateTensors(h, residual)
        h, _ = m.norm.forward(h, residual)
        return (h, aux) if aux_hidden_state_layers else h

    def _forward_stacks(self, stacks: list[tuple[int, int, Any]], h: torch.Tensor,
                        residual: torch.Tensor | None, positions: torch.Tensor,
                        kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                        aux_layers: tuple[int, ...]) -> Any:
        """`forward` through C++ stacks of consecutive layers, each taking the (h, residual)
        the previous one returned; the stream `h + residual` entering an aux layer is kept."""
        m = self.model
        first = self.pp_stage.start_layer
        aux: list[torch.Tensor] = []
        for start, end, stack in stacks:
            if start in aux_layers:
                aux.append(h if residual is None else h + residual)
            h, residual = stack.forward(
                h, kv_caches[start - first:end - first], m.rotary.cos, m.rotary.sin,
                positions, meta.slot_mapping, meta.q_starts, meta.query_lens, meta.seq_lens,
                meta.block_tables, meta.block_size, residual)
        if not self.pp_stage.is_last:
            return IntermediateTensors(h, residual)
        h = m.norm.forward(h, residual)[0]
        return (h, aux) if aux_layers else h

    def _layer_stacks(self, aux_layers: tuple[int, ...]) -> list[tuple[int, int, Any]] | None:
        """The layers as C++ calls (`sous.models.llama_stack`): one, or one per run between
        aux layers; `(start, end, stack)` each, built on first use. None when they do not
        qualify."""
        if aux_layers not in self._stacks:
            stage = self.pp_stage
            bounds = [b for b in aux_layers if stage.start_layer < b < stage.end_layer]
            edges = [stage.start_layer, *bounds, stage.end_layer]
            built = [(a, b, build_llama_stack(self, a, b))
                     for a, b in itertools.pairwise(edges) if b > a]
            ok = all(stack is not None for _, _, stack in built)
            self._stacks[aux_layers] = built if ok else None
        return self._stacks[aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> None:
        """Load Hugging Face-named weights (dense tensors, or `GroupQuantWeight` for the 4-bit
        path). q/k/v and gate/up are fused as their parts arrive; raises on unknown or missing
        names."""
        dev = self._device()
        dtype = self.dtype
        cfg = self.config
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        pending: dict[tuple[int, str], dict[str, Any]] = {}
        loaded: set[str] = set()
        embed: AnyWeight | None = None
        lm_head: AnyWeight | None = None
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "model.embed_tokens.weight":
                embed = w
                continue
            if name == "lm_head.weight":
                lm_head = w
                continue
            if name == "model.norm.weight":
                self._set_norm(self.model.norm, w)
                loaded.add(name)
                continue
            m = _LAYER_RE.match(name)
            if m is None:
                raise ValueError(f"unexpected weight {name!r} for LlamaForCausalLM")
            idx, rest = int(m.group(1)), m.group(2)
            layer = self.model.layers[idx]
            if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                self._set_norm(getattr(layer, rest.split(".")[0]), w)
                loaded.add(name)
                continue
            base, _, kind = rest.rpartition(".")
            if base not in _FUSED or kind not in ("weight", "bias"):
                raise ValueError(f"unexpected weight {name!r} for LlamaForCausalLM")
            target, part, nparts = _FUSED[base]
            if base in ("self_attn.q_proj", "self_attn.k_proj"):
                w = _interleave(w, self.head_dim)
            has_bias = attn_bias if base.startswith("self_attn") else mlp_bias
            slot = pending.setdefault((idx, target), {})
            slot[f"{kind}{part}"] = w
            need = nparts * (2 if has_bias else 1)
            if len(slot) == need:
                ws = [slot[f"weight{i}"] for i in range(nparts)]
                bs = [slot[f"bias{i}"] for i in range(nparts)] if has_bias else None
                mod_name, attr = target.split(".")
                setattr(getattr(layer, mod_name), attr, make_linear(ws, bs, dtype, dev))
                del pending[(idx, target)]
                loaded.add(f"model.layers.{idx}.{target}")
        if pending:
            missing = ", ".join(f"model.layers.{i}.{t}" for i, t in pending)
            raise ValueError(f"incomplete weights for: {missing}")
        if embed is None:
            raise ValueError("missing weight model.embed_tokens.weight")
        head = embed if self.tie_word_embeddings or lm_head is None else lm_head
        if lm_head is None and not self.tie_word_embeddings:
            raise ValueError("missing weight lm_head.weight (and tie_word_embeddings is false)")
        self.lm_head = make_linear([head], None, dtype, dev)
        self.model.embed_tokens = make_embedding(embed, self.lm_head if head is embed else None,
                                                 dtype, dev)
        expected = {"model.norm.weight"}
        for i in range(cfg.num_hidden_layers):
            expected |= {
                f"model.layers.{i}.{n}"
                for n in (
                    "input_layernorm.weight",
                    "post_attention_layernorm.weight",
                    "self_attn.qkv_proj",
                    "self_attn.o_proj",
                    "mlp.gate_up_proj",
                    "mlp.down_proj",
                )
            }
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(
                f"missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )

    def _device(self) -> torch.device:
        return self.model.norm.weight.device

    def _set_norm(self, norm: RMSNorm, w: AnyWeight) -> None:
        if isinstance(w, GroupQuantWeight):
            w = w.dequantize()
        norm.weight.data.copy_(w.to(norm.weight.dtype))
