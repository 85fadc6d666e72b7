// Rows of a qgemm-packed weight, dequantised: the token embedding of a GGUF model read from
// its (tied) output head's blocks. Layout as in qgemm.cpp: output row r is lane r % 16 of
// group r / 16; per block of 32, element 4 s + j of a lane sits at byte 64 s + 4 lane + j
// (8 bits), or in the low (s < 4) / high (s >= 4) nibble of byte 64 (s % 4) + 4 lane + j.
//
// value = float(q) * scale + min, multiplied then added (two roundings, as GGUF's own
// dequantisation and torch do; never fused into one fma).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "ops.h"

#pragma GCC optimize("fp-contract=off")

namespace sous {
namespace {

constexpr int64_t QK = 32;
constexpr int64_t LANES = 16;

template <typename S, typename O>
void gather(const uint8_t* w, const S* wd, const S* wm, int64_t nb, int64_t block_bytes,
            int64_t bits, const int64_t* ids, int64_t t, O* out) {
  const int64_t k = nb * QK;
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = ids[r] / LANES, lane = ids[r] % LANES;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* src = w + (g * nb + b) * block_bytes + 4 * lane;
        const int64_t si = (g * nb + b) * LANES + lane;
        const float d = static_cast<float>(wd[si]), m = static_cast<float>(wm[si]);
        for (int64_t e = 0; e < QK; ++e) {
          const int64_t s = e / 4, j = e % 4;
          const int q = bits == 8 ? src[64 * s + j]
                                  : (src[64 * (s % 4) + j] >> (s < 4 ? 0 : 4)) & 15;
          const float scaled = static_cast<float>(q) * d;
          out[r * k + b * QK + e] = static_cast<O>(scaled + m);
        }
      }
    }
  });
}

template <typename S>
void dispatch_out(const at::Tensor& w, const S* wd, const S* wm, int64_t bits,
                  const at::Tensor& ids, at::Tensor& y) {
  const int64_t nb = w.size(1), t = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  if (y.scalar_type() == at::kBFloat16) {
    gather(w.data_ptr<uint8_t>(), wd, wm, nb, w.size(2), bits, ip, t,
           y.data_ptr<c10::BFloat16>());
  } else {
    gather(w.data_ptr<uint8_t>(), wd, wm, nb, w.size(2), bits, ip, t, y.data_ptr<float>());
  }
}

}  // namespace

at::Tensor qgemm_rows(const at::Tensor& w, const at::Tensor& wd, const at::Tensor& wm, int64_t n,
                      int64_t bits, const at::Tensor& ids, at::ScalarType out_type) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm_rows: bits must be 4 or 8");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(2) == 16 * bits * 4 && w.size(0) == (n + LANES - 1) / LANES,
              "qgemm_rows: w must be packed contiguous uint8 [N / 16, K / 32, 64 * bits]");
  TORCH_CHECK(wd.scalar_type() == wm.scalar_type() &&
                  (wd.scalar_type() == at::kFloat || wd.scalar_type() == at::kHalf) &&
                  wd.is_contiguous() && wm.is_contiguous() &&
                  wd.numel() == w.size(0) * w.size(1) * LANES && wm.numel() == wd.numel(),
              "qgemm_rows: scales must be contiguous float32 or float16 [N / 16, K / 32, 16]");
  TORCH_CHECK(out_type == at::kFloat || out_type == at::kBFloat16,
              "qgemm_rows: out dtype must be float32 or bfloat16");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "qgemm_rows: ids must be a 1-D int64 tensor");
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "qgemm_rows: id ", ip[i], " out of range [0, ", n, ")");
  at::Tensor y = at::empty({idc.size(0), w.size(1) * QK}, w.options().dtype(out_type));
  if (wd.scalar_type() == at::kHalf) {
    dispatch_out(w, wd.data_ptr<c10::Half>(), wm.data_ptr<c10::Half>(), bits, idc, y);
  } else {
    dispatch_out(w, wd.data_ptr<float>(), wm.data_ptr<float>(), bits, idc, y);
  }
  return y;
}

}  // namespace sous
