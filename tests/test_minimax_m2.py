"""sous' MiniMax-M2 on the paged KV cache against transformers' MiniMaxM2ForCausalLM (float32).

The tiny checkpoint (tests/tiny_models.py): hidden 64, 3 layers, GQA 4 q / 2 kv heads x 16,
partial rotary 8 of 16, full-width QK norm, 8 experts top-2 with a random correction bias.
Tolerance: logits within atol 1e-4 (observed ~1e-6); greedy generation token-identical.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.models.loader import load_model
from sous.models.minimax_m2 import MiniMaxM2ForCausalLM
from test_llama import PagedRunner
from tiny_models import MINIMAX_MTP_NAMES, make_tiny_minimax_m2

CPU = torch.device("cpu")
ATOL = 1e-4


@cache  # models are read-only here: one load per checkpoint for the module
def _hf(path: Path):
    from transformers import MiniMaxM2ForCausalLM as HFMiniMaxM2

    return HFMiniMaxM2.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf(path)(torch.tensor([ids])).logits[0]


@cache
def _ours(path: Path) -> MiniMaxM2ForCausalLM:
    model = load_model(ModelConfig(model=str(path), dtype="float32"), LoadConfig(), CPU).model
    assert isinstance(model, MiniMaxM2ForCausalLM)
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_minimax_m2(tmp_path_factory.mktemp("mm"))


def test_full_prefill_matches_transformers(tiny: Path) -> None:
    ids = _ids(40, 1)
    ours = PagedRunner(_ours(tiny), block_size=16).step({0: ids})[0]
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_bfloat16_close_to_transformers_bfloat16(tiny: Path) -> None:
    """bf16 weights and activations, bf16 router and bias as in transformers: logits within
    a few bf16 ulps (atol 0.06 at |logit| < 4; observed 0.02), same argmax."""
    from transformers import MiniMaxM2ForCausalLM as HFMiniMaxM2

    ids = _ids(40, 1)
    hf = HFMiniMaxM2.from_pretrained(tiny, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    model = load_model(ModelConfig(model=str(tiny), dtype="bfloat16"), LoadConfig(), CPU).model
    ours = PagedRunner(model, block_size=16).step({0: ids})[0]
    torch.testing.assert_close(ours, ref, atol=0.06, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode(tiny: Path, block_size: int) -> None:
    ids = _ids(48, 2)
    ref = _hf_logits(tiny, ids)
    runner = PagedRunner(_ours(tiny), block_size=block_size)
    pos = 0
    for size in [5, 3, 9, 1, 14]:  # chunks straddle block boundaries for both block sizes
        got = runner.step({0: ids[pos : pos + size]})[0]
        torch.testing.assert_close(got, ref[pos : pos + size], atol=ATOL, rtol=0)
        pos += size
    while pos < len(ids):
        got = runner.step({0: [ids[pos]]})[0]
        torch.testing.assert_close(got, ref[pos : pos + 1], atol=ATOL, rtol=0)
        pos += 1


def test_mixed_batch_matches_transformers(tiny: Path) -> None:
    """Prefill chunks and decodes of several sequences in one step: routing is per token."""
    seqs = {s: _ids(n, 10 + s) for s, n in {0: 22, 1: 18, 2: 25}.items()}
    refs = {s: _hf_logits(tiny, ids) for s, ids in seqs.items()}
    runner = PagedRunner(_ours(tiny), block_size=4)
    done = dict.fromkeys(seqs, 0)
    for plan in [{0: 12, 1: 17}, {1: 1, 2: 9, 0: 1}, {2: 16, 0: 9}]:
        out = runner.step({s: seqs[s][done[s] : done[s] + n] for s, n in plan.items()})
        for s, n in plan.items():
            torch.testing.assert_close(out[s], refs[s][done[s] : done[s] + n], atol=ATOL, rtol=0)
            done[s] += n
    assert done == {0: 22, 1: 18, 2: 25}


def test_greedy_generation_matches_transformers_generate(tiny: Path) -> None:
    """32 greedy tokens through `LLM` with 16-token step budgets (chunked prefill), block 16."""
    from sous import LLM, SamplingParams

    prompts = [_ids(37, 20), _ids(9, 21), _ids(21, 22)]
    hf = _hf(tiny)
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False)
            expected.append(out[0, len(p):].tolist())
    llm = LLM(str(tiny), dtype="float32", max_model_len=256, block_size=16,
              max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(set(map(tuple, expected))) == 3


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _fresh(path: Path) -> MiniMaxM2ForCausalLM:
    from transformers import AutoConfig

    return MiniMaxM2ForCausalLM(AutoConfig.from_pretrained(path), torch.float32)


def test_unknown_and_missing_weights_raise(tiny: Path) -> None:
    weights = _weights(tiny)

    def load(extra: dict[str, torch.Tensor], drop: str = "") -> None:
        _fresh(tiny).load_weights([*((k, v) for k, v in weights.items() if k != drop),
                                   *extra.items()])

    load({})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.3.enorm.weight'"):
        load({"model.layers.3.enorm.weight": torch.ones(64)})  # no MTP modules in this config
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.bogus.weight'"):
        load({"model.layers.0.mlp.bogus.weight": torch.ones(1)})
    with pytest.raises(ValueError, match=r"layers.1.block_sparse_moe: .*up_proj of experts 5"):
        load({}, drop="model.layers.1.block_sparse_moe.experts.5.w3.weight")
    with pytest.raises(ValueError, match=r"missing weights: model.layers.2.self_attn.q_norm"):
        load({}, drop="model.layers.2.self_attn.q_norm.weight")
    with pytest.raises(ValueError, match="incomplete q/k/v weights for layers \\[0\\]"):
        load({}, drop="model.layers.0.self_attn.v_proj.weight")


def test_transformers_internal_names_load(tiny: Path) -> None:
    """transformers' in-memory names (fused 3-D experts under `mlp.`) load to the same model."""
    hf = _hf(tiny)
    ours = _fresh(tiny)
    ours.load_weights((k, v.detach()) for k, v in hf.state_dict().items())
    assert any(".mlp.experts.gate_up_proj" in k for k in hf.state_dict())
    ids = _ids(24, 4)
    got = PagedRunner(ours, block_size=16).step({0: ids})[0]
    torch.testing.assert_close(got, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_kv_cache_spec_bytes(tiny: Path) -> None:
    from transformers import MiniMaxM2Config

    spec = _ours(tiny).kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size) == (3, 2, 16)
    assert spec.bytes_per_token == 2 * 3 * 2 * 16 * 4
    real = MiniMaxM2Config(rotary_dim=64, use_qk_norm=True, num_mtp_modules=3)
    with torch.device("meta"):  # MiniMax-M2.7 shape, no memory: 62 x 8 kv heads x 128, bf16
        big = MiniMaxM2ForCausalLM(real, torch.bfloat16)
    assert big.rotary_dim == 64 and big.mtp.num_modules == 3
    assert big.kv_cache_spec().bytes_per_token == 62 * 8 * 128 * 2 * 2 == 253_952


