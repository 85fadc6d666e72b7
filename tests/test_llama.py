"""sous' Llama on the paged KV cache against transformers' LlamaForCausalLM (float32).

Tolerances: tiny random checkpoints, logits within atol 1e-4 (observed ~2e-6); the bundled
SmolLM2 GGUF (30 layers, logits up to ~40), atol 2e-3 (observed ~1e-4) and identical argmax.
"""

from __future__ import annotations

import pytest
import torch

from paged_runner import PagedRunner, check_mixed_batches
from paged_runner import load_ours as _ours
from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.engine.attention import AttentionMetadata
from sous.models.layers.linear import int4_kernel_available
from sous.models.loader import load_model
from tiny_models import make_tiny_llama

CPU = torch.device("cpu")
ATOL = 1e-4


def _hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("m"), num_hidden_layers=3)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 4},  # MHA
        {"num_key_value_heads": 1},  # MQA
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16},
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["gqa", "mha", "mqa", "head_dim", "tied_bias", "llama3_rope"],
)
def test_full_prefill_matches_transformers(tmp_path, overrides):
    path = make_tiny_llama(tmp_path, **overrides)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(path, ids)
    runner = PagedRunner(_ours(path), block_size=16)
    ours = runner.step({0: ids})[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode(tiny, block_size):
    ids = torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _hf_logits(tiny, ids)
    runner = PagedRunner(_ours(tiny), block_size=block_size)
    pos = 0
    for size in [5, 3, 9, 1, 14]:  # straddles block boundaries for both block sizes
        got = runner.step({0: ids[pos : pos + size]})[0]
        torch.testing.assert_close(got, ref[pos : pos + size], atol=ATOL, rtol=0)
        pos += size
    while pos < len(ids):  # decode the rest one token at a time
        got = runner.step({0: [ids[pos]]})[0]
        torch.testing.assert_close(got, ref[pos : pos + 1], atol=ATOL, rtol=0)
        pos += 1


def test_mixed_batch_prefill_chunk_and_decodes(tiny):
    gen = torch.Generator().manual_seed(3)
    lengths = {0: 30, 1: 24, 2: 20, 3: 27}
    seqs = {s: torch.randint(0, 1000, (n,), generator=gen).tolist() for s, n in lengths.items()}
    refs = {s: _hf_logits(tiny, ids) for s, ids in seqs.items()}
    done = check_mixed_batches(PagedRunner(_ours(tiny), block_size=4), seqs, refs, ATOL)
    assert done == {0: 20, 1: 24, 2: 20, 3: 27}


def test_decode_batch_matches_single(tiny):
    """16 decodes of different lengths in one step == each alone (batch invariance)."""
    gen = torch.Generator().manual_seed(4)
    model = _ours(tiny)
    prompts = [torch.randint(0, 1000, (5 + 3 * i,), generator=gen).tolist() for i in range(16)]
    batch = PagedRunner(model, block_size=4, num_blocks=512)
    batch.step({i: p[:-1] for i, p in enumerate(prompts)})
    together = batch.step({i: [p[-1]] for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        alone = PagedRunner(model, block_size=4).step({0: p})[0][-1:]
        torch.testing.assert_close(together[i], alone, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def smollm_prompt():
    from transformers import AutoModelForCausalLM

    from conftest import BUNDLED_GGUF, bundled_model_dir

    loaded = load_model(ModelConfig(dtype="float32"), LoadConfig(), CPU)
    text = "The three primary colours are red, yellow and blue. Mixing red and yellow gives"
    ids = loaded.tokenizer(text)["input_ids"]
    assert 15 <= len(ids) <= 25
    ref_model = AutoModelForCausalLM.from_pretrained(
        bundled_model_dir(), gguf_file=BUNDLED_GGUF, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    return loaded, ids, ref


def test_smollm_gguf_matches_transformers(smollm_prompt):
    loaded, ids, ref = smollm_prompt
    runner = PagedRunner(loaded.model, block_size=16)
    ours = runner.step({0: ids[:11]})[0]
    ours = torch.cat([ours, runner.step({0: ids[11:]})[0]])
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm_int4_path_close_to_dense(smollm_prompt):
    """`--quantization gguf` on CPU: exact Q4 weights; int8 block activations (qgemm) or
    bf16 matmul numerics (torch's int4 kernel)."""
    dense, ids, ref = smollm_prompt
    if not int4_kernel_available(CPU):
        pytest.skip("torch's int4 CPU kernel is not available on this machine")
    loaded = load_model(ModelConfig(quantization="gguf"), LoadConfig(), CPU)
    assert loaded.quantization == "gguf"
    runner = PagedRunner(loaded.model, block_size=16)
    ours = runner.step({0: ids})[0]
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.median() > 0.999 and cos.min() > 0.99, cos  # qgemm measured: 0.9997 / 0.9935
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert top1 >= 0.85, top1
    # the reference's top-1 is always within our top-5
    top5 = ours.topk(5, dim=-1).indices
    assert (top5 == ref.argmax(-1, keepdim=True)).any(-1).all()


def test_attention_metadata_build():
    meta = AttentionMetadata.build(
        query_lens=[3, 1, 2],
        seq_lens=[3, 6, 7],
        block_tables=[[9], [4, 2], [7, 1]],
        block_size=4,
        device=CPU,
    )
    assert meta.num_tokens == 6
    assert meta.positions.tolist() == [0, 1, 2, 5, 5, 6]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [36, 37, 38, 9, 5, 6]
    assert meta.logits_indices.tolist() == [2, 3, 5]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.seq_lens.tolist() == [3, 6, 7]
    assert meta.block_tables.tolist() == [[9, 0], [4, 2], [7, 1]]
    assert meta.decode_rows == [1] and meta.decode_token_slice == (3, 4)
    assert [(p.index, p.context_len) for p in meta.prefills] == [(0, 0), (2, 5)]
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build([1], [9], [[0, 1]], 4, CPU)


def test_greedy_generation_matches_transformers_generate(tiny):
    """32 greedy tokens through `LLM` with 16-token step budgets (chunked prefill), block 16."""
    from transformers import LlamaForCausalLM

    from sous import LLM, SamplingParams

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (37, 9, 21)]
    hf = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    llm = LLM(str(tiny), dtype="float32", max_model_len=256, block_size=16,
              max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20)
    # min_new_tokens bans EOS in transformers; min_tokens does the same here.
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len({tuple(e) for e in expected}) == 3
