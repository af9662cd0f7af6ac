"""How the runner multiplies by a weight, chosen once per weight at load: the one place for it.

- bfloat16 / float16 otherwise, on a CPU where oneDNN runs them (cpu_isa.py): oneDNN with the weight reordered
  once into its blocked layout (`mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise`):
  a decode step streams every weight once, and from a prepacked weight oneDNN streams faster than
  `aten::mm` at decode row counts. A row's result must not depend on how many rows share the call:
  - oneDNN sums a lone row in another order, so a lone row is multiplied as two (the row expanded,
    not copied: oneDNN reads it twice);
  - with AMX oneDNN picks its kernel and blocking by the row count, and a row gets the bits it gets
    alone only in calls of at most AMX_ROW_BLOCK rows. That is CPU-dependent, so each weight's row
    block is checked at load (`checked_row_block`) and cut where a call of that many rows changed a
    row's bits. Where there is a limit, a step's rows are cut into calls (`call_ranges`): decode rows
    in calls of at most the block, a prompt's tiles (rows always computed together) in calls of their
    own of a whole number of TILE_ROWS (a partial tile padded), where a row gets the same bits wherever
    it sits; consecutive tiles share a call of up to `tile_rows` rows, found per weight at load
    (`_tile_rows`), as longer calls are faster.
- bfloat16 on a CPU with AVX512-BF16, first: the native kernel (native.py, native/bf16_linear.cpp), AMX tiles where
  `cpu_isa.amx_enabled()`; a row's bits never depend on the call, so it needs no cutting.
- int8 (`quantization: int8`): int8 weights (quantization.py). With bf16 activations on a CPU with
  AVX512-BF16 and AVX512-VNNI, the native int8 kernel (native/int8_linear.cpp: weights and
  activations int8 a scale per 32 inputs), invariant by construction; else `_weight_int8pack_mm`,
  weight-only.
- float32, and every other device: plain `F.linear`, so that float32 logits stay bit-equal to the
  model's own forward (tested).

What each choice costs and buys, measured: docs/benchmarks.md (oneDNN prepacking, the lone row,
calls of prompt tiles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from tritonllm.kernels import cpu_isa, native
from tritonllm.kernels.quantization import Int8GroupWeight, Int8Weight


@dataclass(frozen=True)
class PackedWeight:
    """A weight in oneDNN's blocked layout."""

    packed: torch.Tensor
    nbytes: int  # of the weight it was made from
    row_block: int | None  # the most rows per call that give each row the bits it gets alone
    tile_rows: int | None  # the most rows (a multiple of TILE_ROWS) per call of prompt tiles


@dataclass(frozen=True)
class NativeWeight:
    """A bf16 weight packed for the native kernel (native.py, native/bf16_linear.cpp)."""

    packed: torch.Tensor
    nbytes: int
    amx: bool  # AMX tiles, else AVX512-BF16
    multiply: Callable  # the kernel's linear(x, packed, bias, amx)


@dataclass(frozen=True)
class NativeInt8Weight:
    """An int8 weight packed for the native int8 kernel (native/int8_linear.cpp)."""

    packed: torch.Tensor
    scales: torch.Tensor  # float32, packed with the values
    nbytes: int
    multiply: Callable  # the kernel's linear_int8(x, packed, scales, bias)


NATIVE_COLUMNS, NATIVE_DEPTH = 16, 32  # the native kernel's block of output columns; AMX's K a step
AMX_ROW_BLOCK = 32  # with AMX, calls of at most this many rows give each row its lone bits (measured)
TILE_ROWS = 64  # with AMX, a call of more than AMX_ROW_BLOCK rows runs a multiple of this many
TILE_CALL_ROWS = (192, 128)  # the longer calls of prompt tiles tried at load, longest first


class Call(NamedTuple):
    """Rows [first, last) of a step in one matmul call that runs `rows` rows (the rest padding)."""
    first: int
    last: int
    rows: int


def _packed_call(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, rows: int = 0) -> torch.Tensor:
    """x times the packed weight, run as max(rows, 2) rows: a lone row as two (see the module's
    notes; expanded, no copy), a partial tile padded with its last row."""
    n = x.shape[0]
    rows = max(rows, n, 2)
    if rows > n:
        x = x.expand(rows, -1) if n == 1 else torch.cat([x, x[-1:].expand(rows - n, -1)])
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if rows == n else out[:n]


def _tile_rows(packed: torch.Tensor, fan_in: int, dtype: torch.dtype) -> int:
    """The longest call of TILE_CALL_ROWS that gives random rows the bits they get in calls of
    TILE_ROWS, wherever they sit in the call; TILE_ROWS if none does."""
    x = torch.randn(2 * TILE_CALL_ROWS[0] * 2, fan_in, generator=torch.Generator().manual_seed(0)).to(dtype)
    short = torch.cat([_packed_call(x[i:i + TILE_ROWS], packed, None) for i in range(0, len(x), TILE_ROWS)])
    for rows in TILE_CALL_ROWS:
        long = torch.cat([_packed_call(x[i:i + rows], packed, None) for i in range(0, len(x), rows)])
        if torch.equal(long, short):
            return rows
    return TILE_ROWS


def invariant_row_block() -> int | None:
    """The most rows per call that keep every row's bits, as known of the CPU: AMX_ROW_BLOCK where
    oneDNN runs AMX (CPU-dependent: cpu_isa.py's switch), else no limit (None); `checked_row_block`
    checks it per weight at load."""
    return AMX_ROW_BLOCK if cpu_isa.amx_enabled() else None


