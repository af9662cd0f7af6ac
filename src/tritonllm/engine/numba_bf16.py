"""bfloat16 inside Numba-compiled loops: the one place that reads and writes its bits.

NumPy has no bfloat16, so the CPU kernels (paged_attention.py, layer_kernels.py) see a bf16 tensor
as its 16-bit patterns (`as_numpy`). A pattern is the upper half of the float32 it stands for, so
widening is a shift and a bitcast, and narrowing rounds to nearest even, as PyTorch's conversion
does: an op computed in float32 and narrowed here gives PyTorch's bf16 op's bits.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic, overload
except ImportError:  # pragma: no cover - numba is a dependency; other devices fall back without it
    numba = None


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the kernels read it, no copy: bfloat16 as its 16-bit patterns."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


if numba is not None:
    @intrinsic
    def _bf16_bits_as_float32(typingctx, bits):
        """A bfloat16's 16 bits as the float32 they are the upper half of (an LLVM bitcast, which
        the compiler vectorizes; Numba has no scalar bitcast)."""
        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def _float32_bits(typingctx, x):
        """A float32's 32 bits as an unsigned integer (an LLVM bitcast)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    def as_float32(x):  # noqa: ARG001 - what the overload below implements
        """A pool or tensor element as float32: bfloat16 from its bits, float32 as it is."""

    @overload(as_float32, inline="always")
    def _as_float32(x):
        if x == types.uint16:
            return lambda x: _bf16_bits_as_float32(x)
        return lambda x: np.float32(x)

    @njit(inline="always")
    def to_bf16(x):
        """float32 -> bfloat16 bits, rounded to nearest even (PyTorch's rounding; NaN stays NaN)."""
        bits = _float32_bits(np.float32(x))
        return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    def store(x, out):  # noqa: ARG001 - what the overload below implements
        """A float32 result as an element of `out`'s dtype: bfloat16 bits rounded, float32 as it is."""

    @overload(store, inline="always")
    def _store(x, out):
        if out.dtype == types.uint16:
            return lambda x, out: to_bf16(x)
        return lambda x, out: np.float32(x)
