// Entry points of the sous CPU ops extension (attention.cpp, gqa.cpp, index_scores.cpp,
// threads.cpp, quant.cpp, qgemm.cpp, qgemm_rows.cpp, layer_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>
#include <vector>

namespace sous {

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const std::vector<int64_t>& k_strides,
                     const std::vector<int64_t>& v_strides, int64_t num_blocks,
                     const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t block_size, int64_t num_kv_heads, double scale, double k_scale,
                     double v_scale, const std::optional<at::Tensor>& indices);

at::Tensor gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& q_start, const at::Tensor& q_len,
                         const at::Tensor& seq_lens, const at::Tensor& block_table,
                         int64_t block_size, double scale, double k_scale, double v_scale);

void index_scores(at::Tensor out, const at::Tensor& q, const at::Tensor& w, const at::Tensor& k,
                  const std::vector<int64_t>& k_strides, int64_t num_blocks,
                  const at::Tensor& row_token, const at::Tensor& row_seq,
                  const at::Tensor& row_pos, const at::Tensor& block_table, int64_t block_size,
                  double scale);

// OpenMP thread t of the calling thread's pool pinned to cpu_sets[t]; returns each thread's
// CPUs read back (threads.cpp).
std::vector<std::vector<int64_t>> pin_omp_threads(
    const std::vector<std::vector<int64_t>>& cpu_sets);

// The CPUs each thread of a num_threads OpenMP team (of the calling thread's pool) may run on.
std::vector<std::vector<int64_t>> omp_thread_cpus(int64_t num_threads);

// Per-row symmetric int8 quantisation of a float32 [M, K] tensor: (int8 [M, K], scale [M, 1])
// (quant.cpp).
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x);

// float32 [M, N] = float(acc) * x_scale[row] * w_scale[col] (+ bias[col]) (quant.cpp).
at::Tensor rescale_int32(const at::Tensor& acc, const at::Tensor& x_scale,
                         const at::Tensor& w_scale, const std::optional<at::Tensor>& bias);

// y [M, N] (x's dtype) = x [M, K] @ W^T for block-quantised W (W = q * wd + wm per block of
// 32, q `bits` 4 or 8, packed), x quantised to int8 per block of 32 (qgemm.cpp).
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& wd,
                 const at::Tensor& wm, int64_t n, int64_t bits,
                 const std::optional<at::Tensor>& bias);

// y [M, N] (x's dtype) = x [M, K] @ W^T for W = (q - 128) * ws[n] (q packed uint8), x quantised
// to int8 per row; bit-identical to quantize_rows_int8 + an int32 matmul + rescale_int32.
at::Tensor qgemm_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws, int64_t n,
                    const std::optional<at::Tensor>& bias);

// True when qgemm runs on AVX-512 VNNI or AVX2 (else a slow portable form).
bool qgemm_simd();

// Rows `ids` [T] int64 (each in [0, n)) of a qgemm-packed block weight of n rows, dequantised
// (q * wd + wm) into a new [T, K] tensor of `out_type` (float32 or bfloat16) (qgemm_rows.cpp).
at::Tensor qgemm_rows(const at::Tensor& w, const at::Tensor& wd, const at::Tensor& wm, int64_t n,
                      int64_t bits, const at::Tensor& ids, at::ScalarType out_type);

// (norm(x + residual) * weight, x + residual), or (norm(x) * weight, undefined) without a
// residual; x [T, H] float32/bfloat16 (layer_ops.cpp).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const std::optional<at::Tensor>& residual);

// x [T, H, D] rotated by the angles of its positions, pairs (2i, 2i + 1): a new contiguous
// tensor (layer_ops.cpp).
at::Tensor rotary_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& positions);

// silu(x[:, :d]) * x[:, d:] for x [T, 2d] (layer_ops.cpp).
at::Tensor silu_and_mul(const at::Tensor& x);

}  // namespace sous
