// A decode step's decoder layers in one call (kernels/decode_layers.py), for steps whose rows all decode.
//
// model_runner.py's loop makes ~9 native calls a layer, each a trip through the interpreter, its
// argument checks and an output allocation. Here the step's arguments are checked once and every
// layer runs the same kernels on the same buffers (kernel_api.h), piece after piece: the norm, q|k|v,
// rotary and the KV write, paged attention, o, the norm, gate|up, SiLU x up, down. Each piece is the
// kernel the per-piece ops call, with the same arithmetic, so a row gets the same bits here as in a
// step with prompt rows, which takes the loop (batch invariance, tested).
#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace py = pybind11;

namespace tritonllm_native {
namespace {

constexpr int64_t kCols = 16;  // output columns a packed block (bf16_linear.cpp, int8_linear.cpp)

// A linear from `pack` (bf16: (blocks, k / 2, 16, 2)) or `pack_int8` (u8: (blocks, k / 4, 16, 4), with scales).
struct Linear {
  torch::Tensor packed, scales, bias;  // scales: int8 only; bias: float32, or undefined
  int64_t k = 0, blocks = 0;
  bool amx = false;

  Linear(const py::tuple& spec, const char* name) {
    TORCH_CHECK(spec.size() == 4, "DecodeLayers: ", name, " must be (packed, scales or None, bias or None, amx)");
    packed = spec[0].cast<torch::Tensor>().contiguous();
    const bool int8 = !spec[1].is_none();
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == (int8 ? 4 : 2) &&
                packed.scalar_type() == (int8 ? torch::kByte : torch::kBFloat16),
                "DecodeLayers: ", name, " is not a weight from pack", int8 ? "_int8" : "");
    blocks = packed.size(0);
    k = packed.size(1) * packed.size(3);
    if (int8) {
      scales = spec[1].cast<torch::Tensor>().contiguous();
      TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.dim() == 3 && scales.size(0) == blocks &&
                  scales.size(1) * 32 == k, "DecodeLayers: ", name, "'s scales are not from pack_int8");
    }
    if (!spec[2].is_none()) {
      bias = spec[2].cast<torch::Tensor>().to(torch::kFloat).contiguous();
      TORCH_CHECK(bias.numel() == n(), "DecodeLayers: ", name, "'s bias has ", bias.numel(), " values, not ", n());
    }
    amx = spec[3].cast<bool>();
    TORCH_CHECK(!amx || amx_linear_permitted(), "DecodeLayers: Linux refused AMX tiles to this process");
  }
  int64_t n() const { return blocks * kCols; }
  void check(int64_t in, int64_t out, const char* name) const {
    TORCH_CHECK(k == in && n() == out, "DecodeLayers: ", name, " is (", n(), ", ", k, "), the model needs (", out,
                ", ", in, ")");
  }
  void run(const bf16* x, int64_t m, bf16* out) const {
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (scales.defined())
      int8_linear_into(x, m, k, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), blocks, b, out);
    else
      bf16_linear_into(x, m, k, reinterpret_cast<const bf16*>(packed.data_ptr()), blocks, b, out, amx);
  }
};

torch::Tensor norm_weight(const torch::Tensor& w, int64_t width, const char* name) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == width && w.scalar_type() == torch::kBFloat16, "DecodeLayers: ", name,
              " must be (", width, ",) bfloat16");
  return w.contiguous();
}

const bf16* bits(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }

}  // namespace

class DecodeLayers {
 public:
  struct Layer {
    torch::Tensor input_norm, post_norm, pool;
    Linear qkv, o, gate_up, down;
  };

