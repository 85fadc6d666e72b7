"""Multi-head latent attention (MLA, DeepSeek-V2/V3/V3.2, A.X-K2) on a latent-only paged cache.

Per token and layer the cache keeps one row: the normalised KV latent `c_kv` (`kv_lora_rank`),
the rotated shared key `k_pe` (`qk_rope_head_dim`) and, for V3.2-style sparse attention, the
indexer key (`index_head_dim`). Per-head keys and values exist only transiently:

* prefill / chunked prefill (query_len > 1): the sequence's latents are up-projected by
  `kv_b_proj` into per-head K/V and attended causally;
* decode (query_len == 1): the weight-absorbed form. `q_nope` is mapped into latent space by
  `W_UK`, every head attends the shared `[c_kv | k_pe]` rows directly (values = `c_kv`), and
  `W_UV` maps the latent output to `v_head_dim` per head. q.k and the output are the same as the
  up-projected form; nothing per-head is materialised over the context.

With the C++ backend (`meta.backend == "cpp"`, see `sous.engine.attention`) decodes read the
latent rows in place through the block table (one kernel call for all of them, also under the
V3.2 indexer's top-k selection), and all prefill sequences of a step share one latent gather
(their whole contexts, by slot), one `kv_b_proj` and one varlen kernel call. The torch backend
gathers each decode batch's blocks and runs one SDPA per prefill sequence (fresh latents when
there is no cached context).

RoPE: DeepSeek's rotary pairs are interleaved (`x[2i], x[2i+1]`; `rope_interleave`, always on
for V3.2 / A.X-K2) and rotated with one complex multiply; `rope_interleave: false` checkpoints
use the rotate-half layout. Cached `k_pe` is in the checkpoint's layout either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sous.engine.attention import AttentionMetadata, PrefillSeq, SeqGroup
from sous.engine.kv_cache.spec import _zeroed
from sous.models.layers.norm import RMSNorm
from sous.models.layers.rotary import apply_rotary, apply_rotary_interleaved, rope_parameters


@dataclass(frozen=True)
class MLAKVCacheSpec:
    """Latent KV layout: per layer one tensor `[num_blocks, block_size, entry_size]` with
    `entry_size = kv_lora_rank + qk_rope_head_dim + index_head_dim`; row = `[c_kv | k_pe |
    indexer key]` (the indexer part only when `index_head_dim` > 0). Slot `s` is block
    `s // block_size`, offset `s % block_size`. The runner owns the tensors; `MLAAttention` writes
    the rows of new tokens at `slot_mapping` and reads only the blocks of `block_tables`."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    dtype: torch.dtype

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def entry_size(self) -> int:
        return self.latent_size + self.index_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of the latent (and indexer key) of one token across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.entry_size * elem

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers."""
        return self.bytes_per_token * block_size

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[torch.Tensor]:
        shape = (num_blocks, block_size, self.entry_size)
        return [_zeroed(shape, self.dtype, device) for _ in range(self.num_layers)]

    @staticmethod
    def copy_slots(caches: list[torch.Tensor], src: int, dst: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` slots of block `src` into block `dst`, in every layer."""
        for cache in caches:
            cache[dst, :num_tokens] = cache[src, :num_tokens]


def mla_softmax_scale(hf_config: Any) -> float:
    """`qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2` for scaled RoPE (YaRN)
    when `mscale_all_dim` is set -- transformers' `yarn_apply_mscale`."""
    qk = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    scale = qk**-0.5
    params = rope_parameters(hf_config)
    if params.get("rope_type", "default") != "default":
        all_dim = params.get("mscale_all_dim", 0)
        factor = float(params.get("factor", 1.0))
        if all_dim and factor > 1:
            m = 0.1 * all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return scale


@dataclass
class RopeTables:
    """The step's rotary tables, looked up once per forward and shared by all layers."""

    freqs_cis: torch.Tensor
    """complex64 `[T, 1, rope/2]` for the interleaved layout."""
    cos: torch.Tensor
    """`[T, 1, rope/2]` in the activation dtype, for the rotate-half layout."""
    sin: torch.Tensor


