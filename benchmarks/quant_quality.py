"""Quality cost of sous' quantised modes on the bundled model, against float32.

Runs one fixed English text (this repository's README, first `--tokens` tokens) through the
bundled SmolLM2-135M-Instruct GGUF loaded four ways -- float32 (every weight dequantised: the
reference), `--dtype float32 --quantization gguf` (the exact Q4_1/Q8_0 weights times
activations quantised to int8 per block of 32, llama.cpp's numerics, on the qgemm kernel;
torch's int4 kernel with bf16 activations on CPUs without AVX-512 VNNI or AVX2; float32 KV
cache), `default` (no flags: the same weights with `--dtype auto` activations and the KV cache
`--kv-cache-dtype auto` gives them, bfloat16 where activations are float32) and
`--quantization int8` (int8 weights, dynamic int8 activations) -- and prints JSON: per mode,
the activation and cache dtypes, perplexity on the text, mean and max absolute logit error
against float32 (relative to the mean absolute float32 logit), and how often the argmax token
agrees.

    python benchmarks/quant_quality.py [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.engine.attention import AttentionMetadata
from sous.engine.kv_cache.cache_dtype import resolve_cache_dtype, with_cache_dtype
from sous.models.layers.linear import Int4Linear
from sous.models.loader import load_model

CPU = torch.device("cpu")
MODES = {"float32": {"dtype": "float32"},
         "gguf": {"dtype": "float32", "quantization": "gguf"},
         "default": {},
         "int8": {"dtype": "float32", "quantization": "int8"}}
"""Mode name -> ModelConfig fields."""


def text_ids(tokenizer, n: int) -> list[int]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    return tokenizer(text)["input_ids"][:n]


@torch.inference_mode()
def logits_of(model: torch.nn.Module, ids: list[int], spec, block_size: int = 16) -> torch.Tensor:
    """float32 logits `[len(ids), vocab]` of one prefill over a fresh paged cache of `spec`."""
    blocks = (len(ids) + block_size - 1) // block_size
    caches = spec.allocate(blocks, block_size, CPU)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], block_size,
                                   CPU)
    hidden = model(torch.tensor(ids), meta.positions, caches, meta)
    return model.compute_logits(hidden).float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return math.exp(-lp.mean().item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    results, ref, ids = {}, None, None
    for name, fields in MODES.items():
        mc = ModelConfig(**fields)
        loaded = load_model(mc, LoadConfig(), CPU)
        cache_dtype = resolve_cache_dtype("auto", mc.dtype, loaded.quantization, loaded.dtype)
        spec = with_cache_dtype(loaded.model.kv_cache_spec(), cache_dtype)
        # Without VNNI `gguf` may keep dense copies for batches of many rows (a prefill like
        # this one); measure the int4 kernel's own numerics, which its decode steps use.
        for m in loaded.model.modules():
            if isinstance(m, Int4Linear):
                m.dense_min_rows = 1 << 30
        ids = ids or text_ids(loaded.tokenizer, args.tokens)
        logits = logits_of(loaded.model, ids, spec)
        row = {"dtype": str(loaded.dtype).removeprefix("torch."),
               "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
               "perplexity": round(perplexity(logits, ids), 4)}
        if ref is None:
            ref = logits
        else:
            err = (logits - ref).abs()
            scale = ref.abs().mean().item()
            row.update(mean_abs_logit_error=round(err.mean().item(), 4),
                       mean_abs_logit_error_rel=round(err.mean().item() / scale, 4),
                       max_abs_logit_error=round(err.max().item(), 3),
                       argmax_agreement=round(
                           (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4))
        results[name] = row
        del loaded
    print(json.dumps({"tokens": len(ids or []), "text": "README.md", "modes": results},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
