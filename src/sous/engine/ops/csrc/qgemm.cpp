// Quantised GEMMs on AVX-512 VNNI (`vpdpbusd`: unsigned 8-bit weights times signed 8-bit
// activations, exact int32 sums) or AVX2 (`vpmaddubsw` + `vpmaddwd`, the same exact sums, 8
// lanes at a time), for the two weight formats sous serves:
//
// * block (`qgemm`): llama.cpp's numerics for GGUF Q4_0 / Q4_1 / Q8_0 --
//     W[n, k] = q[n, k] * wd[n, b] + wm[n, b]          (b = k / 32; q unsigned, 4 or 8 bits)
//     x[m, k] ~ xq[m, k] * xd[m, b]                    (xq int8, xd = max|x| / 127 per block)
//     y[m, n] = sum_b (q . xq)_b * (wd[n, b] * xd[m, b]) + wm[n, b] * xs[m, b]
//   with xs = xd * sum(xq) per block (llama.cpp's Q8_1 `s`);
// * per channel (`qgemm_i8`): W[n, k] = (q[n, k] - 128) * ws[n], x[m, k] ~ xq[m, k] * xd[m]:
//     y[m, n] = float(q . xq - 128 * sum(xq)) * xd[m] * ws[n]     (one int32 sum over K).
//
// Block scales and minimums are float16 (GGUF stores them so) or float32.
//
// Packed weight layout (`sous.models.layers.qgemm_linear.pack_weights`): output rows in groups
// of 16 (the last padded with zeros); per group and block of 32, eight 4-byte steps of all 16
// rows, so that lane l of one `vpdpbusd` adds 4 products of row 16 g + l and eight steps leave
// each lane holding its row's block dot product: 512 bytes per (group, block) for 8 bits; for
// 4 bits 256 bytes, steps s and s + 4 sharing bytes (low and high nibbles).
//
// Every output is computed by the same instruction sequence whatever the number of rows or
// which rows share a tile, so a row's result does not depend on the batch it is in. The AVX2
// and VNNI forms do the same float operations per lane, so their results are bit-identical.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SOUS_QGEMM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SOUS_QGEMM_AVX2 1
#endif

namespace sous {
namespace {

constexpr int64_t QK = 32;       // elements per block
constexpr int64_t LANES = 16;    // output rows per group
constexpr int64_t M_BLOCK = 64;  // activation rows per pass over a thread's weights (fit L2)

// A call's activations quantised to int8: q [M, K]; per block (block mode) d [M, nb] and
// s = d * sum(q) [M, nb]; per row (per-channel mode) d [M] and s = sum(q) [M].
struct QuantAct {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t k = 0, nb = 0;
};

template <typename T>
float at_f32(const T* x, int64_t i) {
  return static_cast<float>(x[i]);
}

#ifdef SOUS_QGEMM_VNNI
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// round-half-even(v * s) (the MXCSR default) saturated to int8 into q[0:16]; returns the sum.
inline __m512i quantize16(__m512 v, __m512 s, bool divide, int8_t* q) {
  const __m512i i = _mm512_cvtps_epi32(divide ? _mm512_div_ps(v, s) : _mm512_mul_ps(v, s));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(i));
  return i;
}

inline float amax16(__m512 v) { return _mm512_reduce_max_ps(_mm512_abs_ps(v)); }
#elif defined(SOUS_QGEMM_AVX2)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

// max|x[0:n]| (n a multiple of 8): max is exact, so any order gives the scalar loop's value.
template <typename T>
float amax_n(const T* x, int64_t n) {
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, abs8(load8(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// q[0:32] = round-half-even(x[0:32] op s) (op: * or /, as the scalar forms; the MXCSR default
// rounding is std::nearbyint's) as int8 (|values| <= 127); returns their exact sum.
template <typename T>
int32_t quantize32(const T* x, __m256 s, bool divide, int8_t* q) {
  __m256i i[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 v = load8(x + 8 * j);
    i[j] = _mm256_cvtps_epi32(divide ? _mm256_div_ps(v, s) : _mm256_mul_ps(v, s));
  }
  // packs interleave the 128-bit lanes; the permute puts the 4-byte groups back in order.
  const __m256i w =
      _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}
#endif

// Block mode: q = round(x * (1 / d)), d = max|x| / 127 per block of 32 (llama.cpp's Q8_1).
template <typename T>
void quantize_blocks(const T* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / QK; ++b) {
    const T* xb = x + b * QK;
#ifdef SOUS_QGEMM_VNNI
    const __m512 lo = load16(xb), hi = load16(xb + 16);
    const float amax = std::fmax(amax16(lo), amax16(hi));
#elif defined(SOUS_QGEMM_AVX2)
    const float amax = amax_n(xb, QK);
#else
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(at_f32(xb, i)));
#endif
    const float db = amax / 127.f;
    const float id = db > 0.f ? 1.f / db : 0.f;
#ifdef SOUS_QGEMM_VNNI
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i sum = _mm512_add_epi32(quantize16(lo, vid, false, q + b * QK),
                                         quantize16(hi, vid, false, q + b * QK + 16));
    s[b] = db * static_cast<float>(_mm512_reduce_add_epi32(sum));
#elif defined(SOUS_QGEMM_AVX2)
    s[b] = db * static_cast<float>(quantize32(xb, _mm256_set1_ps(id), false, q + b * QK));
#else
    int32_t sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(at_f32(xb, i) * id));
      q[b * QK + i] = static_cast<int8_t>(v);
      sum += v;
    }
    s[b] = db * static_cast<float>(sum);
#endif
    d[b] = db;
  }
}

