// The native kernels' Python module (kernels/native.py builds and loads it).
#include <torch/extension.h>
#include <pybind11/numpy.h>

namespace py = pybind11;

torch::Tensor pack(const torch::Tensor& weight);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     bool amx);
bool paged_decode_supports(int64_t group, int64_t dim);
void paged_decode(const py::array& q, const py::array& pool, const py::array& tables, const py::array& lengths,
                  const py::array& order, float scale, py::array& out, const py::array& out_rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a (out, in) bfloat16 weight in VNNI blocks of 16 output columns");
  m.def("linear", &linear, "rows (m, in) times a packed weight, plus bias; bfloat16 out");
  m.def("paged_decode_supports", &paged_decode_supports, "whether paged_decode has a kernel for this shape");
  m.def("paged_decode", &paged_decode, "decode attention over a bf16 paged KV pool (kernels/paged_attention.py)");
}
