"""Memory fit per rank, before anything starts.

For one engine process: KV bytes per token (per rank), the KV cache for the configured
sequences, the weights per rank, the verdict and the largest `--max-model-len` that fits.

- KV per token per layer: GQA `kv_heads_per_rank x head_dim x 2 (K, V) x dtype bytes`
  (kv heads shard by TP, at least one per rank). MLA (A.X-K2) keeps one latent row
  (576 = kv_lora 512 + rope 64) that TP does not shard, plus the sparse-attention indexer
  key (128): in bf16 576x2 + 128x2 = 1408 B. Under an fp8 KV dtype an MLA model is counted
  as a 1-byte latent and a 1-byte indexer key with a 2-byte per-position scale (706 B) —
  inferred from vllm-rbln's fp8 indexer cache, not verified. A rank holds ceil(L / PP) layers.
- Blocks: each sequence takes ceil((max_model_len + lookahead) / block_size) blocks
  (lookahead = speculative tokens), plus one reserved null block per rank; so one A.X-K2
  sequence of 262144 tokens at block 2048 is (128 + 1) x 2048 x 61 x 1408 B = 21.1 GiB.
- Weights per rank: routed experts shard over TP x DP (expert parallel, or MoE tensor
  parallel across the DP group), other linears over TP, all layers split by PP; embedding
  and lm_head (bf16) are on the first/last PP stage. Linear bytes per parameter: FP8 1 B
  (+ fp32 scale per 128x128), BF16 2 B, NVFP4 experts 0.5625 B (e2m1 + e4m3 scale per 16)
  with FP8 other linears. Speculative draft weights are not counted.
- Device: usable = memory x `--gpu-memory-utilization` - runtime reserve - weights. On an
  RBLN-CR13 (140 GiB, 4 chiplets, 2 GiB runtime reserve, as vllm-rbln's
  `estimate_available_memory`) a cache with fewer kv heads per rank than chiplets is
  replicated `4 // kv_heads` times (MLA: 4x).

Public API: `DeviceSpec`, `DEVICES`, `FitInputs`, `FitReport`, `fit`, `kv_bytes_per_token`,
`weight_bytes_per_rank`, `GIB`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sous.recipes.archs import ModelArch

__all__ = [
    "DEVICES",
    "GIB",
    "DeviceSpec",
    "FitInputs",
    "FitReport",
    "dtype_bytes",
    "fit",
    "kv_bytes_per_token",
    "weight_bytes_per_rank",
]

GIB = 1 << 30
_FP8_SCALE = 1 + 4 / (128 * 128)
_LINEAR_BYTES = {"FP8": (_FP8_SCALE, _FP8_SCALE), "BF16": (2.0, 2.0),
                 "NVFP4": (0.5 + 1 / 16, _FP8_SCALE)}  # (routed experts, other linears)
WEIGHT_FORMATS = tuple(_LINEAR_BYTES)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the serving software sees it."""

    name: str
    memory_bytes: int
    chiplets: int = 1          # KV with fewer kv heads per rank than this is replicated
    reserve_bytes: int = 0     # runtime buffers taken before the KV cache


DEVICES: dict[str, DeviceSpec] = {
    "RBLN-CR13": DeviceSpec("RBLN-CR13", 140 * GIB, chiplets=4, reserve_bytes=2 * GIB),
}


