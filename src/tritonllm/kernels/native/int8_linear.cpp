// int8 linears for CPUs with AVX512-VNNI (kernels/linear.py, `quantization: int8`).
//
// Weights and activations are int8 in groups of 32 of K, a float scale a group (as llama.cpp's
// Q8_0), so int8 multiplies run at twice bf16's rate and a weight is near half the bytes:
// - weights (quantization.py's Int8GroupWeight): u8 = w + 128 in blocks of 16 output columns, 4 of K
//   a column: packed[block][k / 4][column][k % 4], what `vpdpbusd` reads (u8 x s8, four products
//   summed into int32 exactly); their scales packed[block][k / 32][column];
// - activations: each row quantized when the call starts.
// sum(u * a) = sum(w * a) + 128 * sum(a): a group's int32 sum starts at -128 * sum(a), exactly.
//
// Batch invariant by construction: a row is quantized alone; an output is an exact int32 sum a group
// and a float32 sum over groups in order; threads split the output columns, never K.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace {

using tritonllm_native::Ahead;
using tritonllm_native::bf16;
using tritonllm_native::row_passes;
using tritonllm_native::narrow;
using tritonllm_native::widen;

constexpr int64_t kCols = 16;    // output columns a block (one zmm of int32)
constexpr int64_t kQuads = 4;    // K a column a step (a dword of four bytes)
constexpr int64_t kGroupK = 32;  // K an activation scale
constexpr int64_t kBlocks = 2;   // blocks computed together (weight loads reuse the row broadcasts)
constexpr int64_t kRows = 4;     // rows computed together (8 int32 and 8 float32 accumulators; 4 x 3
                                 // blocks spilled the float32 ones and ran a quarter slower)

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")))

// Rows quantized: q (m, k) int8, a scale and a start (-128 x the group's sum of q) a group.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<int32_t> starts;
};

AVX512_VNNI void quantize_row(const bf16* x, int64_t k, int8_t* q, float* scales, int32_t* starts) {
  for (int64_t g = 0; g < k / kGroupK; ++g) {
    const __m512 lo = widen(x + g * kGroupK), hi = widen(x + g * kGroupK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    // rounded to nearest even (MXCSR's default), within [-127, 127]
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128((__m128i*)(q + g * kGroupK), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128((__m128i*)(q + g * kGroupK + 16), _mm512_cvtsepi32_epi8(qhi));
    scales[g] = amax / 127.0f;
    starts[g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

template <int R, int B>
AVX512_VNNI void vnni_tile(const Quantized& rows, int64_t r0, int64_t k, const uint8_t* w, const float* w_scales,
                           const float* bias, bf16* out, int64_t ldo, Ahead ahead) {
  const int64_t groups = k / kGroupK, block = k * kCols;  // bytes a packed block
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    ahead.fetch();  // once a group of K: a check at each of its 8 steps made a lone row 1.3x slower
    __m512i sum[R][B];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(rows.starts[(r0 + r) * groups + g]);
      for (int b = 0; b < B; ++b) sum[r][b] = start;
    }
    for (int64_t s = 0; s < kGroupK / kQuads; ++s) {
      const int64_t quad = g * (kGroupK / kQuads) + s;
      __m512i wv[B];
      for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + b * block + quad * kCols * kQuads);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, rows.q.data() + (r0 + r) * k + quad * kQuads, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int b = 0; b < B; ++b) sum[r][b] = _mm512_dpbusd_epi32(sum[r][b], wv[b], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(rows.scales[(r0 + r) * groups + g]);
      for (int b = 0; b < B; ++b) {
        const __m512 both = _mm512_mul_ps(scale, _mm512_loadu_ps(w_scales + (b * groups + g) * kCols));
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), both, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      __m512 v = acc[r][b];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + b * kCols));
      narrow(out + (r0 + r) * ldo + b * kCols, v);
    }
}

using TileFn = void (*)(const Quantized&, int64_t, int64_t, const uint8_t*, const float*, const float*, bf16*, int64_t,
                        Ahead);

template <int R>
TileFn tile_for_blocks(int64_t blocks) {
  switch (blocks) {
    case 1: return vnni_tile<R, 1>;
    default: return vnni_tile<R, 2>;
  }
}

TileFn tile_for(int64_t rows, int64_t blocks) {
  switch (rows) {
    case 1: return tile_for_blocks<1>(blocks);
    case 2: return tile_for_blocks<2>(blocks);
    case 3: return tile_for_blocks<3>(blocks);
    default: return tile_for_blocks<4>(blocks);
  }
}

}  // namespace

