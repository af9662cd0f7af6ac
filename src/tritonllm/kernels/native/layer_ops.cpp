// A decoder layer's work between its matmuls, for bf16 on CPUs with AVX512-BF16: the native twins of
// kernels/layer_kernels.py's Numba loops, same arguments, one call a piece.
//
// Each value is rounded to bf16 where the model's own bf16 ops round (a product or a sum of bf16
// values in float32, then to nearest even), so the residual add, rotary and the KV write give
// PyTorch's bits; a norm's sum of squares runs 16 lanes then one fixed tree, SiLU's exp is a
// polynomial: those may differ from PyTorch in a last bit. Every row is computed by itself, in an
// order fixed by its width alone: a row's bits never depend on the other rows of the call.
#include "kernel_api.h"
#include "vector_math.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

namespace tritonllm_native {
namespace {

constexpr int64_t kSerialElements = 16384;  // below this a call runs on one thread: a fork costs more

AVX512_BF16 inline __mmask16 first(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

AVX512_BF16 inline __m512 widen_n(const bf16* p, int64_t n) {  // the first n of 16, zeros after
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first(n), p)), 16));
}

AVX512_BF16 inline void narrow_n(bf16* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), (__m256i)_mm512_cvtneps_pbh(v));
}

AVX512_BF16 inline __m512 round_bf16(__m512 v) {  // float32 -> bf16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

template <typename Fn>
void for_rows(int64_t rows, int64_t elements_a_row, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, elements_a_row));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

AVX512_BF16 void add_rms_norm_row(bf16* h, const bf16* d, const bf16* w, float eps, bf16* out, int64_t width) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const int64_t n = std::min<int64_t>(16, width - i);
    __m512 x = widen_n(h + i, n);
    if (d) {
      x = round_bf16(_mm512_add_ps(x, widen_n(d + i, n)));
      narrow_n(h + i, x, n);
    }
    squares = _mm512_fmadd_ps(x, x, squares);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < width; i += 16) {
    const int64_t n = std::min<int64_t>(16, width - i);
    const __m512 normed = round_bf16(_mm512_mul_ps(widen_n(h + i, n), scale));
    narrow_n(out + i, _mm512_mul_ps(widen_n(w + i, n), normed), n);
  }
}

AVX512_BF16 void silu_mul_row(const bf16* gate_up, bf16* out, int64_t width) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < width; i += 16) {
    const int64_t n = std::min<int64_t>(16, width - i);
    const __m512 g = widen_n(gate_up + i, n);
    const __m512 act = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    narrow_n(out + i, _mm512_mul_ps(act, widen_n(gate_up + width + i, n)), n);
  }
}

// x * cos + rotate_half(x) * sin for one head, sin carrying rotate_half's sign, each op rounded to bf16;
// to out in bf16 and to out32 in float32, where not null.
AVX512_BF16 void rotate_head(const bf16* x, const bf16* cos, const bf16* sin, int64_t dim, bf16* out, float* out32) {
  const int64_t half = dim / 2;
  for (int64_t d0 = 0; d0 < half; d0 += 16) {
    const int64_t n = std::min<int64_t>(16, half - d0);
    const __m512 lo = widen_n(x + d0, n), hi = widen_n(x + half + d0, n);
    for (int side = 0; side < 2; ++side) {
      const int64_t d = side ? half + d0 : d0;
      const __m512 self = side ? hi : lo, partner = side ? lo : hi;
      const __m512 a = round_bf16(_mm512_mul_ps(self, widen_n(cos + d, n)));
      const __m512 b = round_bf16(_mm512_mul_ps(partner, widen_n(sin + d, n)));
      const __m512 value = round_bf16(_mm512_add_ps(a, b));
      if (out) narrow_n(out + d, value, n);
      if (out32) _mm512_mask_storeu_ps(out32 + d, first(n), value);
    }
  }
}

}  // namespace

void add_rms_norm_rows(bf16* h, const bf16* d, const bf16* w, float eps, bf16* o, int64_t rows, int64_t width) {
  for_rows(rows, width, [&](int64_t t) {
    add_rms_norm_row(h + t * width, d ? d + t * width : nullptr, w, eps, o + t * width, width);
  });
}

void silu_mul_rows(const bf16* g, bf16* o, int64_t rows, int64_t width) {
  for_rows(rows, 3 * width, [&](int64_t t) { silu_mul_row(g + t * 2 * width, o + t * width, width); });
}

void rotate_and_store_rows(const bf16* x, const bf16* cp, const bf16* sp, int64_t dim, const int64_t* pos,
                           const int64_t* slot, int64_t tokens, bf16* pp, int64_t slots, int64_t heads,
                           int64_t kv_heads, bf16* qo, const int64_t* dec, float* qd) {
  const int64_t stride = (heads + 2 * kv_heads) * dim;
  for_rows(tokens, stride, [&](int64_t t) {
    const bf16* row = x + t * stride;
    const bf16 *c = cp + pos[t] * dim, *s = sp + pos[t] * dim;
    const int64_t decode_row = dec ? dec[t] : t;
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(row + h * dim, c, s, dim, qo ? qo + t * heads * dim + h * dim : nullptr,
                  decode_row >= 0 ? qd + decode_row * heads * dim + h * dim : nullptr);
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate_head(row + (heads + h) * dim, c, s, dim, pp + (h * slots + slot[t]) * dim, nullptr);
      std::memcpy(pp + ((kv_heads + h) * slots + slot[t]) * dim, row + (heads + kv_heads + h) * dim, dim * sizeof(bf16));
    }
  });
}

