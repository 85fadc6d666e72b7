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

from sous.engine.kv_cache.cache_dtype import with_cache_dtype
from sous.recipes.archs import ARCHS
from sous.recipes.fit import kv_bytes_per_token
from tiny_models import axk2_full_scale_config


def minimax_m2_7_spec():
    from transformers import MiniMaxM2Config

    from sous.models.minimax_m2 import MiniMaxM2ForCausalLM

    cfg = MiniMaxM2Config(rotary_dim=64, use_qk_norm=True, num_hidden_layers=62,
                          num_key_value_heads=8, head_dim=128, hidden_size=3072)
    with torch.device("meta"):
        return MiniMaxM2ForCausalLM(cfg, torch.bfloat16).kv_cache_spec()


def axk2_spec():
    from sous.models.deepseek import AXK2ForCausalLM

    cfg = axk2_full_scale_config()
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