// Per-channel mode: q = round-half-even(x / d), d = max|x| / 127 per row (1 for a zero row):
// the arithmetic of quantize_rows_int8 (quant.cpp).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* s) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef SOUS_QGEMM_VNNI
  for (; i + 16 <= k; i += 16) amax = std::fmax(amax, amax16(load16(x + i)));
#elif defined(SOUS_QGEMM_AVX2)
  i = k / QK * QK;
  if (i > 0) amax = amax_n(x, i);
#endif
  for (; i < k; ++i) amax = std::fmax(amax, std::fabs(at_f32(x, i)));
  const float dr = amax > 0.f ? amax / 127.f : 1.f;
  int32_t sum = 0;
  i = 0;
#ifdef SOUS_QGEMM_VNNI
  __m512i acc = _mm512_setzero_si512();
  for (; i + 16 <= k; i += 16)
    acc = _mm512_add_epi32(acc, quantize16(load16(x + i), _mm512_set1_ps(dr), true, q + i));
  sum = _mm512_reduce_add_epi32(acc);
#elif defined(SOUS_QGEMM_AVX2)
  for (; i + QK <= k; i += QK) sum += quantize32(x + i, _mm256_set1_ps(dr), true, q + i);
#endif
  for (; i < k; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(at_f32(x, i) / dr));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = dr;
  *s = static_cast<float>(sum);
}

QuantAct quantize(const at::Tensor& x, bool per_block) {
  QuantAct a;
  const int64_t m = x.size(0);
  a.k = x.size(1);
  a.nb = a.k / QK;
  const int64_t per_row = per_block ? a.nb : 1;
  a.q.resize(m * a.k);
  a.d.resize(m * per_row);
  a.s.resize(m * per_row);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* q = a.q.data() + r * a.k;
      float* d = a.d.data() + r * per_row;
      float* s = a.s.data() + r * per_row;
      if (bf16) {
        const c10::BFloat16* xr = x.data_ptr<c10::BFloat16>() + r * a.k;
        per_block ? quantize_blocks(xr, a.k, q, d, s) : quantize_row(xr, a.k, q, d, s);
      } else {
        const float* xr = x.data_ptr<float>() + r * a.k;
        per_block ? quantize_blocks(xr, a.k, q, d, s) : quantize_row(xr, a.k, q, d, s);
      }
    }
  });
  return a;
}

