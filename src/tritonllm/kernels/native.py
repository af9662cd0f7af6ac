"""The native CPU kernels (native/*.cpp): built once, loaded where the CPU runs them.

- **What.** The bf16 linear (bf16_linear.cpp, used by linear.py), paged decode attention over a
  bf16 pool (paged_decode.cpp, used by paged_attention.py) and a layer's work between its matmuls
  (layer_ops.cpp: the residual add and RMSNorm, rotary and the KV write, SiLU x up; used in place
  of layer_kernels.py's Numba loops), one library (module.cpp binds them; vector_math.h is shared).
- **Where.** A CPU with AVX512-BF16 (`vdpbf16ps`); the linear uses AMX tiles (`tdpbf16ps`) where
  `cpu_isa.amx_enabled()` (oneDNN's `ONEDNN_MAX_CPU_ISA` switch turns both off together). An
  AVX2-only CPU, float32 and float16 keep the other paths (oneDNN, Numba).
- **Why.** Each output element is one accumulator in a fixed order and threads split outputs or
  tasks, never a sum, so a row gets the same bits in a call of any size and place: batch invariance
  costs no extra calls (oneDNN needs a lone row run as two and calls of at most 32 rows with AMX). A
  linear call costs a few microseconds, where oneDNN's costs ~15-20 (docs/benchmarks.md).
- **Built** by `./setup.sh` (`tritonllm-kernels build`) with the system compiler through torch's
  extension builder, into the cache under a hash of the sources, the torch version and the flags. A
  process never compiles: it loads the built library, or runs the previous paths and says why once
  in its log.
- **Switch.** `TRITONLLM_NATIVE_KERNELS=0` forces the previous paths (tests, A/B).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path

from tritonllm import model_files
from tritonllm.kernels import cpu_isa

log = logging.getLogger(__name__)

SWITCH_ENV = "TRITONLLM_NATIVE_KERNELS"
SOURCES = tuple(Path(__file__).parent / "native" / name
                for name in ("module.cpp", "bf16_linear.cpp", "int8_linear.cpp", "paged_decode.cpp", "layer_ops.cpp",
                              "decode_layers.cpp"))
HEADERS = tuple(Path(__file__).parent / "native" / name for name in ("vector_math.h", "kernel_api.h"))
CFLAGS = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own threads


def enabled() -> bool:
    """The switch: on unless TRITONLLM_NATIVE_KERNELS is 0/false/off."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def cpu_runs_it() -> bool:
    """AVX512-BF16 here, and ONEDNN_MAX_CPU_ISA, where set, not below it."""
    cap = cpu_isa.isa_cap()
    return "avx512_bf16" in cpu_isa.cpu_flags() and (not cap or any(s in cap for s in ("BF16", "FP16", "AMX", "AVX10")))


def module_name() -> str:
    import torch

    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS) + torch.__version__.encode()
                            + " ".join(CFLAGS).encode())
    return "tritonllm_native_" + digest.hexdigest()[:12]


def build_dir() -> Path:
    return model_files.cache_root() / "kernels" / module_name()


def _library() -> Path:
    return build_dir() / f"{module_name()}.so"


def build() -> str:
    """Compile the kernel into the cache (idempotent); a line saying what happened."""
    if _library().exists():
        return f"native kernels: {_library()} (built)"
    if not (shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja")):
        return "native kernels: no C++ compiler or ninja here; the engine runs the other paths"
    from torch.utils.cpp_extension import load

    build_dir().mkdir(parents=True, exist_ok=True)
    load(name=module_name(), sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
         build_directory=str(build_dir()), verbose=False)
    return f"native kernels: {_library()} (compiled)"


def kernel():
    """The kernels' module where the switch is on and it loads here, else None."""
    return _loaded() if enabled() and cpu_runs_it() else None


@functools.lru_cache(maxsize=None)
def _loaded():
    """The built kernel module, or None: not built, or it failed to load (logged once). A kernel
    that cannot load must never stop a model from loading."""
    try:
        library = _library()
        if not library.exists():
            log.info("native kernels off: not built (%s); ./setup.sh builds them", library)
            return None
        import torch  # noqa: F401  (the module links against torch's libraries, loaded first)

        name = library.stem
        spec = importlib.util.spec_from_file_location(
            name, library, loader=importlib.machinery.ExtensionFileLoader(name, str(library)))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as exc:  # noqa: BLE001  (any failure leaves the previous path, said once)
        log.warning("native kernels off: %s: %s", type(exc).__name__, exc)
        return None
    sys.modules[name] = mod
    log.info("native kernels loaded: %s", library)
    return mod


def describe() -> str:
    """What the native kernels run on here, for reports: AMX (the linear's tiles), AVX512-BF16, or
    off and why."""
    if not enabled():
        return f"off ({SWITCH_ENV}=0)"
    if not cpu_runs_it():
        return "off (no AVX512-BF16)"
    if _loaded() is None:
        return "off (not built)"
    return "AMX" if cpu_isa.amx_enabled() else "AVX512-BF16"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print("usage: python -m tritonllm.kernels.native build", file=sys.stderr)
        return 2
    print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
