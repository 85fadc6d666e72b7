// SIMD building blocks of the CPU attention kernels: float32 math over rows of K/V read
// straight from the paged cache. Every function has an AVX-512 body and an AVX2 + FMA body (the
// extension is built with -march=native, so one of them or neither is compiled in) and a
// portable scalar body the compiler may vectorise on other CPUs. Each computes a row the same
// way whichever rows are processed with it, so results stay batch-invariant.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SOUS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SOUS_AVX2 1
#endif

namespace sous {

// Element type of a KV cache.
enum class KvType : int { F32 = 0, BF16 = 1, F16 = 2, FP8E4M3 = 3 };

inline int kv_elem_size(KvType t) {
  return t == KvType::F32 ? 4 : (t == KvType::FP8E4M3 ? 1 : 2);
}

inline float fp8e4m3_to_float(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xF, m = b & 7;
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;  // subnormal: m * 2^-9
  } else {
    const uint32_t bits = ((e + 120) << 23) | (m << 20);
    std::memcpy(&v, &bits, 4);
  }
  return (b & 0x80) ? -v : v;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// dst[0:n] = float(src[0:n]) * scale, src in the cache's element type.
inline void convert_row(const void* src, KvType t, int n, float scale, float* dst) {
  int i = 0;
#ifdef SOUS_AVX512
  const __m512 vs = _mm512_set1_ps(scale);
  if (t == KvType::FP8E4M3) {
    const auto* s = static_cast<const uint8_t*>(src);
    for (; i + 16 <= n; i += 16) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
      __m512 normal = _mm512_castsi512_ps(
          _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
      __m512 sub = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(7))),
          _mm512_set1_ps(0.001953125f));
      __mmask16 is_sub =
          _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x78)),
                                  _mm512_setzero_si512());
      __m512 v = _mm512_mul_ps(_mm512_mask_blend_ps(is_sub, normal, sub), vs);
      __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      _mm512_storeu_ps(dst + i,
                       _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign)));
    }
  } else if (t == KvType::BF16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (; i + 16 <= n; i += 16) {
      __m512i w =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), vs));
    }
  } else if (t == KvType::F16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (; i + 16 <= n; i += 16) {
      __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(v, vs));
    }
  }
#elif defined(SOUS_AVX2)
  const __m256 vs = _mm256_set1_ps(scale);
  if (t == KvType::BF16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (; i + 8 <= n; i += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), vs));
    }
  } else if (t == KvType::F16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(v, vs));
    }
  }
#endif
  switch (t) {
    case KvType::F32: {
      const auto* s = static_cast<const float*>(src);
      for (; i < n; ++i) dst[i] = s[i] * scale;
      break;
    }
    case KvType::BF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (; i < n; ++i) dst[i] = bf16_to_float(s[i]) * scale;
      break;
    }
    case KvType::F16: {
      const auto* s = static_cast<const c10::Half*>(src);
      for (; i < n; ++i) dst[i] = static_cast<float>(s[i]) * scale;
      break;
    }
    case KvType::FP8E4M3: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (; i < n; ++i) dst[i] = fp8e4m3_to_float(s[i]) * scale;
      break;
    }
  }
}

#ifdef SOUS_AVX512
// bfloat16 <-> float32 for 16 lanes, bit-identical to c10::BFloat16's scalar conversions
// (round to nearest even; NaN becomes 0x7FC0).
inline __m512 bf16_load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The bfloat16 bits of v in the upper half of each lane, the lower half zero: the value as
// stored in bfloat16, read back as float32 (round_t<BFloat16>).
inline __m512 bf16_round16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000)));
}

// Stores an already rounded (bf16_round16) vector as 16 bfloat16 values.
inline void bf16_store16(c10::BFloat16* p, __m512 rounded) {
  const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
}

// The 16 horizontal sums of v[0..15], as one vector (lane j = sum of v[j]).
inline __m512 hsum16(__m512* v) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; ++k) {
    __m512 a = v[2 * k], b = v[2 * k + 1];
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int k = 0; k < 4; ++k) {
    __m512 a = w[2 * k], b = w[2 * k + 1];
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                             _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                             _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88),
                       _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-103.0f));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}

inline __mmask16 tail_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
#elif defined(SOUS_AVX2)
// The 8 horizontal sums of v[0..7], as one vector (lane j = sum of v[j]).
inline __m256 hsum8(const __m256* v) {
  const __m256 x0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 x1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(x0, x1, 0x20), _mm256_permute2f128_ps(x0, x1, 0x31));
}

// exp512's polynomial with 2^n built in the exponent bits: inputs are clamped to [-87.34, 88]
// (normal results) and lanes below -87.34 (exp < FLT_MIN) give 0.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
#endif

