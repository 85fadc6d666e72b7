// W8A8 helpers for Int8Linear (models/layers/int8_linear.py): per-row int8 quantisation of
// activations, and the rescale of an int32 matmul result, each one pass over the data instead
// of the five to six tensor ops (and temporaries) of the eager torch form. Same arithmetic as
// that form: scale = max|x| / 127 (1 for an all-zero row), x8 = round-half-even(x / scale);
// y = float(acc) * x_scale[row] * w_scale[col] (+ bias[col]).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "ops.h"

namespace sous {

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quantize_rows_int8: x must be a contiguous 2-D float32 tensor");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * k;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(row[i]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      sp[r] = s;
      int8_t* out = qp + r * k;
      for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int8_t>(std::nearbyint(row[i] / s));
    }
  });
  return {q, scale};
}

at::Tensor rescale_int32(const at::Tensor& acc, const at::Tensor& x_scale,
                         const at::Tensor& w_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "rescale_int32: acc must be a contiguous 2-D int32 tensor");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(x_scale.numel() == m && w_scale.numel() == n, "rescale_int32: scale shapes");
  at::Tensor y = at::empty({m, n}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.contiguous().data_ptr<float>();
  const float* ws = w_scale.contiguous().data_ptr<float>();
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = ap + r * n;
      float* out = yp + r * n;
      const float s = xs[r];
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(a[j]) * s * ws[j];
      if (bp != nullptr) {
        for (int64_t j = 0; j < n; ++j) out[j] += bp[j];
      }
    }
  });
  return y;
}

}  // namespace sous
