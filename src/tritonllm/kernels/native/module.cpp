// The native kernels' Python module (kernels/native.py builds and loads it).
#include <torch/extension.h>
#include <pybind11/numpy.h>

#include "kernel_api.h"

namespace py = pybind11;

torch::Tensor pack(const torch::Tensor& weight);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     bool amx);
double peak_flops(bool amx, double seconds);
std::vector<torch::Tensor> pack_int8(const torch::Tensor& values, const torch::Tensor& scales);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias);
namespace tritonllm_native {
void add_rms_norm(const py::array& hidden, const py::object& delta, const py::array& weight, float eps, py::array& out);
void silu_mul(const py::array& gate_up, py::array& out);
void rotate_and_store(const py::array& qkv, const py::array& cos, const py::array& sin, const py::array& positions,
                      const py::array& write_index, py::array& pool, py::array& q_out, const py::array& decode_of,
                      py::array& q_decode, int64_t heads);
void bind_decode_layers(py::module_& m);
}  // namespace tritonllm_native
void paged_decode(const py::array& q, const py::array& pool, const py::array& tables, const py::array& lengths,
                  const py::array& order, float scale, py::array& out, const py::array& out_rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a (out, in) bfloat16 weight in VNNI blocks of 16 output columns");
  m.def("linear", &linear, "rows (m, in) times a packed weight, plus bias; bfloat16 out");
  m.def("peak_flops", &peak_flops, "FLOP/s of vdpbf16ps (or AMX tdpbf16ps) on every thread, no memory (benchmarks)");
  m.def("pack_int8", &pack_int8, "(out, in) int8 values (+128 as u8) and their (out, in / 32) scales, in blocks of 16 output columns");
  m.def("linear_int8", &linear_int8, "rows (m, in) quantized to int8 (a scale a 32 of K) times a packed int8 weight, plus bias; bfloat16 out");
  m.def("paged_decode_supports", &tritonllm_native::paged_decode_supports, "whether paged_decode has a kernel for this shape");
  m.def("add_rms_norm", &tritonllm_native::add_rms_norm, "hidden += delta; out = weight x rms_norm(hidden) (layer_kernels.py)");
  m.def("silu_mul", &tritonllm_native::silu_mul, "out = silu(gate) x up (layer_kernels.py)");
  m.def("rotate_and_store", &tritonllm_native::rotate_and_store, "rotary on q and k, k and v to the pool (layer_kernels.py)");
  m.def("paged_decode", &paged_decode, "decode attention over a bf16 paged KV pool (kernels/paged_attention.py)");
  tritonllm_native::bind_decode_layers(m);
}
