// Varlen attention over a paged KV cache, read in place through the block table.
//
// Sequence b owns query rows q[q_start[b] : q_start[b] + q_len[b]] (tokens at positions
// seq_lens[b] - q_len[b] ...) and keys/values at positions 0 .. seq_lens[b] - 1. Dense mode: each
// query attends causally to every position up to its own. Index mode (`indices` [T, topk]
// int32, -1 = none): the query of token t attends exactly positions indices[t, :] (DeepSeek
// sparse attention). Query head hq reads KV head hq / (Hq / Hkv) (GQA / MQA).
//
// Work is split into (sequence, KV head, query tile) items run by the OpenMP threads of torch's
// pool; each keeps a flash-attention style running max / sum / output per query row and reads
// key/value rows straight from the cache (float32) or converted chunk by chunk (bf16, fp16,
// fp8 e4m3 with the per-layer scale).
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <limits>

#include "kv_source.h"
#include "ops.h"

namespace sous {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr int kChunk = 64;     // keys per online-softmax step
constexpr int kRowBlock = 4;   // query rows of one head that share key/value loads

struct Item {
  int32_t seq, h0, h1, t0, t1;
  int64_t cost;
};

struct Args {
  float* out;
  int64_t o_tok, o_head;
  const float* q;
  int64_t q_tok, q_head;
  KvSource k, v;
  bool v_in_k;  // values are the leading dv columns of the key rows (MLA latent)
  BlockTable bt;
  const int32_t *q_start, *q_len, *seq_lens;
  const int32_t* indices;
  int64_t topk;
  int group, dk, dv;
  float scale;
};

struct Scratch {
  std::vector<float> o, mx, l, p, kbuf, vbuf;
  std::vector<const float*> kp, vp;
  std::vector<int32_t> pos;
};

// Key positions of an index-mode item (one token): the valid entries of its index row.
int selected_positions(const Args& a, int b, int token, Scratch& s) {
  const int32_t* idx = a.indices + static_cast<int64_t>(token) * a.topk;
  const int sl = a.seq_lens[b];
  s.pos.clear();
  for (int64_t k = 0; k < a.topk; ++k)
    if (idx[k] >= 0 && idx[k] < sl) s.pos.push_back(idx[k]);
  return static_cast<int>(s.pos.size());
}

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 1);
}

// Prefetch the item's key/value rows at positions j0 .. j1-1 (all of its heads).
void prefetch_rows(const Args& a, const Item& it, int j0, int j1, const int32_t* sel) {
  const int heads = it.h1 - it.h0;
  const int64_t kspan = ((heads - 1) * a.k.head_stride + a.dk) * kv_elem_size(a.k.type);
  const int64_t vspan = ((heads - 1) * a.v.head_stride + a.dv) * kv_elem_size(a.v.type);
  for (int j = j0; j < j1; ++j) {
    int64_t blk, off;
    a.bt.locate(it.seq, sel ? sel[j] : j, &blk, &off);
    prefetch_span(a.k.row(blk, off, it.h0), kspan);
    if (!a.v_in_k) prefetch_span(a.v.row(blk, off, it.h0), vspan);
  }
}

inline int dense_keys(const Args& a, const Item& it) {
  const int sl = a.seq_lens[it.seq];
  return std::min(sl, sl - a.q_len[it.seq] + it.t1);
}

// Row pointers (float32 in place, else converted into the buffers) of keys c0 .. c0+n-1 for the
// item's heads: kp[hh * kChunk + j]; padded to a multiple of 16 rows. Prefetches the next chunk.
void load_chunk(const Args& a, const Item& it, int c0, int n, int nkeys, const int32_t* sel,
                Scratch& s) {
  const int heads = it.h1 - it.h0;
  const int npad = (n + 15) & ~15;
  for (int j = 0; j < n; ++j) {
    const int64_t pos = sel ? sel[c0 + j] : c0 + j;
    int64_t blk, off;
    a.bt.locate(it.seq, pos, &blk, &off);
    for (int hh = 0; hh < heads; ++hh) {
      const int64_t r = static_cast<int64_t>(hh) * kChunk + j;
      const float* kr = a.k.load(blk, off, it.h0 + hh, a.dk, s.kbuf.data() + r * a.dk);
      s.kp[r] = kr;
      s.vp[r] = a.v_in_k ? kr : a.v.load(blk, off, it.h0 + hh, a.dv, s.vbuf.data() + r * a.dv);
    }
  }
  for (int hh = 0; hh < heads; ++hh)
    for (int j = n; j < npad; ++j) {
      s.kp[hh * kChunk + j] = s.kp[hh * kChunk + n - 1];
      s.vp[hh * kChunk + j] = s.vp[hh * kChunk + n - 1];
    }
  if (c0 + kChunk < nkeys)
    prefetch_rows(a, it, c0 + kChunk, std::min(nkeys, c0 + 2 * kChunk), sel);
}

