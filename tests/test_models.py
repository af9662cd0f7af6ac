"""Model provisioning and loading: every source goes through the same loader, nothing downloads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tritonllm import model_files
from tritonllm.engine import model_loader
from tritonllm.engine.model_runner import ModelRunner


def test_env_variable_overrides_the_configured_model(monkeypatch):
    monkeypatch.setenv(model_files.MODEL_ENV, "tiny")
    assert model_files.resolve_model_path("bundled") == str(model_files.tiny_dir())
    monkeypatch.delenv(model_files.MODEL_ENV)
    assert model_files.resolve_model_path("bundled") == str(model_files.bundled_dir())
    assert model_files.resolve_model_path("/some/dir") == "/some/dir"


def test_a_local_directory_loads_like_the_named_models(monkeypatch):
    monkeypatch.delenv(model_files.MODEL_ENV, raising=False)
    model, tokenizer = model_loader.load_model(str(model_files.tiny_dir()), "cpu", "float32")
    assert model.config.model_type == "llama"
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.decode(tokenizer.encode("Paris")) == "Paris"


def test_bundled_model_is_converted_once_and_cached():
    path = model_files.prepare_bundled()
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert model_files.prepare_bundled() == path  # second call: cached, no conversion


def test_bad_dtype_is_named(monkeypatch):
    monkeypatch.delenv(model_loader.DTYPE_ENV)
    with pytest.raises(ValueError, match="dtype must be auto or one of float32, float16, bfloat16, got 'float8'"):
        model_loader.resolve_dtype("float8")


def test_auto_dtype_is_bfloat16_where_the_cpu_runs_it_natively(monkeypatch):
    monkeypatch.delenv(model_loader.DTYPE_ENV, raising=False)
    expected = torch.bfloat16 if model_loader.cpu_runs_bf16_fast() else torch.float32
    assert model_loader.resolve_dtype("auto", "cpu") == model_loader.resolve_dtype(None, "cpu") == expected
    assert model_loader.resolve_dtype("float32", "cpu") == torch.float32
    monkeypatch.setenv(model_loader.DTYPE_ENV, "bfloat16")  # the environment wins, as TRITONLLM_MODEL does
    assert model_loader.resolve_dtype("float32", "cpu") == torch.bfloat16
    model, _ = model_loader.load_model("tiny", "cpu", "float32")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_unsupported_architecture_is_refused_with_its_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    with pytest.raises(ValueError, match="gpt2"):
        ModelRunner(model, num_slots=2, max_model_len=32)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_llama_layout_architectures_match_generate(arch):
    """The runner's claim beyond Llama: tiny random Qwen2 / Qwen3 / Mistral decode like `generate`."""
    import transformers

    from tritonllm.engine.llm_engine import LLMEngine
    from tritonllm.engine.sampling_params import SamplingParams
    from tritonllm.engine.scheduler import SchedulerConfig

    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    _, tokenizer = model_loader.load_model("tiny", "cpu")
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        sliding_window=None, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=8))
    prompts = ["The quick brown fox jumps over", "Hello"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == ref.tolist()


def test_fused_weights_share_storage_and_leave_the_model_working():
    """The runner concatenates q|k|v and gate|up once; the HF modules then read views of them."""
    model, tokenizer = model_loader.load_model("tiny", "cpu", "float32")
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    before = model.generate(ids, max_new_tokens=8, do_sample=False)
    params = sum(p.numel() for p in model.parameters())
    runner = ModelRunner(model, num_slots=2, max_model_len=64)
    attn, fused = model.model.layers[0].self_attn, runner.layers[0]
    assert attn.q_proj.weight.data_ptr() == fused.qkv.data_ptr()  # a view, not a copy
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() > fused.gate_up.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == params
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), before)


def test_quantization_is_checked_and_named(monkeypatch):
    from tritonllm.kernels.quantization import QUANTIZATION_ENV

    monkeypatch.delenv(QUANTIZATION_ENV, raising=False)
    model, _ = model_loader.load_model("tiny", "cpu", "float32")
    with pytest.raises(ValueError, match="quantization must be one of none, int8, got 'int4'"):
        ModelRunner(model, num_slots=2, max_model_len=32, quantization="int4")
    with pytest.raises(ValueError, match="int8 runs on CPU with dtype bfloat16 or float16, not torch.float32"):
        ModelRunner(model, num_slots=2, max_model_len=32, quantization="int8")


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bundled_model_answers_in_bfloat16(monkeypatch, quantization):
    """The `auto` dtype of CPUs with native bf16, and int8 weights on it: the real model still knows."""
    from tritonllm.engine.llm_engine import LLMEngine
    from tritonllm.engine.sampling_params import SamplingParams
    from tritonllm.engine.scheduler import SchedulerConfig

    model, tokenizer = model_loader.load_model("bundled", "cpu", torch.bfloat16)
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=4, max_model_len=256), quantization)
    assert engine.runner.quantization == quantization
    capitals = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin"}
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is the capital of {country}?"}],
                                          add_generation_prompt=True, tokenize=False) for country in capitals]
    answers = [out.text for out in engine.generate(chat, SamplingParams(max_tokens=16, temperature=0))]
    right = sum(city in answer for city, answer in zip(capitals.values(), answers))
    # All four here; bf16 kernels of another CPU may flip one near-tied token, not the model's knowledge.
    assert right >= 3, answers


HUGE_PAGES_PROBE = """
import os, torch
from tritonllm.engine.model_loader import load_model
load_model("tiny", "cpu", torch.float32)
keep = torch.ones(4 << 20, dtype=torch.uint8)  # one tensor past PyTorch's 2 MB threshold, after the load
at, flags = keep.data_ptr(), ""
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        start, end = (int(x, 16) for x in head.split("-"))
        inside = start <= at < end
    elif inside and line.startswith("VmFlags:"):
        flags = line
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), " hg " in flags + " ")
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only: reads /proc")
@pytest.mark.parametrize("setting", [None, "0"])
def test_loading_a_model_asks_for_huge_pages_unless_the_user_said_no(setting):
    # What the project controls: PyTorch's allocator madvises large tensors for huge pages (the mapping's
    # "hg" flag). Whether the kernel has a free 2 MB page at that moment is the machine's business.
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", HUGE_PAGES_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == (setting or "1")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    assert out[1] == str(thp and setting is None), out
