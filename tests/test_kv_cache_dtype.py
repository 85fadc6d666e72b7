"""`--kv-cache-dtype`: fp8 (e4m3 with per-layer scales, against the model-dtype cache), and
what `auto` resolves to.

The error is measured on tiny random checkpoints (chunked prefill then decode, so later tokens
read every earlier token back from the fp8 cache): per token, max |logit difference| / max
|logit|; the bound applies to the median over tokens. MoE models also show a few tokens with a
larger error, where fp8 rounding flips a top-k expert choice. Observed (median / max): Llama
2.0e-2 / 3.4e-2, MiniMax-M2 3.4e-2 / 2.7e-1; bound 1e-1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_runner import PagedRunner
from paged_runner import load_ours as _ours
from sous import LLM, SamplingParams
from sous.engine.kv_cache.cache_dtype import (
    apply_kv_scales,
    resolve_cache_dtype,
    with_cache_dtype,
)
from tiny_models import make_tiny_llama, make_tiny_minimax_m2

REL_BOUND = 1e-1
MAKERS = {
    "llama": lambda p: make_tiny_llama(p, num_hidden_layers=3),
    "minimax_m2": make_tiny_minimax_m2,
}


def chunked_logits(model: torch.nn.Module, ids: list[int], kv_cache_dtype: str) -> torch.Tensor:
    runner = PagedRunner(model, block_size=16, kv_cache_dtype=kv_cache_dtype)
    out, pos = [], 0
    for size in (7, 13, 20):
        out.append(runner.step({0: ids[pos:pos + size]})[0])
        pos += size
    while pos < len(ids):
        out.append(runner.step({0: [ids[pos]]})[0])
        pos += 1
    return torch.cat(out)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Median over tokens of max |a - b| / max |b| (rows are tokens)."""
    return float(((a - b).abs().max(dim=-1).values / b.abs().max()).median())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return MAKERS["llama"](tmp_path_factory.mktemp("m"))


def test_spec_bytes_shrink() -> None:
    from sous.engine.kv_cache.spec import KVCacheSpec

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    fp8 = with_cache_dtype(spec, "fp8")
    assert fp8.dtype == torch.float8_e4m3fn
    assert fp8.bytes_per_token * 2 == spec.bytes_per_token
    with pytest.raises(ValueError, match="fp4"):
        with_cache_dtype(spec, "fp4")
    f32 = dataclasses.replace(spec, dtype=torch.float32)
    assert with_cache_dtype(f32, "bfloat16").bytes_per_token * 2 == f32.bytes_per_token


@pytest.mark.parametrize("flag,dtype,quant,act,want", [
    ("auto", "auto", "gguf", torch.float32, "bfloat16"),  # the GGUF default without bf16 CPUs
    ("auto", "auto", "gguf", torch.bfloat16, "auto"),
    ("auto", "float32", "gguf", torch.float32, "auto"),  # an explicit --dtype stays exact
    ("auto", "auto", None, torch.float32, "auto"),  # float checkpoints: the model dtype
    ("auto", "auto", "int8", torch.float32, "auto"),
    ("fp8", "auto", "gguf", torch.float32, "fp8"),
])
def test_auto_cache_dtype(flag: str, dtype: str, quant: str | None, act: torch.dtype,
                          want: str) -> None:
    assert resolve_cache_dtype(flag, dtype, quant, act) == want


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_fp8_close_to_model_dtype(arch: str, tmp_path) -> None:
    model = _ours(MAKERS[arch](tmp_path))
    ids = torch.randint(0, 1000, (56,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = chunked_logits(model, ids, "auto")
    got = chunked_logits(model, ids, "fp8")
    err = relative_error(got, ref)
    assert 0 < err < REL_BOUND, err
    # Per-layer scales divide what is stored and multiply what is read: results stay close.
    layers = model.config.num_hidden_layers
    n = apply_kv_scales(model, {f"model.layers.{i}.self_attn.{kv}_scale": 0.25
                                for i in range(layers) for kv in ("k", "v")})
    assert n == 2 * layers
    scaled = chunked_logits(model, ids, "fp8")
    assert relative_error(scaled, ref) < REL_BOUND
    assert not torch.equal(scaled, got)


# The engine end to end (scheduler, chunked prefill, paged fp8 cache, sampler) against the
# model-dtype cache, same metric as above. README (Llama, the sequence above): median 2.0 %,
# worst token 3.4 %; observed here (CPU) 2.6 % / 2.8 %. Bounds: the median under 5 % (2.5x
# the README's median) and every token under 10 % (about 3x the README's worst token); a
# broken fp8 path (scales, dequantisation, a wrong slot) is off by 100 % or more.
ENGINE_MEDIAN_BOUND = 5e-2
ENGINE_TOKEN_BOUND = 1e-1


def engine_tokens_and_logits(path, kv_cache_dtype: str,
                             prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and, per engine step, the logits of the step's last position (one request:
    the sampled row), read with a forward hook on the served model."""
    llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, max_model_len=256,
              kv_cache_memory_bytes=8 << 20, block_size=16, max_num_batched_tokens=16)
    model = llm.engine.runner.model
    rows: list[torch.Tensor] = []
    handle = model.register_forward_hook(
        lambda _m, _a, hidden: rows.append(model.compute_logits(hidden[-1:])))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    handle.remove()
    if kv_cache_dtype != "auto":
        assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    return out.outputs[0].token_ids, torch.cat(rows)


def test_engine_with_fp8_cache_matches_model_dtype(tiny) -> None:
    prompt = torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_tokens, ref = engine_tokens_and_logits(tiny, "auto", prompt)
    tokens, got = engine_tokens_and_logits(tiny, "fp8", prompt)
    assert len(tokens) == len(ref_tokens) == 16 and got.shape == ref.shape
    # Rows: 2 prefill chunks that sample nothing, then one per output token. Contexts agree
    # up to the first differing token, whose row is the last one comparable.
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b),
                 len(tokens) - 1)
    n = ref.shape[0] - len(tokens) + first + 1
    scale = ref[:n].abs().max()
    err = (got[:n] - ref[:n]).abs().max(dim=-1).values / scale
    assert 0 < float(err.median()) < ENGINE_MEDIAN_BOUND, err
    assert float(err.max()) < ENGINE_TOKEN_BOUND, err
    if tokens != ref_tokens:  # only a near tie may flip: the lead is within the fp8 error
        row, want, have = ref[n - 1], ref_tokens[first], tokens[first]
        assert float(row[want] - row[have]) <= 2 * float(err[-1] * scale), (first, err)