// One call's operands (read-only, shared by all threads) and its output.
struct Problem {
  const QuantAct* a;
  const uint8_t* w;  // packed weights (see the file comment)
  const float* wd;   // block: [G, nb, 16] scales; per channel: [N] scales
  const float* wm;   // block: [G, nb, 16] minimums; per channel: unused
  const c10::Half* hd;  // block mode with float16 scales (GGUF's own precision): these
  const c10::Half* hm;  // instead of wd / wm
  const float* bias;
  int64_t n, bits, block_bytes;
  bool per_block;
  at::ScalarType out_type;
  void* y;
};

// y[m, n0 + l] = v[l] (+ bias) for the lanes that are real rows.
void store(const Problem& p, int64_t m, int64_t n0, const float* v) {
  const int64_t count = std::min(LANES, p.n - n0);
#ifdef SOUS_AVX512
  if (count == LANES && p.out_type == at::kBFloat16) {  // the loop below, 16 lanes at once
    __m512 out = _mm512_loadu_ps(v);
    if (p.bias != nullptr) out = _mm512_add_ps(out, _mm512_loadu_ps(p.bias + n0));
    bf16_store16(static_cast<c10::BFloat16*>(p.y) + m * p.n + n0, bf16_round16(out));
    return;
  }
#endif
  for (int64_t l = 0; l < count; ++l) {
    const float out = p.bias != nullptr ? v[l] + p.bias[n0 + l] : v[l];
    if (p.out_type == at::kBFloat16) {
      static_cast<c10::BFloat16*>(p.y)[m * p.n + n0 + l] = c10::BFloat16(out);
    } else {
      static_cast<float*>(p.y)[m * p.n + n0 + l] = out;
    }
  }
}

#if defined(SOUS_QGEMM_VNNI) || defined(SOUS_QGEMM_AVX2)
// A call streams its weights once (a layer's ~2 MB do not stay in L2 until the next token),
// and the hardware prefetcher alone leaves the core waiting on them: measured on a 30-layer
// pass of one row, about 4.2 ms without this and 2.9 ms with it. Fetching the weights (and block
// scales) PREFETCH_BYTES ahead of the block being computed changes no result. Only a group's
// first tile of rows prefetches (`run` walks a group's tiles one after the other).
constexpr int64_t PREFETCH_BYTES = 4096;

inline void prefetch_ahead(const Problem& p, int64_t g, int64_t b, int64_t nb) {
  const int64_t j = g * nb + b + PREFETCH_BYTES / p.block_bytes;  // (group, block) index
  const char* w = reinterpret_cast<const char*>(p.w + j * p.block_bytes);
  for (int64_t line = 0; line < p.block_bytes; line += 64) _mm_prefetch(w + line, _MM_HINT_T0);
  if (!p.per_block) return;  // per-channel scales are few and stay cached
  if (p.hd != nullptr) {  // 32 bytes of float16 per block and array: a line every 2 blocks
    if ((j & 1) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p.hd + j * LANES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.hm + j * LANES), _MM_HINT_T0);
    }
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(p.wd + j * LANES), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p.wm + j * LANES), _MM_HINT_T0);
  }
}
#endif

#ifdef SOUS_QGEMM_VNNI
// The eight 4-byte steps of one (group, block) of weights, as unsigned bytes.
inline void load_steps(const uint8_t* src, int64_t bits, __m512i* w) {
  if (bits == 8) {
    for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(src + 64 * s);
    return;
  }
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int s = 0; s < 4; ++s) {
    const __m512i v = _mm512_loadu_si512(src + 64 * s);
    w[s] = _mm512_and_si512(v, lo4);
    w[s + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
  }
}

inline __m512 load_half16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Exact int32 block dot of each lane's row with activation block `x` (32 int8), added to acc.
inline __m512i block_dot(__m512i acc, const __m512i* w, const int8_t* x) {
  for (int s = 0; s < 8; ++s) {
    int32_t four;
    std::memcpy(&four, x + 4 * s, 4);
    acc = _mm512_dpbusd_epi32(acc, w[s], _mm512_set1_epi32(four));
  }
  return acc;
}

