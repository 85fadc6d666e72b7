"""A Llama model's decoder layers as one C++ call per step (`sous_ops.LlamaStack`).

When every linear of every layer is a `BlockQuantLinear` (GGUF weights on the qgemm kernel,
the bundled model's default) and a step runs on the C++ attention path, the step's layers go
through `LlamaStack.forward`: the same kernels in the same order as `LlamaDecoderLayer`, so
the hidden states are bit-identical, without ~10 Python calls per layer (about 1 ms a token
for the bundled model's 30 layers on this class of CPU). It releases the GIL while it runs,
so the server thread can stream the previous token meanwhile.

The stack shares the model's tensors (nothing is copied; the model must not be reloaded
after it is built). `SOUS_FUSED_LAYERS=0` turns it off (the Python layers run).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sous.engine.attention import AttentionMetadata
from sous.engine.ops.build import cpu_ops
from sous.models.layers.qgemm_linear import BlockQuantLinear

FUSED_ENV = "SOUS_FUSED_LAYERS"
_DTYPES = (torch.float32, torch.bfloat16)


def fused_layers_enabled() -> bool:
    return os.environ.get(FUSED_ENV, "1").strip() not in ("0", "false", "no", "off")


def build_llama_stack(model: Any, start: int = 0, end: int | None = None) -> Any | None:
    """The `LlamaStack` of a `LlamaForCausalLM`'s layers `start:end` (all by default), or
    None when a layer does not qualify (another linear kind, norm weights in another dtype,
    no C++ ops, not on the CPU). A stack starting past layer 0 takes the `(h, residual)` the
    layers before it returned."""
    m = model.model
    ops = cpu_ops(m.norm.weight.device)
    if ops is None or not fused_layers_enabled() or model.dtype not in _DTYPES:
        return None
    stack = ops.LlamaStack()
    for layer in m.layers[start:end]:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(type(lin) is BlockQuantLinear for lin in linears):
            return None
        if any(n.weight.dtype != model.dtype for n in norms):
            return None
        spec = ops.LlamaLayer()
        spec.in_norm, spec.post_norm = norms[0].weight, norms[1].weight
        spec.eps = norms[0].eps
        spec.qkv, spec.o, spec.gate_up, spec.down = (_qlinear(ops, lin) for lin in linears)
        spec.num_heads, spec.num_kv_heads = attn.num_heads, attn.num_kv_heads
        spec.head_dim, spec.scale = attn.head_dim, attn.scale
        spec.k_scale, spec.v_scale = float(attn.k_scale), float(attn.v_scale)
        stack.append(spec)
    return stack


def _qlinear(ops: Any, lin: BlockQuantLinear) -> Any:
    q = ops.QLinear()
    q.w, q.wd, q.wm, q.n, q.bits = lin.packed, lin.scale, lin.min, lin.out_features, lin.bits
    q.bias = lin.bias
    return q


def stack_runs(meta: AttentionMetadata, h: torch.Tensor) -> bool:
    """Whether this step can go through the stack: the C++ attention path with its
    metadata, no per-layer KV hooks, activations the kernels take."""
    return (meta.backend == "cpp" and meta.kv_hooks is None and meta.q_starts is not None
            and meta.query_lens is not None and h.dtype in _DTYPES)