std::vector<torch::Tensor> pack_int8(const torch::Tensor& values, const torch::Tensor& scales) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kChar, "pack_int8: a 2-d int8 weight");
  const int64_t n = values.size(0), k = values.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kGroupK == 0, "pack_int8: out features a multiple of 16, in features of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / kGroupK, "pack_int8: (", n, ", ",
              k / kGroupK, ") scales, one a 32 of K");
  // (n, k) -> (n / 16, 16, k / 4, 4) -> (n / 16, k / 4, 16, 4), each value + 128 as u8
  const torch::Tensor unsigned_values = (values.to(torch::kShort) + 128).to(torch::kByte);
  const torch::Tensor packed =
      unsigned_values.contiguous().view({n / kCols, kCols, k / kQuads, kQuads}).permute({0, 2, 1, 3}).contiguous();
  // (n, groups) -> (n / 16, groups, 16)
  const torch::Tensor packed_scales =
      scales.to(torch::kFloat).contiguous().view({n / kCols, kCols, k / kGroupK}).permute({0, 2, 1}).contiguous();
  return {packed, packed_scales};
}

void tritonllm_native::int8_linear_into(const bf16* xp, int64_t m, int64_t k, const uint8_t* wp, const float* sp,
                                        int64_t blocks, const float* bp, bf16* op) {
  if (m == 0) return;
  const int64_t n = blocks * kCols, groups = k / kGroupK;
  thread_local Quantized scratch;  // reused: a step calls this ~120 times
  Quantized& q = scratch;  // the caller's, in the workers too (a thread_local named there is theirs)
  q.q.resize(m * k);
  q.scales.resize(m * groups);
  q.starts.resize(m * groups);
  at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      quantize_row(xp + r * k, k, q.q.data() + r * k, q.scales.data() + r * groups, q.starts.data() + r * groups);
  });
  const int64_t block = k * kCols;
  // Each thread an even share of the blocks, as bf16_linear.cpp.
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / kBlocks));
  at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
    for (int64_t share = first; share < last; ++share) {
      const int64_t b_first = blocks * share / shares, b_last = blocks * (share + 1) / shares;
      for (int64_t b0 = b_first; b0 < b_last; b0 += kBlocks) {
        const int64_t nb = std::min(kBlocks, b_last - b0), next_blocks = std::min(kBlocks, b_last - b0 - nb);
        row_passes(m, kRows, wp + (b0 + nb) * block, next_blocks * block, k / kGroupK, false,
                   [&](int64_t r0, int64_t rows, Ahead ahead) {
                     tile_for(rows, nb)(q, r0, k, wp + b0 * block, sp + b0 * groups * kCols,
                                        bp ? bp + b0 * kCols : nullptr, op + b0 * kCols, n, ahead);
                   });
      }
    }
  });
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias) {
  // packed, scales: from pack_int8
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear_int8: 2-d bfloat16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kByte && packed.size(2) == kCols &&
              packed.size(3) == kQuads, "linear_int8: a weight from pack_int8");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * kCols;
  TORCH_CHECK(packed.size(1) * kQuads == k, "linear_int8: rows have ", k, " features, the weight ",
              packed.size(1) * kQuads);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == k / kGroupK &&
              scales.scalar_type() == torch::kFloat, "linear_int8: scales from pack_int8");
  const torch::Tensor rows = x.contiguous(), w_scales = scales.contiguous();
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) bias32 = bias->to(torch::kFloat).contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options());
  tritonllm_native::int8_linear_into(reinterpret_cast<const bf16*>(rows.data_ptr()), m, k, packed.data_ptr<uint8_t>(),
                                     w_scales.data_ptr<float>(), blocks,
                                     bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                                     reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}
