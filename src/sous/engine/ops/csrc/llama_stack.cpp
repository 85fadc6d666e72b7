// A Llama decoder stack in one call (llama_stack.h): the kernels the Python layers of
// sous/models/llama.py call one by one, called here in the same order with the same
// arguments, so every result is bit-identical; what goes away is the Python between them.
#include "llama_stack.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace sous {

namespace {

// Tokens per sub-step. A longer step runs the layers over consecutive ranges of at most this
// many tokens, each range through every layer before the next starts: chunked prefill within
// one step. A range attends to the earlier ranges' keys and values in the cache (gqa_attention
// stores a range's own before attending), and every kernel computes a row the same way
// whatever rows share its call, so the results are bit-identical to one pass. What changes is
// memory: a 2048-token step's activations (~60 MB per layer for SmolLM2-135M in float32, the
// largest allocations the server makes) are never resident at once.
constexpr int64_t kSubStepTokens = 256;

// One step's (or sub-step's) attention metadata, as LlamaStack::forward takes it.
struct StepMeta {
  at::Tensor positions, slot_mapping, q_start, q_len, seq_lens, block_table;
};

// The metadata of tokens [a, b) of `m`: the sequences with queries among them, their queries
// cut to the range, their lengths ending at their last query in it.
StepMeta sub_step(const StepMeta& m, int64_t a, int64_t b) {
  const at::Tensor qs_t = m.q_start.to(at::kInt).contiguous();
  const at::Tensor ql_t = m.q_len.to(at::kInt).contiguous();
  const at::Tensor sl_t = m.seq_lens.to(at::kInt).contiguous();
  const int32_t *qs = qs_t.data_ptr<int32_t>(), *ql = ql_t.data_ptr<int32_t>();
  const int32_t* sl = sl_t.data_ptr<int32_t>();
  std::vector<int32_t> start, len, seq;
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < qs_t.numel(); ++i) {
    const int64_t lo = std::max<int64_t>(a, qs[i]), hi = std::min<int64_t>(b, qs[i] + ql[i]);
    if (lo >= hi) continue;
    start.push_back(static_cast<int32_t>(lo - a));
    len.push_back(static_cast<int32_t>(hi - lo));
    seq.push_back(static_cast<int32_t>(sl[i] - (qs[i] + ql[i] - hi)));
    rows.push_back(i);
  }
  const auto ints = [](const std::vector<int32_t>& v) {
    return at::tensor(at::ArrayRef<int32_t>(v), at::kInt);
  };
  const at::Tensor picked = at::tensor(at::ArrayRef<int64_t>(rows), at::kLong);
  return {m.positions.narrow(0, a, b - a), m.slot_mapping.narrow(0, a, b - a), ints(start),
          ints(len), ints(seq), m.block_table.index_select(0, picked)};
}

// BlockQuantLinear.forward: x (float32 or bfloat16) in, the same dtype out.
at::Tensor linear(const at::Tensor& x, const QLinear& l) {
  at::Tensor y = qgemm(x.contiguous(), l.w, l.wd, l.wm, l.n, l.bits, l.bias);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// The layers over one (sub-)step: LlamaDecoderLayer.forward after LlamaDecoderLayer.forward.
std::tuple<at::Tensor, at::Tensor> run(const std::vector<LlamaLayer>& layers, at::Tensor h,
                                       const std::vector<at::Tensor>& kv_caches,
                                       const at::Tensor& cos, const at::Tensor& sin,
                                       const StepMeta& m, int64_t block_size,
                                       const std::optional<at::Tensor>& residual_in) {
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
                                       cos, sin, m.positions);
    at::Tensor q = qk.narrow(1, 0, L.num_heads);
    at::Tensor k = qk.narrow(1, L.num_heads, L.num_kv_heads);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, L.num_kv_heads, L.head_dim});
    at::Tensor o = gqa_attention(q, k, v, kv_caches[i], m.slot_mapping, m.q_start, m.q_len,
                                 m.seq_lens, m.block_table, block_size, L.scale, L.k_scale,
                                 L.v_scale);
    x = linear(o.reshape({t, q_size}), L.o);
    std::tie(x, residual) = rms_norm(x, L.post_norm, L.eps, residual);
    // LlamaMLP.forward
    h = linear(silu_and_mul(linear(x, L.gate_up)), L.down);
  }
  return {h, residual};
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
  const StepMeta meta{positions, slot_mapping, q_start, q_len, seq_lens, block_table};
  const int64_t t = h.size(0);
  if (t <= kSubStepTokens)
    return run(layers, h, kv_caches, cos, sin, meta, block_size, residual_in);
  at::Tensor h_out = at::empty_like(h), r_out = at::empty_like(h);
  for (int64_t a = 0; a < t; a += kSubStepTokens) {
    const int64_t n = std::min(kSubStepTokens, t - a);
    std::optional<at::Tensor> r;
    if (residual_in.has_value()) r = residual_in->narrow(0, a, n);
    auto [hs, rs] = run(layers, h.narrow(0, a, n), kv_caches, cos, sin,
                        sub_step(meta, a, a + n), block_size, r);
    h_out.narrow(0, a, n).copy_(hs);
    r_out.narrow(0, a, n).copy_(rs);
  }
  return {h_out, r_out};
}

}  // namespace sous
