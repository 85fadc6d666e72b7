"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, A.X-K2).

For each query at position p the indexer scores every position j <= p:

    score[j] = sum_h w[h] * relu(q[h] . k[j] * index_head_dim ** -0.5),
    w = weights_proj(x) * index_n_heads ** -0.5   (float32)

with `q = wq_b(q_resid)` (`[index_n_heads, index_head_dim]`, `q_resid` = MLA's normalised query
latent), `k = LayerNorm(wk(x))` (one head) and RoPE (rotate-half layout) on the first
`qk_rope_head_dim` dims of both. The query then attends only its top `min(index_topk, p + 1)`
positions -- transformers' `DeepseekV32Indexer` + mask, in prefill, chunked prefill and decode
alike. When a sequence's whole context fits in `index_topk` the selection is all of it and is
skipped. Keys are cached per token in the tail of the layer's MLA cache row.

With the C++ backend the scores of every token of the step are computed by one kernel that
reads the keys in place through the block table (in bounded row chunks), and the selection is
handed to MLA as top-k position lists (`IndexSelection.indices`) instead of masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sous.engine.attention import AttentionMetadata, PrefillSeq
from sous.models.layers.mla import RopeTables, _Unloaded, gather_rows, write_rows
from sous.models.layers.rotary import apply_rotary

_QUERY_CHUNK = 256
"""Query rows scored at once in prefill (bounds the `[rows, heads, context]` score tensor)."""
_SCORE_ELEMENTS = 1 << 24
"""C++ backend: most score elements (`rows x context`) held at once."""


@dataclass
class IndexSelection:
    """Which positions each query may attend (True = selected and causal), or None where the
    whole causal context is selected."""

    decode: torch.Tensor | None = None
    """bool `[Bd, nblk * block_size]` over the decode rows' gathered (padded) context."""
    prefill: list[torch.Tensor | None] = field(default_factory=list)
    """Per `meta.prefills` entry: bool `[query_len, seq_len]`."""
    indices: torch.Tensor | None = None
    """C++ backend: int32 `[T, min(topk, max_seq_len)]`, the positions each token of the step
    attends (-1 = none), or None when every token attends its whole causal context."""