def dtype_bytes(kv_cache_dtype: str) -> int | None:
    """Bytes per KV element for `--kv-cache-dtype` (None for `auto`: the model's bf16)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype.startswith("fp8"):
        return 1
    sizes = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
    if kv_cache_dtype not in sizes:
        raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r} "
                         f"(valid: auto, fp8, fp8_e4m3, fp8_e5m2, {', '.join(sizes)})")
    return sizes[kv_cache_dtype]


@dataclass(frozen=True)
class FitInputs:
    """The settings of one engine process that decide its memory."""

    arch: ModelArch
    block_size: int
    max_model_len: int
    max_num_seqs: int = 1
    kv_cache_dtype: str = "auto"
    weight_format: str = "FP8"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    lookahead_tokens: int = 0
    gpu_memory_utilization: float = 0.9
    device: DeviceSpec = DEVICES["RBLN-CR13"]


def kv_heads_per_rank(arch: ModelArch, tp: int) -> int:
    return 1 if arch.is_mla else max(1, arch.num_kv_heads // tp)


def kv_bytes_per_token(arch: ModelArch, kv_cache_dtype: str = "auto", tp: int = 1,
                       pp: int = 1) -> int:
    """KV bytes one token takes on one rank (all the layers that rank holds)."""
    size = dtype_bytes(kv_cache_dtype)
    if arch.is_mla:
        assert arch.mla_latent_dim is not None
        idx = arch.indexer_head_dim or 0
        if size is None or size >= 2:
            per_layer = (arch.mla_latent_dim + idx) * (size or 2)
        else:  # fp8 latent + fp8 indexer key with a 2-byte per-position scale [inferred]
            per_layer = arch.mla_latent_dim + (idx + 2 if idx else 0)
    else:
        per_layer = kv_heads_per_rank(arch, tp) * arch.head_dim * 2 * (size or 2)
    return math.ceil(arch.num_layers / pp) * per_layer


def weight_bytes_per_rank(arch: ModelArch, weight_format: str, tp: int = 1, pp: int = 1,
                          dp: int = 1) -> int:
    """Weight bytes on the most loaded rank (see the module docstring for the rules)."""
    if weight_format not in _LINEAR_BYTES:
        raise ValueError(f"unknown weight format {weight_format!r} "
                         f"(valid: {', '.join(WEIGHT_FORMATS)})")
    expert_b, linear_b = _LINEAR_BYTES[weight_format]
    p = arch.params
    layer_share = math.ceil(arch.num_layers / pp) / arch.num_layers
    layers = (p.routed_experts * expert_b / (tp * dp)
              + p.other_linear * linear_b / tp + p.layer_bf16 * 2) * layer_share
    heads = (p.embed + p.lm_head) if pp == 1 else max(p.embed, p.lm_head)
    return int(layers + heads * 2 / tp)


@dataclass(frozen=True)
class FitReport:
    """The fit of one engine process; every size is per rank, in bytes."""

    inputs: FitInputs
    kv_bytes_per_token: int
    blocks_per_seq: int
    kv_bytes_per_seq: int           # one full-length sequence, with the null block
    kv_bytes: int                   # max_num_seqs full-length sequences, with the null block
    replication: int                # device copies of the KV (chiplets)
    weight_bytes: int
    budget_bytes: int               # memory x utilization
    kv_room_bytes: int              # budget - reserve - weights
    full_length_seqs_that_fit: int
    max_model_len_that_fits: int    # for max_num_seqs sequences; 0 when none fits

    @property
    def fits(self) -> bool:
        return self.kv_room_bytes >= self.kv_bytes * self.replication

    @property
    def verdict(self) -> str:
        if self.fits:
            return "fits"
        if self.full_length_seqs_that_fit >= 1:
            return "partial"
        return "does not fit"


def _largest_len(room: int, per_block: int, seqs: int, block: int, lookahead: int) -> int:
    if per_block <= 0 or room < per_block:
        return 0
    blocks_per_seq = (room // per_block - 1) // seqs
    return max(0, blocks_per_seq * block - lookahead)


def fit(inp: FitInputs) -> FitReport:
    """The memory fit of one engine process on `inp.device`."""
    tp, pp, dp = inp.tensor_parallel_size, inp.pipeline_parallel_size, inp.data_parallel_size
    per_token = kv_bytes_per_token(inp.arch, inp.kv_cache_dtype, tp, pp)
    per_block = per_token * inp.block_size
    blocks_per_seq = math.ceil((inp.max_model_len + inp.lookahead_tokens) / inp.block_size)
    kv_seq = (blocks_per_seq + 1) * per_block
    kv_all = (inp.max_num_seqs * blocks_per_seq + 1) * per_block
    heads = kv_heads_per_rank(inp.arch, tp)
    replication = max(1, inp.device.chiplets // heads)
    weights = weight_bytes_per_rank(inp.arch, inp.weight_format, tp, pp, dp)
    budget = int(inp.device.memory_bytes * inp.gpu_memory_utilization)
    room = budget - inp.device.reserve_bytes - weights
    device_block = per_block * replication
    seqs_fit = max(0, (room // device_block - 1) // blocks_per_seq) if room > 0 else 0
    largest = _largest_len(room, device_block, inp.max_num_seqs, inp.block_size,
                           inp.lookahead_tokens)
    return FitReport(inputs=inp, kv_bytes_per_token=per_token, blocks_per_seq=blocks_per_seq,
                     kv_bytes_per_seq=kv_seq, kv_bytes=kv_all, replication=replication,
                     weight_bytes=weights, budget_bytes=budget, kv_room_bytes=room,
                     full_length_seqs_that_fit=seqs_fit, max_model_len_that_fits=largest)
