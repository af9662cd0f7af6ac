// bf16 linears for CPUs with AVX512-BF16, and AMX tiles where the CPU has them (kernels/linear.py).
//
// Batch invariant by construction: every output element is one accumulator that runs over K in one
// fixed order (pairs of K for `vdpbf16ps`, 32 of K a step for AMX's `tdpbf16ps`), whatever the number
// of rows in the call or a row's place in it; threads split the output columns, never K.
//
// The weight is packed once at load, 16 output columns a block, in VNNI pairs:
// packed[block][k / 2][column][k % 2], the layout both `vdpbf16ps` and AMX's B tiles read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace {

constexpr int64_t kCols = 16;        // output columns a block (one zmm of float32)
constexpr int64_t kGroup = 4;        // blocks computed together (weight loads reuse the row broadcasts)
constexpr int64_t kRows = 6;         // rows computed together by the AVX512 kernel (24 accumulators)
constexpr int64_t kWideRows = 8;     // or, in a call of 7 or 8 rows, all of them
constexpr int64_t kWideGroup = 3;    // with this many blocks (24 accumulators)
constexpr int64_t kTileRows = 16;    // AMX: rows a tile
constexpr int64_t kTileK = 32;       // AMX: K a tile dot product

using tritonllm_native::Ahead;
using tritonllm_native::bf16;
using tritonllm_native::row_passes;

// ---- AVX512-BF16 ----------------------------------------------------------------------------------

template <int R, int B>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void avx512_tile(const bf16* x, int64_t ldx, const bf16* w, int64_t k2n, const float* bias, bf16* out, int64_t ldo,
                 Ahead ahead) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t block = k2n * kCols * 2;  // elements a packed block
  for (int64_t k2 = 0; k2 < k2n; ++k2) {
    ahead.fetch();
    __m512bh wv[B];
    for (int b = 0; b < B; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block + k2 * kCols * 2);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * k2, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      __m512 v = acc[r][b];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + b * kCols));
      _mm256_storeu_si256((__m256i*)(out + r * ldo + b * kCols), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

using TileFn = void (*)(const bf16*, int64_t, const bf16*, int64_t, const float*, bf16*, int64_t, Ahead);

template <int R>
TileFn tile_for_blocks(int64_t blocks) {
  switch (blocks) {
    case 1: return avx512_tile<R, 1>;
    case 2: return avx512_tile<R, 2>;
    case 3: return avx512_tile<R, 3>;
    default: return avx512_tile<R, 4>;
  }
}

TileFn tile_for(int64_t rows, int64_t blocks) {
  switch (rows) {
    case 1: return tile_for_blocks<1>(blocks);
    case 2: return tile_for_blocks<2>(blocks);
    case 3: return tile_for_blocks<3>(blocks);
    case 4: return tile_for_blocks<4>(blocks);
    case 5: return tile_for_blocks<5>(blocks);
    case 6: return tile_for_blocks<6>(blocks);
    case 7: return blocks == 1 ? avx512_tile<7, 1> : blocks == 2 ? avx512_tile<7, 2> : avx512_tile<7, 3>;
    default: return blocks == 1 ? avx512_tile<8, 1> : blocks == 2 ? avx512_tile<8, 2> : avx512_tile<8, 3>;
  }
}

void avx512_columns(const bf16* x, int64_t m, int64_t k, const bf16* w, const float* bias, bf16* out, int64_t n,
                    int64_t first_block, int64_t last_block) {
  // 7 or 8 rows go in one pass of kWideGroup blocks, fetching the next group meanwhile: each weight line
  // is read once (two passes of 4 read it from memory, then from cache); the lm_head's 8 rows took 0.9
  // of the time, the layers' 0.98 (Zen 5).
  const bool wide = m > kRows && m <= kWideRows;
  const int64_t group = wide ? kWideGroup : kGroup;
  const int64_t k2n = k / 2, block = k2n * kCols * 2;
  for (int64_t b0 = first_block; b0 < last_block; b0 += group) {
    const int64_t blocks = std::min(group, last_block - b0);
    const int64_t next_blocks = std::min(group, last_block - b0 - blocks);
    row_passes(m, wide ? kWideRows : kRows, w + (b0 + blocks) * block, next_blocks * block * int64_t(sizeof(bf16)),
               k2n, wide, [&](int64_t r0, int64_t rows, Ahead ahead) {
                 tile_for(rows, blocks)(x + r0 * k, k, w + b0 * block, k2n, bias ? bias + b0 * kCols : nullptr,
                                        out + r0 * n + b0 * kCols, n, ahead);
               });
  }
}

// ---- AMX ------------------------------------------------------------------------------------------

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out AMX's tile state only to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void amx_columns(const bf16* x, int64_t m, int64_t k, const bf16* w, const float* bias, bf16* out, int64_t n,
                 int64_t first_block, int64_t last_block) {
  // tmm0-3: C (rows x 16 float32), tmm4: A (rows x 32 bf16), tmm5-6: B (16 pairs x 16 columns).
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) { cfg.rows[t] = kTileRows; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  const int64_t k2n = k / 2, block = k2n * kCols * 2;
  alignas(64) float c[kGroup][kTileRows][kCols];
  // A last partial tile of rows, zero-padded once a call.
  const int64_t tail = m % kTileRows;
  thread_local std::vector<bf16> padded;
  if (tail) {
    padded.assign(kTileRows * k, 0);
    std::memcpy(padded.data(), x + (m - tail) * k, tail * k * sizeof(bf16));
  }
  for (int64_t b0 = first_block; b0 < last_block; b0 += kGroup) {
    const int64_t blocks = std::min(kGroup, last_block - b0);
    const bf16* wb = w + b0 * block;
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, m - r0);
      const bf16* a = rows < kTileRows ? padded.data() : x + r0 * k;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kc = 0; kc < k; kc += kTileK) {
        const bf16* wk = wb + kc * kCols;  // (kc / 2) pairs in, 16 columns x 2 each
        _tile_loadd(4, a + kc, k * sizeof(bf16));
        _tile_loadd(5, wk, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (blocks > 1) { _tile_loadd(6, wk + block, 64); _tile_dpbf16ps(1, 4, 6); }
        if (blocks > 2) { _tile_loadd(5, wk + 2 * block, 64); _tile_dpbf16ps(2, 4, 5); }
        if (blocks > 3) { _tile_loadd(6, wk + 3 * block, 64); _tile_dpbf16ps(3, 4, 6); }
      }
      _tile_stored(0, c[0], 64);
      if (blocks > 1) _tile_stored(1, c[1], 64);
      if (blocks > 2) _tile_stored(2, c[2], 64);
      if (blocks > 3) _tile_stored(3, c[3], 64);
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t r = 0; r < rows; ++r) {
          __m512 v = _mm512_load_ps(c[b][r]);
          if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + (b0 + b) * kCols));
          _mm256_storeu_si256((__m256i*)(out + (r0 + r) * n + (b0 + b) * kCols), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
  }
  _tile_release();
}