// out[j] = scale * dot(q[0:d], k[j][0:d]) for the 16 rows k[0..15].
inline void scores16(const float* q, const float* const* k, int d, float scale, float* out) {
#ifdef SOUS_AVX512
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + i), acc[j]);
  }
  if (i < d) {
    const __mmask16 m = tail_mask(d - i);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k[j] + i), acc[j]);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
#elif defined(SOUS_AVX2)
  for (int h = 0; h < 16; h += 8) {  // two halves of 8 rows: 8 accumulators stay in registers
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[h + j] + i), acc[j]);
    }
    alignas(32) float part[8];
    _mm256_store_ps(part, hsum8(acc));
    for (int j = 0; j < 8; ++j) {
      float tail = 0.f;
      for (int e = i; e < d; ++e) tail += q[e] * k[h + j][e];
      out[h + j] = (part[j] + tail) * scale;
    }
  }
#else
  for (int j = 0; j < 16; ++j) {
    float s = 0.f;
    const float* kj = k[j];
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; ++i) s += q[i] * kj[i];
    out[j] = s * scale;
  }
#endif
}

inline float max_n(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
  int i = 0;
#ifdef SOUS_AVX512
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    vm = _mm512_mask_max_ps(vm, m, vm, _mm512_maskz_loadu_ps(m, x + i));
  }
  return _mm512_reduce_max_ps(vm);
#elif defined(SOUS_AVX2)
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
    m = hmax(vm);
  }
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[0:n] = exp(x[0:n] - mx); returns their sum.
inline float exp_shift_sum(float* x, int n, float mx) {
  int i = 0;
  float sum = 0.f;
#ifdef SOUS_AVX512
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vm));
    _mm512_mask_storeu_ps(x + i, m, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    i = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(SOUS_AVX2)
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {  // the same exp for the tail lanes
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 e = _mm256_and_ps(
        _mm256_castsi256_ps(m), exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), vm)));
    _mm256_maskstore_ps(x + i, m, e);
    acc = _mm256_add_ps(acc, e);
    i = n;
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}

inline void scale_n(float* x, int n, float a) {
#pragma omp simd
  for (int i = 0; i < n; ++i) x[i] *= a;
}

// o[i][0:dv] += sum_{j<n} P[i][j] * v[j][0:dv] for the R rows (R <= 4; V loads shared).
template <int R>
inline void axpy_rows_multi(float* const* o, const float* P, int ldp, const float* const* v,
                            int n, int dv) {
  int c = 0;
#ifdef SOUS_AVX512
  for (; c + 64 <= dv; c += 64) {
    __m512 acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < 4; ++g) acc[i][g] = _mm512_loadu_ps(o[i] + c + 16 * g);
    for (int j = 0; j < n; ++j) {
      const float* vj = v[j] + c;
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
      const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
      for (int i = 0; i < R; ++i) {
        const __m512 pb = _mm512_set1_ps(P[i * ldp + j]);
        acc[i][0] = _mm512_fmadd_ps(pb, v0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(pb, v1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(pb, v2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(pb, v3, acc[i][3]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < 4; ++g) _mm512_storeu_ps(o[i] + c + 16 * g, acc[i][g]);
  }
  for (; c < dv; c += 16) {
    const __mmask16 m = tail_mask(std::min(16, dv - c));
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_maskz_loadu_ps(m, o[i] + c);
    for (int j = 0; j < n; ++j) {
      const __m512 vj = _mm512_maskz_loadu_ps(m, v[j] + c);
      for (int i = 0; i < R; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(P[i * ldp + j]), vj, acc[i]);
    }
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(o[i] + c, m, acc[i]);
  }
#elif defined(SOUS_AVX2)
  for (; c + 16 <= dv; c += 16) {  // R x 2 accumulators + 2 value vectors fit 16 registers
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < 2; ++g) acc[i][g] = _mm256_loadu_ps(o[i] + c + 8 * g);
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v[j] + c), v1 = _mm256_loadu_ps(v[j] + c + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 pb = _mm256_set1_ps(P[i * ldp + j]);
        acc[i][0] = _mm256_fmadd_ps(pb, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(pb, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < 2; ++g) _mm256_storeu_ps(o[i] + c + 8 * g, acc[i][g]);
  }
#endif
#ifndef SOUS_AVX512
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < n; ++j) {
      const float pj = P[i * ldp + j];
      const float* vj = v[j];
      float* oi = o[i];
#pragma omp simd
      for (int k = c; k < dv; ++k) oi[k] += pj * vj[k];
    }
#endif
}

}  // namespace sous
