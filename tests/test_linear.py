"""The runner's matmuls (kernels/linear.py): the kernel chosen per weight, and what it must keep.

A row's result must not depend on how many rows share the call (batch invariance of the matmul),
for every linear shape of the bundled model, in bfloat16 (the native kernel where the CPU has
AVX512-BF16, and with it off: oneDNN prepacked where oneDNN runs bf16, plain `F.linear` on an AVX2-only
CPU) and with int8 weights (the native int8 kernel where the CPU also has AVX512-VNNI, else weight-only); float32 stays plain `F.linear`, the model's own kernel. The native kernel's
own tests: test_native.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tritonllm.kernels import cpu_isa, native
from tritonllm.kernels.linear import NativeInt8Weight, NativeWeight, PackedWeight, linear, nbytes, prepare, prepack_enabled
from tritonllm.kernels.quantization import Int8Weight
from tritonllm.model_files import prepare_bundled

ROW_COUNTS = (1, 2, 3, 5, 8, 13, 32, 64, 257)
ONEDNN_BF16 = prepack_enabled(torch.bfloat16, torch.device("cpu"))  # CPU-dependent (cpu_isa.py)
NATIVE = native.kernel() is not None  # CPU-dependent (AVX512-BF16), and built by ./setup.sh
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU has no oneDNN bf16 (AVX2 only): F.linear")


@pytest.fixture(params=["native", "previous"])
def path(request, monkeypatch):
    """The bf16 path: the native kernel, or with it off (TRITONLLM_NATIVE_KERNELS=0) linear.py's other."""
    if request.param == "native" and not NATIVE:
        pytest.skip("no native kernel here: the CPU has no AVX512-BF16")
    monkeypatch.setenv(native.SWITCH_ENV, "1" if request.param == "native" else "0")
    return request.param


@pytest.fixture
def previous_path(monkeypatch):
    """linear.py's paths with the native kernel off (oneDNN prepacked where oneDNN runs bf16)."""
    monkeypatch.setenv(native.SWITCH_ENV, "0")


def bundled_linear_shapes() -> dict[str, tuple[int, int]]:
    """(in, out) of every matmul of the bundled model's runner, from its config."""
    config = json.loads((prepare_bundled() / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden), "lm_head": (hidden, config["vocab_size"])}


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down", "lm_head"])
def test_a_rows_result_does_not_depend_on_the_row_count(name, quantization, path):
    fan_in, fan_out = bundled_linear_shapes()[name]
    torch.manual_seed(0)
    weight = (torch.randn(fan_out, fan_in) * fan_in ** -0.5).to(torch.bfloat16)
    x = torch.randn(max(ROW_COUNTS), fan_in).to(torch.bfloat16)
    prepared = prepare(weight, quantization, rows_hint=8)
    native_int8 = path == "native" and "avx512_vnni" in cpu_isa.cpu_flags()
    assert isinstance(prepared, (NativeInt8Weight if native_int8 else Int8Weight) if quantization == "int8"
                      else NativeWeight if path == "native" else PackedWeight if ONEDNN_BF16 else torch.Tensor)
    full = linear(x, prepared)
    for rows in ROW_COUNTS:
        assert torch.equal(linear(x[:rows], prepared), full[:rows]), f"{name}: {rows} rows differ"
    # every row alone (a decode step of one sequence): oneDNN once summed a lone row in another order
    lone = [row for row in range(len(x)) if not torch.equal(linear(x[row:row + 1], prepared), full[row:row + 1])]
    assert not lone, f"{name}: {len(lone)} of {len(x)} rows differ alone, first {lone[:5]}"