void add_rms_norm(const py::array& hidden, const py::object& delta, const py::array& weight, float eps,
                  py::array& out) {
  const char* op = "add_rms_norm";
  bf16* h = data_of<bf16>(hidden, op, "hidden", 2);
  const bf16* w = data_of<bf16>(weight, op, "weight", 1);
  bf16* o = data_of<bf16>(out, op, "out", 2);
  const bf16* d = nullptr;
  const int64_t rows = hidden.shape(0), width = hidden.shape(1);
  if (!delta.is_none()) {
    const py::array da = delta.cast<py::array>();
    d = data_of<bf16>(da, op, "delta", 2);
    TORCH_CHECK(da.shape(0) == rows && da.shape(1) == width, op, ": delta's shape is not hidden's");
  }
  TORCH_CHECK(weight.shape(0) == width && out.shape(0) == rows && out.shape(1) == width,
              op, ": weight or out does not fit hidden (", rows, ", ", width, ")");
  py::gil_scoped_release released;
  add_rms_norm_rows(h, d, w, eps, o, rows, width);
}

void silu_mul(const py::array& gate_up, py::array& out) {
  const char* op = "silu_mul";
  const bf16* g = data_of<bf16>(gate_up, op, "gate_up", 2);
  bf16* o = data_of<bf16>(out, op, "out", 2);
  const int64_t rows = out.shape(0), width = out.shape(1);
  TORCH_CHECK(gate_up.shape(0) == rows && gate_up.shape(1) == 2 * width, op, ": gate_up must be (rows, 2 x out's width)");
  py::gil_scoped_release released;
  silu_mul_rows(g, o, rows, width);
}

// qkv (tokens, (heads + 2 kv_heads) x dim): q, k, v heads; cos, sin (positions, dim); pool
// (2 kv_heads, slots, dim), keys then values; rotated q heads to q_out (tokens, heads x dim), rotated
// keys and the values to the pool at write_index; a decode row's rotated q also to
// q_decode[decode_of[t]] in float32 (decode_of[t] < 0: not a decode row).
void rotate_and_store(const py::array& qkv, const py::array& cos, const py::array& sin, const py::array& positions,
                      const py::array& write_index, py::array& pool, py::array& q_out, const py::array& decode_of,
                      py::array& q_decode, int64_t heads) {
  const char* op = "rotate_and_store";
  const bf16* x = data_of<bf16>(qkv, op, "qkv", 2);
  const bf16* cp = data_of<bf16>(cos, op, "cos", 2);
  const bf16* sp = data_of<bf16>(sin, op, "sin", 2);
  const int64_t* pos = data_of<int64_t>(positions, op, "positions", 1);
  const int64_t* slot = data_of<int64_t>(write_index, op, "write_index", 1);
  bf16* pp = data_of<bf16>(pool, op, "pool", 3);
  bf16* qo = data_of<bf16>(q_out, op, "q_out", 2);
  const int64_t* dec = data_of<int64_t>(decode_of, op, "decode_of", 1);
  float* qd = data_of<float>(q_decode, op, "q_decode", 2);
  const int64_t tokens = qkv.shape(0), dim = cos.shape(1), kv_heads = pool.shape(0) / 2, slots = pool.shape(1);
  const int64_t stride = qkv.shape(1);
  TORCH_CHECK(dim % 2 == 0 && sin.shape(0) == cos.shape(0) && sin.shape(1) == dim, op, ": cos and sin must be (positions, even dim)");
  TORCH_CHECK(pool.shape(2) == dim && stride == (heads + 2 * kv_heads) * dim, op, ": qkv's width is not (",
              heads, " + 2 x ", kv_heads, ") x ", dim);
  TORCH_CHECK(q_out.shape(0) == tokens && q_out.shape(1) == heads * dim && q_decode.shape(1) == heads * dim,
              op, ": q_out or q_decode is not (tokens, heads x dim)");
  TORCH_CHECK(positions.shape(0) == tokens && write_index.shape(0) == tokens && decode_of.shape(0) == tokens,
              op, ": one position, write index and decode_of a token");
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.shape(0), op, ": position ", pos[t], " has no rotary table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, op, ": slot ", slot[t], " is not in the pool");
    TORCH_CHECK(dec[t] < q_decode.shape(0), op, ": decode row ", dec[t], " is out of range");
  }
  py::gil_scoped_release released;
  rotate_and_store_rows(x, cp, sp, dim, pos, slot, tokens, pp, slots, heads, kv_heads, qo, dec, qd);
}

}  // namespace tritonllm_native
