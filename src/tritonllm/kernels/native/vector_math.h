// What the native kernels share: bf16 as bits, AVX512 float32 <-> bf16, a vector exp, numpy checks.
#pragma once
#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <immintrin.h>
#include <cstdint>

namespace tritonllm_native {

namespace py = pybind11;
using bf16 = uint16_t;

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

AVX512_BF16 inline __m512 widen(const bf16* p) {  // 16 bf16 -> float32: a shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

AVX512_BF16 inline void narrow(bf16* p, __m512 v) {  // 16 float32 -> bf16, rounded to nearest even
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
}

// exp(x) in float32 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n; x clamped
// to [-87, 88]), within 2 ulp of expf.
AVX512_BF16 inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// A linear's passes over the rows for one group of weight blocks (bf16_linear.cpp, int8_linear.cpp).
// The group's weight comes from memory in the first pass and from cache in the others, so the next
// group's is fetched into L2 a few lines a step of K, spread over this group's passes: memory works
// while the dot products run. Passes are of near-equal rows (32 by at most 6: 5 5 5 5 6 6, not
// 6 x 5 + 2): a pass of few rows keeps too few accumulators to hide the dot product's latency.
// Neither changes any output element's arithmetic.
struct Ahead {
  const char* next;
  int64_t left, per_step;
  inline void fetch() {
    for (int64_t i = 0; i < per_step && left > 0; ++i, --left, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// pass(first row, rows, ahead) for each pass; `steps`: the steps of K a pass takes; `fetch_alone`: fetch
// the next group in a lone pass too.
template <typename Pass>
void row_passes(int64_t m, int64_t max_rows, const void* next_group, int64_t next_bytes, int64_t steps,
                bool fetch_alone, Pass pass) {
  const int64_t passes = (m + max_rows - 1) / max_rows, lines = next_bytes / 64;
  for (int64_t p = 0, r0 = 0; p < passes; ++p) {
    const int64_t rows = (m - r0) / (passes - p);
    const int64_t first = lines * p / passes, count = lines * (p + 1) / passes - first;
    // a lone pass of few rows streams its own weight: fetching the next group too measured slower (a
    // lone row 1.08x); a lone pass of 7-8 rows gains (bf16_linear.cpp)
    pass(r0, rows, Ahead{static_cast<const char*>(next_group) + first * 64, passes > 1 || fetch_alone ? count : 0,
                         (count + steps - 1) / steps});
    r0 += rows;
  }
}

// A numpy array's data, checked: its number of dimensions, dtype and C order (`op` names the caller).
template <typename T>
T* data_of(const py::array& a, const char* op, const char* name, int dims) {
  TORCH_CHECK(a.ndim() == dims, op, ": ", name, " must have ", dims, " dimensions, not ", a.ndim());
  TORCH_CHECK(a.dtype().is(py::dtype::of<T>()), op, ": ", name, " has the wrong dtype");
  TORCH_CHECK(a.flags() & py::array::c_style, op, ": ", name, " must be C-contiguous");
  return static_cast<T*>(const_cast<void*>(a.data()));
}

}  // namespace tritonllm_native