def test_a_bf16_weight_keeps_the_bias_and_the_values(path):
    torch.manual_seed(1)
    weight, bias = torch.randn(96, 64).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    x = torch.randn(7, 64).to(torch.bfloat16)
    got = linear(x, prepare(weight, "none", rows_hint=8), bias)
    torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)
    assert nbytes(prepare(weight, "none", 8)) == weight.numel() * 2
    int8 = prepare(weight, "int8", 8)
    # a bf16 scale a row (weight-only), or a float32 scale a 32 of a row (the native int8 kernel)
    assert nbytes(int8) == weight.numel() + (96 * 2 * 4 if isinstance(int8, NativeInt8Weight) else 96 * 2)
    want = F.linear(x, weight, bias).float()
    assert (linear(x, int8, bias).float() - want).norm() / want.norm() < 0.02


def test_float32_and_other_devices_keep_the_plain_weight():
    weight = torch.randn(8, 4)
    assert isinstance(prepare(weight, "none", rows_hint=8), torch.Tensor)  # float32: F.linear, the model's own
    assert not prepack_enabled(torch.float32, torch.device("cpu"))
    assert not prepack_enabled(torch.bfloat16, torch.device("cuda"))


def test_call_ranges_keep_a_prompt_tile_whole_and_cut_free_rows_at_the_block():
    from tritonllm.kernels.linear import call_ranges

    assert call_ranges([(i, i + 1) for i in range(70)], 32) == [(0, 32, 32), (32, 64, 32), (64, 70, 6)]  # decode rows
    # two decode rows, a tile of 48 prompt rows (its own call, padded to 64), 14 more prompt rows and a decode row
    assert call_ranges([(0, 1), (1, 2), (2, 50), (50, 64), (64, 65)], 32) == [(0, 2, 2), (2, 50, 64), (50, 65, 15)]
    assert call_ranges([(0, 64), (64, 128), (128, 140), (140, 141)], 32) == [(0, 64, 64), (64, 128, 64), (128, 141, 13)]
    assert call_ranges([(0, 1), (1, 2)], None) is None  # no limit: one call


def test_call_ranges_put_consecutive_tiles_in_calls_of_whole_tiles_up_to_tile_rows():
    from tritonllm.kernels.linear import call_ranges

    tiles = [(0, 64), (64, 128), (128, 192), (192, 256), (256, 294)]
    assert call_ranges(tiles + [(294, 295)], 32, 192) == [(0, 192, 192), (192, 294, 128), (294, 295, 1)]
    # a decode row between two prompts' tiles ends a call; a partial tile joins full ones, padded
    groups = [(0, 1), (1, 65), (65, 129), (129, 167), (167, 168), (168, 232)]
    assert call_ranges(groups, 32, 192) == [(0, 1, 1), (1, 167, 192), (167, 168, 1), (168, 232, 64)]


def test_a_tile_of_rows_gets_the_same_bits_in_any_step(path):
    """Rows cut by `call_ranges` get the same bits whatever rows share the step: a tile alone against
    the same tile after decode rows and before another tile."""
    from tritonllm.kernels.linear import call_ranges

    fan_in, fan_out = bundled_linear_shapes()["gate_up"]
    torch.manual_seed(1)
    weight = prepare((torch.randn(fan_out, fan_in) * fan_in ** -0.5).to(torch.bfloat16), "none", rows_hint=8)
    tile = torch.randn(50, fan_in).to(torch.bfloat16)
    others = torch.randn(100, fan_in).to(torch.bfloat16)
    block = 32  # AMX's limit; any other CPU keeps bits at any row count
    alone = linear(tile, weight, calls=call_ranges([(0, 50)], block))
    step = torch.cat([others[:7], tile, others[7:71]])
    groups = [(i, i + 1) for i in range(7)] + [(7, 57), (57, 121)]
    assert torch.equal(linear(step, weight, calls=call_ranges(groups, block))[7:57], alone)


