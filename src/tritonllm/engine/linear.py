"""How the runner multiplies by a weight, chosen once per weight at load: the one place for it.

- bfloat16 / float16 on CPU: oneDNN with the weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise`). A decode step streams
  every weight once; from a prepacked weight oneDNN streams about 2x faster than `aten::mm`
  at 8 rows (docs/benchmarks.md). A row's result does not depend on how many rows share the
  call (tested for every shape of the bundled model, every row alone against all together):
  oneDNN sums a lone row in another order (a few outputs in 10^4 differed by one bf16 ulp, the
  1536-wide `down` of the bundled model), so a lone row is multiplied as two (the row expanded, not
  copied: oneDNN reads it twice; 15 us less a call than `repeat` here, the same bits).
  With AMX (Intel) oneDNN picks its kernel and blocking by the row count: a row gets the bits it
  gets alone only in calls of at most 32 rows here (measured on the model's shapes; without AMX,
  any count). So where the CPU has AMX, a step's rows are cut into calls that give every row the
  same bits whatever shares the step (`call_ranges`): each tile of a prompt's rows (the same rows
  whenever it is computed) is a call, and decode rows go in calls of at most 32. A 1,024-token
  prompt took 418 ms so, 487 ms in calls of 32 rows, 339 ms in one call a chunk (not invariant);
  decode steps of <= 32 rows pay nothing.
- int8 (`quantization: int8`): weight-only int8 (quantization.py).
- float32, and every other device: plain `F.linear`, so that float32 logits stay bit-equal to
  the model's own forward (tested). On CUDA nothing has been measured to beat it yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonllm.engine.quantization import Int8Weight


@dataclass(frozen=True)
class PackedWeight:
    """A weight in oneDNN's blocked layout."""

    packed: torch.Tensor
    nbytes: int  # of the weight it was made from
    row_block: int | None  # the most rows per call that give each row the bits it gets alone


AMX_ROW_BLOCK = 32  # with AMX, calls of at most this many rows give each row its lone bits (measured)


def _packed_call(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x if x.shape[0] > 1 else x.expand(2, -1)  # a lone row as two (see the module's notes); no copy
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out if x.shape[0] > 1 else out[:1]


def invariant_row_block() -> int | None:
    """The most rows per call that keep every row's bits: AMX_ROW_BLOCK where oneDNN runs AMX, else
    no limit (None)."""
    from tritonllm.models import cpu_flags

    amx = "amx_bf16" in cpu_flags() and os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("", "ALL", "DEFAULT")
    return AMX_ROW_BLOCK if amx else None


def prepack_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available())


def prepare(weight: torch.Tensor, quantization: str, rows_hint: int):
    """The form of `weight` (out, in) that `linear` multiplies fastest here."""
    weight = weight.detach()
    if quantization == "int8":
        return Int8Weight.of(weight)
    if prepack_enabled(weight.dtype, weight.device):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
        return PackedWeight(packed, weight.numel() * weight.element_size(), invariant_row_block())
    return weight


def nbytes(weight) -> int:
    """Bytes a matmul by this weight streams from memory."""
    if isinstance(weight, PackedWeight):
        return weight.nbytes
    if isinstance(weight, Int8Weight):
        return weight.values.numel() + weight.scales.numel() * weight.scales.element_size()
    return weight.numel() * weight.element_size()


def call_ranges(groups: list[tuple[int, int]], block: int | None) -> list[tuple[int, int]] | None:
    """Row ranges, one matmul call each, for rows in consecutive `groups` (a group: rows that are
    always computed together, such as a prompt tile's): groups of at most `block` rows are merged
    into calls of at most `block` (every row gets its lone bits there); a larger group is a call of
    its own, always the same rows, so the same bits. None: no limit (one call)."""
    if block is None:
        return None
    calls, start, end = [], 0, 0
    for first, last in groups:
        if last - first > block or last - start > block:
            if end > start:
                calls.append((start, end))
            start = first
        end = last
        if last - first > block:
            calls.append((first, last))
            start = last
    if end > start:
        calls.append((start, end))
    return calls


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           calls: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """x (rows, in) times a weight from `prepare` (or a plain tensor), plus bias. `calls`: how to cut
    the rows where the weight keeps rows' bits only in short calls (`call_ranges`; default: calls
    of `row_block` rows)."""
    if isinstance(weight, PackedWeight):
        block = weight.row_block
        if block is None or x.shape[0] <= block:
            return _packed_call(x, weight.packed, bias)
        calls = calls or [(i, min(i + block, x.shape[0])) for i in range(0, x.shape[0], block)]
        if len(calls) == 1:  # all rows in one call (the runner without batch invariance)
            return _packed_call(x, weight.packed, bias)
        return torch.cat([_packed_call(x[first:last], weight.packed, bias) for first, last in calls])
    if isinstance(weight, Int8Weight):
        out = torch.ops.aten._weight_int8pack_mm(x, weight.values, weight.scales)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