// Outputs [m0, m0 + MT) x group g (16 rows).
template <int MT, bool BLOCK, bool HALF, int BITS>
void tile_t(const Problem& p, int64_t m0, int64_t g) {
  const QuantAct& a = *p.a;
  const uint8_t* wg = p.w + g * a.nb * p.block_bytes;
  __m512 acc[MT];
  __m512i iacc[MT];
  for (int i = 0; i < MT; ++i) {
    acc[i] = _mm512_setzero_ps();
    iacc[i] = _mm512_setzero_si512();
  }
  __m512i w[8];
  const bool first_tile = m0 % M_BLOCK == 0;  // later tiles of the group find it cached
  for (int64_t b = 0; b < a.nb; ++b) {
    if (first_tile) prefetch_ahead(p, g, b, a.nb);
    load_steps(wg + b * p.block_bytes, BITS, w);
    if constexpr (BLOCK) {
      const int64_t si = (g * a.nb + b) * LANES;
      const __m512 wd = HALF ? load_half16(p.hd + si) : _mm512_loadu_ps(p.wd + si);
      const __m512 wm = HALF ? load_half16(p.hm + si) : _mm512_loadu_ps(p.wm + si);
      for (int i = 0; i < MT; ++i) {
        const int64_t r = (m0 + i) * a.nb + b;
        const int8_t* x = a.q.data() + (m0 + i) * a.k + b * QK;
        const __m512i dot = block_dot(_mm512_setzero_si512(), w, x);
        const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(a.d[r]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
        acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(a.s[r]), acc[i]);
      }
    } else {
      for (int i = 0; i < MT; ++i)
        iacc[i] = block_dot(iacc[i], w, a.q.data() + (m0 + i) * a.k + b * QK);
    }
  }
  alignas(64) float out[LANES];
  for (int i = 0; i < MT; ++i) {
    if constexpr (!BLOCK) {  // float(acc - 128 sum(xq)) * xd[m] * ws[n]
      const int32_t offset = 128 * static_cast<int32_t>(a.s[m0 + i]);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[i], _mm512_set1_epi32(offset)));
      const __mmask16 mask = static_cast<__mmask16>((1u << std::min(LANES, p.n - g * LANES)) - 1u);
      acc[i] = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(a.d[m0 + i])),
                             _mm512_maskz_loadu_ps(mask, p.wd + g * LANES));
    }
    _mm512_store_ps(out, acc[i]);
    store(p, m0 + i, g * LANES, out);
  }
}
// Block mode, outputs [m0, m0 + MT) x groups g and g + 1: each broadcast of four activation
// bytes feeds both groups' `vpdpbusd`, where tile_t spends one broadcast per instruction (11 %
// less time than tile<8> at 64 and 256 rows on an AVX-512 EPYC, one thread). Every output's
// operations are tile_t's, in the same order, so results are bit-identical.
template <int MT, bool HALF, int BITS>
void tile2_t(const Problem& p, int64_t m0, int64_t g) {
  const QuantAct& a = *p.a;
  const uint8_t* wg0 = p.w + g * a.nb * p.block_bytes;
  const uint8_t* wg1 = wg0 + a.nb * p.block_bytes;
  __m512 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  __m512i w0[8], w1[8];
  const bool first_tile = m0 % M_BLOCK == 0;
  for (int64_t b = 0; b < a.nb; ++b) {
    if (first_tile) {
      prefetch_ahead(p, g, b, a.nb);
      prefetch_ahead(p, g + 1, b, a.nb);
    }
    load_steps(wg0 + b * p.block_bytes, BITS, w0);
    load_steps(wg1 + b * p.block_bytes, BITS, w1);
    const int64_t si0 = (g * a.nb + b) * LANES, si1 = si0 + a.nb * LANES;
    const __m512 wd0 = HALF ? load_half16(p.hd + si0) : _mm512_loadu_ps(p.wd + si0);
    const __m512 wm0 = HALF ? load_half16(p.hm + si0) : _mm512_loadu_ps(p.wm + si0);
    const __m512 wd1 = HALF ? load_half16(p.hd + si1) : _mm512_loadu_ps(p.wd + si1);
    const __m512 wm1 = HALF ? load_half16(p.hm + si1) : _mm512_loadu_ps(p.wm + si1);
    for (int i = 0; i < MT; ++i) {
      const int64_t r = (m0 + i) * a.nb + b;
      const int8_t* x = a.q.data() + (m0 + i) * a.k + b * QK;
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int st = 0; st < 8; ++st) {
        int32_t four;
        std::memcpy(&four, x + 4 * st, 4);
        const __m512i bx = _mm512_set1_epi32(four);
        d0 = _mm512_dpbusd_epi32(d0, w0[st], bx);
        d1 = _mm512_dpbusd_epi32(d1, w1[st], bx);
      }
      const __m512 xd = _mm512_set1_ps(a.d[r]), xs = _mm512_set1_ps(a.s[r]);
      acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(wd0, xd), acc[i][0]);
      acc[i][0] = _mm512_fmadd_ps(wm0, xs, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(wd1, xd), acc[i][1]);
      acc[i][1] = _mm512_fmadd_ps(wm1, xs, acc[i][1]);
    }
  }
  alignas(64) float out[LANES];
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h) {
      _mm512_store_ps(out, acc[i][h]);
      store(p, m0 + i, (g + h) * LANES, out);
    }
}

