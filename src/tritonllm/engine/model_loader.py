"""Loading a model into the engine: its dtype, its device, huge pages for its weights.

The model itself is found by model_files.py (bundled, tiny, a directory or a hub id).
"""

from __future__ import annotations

import os

import torch

from tritonllm.kernels.cpu_isa import runs_bf16_fast as cpu_runs_bf16_fast
from tritonllm.model_files import resolve_model_path

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ENV = "TRITONLLM_DTYPE"  # overrides the dtype named in config.pbtxt (auto, float32, bfloat16, float16)


def resolve_dtype(name: str | torch.dtype | None, device: str = "cpu") -> torch.dtype:
    """The dtype a model runs in. `auto` (the default): bfloat16 on CUDA and on CPUs with native bf16,
    float32 elsewhere. The environment variable TRITONLLM_DTYPE, when set, wins over `name`."""
    if isinstance(name, torch.dtype):
        return name
    name = os.environ.get(DTYPE_ENV) or name or "auto"
    if name == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_runs_bf16_fast() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(device: str | None) -> str:
    return default_device() if not device or device == "auto" else device


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages (2 MB) for every tensor of 2 MB or more:
    the weights a decode step streams and the KV pool. With 4 KB pages a step walks ~70,000 of
    them; decode steps measured 0-40 % faster with huge pages on this VM (THP in `madvise` mode,
    docs/benchmarks.md). PyTorch reads the variable at its first large allocation, so this runs
    before the model loads; a value the user set is kept (0 turns it off)."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


def load_model(spec: str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None):
    """Load (model, tokenizer) in eval mode from any spec accepted by `resolve_model_path`,
    in the dtype `resolve_dtype` picks (auto: bfloat16 where the hardware runs it fast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    use_huge_pages()
    path = resolve_model_path(spec)
    device = resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    model.to(device).eval()
    return model, tokenizer
