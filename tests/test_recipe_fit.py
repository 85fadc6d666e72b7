"""The memory fit: the published KV figures, weights per rank, verdicts, largest length."""

from __future__ import annotations

import dataclasses

import pytest

from sous.recipes.archs import ARCHS, find_arch
from sous.recipes.catalog import load_recipe
from sous.recipes.check import CheckOverrides, check_model, check_plan
from sous.recipes.compose import compose
from sous.recipes.fit import (
    DEVICES,
    GIB,
    FitInputs,
    fit,
    kv_bytes_per_token,
    weight_bytes_per_rank,
)

AXK2 = ARCHS["skt/A.X-K2"]
MINIMAX = ARCHS["MiniMaxAI/MiniMax-M2.7"]


def test_axk2_kv_per_rank_reproduces_the_published_figures():
    assert kv_bytes_per_token(AXK2) == 61 * 1408 == 85_888
    r = fit(FitInputs(arch=AXK2, block_size=2048, max_model_len=262144))
    assert r.blocks_per_seq == 128
    assert r.kv_bytes == (262144 // 2048 + 1) * 2048 * 61 * 1408 == 22_690_922_496
    assert f"{r.kv_bytes / GIB:.1f}" == "21.1"
    r = fit(FitInputs(arch=AXK2, block_size=2048, max_model_len=163840))
    assert r.kv_bytes == 14_247_788_544 and f"{r.kv_bytes / GIB:.1f}" == "13.3"


def test_mla_cache_is_not_sharded_by_tp():
    assert kv_bytes_per_token(AXK2, tp=8) == kv_bytes_per_token(AXK2)
    assert kv_bytes_per_token(AXK2, pp=2) == 31 * 1408


def test_minimax_kv_bytes_per_token():
    assert kv_bytes_per_token(MINIMAX, "fp8") == 62 * 8 * 128 * 2 * 1 == 126_976
    assert kv_bytes_per_token(MINIMAX, "auto") == 253_952
    assert kv_bytes_per_token(MINIMAX, "fp8", tp=4) == 126_976 // 4  # 2 kv heads per rank
    assert kv_bytes_per_token(MINIMAX, "fp8", tp=16) == 126_976 // 8  # at least one head
    assert kv_bytes_per_token(MINIMAX, "fp8", pp=4) == 16 * 8 * 128 * 2


def test_param_counts_match_the_published_sizes():
    assert 685e9 < AXK2.params.total < 695e9  # "688B"
    assert 225e9 < MINIMAX.params.total < 232e9  # "230B"
    # A.X-K2 NVFP4 (experts e2m1 + scales, other linears fp8) is published as 398 GB
    assert weight_bytes_per_rank(AXK2, "NVFP4") == pytest.approx(398e9, rel=0.01)
    # the FP8 checkpoint is ~656 GiB
    assert weight_bytes_per_rank(AXK2, "FP8") / GIB == pytest.approx(656, rel=0.03)


def test_weights_shard_by_layout():
    full = weight_bytes_per_rank(MINIMAX, "FP8")
    dp4 = weight_bytes_per_rank(MINIMAX, "FP8", dp=4)
    pp4 = weight_bytes_per_rank(MINIMAX, "FP8", pp=4)
    assert dp4 < full / 3.5 and pp4 < full / 3.5
    assert weight_bytes_per_rank(MINIMAX, "BF16") > 1.9 * full


def test_verdicts_and_largest_length():
    base = FitInputs(arch=AXK2, block_size=2048, max_model_len=163840, tensor_parallel_size=16)
    r = fit(base)
    # RBLN-CR13: the single-head MLA cache is kept on all 4 chiplets
    assert r.replication == 4 and r.verdict == "fits"
    assert r.budget_bytes == int(140 * GIB * 0.9)
    assert r.max_model_len_that_fits >= 163840 and r.max_model_len_that_fits % 2048 == 0
    longest = fit(dataclasses.replace(base, max_model_len=r.max_model_len_that_fits))
    assert longest.fits
    assert not fit(dataclasses.replace(base, max_model_len=r.max_model_len_that_fits + 1)).fits
    # 262144 needs weights <= ~39.5 GiB per card: not at TP16
    assert not fit(dataclasses.replace(base, max_model_len=262144)).fits
    # TP1 cannot hold 688B parameters at all
    r = fit(dataclasses.replace(base, tensor_parallel_size=1))
    assert r.verdict == "does not fit" and r.max_model_len_that_fits == 0


def test_partial_when_not_every_sequence_fits():
    r = fit(FitInputs(arch=MINIMAX, block_size=4096, max_model_len=204800, max_num_seqs=4,
                      kv_cache_dtype="fp8", data_parallel_size=4))
    assert r.verdict == "partial" and 1 <= r.full_length_seqs_that_fit < 4


def test_device_memory_and_utilization():
    inp = FitInputs(arch=MINIMAX, block_size=4096, max_model_len=204800,
                    kv_cache_dtype="fp8", data_parallel_size=4)
    small = dataclasses.replace(inp, device=dataclasses.replace(DEVICES["RBLN-CR13"],
                                                                memory_bytes=64 * GIB))
    assert fit(inp).fits and not fit(small).fits
    assert fit(dataclasses.replace(inp, gpu_memory_utilization=0.5)).budget_bytes == 70 * GIB


def test_lookahead_adds_a_block_at_a_block_multiple():
    inp = FitInputs(arch=AXK2, block_size=2048, max_model_len=262144)
    assert fit(dataclasses.replace(inp, lookahead_tokens=3)).blocks_per_seq == 129


def test_find_arch():
    assert find_arch("skt/A.X-K2") == (AXK2, None)
    assert find_arch("a.x-k2") == (AXK2, None)
    assert find_arch("nvidia/MiniMax-M2.7-NVFP4") == (MINIMAX, "NVFP4")
    assert find_arch("meta/llama") is None


def test_check_plan_reads_the_recipe_flags():
    lr = load_recipe("minimax-m2.7")
    plan = compose(lr.recipe, "prefill-decode-disaggregated", "Latency", recommended=True)
    rows = check_plan(plan)
    assert [row.labels for row in rows] == [("prefill rank 0",), ("decode ranks 0-3",)]
    prefill, decode = rows
    assert prefill.report.inputs.pipeline_parallel_size == 4
    assert prefill.report.inputs.gpu_memory_utilization == 0.8  # from the lmcache=rds delta
    assert prefill.report.inputs.lookahead_tokens == 3  # eagle3 num_speculative_tokens
    assert decode.report.inputs.data_parallel_size == 4
    assert decode.report.kv_bytes_per_token == 126_976
    assert decode.report.inputs.max_num_seqs == 1 and decode.report.inputs.block_size == 4096
    assert prefill.report.inputs.max_num_seqs == 4
    over = check_plan(plan, CheckOverrides(max_num_seqs=2, device_memory_gib=96))
    assert over[1].report.inputs.max_num_seqs == 2
    assert over[1].report.inputs.device.memory_bytes == 96 * GIB


def test_check_plan_reads_the_axk2_flags():
    """A.X-K2's P/D recommended selection: the NVFP4 checkpoint suffix gives the weight format,
    no --kv-cache-dtype means the model's bf16 cache, the MLA cache is 61 x 1408 B per token
    (8 layers per stage under PP8)."""
    lr = load_recipe("ax-k2")
    plan = compose(lr.recipe, "prefill-decode-disaggregated", recommended=True)
    prefill, decode = check_plan(plan)
    assert prefill.labels == ("prefill rank 0",) and decode.labels == ("decode ranks 0-7",)
    for row in (prefill, decode):
        inp = row.report.inputs
        assert inp.arch is AXK2 and inp.weight_format == "NVFP4"
        assert inp.kv_cache_dtype == "auto" and inp.block_size == 2048
        assert inp.max_model_len == 262144 and inp.lookahead_tokens == 3
        assert row.report.replication == 4
    assert prefill.report.inputs.pipeline_parallel_size == 8
    assert prefill.report.inputs.gpu_memory_utilization == 0.85  # the lmcache=rds delta
    assert prefill.report.inputs.max_num_seqs == 8
    assert prefill.report.kv_bytes_per_token == 8 * 1408
    assert decode.report.inputs.data_parallel_size == 8
    assert decode.report.inputs.max_num_seqs == 1
    assert decode.report.kv_bytes_per_token == 85_888
    assert decode.report.blocks_per_seq == 129  # 262144 + 3 speculative tokens


def test_check_model_without_recipe():
    row = check_model("skt/A.X-K2", CheckOverrides(block_size=2048, max_model_len=262144))
    assert row.report.kv_bytes == 22_690_922_496
    with pytest.raises(ValueError, match="give --max-model-len"):
        check_model("skt/A.X-K2", CheckOverrides(block_size=2048))
    with pytest.raises(ValueError, match="known"):
        check_model("org/unknown", CheckOverrides())
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        check_model("skt/A.X-K2", CheckOverrides(max_model_len=1024, kv_cache_dtype="int3"))
