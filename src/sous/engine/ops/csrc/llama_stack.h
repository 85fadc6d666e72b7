// LlamaStack: the decoder layers of a Llama model whose linears are qgemm block weights, run
// in one C++ call per step (llama_stack.cpp). Built once from the loaded model's tensors
// (shared, never mutated); `forward` takes what one step's Python forward takes.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace sous {

struct QLinear {
  at::Tensor w, wd, wm;  // qgemm's packed weight, scales, minimums
  int64_t n = 0, bits = 4;
  std::optional<at::Tensor> bias;
};

struct LlamaLayer {
  at::Tensor in_norm, post_norm;
  double eps = 1e-6;
  QLinear qkv, o, gate_up, down;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double scale = 1.0, k_scale = 1.0, v_scale = 1.0;
};

struct LlamaStack {
  std::vector<LlamaLayer> layers;

  // (h, residual) after the last layer, before the final norm: h [T, H] float32 or bfloat16,
  // one KV cache per layer; then the step's attention metadata (gqa_attention's); `residual`
  // is the stream entering the first layer beside h (none for the model's layer 0), as
  // LlamaDecoderLayer.forward takes it, so a model split into stacks computes what one does.
  // A step of more than 256 tokens runs as sub-steps of at most 256 (llama_stack.cpp), with
  // the same results and a smaller peak of memory.
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor h, const std::vector<at::Tensor>& kv_caches, const at::Tensor& cos,
      const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& slot_mapping,
      const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& seq_lens,
      const at::Tensor& block_table, int64_t block_size,
      const std::optional<at::Tensor>& residual) const;
};

}  // namespace sous