// The problem's kind as template arguments: no branch inside the block loop, and the tile's
// accumulators stay in registers (about 5 % faster at 64 rows than branching per block).
template <int MT>
void tile(const Problem& p, int64_t m0, int64_t g) {
  if (!p.per_block) return tile_t<MT, false, false, 8>(p, m0, g);
  if (p.hd != nullptr) {
    return p.bits == 8 ? tile_t<MT, true, true, 8>(p, m0, g) : tile_t<MT, true, true, 4>(p, m0, g);
  }
  return p.bits == 8 ? tile_t<MT, true, false, 8>(p, m0, g) : tile_t<MT, true, false, 4>(p, m0, g);
}

// Block mode, four rows x groups g and g + 1 (tile2_t).
void tile2(const Problem& p, int64_t m0, int64_t g) {
  if (p.hd != nullptr) {
    return p.bits == 8 ? tile2_t<4, true, 8>(p, m0, g) : tile2_t<4, true, 4>(p, m0, g);
  }
  return p.bits == 8 ? tile2_t<4, false, 8>(p, m0, g) : tile2_t<4, false, 4>(p, m0, g);
}
#elif defined(SOUS_QGEMM_AVX2)
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i bcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

inline __m256 load_scale8(const float* f, const c10::Half* h, int64_t i) {
  return h != nullptr ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)))
                      : _mm256_loadu_ps(f + i);
}

// Block dots of R activation rows `x[r]` (32 int8 each) with both halves (lanes 0-7, 8-15) of
// one (group, block) of 4-bit weights `src`: dot[r][h], exact int32. `vpmaddubsw` pair sums
// are at most 2 * 15 * 127 and eight of them fit int16, so nothing saturates.
template <int R>
inline void dots4(const uint8_t* src, const int8_t* const* x, __m256i (*dot)[2]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i p[R][2];
  for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = _mm256_setzero_si256();
  for (int s = 0; s < 4; ++s) {
    __m256i xlo[R], xhi[R];
    for (int r = 0; r < R; ++r) {
      xlo[r] = bcast4(x[r] + 4 * s);
      xhi[r] = bcast4(x[r] + 4 * s + 16);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(src + 64 * s + 32 * h);
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      for (int r = 0; r < R; ++r) {
        p[r][h] = _mm256_add_epi16(p[r][h], _mm256_maddubs_epi16(lo, xlo[r]));
        p[r][h] = _mm256_add_epi16(p[r][h], _mm256_maddubs_epi16(hi, xhi[r]));
      }
    }
  }
  const __m256i one = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(p[r][h], one);
}

