// Paged decode attention over a bf16 KV pool, for CPUs with AVX512-BF16 (kernels/paged_attention.py).
//
// One task per (row, KV head), its query heads scored together so each key and value is read once:
// - scores: a key's dot product with each query head is `vdpbf16ps` over the key's pairs (the
//   queries are bf16 values: the model's own q, so rounding them to bf16 is exact), 8 keys a time;
//   their 8 partial vectors are summed by one fixed tree of shuffles into 8 scores, so no key pays a
//   horizontal sum of its own (16 keys a time spilled 48 partial vectors for 3 query heads);
// - softmax in float32 (a polynomial exp within 2 ulp of expf), then values accumulated with
//   vertical FMAs, key after key, each widened from bf16 by a shift and a mask;
// - a row longer than kPart keys is split into parts of kPart (the last shorter), each part a task
//   with its own peak and sum, merged in part order when all are done: a lone long row keeps both
//   threads busy (3 KV heads on 2 threads left one idle half the call);
// - every sum runs in one fixed order that depends on the row's own length only, and tasks are
//   taken one at a time by whichever thread is free: a row's bits never depend on the batch.
#include "kernel_api.h"
#include "vector_math.h"
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

using namespace tritonllm_native;

namespace {

constexpr int64_t kKeys = 16;      // keys scored together: one vector of scores
constexpr int kMaxGroup = 8;       // query heads a KV head
constexpr int64_t kPart = 1024;    // keys a task at most: a longer row is split into parts of this many

// Lane i < 8 of the result is the sum of v[i]'s 16 lanes, in one fixed order: (L0 + L1) + (L2 + L3),
// L the sums of its 128-bit lanes, each (e0 + e2) + (e1 + e3).
AVX512_BF16 inline __m256 sum_each(const __m512 v[8]) {
  __m512 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: one partial of each of 4 keys, in key order
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // 128-bit lanes: [keys 0-3: L0+L1, L2+L3, keys 4-7: L0+L1, L2+L3]
  const __m512 halves = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                      _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  return _mm512_castps512_ps256(
      _mm512_add_ps(_mm512_shuffle_f32x4(halves, halves, 0x88), _mm512_shuffle_f32x4(halves, halves, 0xDD)));
}

struct Task {
  const float* q;        // (group, dim) float32
  const bf16* keys;      // this KV head's keys in the pool
  const bf16* values;    // and values
  const int64_t* table;  // the row's blocks
  int64_t first, n;      // the task's keys: [first, first + n) of the row's
  int64_t block_size;
  float scale;
  float* scores;         // (group, n rounded up to 16), scratch
  void* out;             // (group, dim): float32, or bf16 (rounded to nearest even)
  bool out_bf16;
  float* part;           // a part of a split row: (group, dim + 2), its unscaled sum, peak and total;
                         // null: the whole row, into out
};

// A task's keys (or values) in order, through its row's block table, with no division a key (in cache
// a 32 x 600 layer took 0.9 of the time; from memory the same).
struct Cursor {
  const bf16* base = nullptr;
  const int64_t* table = nullptr;
  int64_t block_size = 1, dim = 0, block = 0, offset = 0;
  Cursor() = default;
  Cursor(const Task& t, const bf16* base, int64_t dim)
      : base(base), table(t.table), block_size(t.block_size), dim(dim), block(t.first / t.block_size),
        offset(t.first % t.block_size) {}
  const bf16* next() {  // this vector, then move on
    const bf16* at = base + (table[block] * block_size + offset) * dim;
    if (++offset == block_size) offset = 0, ++block;
    return at;
  }
};

// The keys then values of the task a thread runs next, asked into L2 a few lines a group of keys while
// this one runs. A row's blocks lie anywhere in the pool, so the hardware's prefetchers barely help; and
// a core alone keeps too few misses in flight to stream a task's keys once it waits on them: prefetching
// within the task (any distance, any cache level) did not help. The next task's memory overlaps this
// one's work. Its lines are walked a block's span at a time: a cursor step and two prefetches a key
// cost as much as the dot products with the KV in cache (docs/benchmarks.md §0w).
template <int D>
struct NextTask {
  const Task* t;  // null: none, or all fetched
  int64_t per_call = 0, key = 0, end = 0;  // key: the first of the next span's keys (then values)
  bool values = false;
  const char *at = nullptr, *stop = nullptr;  // the span being fetched
  NextTask(const Task* next, int64_t calls) : t(next) {
    if (!t) return;
    per_call = (2 * t->n * (D * 2 / 64) + calls - 1) / calls;
    key = t->first;
    end = t->first + t->n;
  }
  void fetch() {  // the next per_call lines
    for (int64_t left = per_call; left > 0;) {
      if (at == stop && !next_span()) return;
      const int64_t count = std::min<int64_t>(left, (stop - at) / 64);
      for (int64_t i = 0; i < count; ++i) _mm_prefetch(at + 64 * i, _MM_HINT_T1);
      at += 64 * count;
      left -= count;
    }
  }
  bool next_span() {  // the keys (or values) from `key` to its block's end or the task's
    if (!t) return false;
    if (key == end) {
      if (values) return (t = nullptr), false;
      values = true;
      key = t->first;
    }
    const int64_t block = key / t->block_size, offset = key % t->block_size;
    const int64_t count = std::min(end, (block + 1) * t->block_size) - key;
    at = (const char*)((values ? t->values : t->keys) + (t->table[block] * t->block_size + offset) * D);
    stop = at + count * D * 2;
    key += count;
    return true;
  }
};

// G query heads of dim 32 C, one KV head.
template <int G, int C>
AVX512_BF16 void attend(const Task& t, const Task* next) {
  constexpr int D = 32 * C, V = 2 * C;  // dim; float32 vectors a head
  const int64_t n = t.n, stride = (n + kKeys - 1) / kKeys * kKeys;
  constexpr int64_t kGroup = kKeys / 2;  // keys a group, scored together; the next task fetched a group
  const int64_t groups = (n + kGroup - 1) / kGroup;
  NextTask<D> upcoming(next, 2 * groups);
  Cursor keys(t, t.keys, D), values(t, t.values, D);

  __m512bh q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      q[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(t.q + g * D + 32 * c + 16), _mm512_loadu_ps(t.q + g * D + 32 * c));

  // scores 8 keys a time: G x 8 partial vectors stay in registers (16 keys a time spilled them)
  for (int64_t first = 0; first < n; first += kGroup) {
    upcoming.fetch();
    __m512 partial[G][kGroup];
    for (int64_t j = 0; j < kGroup; ++j) {
      const int64_t k = first + j;
      if (k >= n) {
        for (int g = 0; g < G; ++g) partial[g][j] = _mm512_setzero_ps();
        continue;
      }
      const bf16* key = keys.next();
      __m512bh kv[C];
      for (int c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_dpbf16_ps(acc, q[g][c], kv[c]);
        partial[g][j] = acc;
      }
    }
    for (int g = 0; g < G; ++g)
      _mm256_storeu_ps(t.scores + g * stride + first, _mm256_mul_ps(sum_each(partial[g]), _mm256_set1_ps(t.scale)));
  }
  if (n % kKeys && n % kKeys <= kKeys / 2)  // the last 16's unscored half: zeros
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(t.scores + g * stride + stride - kKeys / 2, _mm256_setzero_ps());

  float tops[G], totals[G];
  for (int g = 0; g < G; ++g) {  // softmax, in place (a part: exp(s - its peak), not yet divided)
    float* s = t.scores + g * stride;
    const __mmask16 tail = (__mmask16)((1u << (n % kKeys ? n % kKeys : kKeys)) - 1);
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < n; k += kKeys)
      peak = _mm512_mask_max_ps(peak, k + kKeys <= n ? (__mmask16)0xFFFF : tail, peak, _mm512_loadu_ps(s + k));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += kKeys) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + k), top));
      _mm512_storeu_ps(s + k, e);
      total = _mm512_mask_add_ps(total, k + kKeys <= n ? (__mmask16)0xFFFF : tail, total, e);
    }
    tops[g] = _mm512_cvtss_f32(top);
    totals[g] = _mm512_reduce_add_ps(total);
    if (t.part) continue;
    const __m512 sum = _mm512_set1_ps(totals[g]);
    for (int64_t k = 0; k < n; k += kKeys) _mm512_storeu_ps(s + k, _mm512_div_ps(_mm512_loadu_ps(s + k), sum));
  }

  // values widened by a shift (even dims) and a mask (odd dims) of their bf16 pairs: lane i of
  // even[g][c] / odd[g][c] sums dim 32 c + 2 i / 32 c + 2 i + 1, interleaved back at the end
  __m512 even[G][C], odd[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) even[g][c] = odd[g][c] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t k = 0; k < n; ++k) {
    if (k % kGroup == 0) upcoming.fetch();
    const bf16* value = values.next();
    __m512 lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i pairs = _mm512_loadu_si512(value + 32 * c);
      lo[c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      hi[c] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(t.scores[g * stride + k]);
      for (int c = 0; c < C; ++c) {
        even[g][c] = _mm512_fmadd_ps(p, lo[c], even[g][c]);
        odd[g][c] = _mm512_fmadd_ps(p, hi[c], odd[g][c]);
      }
    }
  }
  __m512 acc[G][V];
  const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second_half = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      acc[g][2 * c] = _mm512_permutex2var_ps(even[g][c], first_half, odd[g][c]);
      acc[g][2 * c + 1] = _mm512_permutex2var_ps(even[g][c], second_half, odd[g][c]);
    }
  if (t.part) {
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(t.part + g * (D + 2) + 16 * v, acc[g][v]);
      t.part[g * (D + 2) + D] = tops[g];
      t.part[g * (D + 2) + D + 1] = totals[g];
    }
    return;
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) {
      if (t.out_bf16)
        narrow((bf16*)t.out + g * D + 16 * v, acc[g][v]);
      else
        _mm512_storeu_ps((float*)t.out + g * D + 16 * v, acc[g][v]);
    }
}

