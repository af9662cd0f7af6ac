"""The compiled work between a layer's matmuls (kernels/layer_kernels.py, CPU, bfloat16).

Each kernel must give what the PyTorch path (step_ops.TorchOps) gives: the same bits where the
model's ops are exact products and sums rounded to bf16 (residual add, rotary, the KV write), at
most one bf16 step apart where a sum or an exp is computed in another order (norm, SiLU); and a
row's result must not depend on the other rows of the call. Every test runs the Numba loops and,
where the native kernels load (AVX512-BF16), their native twins (native/layer_ops.cpp).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tritonllm.kernels import layer_kernels, native
from tritonllm.engine.model_runner import Chunk, ModelRunner
from tritonllm.kernels.numba_helpers import as_numpy
from tritonllm.engine.step_ops import rms_norm
from tritonllm.engine.model_loader import load_model

pytestmark = pytest.mark.skipif(not layer_kernels.available(torch.bfloat16, torch.device("cpu"), "silu"),
                                reason="numba missing")
BF16 = torch.bfloat16
NATIVE = native.kernel()
IMPLS = [pytest.param(layer_kernels, id="numba")] + ([pytest.param(NATIVE, id="native")] if NATIVE else [])


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare values one bf16 step apart (2^-7 relative, with a floor for tiny values)."""
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-30).all(), diff.max()
    assert (got != want).float().mean() < 1e-3


def norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, ops=layer_kernels):
    hidden, out = hidden.clone(), torch.empty_like(hidden)
    ops.add_rms_norm(as_numpy(hidden), None if delta is None else as_numpy(delta), as_numpy(weight),
                               1e-5, as_numpy(out))
    return hidden, out


@pytest.mark.parametrize("ops", IMPLS)
def test_add_rms_norm_adds_exactly_and_normalises_as_the_model_does(ops):
    torch.manual_seed(0)
    hidden, delta = (torch.randn(300, 576) * 4).to(BF16), torch.randn(300, 576).to(BF16)
    weight = torch.randn(576).to(BF16)
    summed, normed = norm(hidden, delta, weight, ops)
    assert torch.equal(summed, hidden + delta)  # the residual add: PyTorch's bits
    close_in_bf16(normed, rms_norm(hidden + delta, weight, 1e-5))
    untouched, first = norm(hidden, None, weight, ops)  # the first layer: no residual yet
    assert torch.equal(untouched, hidden)
    close_in_bf16(first, rms_norm(hidden, weight, 1e-5))
    for row in (0, 7, 299):  # a row alone gets the bits it gets among 300
        alone = norm(hidden[row:row + 1], delta[row:row + 1], weight, ops)[1]
        assert torch.equal(alone[0], normed[row])


@pytest.mark.parametrize("ops", IMPLS)
def test_silu_mul_is_the_gated_activation(ops):
    torch.manual_seed(1)
    gate_up = (torch.randn(100, 2 * 1536) * 3).to(BF16)
    out = torch.empty(100, 1536, dtype=BF16)
    ops.silu_mul(as_numpy(gate_up), as_numpy(out))
    gate, up = gate_up.chunk(2, dim=-1)
    close_in_bf16(out, F.silu(gate) * up)
    alone = torch.empty(1, 1536, dtype=BF16)
    ops.silu_mul(as_numpy(gate_up[41:42].contiguous()), as_numpy(alone))
    assert torch.equal(alone[0], out[41])


