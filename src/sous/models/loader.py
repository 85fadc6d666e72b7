"""`load_model`: MODEL argument -> model on device + tokenizer + serving facts.

MODEL is None (the bundled SmolLM2 GGUF), a Hugging Face-style folder, or a `.gguf` file. sous
never downloads: anything else is an error that says how to point at a local copy.

dtype `auto`: on CPU bfloat16 when the CPU has native bf16 (avx512_bf16 / amx_bf16 / ARM bf16),
else float32; on CUDA the checkpoint's dtype, with float32 checkpoints run in bfloat16 (float16
where bf16 is unsupported), as vLLM does.

GGUF files: by default (`--dtype auto`, no `--quantization`) and with `--quantization gguf`,
their Q4_0/Q4_1/Q8_0 matrices stay quantised, as vLLM serves GGUF, and run on sous' `qgemm`
kernel (AVX-512 VNNI or AVX2: llama.cpp's numerics, int8 block activations) or else torch's int4 CPU
kernel (bf16 activations); both compute each row on its own, so results do not depend on the
batch. An explicit `--dtype` (float32, bfloat16, float16) dequantises every weight on load to
that dtype instead: exact numerics, as transformers computes them. Opt-in, for the int4 kernel:
models whose dense form fits in `SOUS_GGUF_DENSE_COPY_MAX_BYTES` (default 0: none) also keep
dense copies, used for batches of >= 16 rows (>= 8 for the two-plane Q8_0 lm_head), which is
faster on CPUs without bf16 but costs the memory and makes results depend on batch size.
Quantised safetensors checkpoints (FP8 block, ModelOpt and compressed-tensors NVFP4; see
`sous.models.quant`) are dequantised on load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from sous.config.errors import ConfigError
from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.models import bundled
from sous.models import loader_gguf as gg
from sous.models import loader_safetensors as st
from sous.models.gguf_tokenizer import load_tokenizer as load_gguf_tokenizer
from sous.models.layers.linear import int4_kernel_available
from sous.models.module_attrs import bind_module_attributes
from sous.models.quant import DequantizedWeights, detect_quant_config
from sous.models.registry import get_model_class, resolve_architecture, supported_architectures

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_T = TypeVar("_T")
logger = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError, ConfigError):
    """MODEL is not a local folder or GGUF file (sous never downloads)."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    hf_config: Any
    dtype: torch.dtype
    served_model_name: str
    max_position_embeddings: int
    eos_token_ids: list[int]
    model_path: str
    quantization: str | None = None
    """"gguf" when GGUF matrices run quantised (qgemm, or torch's int4 kernel); for a quantised
    safetensors checkpoint (dequantised on load): "fp8" (block or per-tensor),
    "modelopt-fp8", "modelopt-nvfp4", "modelopt-mixed" (per-layer NVFP4 / FP8) or
    "compressed-tensors-nvfp4"; else None."""
    kv_scales: dict[str, float] = field(default_factory=dict)
    """Checkpoint KV-cache scales ("model.layers.0.self_attn.k_scale" -> float), if any."""


@lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 arithmetic."""
    try:
        if torch.backends.cpu.get_cpu_capability() == "AMX":  # type: ignore[attr-defined]
            return True
    except Exception:  # pragma: no cover
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set(
        re.findall(r"[\w.]+", " ".join(re.findall(r"^(?:flags|Features)\s*:(.*)$", text, re.M)))
    )
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = _DTYPES.get(d.replace("torch.", ""))
    return d if isinstance(d, torch.dtype) else None


def resolve_dtype(requested: str, ckpt: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype weights and activations run in (see module docstring for `auto`)."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"unsupported dtype {requested!r}; use auto, {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    if device.type == "cuda":
        if ckpt in (torch.bfloat16, torch.float16):
            return ckpt
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    return torch.float32


def _not_found(model: str) -> ModelNotFoundError:
    hint = ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith((".", "/")):
        hint = (
            f" {model!r} looks like a Hugging Face Hub id: download it yourself (for example "
            f"`huggingface-cli download {model} --local-dir ./{model.split('/')[-1]}`) and pass "
            "that folder."
        )
    return ModelNotFoundError(
        f"Model {model!r} is not a local folder or .gguf file. sous does not download models: "
        "pass a local Hugging Face-style folder (config.json + *.safetensors + tokenizer files) "
        f"or a .gguf file.{hint}"
    )


def _locate(model_config: ModelConfig) -> tuple[Path, bool]:
    """`(path, is_gguf)` for the MODEL argument."""
    if model_config.model is None:
        p = bundled.bundled_gguf_path()
    else:
        p = Path(model_config.model).expanduser()
        if not p.exists():
            raise _not_found(model_config.model)
    if model_config.revision not in (None, "main"):
        raise ConfigError(
            f"--revision {model_config.revision!r} cannot be used with the local model {str(p)!r}: "
            "sous does not download, so only the files on disk (revision 'main') exist. "
            "Check out the revision you want into a folder and pass that folder."
        )
    if model_config.model is None:
        return p, True
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ConfigError(f"{p} is a file but not a .gguf file; pass a .gguf or a model folder")
        return p, True
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0], True
        raise ConfigError(
            f"{p} is not a Hugging Face-style model folder: it has no config.json"
            + (f" (and {len(ggufs)} .gguf files: pass one of them)" if ggufs else "")
        )
    return p, False


@contextlib.contextmanager
def _progress(items: Iterable[_T], total: int, desc: str) -> Iterator[Iterator[_T]]:
    """`items` behind a progress bar on stderr. The bar is closed (its line ended) when the
    block exits, also on an error, so that a start-up error prints on a line of its own."""
    from tqdm import tqdm

    bar = tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, dynamic_ncols=True)
    try:
        yield iter(bar)
    finally:
        bar.close()


def _apply_chat_template_override(tokenizer: Any, chat_template: str | None) -> None:
    if not chat_template:
        return
    p = Path(chat_template).expanduser()
    tokenizer.chat_template = p.read_text() if p.is_file() else chat_template


def _unique(ids: Iterable[int | None]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out


def _build_model(hf_config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    cls = get_model_class(resolve_architecture(hf_config))
    with torch.device(device):
        return cls(hf_config, dtype)


def _keep_gguf_quantized(reader: Any, mc: ModelConfig, device: torch.device) -> bool:
    """Run the file's Q4_0/Q4_1/Q8_0 matrices quantised: with `--quantization gguf`, and by
    default (`--dtype auto`, no `--quantization`) where this device has a kernel for them, as
    vLLM serves a GGUF file. An explicit `--dtype` dequantises every weight to it (exact)."""
    if mc.quantization == "gguf":
        if not int4_kernel_available(device):
            raise ConfigError(f"--quantization gguf needs a quantised-matmul kernel for "
                              f"{device}; there is none.")
        return True
    if mc.quantization is not None or mc.dtype != "auto":
        return False
    return int4_kernel_available(device) and gg.has_group_quant(reader)


def _load_gguf(path: Path, mc: ModelConfig, device: torch.device) -> LoadedModel:
    reader = gg.open_gguf(path)
    hf_config = gg.build_config(reader)
    keep_quantized = _keep_gguf_quantized(reader, mc, device)
    dtype = resolve_dtype(mc.dtype, torch.float32, device)
    # Opt-in dense copies for batches of many rows (see Int4Linear and the module docstring).
    limit = int(os.environ.get("SOUS_GGUF_DENSE_COPY_MAX_BYTES", 0))
    dense_fallback = keep_quantized and 0 < gg.dense_bytes(reader, dtype) <= limit
    model = _build_model(hf_config, dtype, device)
    weights = gg.iter_weights(reader, hf_config, dtype, keep_quantized, dense_fallback)
    with _progress(weights, len(reader.tensors), "Loading GGUF weights") as bar:
        model.load_weights(bar)  # type: ignore[operator]
    tok_dir = Path(mc.tokenizer) if mc.tokenizer else None
    tokenizer = _load_hf_tokenizer(tok_dir) if tok_dir else load_gguf_tokenizer(path)
    eos = _unique([*gg.eos_token_ids(reader), tokenizer.eos_token_id])
    return LoadedModel(
        model=model.eval(),
        tokenizer=tokenizer,
        hf_config=hf_config,
        dtype=dtype,
        served_model_name="",
        max_position_embeddings=int(hf_config.max_position_embeddings),
        eos_token_ids=eos,
        model_path=str(path),
        quantization="gguf" if keep_quantized else None,
    )


def _load_hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    if not folder.exists():
        raise _not_found(str(folder))
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _load_folder(path: Path, mc: ModelConfig, lc: LoadConfig, device: torch.device) -> LoadedModel:
    from transformers import AutoConfig

    raw = st.read_json(path / "config.json")
    archs = raw.get("architectures") or []
    resolve_architecture(type("Cfg", (), {"architectures": archs})())  # clear error before parsing
    quant = detect_quant_config(path, raw)
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"cannot read {path / 'config.json'} ({e}). "
            f"Supported architectures: {', '.join(supported_architectures())}"
        ) from e
    dtype = resolve_dtype(mc.dtype, checkpoint_dtype(hf_config), device)
    files = st.safetensors_files(path)
    model = _build_model(hf_config, dtype, device)
    total = st.count_tensors(files)
    tensors = st.iter_weights(files, lc.safetensors_load_strategy)
    with _progress(tensors, total, "Loading safetensors weights") as weights:
        deq = DequantizedWeights(weights, quant, dtype) if quant is not None else None
        model.load_weights(weights if deq is None else deq)  # type: ignore[operator]
    if deq is not None:
        logger.info("Loaded a %s checkpoint: %d weights dequantised to %s",
                    deq.config.method, deq.num_dequantized, dtype)
    tokenizer = _load_hf_tokenizer(Path(mc.tokenizer) if mc.tokenizer else path)
    cfg_eos = getattr(hf_config, "eos_token_id", None)
    cfg_eos = cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]
    eos = _unique([*st.generation_eos_ids(path), *cfg_eos, tokenizer.eos_token_id])
    max_pos = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    if window:  # no sliding-window attention yet: serve only contexts it does not affect
        max_pos = min(max_pos, int(window))
    return LoadedModel(
        model=model.eval(),
        tokenizer=tokenizer,
        hf_config=hf_config,
        dtype=dtype,
        served_model_name="",
        max_position_embeddings=max_pos,
        eos_token_ids=eos,
        model_path=str(path),
        quantization=deq.config.method if deq is not None else None,
        kv_scales=deq.kv_scales if deq is not None else {},
    )


def _quantize_int8(loaded: LoadedModel, device: torch.device) -> None:
    """`--quantization int8`: every dense linear of the loaded model becomes W8A8."""
    from sous.models.layers.int8_linear import quantize_linears

    if device.type != "cpu":
        raise ConfigError(f"--quantization int8 runs on the CPU only, not on {device}.")
    if loaded.quantization is not None:
        raise ConfigError(f"--quantization int8 needs a float checkpoint; this one is "
                          f"{loaded.quantization}.")
    n = quantize_linears(loaded.model)
    loaded.quantization = "int8"
    logger.info("--quantization int8: %d linear layers as int8 weights with dynamic int8 "
                "activations", n)


def load_model(
    model_config: ModelConfig, load_config: LoadConfig, device: torch.device
) -> LoadedModel:
    """Load MODEL (see module docstring) onto `device`, in eval mode, in the resolved dtype."""
    device = torch.device(device)
    path, is_gguf = _locate(model_config)
    if is_gguf:
        loaded = _load_gguf(path, model_config, device)
    else:
        loaded = _load_folder(path, model_config, load_config, device)
    if model_config.quantization == "int8":
        _quantize_int8(loaded, device)
    bind_module_attributes(loaded.model)
    _apply_chat_template_override(loaded.tokenizer, model_config.chat_template)
    if model_config.served_model_name:
        loaded.served_model_name = model_config.served_model_name
    elif model_config.model is None:
        loaded.served_model_name = bundled.BUNDLED_NAME
    else:
        loaded.served_model_name = model_config.model
    return loaded


def num_hidden_layers(model_config: ModelConfig) -> int:
    """MODEL's decoder layer count, read from its config (nothing is loaded)."""
    path, is_gguf = _locate(model_config)
    if is_gguf:
        return int(gg.build_config(gg.open_gguf(path)).num_hidden_layers)
    raw = st.read_json(path / "config.json")
    return int(raw.get("num_hidden_layers") or raw.get("text_config", {})["num_hidden_layers"])
