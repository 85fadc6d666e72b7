"""Quantised safetensors checkpoints (FP8 block, ModelOpt NVFP4, compressed-tensors NVFP4),
quantised here from a tiny random Llama and loaded through sous.

Bounds (per element, S = the element's effective scale):
- FP8 e4m3 (3 mantissa bits): |w - w'| <= max(2^-4 |w|, 2^-10 S) (half an ulp; the second term
  is half the e4m3 subnormal step 2^-9).
- NVFP4 E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}: |w - w'| <= S * h(|w|/S), h = 1/4 up to 2, 1/2 up
  to 4, 1 above (half the grid step; clamping at 6 after e4m3 rounding of S costs < 0.4 S).
- Loader: every quantised weight of the checkpoint meets the bound above, and the quantised
  checkpoint's logits equal (bit for bit) those of a dense checkpoint holding the test's own
  reference dequantisation. Versus the unquantised model the relative L2 logit error is <= 0.15
  (FP8; observed 0.085-0.09) and <= 0.5 (NVFP4; observed 0.35): this random 2-layer model
  amplifies weight noise (per-element ~2% FP8, ~10% NVFP4); an unrelated model would be ~1.4.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.engine.attention import AttentionMetadata
from sous.models.loader import load_model
from sous.models.quant import DequantizedWeights, QuantConfig, detect_quant_config
from sous.models.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block
from sous.models.quant.nvfp4 import dequantize_nvfp4, pack_e2m1, quantize_nvfp4, unpack_e2m1
from tiny_models import make_tiny_llama

CPU = torch.device("cpu")
IDS = [1, 5, 17, 42, 99, 3, 250, 7, 600, 12, 13, 14]
NAMES = ("fp8-32", "fp8-128", "modelopt", "modelopt-hf-quant-config", "ct")


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    caches = model.kv_cache_spec().allocate(8, 16, CPU)
    n = len(ids)
    meta = AttentionMetadata.build([n], [n], [list(range((n + 15) // 16))], 16, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta.positions, caches, meta))


def _load(path: Path):
    return load_model(ModelConfig(model=str(path), dtype="float32"), LoadConfig(), CPU)


def _ref_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Reference FP8-block dequantisation, one tile at a time."""
    out = q.float().clone()
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            rows = slice(bi * block[0], (bi + 1) * block[0])
            cols = slice(bj * block[1], (bj + 1) * block[1])
            out[rows, cols] *= scale[bi, bj]
    return out


def _ref_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, mult: float = 1.0, div: float = 1.0
) -> torch.Tensor:
    """Reference NVFP4 dequantisation from the E2M1 bit fields (low nibble = even element):
    `value * block_scale * mult / div`."""
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.int64)
    codes[:, 0::2] = (packed & 15).long()
    codes[:, 1::2] = (packed >> 4).long()
    e, m = (codes >> 1) & 3, (codes & 1).float()
    mag = torch.where(e == 0, 0.5 * m, 2.0 ** (e - 1).float() * (1 + 0.5 * m))
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * scale.float().repeat_interleave(16, dim=1) * mult / div


def _assert_within_bound(w: torch.Tensor, dq: torch.Tensor, s: torch.Tensor, fp8: bool) -> None:
    """The module docstring's per-element bound; `s` is the per-element effective scale."""
    if fp8:
        bound = torch.maximum(w.abs() * 2**-4, s * 2**-10)
    else:
        x = w.abs() / s
        bound = torch.where(x <= 2, 0.25, torch.where(x <= 4, 0.5, 1.0)) * s
    assert ((w - dq).abs() <= bound * (1 + 1e-6)).all()
    assert (w - dq).abs().max() > 0


def _quant_config(name: str) -> dict:
    if name.startswith("fp8"):
        b = int(name.split("-")[1])
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [b, b],
                "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}
    if name.startswith("modelopt"):
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "ignore": ["lm_head", "model.layers.1.mlp.down_proj"]}
    group = {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
             "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                         "group_size": 16, "symmetric": True, "dynamic": False}}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*1\\.mlp\\.down"]}


def _quantize_tensors(name: str, sd: dict, qc: QuantConfig) -> tuple[dict, dict, dict]:
    """-> (scale/side tensors, quantised weights, reference dequantised full state dict)."""
    side, qweights, ref = {}, {}, dict(sd)
    for key, w in sd.items():
        module = key.removesuffix(".weight")
        if not (key.endswith("proj.weight") or key == "lm_head.weight") or qc.is_ignored(module):
            continue
        if name.startswith("fp8"):
            q, s = quantize_fp8_block(w, qc.weight_block_size)
            qweights[key], side[f"{module}.weight_scale_inv"] = q, s
            ref[key] = _ref_fp8(q, s, qc.weight_block_size)
            _assert_within_bound(w, ref[key], _ref_fp8(torch.ones_like(w), s, qc.weight_block_size),
                                 fp8=True)
            continue
        packed, scale, g = quantize_nvfp4(w)
        ref[key] = _ref_nvfp4(packed, scale, mult=float(g))
        side[f"{module}.weight_scale"] = scale
        if name == "ct":
            qweights[f"{module}.weight_packed"] = packed
            side[f"{module}.weight_global_scale"] = (1.0 / g).reshape(1)
            ref[key] = _ref_nvfp4(packed, scale, div=float(1.0 / g))
            side[f"{module}.input_global_scale"] = torch.tensor([3.0])
        else:
            qweights[key] = packed
            side[f"{module}.weight_scale_2"] = g
            side[f"{module}.input_scale"] = torch.tensor(0.5)
        _assert_within_bound(w, ref[key], scale.float().repeat_interleave(16, 1) * g, fp8=False)
    return side, qweights, ref


