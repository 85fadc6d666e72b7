#include <torch/extension.h>

#include "llama_stack.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sous CPU ops: attention that reads K/V through the block table";
  m.def("paged_attention", &sous::paged_attention,
        "Varlen causal (or index-selected) attention over a paged KV cache");
  m.def("gqa_attention", &sous::gqa_attention,
        "Store a step's new K/V in a GQA paged cache, then attend every sequence");
  m.def("index_scores", &sous::index_scores,
        "DeepSeek sparse-attention indexer scores over a paged key cache");
  m.def("pin_omp_threads", &sous::pin_omp_threads,
        "Pin OpenMP thread t of the calling thread's pool to cpu_sets[t]; returns the placement");
  m.def("omp_thread_cpus", &sous::omp_thread_cpus,
        "The CPUs each thread of an n-thread OpenMP team may run on");
  m.def("quantize_rows_int8", &sous::quantize_rows_int8,
        "Per-row symmetric int8 quantisation of a float32 matrix: (int8, scale [M, 1])");
  m.def("rescale_int32", &sous::rescale_int32,
        "float(acc) * x_scale[row] * w_scale[col] (+ bias) for an int32 matmul result");
  m.def("qgemm", &sous::qgemm,
        "x @ W^T for block-quantised W (GGUF Q4_0/Q4_1/Q8_0) with int8 block activations");
  m.def("qgemm_i8", &sous::qgemm_i8,
        "x @ W^T for per-channel int8 W with per-row int8 activations (exact int32 sums)");
  m.def("qgemm_simd", &sous::qgemm_simd, "True when qgemm runs on AVX-512 VNNI or AVX2");
  m.def("qgemm_rows", &sous::qgemm_rows,
        "Rows of a qgemm-packed block weight, dequantised (a quantised token embedding)");
  m.def("rms_norm", &sous::rms_norm, "Residual add + RMSNorm in one pass: (out, new residual)");
  m.def("rotary_interleaved", &sous::rotary_interleaved,
        "Rotary embedding of [T, H, D] rows whose pairs are adjacent");
  m.def("silu_and_mul", &sous::silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  py::class_<sous::QLinear>(m, "QLinear")
      .def(py::init<>())
      .def_readwrite("w", &sous::QLinear::w)
      .def_readwrite("wd", &sous::QLinear::wd)
      .def_readwrite("wm", &sous::QLinear::wm)
      .def_readwrite("n", &sous::QLinear::n)
      .def_readwrite("bits", &sous::QLinear::bits)
      .def_readwrite("bias", &sous::QLinear::bias);
  py::class_<sous::LlamaLayer>(m, "LlamaLayer")
      .def(py::init<>())
      .def_readwrite("in_norm", &sous::LlamaLayer::in_norm)
      .def_readwrite("post_norm", &sous::LlamaLayer::post_norm)
      .def_readwrite("eps", &sous::LlamaLayer::eps)
      .def_readwrite("qkv", &sous::LlamaLayer::qkv)
      .def_readwrite("o", &sous::LlamaLayer::o)
      .def_readwrite("gate_up", &sous::LlamaLayer::gate_up)
      .def_readwrite("down", &sous::LlamaLayer::down)
      .def_readwrite("num_heads", &sous::LlamaLayer::num_heads)
      .def_readwrite("num_kv_heads", &sous::LlamaLayer::num_kv_heads)
      .def_readwrite("head_dim", &sous::LlamaLayer::head_dim)
      .def_readwrite("scale", &sous::LlamaLayer::scale)
      .def_readwrite("k_scale", &sous::LlamaLayer::k_scale)
      .def_readwrite("v_scale", &sous::LlamaLayer::v_scale);
  py::class_<sous::LlamaStack>(m, "LlamaStack")
      .def(py::init<>())
      .def("append", [](sous::LlamaStack& s, const sous::LlamaLayer& l) { s.layers.push_back(l); })
      .def("__len__", [](const sous::LlamaStack& s) { return s.layers.size(); })
      .def("forward", &sous::LlamaStack::forward, py::call_guard<py::gil_scoped_release>(),
           "All decoder layers of one step: (h, residual) before the final norm");
}
