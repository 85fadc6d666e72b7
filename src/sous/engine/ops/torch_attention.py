"""The pure-torch attention path (`SOUS_ATTENTION=torch`; any device): gather + SDPA.

* decodes (query_len == 1): their blocks are gathered (one `index_select`) into a padded
  `[B, L, Hkv, D]` batch and attended with one `scaled_dot_product_attention` under a length
  mask; GQA folds the query heads of one KV head into the query axis, so K/V are not repeated;
* everything else (prefill chunks, chunked prefill continuations, prefix-cache hits, speculative
  verification): one `scaled_dot_product_attention` per sequence, causal with the mask shifted
  by the number of tokens already in the cache.

`add_torch_metadata` adds the device tensors this path needs to a step's `AttentionMetadata`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sous.engine.attention import FP8_DTYPES, AttentionMetadata, PrefillSeq, read_kv


def add_torch_metadata(meta: AttentionMetadata, bt: np.ndarray, need: np.ndarray,
                       device: torch.device) -> None:
    """Fill `decode_block_ids` / `decode_num_blocks` / `decode_mask` and each prefill's
    `block_ids` (all of them: a lossy cache is always read back) and `mask` (those with context)
    (`bt`: the padded host block table, `need`: blocks per sequence)."""
    rows = np.asarray(meta.decode_rows, dtype=np.int64)
    parts: list[np.ndarray] = []
    nd = len(rows)
    if nd:
        meta.decode_num_blocks = int(need[rows].max())
        parts += [bt[rows, : meta.decode_num_blocks].reshape(-1), meta._host["sl"][rows]]
    parts += [bt[p.index, : need[p.index]] for p in meta.prefills]
    if not parts:
        return
    views = torch.split(torch.from_numpy(np.concatenate(parts)).to(device),
                        [len(p) for p in parts])
    k = 0
    if nd:
        meta.decode_block_ids, lens = views[0], views[1]
        k = 2
        ar = torch.arange(meta.decode_num_blocks * meta.block_size, device=device)
        meta.decode_mask = (ar[None, :] < lens[:, None]).view(nd, 1, 1, -1)
    for p in meta.prefills:
        p.block_ids = views[k]
        k += 1
        if p.context_len == 0:
            continue
        q_pos = torch.arange(p.context_len, p.seq_len, device=device)
        p.mask = torch.arange(p.seq_len, device=device)[None, :] <= q_pos[:, None]


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`[2, len(block_ids) * bs, Hkv, D]`: the cache contents of the given blocks, in order."""
    _, nb, bs, h, d = kv_cache.shape
    if kv_cache.dtype in FP8_DTYPES:
        return _gather(kv_cache.view(torch.uint8), block_ids).view(kv_cache.dtype)
    flat = kv_cache.view(2, nb, bs * h * d)
    n = block_ids.shape[0]
    if n < 16:
        return flat.index_select(1, block_ids).view(2, -1, h, d)
    # Row gathers along dim 0 of contiguous 2-D tensors take torch's memcpy path: ~1.7x faster
    # than one index_select along dim 1 for decode batches.
    out = torch.empty((2, n, bs * h * d), dtype=kv_cache.dtype, device=kv_cache.device)
    torch.index_select(flat[0], 0, block_ids, out=out[0])
    torch.index_select(flat[1], 0, block_ids, out=out[1])
    return out.view(2, -1, h, d)


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q `[Bd, Hq, D]` -> `[Bd, Hq, D]` over each decode sequence's cached context."""
    bd, hq, d = q.shape
    assert meta.decode_block_ids is not None
    hkv = kv_cache.shape[-2]
    kv = read_kv(_gather(kv_cache, meta.decode_block_ids), q.dtype, *kv_scales)
    kv = kv.view(2, bd, -1, hkv, d)
    # The query heads sharing a KV head become that head's "query length": no K/V repeat.
    out = F.scaled_dot_product_attention(
        q.view(bd, hkv, hq // hkv, d),
        kv[0].transpose(1, 2),
        kv[1].transpose(1, 2),
        attn_mask=meta.decode_additive_mask(q.dtype),
        scale=scale,
    )
    return out.reshape(bd, hq, d)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    p: PrefillSeq,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One sequence's queries `[Lq, Hq, D]` over its context -> `[Lq, Hq, D]`. A fresh prefill
    uses the new K/V directly when the cache holds them losslessly (same dtype), else reads them
    back like cached context (so an fp8 cache gives the same result with or without a prefix
    hit, as the C++ path does)."""
    qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
    if p.context_len == 0 and kv_cache.dtype == q.dtype:
        ks = k[p.start : p.end]
        vs = v[p.start : p.end]
    else:
        assert p.block_ids is not None
        kv = read_kv(_gather(kv_cache, p.block_ids)[:, : p.seq_len], q.dtype, *kv_scales)
        ks, vs = kv[0], kv[1]
    ks = ks.transpose(0, 1).unsqueeze(0)
    vs = vs.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    if p.mask is None:
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=gqa
        )
    return out.squeeze(0).transpose(0, 1)


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """`paged_attention` after the cache write: q `[T, Hq, D]` -> `[T, Hq, D]`."""
    if not meta.prefills and meta.decode_token_slice == (0, meta.num_tokens):
        return _decode_attention(q, kv_cache, meta, scale, kv_scales)
    out = torch.empty_like(q)
    if meta.decode_rows:
        if meta.decode_token_slice is not None:
            a, b = meta.decode_token_slice
            out[a:b] = _decode_attention(q[a:b], kv_cache, meta, scale, kv_scales)
        else:
            idx = meta.decode_token_idx
            assert idx is not None
            dec = _decode_attention(q.index_select(0, idx), kv_cache, meta, scale, kv_scales)
            out.index_copy_(0, idx, dec)
    for p in meta.prefills:
        out[p.start : p.end] = _prefill_attention(q, k, v, kv_cache, p, scale, kv_scales)
    return out
