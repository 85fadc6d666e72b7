// DeepSeek sparse attention's lightning-indexer scores over a paged key cache.
//
// Row r scores query token t = row_token[r] of sequence b = row_seq[r] at position
// p = row_pos[r] against every position j of the sequence:
//   out[r, j] = sum_h w[t, h] * relu(scale * q[t, h] . key[j])   for j <= p,
//   out[r, j] = -inf                                             for j > p (up to out's width).
// Keys are read in place through the block table (one key head; any cache element type,
// unscaled). Work items are (row, chunk of 64 positions).
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <limits>

#include "kv_source.h"
#include "ops.h"

namespace sous {
namespace {

constexpr int kChunk = 64;

struct ScoreArgs {
  float* out;
  int64_t out_stride, width;
  const float* q;
  int64_t q_tok, q_head;
  const float* w;
  int64_t w_tok;
  KvSource k;
  BlockTable bt;
  const int32_t *row_token, *row_seq, *row_pos;
  int heads, dim;
  float scale;
};

void score_chunk(const ScoreArgs& a, int64_t r, int64_t c0, std::vector<float>& kbuf,
                 std::vector<const float*>& kp, float* tmp) {
  float* dst = a.out + r * a.out_stride + c0;
  const int64_t width = std::min<int64_t>(kChunk, a.width - c0);
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(width, a.row_pos[r] + 1 - c0));
  for (int64_t j = n; j < width; ++j) dst[j] = -std::numeric_limits<float>::infinity();
  if (n == 0) return;
  const int64_t b = a.row_seq[r], t = a.row_token[r];
  kbuf.resize(static_cast<size_t>(kChunk) * a.dim);
  kp.resize(kChunk);
  for (int64_t j = 0; j < n; ++j) {
    int64_t blk, off;
    a.bt.locate(b, c0 + j, &blk, &off);
    kp[j] = a.k.load(blk, off, 0, a.dim, kbuf.data() + j * a.dim);
  }
  for (int64_t j = n; j < ((n + 15) & ~15); ++j) kp[j] = kp[n - 1];
  for (int64_t j = 0; j < n; ++j) dst[j] = 0.f;
  for (int h = 0; h < a.heads; ++h) {
    const float* qh = a.q + t * a.q_tok + h * a.q_head;
    const float wh = a.w[t * a.w_tok + h];
    for (int64_t g = 0; g < n; g += 16) {
      scores16(qh, kp.data() + g, a.dim, a.scale, tmp);
      const int64_t m = std::min<int64_t>(16, n - g);
      for (int64_t j = 0; j < m; ++j) dst[g + j] += wh * std::max(tmp[j], 0.f);
    }
  }
}

}  // namespace

void index_scores(at::Tensor out, const at::Tensor& q, const at::Tensor& w, const at::Tensor& k,
                  const std::vector<int64_t>& k_strides, int64_t num_blocks,
                  const at::Tensor& row_token, const at::Tensor& row_seq,
                  const at::Tensor& row_pos, const at::Tensor& block_table, int64_t block_size,
                  double scale) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && q.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kFloat,
              "sous ops: out, q and w must be float32");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && q.dim() == 3 && q.stride(2) == 1 &&
                  w.dim() == 2 && w.stride(1) == 1 && w.size(1) == q.size(1),
              "sous ops: out [N, L], q [T, H, D], w [T, H] with contiguous rows");
  const int64_t rows = out.size(0);
  TORCH_CHECK(row_token.numel() == rows && row_seq.numel() == rows && row_pos.numel() == rows,
              "sous ops: one token / sequence / position per output row");
  ScoreArgs a{out.data_ptr<float>(), out.stride(0), out.size(1), q.data_ptr<float>(),
              q.stride(0), q.stride(1), w.data_ptr<float>(), w.stride(0),
              KvSource(k, k_strides, 1.0), BlockTable(block_table, block_size),
              int32_data(row_token, "row_token"), int32_data(row_seq, "row_seq"),
              int32_data(row_pos, "row_pos"), static_cast<int>(q.size(1)),
              static_cast<int>(q.size(2)), static_cast<float>(scale)};
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(a.row_token[r] >= 0 && a.row_token[r] < q.size(0), "sous ops: bad row_token");
    TORCH_CHECK(a.row_seq[r] >= 0 && a.row_seq[r] < block_table.size(0), "sous ops: bad row_seq");
    const int64_t used = std::min<int64_t>(a.width, a.row_pos[r] + 1);
    const int64_t nblk = (used + block_size - 1) / block_size;
    TORCH_CHECK(nblk <= block_table.size(1), "sous ops: block table too short");
    for (int64_t j = 0; j < nblk; ++j) {
      const int32_t blk = a.bt.data[a.row_seq[r] * a.bt.row_stride + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "sous ops: block id ", blk, " out of range");
    }
  }
  const int64_t chunks = (a.width + kChunk - 1) / kChunk;
  const int64_t n = rows * chunks;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
#pragma omp parallel num_threads(std::max(threads, 1)) if (threads > 1)
  {
    std::vector<float> kbuf;
    std::vector<const float*> kp;
    float tmp[16];
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < n; ++i)
      score_chunk(a, i / chunks, (i % chunks) * kChunk, kbuf, kp, tmp);
  }
}

}  // namespace sous