// Online-softmax update of R rows of one head with the chunk's keys: scores, running max/sum,
// rescale, P.V. lims[i] = visible keys of row i (> 0 for at least one row). Each row's
// arithmetic is the same whatever R and whichever rows share the block, so a query row gets
// the same result in a decode step, a prefill or a prefill chunk (batch-invariant output).
template <int R>
void block_update(const Args& a, const float* const* qr, const int* lims,
                  const float* const* kp, const float* const* vp, Scratch& s, int r0) {
  float* P = s.p.data();
  int nmax = 0;
  for (int i = 0; i < R; ++i) nmax = std::max(nmax, lims[i]);
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < lims[i]; g += 16)
      scores16(qr[i], kp + g, a.dk, a.scale, P + i * kChunk + g);
  float* orow[R];
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i, lim = lims[i];
    float* pi = P + i * kChunk;
    orow[i] = s.o.data() + static_cast<int64_t>(r) * a.dv;
    if (lim <= 0) {
      std::fill(pi, pi + nmax, 0.f);
      continue;
    }
    const float nm = std::max(s.mx[r], max_n(pi, lim));
    const float alpha = s.mx[r] == kNegInf ? 0.f : std::exp(s.mx[r] - nm);
    const float sum = exp_shift_sum(pi, lim, nm);
    std::fill(pi + lim, pi + nmax, 0.f);
    if (alpha != 1.f) scale_n(orow[i], a.dv, alpha);
    s.l[r] = s.l[r] * alpha + sum;
    s.mx[r] = nm;
  }
  axpy_rows_multi<R>(orow, P, kChunk, vp, nmax, a.dv);
}

// All rows of head hh of the item over one chunk (n keys starting at c0).
void head_update(const Args& a, const Item& it, int hh, int c0, int n, int ctx, bool dense,
                 Scratch& s) {
  const int G = a.group;
  const int rows_h = (it.t1 - it.t0) * G;
  const float* const* kp = s.kp.data() + static_cast<int64_t>(hh) * kChunk;
  const float* const* vp = s.vp.data() + static_cast<int64_t>(hh) * kChunk;
  const int qh0 = (it.h0 + hh) * G;
  for (int rb = 0; rb < rows_h; rb += kRowBlock) {
    const int R = std::min(kRowBlock, rows_h - rb);
    const float* qr[kRowBlock];
    int lims[kRowBlock];
    int any = 0;
    for (int i = 0; i < R; ++i) {
      const int t = it.t0 + (rb + i) / G, g = (rb + i) % G;
      qr[i] = a.q + (a.q_start[it.seq] + t) * a.q_tok + (qh0 + g) * a.q_head;
      lims[i] = dense ? std::min(n, ctx + t + 1 - c0) : n;
      any |= lims[i] > 0;
    }
    if (!any) continue;
    const int r0 = hh * rows_h + rb;
    switch (R) {
      case 4: block_update<4>(a, qr, lims, kp, vp, s, r0); break;
      case 3: block_update<3>(a, qr, lims, kp, vp, s, r0); break;
      case 2: block_update<2>(a, qr, lims, kp, vp, s, r0); break;
      default: block_update<1>(a, qr, lims, kp, vp, s, r0); break;
    }
  }
}

void run_item(const Args& a, const Item& it, Scratch& s) {
  const int b = it.seq, G = a.group, heads = it.h1 - it.h0;
  const int qs = a.q_start[b], sl = a.seq_lens[b], ctx = sl - a.q_len[b];
  const int rows_h = (it.t1 - it.t0) * G, rows = rows_h * heads;
  const int32_t* sel = nullptr;
  int nkeys;
  if (a.indices) {
    nkeys = selected_positions(a, b, qs + it.t0, s);
    sel = s.pos.data();
  } else {
    nkeys = dense_keys(a, it);
  }
  s.o.assign(static_cast<size_t>(rows) * a.dv, 0.f);
  s.mx.assign(rows, kNegInf);
  s.l.assign(rows, 0.f);
  s.p.resize(kRowBlock * kChunk);
  s.kp.resize(static_cast<size_t>(heads) * kChunk);
  s.vp.resize(static_cast<size_t>(heads) * kChunk);
  if (a.k.type != KvType::F32) s.kbuf.resize(static_cast<size_t>(heads) * kChunk * a.dk);
  if (a.v.type != KvType::F32 && !a.v_in_k)
    s.vbuf.resize(static_cast<size_t>(heads) * kChunk * a.dv);
  for (int c0 = 0; c0 < nkeys; c0 += kChunk) {
    const int n = std::min(kChunk, nkeys - c0);
    load_chunk(a, it, c0, n, nkeys, sel, s);
    for (int hh = 0; hh < heads; ++hh) head_update(a, it, hh, c0, n, ctx, sel == nullptr, s);
  }
  for (int r = 0; r < rows; ++r) {
    const int hh = r / rows_h, t = it.t0 + (r % rows_h) / G, g = (r % rows_h) % G;
    float* dst = a.out + (qs + t) * a.o_tok + ((it.h0 + hh) * G + g) * a.o_head;
    const float* src = s.o.data() + static_cast<int64_t>(r) * a.dv;
    const float inv = s.l[r] > 0.f ? 1.f / s.l[r] : 0.f;
    for (int i = 0; i < a.dv; ++i) dst[i] = src[i] * inv;
  }
}

