"""Paged attention (C++ kernels and the torch path) against a straightforward reference: one
`scaled_dot_product_attention` per sequence over K/V gathered slot by slot."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sous.engine.attention import ATTENTION_ENV, AttentionMetadata, paged_attention
from sous.engine.ops.build import load

CPU = torch.device("cpu")
BACKENDS = ["cpp", "torch"]


def _backend(monkeypatch, backend: str) -> None:
    if backend == "cpp" and load() is None:
        pytest.fail("the sous_ops extension does not build on this machine")
    monkeypatch.setenv(ATTENTION_ENV, backend)


def _tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int) -> list[list[int]]:
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range((s + block_size - 1) // block_size)] for s in seq_lens]


def _cache_rows(cache: torch.Tensor, slots: list[int], scale: float) -> torch.Tensor:
    """float32 rows of a `[nb, bs, ...]` cache at the given slots, fp8 scale applied."""
    flat = cache.reshape(-1, *cache.shape[2:])
    rows = flat[torch.tensor(slots)].float()
    return rows * scale if cache.dtype == torch.float8_e4m3fn else rows


def reference(q, kv_cache, qlens, slens, tables, bs, scale, k_scale=1.0, v_scale=1.0):
    """Per sequence: gather K/V of positions 0..seq_len-1, causal SDPA shifted by the context."""
    outs, start = [], 0
    for ql, sl, table in zip(qlens, slens, tables, strict=True):
        slots = [table[p // bs] * bs + p % bs for p in range(sl)]
        k = _cache_rows(kv_cache[0], slots, k_scale).transpose(0, 1)
        v = _cache_rows(kv_cache[1], slots, v_scale).transpose(0, 1)
        qs = q[start : start + ql].float().transpose(0, 1)
        mask = torch.arange(sl)[None, :] <= torch.arange(sl - ql, sl)[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=qs.shape[0] != k.shape[0])
        outs.append(o.transpose(0, 1))
        start += ql
    return torch.cat(outs)


def run_case(qlens, slens, *, bs=16, group=3, hkv=3, d=64, cache_dtype=torch.float32,
             k_scale=1.0, v_scale=1.0, seed=0, q_dtype=torch.float32):
    """Write the step's K/V after random cached context, attend, compare with `reference`."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((s + bs - 1) // bs for s in slens) + 3
    tables = _tables(slens, bs, num_blocks, seed)
    kv = torch.randn((2, num_blocks, bs, hkv, d), generator=g)
    if cache_dtype == torch.float8_e4m3fn:
        kv = (kv * 3).clamp(-448, 448)
    kv_cache = kv.to(cache_dtype)
    t = sum(qlens)
    # q as a strided view of a fused projection, as the models pass it
    qkv = torch.randn((t, hkv * group + 2 * hkv, d), generator=g).to(q_dtype)
    q = qkv[:, : hkv * group]
    k = torch.randn((t, hkv, d), generator=g).to(q_dtype)
    v = torch.randn((t, hkv, d), generator=g).to(q_dtype)
    meta = AttentionMetadata.build(qlens, slens, tables, bs, CPU)
    scale = d**-0.5
    out = paged_attention(q, k, v, kv_cache, meta, scale, k_scale, v_scale)
    ref = reference(q, kv_cache, qlens, slens, tables, bs, scale, k_scale, v_scale)
    return meta, out, ref


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    err = (out.float() - ref).abs().max().item()
    assert err <= rel * max(ref.abs().max().item(), 1.0), err


