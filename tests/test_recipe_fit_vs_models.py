"""`sous recipe check` and the engine agree on KV bytes per token.

The fit check (torch-free, from the public architecture numbers in `recipes/archs.py`) must give
the same bytes per token as the model classes the engine sizes its cache with, for the real
full-scale shapes (built on the meta device: no memory). The one known difference is A.X-K2
with an fp8 cache: the fit check counts vllm-rbln's 2-byte per-position indexer scale (the
recipes deploy vllm-rbln), sous keeps the fp8 indexer key unscaled.
"""

from __future__ import annotations

import pytest
import torch

from sous.engine.kv_cache.fp8 import with_cache_dtype
from sous.recipes.archs import ARCHS
from sous.recipes.fit import kv_bytes_per_token
from tiny_models import tiny_deepseek_config


def minimax_m2_7_spec():
    from transformers import MiniMaxM2Config

    from sous.models.minimax_m2 import MiniMaxM2ForCausalLM

    cfg = MiniMaxM2Config(rotary_dim=64, use_qk_norm=True, num_hidden_layers=62,
                          num_key_value_heads=8, head_dim=128, hidden_size=3072)
    with torch.device("meta"):
        return MiniMaxM2ForCausalLM(cfg, torch.bfloat16).kv_cache_spec()


def axk2_spec():
    from sous.models.deepseek import AXK2ForCausalLM

    cfg = tiny_deepseek_config(
        "AXK2ForCausalLM", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
        num_key_value_heads=64, n_routed_experts=256, num_experts_per_tok=8, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_topk=2048, index_n_heads=64, index_head_dim=128, gated_norm_rank=16,
        max_position_embeddings=262144)
    with torch.device("meta"):
        return AXK2ForCausalLM(cfg, torch.bfloat16).kv_cache_spec()


@pytest.mark.parametrize("name, build", [("MiniMaxAI/MiniMax-M2.7", minimax_m2_7_spec),
                                         ("skt/A.X-K2", axk2_spec)])
def test_fit_check_matches_model_kv_spec(name: str, build) -> None:
    arch = ARCHS[name]
    spec = build()
    assert kv_bytes_per_token(arch, "auto") == spec.bytes_per_token
    fp8 = with_cache_dtype(spec, "fp8").bytes_per_token
    if arch.is_mla:
        assert kv_bytes_per_token(arch, "fp8") == fp8 + 2 * arch.num_layers
    else:
        assert kv_bytes_per_token(arch, "fp8") == fp8 == 126_976
