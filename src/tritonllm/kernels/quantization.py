"""int8 for the runner's matmuls (`quantization: int8`): about half the bytes of bf16 per step.

A decode step on CPU streams every weight once, so fewer bytes is a faster step. Two forms, chosen
in linear.py by what the CPU runs:
- with bf16 activations on a CPU with AVX512-BF16 and AVX512-VNNI (and the native kernels built):
  weights and activations both int8 in groups of 32 inputs, a scale a group (`Int8GroupWeight`;
  native/int8_linear.cpp multiplies int8 by int8, twice bf16's rate);
- else weight-only: a scale per output row (`Int8Weight`), activations stay 16-bit and
  `torch.ops.aten._weight_int8pack_mm` multiplies them with the int8 weights directly. With float32
  activations that kernel takes a slow path (measured ~1 s a step), so int8 needs a 16-bit dtype,
  and on CPU.
How far each is from float32, and how fast: docs/benchmarks.md.
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


@dataclass(frozen=True)
class Int8GroupWeight:
    """int8 with a scale per 32 inputs of an output row (absmax / 127; llama.cpp's Q8_0): what the
    native int8 kernel multiplies, its activations quantized the same way (native/int8_linear.cpp)."""

    values: torch.Tensor  # int8 (out, in)
    scales: torch.Tensor  # float32 (out, in / GROUP)

    GROUP = 32

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Int8GroupWeight":
        groups = weight.float().view(weight.shape[0], -1, cls.GROUP)
        scales = groups.abs().amax(dim=2).clamp(min=1e-12) / 127
        values = torch.round(groups / scales[:, :, None]).clamp(-127, 127).to(torch.int8)
        return cls(values.view(weight.shape).contiguous(), scales.contiguous())


def resolve_quantization(name: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """The method to use: TRITONLLM_QUANTIZATION wins over `name`; errors name what is wrong."""
    method = os.environ.get(QUANTIZATION_ENV) or name or "none"
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "int8" and (dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu"):
        raise ValueError(f"quantization int8 runs on CPU with dtype bfloat16 or float16, not {dtype} on "
                         f"{device.type} (float32 activations take a slow path)")
    return method