MIXED = ([1, 7, 1, 33, 1, 5, 70], [9, 7, 130, 33, 1, 60, 200])
"""decode, fresh prefill, decode, fresh prefill, first-token decode, prefix hit, long chunk."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [1, 4, 16, 64])
@pytest.mark.parametrize("group,d", [(1, 64), (3, 64), (8, 128), (3, 128)])
def test_mixed_batch_matches_reference(monkeypatch, backend, bs, group, d):
    _backend(monkeypatch, backend)
    meta, out, ref = run_case(*MIXED, bs=bs, group=group, hkv=2, d=d, seed=bs + group)
    assert meta.backend == backend
    assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [1, 16])
def test_decode_only(monkeypatch, backend, bs):
    _backend(monkeypatch, backend)
    slens = [1, 2, 15, 16, 17, 200, 333, 64]
    _, out, ref = run_case([1] * len(slens), slens, bs=bs, seed=3)
    assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_only_and_prefix_hits(monkeypatch, backend):
    _backend(monkeypatch, backend)
    _, out, ref = run_case([300, 17, 64], [300, 17, 64], seed=4)
    assert_close(out, ref)
    _, out, ref = run_case([100, 3, 64], [260, 19, 64 + 64], bs=16, seed=5)
    assert_close(out, ref)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_cpp_rows_do_not_depend_on_the_step_shape(monkeypatch, group):
    """A query row gets bit-identical output whether its sequence is prefilled in one step, in
    chunks, one token at a time, or next to other sequences (batch invariance: greedy output
    must not change with chunked prefill or after preemption)."""
    _backend(monkeypatch, "cpp")
    g = torch.Generator().manual_seed(7)
    bs, hkv, d, n = 16, 2, 64, 150
    q = torch.randn((n, hkv * group, d), generator=g)
    k, v = torch.randn((n, hkv, d), generator=g), torch.randn((n, hkv, d), generator=g)
    table = list(range((n + bs - 1) // bs))

    def run(cuts: list[int], neighbour: bool) -> torch.Tensor:
        kv_cache = torch.zeros((2, len(table) + 20, bs, hkv, d))
        outs = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            qlens, slens, tables = [b - a], [b], [table]
            qs, ks, vs = q[a:b], k[a:b], v[a:b]
            if neighbour:  # another sequence (a 5-token prefill) in the same step
                qlens, slens, tables = [5, *qlens], [5, *slens], [[len(table)], table]
                qs, ks, vs = (torch.cat([x[:5] * 0.5, x[a:b]]) for x in (q, k, v))
            meta = AttentionMetadata.build(qlens, slens, tables, bs, CPU)
            out = paged_attention(qs, ks, vs, kv_cache, meta, d**-0.5)
            outs.append(out[-(b - a):])
        return torch.cat(outs)

    whole = run([0, n], False)
    assert torch.equal(run([0, 5, 64, 65, 129, n], False), whole)
    assert torch.equal(run(list(range(n + 1)), False), whole)
    assert torch.equal(run([0, 70, 71, n], True), whole)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [4, 16])
def test_fp8_cache_with_scales(monkeypatch, backend, bs):
    _backend(monkeypatch, backend)
    _, out, ref = run_case(*MIXED, bs=bs, group=3, hkv=2, d=64, cache_dtype=torch.float8_e4m3fn,
                           k_scale=0.37, v_scale=1.9, seed=6)
    assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_cache(monkeypatch, backend, q_dtype):
    """Only an fp8 cache is stored scaled: a bf16 cache ignores the (checkpoint) scales."""
    _backend(monkeypatch, backend)
    _, out, ref = run_case(*MIXED, cache_dtype=torch.bfloat16, q_dtype=q_dtype, seed=7,
                           k_scale=0.5, v_scale=2.0)
    assert out.dtype == q_dtype
    assert_close(out, ref, rel=1e-2)


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float8_e4m3fn, torch.float32),
                                                 (torch.bfloat16, torch.float32),
                                                 (torch.float8_e4m3fn, torch.bfloat16)])
def test_cpp_cache_write_equals_torch(monkeypatch, cache_dtype, q_dtype):
    """The C++ path stores new K/V byte for byte like `write_kv` (scale, saturation, rounding)."""
    qlens, slens = MIXED
    caches = {}
    for backend in BACKENDS:
        _backend(monkeypatch, backend)
        g = torch.Generator().manual_seed(8)
        num_blocks = sum((s + 15) // 16 for s in slens) + 3
        tables = _tables(slens, 16, num_blocks, 8)
        cache = torch.zeros((2, num_blocks, 16, 2, 64), dtype=cache_dtype)
        t = sum(qlens)
        q = torch.randn((t, 6, 64), generator=g).to(q_dtype)
        k = (torch.randn((t, 2, 64), generator=g) * 300).to(q_dtype)
        v = (torch.randn((t, 2, 64), generator=g) * 300).to(q_dtype)
        meta = AttentionMetadata.build(qlens, slens, tables, 16, CPU)
        paged_attention(q, k, v, cache, meta, 0.125, 0.5, 1.7)
        caches[backend] = cache.view(torch.uint8)
    assert torch.equal(caches["cpp"], caches["torch"])


FALLBACK_PROBE = """
import torch
from sous.engine.attention import AttentionMetadata
for _ in range(3):
    print(AttentionMetadata.build([1], [1], [[0]], 16, torch.device("cpu")).backend)
