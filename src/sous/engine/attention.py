"""Paged attention over the block KV cache: per-step metadata and the attention op.

The metadata is built once per engine step on the host (numpy) and copied to the device in a
handful of transfers; every layer then reuses it, so the layers never sync with the host.

Two implementations (`AttentionMetadata.backend`, chosen per step by `attention_backend`):

* `"cpp"` (the default on CPU): the `sous_ops` C++ extension (`engine/ops/`) reads K/V straight
  from the paged cache through the block table -- no gather, no per-layer copies -- and computes
  every sequence of the step (decodes, prefill chunks, prefix-cache hits, chunked-prefill
  continuations; causal over cached context + new tokens) in ONE call per layer;
* `"torch"` (any device; CPU when the extension cannot be built, with one warning): decode
  blocks are gathered into a padded batch for one `scaled_dot_product_attention`, every other
  sequence gets its own SDPA call over its gathered context (`engine/ops/torch_attention.py`).

The environment variable `SOUS_ATTENTION` picks one: `auto` (default: `cpp` on CPU when the
extension loads, else `torch`), `cpp` (CPU steps must use the extension; an error if it cannot
be built) or `torch`. Both give the same results up to float rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

ATTENTION_ENV = "SOUS_ATTENTION"
FP8_DTYPES = (torch.float8_e4m3fn,)
_FP8_MAX = 448.0


def attention_backend(device: torch.device) -> str:
    """`"cpp"` or `"torch"` for a step on `device`, per `SOUS_ATTENTION` (module docstring)."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "cpp", "torch"):
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: expected auto, cpp or torch")
    if choice == "torch" or torch.device(device).type != "cpu":
        return "torch"
    from sous.engine.ops.build import load

    if load() is not None:
        return "cpp"
    if choice == "cpp":
        raise RuntimeError(f"{ATTENTION_ENV}=cpp but the sous_ops C++ extension cannot be built")
    return "torch"


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
    block_ids: torch.Tensor | None = None
    """torch backend: blocks holding the sequence (device, int64)."""
    mask: torch.Tensor | None = None
    """torch backend: bool `[query_len, seq_len]` causal mask shifted by context_len (None when
    context_len == 0: plain causal)."""