// The same for 8-bit weights, split into nibbles (high nibble sums shifted by 4).
template <int R>
inline void dots8(const uint8_t* src, const int8_t* const* x, __m256i (*dot)[2]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256i plo[R], phi[R];
    for (int r = 0; r < R; ++r) plo[r] = phi[r] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const __m256i v = load32(src + 64 * s + 32 * h);
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = bcast4(x[r] + 4 * s);
        plo[r] = _mm256_add_epi16(plo[r], _mm256_maddubs_epi16(lo, xb));
        phi[r] = _mm256_add_epi16(phi[r], _mm256_maddubs_epi16(hi, xb));
      }
    }
    for (int r = 0; r < R; ++r)
      dot[r][h] = _mm256_add_epi32(_mm256_madd_epi16(plo[r], one),
                                   _mm256_slli_epi32(_mm256_madd_epi16(phi[r], one), 4));
  }
}

// Outputs [m0, m0 + R) x group g (16 rows): R rows share each load of the weights.
template <int R>
void tile(const Problem& p, int64_t m0, int64_t g) {
  const QuantAct& a = *p.a;
  const uint8_t* wg = p.w + g * a.nb * p.block_bytes;
  __m256 acc[R][2];
  __m256i iacc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      acc[r][h] = _mm256_setzero_ps();
      iacc[r][h] = _mm256_setzero_si256();
    }
  const bool first_tile = m0 % M_BLOCK == 0;  // later tiles of the group find it cached
  for (int64_t b = 0; b < a.nb; ++b) {
    if (first_tile) prefetch_ahead(p, g, b, a.nb);
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q.data() + (m0 + r) * a.k + b * QK;
    __m256i dot[R][2];
    if (p.bits == 8) {
      dots8<R>(wg + b * p.block_bytes, x, dot);
    } else {
      dots4<R>(wg + b * p.block_bytes, x, dot);
    }
    if (!p.per_block) {
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) iacc[r][h] = _mm256_add_epi32(iacc[r][h], dot[r][h]);
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t si = (g * a.nb + b) * LANES + 8 * h;
      const __m256 wd = load_scale8(p.wd, p.hd, si), wm = load_scale8(p.wm, p.hm, si);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * a.nb + b;
        const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(a.d[i]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), scale, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(wm, _mm256_set1_ps(a.s[i]), acc[r][h]);
      }
    }
  }
  alignas(32) float out[LANES];
  alignas(32) float ws[LANES] = {};
  if (!p.per_block)
    for (int64_t l = 0; l < LANES && g * LANES + l < p.n; ++l) ws[l] = p.wd[g * LANES + l];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      if (!p.per_block) {  // float(acc - 128 sum(xq)) * xd[m] * ws[n]
        const int32_t offset = 128 * static_cast<int32_t>(a.s[m0 + r]);
        const __m256 v =
            _mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[r][h], _mm256_set1_epi32(offset)));
        acc[r][h] = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(a.d[m0 + r])),
                                  _mm256_load_ps(ws + 8 * h));
      }
      _mm256_store_ps(out + 8 * h, acc[r][h]);
    }
    store(p, m0 + r, g * LANES, out);
  }
}
#else
// Portable form (no VNNI, no AVX2): the same integer dots and float operations, one lane at a
// time.
template <int MT>
void tile(const Problem& p, int64_t m0, int64_t g) {
  const QuantAct& a = *p.a;
  for (int i = 0; i < MT; ++i) {
    const int64_t m = m0 + i;
    float out[LANES];
    for (int64_t l = 0; l < LANES; ++l) {
      float acc = 0.f;
      int32_t iacc = 0;
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* src = p.w + (g * a.nb + b) * p.block_bytes;
        int32_t dot = 0;
        for (int64_t e = 0; e < QK; ++e) {
          const int64_t s = e / 4, j = e % 4;
          const uint8_t q = p.bits == 8 ? src[64 * s + 4 * l + j]
                                        : (src[64 * (s % 4) + 4 * l + j] >> (s < 4 ? 0 : 4)) & 0x0F;
          dot += int32_t(q) * int32_t(a.q[m * a.k + b * QK + e]);
        }
        if (p.per_block) {
          const int64_t wi = (g * a.nb + b) * LANES + l, r = m * a.nb + b;
          const float wd = p.hd != nullptr ? static_cast<float>(p.hd[wi]) : p.wd[wi];
          const float wm = p.hm != nullptr ? static_cast<float>(p.hm[wi]) : p.wm[wi];
          acc = std::fma(static_cast<float>(dot), wd * a.d[r], acc);
          acc = std::fma(wm, a.s[r], acc);
        } else {
          iacc += dot;
        }
      }
      if (!p.per_block) {
        const int64_t n = std::min(g * LANES + l, p.n - 1);
        acc = static_cast<float>(iacc - 128 * static_cast<int32_t>(a.s[m])) * a.d[m] * p.wd[n];
      }
      out[l] = acc;
    }
    store(p, m, g * LANES, out);
  }
}
#endif