# ------------------------------------------------------------------------------- MTP modules
N_LAYERS = 3  # of the tiny config; MTP module k is `model.layers.{3 + k}`


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_minimax_m2(tmp_path_factory.mktemp("mm_mtp"), mtp_modules=2)


def _meta(qlen: int, slen: int, block_size: int = 4):
    from sous.engine.attention import AttentionMetadata

    return AttentionMetadata.build([qlen], [slen], [list(range(32))[::-1]], block_size, CPU)


def _main_hidden(model: MiniMaxM2ForCausalLM, ids: list[int]) -> torch.Tensor:
    """The main model's `forward` output [T, H] for one prefill of `ids`."""
    caches = model.kv_cache_spec().allocate(32, 4, CPU)
    meta = _meta(len(ids), len(ids))
    with torch.inference_mode():
        return model(torch.tensor(ids), meta.positions, caches, meta)


def _mtp_reference(path: Path, k: int, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Logits of MTP module k, positions 0..T-1, from the checkpoint tensors: the MTP head in
    plain torch (`eh_proj([enorm(embed) | hnorm(h)])`, embedding zeroed at position 0), then the
    module's block + `shared_head.norm` + `lm_head` as a 1-layer transformers MiniMaxM2 model."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers import MiniMaxM2ForCausalLM as HFMiniMaxM2

    w = _weights(path)
    pre = f"model.layers.{N_LAYERS + k}."

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    e = w["model.embed_tokens.weight"][torch.tensor(next_ids)]
    e[0] = 0.0
    x = torch.cat((rms(e, w[pre + "enorm.weight"]), rms(hidden, w[pre + "hnorm.weight"])), -1)
    x = x @ w[pre + "eh_proj.weight"].T
    block = {f"model.layers.0.{n.removeprefix(pre)}": t for n, t in w.items()
             if n.startswith(pre) and n.removeprefix(pre) not in MINIMAX_MTP_NAMES}
    block["model.norm.weight"] = w[pre + "shared_head.norm.weight"]
    block["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
    block["lm_head.weight"] = w["lm_head.weight"]
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_hidden_layers = 1
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        save_file(block, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        hf = HFMiniMaxM2.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(inputs_embeds=x[None]).logits[0]


def test_mtp_modules_loaded_as_layers(tiny_mtp: Path, tiny: Path) -> None:
    from sous.models.minimax_m2_mtp import MiniMaxM2MTPLayer

    model, w = _ours(tiny_mtp), _weights(tiny_mtp)
    assert model.mtp.num_modules == 2 and model.mtp.num_loaded == 2
    for k in range(2):
        layer, pre = model.mtp[k], f"model.layers.{N_LAYERS + k}."
        assert isinstance(layer, MiniMaxM2MTPLayer)
        assert torch.equal(layer.hnorm.weight, w[pre + "hnorm.weight"])
        assert torch.equal(layer.shared_head_norm.weight, w[pre + "shared_head.norm.weight"])
        assert torch.equal(layer.eh_proj.weight_t.T, w[pre + "eh_proj.weight"])
        q = w[pre + "self_attn.q_proj.weight"]
        assert torch.equal(layer.block.self_attn.qkv_proj.weight_t.T[: q.shape[0]], q)
        assert layer.shared_head is None and layer.embed_tokens is None
    assert not torch.equal(model.mtp[0].eh_proj.weight_t, model.mtp[1].eh_proj.weight_t)
    ids = _ids(20, 3)  # the MTP modules do not change the main model's logits
    ours = PagedRunner(model, block_size=16).step({0: ids})[0]
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("k", [0, 1])
def test_forward_mtp_matches_reference_across_chunks(tiny_mtp: Path, k: int) -> None:
    """Module k fed the main model's hidden states and the next tokens (step 0 of a drafter),
    in chunks through its own paged one-layer KV cache (block 4): logits equal the reference."""
    from dataclasses import replace

    model = _ours(tiny_mtp)
    ids = _ids(24, 5 + k)
    hidden = _main_hidden(model, ids)
    nxt = int(model.compute_logits(hidden[-1:]).argmax())
    next_ids = [*ids[1:], nxt]
    ref = _mtp_reference(tiny_mtp, k, next_ids, hidden)
    cache = replace(model.kv_cache_spec(), num_layers=1).allocate(32, 4, CPU)[0]
    pos = 0
    for size in [7, 6, 1, 1, 9]:
        meta = _meta(size, pos + size)
        with torch.inference_mode():
            out = model.forward_mtp(k, torch.tensor(next_ids[pos : pos + size]), meta.positions,
                                    hidden[pos : pos + size], cache, meta)
            got = model.compute_mtp_logits(k, out)
        assert out.shape == (size, 64) and got.dtype == torch.float32
        torch.testing.assert_close(got, ref[pos : pos + size], atol=ATOL, rtol=0)
        pos += size
    assert pos == len(ids)


def test_mtp_own_head_and_embedding_used_when_present(tiny_mtp: Path) -> None:
    """Optional per-module `shared_head.head` / `embed_tokens` replace the shared ones."""
    w = _weights(tiny_mtp)
    gen = torch.Generator().manual_seed(7)
    head, embed = torch.randn(1000, 64, generator=gen), torch.randn(1000, 64, generator=gen)
    model = _fresh(tiny_mtp)
    model.load_weights([*w.items(), ("model.layers.3.shared_head.head.weight", head),
                        ("model.layers.3.embed_tokens.weight", embed)])
    shared = _ours(tiny_mtp)
    ids, hidden = [5, 9, 17, 4], torch.randn(4, 64, generator=gen)
    meta = _meta(4, 4)
    outs = []
    for m in (model, shared):
        cache = m.kv_cache_spec().allocate(32, 4, CPU)[0]
        with torch.inference_mode():
            outs.append(m.forward_mtp(0, torch.tensor(ids), meta.positions, hidden, cache, meta))
    assert not torch.allclose(outs[0], outs[1])  # own embedding differs from the main one
    normed = model.mtp[0].shared_head_norm.forward(outs[0])
    torch.testing.assert_close(model.compute_mtp_logits(0, outs[0]), normed @ head.T)
    normed = shared.mtp[0].shared_head_norm.forward(outs[1])
    torch.testing.assert_close(shared.compute_mtp_logits(0, outs[1]), normed @ w["lm_head.weight"].T)


def test_mtp_weights_checked(tiny_mtp: Path, tiny: Path) -> None:
    weights = _weights(tiny_mtp)
    base = {k: v for k, v in weights.items() if not k.startswith(("model.layers.3.",
                                                                  "model.layers.4."))}

    def load(ws: dict[str, torch.Tensor]) -> MiniMaxM2ForCausalLM:
        model = _fresh(tiny_mtp)
        model.load_weights(ws.items())
        return model

    none = load(base)  # the public checkpoints: config says MTP, no MTP weights
    assert none.mtp.num_modules == 2 and none.mtp.num_loaded == 0
    with pytest.raises(IndexError, match="MTP module 0 is not loaded"):
        none.forward_mtp(0, torch.tensor([1]), torch.tensor([0]), torch.zeros(1, 64),
                         torch.zeros(0), _meta(1, 1))
    only0 = load({**base, **{k: v for k, v in weights.items() if k.startswith("model.layers.3.")}})
    assert only0.mtp.num_loaded == 1
    with pytest.raises(ValueError, match=r"missing weights: model.layers.3.hnorm.weight"):
        load({k: v for k, v in weights.items() if k != "model.layers.3.hnorm.weight"})
    with pytest.raises(ValueError, match=r"missing weights: model.layers.4.self_attn.o_proj"):
        load({k: v for k, v in weights.items() if k != "model.layers.4.self_attn.o_proj.weight"})
    with pytest.raises(ValueError, match=r"model.layers.4.block_sparse_moe: .*down_proj of exp"):
        load({k: v for k, v in weights.items()
              if k != "model.layers.4.block_sparse_moe.experts.2.w2.weight"})
    with pytest.raises(ValueError, match=r"missing weights: model.layers.3.eh_proj.weight"):
        load({**base, "model.layers.4.enorm.weight": torch.ones(64)})  # module 0 absent
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.3.bogus.weight'"):
        load({**weights, "model.layers.3.bogus.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="layer 5 is beyond num_hidden_layers"):
        load({**weights, "model.layers.5.enorm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match="unexpected weight 'model.mtp_layers.0.e_norm.weight'"):
        load({**weights, "model.mtp_layers.0.e_norm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match=r"MTP eh_proj: shape \(64, 64\)"):
        load({**weights, "model.layers.3.eh_proj.weight": torch.ones(64, 64)})
