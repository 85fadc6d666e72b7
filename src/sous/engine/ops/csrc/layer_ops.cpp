// The small elementwise steps of a decoder layer, each one pass over the data instead of the
// five to ten torch ops (and temporaries) of its eager form: residual add + RMSNorm, rotary
// embedding (interleaved pairs), SiLU-and-mul. float32 or bfloat16 tensors; the arithmetic is
// float32 with the eager form's roundings to the tensor dtype (bfloat16: after the residual
// add, after the normalisation, after SiLU), so results match it to float32 rounding. Rows are
// independent: a token's result does not depend on the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace sous {
namespace {

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}
// The value as stored in T, read back (bfloat16 rounding; identity for float).
template <typename T>
inline float round_t(float v) {
  return to_f(from_f<T>(v));
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": x must be 2-D float32 or bfloat16 with contiguous rows");
}

// sum(x[i]^2) in SS_LANES interleaved partial sums added up in a fixed order: the same value
// whatever the vector width (the compiler vectorises the lanes), without a serial chain of adds.
constexpr int64_t SS_LANES = 16;
inline float sum_squares(const float* x, int64_t n) {
  float acc[SS_LANES] = {};
  int64_t i = 0;
  for (; i + SS_LANES <= n; i += SS_LANES)
    for (int64_t j = 0; j < SS_LANES; ++j) acc[j] += x[i + j] * x[i + j];
  for (; i < n; ++i) acc[i % SS_LANES] += x[i] * x[i];
  for (int64_t w = SS_LANES / 2; w > 0; w /= 2)
    for (int64_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

#ifdef SOUS_AVX512
// rms_norm_rows' row for bfloat16 with h % 16 == 0: the same operations 16 lanes at a time.
// buf receives the (residual-added) row as float32; returns false when h does not fit.
inline bool rms_norm_row_bf16(const c10::BFloat16* xr, const c10::BFloat16* rr,
                              const c10::BFloat16* wp, double eps, int64_t h, float* buf,
                              c10::BFloat16* ro, c10::BFloat16* orow) {
  if (h % 16 != 0) return false;
  for (int64_t i = 0; i < h; i += 16) {
    __m512 v = bf16_load16(xr + i);
    if (rr != nullptr) {
      v = bf16_round16(_mm512_add_ps(v, bf16_load16(rr + i)));
      bf16_store16(ro + i, v);
    }
    _mm512_storeu_ps(buf + i, v);
  }
  const float inv = 1.f / std::sqrt(sum_squares(buf, h) / static_cast<float>(h) +
                                    static_cast<float>(eps));
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 n = bf16_round16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), vinv));
    bf16_store16(orow + i, bf16_round16(_mm512_mul_ps(n, bf16_load16(wp + i))));
  }
  return true;
}
#endif

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, double eps,
                   at::Tensor& out, at::Tensor& res_out) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = res != nullptr ? res->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* ro = res != nullptr ? res_out.data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(h);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * x.stride(0);
#ifdef SOUS_AVX512
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const T* rr = rp != nullptr ? rp + r * res->stride(0) : nullptr;
        T* rrow = ro != nullptr ? ro + r * h : nullptr;
        if (rms_norm_row_bf16(xr, rr, wp, eps, h, buf.data(), rrow, op + r * h)) continue;
      }
#endif
      for (int64_t i = 0; i < h; ++i) buf[i] = to_f(xr[i]);
      if (rp != nullptr) {
        const T* rr = rp + r * res->stride(0);
        for (int64_t i = 0; i < h; ++i) {
          buf[i] = round_t<T>(buf[i] + to_f(rr[i]));
          ro[r * h + i] = from_f<T>(buf[i]);
        }
      }
      const float inv = 1.f / std::sqrt(sum_squares(buf.data(), h) / static_cast<float>(h) +
                                        static_cast<float>(eps));
      T* orow = op + r * h;
      for (int64_t i = 0; i < h; ++i) {
        // float32: x * inv * w (one rounding); bfloat16: round(round(x * inv) * w), as eager
        orow[i] = from_f<T>(round_t<T>(buf[i] * inv) * to_f(wp[i]));
      }
    }
  });
}

template <typename T>
void rotary_rows(const at::Tensor& x, const float* cp, const float* sp, const int64_t* pos,
                 at::Tensor& out) {
  const int64_t t = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const float* c = cp + pos[i] * half;
      const float* s = sp + pos[i] * half;
      for (int64_t hh = 0; hh < heads; ++hh) {
        const T* xr = xp + i * x.stride(0) + hh * x.stride(1);
        T* orow = op + (i * heads + hh) * 2 * half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_f(xr[2 * j]), b = to_f(xr[2 * j + 1]);
          orow[2 * j] = from_f<T>(a * c[j] - b * s[j]);
          orow[2 * j + 1] = from_f<T>(a * s[j] + b * c[j]);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(d);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * x.stride(0);
      for (int64_t i = 0; i < d; ++i) e[i] = -to_f(xr[i]);
      int64_t i = 0;
#ifdef SOUS_AVX512
      for (; i + 16 <= d; i += 16) _mm512_storeu_ps(&e[i], exp512(_mm512_loadu_ps(&e[i])));
#elif defined(SOUS_AVX2)
      for (; i + 8 <= d; i += 8) _mm256_storeu_ps(&e[i], exp256(_mm256_loadu_ps(&e[i])));
#endif
      for (; i < d; ++i) e[i] = std::exp(e[i]);
      T* orow = op + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float a = to_f(xr[j]);
        orow[j] = from_f<T>(round_t<T>(a / (1.f + e[j])) * to_f(xr[d + j]));
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const std::optional<at::Tensor>& residual) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(1),
              "rms_norm: weight must be contiguous [H] in x's dtype");
  const at::Tensor* res = residual.has_value() ? &*residual : nullptr;
  if (res != nullptr) {
    check_rows(*res, "rms_norm");
    TORCH_CHECK(res->sizes() == x.sizes() && res->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor res_out = res != nullptr ? at::empty(x.sizes(), x.options()) : at::Tensor();
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows<c10::BFloat16>(x, res, weight, eps, out, res_out);
  } else {
    rms_norm_rows<float>(x, res, weight, eps, out, res_out);
  }
  return {out, res_out};
}

at::Tensor rotary_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rotary_interleaved: x must be [T, H, D] float32/bfloat16, D even, rows contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  sin.sizes() == cos.sizes() && cos.size(1) == x.size(2) / 2,
              "rotary_interleaved: cos/sin must be contiguous float32 [P, D / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "rotary_interleaved: positions must be contiguous int64 [T]");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < positions.numel(); ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "rotary_interleaved: position ", pos[i],
                " outside the table");
  if (x.scalar_type() == at::kBFloat16) {
    rotary_rows<c10::BFloat16>(x, cp, sp, pos, out);
  } else {
    rotary_rows<float>(x, cp, sp, pos, out);
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x must have an even number of columns");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_rows<c10::BFloat16>(x, out);
  } else {
    silu_mul_rows<float>(x, out);
  }
  return out;
}

}  // namespace sous
