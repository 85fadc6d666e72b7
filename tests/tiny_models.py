"""Tiny random Hugging Face checkpoints for tests (offline, seeded, deterministic).

`make_tiny_llama(tmp_path)` writes a servable folder: config.json, model.safetensors (or shards),
generation_config.json and a small word-level tokenizer with a chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS_TEXT = (
    "the a an and or but if then else of to in on at by for with from is are was were be been "
    "hello world how you me we they it this that what which who when where why yes no one two "
    "three four five six seven eight nine ten user assistant system cat dog fish bird red green "
    "blue big small fast slow good bad up down left right day night sun moon water fire ! ? . , "
    "\n : ; ' \" ( ) 0 1 2 3 4 5 6 7 8 9"
)


def make_tokenizer(vocab_size: int = 1000) -> Any:
    """A `PreTrainedTokenizerFast` over a word-level vocabulary of exactly `vocab_size` entries
    (special tokens first: unk=0, <|endoftext|>=1 (bos), <|im_start|>=2, <|im_end|>=3 (eos))."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + [w for w in WORDS_TEXT.split(" ") if w]:
        vocab.setdefault(tok, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama_config(**overrides: Any) -> Any:
    """A small `LlamaConfig` (hidden 64, 2 layers, 4 q heads / 2 kv heads, vocab 1000)."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=1,
        architectures=["LlamaForCausalLM"],
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_tiny_llama(
    tmp_path: Path | str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str = "float32",
    name: str = "tiny-llama",
    **overrides: Any,
) -> Path:
    """Write a random tiny Llama checkpoint + tokenizer to `tmp_path/name` and return the folder.

    `overrides` go to `LlamaConfig` (e.g. `num_hidden_layers=4`, `tie_word_embeddings=True`,
    `attention_bias=True`, `rope_scaling={...}`). `max_shard_size` (e.g. "100KB") shards the
    safetensors with an index file. Same seed -> identical weights."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_llama_config(**overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Larger-than-default init so attention patterns and logits are far from uniform.
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    GenerationConfig(bos_token_id=1, eos_token_id=[3, 1], pad_token_id=1).save_pretrained(out)
    make_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def tiny_minimax_m2_config(**overrides: Any) -> Any:
    """A small `MiniMaxM2Config`: hidden 64, 3 layers, 4 q heads / 2 kv heads x 16 with partial
    rotary (8 of 16 dims), full-width QK norm, 8 experts top-2 (intermediate 32), vocab 1000."""
    from transformers import MiniMaxM2Config

    kw: dict[str, Any] = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        use_qk_norm=True,
        qk_norm_type="per_layer",
        scoring_func="sigmoid",
        use_routing_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=1,
        architectures=["MiniMaxM2ForCausalLM"],
    )
    kw.update(overrides)
    return MiniMaxM2Config(**kw)


MINIMAX_MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
"""The MTP-only tensors of each module `k` written by `make_tiny_minimax_m2(mtp_modules=n)` under
`model.layers.{num_hidden_layers + k}.` (vLLM's assumed layout, see `sous.models.minimax_m2_mtp`):
norms `[H]`, `eh_proj` `[H, 2H]`; the module's decoder block is written there too, under the
names of a main layer (`self_attn.q_proj.weight`, `block_sparse_moe.experts.{e}.w1.weight`, ...)."""