// ---- the instructions' peak (benchmarks) -----------------------------------------------------------

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
double avx512_bf16_flops(int64_t steps) {
  // 24 independent chains (as the kernel's 6 x 4 tile), no memory: what `vdpbf16ps` can do here.
  // Unrolled, so the chains stay in registers (a loop over them keeps them in memory), each from
  // its own start (equal chains are merged into one by the compiler).
  __m512 acc[24];
#pragma GCC unroll 24
  for (int a = 0; a < 24; ++a) acc[a] = _mm512_set1_ps(float(a));
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), w = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 24
    for (int a = 0; a < 24; ++a) acc[a] = _mm512_dpbf16_ps(acc[a], x, w);
  }
  float sink = 0;
  for (int a = 0; a < 24; ++a) sink += _mm512_reduce_add_ps(acc[a]);
  return sink;  // read so the loop is kept
}

__attribute__((target("amx-tile,amx-bf16")))
double amx_bf16_flops(int64_t steps) {
  // 4 C tiles from two A and two B tiles (the 2 x 2 a tile kernel can reach), no memory.
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = kTileRows; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  alignas(64) bf16 ones[kTileRows * 32];
  std::fill(ones, ones + kTileRows * 32, bf16(0x3f80));
  _tile_loadd(4, ones, 64); _tile_loadd(5, ones, 64); _tile_loadd(6, ones, 64); _tile_loadd(7, ones, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[kTileRows][kCols];
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0][0];
}

}  // namespace

// ---- the ops (bound in module.cpp) ----------------------------------------------------------------

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "pack: a 2-d bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kTileK == 0, "pack: out features a multiple of 16, in features of 32");
  // (n, k) -> (n / 16, 16, k / 2, 2) -> (n / 16, k / 2, 16, 2)
  return weight.contiguous().view({n / kCols, kCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

void tritonllm_native::bf16_linear_into(const bf16* x, int64_t m, int64_t k, const bf16* packed, int64_t blocks,
                                        const float* bias, bf16* out, bool amx) {
  if (m == 0) return;
  const int64_t n = blocks * kCols;
  // Each thread an even share of the blocks: whole groups of 4 split 36 blocks (a 576-wide weight)
  // 20 / 16 over two threads, a tenth slower than 18 / 18.
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / kGroup));
  at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
    for (int64_t share = first; share < last; ++share) {
      const int64_t b0 = blocks * share / shares, b1 = blocks * (share + 1) / shares;
      if (amx) amx_columns(x, m, k, packed, bias, out, n, b0, b1);
      else avx512_columns(x, m, k, packed, bias, out, n, b0, b1);
    }
  });
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear: 2-d bfloat16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2, "linear: a packed weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * kCols;
  TORCH_CHECK(packed.size(1) * 2 == k, "linear: rows have ", k, " features, the weight ", packed.size(1) * 2);
  TORCH_CHECK(!amx || amx_permitted(), "linear: Linux refused AMX tiles to this process");
  const torch::Tensor rows = x.contiguous();
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) bias32 = bias->to(torch::kFloat).contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options());
  tritonllm_native::bf16_linear_into(reinterpret_cast<const bf16*>(rows.data_ptr()), m, k,
                                     reinterpret_cast<const bf16*>(packed.data_ptr()), blocks,
                                     bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                                     reinterpret_cast<bf16*>(out.data_ptr()), amx);
  return out;
}

bool tritonllm_native::amx_linear_permitted() { return amx_permitted(); }

double peak_flops(bool amx, double seconds) {
  // FLOP/s of the dot-product instruction on every thread at once, the best of 3 timed rounds.
  TORCH_CHECK(!amx || amx_permitted(), "peak_flops: Linux refused AMX tiles to this process");
  const double per_step = amx ? 4.0 * kTileRows * kCols * kTileK * 2 : 24.0 * kCols * 2 * 2;
  const int threads = at::get_num_threads();
  auto run = [&](int64_t steps) {
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        volatile double kept = amx ? amx_bf16_flops(steps) : avx512_bf16_flops(steps);  // not optimized away
        (void)kept;
      }
    });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  int64_t steps = 1 << 12;
  while (run(steps) < seconds / 3 && steps < (int64_t(1) << 40)) steps *= 2;
  double best = 0;
  for (int r = 0; r < 3; ++r) best = std::max(best, per_step * steps * threads / run(steps));
  return best;
}
