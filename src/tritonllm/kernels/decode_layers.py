"""A decode step's decoder layers in one native call (native/decode_layers.cpp), made once at load.

model_runner.py's layer loop calls ~9 kernels a layer from Python; in a step whose rows all decode,
that interpreter time and each call's checks and allocations were ~1-1.5 ms of an 8 x 32 step
(docs/benchmarks.md). `DecodeLayers.forward` runs the same kernels for every layer in one call, so a
row gets the same bits in either (tested). It is made only where every piece has a native kernel:
bf16 on a CPU with AVX512-BF16, every matmul a native weight (bf16 or int8), the paged decode kernel
for the model's heads, SiLU, and no per-head q/k norms (Qwen3's run the loop).
"""

from __future__ import annotations

from tritonllm.kernels import native
from tritonllm.kernels.linear import NativeInt8Weight, NativeWeight

MATMULS = ("qkv", "o", "gate_up", "down")


def _linear(weight, bias):
    """A prepared weight as DecodeLayers takes it: (packed, scales or None, bias or None, amx)."""
    if isinstance(weight, NativeWeight):
        return weight.packed, None, bias, weight.amx
    return weight.packed, weight.scales, bias, False


def build(layers, pools, cos, sin, heads: int, kv_heads: int, head_dim: int, eps: float, scaling: float):
    """The native DecodeLayers for these layers (fused_weights.py's LayerWeights with prepared matmul
    weights), their KV pools and the rotary tables; None where a piece has no native kernel here."""
    kernel = native.kernel()
    if kernel is None or not kernel.paged_decode_supports(heads // kv_heads, head_dim):
        return None
    if any(w.q_norm is not None or not all(isinstance(getattr(w, name), (NativeWeight, NativeInt8Weight))
                                           for name in MATMULS) for w in layers):
        return None
    specs = [(w.input_norm, _linear(w.qkv, w.qkv_bias), _linear(w.o, w.o_bias), w.post_norm,
              _linear(w.gate_up, None), _linear(w.down, None), pool) for w, pool in zip(layers, pools)]
    return kernel.DecodeLayers(specs, cos, sin, heads, kv_heads, head_dim, eps, scaling)