_FP8_DTYPES = (torch.float8_e4m3fn,)
_FP8_MAX = 448.0


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, start: int,
               scale: float = 1.0) -> None:
    """Store `rows` `[T, W]` into columns `start : start + W` of the cache rows at `slots`.
    An fp8 cache (`--kv-cache-dtype fp8`) stores `rows / scale`, saturated to the e4m3 range."""
    flat = cache.view(-1, cache.shape[-1])
    end = start + rows.shape[-1]
    if cache.dtype in _FP8_DTYPES:
        if scale != 1.0:
            rows = rows / scale
        q = rows.clamp(-_FP8_MAX, _FP8_MAX).to(cache.dtype)
        # index_copy_ has no float8 kernel on every device: move the bytes instead.
        flat.view(torch.uint8)[:, start:end].index_copy_(0, slots, q.view(torch.uint8))
    else:
        flat[:, start:end].index_copy_(0, slots, rows.to(cache.dtype))


def gather_rows(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`[len(block_ids) * block_size, entry_size]`: the cache rows of the given blocks, in order
    (in the cache's dtype)."""
    if cache.dtype in _FP8_DTYPES:
        return gather_rows(cache.view(torch.uint8), block_ids).view(cache.dtype)
    return cache.index_select(0, block_ids).view(-1, cache.shape[-1])


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """`[len(slots), width]`: the first `width` columns of the cache rows at `slots` (in the
    cache's dtype)."""
    if cache.dtype in _FP8_DTYPES:
        return gather_slots(cache.view(torch.uint8), slots, width).view(cache.dtype)
    return cache.view(-1, cache.shape[-1])[:, :width].index_select(0, slots)


def read_rows(rows: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Gathered cache rows -> `dtype`, times `scale` for an fp8 cache."""
    if rows.dtype == dtype:
        return rows
    out = rows.to(dtype)
    if rows.dtype in _FP8_DTYPES and scale != 1.0:
        out = out * scale
    return out


class _Unloaded(nn.Module):
    """Placeholder for a linear whose weights have not been loaded yet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard only
        raise RuntimeError("model weights were not loaded")


class MLAAttention(nn.Module):
    """MLA over the latent cache (see module docstring).

    Linears (`DenseLinear`-like, set by the model's loader): `in_proj` = `[q_a_proj or q_proj;
    kv_a_proj_with_mqa]` fused, `q_b_proj`, `o_proj`, `kv_b_proj`; `set_kv_b` also derives
    `w_uk` `[H, nope, kv_lora]` and `w_uv` `[H, kv_lora, v]` for the absorbed decode.
    `output_gate` (A.X-K2): `q_b_proj` reads `[q_a_layernorm(q_c) | q_c]` and yields per head
    `[q_nope | q_pe | gate (v_head_dim)]`; the attention output is scaled by `sigmoid(gate)`
    before `o_proj`. `indexer` (V3.2): restricts each query to its top-k positions."""

    def __init__(self, cfg: Any, dtype: torch.dtype, *, output_gate: bool, interleaved: bool,
                 indexer: nn.Module | None = None):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank
        self.q_dim = self.q_lora or self.num_heads * (self.nope + self.rope)
        self.scale = mla_softmax_scale(cfg)
        self.output_gate = output_gate
        self.interleaved = interleaved
        self.in_proj: nn.Module = _Unloaded()
        self.q_b_proj: nn.Module | None = _Unloaded() if self.q_lora else None
        self.o_proj: nn.Module = _Unloaded()
        self.kv_b_proj: nn.Module = _Unloaded()
        self.q_a_layernorm = RMSNorm(self.q_lora, 1e-6, dtype) if self.q_lora else None
        self.kv_a_layernorm = RMSNorm(self.kv_lora, 1e-6, dtype)
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self.indexer = indexer
        self.k_scale = 1.0
        """fp8 cache only: latent rows are stored divided by this (checkpoint `k_scale`)."""

    def set_kv_b(self, kv_b_proj: nn.Module, weight: torch.Tensor) -> None:
        """Install `kv_b_proj` (`weight` `[H * (nope + v), kv_lora]`) and its absorbed halves."""
        w = weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        self.kv_b_proj = kv_b_proj
        self.w_uk = w[:, : self.nope].contiguous()
        self.w_uv = w[:, self.nope :].transpose(1, 2).contiguous()

    def _rotate(self, x: torch.Tensor, rt: RopeTables) -> torch.Tensor:
        if self.interleaved:
            return apply_rotary_interleaved(x, rt.freqs_cis)
        return apply_rotary(x, rt.cos, rt.sin)

    def forward(self, x: torch.Tensor, rt: RopeTables, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`. Writes the new tokens' cache rows first."""
        t = x.shape[0]
        a = self.in_proj.forward(x)
        q_c, kv = a[:, : self.q_dim], a[:, self.q_dim :]
        q_resid = None
        if self.q_a_layernorm is not None:
            q_resid = self.q_a_layernorm.forward(q_c)
            q_in = torch.cat([q_resid, q_c], dim=-1) if self.output_gate else q_resid
            assert self.q_b_proj is not None
            q = self.q_b_proj.forward(q_in).view(t, self.num_heads, -1)
        else:
            q = q_c.reshape(t, self.num_heads, -1)
        qk = self.nope + self.rope
        q_nope = q[..., : self.nope]
        q_pe = self._rotate(q[..., self.nope : qk], rt)
        c_kv = self.kv_a_layernorm.forward(kv[:, : self.kv_lora])
        k_pe = self._rotate(kv[:, None, self.kv_lora :], rt)[:, 0]
        latent = torch.cat([c_kv, k_pe], dim=-1)
        if meta.kv_hooks is not None:
            meta.kv_hooks.wait_for_layer_load(kv_cache)
        write_rows(kv_cache, meta.slot_mapping, latent, 0, self.k_scale)
        sel = None
        if self.indexer is not None:
            assert q_resid is not None
            sel = self.indexer.forward(x, q_resid, rt, kv_cache, meta)
        out = self._attend(q_nope, q_pe, latent, kv_cache, meta, sel)
        if meta.kv_hooks is not None:  # the indexer keys are written by now too
            meta.kv_hooks.save_kv_layer(kv_cache)
        o = out.reshape(t, self.num_heads * self.v_dim)
        if self.output_gate:
            gate = q[..., qk:].reshape(t, -1)
            o = (o * torch.sigmoid(gate.float())).to(o.dtype)
        return self.o_proj.forward(o)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, sel: Any) -> torch.Tensor:
        """`[T, H, v_head_dim]`: decodes in latent space, other sequences up-projected."""
        if meta.backend == "cpp":
            return self._attend_cpp(q_nope, q_pe, kv_cache, meta, sel)
        t = q_nope.shape[0]
        if not meta.prefills and meta.decode_token_slice == (0, meta.num_tokens):
            return self._decode(q_nope, q_pe, kv_cache, meta, sel)
        out = q_nope.new_empty((t, self.num_heads, self.v_dim))
        if meta.decode_rows:
            if meta.decode_token_slice is not None:
                a, b = meta.decode_token_slice
                out[a:b] = self._decode(q_nope[a:b], q_pe[a:b], kv_cache, meta, sel)
            else:
                idx = meta.decode_token_idx
                assert idx is not None
                dec = self._decode(q_nope.index_select(0, idx), q_pe.index_select(0, idx),
                                   kv_cache, meta, sel)
                out.index_copy_(0, idx, dec)
        if meta.prefills:
            q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
            for i, p in enumerate(meta.prefills):
                mask = None if sel is None else sel.prefill[i]
                out[p.start : p.end] = self._prefill(q, latent, kv_cache, p, mask)
        return out

    def _prefill(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                 p: PrefillSeq, index_mask: torch.Tensor | None) -> torch.Tensor:
        """One sequence's queries `[Lq, H, qk]` over its whole context -> `[Lq, H, v]`. A fresh
        prefill uses its new latents when the cache holds them losslessly (same dtype), else
        reads them back like cached context (as the C++ path always does)."""
        if p.context_len == 0 and kv_cache.dtype == latent.dtype:
            lat = latent[p.start : p.end]
        else:
            assert p.block_ids is not None
            lat = gather_rows(kv_cache, p.block_ids)[: p.seq_len, : self.kv_lora + self.rope]
            lat = read_rows(lat, q.dtype, self.k_scale)
        s = lat.shape[0]
        kv = self.kv_b_proj.forward(lat[:, : self.kv_lora].contiguous())
        kv = kv.view(s, self.num_heads, self.nope + self.v_dim)
        k = torch.empty((s, self.num_heads, self.nope + self.rope), dtype=q.dtype,
                        device=q.device)
        k[..., : self.nope] = kv[..., : self.nope]
        k[..., self.nope :] = lat[:, None, self.kv_lora :]
        v = kv[..., self.nope :]
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
        ks = k.transpose(0, 1).unsqueeze(0)
        vs = v.transpose(0, 1).unsqueeze(0)
        mask = p.mask if index_mask is None else index_mask
        if mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
        return o.squeeze(0).transpose(0, 1)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sel: Any) -> torch.Tensor:
        """Absorbed attention of the decode rows: q `[Bd, H, *]` -> `[Bd, H, v]`."""
        assert meta.decode_block_ids is not None and self.w_uk is not None
        assert self.w_uv is not None
        bd = q_nope.shape[0]
        width = self.kv_lora + self.rope
        rows = gather_rows(kv_cache, meta.decode_block_ids).view(bd, -1, kv_cache.shape[-1])
        rows = read_rows(rows[..., :width], q_nope.dtype, self.k_scale)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [H, Bd, kv_lora]
        qq = torch.cat([q_lat.transpose(0, 1), q_pe.to(q_lat.dtype)], dim=-1)
        mask = meta.decode_additive_mask(qq.dtype)
        if sel is not None and sel.decode is not None:
            mask = mask.masked_fill(~sel.decode.view(bd, 1, 1, -1), float("-inf"))
        o = F.scaled_dot_product_attention(
            qq.unsqueeze(1),
            rows[:, None],
            rows[:, None, :, : self.kv_lora],
            attn_mask=mask,
            scale=self.scale,
        )  # [Bd, 1, H, kv_lora]
        return torch.bmm(o[:, 0].transpose(0, 1), self.w_uv).transpose(0, 1)

    # -- C++ backend -------------------------------------------------------------------------

    def _attend_cpp(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, sel: Any) -> torch.Tensor:
        """`_attend` on the C++ kernels: decodes absorbed over the cache in place (one call),
        prefill sequences up-projected together (one gather, one call)."""
        idx = None if sel is None else sel.indices
        if not meta.prefills:
            return self._decode_cpp(q_nope, q_pe, kv_cache, meta, meta.decode_group(), idx)
        out = torch.empty((q_nope.shape[0], self.num_heads, self.v_dim), dtype=torch.float32,
                          device=q_nope.device)
        if meta.decode_rows:
            g = meta.decode_group()
            if g.token_slice is not None:
                a, b = g.token_slice
                qn, qp, di = q_nope[a:b], q_pe[a:b], None if idx is None else idx[a:b]
                out[a:b] = self._decode_cpp(qn, qp, kv_cache, meta, g, di)
            else:
                assert g.token_idx is not None
                ti = g.token_idx
                di = None if idx is None else idx.index_select(0, ti)
                dec = self._decode_cpp(q_nope.index_select(0, ti), q_pe.index_select(0, ti),
                                       kv_cache, meta, g, di)
                out.index_copy_(0, ti, dec.float())
        self._prefill_cpp(q_nope, q_pe, kv_cache, meta.prefill_group(), idx, out)
        return out.to(q_nope.dtype)

    def _prefill_cpp(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     g: SeqGroup, idx: torch.Tensor | None, out: torch.Tensor) -> None:
        """All prefill sequences: their latents (positions 0 .. seq_len-1, read back from the
        cache) up-projected once, then one varlen causal call writing their rows of `out`."""
        from sous.engine.ops.cpu_attention import flat_attention

        assert g.kv_slots is not None
        width = self.kv_lora + self.rope
        lat = read_rows(gather_slots(kv_cache, g.kv_slots, width), q_nope.dtype, self.k_scale)
        s = lat.shape[0]
        kv = self.kv_b_proj.forward(lat[:, : self.kv_lora].contiguous())
        kv = kv.view(s, self.num_heads, self.nope + self.v_dim)
        k = torch.empty((s, self.num_heads, self.nope + self.rope), dtype=kv.dtype,
                        device=kv.device)
        k[..., : self.nope] = kv[..., : self.nope]
        k[..., self.nope :] = lat[:, None, self.kv_lora :]
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
        flat_attention(q, k, kv[..., self.nope :], g, self.scale, out, idx)

    def _decode_cpp(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, g: SeqGroup,
                    idx: torch.Tensor | None) -> torch.Tensor:
        """Absorbed attention of the decode rows `[Bd, H, *]` over their latent rows in place
        -> `[Bd, H, v]` (in q's dtype)."""
        from sous.engine.ops.cpu_attention import latent_attention

        assert self.w_uk is not None and self.w_uv is not None
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [H, Bd, kv_lora]
        qq = torch.cat([q_lat.transpose(0, 1), q_pe.to(q_lat.dtype)], dim=-1)
        o = latent_attention(qq, kv_cache, self.kv_lora, g, meta.block_size, self.scale,
                             self.k_scale, idx)
        return torch.bmm(o.to(q_lat.dtype).transpose(0, 1), self.w_uv).transpose(0, 1)
