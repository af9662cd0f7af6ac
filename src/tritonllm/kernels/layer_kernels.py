"""A decoder layer's work between its matmuls, compiled for CPU in bfloat16: one call per piece.

In PyTorch that work is ~30 small ops a layer (norms, rotary, the KV write, casts, the gated
activation), each a dispatch, an allocation and a pass over memory; at 8 rows they took about as
long as the layer's four matmuls (measured, docs/benchmarks.md). Here each piece is one loop over
the step's rows, compiled by Numba (parallel over rows, the GIL released):

- `add_rms_norm`: the residual add and the next RMSNorm in one pass;
- `rotate_and_store`: rotary on q and k, the new keys and values written to the paged pool, and
  the decode rows' queries widened for paged_attention.py;
- `silu_mul`: SiLU of the gate times up.

Each op rounds to bfloat16 where the model's own bf16 ops do (a product or a sum of bf16 values
computed in float32, then rounded to nearest even), so the residual add, rotary, the KV write and
the casts give PyTorch's bits. Sums inside a norm and the exp of SiLU are computed in another
order or another approximation than PyTorch's: a value may differ in its last bit from the
PyTorch path (model_runner.py's reference, used in float32 and on other devices). Every row is
computed by itself, so a row's result never depends on the other rows of the step.
"""

from __future__ import annotations

import numpy as np
import torch

from tritonllm.kernels.numba_helpers import numba

if numba is not None:
    from numba import njit, prange

    from tritonllm.kernels.numba_helpers import as_float32, expf, to_bf16


def available(dtype: torch.dtype, device: torch.device, activation: str) -> bool:
    return numba is not None and device.type == "cpu" and dtype == torch.bfloat16 and activation == "silu"


if numba is not None:
    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _add_rms_norm(hidden, delta, weight, eps, out, add):
        """hidden (rows, width) += delta (if `add`), in place; out = weight * rms_norm(hidden), each
        rounded to bf16 as the model's ops round (all bf16 bits)."""
        rows, width = hidden.shape
        for t in prange(rows):
            if add:
                for i in range(width):
                    hidden[t, i] = to_bf16(as_float32(hidden[t, i]) + as_float32(delta[t, i]))
            total = np.float32(0.0)
            for i in range(width):
                x = as_float32(hidden[t, i])
                total += x * x
            inv = np.float32(1.0) / np.sqrt(total / np.float32(width) + eps)
            for i in range(width):
                normed = as_float32(to_bf16(as_float32(hidden[t, i]) * inv))
                out[t, i] = to_bf16(as_float32(weight[i]) * normed)

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _rotate_and_store(qkv, cos, sin, positions, write_index, pool, q_out, decode_of, q_decode, heads):
        """qkv (tokens, (heads + 2 kv_heads) x dim): q, k, v heads; cos, sin (positions, dim), sin with
        rotate_half's sign; pool (2 kv_heads, slots, dim): the layer's pool, flat; rotated q heads to
        q_out (tokens, heads x dim), rotated k and plain v heads to the pool at write_index; a decode
        row's rotated q also to q_decode[decode_of[t]] in float32 (decode_of[t] < 0: not a decode).
        x * cos + rotate_half(x) * sin rounded after each op, as the model computes it in bf16."""
        tokens = qkv.shape[0]
        kv_heads = pool.shape[0] // 2
        dim = cos.shape[1]
        half = dim // 2
        for t in prange(tokens):
            p, slot, decode = positions[t], write_index[t], decode_of[t]
            for hh in range(heads + kv_heads):
                base = hh * dim
                for d in range(dim):
                    partner = base + d + half if d < half else base + d - half
                    a = to_bf16(as_float32(qkv[t, base + d]) * as_float32(cos[p, d]))
                    b = to_bf16(as_float32(qkv[t, partner]) * as_float32(sin[p, d]))
                    value = to_bf16(as_float32(a) + as_float32(b))
                    if hh < heads:
                        q_out[t, base + d] = value
                        if decode >= 0:
                            q_decode[decode, base + d] = as_float32(value)
                    else:
                        pool[hh - heads, slot, d] = value
            for h in range(kv_heads):
                base = (heads + kv_heads + h) * dim
                for d in range(dim):
                    pool[kv_heads + h, slot, d] = qkv[t, base + d]

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _silu_mul(gate_up, out):
        """out = silu(gate) * up, gate_up (rows, 2 width) = gate | up, each op rounded to bf16."""
        rows, width = out.shape
        for t in prange(rows):
            for i in range(width):
                g = as_float32(gate_up[t, i])
                act = as_float32(to_bf16(g / (np.float32(1.0) + expf(-g))))
                out[t, i] = to_bf16(act * as_float32(gate_up[t, width + i]))


def add_rms_norm(hidden: np.ndarray, delta: np.ndarray | None, weight: np.ndarray, eps: float,
                 out: np.ndarray) -> None:
    _add_rms_norm(hidden, hidden if delta is None else delta, weight, np.float32(eps), out, delta is not None)


def rotate_and_store(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
                     write_index: np.ndarray, pool: np.ndarray, q_out: np.ndarray, decode_of: np.ndarray,
                     q_decode: np.ndarray, heads: int) -> None:
    _rotate_and_store(qkv, cos, sin, positions, write_index, pool, q_out, decode_of, q_decode, heads)


def silu_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    _silu_mul(gate_up, out)


def warm_up() -> None:
    """Compile (or load from Numba's cache) every kernel now, not in the first request's step."""
    u16 = np.zeros((2, 4), np.uint16)
    add_rms_norm(u16, u16, u16[0], 1e-5, u16.copy())
    add_rms_norm(u16, None, u16[0], 1e-5, u16.copy())
    index = np.zeros(2, np.int64)
    table = np.zeros((2, 2), np.uint16)  # 1 q head, 1 kv head, dim 2
    rotate_and_store(np.zeros((2, 6), np.uint16), table, table, index, index, np.zeros((2, 1, 2), np.uint16),
                     table.copy(), index - 1, np.zeros((1, 2), np.float32), 1)
    silu_mul(np.zeros((2, 8), np.uint16), u16)