@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_a_prompt_row_gets_the_same_bits_whichever_tiles_share_its_call(name, path):
    """A prefix-cache hit computes a prompt's rows from a later tile on than a cold prefill does, so
    the tiles share calls otherwise (call_ranges merges them up to the weight's `tile_rows`, found
    at load): every row must get the same bits, for every layer shape of the bundled model."""
    from tritonllm.kernels.linear import TILE_ROWS, call_ranges

    fan_in, fan_out = bundled_linear_shapes()[name]
    torch.manual_seed(2)
    weight = prepare((torch.randn(fan_out, fan_in) * fan_in ** -0.5).to(torch.bfloat16), "none", rows_hint=8)
    tile_rows = getattr(weight, "tile_rows", None) or 192  # None: no AMX, any call keeps the bits
    assert tile_rows % TILE_ROWS == 0
    prompt = torch.randn(700, fan_in).to(torch.bfloat16)
    tiles = [(first, min(first + TILE_ROWS, len(prompt))) for first in range(0, len(prompt), TILE_ROWS)]
    cold = linear(prompt, weight, calls=call_ranges(tiles, 32, tile_rows))
    for hit in (1, 2, 3, 5, 10):  # cached tiles
        start = tiles[hit][0]
        rest = [(first - start, last - start) for first, last in tiles[hit:]]
        assert torch.equal(linear(prompt[start:], weight, calls=call_ranges(rest, 32, tile_rows)), cold[start:]), hit
    alone = torch.cat([linear(prompt[a:b], weight, calls=call_ranges([(0, b - a)], 32)) for a, b in tiles])
    assert torch.equal(alone, cold)  # a tile a call, the last one padded


@needs_onednn_bf16
def test_a_runner_without_batch_invariance_makes_one_call_a_weight_a_step(monkeypatch, previous_path):
    """`batch_invariant: false` trades the cut calls for one matmul call a weight a step (rows limited
    to 4 a call here, as AMX limits them to 32, so that any CPU shows the cut)."""
    from dataclasses import replace

    from tritonllm.kernels import linear as linear_module
    from tritonllm.engine.model_runner import Chunk, ModelRunner
    from tritonllm.engine.model_loader import load_model

    model, _ = load_model("tiny", "cpu", torch.bfloat16)
    calls = []
    real = linear_module._packed_call
    monkeypatch.setattr(linear_module, "_packed_call", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    results = {}
    for invariant in (True, False):
        runner = ModelRunner(model, 8, 256, batch_invariant=invariant)
        runner.layers = [replace(w, **{n: replace(getattr(w, n), row_block=4) for n in ("qkv", "o", "gate_up", "down")})
                         for w in runner.layers]
        runner.row_block = 4
        chunks = [Chunk(runner.slot_blocks(i), [5 + i], 7, True) for i in range(6)]
        runner.forward(chunks)  # the keys the step attends to (any values: the same in both runs)
        calls.clear()
        results[invariant] = runner.forward(chunks)
        per_weight = len(calls) - 1  # the lm_head is one call of the 6 rows wanting logits
        results[invariant, "calls"] = per_weight / (4 * len(runner.layers))
    assert results[True, "calls"] == 2 and results[False, "calls"] == 1  # 6 rows: 4 + 2, or all 6
    torch.testing.assert_close(results[True], results[False], atol=0.1, rtol=0.05)  # the same model either way


def test_the_row_block_is_checked_at_load_and_cut_where_a_kernel_changes_bits():
    """Calls of any row count (no AMX) or of 32 (AMX) are checked per weight at load; a kernel that
    gives a row other bits past 8 rows (as oneDNN's AMX kernel does past 32) gets calls of 8."""
    from tritonllm.kernels.linear import checked_row_block

    def exact(x):  # every row computed by itself
        return x[:, :16] * 2

    def past8(x):
        return exact(x) + (x.shape[0] > 8) * 1e-3

    assert checked_row_block(exact, 32, torch.float32, None) is None
    assert checked_row_block(exact, 32, torch.float32, 32) == 32
    assert checked_row_block(past8, 32, torch.float32, None) == 8
    assert checked_row_block(past8, 32, torch.float32, 32) == 8
    assert checked_row_block(lambda x: exact(x) + (x.shape[0] > 1) * 1e-3, 32, torch.float32, None) == 1
