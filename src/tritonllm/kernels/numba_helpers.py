"""What the Numba-compiled CPU kernels share: bfloat16 bits, an exp that vectorizes, and a
prefetch hint.

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
    def _bits_as_float32(typingctx, bits):
        """32 bits as the float32 they encode (an LLVM bitcast)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

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

    @intrinsic
    def _prefetch(typingctx, flat, index):
        """Ask the CPU to bring flat[index]'s cache line in (llvm.prefetch: a read, kept in every
        level). Only a hint: an address past the array is never touched."""
        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            address = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            hint = builder.module.declare_intrinsic(
                "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]))
            builder.call(hint, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.void(flat, types.intp), codegen

    @njit(inline="always")
    def prefetch(flat, index, count):
        """Prefetch the cache lines of flat[index:index + count] (flat: a 1-d C-contiguous array)."""
        for offset in range(0, count, max(1, 64 // flat.itemsize)):
            _prefetch(flat, index + offset)

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

    @njit(inline="always", fastmath=True)
    def expf(x):
        """exp(x) in float32 (Cephes' expf, ~1 ulp; inputs clamped to [-87, 88]), inline so that a
        loop of it vectorizes (np.exp is a libm call per element)."""
        v = min(max(x, np.float32(-87.0)), np.float32(88.0))
        whole = np.floor(v * np.float32(1.44269504088896341) + np.float32(0.5))
        r = v - whole * np.float32(0.693359375) + whole * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        return (p * r * r + r + np.float32(1.0)) * _bits_as_float32(np.uint32(np.int32(whole) + 127) << 23)