@dataclass
class SeqGroup:
    """Some of the step's sequences in the form the C++ kernels take (int32 device tensors)."""

    rows: list[int]
    """Batch rows of the sequences."""
    q_start: torch.Tensor
    """[n]: first query row of each sequence in the query tensor given to the kernel."""
    q_len: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    """[n, max_blocks]: the sequences' block tables."""
    num_tokens: int
    max_seq_len: int
    token_slice: tuple[int, int] | None = None
    """When the group's tokens are contiguous in the batch: their [start, end)."""
    token_idx: torch.Tensor | None = None
    """int64 [num_tokens]: batch rows of the group's tokens (when not contiguous)."""
    kv_start: torch.Tensor | None = None
    """[n, 1]: first row of each sequence in a flat per-group K/V (prefill group only)."""
    kv_slots: torch.Tensor | None = None
    """int64 [sum seq_lens]: cache slots of positions 0 .. seq_len-1 of each sequence, in order
    (prefill group only; empty for the decode group)."""


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers (read-only for them)."""

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
    backend: str = "torch"
    """`"cpp"` or `"torch"` (see module docstring)."""
    kv_hooks: Any = None
    """A KV connector's worker side (`sous.engine.runner.KVLayerHooks`) or None: attention
    calls `wait_for_layer_load(kv_cache)` before a layer reads its cache and
    `save_kv_layer(kv_cache)` once it has written the step's new rows."""
    query_lens: torch.Tensor | None = None
    """int32 [B]."""
    q_starts: torch.Tensor | None = None
    """int32 [B]: `query_start_loc[:-1]`."""
    token_seqs: torch.Tensor | None = None
    """int32 [T]: batch row of each token's sequence."""
    positions_i32: torch.Tensor | None = None
    """int32 [T]: `positions` as int32."""
    max_seq_len: int = 0
    decode_rows: list[int] = field(default_factory=list)
    """Batch rows of the decode sequences (query_len == 1)."""
    decode_token_slice: tuple[int, int] | None = None
    """When the decode tokens are contiguous in the batch: their [start, end)."""
    decode_token_idx: torch.Tensor | None = None
    """int64 [Bd] token indices of the decode sequences (when not contiguous)."""
    prefills: list[PrefillSeq] = field(default_factory=list)
    # -- torch backend only --
    decode_block_ids: torch.Tensor | None = None
    """int64 [Bd * nblk]: block ids of the decode sequences, row-major, padded with 0."""
    decode_num_blocks: int = 0
    decode_mask: torch.Tensor | None = None
    """bool [Bd, 1, 1, nblk * block_size]: True where a key position is inside the sequence."""
    _host: dict[str, Any] = field(default_factory=dict, repr=False)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    def decode_additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """torch backend: the decode mask as 0 / -inf in `dtype` (built once, then cached)."""
        m = self._cache.get(("mask", dtype))
        if m is None:
            assert self.decode_mask is not None
            m = torch.zeros(self.decode_mask.shape, dtype=dtype, device=self.decode_mask.device)
            m.masked_fill_(~self.decode_mask, float("-inf"))
            self._cache[("mask", dtype)] = m
        return m

    def decode_group(self) -> SeqGroup:
        """The decode sequences; `q_start` counts rows of a compacted `[Bd, ...]` query."""
        if "decode" not in self._cache:
            self._cache["decode"] = self._group(self.decode_rows, compact=True)
        return self._cache["decode"]

    def prefill_group(self) -> SeqGroup:
        """The non-decode sequences; `q_start` counts rows of the whole batch; with the flat
        K/V layout (`kv_start`, `kv_slots`) used by MLA's up-projected prefill."""
        if "prefill" not in self._cache:
            self._cache["prefill"] = self._group([p.index for p in self.prefills], compact=False)
        return self._cache["prefill"]

    def _group(self, rows: list[int], compact: bool) -> SeqGroup:
        h = self._host
        r = np.asarray(rows, dtype=np.int64)
        ql, sl, qsl, bt = h["ql"][r], h["sl"][r], h["qsl"][r], h["bt"][r]
        nblk = int(((sl + self.block_size - 1) // self.block_size).max()) if len(r) else 1
        q_start = np.cumsum(ql) - ql if compact else qsl
        kv_start = np.cumsum(sl) - sl
        i32 = [q_start, ql, sl, bt[:, :nblk].reshape(-1), kv_start]
        v32 = _to_device(i32, np.int32, self.positions.device)
        tok = np.concatenate([np.arange(a, a + n) for a, n in zip(qsl, ql, strict=True)]
                             + [np.zeros(0, np.int64)])
        slots = np.zeros(0, np.int64)
        if not compact:  # the flat layout's gather index
            pos = np.concatenate([np.arange(n) for n in sl] + [slots])
            seq = np.repeat(np.arange(len(r)), sl)
            slots = bt[seq, pos // self.block_size] * self.block_size + pos % self.block_size
        contiguous = len(tok) > 0 and int(tok[-1] - tok[0]) == len(tok) - 1
        v64 = _to_device([slots] + ([] if contiguous else [tok]), np.int64,
                         self.positions.device)
        return SeqGroup(
            rows=list(rows), q_start=v32[0], q_len=v32[1], seq_lens=v32[2],
            block_tables=v32[3].view(len(r), nblk), num_tokens=len(tok),
            max_seq_len=int(sl.max()) if len(r) else 0,
            token_slice=(int(tok[0]), int(tok[-1]) + 1) if contiguous else None,
            token_idx=None if contiguous else v64[1],
            kv_start=v32[4].view(-1, 1), kv_slots=v64[0],
        )

    @classmethod
    def build(
        cls,
        query_lens: list[int] | np.ndarray,
        seq_lens: list[int] | np.ndarray,
        block_tables: list[list[int]] | np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for a step. Sequence i holds `seq_lens[i]` tokens after this step, of which the
        last `query_lens[i]` are computed now; `block_tables[i]` lists its blocks in order (a
        2-D array: one padded row per sequence, each holding at least the blocks it needs)."""
        ql, sl, bt, need = _host_arrays(query_lens, seq_lens, block_tables, block_size)
        num_seqs = len(ql)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(ql, out=qsl[1:])
        num_tokens = int(qsl[-1])
        ctx = sl - ql
        seq_of_tok = np.repeat(np.arange(num_seqs), ql)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - ctx, ql)
        slots = bt[seq_of_tok, positions // block_size] * block_size + positions % block_size
        decode_rows = np.nonzero(ql == 1)[0]
        dec_tok = qsl[decode_rows]
        contiguous = len(decode_rows) > 0 and int(dec_tok[-1] - dec_tok[0]) == len(dec_tok) - 1
        # Two host arrays (int64, int32) -> two device copies for all common index data.
        v64 = _to_device([positions, slots, qsl[1:] - 1] + ([] if contiguous else [dec_tok]),
                         np.int64, device)
        v32 = _to_device([qsl, sl, bt.reshape(-1), ql, seq_of_tok, positions], np.int32, device)
        meta = cls(
            num_tokens=num_tokens,
            query_start_loc=v32[0],
            seq_lens=v32[1],
            query_lens_list=ql.tolist(),
            seq_lens_list=sl.tolist(),
            block_tables=v32[2].view(num_seqs, bt.shape[1]),
            slot_mapping=v64[1],
            positions=v64[0],
            logits_indices=v64[2],
            block_size=block_size,
            backend=attention_backend(device),
            query_lens=v32[3],
            q_starts=v32[0][:-1],
            token_seqs=v32[4],
            positions_i32=v32[5],
            max_seq_len=int(sl.max()) if num_seqs else 0,
            decode_rows=decode_rows.tolist(),
            _host={"ql": ql, "sl": sl, "qsl": qsl, "bt": bt},
        )
        if len(decode_rows):
            if contiguous:
                meta.decode_token_slice = (int(dec_tok[0]), int(dec_tok[0]) + len(dec_tok))
            else:
                meta.decode_token_idx = v64[3]
        meta.prefills = [
            PrefillSeq(i, int(qsl[i]), int(qsl[i + 1]), int(ctx[i]), int(sl[i]))
            for i in np.nonzero(ql != 1)[0].tolist()
        ]
        if meta.backend == "torch":
            from sous.engine.ops.torch_attention import add_torch_metadata

            add_torch_metadata(meta, bt, need, device)
        return meta


def _host_arrays(query_lens: list[int] | np.ndarray, seq_lens: list[int] | np.ndarray,
                 block_tables: list[list[int]] | np.ndarray, block_size: int,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validated int64 query lengths, sequence lengths, the block table padded with 0, and the
    blocks each sequence needs."""
    num_seqs = len(query_lens)
    if not (len(seq_lens) == len(block_tables) == num_seqs):
        raise ValueError("query_lens, seq_lens and block_tables must have the same length")
    ql = np.asarray(query_lens, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    if num_seqs and (ql.min() < 1 or (sl < ql).any()):
        raise ValueError("every sequence needs 1 <= query_len <= seq_len")
    need = (sl + block_size - 1) // block_size
    if isinstance(block_tables, np.ndarray):
        bt = block_tables.astype(np.int64, copy=False).reshape(num_seqs, -1)
        lens = np.full(num_seqs, bt.shape[1])
        if bt.shape[1] == 0:
            bt = np.zeros((num_seqs, 1), dtype=np.int64)
    else:
        lens = np.asarray([len(b) for b in block_tables], dtype=np.int64)
        bt = np.zeros((num_seqs, max(int(lens.max(initial=0)), 1)), dtype=np.int64)
        for i, b in enumerate(block_tables):
            bt[i, : len(b)] = b
    if num_seqs and (need > lens).any():
        raise ValueError("a block table is too short for its sequence length")
    return ql, sl, bt, need


def _to_device(parts: list[np.ndarray], dtype: Any, device: torch.device) -> list[torch.Tensor]:
    """`parts` concatenated as `dtype`, copied to `device` in one transfer, split back."""
    packed = torch.from_numpy(np.concatenate([np.asarray(p, dtype=dtype) for p in parts]))
    return list(torch.split(packed.to(device), [len(p) for p in parts]))


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new keys/values `[T, Hkv, D]` into `kv_cache` `[2, nb, bs, Hkv, D]` at the slots.
    An fp8 cache stores `k / k_scale` and `v / v_scale` (computed in float32), saturated to the
    e4m3 range."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    kv = torch.stack((k, v))
    if kv_cache.dtype in FP8_DTYPES:
        kv = kv.float()
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
    """Gathered cache contents `[2, ...]` -> `dtype`, with an fp8 cache's scales applied (only an
    fp8 cache is stored scaled)."""
    if kv.dtype == dtype:
        return kv
    out = kv.to(dtype)
    if kv.dtype in FP8_DTYPES:
        if k_scale != 1.0:
            out[0] *= k_scale
        if v_scale != 1.0:
            out[1] *= v_scale
    return out


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
    hooks = meta.kv_hooks
    if hooks is not None:
        hooks.wait_for_layer_load(kv_cache)
    if meta.backend == "cpp":
        out = _cpu_ops().gqa_attention(q, k, v, kv_cache, meta, scale, k_scale, v_scale)
    else:
        write_kv(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        from sous.engine.ops.torch_attention import gqa_attention as torch_gqa

        out = torch_gqa(q, k, v, kv_cache, meta, scale, (k_scale, v_scale))
    if hooks is not None:
        hooks.save_kv_layer(kv_cache)
    return out


def _cpu_ops() -> Any:
    """`sous.engine.ops.cpu_attention` (imported on first use: it imports this module)."""
    from sous.engine.ops import cpu_attention

    return cpu_attention
