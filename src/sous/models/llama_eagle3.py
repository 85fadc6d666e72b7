"""EAGLE-3 draft head (vLLM's `llama_eagle3` layout) on the paged KV cache.

Checkpoint layout (what `--speculative-config '{"method": "eagle3", "model": DIR}'` loads):
`config.json` with `architectures` `LlamaForCausalLMEagle3` or `Eagle3LlamaForCausalLM`,
Llama fields for the one decoder layer, `draft_vocab_size`, `target_hidden_size` (default
`hidden_size`), `norm_before_residual` (default false) and optionally
`eagle_config.eagle_aux_hidden_state_layer_ids`; weights (`*.safetensors` or
`pytorch_model.bin`):

- `fc.weight` `[H, 3 * H_target]`: the target's three aux hidden states -> H;
- `midlayer.*` (or `layers.0.*`): a Llama decoder layer whose q/k/v input is 2H,
  `cat(input_layernorm(embed(token)), hidden_norm(hidden))`, with `midlayer.hidden_norm`;
- `norm.weight`, `lm_head.weight` `[draft_vocab_size, H]`;
- `d2t` `[draft_vocab_size]` offsets (target id = draft id + d2t[draft id]); without it the
  draft vocabulary is the target's. `t2d` is ignored;
- `embed_tokens.weight` optional: shared from the target when absent.

A leading `model.` on any name is accepted. Problems with the folder are `ConfigError`s naming
the `--speculative-config` field (`model`, `draft_vocab_size`, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from sous.config.errors import ConfigError
from sous.engine.attention import AttentionMetadata
from sous.engine.kv_cache.spec import KVCacheSpec
from sous.engine.spec_decode.eagle_proposer import greedy_draft
from sous.models.layers.embedding import make_embedding
from sous.models.layers.int8_linear import quantize_linears
from sous.models.layers.linear import make_linear
from sous.models.layers.norm import RMSNorm
from sous.models.layers.qgemm_linear import qgemm_ops
from sous.models.layers.rotary import RotaryEmbedding
from sous.models.llama import LlamaAttention, LlamaMLP, _interleave

FLAG = "--speculative-config"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux hidden state layers: (2, L // 2, L - 3)."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over `cat(norm(embeds), norm(hidden))` (2H)."""

    def __init__(self, cfg: Any, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(cfg, head_dim)
        self.mlp = LlamaMLP(cfg)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Any,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual) as a Llama layer returns them."""
        e = self.input_layernorm.forward(embeds)
        h = self.hidden_norm.forward(hidden)
        residual = h if self.norm_before_residual else hidden
        x = self.self_attn.forward(torch.cat([e, h], dim=-1), rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """The draft head. `combine_hidden_states(aux)` -> `[T, H]`; `forward(ids, positions,
    hidden, kv_cache, meta)` -> (post-norm hidden for `draft_argmax`, pre-norm hidden fed to
    the next draft step). Its one KV cache layer is `kv_cache_spec()`; the caller owns it."""

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        with torch.device(device):
            self.layer = Eagle3Layer(cfg, self.head_dim, dtype)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.rotary = RotaryEmbedding(cfg, self.head_dim, cfg.max_position_embeddings)
        self.fc: nn.Module | None = None
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        self.d2t: torch.Tensor | None = None
        """Draft id -> target id (absolute ids, not the checkpoint's offsets); None: same."""
        self.int8 = False
        """Whether the linears are W8A8 `Int8Linear`s (`load_eagle3_draft`)."""

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=1, num_kv_heads=self.num_kv_heads,
                           head_size=self.head_dim, dtype=self.dtype)

    def combine_hidden_states(self, aux: list[torch.Tensor]) -> torch.Tensor:
        assert self.fc is not None
        return self.fc.forward(torch.cat(aux, dim=-1).to(self.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        embeds = self.embed_tokens.forward(input_ids).to(self.dtype)
        rope = self.rotary.step(positions)
        x, residual = self.layer.forward(embeds, hidden, rope, kv_cache, meta)
        return self.norm.forward(x, residual)

    def draft_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) from post-norm hidden states `[N, H]`."""
        return self.draft_tokens(0, hidden, False)[0]

    # `DraftModel` (sous.engine.spec_decode.eagle_proposer): every step is the same head.
    def first_hidden(self, target: Any, index: torch.Tensor) -> torch.Tensor:
        return self.combine_hidden_states([a[index] for a in target.aux_hidden_states])

    def forward_step(self, j: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward(input_ids, positions, hidden, kv_caches[0], meta)

    def draft_tokens(self, j: int, out: torch.Tensor, with_probs: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.lm_head is not None
        ids, probs = greedy_draft(self.lm_head.forward(out), with_probs)
        return (ids if self.d2t is None else self.d2t[ids]), probs

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: dict[str, torch.Tensor], target: nn.Module,
                     target_vocab_size: int) -> None:
        """Load checkpoint tensors (names normalised by `_normalise`); the embedding is
        shared from `target` when absent. ConfigError naming what is missing or wrong."""
        dev, dtype, cfg = self.norm.weight.device, self.dtype, self.config
        layer = self.layer
        norms = {"norm.weight": self.norm, "layers.0.input_layernorm.weight":
                 layer.input_layernorm, "layers.0.hidden_norm.weight": layer.hidden_norm,
                 "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm}
        for name, norm in norms.items():
            norm.weight.data.copy_(_need(weights, name).to(dtype))
        attn = "layers.0.self_attn."
        q, k = (_interleave(_need(weights, f"{attn}{p}_proj.weight"), self.head_dim)
                for p in "qk")
        layer.self_attn.qkv_proj = make_linear([q, k, _need(weights, f"{attn}v_proj.weight")],
                                               None, dtype, dev)
        layer.self_attn.o_proj = make_linear([_need(weights, f"{attn}o_proj.weight")], None,
                                             dtype, dev)
        mlp = "layers.0.mlp."
        layer.mlp.gate_up_proj = make_linear([_need(weights, f"{mlp}gate_proj.weight"),
                                              _need(weights, f"{mlp}up_proj.weight")],
                                             None, dtype, dev)
        layer.mlp.down_proj = make_linear([_need(weights, f"{mlp}down_proj.weight")], None,
                                          dtype, dev)
        self.fc = make_linear([_need(weights, "fc.weight")], None, dtype, dev)
        head = _need(weights, "lm_head.weight")
        self.lm_head = make_linear([head], None, dtype, dev)
        embed = weights.get("embed_tokens.weight")
        self.embed_tokens = (target.model.embed_tokens if embed is None
                             else make_embedding(embed, None, dtype, dev))
        self.d2t = _draft_to_target(weights.get("d2t"), head.shape[0], cfg, target_vocab_size,
                                    dev)


def _need(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        shown = name.replace("layers.0.", "midlayer.")  # the checkpoint's name for it
        raise ConfigError(f"{FLAG}: the EAGLE-3 draft has no weight {shown!r}")
    return weights[name]


def _draft_to_target(d2t: torch.Tensor | None, draft_vocab: int, cfg: Any,
                     target_vocab: int, device: torch.device) -> torch.Tensor | None:
    """Absolute target ids of the draft vocabulary; ConfigError when it does not map."""
    declared = getattr(cfg, "draft_vocab_size", None) or draft_vocab
    if declared != draft_vocab:
        raise ConfigError(f"{FLAG}: draft_vocab_size={declared} but the draft's lm_head has "
                          f"{draft_vocab} rows")
    if d2t is None:
        if draft_vocab != target_vocab:
            raise ConfigError(f"{FLAG}: draft_vocab_size={draft_vocab} does not map onto the "
                              f"target's vocabulary of {target_vocab} (no d2t table)")
        return None
    if tuple(d2t.shape) != (draft_vocab,):
        raise ConfigError(f"{FLAG}: d2t has shape {tuple(d2t.shape)}, expected "
                          f"({draft_vocab},) for draft_vocab_size={draft_vocab}")
    ids = torch.arange(draft_vocab, dtype=torch.int64) + d2t.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
        raise ConfigError(f"{FLAG}: draft_vocab_size={draft_vocab}: d2t maps draft ids outside "
                          f"the target's vocabulary of {target_vocab}")
    return ids.to(device)


def _normalise(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def read_draft_config(folder: Path) -> dict[str, Any]:
    """The draft's config.json; ConfigError when `folder` is not an EAGLE-3 draft."""
    path = folder / "config.json"
    if not folder.exists():
        raise ConfigError(f"{FLAG}: model {str(folder)!r} is not an EAGLE-3 draft checkpoint "
                          "here: no such folder (sous never downloads; `sous draft train --out "
                          "DIR` distils a head for the served model)")
    if not folder.is_dir() or not path.is_file():
        raise ConfigError(f"{FLAG}: model {str(folder)!r} is not an EAGLE-3 draft checkpoint "
                          "(no config.json in a folder)")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ConfigError(f"{FLAG}: model {str(folder)!r} is not an EAGLE-3 draft: its "
                          f"architectures are {archs}, expected one of {', '.join(ARCHITECTURES)}")
    return cfg


def read_draft_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if not bins:
            raise ConfigError(f"{FLAG}: model {str(folder)!r} holds no *.safetensors or "
                              "pytorch_model.bin weights")
        for f in bins:
            weights.update(torch.load(f, map_location="cpu", weights_only=True))
    return {_normalise(k): v for k, v in weights.items() if not k.endswith("t2d")}


def load_eagle3_draft(folder: str, target: nn.Module, target_config: Any,
                      device: torch.device, int8: bool = False,
                      ) -> tuple[Eagle3LlamaForCausalLM, tuple[int, ...]]:
    """(the draft head on `device` in the target's dtype, the target layers whose aux hidden
    states it reads). ConfigError naming the field when the folder does not fit the target.

    `int8` (asked for when the target itself runs quantised): the head's linears run as W8A8
    `Int8Linear`s where the CPU has the qgemm kernel (`draft.int8` says whether they do).
    Drafts are only proposals, so this changes which drafts are accepted, never the output;
    for a one-stream decode step a bfloat16 `torch.mm` of the head's `[1, H]` rows costs
    several times the int8 kernel."""
    path = Path(folder).expanduser()
    raw = read_draft_config(path)
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"{FLAG}: the EAGLE-3 draft has num_hidden_layers={layers}; sous "
                          "loads one-layer heads")
    target_hidden = target_config.hidden_size
    declared = raw.get("target_hidden_size") or raw.get("hidden_size")
    if declared != target_hidden:
        raise ConfigError(f"{FLAG}: the EAGLE-3 draft's target_hidden_size={declared} does not "
                          f"match the target's hidden_size={target_hidden}")
    eagle = raw.get("eagle_config") or {}
    num_layers = target_config.num_hidden_layers
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers)
    aux = tuple(sorted(set(ids)))  # the target hands them back in layer order
    if len(aux) != 3 or not all(0 <= i < num_layers for i in aux):
        raise ConfigError(f"{FLAG}: eagle_aux_hidden_state_layer_ids={list(ids)} must be 3 "
                          f"distinct layers of the target's {num_layers}")
    raw.setdefault("max_position_embeddings", target_config.max_position_embeddings)
    raw.setdefault("rms_norm_eps", 1e-6)
    cfg = SimpleNamespace(**raw)
    weights = read_draft_weights(path)
    fc = weights.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, 3 * target_hidden):
        raise ConfigError(f"{FLAG}: the draft's fc.weight has shape {tuple(fc.shape)}, "
                          f"expected ({cfg.hidden_size}, {3 * target_hidden})")
    if "embed_tokens.weight" not in weights and cfg.hidden_size != target_hidden:
        raise ConfigError(f"{FLAG}: the draft has no embed_tokens and its hidden_size="
                          f"{cfg.hidden_size} differs from the target's {target_hidden}")
    dtype = target.dtype
    draft = Eagle3LlamaForCausalLM(cfg, dtype, device)
    draft.load_weights(weights, target, target_config.vocab_size)
    if int8 and qgemm_ops(device) is not None:
        draft.int8 = quantize_linears(draft) > 0
    return draft, aux
