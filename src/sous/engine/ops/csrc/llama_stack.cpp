// A Llama decoder stack in one call (llama_stack.h): the kernels the Python layers of
// sous/models/llama.py call one by one, called here in the same order with the same
// arguments, so every result is bit-identical; what goes away is the Python between them.
#include "llama_stack.h"

#include <ATen/ATen.h>

namespace sous {

namespace {

// BlockQuantLinear.forward: x (float32 or bfloat16) in, the same dtype out.
at::Tensor linear(const at::Tensor& x, const QLinear& l) {
  at::Tensor y = qgemm(x.contiguous(), l.w, l.wd, l.wm, l.n, l.bits, l.bias);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> LlamaStack::forward(
    at::Tensor h, const std::vector<at::Tensor>& kv_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& seq_lens,
    const at::Tensor& block_table, int64_t block_size,
    const std::optional<at::Tensor>& residual_in) const {
  TORCH_CHECK(kv_caches.size() == layers.size(), "LlamaStack: ", layers.size(),
              " layers, ", kv_caches.size(), " KV caches");
  const int64_t t = h.size(0);
  at::Tensor residual = residual_in.has_value() ? *residual_in : at::Tensor();
  for (size_t i = 0; i < layers.size(); ++i) {
    const LlamaLayer& L = layers[i];
    at::Tensor x;
    if (!residual.defined()) {  // LlamaDecoderLayer.forward of the first layer
      residual = h;
      x = std::get<0>(rms_norm(h, L.in_norm, L.eps, std::nullopt));
    } else {
      std::tie(x, residual) = rms_norm(h, L.in_norm, L.eps, residual);
    }
    // LlamaAttention.forward
    const int64_t q_size = L.num_heads * L.head_dim;
    const int64_t kv_size = L.num_kv_heads * L.head_dim;
    at::Tensor qkv = linear(x, L.qkv);
    at::Tensor qk = rotary_interleaved(qkv.narrow(1, 0, q_size + kv_size).view({t, -1, L.head_dim}),
                                       cos, sin, positions);
    at::Tensor q = qk.narrow(1, 0, L.num_heads);
    at::Tensor k = qk.narrow(1, L.num_heads, L.num_kv_heads);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, L.num_kv_heads, L.head_dim});
    at::Tensor o = gqa_attention(q, k, v, kv_caches[i], slot_mapping, q_start, q_len, seq_lens,
                                 block_table, block_size, L.scale, L.k_scale, L.v_scale);
    x = linear(o.reshape({t, q_size}), L.o);
    std::tie(x, residual) = rms_norm(x, L.post_norm, L.eps, residual);
    // LlamaMLP.forward
    h = linear(silu_and_mul(linear(x, L.gate_up)), L.down);
  }
  return {h, residual};
}

}  // namespace sous