// A split row's parts (each (group, dim + 2), in part order) into its result: every sum in part order.
AVX512_BF16 void merge_parts(const float* parts, int64_t count, int64_t group, int64_t dim, void* out, bool out_bf16) {
  const int64_t stride = group * (dim + 2);
  for (int64_t g = 0; g < group; ++g) {
    const float* first = parts + g * (dim + 2);
    float peak = first[dim];
    for (int64_t i = 1; i < count; ++i) peak = std::max(peak, first[i * stride + dim]);
    float total = 0;
    __m512 acc[8];  // dim <= 128
    for (int64_t v = 0; v < dim / 16; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) {
      const float* part = first + i * stride;
      const __m512 weight = exp_ps(_mm512_set1_ps(part[dim] - peak));
      total += _mm512_cvtss_f32(weight) * part[dim + 1];
      for (int64_t v = 0; v < dim / 16; ++v) acc[v] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(part + 16 * v), acc[v]);
    }
    const __m512 sum = _mm512_set1_ps(total);
    for (int64_t v = 0; v < dim / 16; ++v) {
      const __m512 r = _mm512_div_ps(acc[v], sum);
      if (out_bf16)
        narrow((bf16*)out + g * dim + 16 * v, r);
      else
        _mm512_storeu_ps((float*)out + g * dim + 16 * v, r);
    }
  }
}

