"""Model loading: the bundled GGUF, GGUF quant formats, safetensors folders and strategies,
dtype resolution and the error messages."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.engine.attention import AttentionMetadata
from sous.models import loader_gguf
from sous.models.bundled import bundled_gguf_path
from sous.models.layers.linear import GroupQuantWeight, Int4Linear, int4_kernel_available
from sous.models.layers.qgemm_linear import BlockQuantEmbedding, qgemm_ops
from sous.models.loader import ModelNotFoundError, cpu_supports_bf16, load_model, resolve_dtype
from tiny_models import make_tiny_llama

CPU = torch.device("cpu")


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    caches = model.kv_cache_spec().allocate(32, 16, CPU)
    n = len(ids)
    meta = AttentionMetadata.build([n], [n], [list(range((n + 15) // 16))], 16, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta.positions, caches, meta))


@pytest.fixture(scope="module")
def bundled():
    return load_model(ModelConfig(), LoadConfig(), CPU)


def test_bundled_gguf(bundled):
    cfg = bundled.hf_config
    assert cfg.num_hidden_layers == 30
    assert cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.vocab_size == 49152
    assert cfg.intermediate_size == 1536
    assert cfg.tie_word_embeddings is True
    assert bundled.served_model_name == "SmolLM2-135M-Instruct"
    assert bundled.max_position_embeddings == 8192
    assert bundled.eos_token_ids == [2]
    assert bundled.model_path == str(bundled_gguf_path())
    # `--dtype auto`: the Q4_1 / Q8_0 matrices stay quantised (as vLLM serves GGUF); an
    # explicit --dtype dequantises them.
    assert bundled.dtype == (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    assert bundled.quantization == "gguf"
    exact = load_model(ModelConfig(dtype="bfloat16"), LoadConfig(), CPU)
    assert exact.quantization is None and exact.dtype == torch.bfloat16
    # The tied Q8_0 embedding is read from the output head's blocks (no dense copy); its rows
    # equal the dequantised table.
    embed = bundled.model.model.embed_tokens
    if isinstance(embed, BlockQuantEmbedding):
        assert embed.table is bundled.model.lm_head
        ids = torch.arange(0, cfg.vocab_size, 7)
        dense = exact.model.model.embed_tokens.weight[ids]
        rows = embed(ids)
        if rows.dtype == dense.dtype:
            assert torch.equal(rows, dense)
        else:  # float32 rows (a CPU without bf16) against the bfloat16 table: its rounding
            torch.testing.assert_close(rows.float(), dense.float(), rtol=2**-8, atol=0.0)
    else:
        assert qgemm_ops(CPU) is None
    assert not bundled.model.training
    spec = bundled.model.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size) == (30, 3, 64)


def test_bundled_tokenizer(bundled):
    tok = bundled.tokenizer
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast)
    text = "Hello world! Ça va? 12345 <|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_bundled_tokenizer_equals_transformers_auto(bundled):
    from transformers import AutoTokenizer

    from conftest import BUNDLED_GGUF, bundled_model_dir

    ref = AutoTokenizer.from_pretrained(bundled_model_dir(), gguf_file=BUNDLED_GGUF)
    tok = bundled.tokenizer
    for text in ["Hello world", "  spaces\n\ttabs", "<|im_start|>user\nx<|im_end|>", "é 中文 🤖"]:
        assert tok(text)["input_ids"] == ref(text)["input_ids"]
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        assert getattr(tok, attr) == getattr(ref, attr)
    assert len(tok) == len(ref)


def test_served_name_and_gguf_path(bundled):
    path = str(bundled_gguf_path())
    mc = ModelConfig(model=path, dtype="float32", served_model_name="smol")
    loaded = load_model(mc, LoadConfig(), CPU)
    assert loaded.served_model_name == "smol"
    assert loaded.quantization is None and loaded.dtype == torch.float32
    ids = bundled.tokenizer("The capital of France is")["input_ids"]
    # dense float32 and the default path agree on the text's next tokens
    dense, default = _logits(loaded.model, ids), _logits(bundled.model, ids)
    cos = torch.nn.functional.cosine_similarity(dense, default, dim=-1)
    assert cos.min() > 0.995
    loaded2 = load_model(ModelConfig(model=path, dtype="float32"), LoadConfig(), CPU)
    assert loaded2.served_model_name == path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_group_quant_is_exact(qtype):
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((48, 256)) * rng.uniform(0.1, 3, (48, 1))).astype(np.float32)
    packed = gguf.quants.quantize(data, t)
    ref = torch.from_numpy(gguf.quants.dequantize(packed, t).copy())
    w = loader_gguf._group_quant(packed, qtype, 48)
    assert w is not None
    torch.testing.assert_close(w.dequantize(), ref, atol=1e-6, rtol=1e-6)
    if int4_kernel_available(CPU):
        x = torch.randn(5, 256)
        y = Int4Linear(w)(x)
        exact = x @ ref.t()
        # bf16 activations/scales/output: relative error well under 1%
        assert ((y - exact).norm() / exact.norm()) < 1e-2
        w.dense_fallback = True
        lin = Int4Linear(w)
        xl = torch.randn(Int4Linear.dense_min_rows, 256)
        torch.testing.assert_close(lin(xl), xl @ ref.t(), atol=1e-4, rtol=1e-4)


def test_gguf_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim = 3, 8
    w = torch.arange(n_head * head_dim).float()
    # llama.cpp's convert_hf_to_gguf permute
    permuted = w.reshape(n_head, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert torch.equal(permuted[loader_gguf._unpermute_rows(len(w), n_head)], w)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("s"), max_shard_size="100KB")


@pytest.mark.parametrize("strategy", [None, "lazy", "eager", "prefetch"])
def test_safetensors_sharded_strategies(sharded, strategy):
    from transformers import LlamaForCausalLM

    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    mc = ModelConfig(model=str(sharded), dtype="float32")
    loaded = load_model(mc, LoadConfig(safetensors_load_strategy=strategy), CPU)
    assert loaded.served_model_name == str(sharded)
    assert loaded.eos_token_ids == [3, 1]
    assert loaded.max_position_embeddings == 512
    assert loaded.tokenizer.chat_template
    ids = [5, 17, 42, 7, 99, 100, 3, 250, 11, 12]
    ref = LlamaForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(loaded.model, ids), expected, atol=1e-4, rtol=0)


def test_bf16_checkpoint_dtypes(tmp_path):
    path = make_tiny_llama(tmp_path, dtype="bfloat16")
    auto = load_model(ModelConfig(model=str(path)), LoadConfig(), CPU)
    assert auto.dtype == (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    bf16 = load_model(ModelConfig(model=str(path), dtype="bfloat16"), LoadConfig(), CPU)
    assert bf16.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert bf16.model.kv_cache_spec().dtype == torch.bfloat16
    a, b = _logits(auto.model, [1, 2, 3, 4, 5]), _logits(bf16.model, [1, 2, 3, 4, 5])
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.1


def test_resolve_dtype():
    assert resolve_dtype("float16", None, CPU) == torch.float16
    expected = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    assert resolve_dtype("auto", torch.bfloat16, CPU) == expected
    assert resolve_dtype("auto", torch.float32, CPU) == expected
    with pytest.raises(ValueError):
        resolve_dtype("int3", None, CPU)


def test_unknown_architecture(sharded, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sharded, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM.*not supported.*LlamaForCausalLM"):
        load_model(ModelConfig(model=str(bad)), LoadConfig(), CPU)


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/no/such/folder"])
def test_nonexistent_model(model):
    with pytest.raises(ModelNotFoundError) as exc:
        load_model(ModelConfig(model=model), LoadConfig(), CPU)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, FileNotFoundError)
    msg = str(exc.value)
    assert "sous does not download" in msg
    assert "local" in msg and ".gguf" in msg
    if "/" in model and not model.startswith("/"):
        assert "huggingface-cli download" in msg


def test_revision_and_chat_template_override(sharded):
    with pytest.raises(ValueError, match="revision"):
        load_model(ModelConfig(model=str(sharded), revision="v2"), LoadConfig(), CPU)
    mc = ModelConfig(model=str(sharded), revision="main", chat_template="{{ 'X' }}")
    loaded = load_model(mc, LoadConfig(), CPU)
    assert loaded.tokenizer.chat_template == "{{ 'X' }}"


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(ModelConfig(model=str(tmp_path / "empty")), LoadConfig(), CPU)


def test_group_quant_weight_cat_and_permute():
    rng = torch.Generator().manual_seed(0)

    def rand(n):
        q = torch.randint(0, 16, (n, 64), generator=rng, dtype=torch.uint8)
        return GroupQuantWeight(
            [(q, torch.rand(n, 2, generator=rng), torch.randn(n, 2, generator=rng))]
        )

    a, b = rand(16), rand(32)
    cat = GroupQuantWeight.cat([a, b])
    torch.testing.assert_close(cat.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    perm = torch.randperm(16, generator=rng)
    torch.testing.assert_close(a.permute_rows(perm).dequantize(), a.dequantize()[perm])
