"""Decode attention on CPU read straight from the paged KV pool: one compiled loop per (row, KV head).

A bf16 pool on a CPU with AVX512-BF16 goes to the native kernel (native/paged_decode.cpp: the same
tasks, scored 16 keys a time with `vdpbf16ps` and no horizontal sum per key); this Numba kernel
runs float32, other CPUs and `TRITONLLM_NATIVE_KERNELS=0`.

PyTorch has no CPU kernel for attention over a block table: its flash kernel wants each row's
keys in one strided run (so rows had to be gathered or kept in lanes), pays a fixed cost per
(row, head) task that dwarfs a decode row's work (32 rows x 128 keys: ~0.8 ms a layer, 5 GB/s),
and gives a row other bits when the call's padded length changes. This kernel is the paged
attention of vLLM and llama.cpp, written in Python and compiled by Numba:

- each (row, KV head) is one task of a parallel loop (OpenMP: the same runtime, and threads, as
  PyTorch's when PyTorch is loaded first); the row's keys are read through its block table, in
  place, up to its own length: no gather, no padding, no mask;
- the query heads sharing a KV head are computed together, so each key and value is read once;
- keys are read block by block (one table read per block, no division per key: 10-20 % off);
- a row's blocks lie anywhere in the pool, so the CPU's prefetcher loses the stream at each block
  and a task waited on memory (7.5 GB/s of KV read in a real step, where the layers' weights have
  pushed the KV out of cache): each key and value is asked for (a prefetch hint) 32 keys before
  it is read, across block ends and from the keys into the values (20-40 % off a layer);
- keys, values and the softmax are widened to float32, as the flash kernel does; the result is
  stored in float32 (the caller rounds it) or rounded to bf16 as it is stored (layer_kernels.py's
  path, into the step's buffer);
- a row's result depends on its own query, keys and length only: nothing about the other rows or
  the step changes how it is summed (batch invariance by construction, tested).

Compiled once per dtype of the pool (bfloat16 as its bits, float32) and of the output, cached on
disk by Numba; `warm_up` compiles every variant a runner uses before its first step.
"""

from __future__ import annotations

import numpy as np
import torch

from tritonllm.kernels import native
from tritonllm.kernels.numba_helpers import as_numpy, numba

if numba is not None:
    from numba import njit, prange

    from tritonllm.kernels.numba_helpers import as_float32, expf, prefetch, store

SUPPORTED = (torch.bfloat16, torch.float32)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    return numba is not None and device.type == "cpu" and dtype in SUPPORTED


PREFETCH_AHEAD = 32  # keys: how far ahead of the one it reads a task asks for its next keys or values