using AttendFn = void (*)(const Task&, const Task*);

template <int C>
AttendFn attend_for_group(int64_t group) {
  switch (group) {
    case 1: return attend<1, C>;
    case 2: return attend<2, C>;
    case 3: return attend<3, C>;
    case 4: return attend<4, C>;
    case 5: return attend<5, C>;
    case 6: return attend<6, C>;
    case 7: return attend<7, C>;
    case 8: return attend<8, C>;
    default: return nullptr;
  }
}

AttendFn attend_for(int64_t group, int64_t dim) {
  switch (dim) {
    case 64: return attend_for_group<2>(group);
    case 128: return attend_for_group<4>(group);
    default: return nullptr;
  }
}

}  // namespace

bool tritonllm_native::paged_decode_supports(int64_t group, int64_t dim) { return attend_for(group, dim) != nullptr; }

void tritonllm_native::check_paged_rows(const PagedRows& p) {
  TORCH_CHECK(attend_for(p.group, p.dim) != nullptr, "paged_decode: no kernel for ", p.group,
              " query heads a KV head of dim ", p.dim);
  for (int64_t r = 0; r < p.rows; ++r) {
    TORCH_CHECK(p.lengths[r] >= 1 && p.lengths[r] <= p.width * p.block_size, "paged_decode: row ", r, " has ",
                p.lengths[r], " keys, its table holds ", p.width * p.block_size);
    for (int64_t b = 0; b < (p.lengths[r] + p.block_size - 1) / p.block_size; ++b) {
      const int64_t block = p.tables[r * p.width + b];
      TORCH_CHECK(block >= 0 && block < p.blocks, "paged_decode: block ", block, " of row ", r, " is not in the pool");
    }
  }
  std::vector<bool> seen(p.rows * p.kv_heads);
  for (int64_t i = 0; i < p.rows * p.kv_heads; ++i) {
    TORCH_CHECK(p.order[i] >= 0 && p.order[i] < p.rows * p.kv_heads && !seen[p.order[i]],
                "paged_decode: order must hold each task once");
    seen[p.order[i]] = true;
  }
}

