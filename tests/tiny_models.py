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