if numba is not None:
    @njit(inline="always")
    def _stream_index(tables, r, pos, n, h, kv_heads, head_elems, block_size, dim):
        """Where in the flattened pool row r's pos-th vector of KV head h starts, reading its keys
        (pos < n) then its values (pos < 2n); -1 past them."""
        if pos >= 2 * n:
            return -1
        if pos >= n:
            pos, h = pos - n, kv_heads + h
        b = pos // block_size
        return h * head_elems + (tables[r, b] * block_size + pos - b * block_size) * dim

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _paged_decode(q, pool, tables, lengths, order, scale, out, out_rows, scores):
        """q (rows, kv_heads, group, dim) float32; pool (2 kv_heads, blocks, block_size, dim), keys
        then values; tables (rows, blocks) int64; lengths (rows,) int64; out (>= rows, heads x dim),
        float32 or bfloat16 bits (rounded), row r's result going to out[out_rows[r]]; scores
        (rows x kv_heads, group, >= max length) float32, scratch. Array views are avoided in
        the loops: each one costs a reference count shared by all threads."""
        rows, kv_heads, group, dim = q.shape
        block_size = pool.shape[2]
        flat = pool.reshape(-1)
        head_elems = pool.shape[1] * block_size * dim
        for i in prange(rows * kv_heads):
            task = order[i]
            r = task // kv_heads
            h = task - r * kv_heads
            n = lengths[r]
            s = scores[task]
            acc = np.zeros((group, dim), np.float32)
            # A row's blocks lie anywhere in the pool, so the hardware's prefetcher loses the stream at
            # every block: ask for each key (then value) PREFETCH_AHEAD keys before it is read.
            for k in range(min(n, PREFETCH_AHEAD)):
                prefetch(flat, _stream_index(tables, r, k, n, h, kv_heads, head_elems, block_size, dim), dim)
            for first in range(0, n, block_size):  # block by block: one table read, no division, per block
                block = tables[r, first // block_size]
                for k in range(first, min(n, first + block_size)):
                    ahead = _stream_index(tables, r, k + PREFETCH_AHEAD, n, h, kv_heads, head_elems, block_size, dim)
                    if ahead >= 0:
                        prefetch(flat, ahead, dim)
                    for g in range(group):
                        dot = np.float32(0.0)
                        for d in range(dim):
                            dot += q[r, h, g, d] * as_float32(pool[h, block, k - first, d])
                        s[g, k] = dot * scale
            for g in range(group):
                peak = s[g, 0]
                for k in range(1, n):
                    peak = max(peak, s[g, k])
                total = np.float32(0.0)
                for k in range(n):
                    s[g, k] = expf(s[g, k] - peak)
                    total += s[g, k]
                for k in range(n):
                    s[g, k] /= total
            for first in range(0, n, block_size):
                block = tables[r, first // block_size]
                for k in range(first, min(n, first + block_size)):
                    ahead = _stream_index(tables, r, n + k + PREFETCH_AHEAD, n, h, kv_heads, head_elems, block_size,
                                          dim)
                    if ahead >= 0:
                        prefetch(flat, ahead, dim)
                    for g in range(group):
                        p = s[g, k]
                        for d in range(dim):
                            acc[g, d] += p * as_float32(pool[kv_heads + h, block, k - first, d])
            row = out_rows[r]
            for g in range(group):
                for d in range(dim):
                    out[row, (h * group + g) * dim + d] = store(acc[g, d], out)


def warm_up(dtype: torch.dtype) -> None:
    """Compile (or load from Numba's cache) the kernel for a pool of `dtype` now, not in the first
    request's step (3-5 s to compile here, ~0.2 s to load)."""
    pool = as_numpy(torch.zeros(2, 2, 16, 16, dtype=dtype))
    decode = PagedDecode([1], [[1]], 1, 1, 16, 1.0, dtype)
    decode(torch.zeros(1, 1, 16, dtype=dtype), pool)  # results in float32 (the PyTorch path's)
    if dtype == torch.bfloat16:  # and rounded into a bf16 buffer (layer_kernels.py's path)
        decode.run(np.zeros((1, 1, 1, 16), np.float32), pool, np.zeros((1, 16), np.uint16), decode.out_rows)


def decode_rows(lengths: list[int], tables: list[list[int]], num_kv_heads: int):
    """The kernels' view of a step's decode rows: tables (rows, longest table) int64, zero past a
    table's end (block 0, never read), lengths (rows,) int64, and the order of their (row, KV head)
    tasks: the longest rows first, so that no thread is left with a long task at the end."""
    width = max(len(t) for t in tables)
    table_array = np.zeros((len(tables), width), np.int64)
    for i, t in enumerate(tables):
        table_array[i, :len(t)] = t
    length_array = np.asarray(lengths, np.int64)
    tasks = np.arange(len(lengths) * num_kv_heads, dtype=np.int64)
    return table_array, length_array, tasks[np.argsort(-np.repeat(length_array, num_kv_heads), kind="stable")]


class PagedDecode:
    """Made once per step for its decode rows; `__call__` runs one layer's attention for them."""

    def __init__(self, lengths: list[int], tables: list[list[int]], num_kv_heads: int, group: int,
                 head_dim: int, scaling: float, dtype: torch.dtype, use_native: bool | None = None):
        """use_native: a bf16 pool to native/paged_decode.cpp where it has the shape (None: where the
        native kernels load now; a runner fixes it at its load)."""
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # this thread's
        self.tables, self.lengths, self.order = decode_rows(lengths, tables, num_kv_heads)
        self.scaling = np.float32(scaling)
        self.num_kv_heads = num_kv_heads
        self.out = np.empty((len(lengths), num_kv_heads * group * head_dim), np.float32)
        self.out_rows = np.arange(len(lengths), dtype=np.int64)
        self.scores = np.empty((len(lengths) * num_kv_heads, group, max(lengths)), np.float32)
        kernel = native.kernel() if use_native is not False else None
        self.native = (kernel if dtype == torch.bfloat16 and kernel is not None
                       and kernel.paged_decode_supports(group, head_dim) else None)

    def __call__(self, q: torch.Tensor, pool: np.ndarray) -> torch.Tensor:
        """q: (rows, heads, dim) of the decode rows; pool: `as_numpy` of the layer. Returns
        (rows, heads, dim) float32."""
        queries = q.float().numpy().reshape(q.shape[0], self.num_kv_heads, -1, q.shape[-1])
        self.run(queries, pool, self.out, self.out_rows)
        return torch.from_numpy(self.out).view(q.shape)

    def run(self, queries: np.ndarray, pool: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> None:
        """The kernel on float32 queries (rows, kv_heads, group, dim), each row's result into
        out[out_rows[row]] (float32, or bfloat16 bits: rounded)."""
        if self.native is not None:
            self.native.paged_decode(queries, pool, self.tables, self.lengths, self.order, self.scaling, out, out_rows)
            return
        with numba.parallel_chunksize(1):  # tasks taken one at a time (see `order`)
            _paged_decode(queries, pool, self.tables, self.lengths, self.order, self.scaling, out, out_rows,
                          self.scores)