// Row r's result into out row out_rows[r] (null: r).
void tritonllm_native::paged_decode_into(const PagedRows& p, const float* qp, const bf16* pp, void* out,
                                         bool out_bf16, const int64_t* rp) {
  const int64_t rows = p.rows, kv_heads = p.kv_heads, group = p.group, dim = p.dim, width = p.width;
  const int64_t block_size = p.block_size;
  const int64_t *lp = p.lengths, *tp = p.tables, *op = p.order;
  const AttendFn fn = attend_for(group, dim);
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, lp[r]);
  char* outp = static_cast<char*>(out);
  const int64_t head_elems = p.blocks * block_size * dim, out_elem = out_bf16 ? 2 : 4;
  auto out_of = [&](int64_t r, int64_t h) {
    return outp + ((rp ? rp[r] : r) * kv_heads * group + h * group) * dim * out_elem;
  };
  // The tasks in `order` (the longest rows first), a split row's parts in turn, and its parts' scratch.
  auto parts_of = [&](int64_t r) { return (lp[r] + kPart - 1) / kPart; };
  int64_t part_count = 0;
  for (int64_t r = 0; r < rows; ++r)
    if (parts_of(r) > 1) part_count += parts_of(r) * kv_heads;
  std::vector<float> partials(part_count * group * (dim + 2));
  struct Split { int64_t r, h; float* parts; int64_t count; };
  std::vector<Task> list;
  std::vector<Split> splits;
  float* next_part = partials.data();
  for (int64_t i = 0; i < rows * kv_heads; ++i) {
    const int64_t r = op[i] / kv_heads, h = op[i] % kv_heads, parts = parts_of(r);
    if (parts > 1) splits.push_back({r, h, next_part, parts});
    for (int64_t part = 0; part < parts; ++part) {
      list.push_back(Task{qp + op[i] * group * dim, pp + h * head_elems, pp + (kv_heads + h) * head_elems,
                          tp + r * width, part * kPart, std::min(kPart, lp[r] - part * kPart), block_size, p.scale, nullptr,
                          out_of(r, h), out_bf16, parts > 1 ? next_part : nullptr});
      if (parts > 1) next_part += group * (dim + 2);
    }
  }
  const int64_t tasks = list.size(), longest_task = std::min(longest, kPart);
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> scores;
    scores.resize(kMaxGroup * ((longest_task + kKeys - 1) / kKeys * kKeys));
    // One task at a time, in the list's order; each thread claims its next task before it runs this
    // one, so that task's keys are fetched meanwhile.
    int64_t i = next++;
    while (i < tasks) {
      const int64_t j = next++;
      Task t = list[i];
      t.scores = scores.data();
      fn(t, j < tasks ? &list[j] : nullptr);
      i = j;
    }
  });
  at::parallel_for(0, splits.size(), 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s)
      merge_parts(splits[s].parts, splits[s].count, group, dim, out_of(splits[s].r, splits[s].h), out_bf16);
  });
}

// q (rows, kv_heads, group, dim) float32; pool (2 kv_heads, blocks, block_size, dim) bf16 bits, keys
// then values; tables (rows, width), lengths (rows,), order (rows x kv_heads,) int64; row r's result
// into out[out_rows[r]] (rows_out, kv_heads x group x dim), float32 or bf16 bits.
void paged_decode(const py::array& q, const py::array& pool, const py::array& tables, const py::array& lengths,
                  const py::array& order, float scale, py::array& out, const py::array& out_rows) {
  const float* qp = data_of<float>(q, "paged_decode", "q", 4);
  const bf16* pp = data_of<uint16_t>(pool, "paged_decode", "pool", 4);
  const int64_t* rp = data_of<int64_t>(out_rows, "paged_decode", "out_rows", 1);
  const PagedRows rows{data_of<int64_t>(tables, "paged_decode", "tables", 2),
                       data_of<int64_t>(lengths, "paged_decode", "lengths", 1),
                       data_of<int64_t>(order, "paged_decode", "order", 1),
                       q.shape(0), tables.shape(1), q.shape(1), q.shape(2), q.shape(3), pool.shape(1), pool.shape(2),
                       scale};
  TORCH_CHECK(pool.shape(0) == 2 * rows.kv_heads && pool.shape(3) == rows.dim,
              "paged_decode: the pool's shape does not fit q");
  TORCH_CHECK(tables.shape(0) == rows.rows && lengths.shape(0) == rows.rows && out_rows.shape(0) == rows.rows &&
              order.shape(0) == rows.rows * rows.kv_heads, "paged_decode: one table, length and out row a row");
  TORCH_CHECK(out.ndim() == 2 && out.shape(1) == rows.kv_heads * rows.group * rows.dim &&
              (out.flags() & py::array::c_style), "paged_decode: out must be (rows, heads x dim), C-contiguous");
  const bool out_bf16 = out.dtype().is(py::dtype::of<uint16_t>());
  TORCH_CHECK(out_bf16 || out.dtype().is(py::dtype::of<float>()), "paged_decode: out is float32 or bf16 bits");
  check_paged_rows(rows);
  for (int64_t r = 0; r < rows.rows; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < out.shape(0), "paged_decode: out row ", rp[r], " is out of range");
  py::gil_scoped_release released;
  paged_decode_into(rows, qp, pp, out.mutable_data(), out_bf16, rp);
}
