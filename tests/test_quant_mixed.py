"""ModelOpt MIXED_PRECISION (per-layer NVFP4 / W4A16_NVFP4 / FP8 / FP8_PER_CHANNEL_PER_TOKEN, as
`skt/A.X-K2-NVFP4`) and per-tensor FP8 checkpoints (ModelOpt `quant_algo: FP8`, `quant_method:
fp8` without `weight_block_size`), quantised here from a tiny random Llama and a tiny A.X-K2.

Bounds per element as in test_quant_loaders.py (S = the element's effective scale): FP8 e4m3
|w - w'| <= max(2^-4 |w|, 2^-10 S); NVFP4 |w - w'| <= S * h(|w|/S), h = 1/4 up to 2, 1/2 up to 4,
1 above. Loader: the quantised checkpoint's logits equal (bit for bit) a dense checkpoint holding
the test's own dequantisation; versus the unquantised model the relative L2 logit error stays
<= 0.5 with NVFP4 layers (observed 0.20 Llama, 0.15 A.X-K2) and <= 0.15 all-FP8 (observed
0.083): these random models amplify weight noise; an unrelated model would be ~1.4.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_runner import PagedRunner, load_ours
from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.models.loader import load_model
from sous.models.quant import DequantizedWeights, LayerQuant, detect_quant_config, resolve_layer
from sous.models.quant.fp8_tensor import dequantize_fp8_tensor, quantize_fp8_tensor
from sous.models.quant.layers import parse_quantized_layers
from sous.models.quant.nvfp4 import quantize_nvfp4
from test_quant_loaders import _assert_within_bound, _ref_nvfp4
from tiny_models import make_tiny_deepseek, make_tiny_llama

CPU = torch.device("cpu")
IDS = [1, 5, 17, 42, 99, 3, 250, 7, 600, 12, 13, 14]
LLAMA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures("one_thread")


def _load(path: Path):
    return load_model(ModelConfig(model=str(path), dtype="float32"), LoadConfig(), CPU)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedRunner(model, block_size=16).step({0: IDS})[0]


def _quantize(sd: dict[str, torch.Tensor], algos: dict[str, str]) -> tuple[dict, dict]:
    """Quantise modules `algos` (module -> ModelOpt quant_algo) of state dict `sd` as ModelOpt
    stores them. Returns (stored tensors of those modules, reference dequantised full state
    dict), after checking every reference weight against its format's bound."""
    stored, ref = {}, dict(sd)
    for module, algo in algos.items():
        w = sd[f"{module}.weight"]
        if algo in ("NVFP4", "W4A16_NVFP4"):
            packed, scale, g = quantize_nvfp4(w)
            dq = _ref_nvfp4(packed, scale, mult=float(g))
            parts = {"weight": packed, "weight_scale": scale, "weight_scale_2": g}
            _assert_within_bound(w, dq, scale.float().repeat_interleave(16, 1) * g, fp8=False)
        else:
            if algo == "FP8":
                q, s = quantize_fp8_tensor(w)
                eff = torch.full_like(w, float(s))
            else:  # FP8_PER_CHANNEL_PER_TOKEN: one scale per output row
                s = w.abs().amax(1) / 448.0
                q = (w / s[:, None]).to(torch.float8_e4m3fn)
                eff = s[:, None].expand_as(w)
            dq = q.float() * eff
            parts = {"weight": q, "weight_scale": s}
            _assert_within_bound(w, dq, eff, fp8=True)
        if algo != "W4A16_NVFP4":
            parts["input_scale"] = torch.tensor(0.5)
        stored.update({f"{module}.{leaf}": t for leaf, t in parts.items()})
        ref[f"{module}.weight"] = dq
    return stored, ref


