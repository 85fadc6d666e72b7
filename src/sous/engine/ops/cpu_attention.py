"""Python side of the `sous_ops` C++ kernels (CPU only): tensor plumbing, no math.

The kernels read K/V rows in place, given a base tensor and its (block, token, head) strides in
elements, so one entry point serves the GQA cache `[2, nb, bs, Hkv, D]`, MLA's latent cache
`[nb, bs, entry]` (one shared KV head whose values are the first `kv_lora_rank` columns of the
keys) and flat per-step K/V `[S, H, D]` (each sequence one "block" starting at its row).
Queries and outputs are float32 (other dtypes are converted around the call).
"""

from __future__ import annotations

from types import ModuleType

import torch

from sous.engine.attention import AttentionMetadata, SeqGroup
from sous.engine.ops.build import load

FLAT_BLOCK = 1 << 30
"""Block size that makes a flat K/V one block per sequence (block id = its first row)."""


def _ops() -> ModuleType:
    mod = load()
    if mod is None:  # the metadata chose "cpp" only after a successful load
        raise RuntimeError("sous_ops C++ extension is not available")
    return mod


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    x = x if x.dtype == torch.float32 else x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """`paged_attention` in one C++ call: store the new k/v `[T, Hkv, D]` into the cache
    `[2, nb, bs, Hkv, D]` at `meta.slot_mapping` (fp8: divided by the scales, saturated), then
    attend every sequence of the step: q `[T, Hq, D]` -> `[T, Hq, D]` in q's dtype."""
    assert meta.query_lens is not None and meta.q_starts is not None
    return _ops().gqa_attention(
        q, k, v, kv_cache, meta.slot_mapping, meta.q_starts, meta.query_lens, meta.seq_lens,
        meta.block_tables, meta.block_size, scale, k_scale, v_scale)


def latent_attention(q: torch.Tensor, cache: torch.Tensor, v_dim: int, group: SeqGroup,
                     block_size: int, scale: float, k_scale: float = 1.0,
                     indices: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed form: q `[n, H, Dk]` (rows `group.q_start`) attends the first `Dk` columns
    of the latent cache rows `[nb, bs, entry]` of its sequence; values are their first `v_dim`
    columns. `indices` `[n, topk]` int32 (-1 = none) restricts each row to those positions.
    Returns float32 `[n, H, v_dim]`."""
    q32 = _as_f32(q)
    out = torch.empty((q.shape[0], q.shape[1], v_dim), dtype=torch.float32, device=q.device)
    strides = [cache.stride(0), cache.stride(1), 0]
    _ops().paged_attention(
        out, q32, cache, cache, strides, strides, cache.shape[0], group.q_start, group.q_len,
        group.seq_lens, group.block_tables, block_size, 1, scale, k_scale, k_scale, indices)
    return out


def flat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: SeqGroup,
                   scale: float, out: torch.Tensor,
                   indices: torch.Tensor | None = None) -> None:
    """Causal attention of the group's query rows of q `[T, H, Dk]` over flat K/V `[S, H, Dk]`
    / `[S, H, Dv]` (sequence i at rows `kv_start[i]` .. + seq_len; any row strides), written into
    the same rows of `out` `[T, H, Dv]` (float32). `indices` as in `latent_attention`, by q row."""
    assert group.kv_start is not None and out.dtype == torch.float32
    _ops().paged_attention(
        out, _as_f32(q), k, v, [k.stride(0), k.stride(0), k.stride(1)],
        [v.stride(0), v.stride(0), v.stride(1)], k.shape[0], group.q_start, group.q_len,
        group.seq_lens, group.kv_start, FLAT_BLOCK, k.shape[1], scale, 1.0, 1.0, indices)


def index_scores(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, offset: int,
                 meta: AttentionMetadata, rows: slice, width: int,
                 scale: float) -> torch.Tensor:
    """Indexer scores of the step's tokens `rows` (a slice of the batch) over their sequences'
    keys (columns `offset:` of the cache rows): float32 `[len(rows), width]`, -inf past each
    token's position (see csrc/index_scores.cpp)."""
    assert meta.token_seqs is not None and meta.positions_i32 is not None
    n = rows.stop - rows.start
    out = torch.empty((n, width), dtype=torch.float32, device=q.device)
    tokens = torch.arange(rows.start, rows.stop, dtype=torch.int32, device=q.device)
    keys = cache[..., offset:]
    _ops().index_scores(
        out, _as_f32(q), _as_f32(w), keys, [cache.stride(0), cache.stride(1), 0],
        cache.shape[0], tokens, meta.token_seqs[rows], meta.positions_i32[rows],
        meta.block_tables, meta.block_size, scale)
    return out
