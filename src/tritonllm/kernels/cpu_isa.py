"""What this CPU runs, and the one switch for the engine's CPU-dependent paths.

The paths whose speed or bits depend on the CPU, each decided where it runs:
- linear.py, oneDNN prepacked bf16/fp16 weights: only where oneDNN runs the dtype
  (`onednn_runs`: AVX512 with BF16, AMX or AVX-NE-CONVERT); elsewhere plain `F.linear`.
- linear.py, AMX row blocks (calls of at most 32 rows) and longer calls of prompt tiles
  (`tile_rows`, checked per weight at load): only where `amx_enabled()`.
- prefill_attention.py, whole prompt tiles sharing one flash-attention call: checked at load for
  the model's head shape (`shared_calls_keep_bits`), on every CPU; PyTorch's CPU flash kernel
  blocks by the call's shape and, with AMX, packs its keys for tile dot products.
- native.py's C++ kernels (the bf16 linear, paged decode attention over a bf16 pool): only where
  the CPU has AVX512-BF16, the linear's AMX tiles only where `amx_enabled()`; each computes a row
  in a fixed order whatever the batch; `TRITONLLM_NATIVE_KERNELS=0` turns them off.
- Numba kernels (layer_kernels.py, paged_attention.py) are compiled for the host CPU; they compute
  every row by itself, so bits may differ between CPUs but never between batches on one CPU.

The switch is oneDNN's own variable, `ONEDNN_MAX_CPU_ISA`, set before the process starts. oneDNN
lowers its kernels to it; PyTorch's flash kernel packs keys for AMX only where oneDNN's effective
ISA has AMX (ATen's `cpublas::could_pack` asks `dnnl::get_effective_cpu_isa()`), and multiplies
through oneDNN otherwise; our own AMX decisions follow it here. So on an Intel Xeon with AMX,
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` runs the paths of an AMD EPYC with AVX512-BF16 and no AMX.
ATen's own vector code follows `ATEN_CPU_CAPABILITY` (avx512, avx2, default) instead.
"""

from __future__ import annotations

import os
import platform

ISA_ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN's names below AVX512_CORE: bf16 kernels need at least AVX512_CORE, or AVX2_VNNI_2.
_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI")


def cpu_flags() -> list[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
            return line.partition(":")[2].strip() or platform.processor()
    except OSError:
        return platform.processor()


def isa_cap() -> str:
    """ONEDNN_MAX_CPU_ISA as oneDNN reads it ('' when unset: the CPU's best)."""
    cap = os.environ.get(ISA_ENV, "").strip().upper()
    return "" if cap in ("ALL", "DEFAULT") else cap


def amx_enabled() -> bool:
    """True where oneDNN (and so PyTorch's flash kernel) runs AMX: the CPU has AMX-BF16 and the cap
    leaves it on."""
    cap = isa_cap()
    return "amx_bf16" in cpu_flags() and (not cap or "AMX" in cap)


def onednn_runs(dtype_name: str) -> bool:
    """True where oneDNN multiplies `bfloat16` or `float16` here (torch's own check, under the cap)."""
    import torch

    if not torch.backends.mkldnn.is_available() or isa_cap() in _BELOW_AVX512:
        return False
    if dtype_name == "bfloat16":
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype_name == "float16":
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def runs_bf16_fast() -> bool:
    """True when the CPU has native bfloat16 matmul instructions (AMX or AVX512-BF16), which oneDNN uses."""
    flags = cpu_flags()
    return ("amx_bf16" in flags or "avx512_bf16" in flags) and onednn_runs("bfloat16")


def describe() -> dict:
    """The CPU as reports name it: model, the flags that pick paths, the cap, the paths taken."""
    flags = set(cpu_flags())
    return {"cpu": cpu_model(), "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "avx512f": "avx512f" in flags, "onednn_max_cpu_isa": isa_cap() or "default",
            "amx_paths": amx_enabled()}
