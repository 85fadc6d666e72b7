// GQA layers' whole attention step in one call: store the step's new K/V into the paged cache
// [2, num_blocks, block_size, Hkv, D] at their slots, then attend every sequence of the step
// (paged_attention) -- so a layer costs one Python -> C++ crossing.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "kv_source.h"
#include "ops.h"

namespace sous {
namespace {

constexpr float kFp8Max = 448.f;

inline float load_elem(const void* p, at::ScalarType t, int64_t i) {
  switch (t) {
    case at::kFloat:
      return static_cast<const float*>(p)[i];
    case at::kBFloat16:
      return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
    default:
      return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
  }
}

// dst[0:d] (cache element type) = src[0:d] / scale (fp8: saturated to +-448, as write_kv in
// attention.py; other types ignore the scale).
void store_row(const void* src, at::ScalarType st, void* dst, KvType dt, int64_t d, float scale) {
  if (dt == KvType::F32 && st == at::kFloat) {
    std::memcpy(dst, src, d * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float x = load_elem(src, st, i);
    switch (dt) {
      case KvType::F32:
        static_cast<float*>(dst)[i] = x;
        break;
      case KvType::BF16:
        static_cast<c10::BFloat16*>(dst)[i] = c10::BFloat16(x);
        break;
      case KvType::F16:
        static_cast<c10::Half*>(dst)[i] = c10::Half(x);
        break;
      case KvType::FP8E4M3: {
        const float y = std::clamp(scale == 1.f ? x : x / scale, -kFp8Max, kFp8Max);
        static_cast<c10::Float8_e4m3fn*>(dst)[i] = c10::Float8_e4m3fn(y);
        break;
      }
    }
  }
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
              const at::Tensor& slots, double k_scale, double v_scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "sous ops: kv_cache must be a contiguous [2, nb, bs, Hkv, D]");
  const int64_t t = k.size(0), hkv = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == d &&
                    x->stride(2) == 1 && x->scalar_type() == k.scalar_type() &&
                    (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 ||
                     k.scalar_type() == at::kHalf),
                "sous ops: new k/v must be [T, Hkv, D] float32/bfloat16/float16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == t,
              "sous ops: slot_mapping must be contiguous int64 [T]");
  const KvType dt = kv_type_of(kv_cache);
  const int64_t esize = kv_elem_size(dt), src_size = k.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const int64_t half = num_slots * hkv * d * esize;  // bytes of the K (or V) half
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "sous ops: slot ", slot[i], " out of range");
  const at::Tensor* src[2] = {&k, &v};
  const float scales[2] = {static_cast<float>(k_scale), static_cast<float>(v_scale)};
  for (int kv = 0; kv < 2; ++kv) {
    const char* s = static_cast<const char*>(src[kv]->data_ptr());
    const int64_t s0 = src[kv]->stride(0) * src_size, s1 = src[kv]->stride(1) * src_size;
    for (int64_t i = 0; i < t; ++i)
      for (int64_t h = 0; h < hkv; ++h)
        store_row(s + i * s0 + h * s1, k.scalar_type(),
                  base + kv * half + (slot[i] * hkv + h) * d * esize, dt, d, scales[kv]);
  }
}

}  // namespace

at::Tensor gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& q_start, const at::Tensor& q_len,
                         const at::Tensor& seq_lens, const at::Tensor& block_table,
                         int64_t block_size, double scale, double k_scale, double v_scale) {
  write_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale);
  at::Tensor q32 = q.scalar_type() == at::kFloat ? q : q.to(at::kFloat);
  if (q32.stride(2) != 1) q32 = q32.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q32.options());
  const at::Tensor kc = kv_cache.select(0, 0), vc = kv_cache.select(0, 1);
  const std::vector<int64_t> strides = {kc.stride(0), kc.stride(1), kc.stride(2)};
  paged_attention(out, q32, kc, vc, strides, strides, kc.size(0), q_start, q_len, seq_lens,
                  block_table, block_size, kc.size(2), scale, k_scale, v_scale, std::nullopt);
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace sous