void run(const Problem& p, int64_t m) {
  const int64_t groups = (p.n + LANES - 1) / LANES;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
      const int64_t m1 = std::min(m, m0 + M_BLOCK);
      for (int64_t g = g0; g < g1; ++g) {
        int64_t r = m0;
#ifdef SOUS_QGEMM_VNNI  // 32 vector registers: eight rows' accumulators fit
        if (p.per_block && m1 - m0 >= 4 && g + 1 < g1) {  // two groups at once
          for (; r + 4 <= m1; r += 4) tile2(p, r, g);
          for (; r < m1; ++r) {
            tile<1>(p, r, g);
            tile<1>(p, r, g + 1);
          }
          ++g;
          continue;
        }
        for (; r + 8 <= m1; r += 8) tile<8>(p, r, g);
#endif
        for (; r + 4 <= m1; r += 4) tile<4>(p, r, g);
        for (; r < m1; ++r) tile<1>(p, r, g);
      }
    }
  });
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qgemm: x must be a contiguous 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) == k, "qgemm: x has ", x.size(1), " columns, the weight ", k);
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, at::Tensor& keep, int64_t n) {
  if (!bias.has_value()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(keep.numel() == n, "qgemm: bias must have N elements");
  return keep.data_ptr<float>();
}

}  // namespace

bool qgemm_simd() {
#if defined(SOUS_QGEMM_VNNI) || defined(SOUS_QGEMM_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& wd,
                 const at::Tensor& wm, int64_t n, int64_t bits,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits must be 4 or 8");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(2) == 16 * bits * 4 && w.size(0) == (n + LANES - 1) / LANES,
              "qgemm: w must be packed contiguous uint8 [N / 16, K / 32, 64 * bits]");
  const int64_t k = w.size(1) * QK;
  check_x(x, k);
  const bool half = wd.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&wd, &wm}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || half) &&
                    t->scalar_type() == wd.scalar_type() && t->is_contiguous() &&
                    t->numel() == w.size(0) * w.size(1) * LANES,
                "qgemm: scales must be contiguous float32 or float16 [N / 16, K / 32, 16]");
  }
  at::Tensor keep;
  const float* bp = bias_ptr(bias, keep, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const QuantAct a = quantize(x, true);
  run(Problem{&a, w.data_ptr<uint8_t>(), half ? nullptr : wd.data_ptr<float>(),
              half ? nullptr : wm.data_ptr<float>(), half ? wd.data_ptr<c10::Half>() : nullptr,
              half ? wm.data_ptr<c10::Half>() : nullptr, bp, n, bits, w.size(2), true,
              x.scalar_type(), y.data_ptr()},
      x.size(0));
  return y;
}

at::Tensor qgemm_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws, int64_t n,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(2) == 512 && w.size(0) == (n + LANES - 1) / LANES,
              "qgemm_i8: w must be packed contiguous uint8 [N / 16, K / 32, 512]");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() == n,
              "qgemm_i8: ws must be contiguous float32 [N]");
  const int64_t k = w.size(1) * QK;
  check_x(x, k);
  at::Tensor keep;
  const float* bp = bias_ptr(bias, keep, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const QuantAct a = quantize(x, false);
  run(Problem{&a, w.data_ptr<uint8_t>(), ws.data_ptr<float>(), nullptr, nullptr, nullptr, bp, n,
              8, 512, false, x.scalar_type(), y.data_ptr()},
      x.size(0));
  return y;
}

}  // namespace sous
