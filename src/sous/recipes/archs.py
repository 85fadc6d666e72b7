"""Public architecture numbers of the recipe models, for the memory fit check.

Numbers come from the models' public `config.json` files and model cards:
A.X-K2 (688B, `AXK2ForCausalLM`, DeepSeek-V3.2 family: MLA + sparse-attention indexer) and
MiniMax-M2.7 (230B, `MiniMaxM2ForCausalLM`: GQA + 256-expert MoE). Parameter counts are
computed from the config fields below (A.X-K2 comes to ~691B, MiniMax-M2.7 to ~229B), split
into the parts that shard differently: routed experts, other linear layers, and the parts
checkpoints keep in bf16 (embeddings, lm_head, norms, router gates, indexer weight proj).

Public API: `ModelArch`, `ParamCounts`, `ARCHS`, `find_arch`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHS", "ModelArch", "ParamCounts", "find_arch"]


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the whole model by how they shard and how checkpoints store them."""

    routed_experts: int   # sharded across TP x DP ranks (EP or MoE-TP), split by PP
    other_linear: int     # attention, dense MLPs, shared experts: sharded by TP, split by PP
    layer_bf16: int       # norms, router gates, indexer weights_proj: kept bf16, in layers
    embed: int            # token embedding (first PP stage), bf16
    lm_head: int          # output head (last PP stage), bf16

    @property
    def total(self) -> int:
        return self.routed_experts + self.other_linear + self.layer_bf16 + self.embed + self.lm_head


@dataclass(frozen=True)
class ModelArch:
    """What the fit check needs to know about a model."""

    name: str                     # Hugging Face id
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position: int | None      # None: not published
    num_kv_heads: int             # GQA kv heads; 1 for MLA (one latent row, not TP-sharded)
    head_dim: int                 # GQA: K and V width per head
    mla_latent_dim: int | None    # MLA: kv_lora_rank + qk_rope_head_dim (cached row), else None
    indexer_head_dim: int | None  # sparse-attention indexer key width (own cache), else None
    params: ParamCounts
    checkpoint_format: str        # the published checkpoint's weight format (FP8, BF16, NVFP4)

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim is not None


def _minimax_m2_7() -> ModelArch:
    layers, h, vocab = 62, 3072, 200064
    q_heads, kv_heads, hd = 48, 8, 128
    experts, inter = 256, 1536
    attn = h * q_heads * hd + 2 * h * kv_heads * hd + q_heads * hd * h  # q, k, v, o
    norms = q_heads * hd + kv_heads * hd + 2 * h  # full-width q/k norm, 2 layer norms
    router = h * experts + experts  # gate + e_score_correction_bias
    params = ParamCounts(
        routed_experts=layers * experts * 3 * h * inter,  # w1, w2, w3 per expert
        other_linear=layers * attn,
        layer_bf16=layers * (norms + router) + h,  # + final norm
        embed=vocab * h,
        lm_head=vocab * h,  # untied
    )
    return ModelArch(
        name="MiniMaxAI/MiniMax-M2.7", architecture="MiniMaxM2ForCausalLM",
        num_layers=layers, hidden_size=h, vocab_size=vocab, max_position=204800,
        num_kv_heads=kv_heads, head_dim=hd, mla_latent_dim=None, indexer_head_dim=None,
        params=params, checkpoint_format="FP8")


def _axk2() -> ModelArch:
    layers, h, vocab, dense_layers = 61, 7168, 163840, 1
    heads, q_lora, kv_lora, nope, rope, v = 64, 1536, 512, 128, 64, 128
    idx_heads, idx_dim = 64, 128
    experts, moe_inter, dense_inter, gate_rank = 256, 2048, 18432, 16
    moe_layers = layers - dense_layers
    attn = (h * q_lora                                  # q_a_proj
            + 2 * q_lora * heads * (nope + rope + v)    # q_b_proj (gate fused, 3072 in)
            + h * (kv_lora + rope)                      # kv_a_proj_with_mqa
            + kv_lora * heads * (nope + v)              # kv_b_proj
            + heads * v * h                             # o_proj
            + q_lora * idx_heads * idx_dim + h * idx_dim)  # indexer wq_b, wk
    gated_norm = 2 * h * gate_rank + h  # low-rank gate (down, up) + weight
    per_layer_bf16 = (q_lora + kv_lora + 2 * idx_dim  # q_a/kv_a norms, indexer k_norm
                      + h * idx_heads                 # indexer weights_proj
                      + 2 * gated_norm)
    params = ParamCounts(
        routed_experts=moe_layers * experts * 3 * h * moe_inter,
        other_linear=(layers * attn + dense_layers * 3 * h * dense_inter
                      + moe_layers * 3 * h * moe_inter),  # one shared expert per MoE layer
        layer_bf16=layers * per_layer_bf16 + moe_layers * (h * experts + experts) + h,
        embed=vocab * h,
        lm_head=vocab * h,
    )
    return ModelArch(
        name="skt/A.X-K2", architecture="AXK2ForCausalLM",
        num_layers=layers, hidden_size=h, vocab_size=vocab, max_position=None,
        num_kv_heads=1, head_dim=kv_lora + rope, mla_latent_dim=kv_lora + rope,
        indexer_head_dim=idx_dim, params=params, checkpoint_format="FP8")


ARCHS: dict[str, ModelArch] = {a.name: a for a in (_minimax_m2_7(), _axk2())}

_FORMAT_SUFFIXES = {"-NVFP4": "NVFP4", "-FP8": "FP8", "-BF16": "BF16"}


def find_arch(model: str) -> tuple[ModelArch, str | None] | None:
    """(architecture, weight format named by the checkpoint suffix or None) for a model id
    such as `skt/A.X-K2`, `A.X-K2`, `nvidia/MiniMax-M2.7-NVFP4` (case-insensitive); None
    when the model is not known."""
    base = model.rstrip("/").rsplit("/", 1)[-1]
    fmt = None
    for suffix, name in _FORMAT_SUFFIXES.items():
        if base.upper().endswith(suffix):
            base, fmt = base[: -len(suffix)], name
    for arch in ARCHS.values():
        if arch.name.rsplit("/", 1)[-1].lower() == base.lower():
            return arch, fmt
    return None
