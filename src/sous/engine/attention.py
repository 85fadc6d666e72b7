"""Paged attention over the block KV cache: per-step metadata and the attention op.

The metadata is built once per engine step on the host (numpy) and copied to the device in a
handful of transfers; every layer then reuses it, so the layers never sync with the host.

Sequences are split into two groups:

* decodes (query_len == 1): their blocks are gathered (one `index_select`) into a padded
  `[B, L, Hkv, D]` batch and attended with one `scaled_dot_product_attention` under a length
  mask; GQA folds the query heads of one KV head into the query axis, so K/V are not repeated;
* everything else (prefill chunks, chunked prefill continuations, prefix-cache hits, speculative
  verification): one `scaled_dot_product_attention` per sequence, causal with the mask shifted
  by the number of tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """Per-step data of one sequence that computes more than one token (or has no decode form)."""

    index: int
    """Row of the sequence in the batch."""
    start: int
    """First token of the sequence in the flattened batch."""
    end: int
    """One past its last token."""
    context_len: int
    """Tokens already in the cache before this step."""
    seq_len: int
    """Tokens of context after this step (context_len + query_len)."""
    block_ids: torch.Tensor | None
    """Blocks holding the sequence (device, int64), or None when context_len == 0: the
    attention then reads the fresh K/V directly."""
    mask: torch.Tensor | None
    """Bool `[query_len, seq_len]` causal mask shifted by context_len (None when context_len
    == 0: plain causal)."""


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    num_tokens: int
    query_start_loc: torch.Tensor
    """int32 [B+1]: offsets of each sequence's tokens in the flattened batch."""
    seq_lens: torch.Tensor
    """int32 [B]: context length of each sequence after this step."""
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_tables: torch.Tensor
    """int32 [B, max_blocks], padded with 0."""
    slot_mapping: torch.Tensor
    """int64 [T]: cache slot of each new token."""
    positions: torch.Tensor
    """int64 [T]: position of each new token."""
    logits_indices: torch.Tensor
    """int64 [B]: index of each sequence's last scheduled token."""
    block_size: int
    # -- precomputed for the attention op --
    decode_rows: list[int] = field(default_factory=list)
    """Batch rows of the decode sequences (query_len == 1)."""
    decode_token_slice: tuple[int, int] | None = None
    """When the decode tokens are contiguous in the batch: their [start, end)."""
    decode_token_idx: torch.Tensor | None = None
    """int64 [Bd] token indices of the decode sequences (when not contiguous)."""
    decode_block_ids: torch.Tensor | None = None
    """int64 [Bd * nblk]: block ids of the decode sequences, row-major, padded with 0."""
    decode_num_blocks: int = 0
    decode_mask: torch.Tensor | None = None
    """bool [Bd, 1, 1, nblk * block_size]: True where a key position is inside the sequence."""
    prefills: list[PrefillSeq] = field(default_factory=list)
    _additive_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    def decode_additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The decode mask as 0 / -inf in `dtype` (built on first use, then cached)."""
        m = self._additive_masks.get(dtype)
        if m is None:
            assert self.decode_mask is not None
            m = torch.zeros(self.decode_mask.shape, dtype=dtype, device=self.decode_mask.device)
            m.masked_fill_(~self.decode_mask, float("-inf"))
            self._additive_masks[dtype] = m
        return m

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for a step. Sequence i holds `seq_lens[i]` tokens after this step, of which the
        last `query_lens[i]` are computed now; `block_tables[i]` lists its blocks in order."""
        num_seqs = len(query_lens)
        if not (len(seq_lens) == len(block_tables) == num_seqs):
            raise ValueError("query_lens, seq_lens and block_tables must have the same length")
        ql = np.asarray(query_lens, dtype=np.int64)
        sl = np.asarray(seq_lens, dtype=np.int64)
        if num_seqs and (ql.min() < 1 or (sl < ql).any()):
            raise ValueError("every sequence needs 1 <= query_len <= seq_len")
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(ql, out=qsl[1:])
        num_tokens = int(qsl[-1])
        ctx = sl - ql
        max_blocks = max((len(b) for b in block_tables), default=0)
        bt = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
        for i, b in enumerate(block_tables):
            bt[i, : len(b)] = b
        need = (sl + block_size - 1) // block_size
        if num_seqs and (need > np.asarray([len(b) for b in block_tables])).any():
            raise ValueError("a block table is too short for its sequence length")

        seq_of_tok = np.repeat(np.arange(num_seqs), ql)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - ctx, ql)
        slots = bt[seq_of_tok, positions // block_size] * block_size + positions % block_size

        decode = ql == 1
        decode_rows = np.nonzero(decode)[0]
        prefill_rows = np.nonzero(~decode)[0]
        nd = len(decode_rows)
        dec_nblk = int(need[decode_rows].max()) if nd else 0
        dec_tok = qsl[decode_rows]
        contiguous = nd > 0 and int(dec_tok[-1] - dec_tok[0]) == nd - 1
        # One int64 host array -> one device copy for all index data of the step.
        parts = [positions, slots, qsl[1:] - 1, qsl, sl, bt.reshape(-1)]
        if nd:
            parts += [bt[decode_rows, :dec_nblk].reshape(-1), sl[decode_rows]]
            if not contiguous:
                parts.append(dec_tok)
        for i in prefill_rows:
            if ctx[i] > 0:
                parts.append(bt[i, : need[i]])
        packed = torch.from_numpy(np.concatenate(parts)).to(device)
        sizes = [len(p) for p in parts]
        views = list(torch.split(packed, sizes))
        b = num_seqs
        meta = cls(
            num_tokens=num_tokens,
            query_start_loc=views[3].to(torch.int32),
            seq_lens=views[4].to(torch.int32),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_tables=views[5].to(torch.int32).view(b, bt.shape[1]),
            slot_mapping=views[1],
            positions=views[0],
            logits_indices=views[2],
            block_size=block_size,
            decode_rows=decode_rows.tolist(),
        )
        k = 6
        if nd:
            meta.decode_num_blocks = dec_nblk
            meta.decode_block_ids = views[k]
            lens = views[k + 1]
            k += 2
            if contiguous:
                meta.decode_token_slice = (int(dec_tok[0]), int(dec_tok[0]) + nd)
            else:
                meta.decode_token_idx = views[k]
                k += 1
            ar = torch.arange(dec_nblk * block_size, device=device)
            meta.decode_mask = (ar[None, :] < lens[:, None]).view(nd, 1, 1, -1)
        for i in prefill_rows.tolist():
            c, s = int(ctx[i]), int(sl[i])
            block_ids = mask = None
            if c > 0:
                block_ids = views[k]
                k += 1
                q_pos = torch.arange(c, s, device=device)
                mask = torch.arange(s, device=device)[None, :] <= q_pos[:, None]
            meta.prefills.append(PrefillSeq(i, int(qsl[i]), int(qsl[i + 1]), c, s, block_ids, mask))
        return meta


FP8_DTYPES = (torch.float8_e4m3fn,)
_FP8_MAX = 448.0


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new keys/values `[T, Hkv, D]` into `kv_cache` `[2, nb, bs, Hkv, D]` at the slots.
    An fp8 cache stores `k / k_scale` and `v / v_scale`, saturated to the e4m3 range."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    kv = torch.stack((k, v))
    if kv_cache.dtype in FP8_DTYPES:
        if k_scale != 1.0 or v_scale != 1.0:
            kv = kv / kv.new_tensor([k_scale, v_scale]).view(2, 1, 1, 1)
        kv = kv.clamp(-_FP8_MAX, _FP8_MAX).to(kv_cache.dtype)
        # index_copy_ has no float8 kernel on every device: move the bytes instead.
        flat.view(torch.uint8).index_copy_(1, slot_mapping, kv.view(torch.uint8))
        return
    if kv.dtype != kv_cache.dtype:
        kv = kv.to(kv_cache.dtype)
    flat.index_copy_(1, slot_mapping, kv)


def read_kv(kv: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """Gathered cache contents `[2, ...]` -> `dtype`, with an fp8 cache's scales applied."""
    if kv.dtype == dtype:
        return kv
    out = kv.to(dtype)
    if k_scale != 1.0:
        out[0] *= k_scale
    if v_scale != 1.0:
        out[1] *= v_scale
    return out


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
    """One sequence's queries `[Lq, Hq, D]` over its context -> `[Lq, Hq, D]`."""
    qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
    if p.block_ids is None:
        ks = k[p.start : p.end]
        vs = v[p.start : p.end]
    else:
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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention for a step's tokens over the paged cache.

    q `[T, Hq, D]`, k/v `[T, Hkv, D]` (new tokens only). Writes k/v into `kv_cache`
    (`[2, num_blocks, block_size, Hkv, D]`) at `meta.slot_mapping`, then attends each sequence's
    queries over its whole context (cached + new). Returns `[T, Hq, D]` in q's dtype.
    `k_scale`/`v_scale` are an fp8 cache's per-layer scales (stored value = k / k_scale).
    """
    write_kv(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
    kv_scales = (k_scale, v_scale)
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
