"""The two attention implementations (`SOUS_ATTENTION=cpp|torch`) give the same logits through
whole models: mixed batches of fresh prefills, chunked-prefill continuations and decodes, for
GQA (Llama, MiniMax-M2) and MLA with the V3.2 indexer's top-k selection, with model-dtype and
fp8 caches (scaled)."""

from __future__ import annotations

import pytest
import torch

from paged_runner import MIXED_PLANS, PagedRunner, load_ours
from sous.engine.attention import ATTENTION_ENV
from sous.engine.kv_cache.cache_dtype import apply_kv_scales
from sous.engine.ops.build import load
from tiny_models import make_tiny_deepseek, make_tiny_llama, make_tiny_minimax_m2

pytestmark = pytest.mark.usefixtures("one_thread")


MAKERS = {
    "llama": make_tiny_llama,
    "minimax_m2": make_tiny_minimax_m2,
    "deepseek_v32": lambda p: make_tiny_deepseek(p, "DeepseekV32ForCausalLM"),
}


def _run(model: torch.nn.Module, backend: str, kv_cache_dtype: str,
         monkeypatch) -> list[torch.Tensor]:
    """Logits of every step of `MIXED_PLANS` (then a few decodes) with one implementation."""
    monkeypatch.setenv(ATTENTION_ENV, backend)
    g = torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(4, 1000, (60,), generator=g).tolist() for s in range(4)}
    runner = PagedRunner(model, block_size=4, kv_cache_dtype=kv_cache_dtype)
    done = dict.fromkeys(seqs, 0)
    outs = []
    for plan in [*MIXED_PLANS, {0: 1, 1: 1, 2: 1, 3: 1}, {2: 1, 0: 1}]:
        out = runner.step({s: seqs[s][done[s] : done[s] + n] for s, n in plan.items()})
        for s, n in plan.items():
            done[s] += n
        outs += [out[s] for s in plan]
    return outs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_cpp_and_torch_paths_agree(arch, kv_cache_dtype, tmp_path, monkeypatch):
    if load() is None:
        pytest.fail("the sous_ops extension does not build on this machine")
    model = load_ours(MAKERS[arch](tmp_path))
    if kv_cache_dtype == "fp8":
        layers = model.config.num_hidden_layers
        apply_kv_scales(model, {f"model.layers.{i}.self_attn.{kv}_scale": s
                                for i in range(layers) for kv, s in (("k", 0.3), ("v", 0.7))})
    want = _run(model, "torch", kv_cache_dtype, monkeypatch)
    got = _run(model, "cpp", kv_cache_dtype, monkeypatch)
    # fp8: a float32 rounding difference in one layer can move a later layer's K/V across an
    # e4m3 rounding boundary (steps of 1/16 relative), so the bound is looser than float32's.
    atol = 1e-4 if kv_cache_dtype == "auto" else 2e-3
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
