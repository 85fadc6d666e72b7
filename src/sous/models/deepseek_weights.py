"""Hugging Face tensor names -> the modules of `DeepseekV3ForCausalLM` (and V3.2 / A.X-K2).

Dense parts are fused as their pieces arrive (q_a + kv_a, gate + up), experts go to `FusedMoE`
per expert or fused, A.X-K2's gated-norm names (`W_down`/`W_up` or `mlp.fc1`/`mlp.fc2`) and
`q_gate_proj` are accepted, and layers past `num_hidden_layers` are MTP modules. Every unknown,
misshapen or missing tensor raises ValueError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from sous.models.layers.linear import AnyWeight, make_linear
from sous.models.layers.mla import _Unloaded
from sous.models.layers.moe import FusedMoE
from sous.models.layers.norm import RMSNorm

if TYPE_CHECKING:
    from sous.models.deepseek import DeepseekV3ForCausalLM

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MOE_KINDS = {
    "mlp.gate.weight": "router",
    "mlp.gate.e_score_correction_bias": "correction_bias",
    "mlp.experts.gate_up_proj": "gate_up_proj",
    "mlp.experts.down_proj": "down_proj",
}
_LINEARS = {
    "self_attn.q_a_proj": ("self_attn.in_proj", 0, 2),
    "self_attn.q_proj": ("self_attn.in_proj", 0, 2),
    "self_attn.kv_a_proj_with_mqa": ("self_attn.in_proj", 1, 2),
    "self_attn.q_b_proj": ("self_attn.q_b_proj", 0, 1),
    "self_attn.q_gate_proj": ("self_attn.q_b_proj", 0, 1),
    "self_attn.o_proj": ("self_attn.o_proj", 0, 1),
    "self_attn.kv_b_proj": ("self_attn.kv_b_proj", 0, 1),
    "self_attn.indexer.wq_b": ("self_attn.indexer.wq_b", 0, 1),
    "self_attn.indexer.wk": ("self_attn.indexer.wk", 0, 1),
    "self_attn.indexer.weights_proj": ("self_attn.indexer.weights_proj", 0, 1),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
    "mlp.down_proj": ("mlp.down_proj", 0, 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0, 2),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1, 2),
    "mlp.shared_experts.down_proj": ("mlp.shared_experts.down_proj", 0, 1),
}
for _norm in ("input_layernorm", "post_attention_layernorm"):
    for _a, _b, _ours in (("W_down", "mlp.fc1", "w_down"), ("W_up", "mlp.fc2", "w_up")):
        _LINEARS[f"{_norm}.{_a}"] = _LINEARS[f"{_norm}.{_b}"] = (f"{_norm}.{_ours}", 0, 1)
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "shared_head.norm.weight": "shared_head_norm.weight"}


class DeepseekWeightLoader:
    """Routes Hugging Face tensors into a `DeepseekV3ForCausalLM` (see its `load_weights`).
    Linears fused from several checkpoint tensors are built once all their parts arrived."""

    def __init__(self, model: DeepseekV3ForCausalLM):
        self.m = model
        self.dev = model.model.norm.weight.device
        self.bias = bool(getattr(model.config, "attention_bias", False))
        self.pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self.loaded: set[str] = set()

    def load(self, weights: Iterable[tuple[str, AnyWeight]]) -> None:
        m, n_layers = self.m, self.m.config.num_hidden_layers
        embed = lm_head = None
        for name, w in weights:
            if not isinstance(w, torch.Tensor):
                raise ValueError(f"{name}: only dense tensors are supported for DeepSeek models")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "model.embed_tokens.weight":
                embed = w
            elif name == "lm_head.weight":
                lm_head = w
            elif name == "model.norm.weight":
                self._param("model.norm.weight", w, name)
            elif (lm := _LAYER_RE.match(name)) is None:
                raise ValueError(f"unexpected weight {name!r} for {type(m).__name__}")
            elif int(lm.group(1)) < n_layers:
                self._layer(f"model.layers.{lm.group(1)}", lm.group(2), w, name)
            else:
                self._mtp(int(lm.group(1)) - n_layers, lm.group(2), w, name)
        self._finish(embed, lm_head)

    def _mtp(self, k: int, rest: str, w: torch.Tensor, name: str) -> None:
        while len(self.m.mtp) <= k:
            self.m.new_mtp_layer()
        layer = self.m.mtp[k]
        if rest in _MTP_OWN:
            self._param(f"mtp.{k}.{_MTP_OWN[rest]}", w, name)
        elif rest == "eh_proj.weight":
            layer.eh_proj = make_linear([w], None, self.m.dtype, self.dev)
        elif rest == "shared_head.head.weight":
            layer.shared_head = make_linear([w], None, self.m.dtype, self.dev)
        elif rest == "embed_tokens.weight":
            layer.embed_tokens = w.to(device=self.dev, dtype=self.m.dtype)
        else:
            self._layer(f"mtp.{k}.block", rest, w, name)

    def _layer(self, prefix: str, rest: str, w: torch.Tensor, name: str) -> None:
        root = self.m.get_submodule(prefix)
        if rest in _MOE_KINDS or _EXPERT_RE.match(rest):
            moe = getattr(root.mlp, "experts", None)
            if not isinstance(moe, FusedMoE):
                raise ValueError(f"unexpected weight {name!r}: layer {prefix} has no MoE")
            em = _EXPERT_RE.match(rest)
            if em is not None:
                moe.load_weight(em.group(2), w, int(em.group(1)))
            else:
                moe.load_weight(_MOE_KINDS[rest], w)
            return
        base, _, kind = rest.rpartition(".")
        if base in _LINEARS and kind in ("weight", "bias"):
            self._linear(prefix, base, kind, w, name)
        else:
            self._param(f"{prefix}.{rest}", w, name)

    def _linear(self, prefix: str, base: str, kind: str, w: torch.Tensor, name: str) -> None:
        target, part, nparts = _LINEARS[base]
        parent, _, attr = f"{prefix}.{target}".rpartition(".")
        try:
            module = self.m.get_submodule(parent)
        except AttributeError:
            module = None
        q_lora = bool(self.m.config.q_lora_rank)
        wrong_q = base == "self_attn.q_proj" if q_lora else base in ("self_attn.q_a_proj",
                                                                      "self_attn.q_b_proj")
        if module is None or not hasattr(module, attr) or wrong_q:
            raise ValueError(f"unexpected weight {name!r} for {type(self.m).__name__}")
        slot = self.pending.setdefault((prefix, target), {})
        slot[f"{kind}{part}"] = w
        biased = [self.bias and self._biased(target, i) for i in range(nparts)]
        if any(f"weight{i}" not in slot or (b and f"bias{i}" not in slot)
               for i, b in enumerate(biased)):
            return
        del self.pending[(prefix, target)]
        ws = [slot[f"weight{i}"] for i in range(nparts)]
        bs = None
        if any(biased):
            bs = [slot.get(f"bias{i}", torch.zeros(ws[i].shape[0])) for i in range(nparts)]
        # transformers keeps the indexer's head weights in float32 (`_keep_in_fp32_modules`).
        fp32 = target == "self_attn.indexer.weights_proj"
        linear = make_linear(ws, bs, torch.float32 if fp32 else self.m.dtype, self.dev)
        if attr == "kv_b_proj":
            module.set_kv_b(linear, ws[0].to(device=self.dev, dtype=self.m.dtype))
        else:
            setattr(module, attr, linear)

    def _biased(self, target: str, part: int) -> bool:
        """Whether part `part` of `target` has a bias in attention_bias checkpoints (q_a_proj,
        kv_a_proj_with_mqa and o_proj do; q_proj, q_b_proj and kv_b_proj do not)."""
        if target == "self_attn.in_proj":
            return part == 1 or bool(self.m.config.q_lora_rank)
        return target == "self_attn.o_proj"

    def _param(self, path: str, w: torch.Tensor, name: str) -> None:
        try:
            p = self.m.get_parameter(path)
        except AttributeError as e:
            raise ValueError(f"unexpected weight {name!r} for {type(self.m).__name__}") from e
        if tuple(p.shape) != tuple(w.shape):
            raise ValueError(f"{name}: expected shape {tuple(p.shape)}, got {tuple(w.shape)}")
        with torch.no_grad():
            p.copy_(w.to(p.dtype))
        self.loaded.add(path)

    def _finish(self, embed: torch.Tensor | None, lm_head: torch.Tensor | None) -> None:
        m = self.m
        if embed is None:
            raise ValueError("missing weight model.embed_tokens.weight")
        if lm_head is None and not m.tie_word_embeddings:
            raise ValueError("missing weight lm_head.weight (and tie_word_embeddings is false)")
        m.model.embed_tokens.weight = nn.Parameter(
            embed.to(device=self.dev, dtype=m.dtype).contiguous(), requires_grad=False
        )
        head = embed if lm_head is None else lm_head
        m.lm_head = make_linear([head], None, m.dtype, self.dev)
        missing = [f"{p}.{t}" for p, t in self.pending]
        for path, mod in m.named_modules():
            if isinstance(mod, _Unloaded):
                missing.append(path)
            elif isinstance(mod, (RMSNorm, nn.LayerNorm)):
                missing += [f"{path}.{n}" for n, _ in mod.named_parameters()
                            if f"{path}.{n}" not in self.loaded]
            elif isinstance(mod, FusedMoE):
                try:
                    mod.check_loaded()
                except ValueError as e:
                    missing.append(f"{path} ({e})")
        if missing:
            shown = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"missing weights for {type(m).__name__}: {shown}")
