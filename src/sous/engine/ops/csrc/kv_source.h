// Where the rows of keys/values live: a paged cache (or a flat tensor, as one "block" per
// sequence) addressed through a block table, in any supported element type.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

#include "vec.h"

namespace sous {

inline KvType kv_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return KvType::F32;
    case at::kBFloat16:
      return KvType::BF16;
    case at::kHalf:
      return KvType::F16;
    case at::kFloat8_e4m3fn:
    case at::kByte:
      return KvType::FP8E4M3;
    default:
      TORCH_CHECK(false, "sous ops: unsupported KV cache dtype ", t.scalar_type());
  }
}

// Rows of one tensor: element (block, offset, head, i) at
// base + block * block_stride + offset * token_stride + head * head_stride + i (in elements).
struct KvSource {
  const char* base = nullptr;
  KvType type = KvType::F32;
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;
  float scale = 1.f;  // applied on read (fp8 caches store x / scale)

  KvSource(const at::Tensor& t, const std::vector<int64_t>& strides, double s) {
    TORCH_CHECK(strides.size() == 3, "sous ops: strides = (block, token, head)");
    base = static_cast<const char*>(t.data_ptr());
    type = kv_type_of(t);
    block_stride = strides[0];
    token_stride = strides[1];
    head_stride = strides[2];
    scale = type == KvType::FP8E4M3 ? static_cast<float>(s) : 1.f;
  }

  const void* row(int64_t block, int64_t offset, int64_t head) const {
    const int64_t e = block * block_stride + offset * token_stride + head * head_stride;
    return base + e * kv_elem_size(type);
  }

  // A float pointer to the row: the cache itself for float32, else `buf` filled with the row
  // converted (and scaled).
  const float* load(int64_t block, int64_t offset, int64_t head, int d, float* buf) const {
    const void* p = row(block, offset, head);
    if (type == KvType::F32) return static_cast<const float*>(p);
    convert_row(p, type, d, scale, buf);
    return buf;
  }
};

// Sequence b's block table row and block size; position -> (block, offset).
struct BlockTable {
  const int32_t* data = nullptr;
  int64_t row_stride = 0;
  int64_t block_size = 1;

  BlockTable(const at::Tensor& t, int64_t bs) : block_size(bs) {
    TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 2 && t.stride(1) == 1,
                "sous ops: block_table must be int32 [B, n] with contiguous rows");
    data = t.data_ptr<int32_t>();
    row_stride = t.stride(0);
  }

  void locate(int64_t b, int64_t pos, int64_t* block, int64_t* offset) const {
    const int64_t j = pos / block_size;
    *block = data[b * row_stride + j];
    *offset = pos - j * block_size;
  }
};

inline const int32_t* int32_data(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "sous ops: ", name,
              " must be contiguous int32");
  return t.data_ptr<int32_t>();
}

}  // namespace sous