"""


@pytest.mark.parametrize("choice", ["auto", "cpp"])
def test_unbuildable_extension_falls_back_with_one_warning(tmp_path, choice):
    """No working compiler: `auto` uses the torch path after one warning; `cpp` is an error."""
    env = {**os.environ, "CXX": "false", "SOUS_OPS_BUILD_DIR": str(tmp_path),
           ATTENTION_ENV: choice}
    r = subprocess.run([sys.executable, "-W", "always", "-c", FALLBACK_PROBE], env=env,
                       capture_output=True, text=True, timeout=300)
    if choice == "auto":
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["torch"] * 3
        assert r.stderr.count("C++ attention ops unavailable") == 1, r.stderr
    else:
        assert r.returncode != 0
        assert f"{ATTENTION_ENV}=cpp" in r.stderr


def test_a_killed_build_leaves_nothing_to_wait_for(tmp_path):
    """cpp_extension's `lock` file, left by a build that was killed, blocked every later start
    forever (a CI run hung in `make setup`); now the next build removes it and goes on."""
    (tmp_path / "lock").touch()
    env = {**os.environ, "CXX": "false", "SOUS_OPS_BUILD_DIR": str(tmp_path), ATTENTION_ENV: "auto"}
    r = subprocess.run([sys.executable, "-c", FALLBACK_PROBE], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["torch"] * 3
    assert not (tmp_path / "lock").exists()


def test_a_finished_build_loads_without_the_compiler():
    """The build `make setup` made is imported directly: no compiler, ninja or lock."""
    from sous.engine.ops.build import build_dir

    if load() is None:
        pytest.skip("no C++ ops build on this machine")
    env = {**os.environ, "CXX": "false", "PATH": "/nonexistent", ATTENTION_ENV: "cpp",
           "SOUS_OPS_BUILD_DIR": str(build_dir())}
    r = subprocess.run([sys.executable, "-c", FALLBACK_PROBE], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpp"] * 3


def test_unknown_backend_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match=ATTENTION_ENV):
        AttentionMetadata.build([1], [1], [[0]], 16, CPU)


# -- MLA: latent (absorbed) attention, flat up-projected prefill, indexer scores -----------------

LAT_SEQS = ([1, 1, 1, 1], [1, 17, 40, 75])


def _latent_cache(bs: int, seq_lens: list[int], entry: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((s + bs - 1) // bs for s in seq_lens) + 2
    cache = (torch.randn((num_blocks, bs, entry), generator=g) * 2).to(dtype)
    return cache, _tables(seq_lens, bs, num_blocks, seed), g


def _random_indices(pos: list[int], topk: int, g: torch.Generator) -> torch.Tensor:
    """int32 [len(pos), topk]: a random subset of 0..pos[i] per row, padded with -1."""
    rows = []
    for p in pos:
        chosen = torch.randperm(p + 1, generator=g)[:topk].tolist()
        rows.append(chosen + [-1] * (topk - len(chosen)))
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("bs,use_index", [(1, False), (16, False), (4, True), (64, True)])
def test_latent_attention_matches_reference(monkeypatch, cache_dtype, bs, use_index):
    """MLA decode: heads attend `[c_kv | k_pe]` rows in place (values = c_kv), optionally only
    at the indexer's positions; fp8 rows are scaled by k_scale."""
    from sous.engine.ops.cpu_attention import latent_attention

    _backend(monkeypatch, "cpp")
    qlens, slens = LAT_SEQS
    kv_lora, rope, heads, k_scale = 48, 16, 5, 0.7 if cache_dtype != torch.float32 else 1.0
    cache, tables, g = _latent_cache(bs, slens, kv_lora + rope + 8, cache_dtype, bs)
    meta = AttentionMetadata.build(qlens, slens, tables, bs, CPU)
    q = torch.randn((4, heads, kv_lora + rope), generator=g)
    idx = _random_indices([s - 1 for s in slens], 20, g) if use_index else None
    out = latent_attention(q, cache, kv_lora, meta.decode_group(), bs, 0.3, k_scale, idx)
    for i, (sl, table) in enumerate(zip(slens, tables, strict=True)):
        pos = list(range(sl)) if idx is None else [p for p in idx[i].tolist() if p >= 0]
        rows = _cache_rows(cache, [table[p // bs] * bs + p % bs for p in pos], k_scale)
        p = torch.softmax(q[i] @ rows[:, : kv_lora + rope].T * 0.3, dim=-1)
        assert_close(out[i], p @ rows[:, :kv_lora])


@pytest.mark.parametrize("use_index", [False, True])
def test_flat_attention_matches_reference(monkeypatch, use_index):
    """MLA prefill: the prefill group's rows of q attend causally over flat per-sequence K/V
    (a decode row in between is left alone)."""
    from sous.engine.ops.cpu_attention import flat_attention

    _backend(monkeypatch, "cpp")
    qlens, slens = [5, 9, 1, 12], [5, 20, 7, 12]
    meta = AttentionMetadata.build(qlens, slens, _tables(slens, 4, 20, 0), 4, CPU)
    group = meta.prefill_group()
    g = torch.Generator().manual_seed(1)
    s_total, heads = 5 + 20 + 12, 3
    k = torch.randn((s_total, heads, 24), generator=g)
    kv = torch.randn((s_total, heads, 40), generator=g)
    v = kv[..., 24:]  # strided, like kv_b_proj's output
    q = torch.randn((sum(qlens), heads, 24), generator=g)
    pos = meta.positions.tolist()
    idx = _random_indices(pos, 6, g) if use_index else None
    out = torch.full((sum(qlens), heads, 16), float("nan"))
    flat_attention(q, k, v, group, 0.25, out, idx)
    assert out[14].isnan().all()  # the decode row
    kv_start = dict(zip([0, 1, 3], [0, 5, 25], strict=True))
    for t in [*range(14), *range(15, 27)]:
        seq = meta.token_seqs[t].item()
        keys = list(range(pos[t] + 1)) if idx is None else [p for p in idx[t].tolist() if p >= 0]
        rows = [kv_start[seq] + p for p in keys]
        p = torch.softmax(torch.einsum("hd,khd->hk", q[t], k[rows]) * 0.25, dim=-1)
        assert_close(out[t], torch.einsum("hk,khd->hd", p, v[rows]))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_index_scores_match_reference(monkeypatch, cache_dtype):
    """score[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . key[j]) for j <= pos[t], else -inf;
    keys read unscaled from the columns after `offset`."""
    from sous.engine.ops.cpu_attention import index_scores

    _backend(monkeypatch, "cpp")
    qlens, slens = [1, 6, 1], [70, 6, 33]
    offset, dim, heads, bs = 20, 32, 4, 16
    cache, tables, g = _latent_cache(bs, slens, offset + dim, cache_dtype, 2)
    meta = AttentionMetadata.build(qlens, slens, tables, bs, CPU)
    q = torch.randn((8, heads, dim), generator=g)
    w = torch.randn((8, heads), generator=g)
    out = index_scores(q, w, cache, offset, meta, slice(0, 8), 70, 0.2)
    pos, seqs = meta.positions.tolist(), meta.token_seqs.tolist()
    for t in range(8):
        table = tables[seqs[t]]
        keys = _cache_rows(cache, [table[p // bs] * bs + p % bs for p in range(pos[t] + 1)], 1.0)
        ref = (w[t, :, None] * torch.relu(q[t] @ keys[:, offset:].T * 0.2)).sum(0)
        assert_close(out[t, : pos[t] + 1], ref)
        assert (out[t, pos[t] + 1 :] == float("-inf")).all()
