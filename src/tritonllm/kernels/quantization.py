"""Weight-only int8 for the runner's matmuls (`quantization: int8`): half the bytes of bf16 per step.

Each output row of a weight gets one scale (absmax / 127); activations stay bfloat16 and
`torch.ops.aten._weight_int8pack_mm` multiplies them with the int8 weights directly. A decode
step on CPU streams every weight once, so fewer bytes is a faster step. With float32 activations
that kernel takes a slow path (measured ~1 s a step), so int8 needs a 16-bit dtype, and on CPU.
The runner multiplies by these weights through linear.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

QUANTIZATION_ENV = "TRITONLLM_QUANTIZATION"  # overrides config.pbtxt's `quantization` for all models
METHODS = ("none", "int8")


@dataclass(frozen=True)
class Int8Weight:
    values: torch.Tensor  # int8 (out, in)
    scales: torch.Tensor  # (out,), in the activations' dtype

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Int8Weight":
        scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
        values = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(values.contiguous(), scales.to(weight.dtype))


def resolve_quantization(name: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """The method to use: TRITONLLM_QUANTIZATION wins over `name`; errors name what is wrong."""
    method = os.environ.get(QUANTIZATION_ENV) or name or "none"
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "int8" and (dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu"):
        raise ValueError(f"quantization int8 runs on CPU with dtype bfloat16 or float16, not {dtype} on "
                         f"{device.type} (float32 activations take a slow path)")
    return method