@pytest.mark.parametrize("ops", IMPLS)
def test_rotate_and_store_rotates_q_and_k_and_writes_the_pool_as_pytorch_does(ops):
    model, _ = load_model("bundled", "cpu", BF16)
    runner = ModelRunner(model, 4, 256)
    heads, kv_heads, dim = runner.num_heads, runner.num_kv_heads, runner.head_dim
    torch.manual_seed(2)
    tokens = 6
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 2).to(BF16)
    positions = torch.tensor([0, 5, 63, 64, 130, 255])
    write_index = torch.tensor([65, 70, 128, 200, 3, 250])
    decode_of = torch.tensor([-1, 0, -1, -1, 1, -1])
    q_out = torch.empty(tokens, heads * dim, dtype=BF16)
    q_decode = torch.empty(2, heads * dim)
    pool = torch.zeros(2 * kv_heads, 8 * 64, dim, dtype=BF16)
    ops.rotate_and_store(as_numpy(qkv), runner.rotary_cos, runner.rotary_sin, positions.numpy(),
                         write_index.numpy(), as_numpy(pool), as_numpy(q_out), decode_of.numpy(), q_decode.numpy(),
                         heads)
    cos, sin = runner.rotary.at(positions)
    rows = qkv.view(tokens, -1, dim)
    want = rows * cos + rows.roll(dim // 2, -1) * sin  # the PyTorch path's rotary
    assert torch.equal(q_out.view(tokens, heads, dim), want[:, :heads])
    assert torch.equal(pool[:, write_index].transpose(0, 1), want[:, heads:])  # k rotated, v as it came
    assert torch.equal(q_decode, q_out[[1, 4]].float())


@pytest.mark.skipif(NATIVE is None, reason=f"native kernels {native.describe()}")
@pytest.mark.parametrize("rows, width", [(1, 576), (8, 576), (300, 576), (3, 100)])
def test_the_native_twins_give_the_numba_loops_bits(rows, width):
    """Widths not a multiple of 16 too (the native loops mask their last vector)."""
    g = torch.Generator().manual_seed(rows)
    hidden, delta = (torch.randn(rows, width, generator=g) * 4).to(BF16), torch.randn(rows, width, generator=g).to(BF16)
    weight = torch.randn(width, generator=g).to(BF16)
    for d in (delta, None):
        got, want = norm(hidden, d, weight, NATIVE), norm(hidden, d, weight, layer_kernels)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(BF16)
    got, want = torch.empty(rows, width, dtype=BF16), torch.empty(rows, width, dtype=BF16)
    NATIVE.silu_mul(as_numpy(gate_up), as_numpy(got))
    layer_kernels.silu_mul(as_numpy(gate_up), as_numpy(want))
    assert torch.equal(got, want)
    heads, kv_heads, dim, slots = 3, 1, 2 * width // 16, 40  # an even dim, halves not a multiple of 16 too
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(BF16)
    cos, sin = torch.randn(50, dim, generator=g).to(BF16), torch.randn(50, dim, generator=g).to(BF16)
    positions = torch.randint(0, 50, (rows,), generator=g).numpy()
    write_index = torch.randperm(max(slots, rows), generator=g)[:rows].numpy()
    decode_of = np.where(np.arange(rows) % 2 == 1, np.arange(rows) // 2, -1)
    results = []
    for ops in (NATIVE, layer_kernels):
        pool = np.zeros((2 * kv_heads, max(slots, rows), dim), np.uint16)
        q_out, q_decode = np.zeros((rows, heads * dim), np.uint16), np.zeros(((rows + 1) // 2, heads * dim), np.float32)
        ops.rotate_and_store(as_numpy(qkv), as_numpy(cos), as_numpy(sin), positions, write_index, pool, q_out,
                             decode_of, q_decode, heads)
        results.append((pool, q_out, q_decode))
    assert all(np.array_equal(a, b) for a, b in zip(*results))


@pytest.mark.skipif(NATIVE is None, reason=f"native kernels {native.describe()}")
def test_bad_shapes_are_refused_by_the_native_twins_with_what_is_wrong():
    hidden = np.zeros((2, 32), np.uint16)
    with pytest.raises(RuntimeError, match="add_rms_norm: weight or out does not fit"):
        NATIVE.add_rms_norm(hidden, None, np.zeros(16, np.uint16), 1e-5, np.zeros((2, 32), np.uint16))
    with pytest.raises(RuntimeError, match="silu_mul: gate_up must be"):
        NATIVE.silu_mul(np.zeros((2, 30), np.uint16), np.zeros((2, 16), np.uint16))
    with pytest.raises(RuntimeError, match="hidden has the wrong dtype"):
        NATIVE.add_rms_norm(hidden.astype(np.float32), None, np.zeros(32, np.uint16), 1e-5, hidden)
    positions = np.array([99, 0])
    with pytest.raises(RuntimeError, match="position 99 has no rotary table"):
        NATIVE.rotate_and_store(np.zeros((2, 12), np.uint16), np.zeros((4, 4), np.uint16), np.zeros((4, 4), np.uint16),
                                positions, np.array([0, 1]), np.zeros((2, 4, 4), np.uint16),
                                np.zeros((2, 4), np.uint16), np.array([-1, -1]), np.zeros((1, 4), np.float32), 1)


def test_the_runner_gives_the_same_answers_with_kernels_and_with_pytorch_ops():
    """The kernels round a rare norm or SiLU value one bf16 step away from PyTorch (the tests above);
    30 layers carry such a step into the logits as far as bf16 itself carries them from float32
    (kernels against PyTorch ops 0.22-0.38, either against float32 0.66 on an AVX2-only AMD EPYC;
    1.0 was seen on an AMD EPYC with AVX512-BF16). So the kernels' logits are held as close to the
    float32 model's as the PyTorch path's are, and give its greedy tokens."""
    model, tokenizer = load_model("bundled", "cpu", BF16)
    runner = ModelRunner(model, 4, 512)
    assert runner.cpu_kernels
    reference = ModelRunner(load_model("bundled", "cpu", torch.float32)[0], 4, 512)
    prompts = [tokenizer.encode("What is the capital of France? " * k) for k in (1, 4, 9)]

    def logits(runner: ModelRunner, kernels: bool):
        runner.cpu_kernels = kernels
        blocks = [runner.slot_blocks(i) for i in range(len(prompts))]
        prefill = runner.forward([Chunk(b, p, 0, True) for b, p in zip(blocks, prompts)])
        decode = runner.forward([Chunk(b, [1017], len(p), True, len(p)) for b, p in zip(blocks, prompts)])
        return prefill, decode

    for got, want, exact in zip(logits(runner, True), logits(runner, False), logits(reference, False)):
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        bf16_error = (want - exact).abs().max()
        assert (got - exact).abs().max() <= 1.5 * bf16_error, ((got - exact).abs().max(), bf16_error)


def test_a_runner_compiles_every_kernel_before_its_first_step():
    """A kernel compiled in a request's step would hold that step for seconds (no disk cache yet)."""
    from tritonllm.kernels import paged_attention

    model, tokenizer = load_model("tiny", "cpu", BF16)
    runner = ModelRunner(model, 4, 256)
    kernels = [layer_kernels._add_rms_norm, layer_kernels._rotate_and_store, layer_kernels._silu_mul,
               paged_attention._paged_decode]
    compiled = [len(k.signatures) for k in kernels]
    ids = tokenizer.encode("hello there " * 20)
    runner.forward([Chunk(runner.slot_blocks(0), ids, 0, True)])
    runner.forward([Chunk(runner.slot_blocks(0), [5], len(ids), True, len(ids)),
                    Chunk(runner.slot_blocks(1), ids[:70], 0, True)])  # a decode row beside a prompt
    assert [len(k.signatures) for k in kernels] == compiled