def _write_quantized(src: Path, dst: Path, name: str) -> dict[str, torch.Tensor]:
    """Copy `src` to `dst` with its linears quantised as `name`; scales go to the first shard
    and quantised weights to the second. Returns the reference dequantised state dict."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    cfg = json.loads((src / "config.json").read_text())
    qcfg = _quant_config(name)
    if name == "modelopt-hf-quant-config":
        side_cfg = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": qcfg["ignore"]}
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": side_cfg}))
    else:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    qc = detect_quant_config(dst, cfg)
    assert qc is not None
    sd = load_file(src / "model.safetensors")
    side, qweights, ref = _quantize_tensors(name, sd, qc)
    stored = {k.rsplit(".", 1)[0] for k in qweights}
    dense = {k: v for k, v in sd.items() if k.removesuffix(".weight") not in stored}
    if name.startswith("modelopt"):
        side["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.25)
        side["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(0.5)
    elif name == "ct":
        side["model.layers.1.self_attn.k_scale"] = torch.tensor([0.125])
        side["model.layers.1.self_attn.v_scale"] = torch.tensor([2.0])
    shards = {"model-00001-of-00002.safetensors": {**side, **dense},
              "model-00002-of-00002.safetensors": qweights}
    for fname, tensors in shards.items():
        save_file(tensors, str(dst / fname))
    weight_map = {k: f for f, t in shards.items() for k in t}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("q"), hidden_size=96, intermediate_size=208)


@pytest.fixture(scope="module")
def original_logits(tiny: Path) -> torch.Tensor:
    return _logits(_load(tiny).model, IDS)


def test_e2m1_nibble_order_and_values():
    packed = torch.tensor([[0x21, 0xF8, 0x7B]], dtype=torch.uint8)
    codes = unpack_e2m1(packed)
    assert codes.tolist() == [[1, 2, 8, 15, 11, 7]]
    assert torch.equal(pack_e2m1(codes), packed)
    w = dequantize_nvfp4(packed, torch.full((1, 1), 2.0).to(torch.float8_e4m3fn), 0.5,
                         torch.float32, group_size=6)
    assert w.tolist() == [[0.5, 1.0, -0.0, -6.0, -1.5, 6.0]]


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (16, 64)])
def test_fp8_block_error_bound(block):
    torch.manual_seed(0)
    w = torch.randn(200, 150) * torch.logspace(-3, 0, 150)
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-200 // block[0]), -(-150 // block[1]))
    dq = dequantize_fp8_block(q, s, block, torch.float32)
    assert torch.equal(dq, _ref_fp8(q, s, block))
    _assert_within_bound(w, dq, _ref_fp8(torch.ones(200, 150), s, block), fp8=True)


def test_fp8_block_grid_round_trip_bit_exact():
    torch.manual_seed(1)
    block, shape = (32, 32), (70, 45)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x10  # no NaN
    raw[::32, ::32] = 0x7E  # 448 in every (partial) tile: its amax fixes the scale
    q = raw.view(torch.float8_e4m3fn)
    scale = 2.0 ** torch.randint(-14, -4, (3, 2)).float()
    w = _ref_fp8(q, scale, block)
    q2, s2 = quantize_fp8_block(w, block)
    assert torch.equal(q2.view(torch.uint8), raw) and torch.equal(s2, scale)
    assert torch.equal(dequantize_fp8_block(q2, s2, block, torch.float32), w)


def test_nvfp4_error_bound():
    torch.manual_seed(2)
    w = torch.randn(40, 64) * torch.logspace(-2, 0, 64)
    packed, scale, g = quantize_nvfp4(w)
    assert packed.shape == (40, 32) and scale.dtype == torch.float8_e4m3fn
    dq = dequantize_nvfp4(packed, scale, g, torch.float32)
    assert torch.equal(dq, _ref_nvfp4(packed, scale, mult=float(g)))
    _assert_within_bound(w, dq, scale.float().repeat_interleave(16, dim=1) * g, fp8=False)


def test_nvfp4_grid_round_trip_bit_exact_both_conventions():
    torch.manual_seed(3)
    codes = torch.randint(0, 16, (24, 48), dtype=torch.uint8)
    codes[:, ::16] = torch.tensor([7, 15], dtype=torch.uint8).repeat(12).view(24, 1)  # +-6
    scale = torch.randint(0x08, 0x7F, (24, 3), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale[0, 0] = 448.0
    mult = 2.0**-10
    w = _ref_nvfp4(pack_e2m1(codes), scale, mult=mult)
    packed, s2, g = quantize_nvfp4(w)
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8)) and float(g) == mult
    assert torch.equal(dequantize_nvfp4(packed, s2, g, torch.float32), w)
    stream = [("m.weight_scale", s2), ("m.weight_global_scale", torch.tensor([1 / mult])),
              ("m.weight_packed", packed)]
    ct = dict(DequantizedWeights(stream, QuantConfig("compressed-tensors-nvfp4"), torch.float32))
    assert torch.equal(ct["m.weight"], w)


@pytest.mark.parametrize("name", NAMES)
def test_quantized_checkpoint_logits(tmp_path, tiny, original_logits, name, caplog):
    qdir, ddir = tmp_path / "quant", tmp_path / "dense"
    ref = _write_quantized(tiny, qdir, name)
    shutil.copytree(tiny, ddir)
    save_file(ref, str(ddir / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="sous.models.loader"):
        loaded = _load(qdir)
    method = {"fp8-32": "fp8", "fp8-128": "fp8", "ct": "compressed-tensors-nvfp4"}.get(
        name, "modelopt-nvfp4")
    assert loaded.quantization == method
    n_quant = 14 if name.startswith("fp8") else 13  # 2x7 projections - 1 ignored (+ lm_head)
    assert f"Loaded a {method} checkpoint: {n_quant} weights dequantised" in caplog.text
    logits = _logits(loaded.model, IDS)
    assert torch.equal(logits, _logits(_load(ddir).model, IDS))
    err = (logits - original_logits).norm() / original_logits.norm()
    assert 0 < err <= (0.15 if name.startswith("fp8") else 0.5)
    expected_kv = {
        "modelopt": {"model.layers.0.self_attn.k_scale": 0.25,
                     "model.layers.0.self_attn.v_scale": 0.5},
        "ct": {"model.layers.1.self_attn.k_scale": 0.125,
               "model.layers.1.self_attn.v_scale": 2.0},
    }
    assert loaded.kv_scales == expected_kv.get(name.removesuffix("-hf-quant-config"), {})


def test_llm_greedy_fp8_equals_dense_reference(tmp_path, tiny):
    from sous import LLM, SamplingParams

    ref = _write_quantized(tiny, tmp_path / "quant", "fp8-128")
    shutil.copytree(tiny, tmp_path / "dense")
    save_file(ref, str(tmp_path / "dense" / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = []
    for d in ("quant", "dense"):
        llm = LLM(str(tmp_path / d), dtype="float32", max_model_len=128,
                  kv_cache_memory_bytes=8 << 20)
        out.append(llm.generate([IDS], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert out[0] == out[1] and len(out[0]) == 12


def test_wrapper_buffers_only_until_group_complete():
    pulled: list[str] = []
    q, s = quantize_fp8_block(torch.randn(8, 8), (4, 4))
    source = [("a.weight_scale_inv", s), ("norm.weight", torch.ones(8)), ("a.weight", q),
              ("b.weight", q), ("attn.k_proj.k_scale", torch.tensor(0.5)),
              ("attn.kv_scale", torch.tensor([2.0])), ("b.weight_scale_inv", s),
              ("b.input_scale", torch.tensor(1.0))]

    def stream():
        for item in source:
            pulled.append(item[0])
            yield item

    deq = DequantizedWeights(stream(), QuantConfig("fp8", weight_block_size=(4, 4)), torch.bfloat16)
    out = [(name, len(pulled), t) for name, t in deq]
    assert [(n, p) for n, p, _ in out] == [("norm.weight", 2), ("a.weight", 3), ("b.weight", 7)]
    assert out[0][2] is source[1][1]
    assert out[1][2].dtype == torch.bfloat16
    assert torch.equal(out[1][2], dequantize_fp8_block(q, s, (4, 4), torch.bfloat16))
    assert deq.kv_scales == {"attn.k_scale": 2.0, "attn.v_scale": 2.0}
    assert deq.num_dequantized == 2


def test_wrapper_errors():
    q, s = quantize_fp8_block(torch.randn(8, 8), (4, 4))
    cfg = QuantConfig("fp8", weight_block_size=(4, 4), ignore=("lm_head",))
    with pytest.raises(ValueError, match=r"lack tensors.*a: has \['weight'\]"):
        list(DequantizedWeights([("a.weight", q)], cfg, torch.float32))
    with pytest.raises(ValueError, match="lm_head.*ignore list"):
        list(DequantizedWeights([("lm_head.weight", q)], cfg, torch.float32))
    with pytest.raises(ValueError, match=r"cannot dequantise a \(fp8\).*expected \[2, 2\]"):
        list(DequantizedWeights([("a.weight", q), ("a.weight_scale_inv", s[:1])], cfg,
                                torch.float32))


@pytest.mark.parametrize(
    ("qcfg", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "'W4A8_AWQ'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
    ],
)
def test_unsupported_quantization_fails_at_load(tmp_path, tiny, qcfg, named):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported quantization") as e:
        _load(d)
    msg = str(e.value)
    assert named in msg
    assert all(m in msg for m in ("fp8", "modelopt (quant_algo NVFP4", "MIXED_PRECISION",
                                  "nvfp4-pack-quantized"))