  // layers: (input_norm, qkv, o, post_norm, gate_up, down, pool) each, a linear as `Linear` takes it and
  // pool the layer's KV (2 kv_heads, blocks, block_size, dim); cos, sin: (positions, dim) rotary tables.
  DecodeLayers(const py::list& layers, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
               int64_t kv_heads, int64_t dim, double eps, double scale)
      : cos_(cos.contiguous()), sin_(sin.contiguous()), heads_(heads), kv_heads_(kv_heads), dim_(dim), eps_(eps),
        scale_(scale) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && paged_decode_supports(heads / kv_heads, dim),
                "DecodeLayers: no paged decode kernel for ", heads, " heads on ", kv_heads, " KV heads of dim ", dim);
    TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == dim && sin_.sizes() == cos_.sizes() &&
                cos_.scalar_type() == torch::kBFloat16 && sin_.scalar_type() == torch::kBFloat16,
                "DecodeLayers: cos and sin must be (positions, ", dim, ") bfloat16");
    TORCH_CHECK(!layers.empty(), "DecodeLayers: no layers");
    for (const py::handle item : layers) {
      const py::tuple t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 7, "DecodeLayers: a layer is (input_norm, qkv, o, post_norm, gate_up, down, pool)");
      Layer layer{torch::Tensor(), torch::Tensor(), t[6].cast<torch::Tensor>(), Linear(t[1].cast<py::tuple>(), "qkv"),
                  Linear(t[2].cast<py::tuple>(), "o"), Linear(t[4].cast<py::tuple>(), "gate_up"),
                  Linear(t[5].cast<py::tuple>(), "down")};
      const int64_t hidden = layer.o.n(), inner = layer.down.k;
      layer.input_norm = norm_weight(t[0].cast<torch::Tensor>(), hidden, "input_norm");
      layer.post_norm = norm_weight(t[3].cast<torch::Tensor>(), hidden, "post_norm");
      layer.qkv.check(hidden, (heads + 2 * kv_heads) * dim, "qkv");
      layer.o.check(heads * dim, hidden, "o");
      layer.gate_up.check(hidden, 2 * inner, "gate_up");
      layer.down.check(inner, hidden, "down");
      const torch::Tensor& pool = layer.pool;
      TORCH_CHECK(pool.dim() == 4 && pool.size(0) == 2 * kv_heads && pool.size(3) == dim && pool.is_contiguous() &&
                  pool.scalar_type() == torch::kBFloat16, "DecodeLayers: a pool must be (", 2 * kv_heads,
                  ", blocks, block_size, ", dim, ") bfloat16, contiguous");
      TORCH_CHECK(layers_.empty() || (pool.sizes() == layers_[0].pool.sizes() && hidden == layers_[0].o.n()),
                  "DecodeLayers: the layers differ in shape");
      layers_.push_back(std::move(layer));
    }
  }

  // hidden (rows, width) bf16: the step's embeddings, one row a decode row, added to in place; positions,
  // write_index (rows,): each row's position and KV slot; tables, lengths, order as paged_decode takes
  // them. Returns the last layer's output (rows, width), not yet added (as the loop leaves it).
  torch::Tensor forward(const torch::Tensor& hidden, const py::array& positions, const py::array& write_index,
                        const py::array& tables, const py::array& lengths, const py::array& order) {
    const char* op = "DecodeLayers.forward";
    const Layer& first = layers_[0];
    const int64_t width = first.o.n(), rows = hidden.size(0);
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == width && hidden.is_contiguous() &&
                hidden.scalar_type() == torch::kBFloat16, op, ": hidden must be (rows, ", width, ") bfloat16");
    const int64_t* pos = data_of<int64_t>(positions, op, "positions", 1);
    const int64_t* slot = data_of<int64_t>(write_index, op, "write_index", 1);
    const int64_t blocks = first.pool.size(1), block_size = first.pool.size(2), slots = blocks * block_size;
    const PagedRows paged{data_of<int64_t>(tables, op, "tables", 2), data_of<int64_t>(lengths, op, "lengths", 1),
                          data_of<int64_t>(order, op, "order", 1), rows, tables.shape(1), kv_heads_,
                          heads_ / kv_heads_, dim_, blocks, block_size, static_cast<float>(scale_)};
    TORCH_CHECK(positions.shape(0) == rows && write_index.shape(0) == rows && tables.shape(0) == rows &&
                lengths.shape(0) == rows && order.shape(0) == rows * kv_heads_,
                op, ": one position, slot, table and length a row, kv_heads tasks a row");
    for (int64_t t = 0; t < rows; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), op, ": position ", pos[t], " has no rotary table");
      TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, op, ": slot ", slot[t], " is not in the pool");
    }
    check_paged_rows(paged);
    torch::Tensor delta = torch::empty({rows, width}, hidden.options());
    if (rows == 0) return delta;
    const int64_t q_width = heads_ * dim_, inner = first.down.k;
    std::vector<bf16> normed(rows * width), qkv(rows * first.qkv.n()), attended(rows * q_width),
        gate_up(rows * 2 * inner), act(rows * inner);
    std::vector<float> q(rows * q_width);
    bf16* h = reinterpret_cast<bf16*>(hidden.data_ptr());
    bf16* d = reinterpret_cast<bf16*>(delta.data_ptr());
    const float eps = static_cast<float>(eps_);
    py::gil_scoped_release released;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      bf16* pool = reinterpret_cast<bf16*>(layer.pool.data_ptr());
      add_rms_norm_rows(h, i ? d : nullptr, bits(layer.input_norm), eps, normed.data(), rows, width);
      layer.qkv.run(normed.data(), rows, qkv.data());
      rotate_and_store_rows(qkv.data(), bits(cos_), bits(sin_), dim_, pos, slot, rows, pool, slots, heads_, kv_heads_,
                            nullptr, nullptr, q.data());
      paged_decode_into(paged, q.data(), pool, attended.data(), true, nullptr);
      layer.o.run(attended.data(), rows, d);
      add_rms_norm_rows(h, d, bits(layer.post_norm), eps, normed.data(), rows, width);
      layer.gate_up.run(normed.data(), rows, gate_up.data());
      silu_mul_rows(gate_up.data(), act.data(), rows, inner);
      layer.down.run(act.data(), rows, d);
    }
    return delta;
  }

 private:
  torch::Tensor cos_, sin_;
  int64_t heads_, kv_heads_, dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

void bind_decode_layers(py::module_& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers", py::module_local(), "a decode step's decoder layers in one call (kernels/decode_layers.py)")
      .def(py::init<const py::list&, const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("layers"), py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("kv_heads"), py::arg("dim"),
           py::arg("eps"), py::arg("scale"))
      .def("forward", &DecodeLayers::forward, py::arg("hidden"), py::arg("positions"), py::arg("write_index"),
           py::arg("tables"), py::arg("lengths"), py::arg("order"));
}

}  // namespace tritonllm_native