def checked_row_block(multiply, fan_in: int, dtype: torch.dtype, block: int | None) -> int | None:
    """`block` (None: no limit) if random rows multiplied (`multiply(x)`) in calls of that many rows get
    the bits each gets alone, else the largest smaller power of two that does (1: a row a call)."""
    rows = (block or 24) + 9  # whole calls and a partial one
    x = torch.randn(rows, fan_in, generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = torch.cat([multiply(x[i:i + 1]) for i in range(rows)])
    size = block or rows
    while size > 1:
        if torch.equal(torch.cat([multiply(x[i:i + size]) for i in range(0, rows, size)]), alone):
            return block if size == (block or rows) else size
        size = 1 << (size - 1).bit_length() - 1 if size & (size - 1) else size // 2
    return 1


def prepack_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN prepacked weights: bf16/fp16 on a CPU where oneDNN runs the dtype (CPU-dependent:
    AVX512-BF16, AMX or AVX-NE-CONVERT; an AVX2-only CPU multiplies bf16 with `F.linear`)."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and cpu_isa.onednn_runs(str(dtype).removeprefix("torch.")))


def native_fits(shape) -> bool:
    """The native kernel takes (out, in) weights with out a multiple of 16 and in of 32."""
    return len(shape) == 2 and shape[0] % NATIVE_COLUMNS == 0 and shape[1] % NATIVE_DEPTH == 0


def prepare(weight: torch.Tensor, quantization: str, rows_hint: int):
    """The form of `weight` (out, in) that `linear` multiplies fastest here."""
    weight = weight.detach()
    kernel = native.kernel() if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                                 and native_fits(weight.shape)) else None
    if quantization == "int8":
        if kernel is not None and "avx512_vnni" in cpu_isa.cpu_flags():
            grouped = Int8GroupWeight.of(weight)
            packed, scales = kernel.pack_int8(grouped.values, grouped.scales)
            return NativeInt8Weight(packed, scales, grouped.values.numel() + grouped.scales.numel() * 4,
                                    kernel.linear_int8)
        return Int8Weight.of(weight)
    if kernel is not None:
        return NativeWeight(kernel.pack(weight), weight.numel() * weight.element_size(), cpu_isa.amx_enabled(),
                            kernel.linear)
    if prepack_enabled(weight.dtype, weight.device):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
        block = checked_row_block(lambda x: _packed_call(x, packed, None), weight.shape[1], weight.dtype,
                                  invariant_row_block())
        tile_rows = None if block is None else _tile_rows(packed, weight.shape[1], weight.dtype)
        return PackedWeight(packed, weight.numel() * weight.element_size(), block, tile_rows)
    return weight


def nbytes(weight) -> int:
    """Bytes a matmul by this weight streams from memory."""
    if isinstance(weight, (PackedWeight, NativeWeight, NativeInt8Weight)):
        return weight.nbytes
    if isinstance(weight, Int8Weight):
        return weight.values.numel() + weight.scales.numel() * weight.scales.element_size()
    return weight.numel() * weight.element_size()


def call_ranges(groups: list[tuple[int, int]], block: int | None, tile_rows: int | None = None) -> list[Call] | None:
    """The matmul calls, for rows in consecutive `groups` (a group: rows that are always computed
    together, such as a prompt tile's): groups of at most `block` rows are merged into calls of at
    most `block` (every row gets its lone bits there); larger groups (tiles) into calls of whole
    TILE_ROWS, padded, of at most `tile_rows` rows (default TILE_ROWS: a tile a call). None: no
    limit (one call)."""
    if block is None:
        return None
    tile_rows = tile_rows or TILE_ROWS
    calls: list[Call] = []
    start = end = 0  # the call being filled: rows [start, end)
    tiles = False  # it holds tiles
    for first, last in groups:
        is_tile = last - first > block
        limit = tile_rows if is_tile else block
        if end > start and (is_tile != tiles or _run_rows(last - start, is_tile) > limit):
            calls.append(Call(start, end, _run_rows(end - start, tiles)))
            start = first
        end, tiles = last, is_tile
    if end > start:
        calls.append(Call(start, end, _run_rows(end - start, tiles)))
    return calls


def _run_rows(rows: int, tiles: bool) -> int:
    return -(-rows // TILE_ROWS) * TILE_ROWS if tiles else rows


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, calls: list[Call] | None = None) -> torch.Tensor:
    """x (rows, in) times a weight from `prepare` (or a plain tensor), plus bias. `calls`: how to cut
    the rows where the weight keeps rows' bits only in short calls (`call_ranges`; default: calls
    of `row_block` rows)."""
    if isinstance(weight, NativeWeight):
        return weight.multiply(x, weight.packed, bias, weight.amx)
    if isinstance(weight, NativeInt8Weight):
        return weight.multiply(x, weight.packed, weight.scales, bias)
    if isinstance(weight, PackedWeight):
        block = weight.row_block
        if block is None or x.shape[0] <= block:
            return _packed_call(x, weight.packed, bias)
        calls = calls or call_ranges([(i, i + 1) for i in range(x.shape[0])], block)
        if len(calls) == 1 and calls[0].rows == x.shape[0]:
            return _packed_call(x, weight.packed, bias)
        return torch.cat([_packed_call(x[c.first:c.last], weight.packed, bias, c.rows) for c in calls])
    if isinstance(weight, Int8Weight):
        out = torch.ops.aten._weight_int8pack_mm(x, weight.values, weight.scales)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