class Indexer(nn.Module):
    """Scores and selects positions (see module docstring). Linears `wq_b`, `wk`,
    `weights_proj` are set by the model's loader; `k_norm_weight` / `k_norm_bias` are the
    key LayerNorm's. `offset` is where the key starts in a cache row."""

    def __init__(self, cfg: Any, dtype: torch.dtype, offset: int):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.offset = offset
        self.scale = self.head_dim**-0.5
        self.wq_b: nn.Module = _Unloaded()
        self.wk: nn.Module = _Unloaded()
        self.weights_proj: nn.Module = _Unloaded()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)

    def _rope(self, x: torch.Tensor, rt: RopeTables) -> torch.Tensor:
        """Rotate the first `rope` dims of `x` `[T, H, D]` (rotate-half layout)."""
        rot = apply_rotary(x[..., : self.rope], rt.cos.to(x.dtype), rt.sin.to(x.dtype))
        return torch.cat([rot, x[..., self.rope :]], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rt: RopeTables,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> IndexSelection:
        """Write the new tokens' keys into `kv_cache` at `slot_mapping`; return the selection
        for every decode row and prefill sequence of the step."""
        t = x.shape[0]
        k = self.k_norm.forward(self.wk.forward(x))
        k = self._rope(k.unsqueeze(1), rt)[:, 0]
        write_rows(kv_cache, meta.slot_mapping, k, self.offset)
        sel = IndexSelection()
        if meta.backend == "cpp":
            if meta.max_seq_len > self.topk:
                q = self._rope(self.wq_b.forward(q_resid).view(t, self.n_heads, self.head_dim), rt)
                w = self.weights_proj.forward(x.float()) * self.n_heads**-0.5
                sel.indices = self._select_cpp(q, w, kv_cache, meta)
            return sel
        need_dec = bool(meta.decode_rows) and meta.decode_num_blocks * meta.block_size > self.topk
        need_pre = [p.seq_len > self.topk for p in meta.prefills]
        if not need_dec and not any(need_pre):
            sel.prefill = [None] * len(meta.prefills)
            return sel
        q = self._rope(self.wq_b.forward(q_resid).view(t, self.n_heads, self.head_dim), rt)
        w = self.weights_proj.forward(x.float()) * self.n_heads**-0.5
        if need_dec:
            sel.decode = self._select_decode(q, w, kv_cache, meta)
        for p, need in zip(meta.prefills, need_pre, strict=True):
            sel.prefill.append(self._select_prefill(q, w, k, kv_cache, p) if need else None)
        return sel

    def _scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q `[B, H, D]`, w `[B, H]`, keys `[B, L, D]` (or `[L, D]`) -> float32 `[B, L]`."""
        if keys.dim() == 2:
            s = torch.einsum("bhd,ld->bhl", q.float(), keys.float())
        else:
            s = torch.bmm(q.float(), keys.float().transpose(1, 2))
        s = F.relu(s * self.scale)
        return torch.bmm(w.float().unsqueeze(1), s).squeeze(1)

    def _top(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """bool `allowed & (in the top min(topk, L) of scores where allowed)`."""
        scores = scores.masked_fill(~allowed, float("-inf"))
        idx = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(allowed).scatter_(-1, idx, True)
        return chosen & allowed

    def _select_decode(self, q: torch.Tensor, w: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        assert meta.decode_block_ids is not None and meta.decode_mask is not None
        if meta.decode_token_slice is not None:
            a, b = meta.decode_token_slice
            qd, wd = q[a:b], w[a:b]
        else:
            assert meta.decode_token_idx is not None
            qd, wd = q.index_select(0, meta.decode_token_idx), w.index_select(0, meta.decode_token_idx)
        bd = qd.shape[0]
        keys = gather_rows(kv_cache, meta.decode_block_ids).view(bd, -1, kv_cache.shape[-1])
        allowed = meta.decode_mask.view(bd, -1)
        return self._top(self._scores(qd, wd, keys[..., self.offset :]), allowed)

    def _select_prefill(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                        kv_cache: torch.Tensor, p: PrefillSeq) -> torch.Tensor:
        if p.context_len == 0 and kv_cache.dtype == k.dtype:
            keys = k[p.start : p.end]
        else:
            assert p.block_ids is not None
            keys = gather_rows(kv_cache, p.block_ids)[: p.seq_len, self.offset :]
        if p.mask is not None:
            causal = p.mask
        else:
            n = p.end - p.start
            causal = torch.ones((n, n), dtype=torch.bool, device=q.device).tril_()
        out = torch.empty_like(causal)
        for a in range(0, p.end - p.start, _QUERY_CHUNK):
            b = min(a + _QUERY_CHUNK, p.end - p.start)
            scores = self._scores(q[p.start + a : p.start + b], w[p.start + a : p.start + b], keys)
            out[a:b] = self._top(scores, causal[a:b])
        return out

    def _select_cpp(self, q: torch.Tensor, w: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """Top-k positions of every token (see `IndexSelection.indices`), scored in place."""
        from sous.engine.ops.cpu_attention import index_scores

        t, width = meta.num_tokens, meta.max_seq_len
        k = min(self.topk, width)
        out = torch.empty((t, k), dtype=torch.int32, device=q.device)
        step = max(1, _SCORE_ELEMENTS // width)
        for a in range(0, t, step):
            b = min(t, a + step)
            scores = index_scores(q, w, kv_cache, self.offset, meta, slice(a, b), width,
                                  self.scale)
            vals, top = scores.topk(k, dim=-1)
            out[a:b] = top.masked_fill_(vals == float("-inf"), -1)
        return out