def _randomize_minimax(model: Any) -> None:
    """Norms near 1, wide router weights, small other weights, random correction bias."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.8, 1.2)
            elif pname.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0.0, 0.1)


def minimax_mtp_tensors(cfg: Any, num_modules: int, seed: int = 0) -> dict[str, Any]:
    """Random MTP modules 0..num_modules-1 for a MiniMax-M2 `cfg`, checkpoint-named: each block
    is the layer of a fresh 1-layer `MiniMaxM2ForCausalLM` saved by `save_pretrained`, renamed
    from `model.layers.0.` to `model.layers.{num_hidden_layers + k}.`, plus `MINIMAX_MTP_NAMES`."""
    import copy
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import MiniMaxM2ForCausalLM

    out: dict[str, Any] = {}
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    block_cfg = copy.deepcopy(cfg)
    block_cfg.num_hidden_layers = 1
    for k in range(num_modules):
        torch.manual_seed(seed + 100 + k)
        block = MiniMaxM2ForCausalLM(block_cfg)
        _randomize_minimax(block)
        with tempfile.TemporaryDirectory() as tmp:
            block.save_pretrained(tmp)
            saved = load_file(Path(tmp) / "model.safetensors")
        prefix = f"model.layers.{cfg.num_hidden_layers + k}."
        for name, t in saved.items():
            if name.startswith("model.layers.0."):
                out[prefix + name.removeprefix("model.layers.0.")] = t
        for sub in MINIMAX_MTP_NAMES:
            if sub == "eh_proj.weight":
                out[prefix + sub] = torch.randn((h, 2 * h), generator=gen) * 0.08
            else:
                out[prefix + sub] = torch.rand((h,), generator=gen) * 0.4 + 0.8
    return out


def make_tiny_minimax_m2(
    tmp_path: Path | str,
    *,
    seed: int = 0,
    name: str = "tiny-minimax-m2",
    mtp_modules: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random tiny MiniMax-M2 checkpoint (transformers' `save_pretrained`: per-expert
    `block_sparse_moe.experts.{e}.w1/w2/w3`) + tokenizer to `tmp_path/name`; returns the folder.

    Router weights have a larger spread and the correction bias is random (not zero), so the
    top-2 choice is well separated and the bias really changes which experts are picked.
    `mtp_modules=n` also writes n random MTP modules (`minimax_mtp_tensors`) and sets
    `num_mtp_modules`/`use_mtp`/`mtp_transformer_layers` in config.json as the Hub configs do."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig, MiniMaxM2ForCausalLM

    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_minimax_m2_config(**overrides)
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(cfg)
    _randomize_minimax(model)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[3, 1], pad_token_id=1).save_pretrained(out)
    make_tokenizer(cfg.vocab_size).save_pretrained(out)
    if mtp_modules:
        tensors = load_file(out / "model.safetensors")
        tensors.update(minimax_mtp_tensors(cfg, mtp_modules, seed))
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        raw = json.loads((out / "config.json").read_text())
        raw.update(num_mtp_modules=mtp_modules, use_mtp=True, mtp_transformer_layers=1)
        (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


DEEPSEEK_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "AXK2ForCausalLM")


def tiny_deepseek_config(arch: str = "DeepseekV3ForCausalLM", **overrides: Any) -> Any:
    """A small DeepSeek-V3 / V3.2 / A.X-K2 config: hidden 64, 3 layers (first dense, then MoE of
    8 experts top-2 + 1 shared), 4 MLA heads (q_lora 48, kv_lora 32, nope 16, rope 16, v 16),
    vocab 1000; V3/V3.2 route over 2 groups (top 1), A.X-K2 without groups; V3.2/A.X-K2 have an
    indexer of 8 heads x 32 keeping the top 8 positions (so sparsity matters past 8 tokens)."""
    import transformers

    cls = {
        "DeepseekV3ForCausalLM": "DeepseekV3Config",
        "DeepseekV32ForCausalLM": "DeepseekV32Config",
        "AXK2ForCausalLM": "AXK2Config",
    }[arch]
    kw: dict[str, Any] = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=1,
        architectures=[arch],
    )
    if arch == "AXK2ForCausalLM":
        kw.update(gated_norm_rank=8)
    else:
        kw.update(n_group=2, topk_group=1)
    if arch != "DeepseekV3ForCausalLM":
        kw.update(index_topk=8, index_head_dim=32, index_n_heads=8)
    kw.update(overrides)
    return getattr(transformers, cls)(**kw)


def deepseek_mtp_tensors(folder: Path, num_hidden_layers: int, seed: int = 0) -> dict[str, Any]:
    """Fake MTP module tensors for `model.layers.{num_hidden_layers}` (DeepSeek naming): the last
    decoder layer's tensors, renamed, plus random enorm/hnorm/eh_proj/shared_head/embed."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    last, new = f"model.layers.{num_hidden_layers - 1}.", f"model.layers.{num_hidden_layers}."
    out = {new + k[len(last):]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    gen = torch.Generator().manual_seed(seed + 7)
    for sub, shape in {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
        "embed_tokens.weight": (vocab, hidden),
    }.items():
        out[new + sub] = torch.randn(shape, generator=gen)
    return out


def make_tiny_deepseek(
    tmp_path: Path | str,
    arch: str = "DeepseekV3ForCausalLM",
    *,
    seed: int = 0,
    name: str | None = None,
    mtp_layers: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random tiny `arch` checkpoint (`tiny_deepseek_config`, float32, transformers'
    `save_pretrained` layout: per-expert tensors, A.X-K2's fused `q_b_proj` and `W_down`/`W_up`)
    + tokenizer to `tmp_path/name` and return the folder. Router weights have a larger spread and
    the correction bias is random, so expert choice is well separated. `mtp_layers=1` also writes
    one MTP module (`deepseek_mtp_tensors`) into `mtp.safetensors`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(tmp_path) / (name or f"tiny-{arch}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_deepseek_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.bias") or pname.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            elif "norm.weight" in pname or pname.endswith("layernorm.weight"):
                p.uniform_(0.8, 1.2)
            elif pname.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[3, 1], pad_token_id=1).save_pretrained(out)
    make_tokenizer(cfg.vocab_size).save_pretrained(out)
    if mtp_layers:
        save_file(deepseek_mtp_tensors(out, cfg.num_hidden_layers, seed), out / "mtp.safetensors",
                  metadata={"format": "pt"})
    return out


def axk2_full_scale_config() -> Any:
    """A.X-K2 688B's real shape (61 layers, hidden 7168, MLA 512 + 64, indexer 64 x 128, 256
    experts), for building its model on the meta device (sizes only, no memory)."""
    return tiny_deepseek_config(
        "AXK2ForCausalLM", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
        num_key_value_heads=64, n_routed_experts=256, num_experts_per_tok=8, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_topk=2048, index_n_heads=64, index_head_dim=128, gated_norm_rank=16,
        max_position_embeddings=262144)
