"""A decode step's layers in one native call (kernels/decode_layers.py, native/decode_layers.cpp): the
same logits and the same KV writes, bit for bit, as the runner's layer loop, which steps with prompt
rows take; where it is made; and bad arguments refused with what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tritonllm.engine.model_loader import load_model
from tritonllm.engine.model_runner import Chunk, ModelRunner
from tritonllm.kernels import native, paged_attention

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=f"native kernels {native.describe()}")


def random_model(**overrides):
    """A small random Llama with a head dim the paged decode kernel has (64), biases on q|k|v and o."""
    config = dict(vocab_size=300, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64, attention_bias=True,
                  max_position_embeddings=4096)
    config.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16).eval()
    with torch.no_grad():  # biases are zero at init: make them count
        for p in model.parameters():
            if p.dim() == 1 and not p.abs().sum():
                p.normal_(0, 0.5)
    return model


def both_ways(runner: ModelRunner, lengths: list[int]):
    """Logits and the KV pools after one decode step at these lengths, fused and by the loop (each from the
    same cache: the step's writes are at the same slots)."""
    fused, results = runner.decode_layers, []
    for way in (fused, None):
        runner.decode_layers = way
        before = [layer.clone() for layer in runner.cache.layers]
        logits = runner.decode_ceiling_step(lengths)
        results.append((logits, [layer.clone() for layer in runner.cache.layers]))
        for layer, saved in zip(runner.cache.layers, before):
            layer.copy_(saved)
    runner.decode_layers = fused
    return results


def fill_cache(runner: ModelRunner, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in runner.cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))


LENGTHS = [[32] * 8, [128] * 32, [5, 700, 64, 1500, 33], [1], [2000, 3, 1100]]


@needs_kernel
@pytest.mark.parametrize("model_name,quantization", [("bundled", None), ("bundled", "int8"), ("random", None)])
def test_the_fused_step_gives_the_loops_bits(model_name, quantization):
    model = random_model() if model_name == "random" else load_model("bundled", "cpu", torch.bfloat16)[0]
    runner = ModelRunner(model, num_slots=32, max_model_len=2048, quantization=quantization)
    assert runner.decode_layers is not None
    fill_cache(runner)
    for lengths in LENGTHS:
        (fused, fused_pools), (loop, loop_pools) = both_ways(runner, lengths)
        assert torch.equal(fused, loop), f"{lengths}: max diff {(fused - loop).abs().max()}"
        assert all(torch.equal(a, b) for a, b in zip(fused_pools, loop_pools)), f"{lengths}: the KV writes differ"


@needs_kernel
def test_a_step_with_prompt_rows_takes_the_loop_and_its_decode_rows_match():
    """The decode row's logits are the same in a step beside a prompt (the loop) as alone (fused)."""
    runner = ModelRunner(random_model(), num_slots=4, max_model_len=512)
    fill_cache(runner)
    decode = Chunk(runner.slot_blocks(0), [7], 90, True)
    alone = runner.forward([decode])[0]
    calls = []
    fused = runner.decode_layers
    runner.decode_layers = type("Spy", (), {"forward": lambda self, *a: calls.append(a) or fused.forward(*a)})()
    beside = runner.forward([Chunk(runner.slot_blocks(1), list(range(40)), 0, True), decode])[1]
    assert not calls, "a step with prompt rows must take the layer loop"
    assert torch.equal(beside, alone)
    runner.forward([decode])
    assert len(calls) == 1, "a step of decode rows alone must take the fused call"


@needs_kernel
def test_it_is_made_only_where_every_piece_has_a_native_kernel(monkeypatch):
    assert ModelRunner(load_model("tiny", "cpu", torch.bfloat16)[0], 2, 64).decode_layers is None  # head dim 16
    assert ModelRunner(random_model(), 2, 64, quantization=None).decode_layers is not None
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64)).to(torch.bfloat16).eval()
    assert ModelRunner(qwen3, 2, 64).decode_layers is None  # per-head q/k norms: the loop
    assert ModelRunner(random_model().float(), 2, 64).decode_layers is None
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert ModelRunner(random_model(), 2, 64).decode_layers is None


@needs_kernel
def test_bad_arguments_are_refused_with_what_is_wrong():
    runner = ModelRunner(random_model(), num_slots=2, max_model_len=256)
    layers = runner.decode_layers
    tables, lengths, order = paged_attention.decode_rows([10], [runner.slot_blocks(0)], runner.num_kv_heads)
    hidden = torch.zeros(1, 192, dtype=torch.bfloat16)
    good = dict(positions=np.array([9]), write_index=np.array([runner.slot_blocks(0)[0] * 64 + 9]))

    def call(**changes):
        args = {**good, "tables": tables, "lengths": lengths, "order": order, **changes}
        return layers.forward(hidden.clone(), args["positions"], args["write_index"], args["tables"], args["lengths"],
                              args["order"])

    assert call().shape == (1, 192)
    for changes, message in ((dict(positions=np.array([99999])), "position 99999 has no rotary table"),
                             (dict(write_index=np.array([10 ** 9])), "is not in the pool"),
                             (dict(lengths=np.array([10 ** 6])), "its table holds"),
                             (dict(tables=tables * 0 + 10 ** 6), "is not in the pool"),
                             (dict(order=order * 0), "order must hold each task once"),
                             (dict(positions=np.array([1.5])), "positions has the wrong dtype")):
        with pytest.raises(RuntimeError, match=message):
            call(**changes)
    with pytest.raises(RuntimeError, match="hidden must be"):
        layers.forward(torch.zeros(1, 64, dtype=torch.bfloat16), good["positions"], good["write_index"], tables,
                       lengths, order)
    assert torch.equal(call(), call())  # still works, the same (hidden is added to in place: a copy a call)
