"""GGUF (llama.cpp) checkpoints: config, tokenizer and weights under Hugging Face names.

The file's header is parsed here (`GGUFFile`, a memory map plus `struct`: ~0.1 s, where
`gguf.GGUFReader` spends ~3 s building objects for the 100k vocabulary strings we do not need);
tensor types, block sizes and dequantisation come from the `gguf` package. Every tensor is dequantised to a dense tensor, except
that with `keep_quantized=True` the Q4_0 / Q4_1 / Q8_0 matrices are handed over in their exact
group-quantised form (`GroupQuantWeight`) for the CPU int4 kernel. llama.cpp stores q_proj /
k_proj rows permuted for its rotary layout; that permutation is undone here exactly as
transformers' GGUF loader does.
"""

from __future__ import annotations

import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from sous.models.layers.gguf_blocks import BLOCK_BYTES, GgufBlocks
from sous.models.layers.linear import AnyWeight, GroupQuantWeight

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALAR |= {11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
_NP |= {11: "<i8", 12: "<f8"}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    """Torch order (outermost first)."""
    tensor_type: Any
    """A `gguf.GGMLQuantizationType`."""
    data: np.ndarray
    """The raw bytes (read-only memory map), shaped `[*shape[:-1], bytes_per_row]`."""

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> Python value; arrays of strings other than the
    ones asked for are kept as their length) and tensors (`tensors`, data memory-mapped)."""

    def __init__(self, path: str | Path, string_arrays: tuple[str, ...] = ()):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = str(path)
        blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        buf = memoryview(blob)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            self.fields[key], pos = _value(buf, pos + 4, vtype, key in string_arrays)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        self.tensors: list[GGUFTensor] = []
        for name, shape, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            row_bytes = shape[-1] // block * type_size
            rows = int(np.prod(shape[:-1]))
            a = start + offset
            data = blob[a : a + rows * row_bytes].reshape(*shape[:-1], row_bytes)
            self.tensors.append(GGUFTensor(name, shape, qtype, data))


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(buf: memoryview, pos: int, vtype: int, keep_strings: bool) -> tuple[Any, int]:
    if vtype in _SCALAR:
        (v,) = struct.unpack_from(_SCALAR[vtype], buf, pos)
        return v, pos + struct.calcsize(_SCALAR[vtype])
    if vtype == 8:
        return _string(buf, pos)
    if vtype != 9:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _NP:
        arr = np.frombuffer(buf, dtype=_NP[etype], count=count, offset=pos)
        return arr.tolist(), pos + arr.nbytes
    if etype != 8:
        raise ValueError(f"GGUF arrays of type {etype} are not supported")
    values: list[str] = []
    for _ in range(count):
        if keep_strings:
            v, pos = _string(buf, pos)
            values.append(v)
        else:
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
    return (values if keep_strings else count), pos


def dense_bytes(reader: GGUFFile, dtype: torch.dtype) -> int:
    """Bytes all tensors would take dequantised to `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(t.n_elements for t in reader.tensors) * elem


GROUP_QUANT_TYPES = tuple(BLOCK_BYTES)
"""GGUF matrix types sous can keep quantised (`_group_quant`)."""


def has_group_quant(reader: GGUFFile) -> bool:
    """True when some matrix of the file is Q4_0 / Q4_1 / Q8_0."""
    return any(len(t.shape) == 2 and t.tensor_type.name in GROUP_QUANT_TYPES
               for t in reader.tensors)


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value (or `default` when absent)."""
    return reader.fields.get(key, default)


def gguf_architecture(reader: GGUFFile) -> str:
    return str(field_value(reader, "general.architecture", "?"))


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor (None for tensors we skip)."""
    if gguf_name in _NAME_MAP:
        return _NAME_MAP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_MAP:
        return f"model.layers.{m.group(1)}.{_BLOCK_MAP[m.group(2)]}.{m.group(3)}"
    return None


class GGUFLlamaConfig(PretrainedConfig):
    """The Llama config of a GGUF file: a plain `PretrainedConfig` carrying LlamaConfig's
    fields, so loading does not import transformers' Llama modelling stack (which pulls
    torch._dynamo and torch.distributed: over a second of start-up)."""

    model_type = "llama"

    def __init__(self, **kwargs: Any) -> None:
        self.hidden_act = kwargs.pop("hidden_act", "silu")
        self.mlp_bias = kwargs.pop("mlp_bias", False)
        self.attention_dropout = kwargs.pop("attention_dropout", 0.0)
        self.initializer_range = kwargs.pop("initializer_range", 0.02)
        self.use_cache = kwargs.pop("use_cache", True)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                     "attention_bias"):
            setattr(self, name, kwargs.pop(name))
        super().__init__(**kwargs)


def build_config(reader: GGUFFile) -> Any:
    """A Llama config (`GGUFLlamaConfig`) from the file's `llama.*` metadata."""
    arch = gguf_architecture(reader)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by sous. "
            f"Supported GGUF architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def g(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // heads))
    rot = int(g("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"partial rotary ({rot} of {head_dim}) is not supported for GGUF llama")
    vocab = g("vocab_size")
    if vocab is None:
        vocab = reader.fields["tokenizer.ggml.tokens"]  # a string array is kept as its length
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(g("rope.freq_base", 10000.0)),
    }
    scaling_type = g("rope.scaling.type")
    if scaling_type == "linear":
        rope.update(rope_type="linear", factor=float(g("rope.scaling.factor", 1.0)))
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported yet")
    cfg = GGUFLlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(g("context_length", 2048)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field_value(reader, "tokenizer.ggml.padding_token_id"),
        architectures=["LlamaForCausalLM"],
    )
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        import gguf

        factors = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).ravel()
        cfg.rope_freq_factors = [float(x) for x in factors]
    general_name = field_value(reader, "general.name")
    if general_name:
        cfg._name_or_path = str(general_name)
    return cfg


def eos_token_ids(reader: GGUFFile) -> list[int]:
    """End-of-generation ids from the metadata: eos, then eot / eom when present."""
    out: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = field_value(reader, f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in out:
            out.append(int(v))
    return out


# ------------------------------------------------------------------ weights
def _group_quant(data: np.ndarray, qtype: str, rows: int) -> GroupQuantWeight | None:
    """The exact `GroupQuantWeight` of a Q4_0 / Q4_1 / Q8_0 matrix (its blocks, read from the
    file map as they are), else None."""
    if qtype not in BLOCK_BYTES:
        return None
    with warnings.catch_warnings():  # `data` is a read-only file map; it is only read
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    return GroupQuantWeight(blocks=GgufBlocks(raw.view(rows, -1, BLOCK_BYTES[qtype]), qtype))


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation for `n_head` heads."""
    idx = torch.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def iter_weights(
    reader: GGUFFile,
    hf_config: Any,
    dtype: torch.dtype,
    keep_quantized: bool,
    dense_fallback: bool = False,
) -> Iterator[tuple[str, AnyWeight]]:
    """`(hf_name, weight)` for every model tensor: dense in `dtype`, or `GroupQuantWeight` for
    Q4_0/Q4_1/Q8_0 matrices when `keep_quantized` (with `dense_fallback` set on them)."""
    import gguf

    heads = hf_config.num_attention_heads
    kv_heads = hf_config.num_key_value_heads
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                continue
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")
        shape = t.shape
        qtype = t.tensor_type.name
        w: AnyWeight | None = None
        if keep_quantized and len(shape) == 2:
            w = _group_quant(t.data, qtype, shape[0])
            if w is not None:
                w.dense_fallback = dense_fallback
        if w is None:
            arr = np.array(gguf.quants.dequantize(t.data, t.tensor_type), copy=True)
            w = torch.from_numpy(arr.reshape(shape)).to(dtype)
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            n = heads if ".q_proj." in name else kv_heads
            perm = _unpermute_rows(shape[0], n)
            w = w.permute_rows(perm) if isinstance(w, GroupQuantWeight) else w[perm]
        yield name, w