def _write(src: Path, dst: Path, algos: dict[str, str], quant: dict, side: dict | None) -> dict:
    """Copy `src` to `dst` with modules `algos` quantised; config.json gets `quant` as its
    `quantization_config`, `side` (if any) goes to hf_quant_config.json. Scales and dense
    tensors go to the first shard, quantised weights to the second. Returns the reference
    dequantised state dict."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    if side is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(side))
    sd = load_file(src / "model.safetensors")
    stored, ref = _quantize(sd, algos)
    weights = {k: v for k, v in stored.items() if k.endswith(".weight")}
    first = {k: v for k, v in sd.items() if k.removesuffix(".weight") not in algos}
    first.update({k: v for k, v in stored.items() if k not in weights})
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": weights}
    for fname, tensors in shards.items():
        save_file(tensors, str(dst / fname))
    weight_map = {k: f for f, t in shards.items() for k in t}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ref


def _dense_copy(src: Path, dst: Path, ref: dict) -> Path:
    shutil.copytree(src, dst)
    save_file(ref, str(dst / "model.safetensors"))
    return dst


def _mixed(algos: dict[str, str], **extra) -> dict:
    layers = {m: {"quant_algo": a, **({"group_size": 16} if "NVFP4" in a else {})}
              for m, a in algos.items()}
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
            "quantized_layers": layers, **extra}


def _llama_algos() -> dict[str, str]:
    """Layer 0: attention FP8, MLP NVFP4. Layer 1: q/k/v FP8, o_proj per-channel FP8,
    gate/up W4A16_NVFP4, down_proj absent (unquantised). lm_head absent."""
    algos = {f"model.layers.0.self_attn.{p}": "FP8" for p in LLAMA_ATTN}
    algos |= {f"model.layers.0.mlp.{p}": "NVFP4" for p in LLAMA_MLP}
    algos |= {f"model.layers.1.self_attn.{p}": "FP8" for p in LLAMA_ATTN[:3]}
    algos["model.layers.1.self_attn.o_proj"] = "FP8_PER_CHANNEL_PER_TOKEN"
    algos |= {f"model.layers.1.mlp.{p}": "W4A16_NVFP4" for p in LLAMA_MLP[:2]}
    return algos


def _axk2_algos(num_layers: int = 3, num_experts: int = 8) -> dict[str, str]:
    """A.X-K2-NVFP4's split: routed experts NVFP4 (layer 2: W4A16_NVFP4), every other linear
    FP8 per tensor (MLA projections, indexer wq_b/wk, dense MLP, shared expert); router gate,
    indexer weights_proj, gated-norm W_down/W_up, embeddings and lm_head unquantised."""
    algos: dict[str, str] = {}
    for i in range(num_layers):
        attn = f"model.layers.{i}.self_attn"
        for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                  "indexer.wq_b", "indexer.wk"):
            algos[f"{attn}.{p}"] = "FP8"
        mlp = f"model.layers.{i}.mlp"
        dense = [mlp] if i == 0 else [f"{mlp}.shared_experts"]
        algos |= {f"{m}.{p}": "FP8" for m in dense for p in LLAMA_MLP}
        experts = [] if i == 0 else [f"{mlp}.experts.{e}" for e in range(num_experts)]
        algo = "W4A16_NVFP4" if i == 2 else "NVFP4"
        algos |= {f"{m}.{p}": algo for m in experts for p in LLAMA_MLP}
    return algos


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    path = make_tiny_llama(tmp_path_factory.mktemp("mixed"), hidden_size=96,
                           intermediate_size=208)
    return path, _logits(load_ours(path))


def test_fp8_tensor_round_trip_and_bound():
    torch.manual_seed(0)
    w = torch.randn(40, 24) * torch.logspace(-3, 0, 24)
    q, s = quantize_fp8_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    assert float(s) == float(w.abs().max() / 448) and q.float().abs().max() == 448
    dq = dequantize_fp8_tensor(q, s, torch.float32)
    assert torch.equal(dq, q.float() * float(s))
    _assert_within_bound(w, dq, torch.full_like(w, float(s)), fp8=True)
    rows = torch.rand(40) + 0.5
    for shape in ((40,), (40, 1)):
        got = dequantize_fp8_tensor(q, rows.reshape(shape), torch.bfloat16)
        assert torch.equal(got, (q.float() * rows[:, None]).to(torch.bfloat16))
    assert torch.equal(dequantize_fp8_tensor(q, s.reshape(1), torch.float32), dq)
    with pytest.raises(ValueError, match=r"weight_scale shape \(24,\)"):
        dequantize_fp8_tensor(q, torch.ones(24), torch.float32)


def test_resolve_layer_names():
    nv, fp8 = LayerQuant("nvfp4", "NVFP4"), LayerQuant("fp8-tensor", "FP8")
    layers = {"model.layers.0.self_attn.qkv_proj": fp8, "model.layers.0.mlp.gate_up_proj": nv,
              "model.layers.1.mlp.experts": nv, "model.layers.2.mlp.experts.down_proj": nv,
              "model.layers.3.self_attn.fused_qkv_a_proj": fp8,
              "model.layers.3.self_attn.o_proj": fp8, "lm_head": fp8}
    want = {
        "model.layers.0.self_attn.k_proj": fp8,
        "model.layers.0.mlp.up_proj": nv,
        "model.layers.0.mlp.down_proj": None,
        "model.layers.1.mlp.experts.7.down_proj": nv,
        "model.layers.1.mlp.shared_experts.gate_proj": None,
        "model.layers.2.mlp.experts.3.down_proj": nv,
        "model.layers.2.mlp.experts.3.gate_proj": None,
        "model.layers.3.self_attn.kv_a_proj_with_mqa": fp8,
        "model.layers.3.self_attn.o_proj": fp8,
        "model.layers.3.self_attn.kv_b_proj": None,
        "lm_head": fp8,
        "model.embed_tokens": None,
    }
    assert {m: resolve_layer(layers, m) for m in want} == want
    parsed = parse_quantized_layers({"a.weight": "fp8", "b": {"quant_algo": "W4A16_NVFP4",
                                                              "group_size": 32}})
    assert parsed == {"a": LayerQuant("fp8-tensor", "FP8"),
                      "b": LayerQuant("nvfp4", "W4A16_NVFP4", 32)}


@pytest.mark.parametrize("where", ["config-json", "hf-quant-config"])
def test_mixed_llama_logits(tmp_path, llama, where, caplog):
    """Map in config.json's quantization_config, or only in hf_quant_config.json (config.json
    naming MIXED_PRECISION without the map), with one key written with ".weight"."""
    src, original = llama
    algos = _llama_algos()
    mixed = _mixed(algos, exclude_modules=["lm_head"])
    layers = mixed["quantized_layers"]
    layers["model.layers.0.mlp.down_proj.weight"] = layers.pop("model.layers.0.mlp.down_proj")
    quant = {"quant_method": "modelopt", **mixed}
    side = None
    if where == "hf-quant-config":
        quant = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
        side = {"producer": {"name": "modelopt"}, "quantization": mixed}
    ref = _write(src, tmp_path / "quant", algos, quant, side)
    with caplog.at_level(logging.INFO, logger="sous.models.loader"):
        loaded = _load(tmp_path / "quant")
    assert loaded.quantization == "modelopt-mixed"
    assert f"Loaded a modelopt-mixed checkpoint: {len(algos)} weights dequantised" in caplog.text
    logits = _logits(loaded.model)
    assert torch.equal(logits, _logits(load_ours(_dense_copy(src, tmp_path / "dense", ref))))
    err = (logits - original).norm() / original.norm()
    assert 0 < err <= 0.5


@pytest.mark.parametrize("kind", ["modelopt-fp8", "fp8-per-tensor"])
def test_per_tensor_fp8_llama_logits(tmp_path, llama, kind, caplog):
    """ModelOpt `quant_algo: FP8` (hf_quant_config.json only, with fp8 KV scales) and
    `quant_method: fp8` with static activations and no weight_block_size: every projection
    FP8 per tensor, lm_head unquantised."""
    src, original = llama
    algos = {f"model.layers.{i}.{p}": "FP8" for i in range(2)
             for p in [f"self_attn.{a}" for a in LLAMA_ATTN] + [f"mlp.{m}" for m in LLAMA_MLP]}
    if kind == "modelopt-fp8":
        quant = {"quant_method": "modelopt"}
        side = {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                 "exclude_modules": ["lm_head"]}}
    else:
        quant = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
        side = None
    ref = _write(src, tmp_path / "quant", algos, quant, side)
    if kind == "modelopt-fp8":
        extra = {"model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.25),
                 "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(0.5)}
        save_file(extra, str(tmp_path / "quant" / "kv.safetensors"))
        index = json.loads((tmp_path / "quant" / "model.safetensors.index.json").read_text())
        index["weight_map"] |= dict.fromkeys(extra, "kv.safetensors")
        (tmp_path / "quant" / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="sous.models.loader"):
        loaded = _load(tmp_path / "quant")
    method = "modelopt-fp8" if kind == "modelopt-fp8" else "fp8"
    assert loaded.quantization == method
    assert f"Loaded a {method} checkpoint: 14 weights dequantised" in caplog.text
    if kind == "modelopt-fp8":
        assert loaded.kv_scales == {"model.layers.1.self_attn.k_scale": 0.25,
                                    "model.layers.1.self_attn.v_scale": 0.5}
    logits = _logits(loaded.model)
    assert torch.equal(logits, _logits(load_ours(_dense_copy(src, tmp_path / "dense", ref))))
    err = (logits - original).norm() / original.norm()
    assert 0 < err <= 0.15


def test_mixed_axk2_like_a_x_k2_nvfp4(tmp_path):
    src = make_tiny_deepseek(tmp_path, "AXK2ForCausalLM")
    algos = _axk2_algos()
    quant = {"quant_method": "modelopt", **_mixed(algos, exclude_modules=["lm_head"])}
    ref = _write(src, tmp_path / "quant", algos, quant, None)
    qdir = tmp_path / "quant"
    qc = detect_quant_config(qdir, json.loads((qdir / "config.json").read_text()))
    assert qc is not None and qc.method == "modelopt-mixed"
    files = sorted(qdir.glob("*.safetensors"))
    stream = [(k, v) for f in files for k, v in load_file(f).items()]
    deq = DequantizedWeights(stream, qc, torch.float32)
    dense = dict(deq)
    assert deq.dequantized_by_scheme == {"nvfp4": 2 * 8 * 3, "fp8-tensor": 3 * 7 + 3 + 2 * 3}
    assert dense.keys() == ref.keys()
    assert all(torch.equal(dense[k], ref[k]) for k in ref)
    loaded = _load(qdir)
    assert loaded.quantization == "modelopt-mixed"
    logits = _logits(loaded.model)
    assert torch.equal(logits, _logits(load_ours(_dense_copy(src, tmp_path / "dense", ref))))
    original = _logits(load_ours(src))
    err = (logits - original).norm() / original.norm()
    assert 0 < err <= 0.5


def test_mixed_errors_name_layer_and_algorithm(tmp_path, llama):
    src, _ = llama
    algos = _llama_algos()
    bad = _mixed(algos)
    bad["quantized_layers"]["model.layers.1.mlp.down_proj"] = {"quant_algo": "W4A8_AWQ",
                                                               "group_size": 128}
    d = tmp_path / "unknown"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", **bad}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported quantization") as e:
        _load(d)
    assert "'model.layers.1.mlp.down_proj' with quant_algo 'W4A8_AWQ'" in str(e.value)

    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="non-empty 'quantized_layers'"):
        _load(d)

    missing = _mixed(algos)
    del missing["quantized_layers"]["model.layers.0.mlp.up_proj"]
    _write(src, tmp_path / "missing", algos, {"quant_method": "modelopt", **missing}, None)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight(_scale)? is "
                       "stored quantised.*not in the MIXED_PRECISION quantized_layers"):
        _load(tmp_path / "missing")