std::vector<Item> make_items(const Args& a, int64_t num_seqs, int num_kv_heads, int threads) {
  // Query tiles of ~64 rows per head (a group's heads share each chunk of keys/values); one
  // token per tile in index mode, where every token has its own key set. An item covers all KV
  // heads (one pass over the sequence's blocks) unless that leaves threads idle.
  const int tile = a.indices ? 1 : std::max(1, 64 / a.group);
  int64_t tiles = 0;
  for (int64_t b = 0; b < num_seqs; ++b) tiles += (a.q_len[b] + tile - 1) / tile;
  const int hstep = tiles >= 4 * threads ? num_kv_heads : 1;
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int ql = a.q_len[b], ctx = a.seq_lens[b] - ql;
    for (int t0 = 0; t0 < ql; t0 += tile) {
      const int t1 = std::min(ql, t0 + tile);
      const int64_t keys = a.indices ? a.topk : std::min(a.seq_lens[b], ctx + t1);
      for (int h = 0; h < num_kv_heads; h += hstep) {
        const int h1 = std::min(num_kv_heads, h + hstep);
        items.push_back({static_cast<int32_t>(b), h, h1, t0, t1, keys * (t1 - t0) * (h1 - h)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

void check_tables(const Args& a, int64_t num_seqs, int64_t table_width, int64_t num_blocks) {
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t sl = a.seq_lens[b];
    TORCH_CHECK(a.q_len[b] >= 0 && a.q_len[b] <= sl, "sous ops: bad q_len / seq_lens");
    const int64_t nblk = (sl + a.bt.block_size - 1) / a.bt.block_size;
    TORCH_CHECK(nblk <= table_width, "sous ops: block table too short for seq_len ", sl);
    for (int64_t j = 0; j < nblk; ++j) {
      const int32_t blk = a.bt.data[b * a.bt.row_stride + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "sous ops: block id ", blk, " out of range");
    }
  }
}

}  // namespace

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const std::vector<int64_t>& k_strides,
                     const std::vector<int64_t>& v_strides, int64_t num_blocks,
                     const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t block_size, int64_t num_kv_heads, double scale, double k_scale,
                     double v_scale, const std::optional<at::Tensor>& indices) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "sous ops: q and out must be float32");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.size(0) == out.size(0) &&
                  q.size(1) == out.size(1) && q.stride(2) == 1 && out.stride(2) == 1,
              "sous ops: q [T, Hq, Dk] and out [T, Hq, Dv] with contiguous rows");
  TORCH_CHECK(k.device().is_cpu() && q.device().is_cpu(), "sous ops: CPU tensors only");
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0,
              "sous ops: query heads must be a multiple of KV heads");
  const int64_t num_seqs = q_start.numel();
  TORCH_CHECK(q_len.numel() == num_seqs && seq_lens.numel() == num_seqs &&
                  block_table.size(0) >= num_seqs,
              "sous ops: per-sequence tensors differ in length");
  Args a{out.data_ptr<float>(), out.stride(0), out.stride(1), q.data_ptr<float>(), q.stride(0),
         q.stride(1), KvSource(k, k_strides, k_scale), KvSource(v, v_strides, v_scale), false,
         BlockTable(block_table, block_size), int32_data(q_start, "q_start"),
         int32_data(q_len, "q_len"), int32_data(seq_lens, "seq_lens"), nullptr, 0,
         static_cast<int>(q.size(1) / num_kv_heads), static_cast<int>(q.size(2)),
         static_cast<int>(out.size(2)), static_cast<float>(scale)};
  a.v_in_k = a.k.base == a.v.base && k_strides == v_strides && a.k.type == a.v.type &&
             a.k.scale == a.v.scale && a.dv <= a.dk;
  if (indices.has_value()) {
    const at::Tensor& idx = *indices;
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == q.size(0), "sous ops: indices [T, topk]");
    a.indices = int32_data(idx, "indices");
    a.topk = idx.size(1);
  }
  check_tables(a, num_seqs, block_table.size(1), num_blocks);
  const std::vector<Item> items =
      make_items(a, num_seqs, static_cast<int>(num_kv_heads), at::get_num_threads());
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  // Items are sorted by cost (largest first) and handed out dynamically.
  if (threads <= 1) {
    static thread_local Scratch s;
    for (int64_t i = 0; i < n; ++i) run_item(a, items[i], s);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    static thread_local Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item(a, items[i], s);
  }
}

}  // namespace sous
