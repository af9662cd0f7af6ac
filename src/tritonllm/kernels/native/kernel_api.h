// The kernels' entry points on raw pointers, unchecked: the Python-facing ops (module.cpp) check their
// arguments and call these, and so does decode_layers.cpp, which runs a whole decode step's layers.
#pragma once
#include <cstdint>

namespace tritonllm_native {

using bf16 = uint16_t;

// out (m, blocks x 16) = x (m, k) times a weight from `pack`, plus bias (float32, or null).
void bf16_linear_into(const bf16* x, int64_t m, int64_t k, const bf16* packed, int64_t blocks, const float* bias,
                      bf16* out, bool amx);

// Whether Linux gives this process AMX's tile state (asked once).
bool amx_linear_permitted();

// The same for a weight from `pack_int8` and its packed scales.
void int8_linear_into(const bf16* x, int64_t m, int64_t k, const uint8_t* packed, const float* scales, int64_t blocks,
                      const float* bias, bf16* out);

// hidden (rows, width) += delta (if not null), in place; out = weight x rms_norm(hidden).
void add_rms_norm_rows(bf16* hidden, const bf16* delta, const bf16* weight, float eps, bf16* out, int64_t rows,
                       int64_t width);

// out (rows, width) = silu(gate) x up, gate_up (rows, 2 width).
void silu_mul_rows(const bf16* gate_up, bf16* out, int64_t rows, int64_t width);

// Rotary on q and k of qkv (tokens, (heads + 2 kv_heads) x dim), keys and values to the flat pool
// (2 kv_heads, slots, dim) at write_index; rotated q heads to q_out (null: not kept); a decode row's
// rotated q also to q_decode[decode_of[t]] in float32 (decode_of null: token t is decode row t).
void rotate_and_store_rows(const bf16* qkv, const bf16* cos, const bf16* sin, int64_t dim, const int64_t* positions,
                           const int64_t* write_index, int64_t tokens, bf16* pool, int64_t slots, int64_t heads,
                           int64_t kv_heads, bf16* q_out, const int64_t* decode_of, float* q_decode);

// A step's decode rows, as paged_decode reads them: their block tables (rows, width), lengths, and
// the order their (row, KV head) tasks are taken in.
struct PagedRows {
  const int64_t* tables;
  const int64_t* lengths;
  const int64_t* order;
  int64_t rows, width, kv_heads, group, dim, blocks, block_size;
  float scale;
};

// Whether paged_decode_into has a kernel for this many query heads a KV head and this head dim.
bool paged_decode_supports(int64_t group, int64_t dim);

// Decode attention of q (rows, kv_heads, group, dim) float32 over one layer's pool (2 kv_heads,
// blocks, block_size, dim); row r's result into out row out_rows[r] (null: row r) of (kv_heads x
// group x dim), float32 or bf16. Checked by `check_paged_rows` first.
void paged_decode_into(const PagedRows& rows, const float* q, const bf16* pool, void* out, bool out_bf16,
                       const int64_t* out_rows);

// Every length within its table, every block of a table in the pool, the order a permutation of the
// tasks; raises naming what is wrong.
void check_paged_rows(const PagedRows& rows);

}  // namespace tritonllm_native
