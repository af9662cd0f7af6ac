"""Prompt rows' attention (kernels/prefill_attention.py): every row gets the bits of its own tile
computed alone, wherever its chunk starts and ends (a prefix-cache hit starts at a later tile than a
cold prefill; a budget cuts a chunk at a tile's end), with whole tiles sharing calls only where the
load-time check found that this CPU keeps their bits so."""

from __future__ import annotations

import random

import pytest
import torch

from tritonllm.kernels import prefill_attention as module
from tritonllm.kernels.prefill_attention import (CALL_ROWS, PREFILL_TILE, checked_call_rows, prefill_attention,
                                                shared_call_rows, tile_by_tile)

SHAPES = [(9, 3, 64), (4, 2, 16)]  # the bundled model's heads, kv heads and head dim; the tiny one's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_a_prompt_rows_bits_do_not_depend_on_the_chunk_around_it(heads, kv_heads, dim, dtype):
    call_rows = shared_call_rows(heads, kv_heads, dim, dtype, "cpu")  # what a runner of this shape uses here
    assert call_rows in (PREFILL_TILE, CALL_ROWS)
    torch.manual_seed(5)  # other rows than the check's
    rng = random.Random(5)
    length = 3 * CALL_ROWS + 150
    q = torch.randn(length, heads, dim).to(dtype)
    keys_values = torch.randn(1, 2 * kv_heads, length, dim).to(dtype)
    scale = dim ** -0.5
    cases = [(0, length), (PREFILL_TILE, length), (CALL_ROWS - PREFILL_TILE, 2 * CALL_ROWS), (5, 300)]
    cases += [(rng.randrange(0, end, rng.choice([1, PREFILL_TILE])), end)
              for end in (rng.randrange(2, length + 1) for _ in range(12))]
    for start, end in cases:
        got = prefill_attention(q[start:end], keys_values[:, :, :end], start, kv_heads, scale, call_rows)
        want = tile_by_tile(q[start:end], keys_values, start, kv_heads, scale)
        assert torch.equal(got, want), f"rows {start}..{end}, calls of up to {call_rows} rows"


def test_the_check_turns_shared_calls_off_where_a_kernel_changes_a_rows_bits(monkeypatch):
    """With AMX, a kernel whose result depends on how many rows share the call (as the flash kernel's
    blocking did on AMD EPYC) must leave a tile a call, one that does not shared calls; without
    AMX, a tile a call."""
    def exact(q, *args, **kwargs):  # a kernel whose rows never depend on the call
        return q * 2

    def by_call_rows(q, *args, **kwargs):
        return q * 2 + (q.shape[2] > PREFILL_TILE) * 1e-3

    shape = (2, 1, 8, torch.bfloat16, "cpu")
    monkeypatch.setattr(module.cpu_isa, "amx_enabled", lambda: True)
    checked_call_rows.cache_clear()
    try:
        monkeypatch.setattr(module.F, "scaled_dot_product_attention", exact)
        assert shared_call_rows(*shape) == CALL_ROWS
        checked_call_rows.cache_clear()
        monkeypatch.setattr(module.F, "scaled_dot_product_attention", by_call_rows)
        assert shared_call_rows(*shape) == PREFILL_TILE
        checked_call_rows.cache_clear()
        monkeypatch.setattr(module.F, "scaled_dot_product_attention", exact)
        monkeypatch.setattr(module.cpu_isa, "amx_enabled", lambda: False)
        assert shared_call_rows(*shape) == PREFILL_TILE  # without AMX, a tile a call whatever a check says
        monkeypatch.setattr(module.cpu_isa, "amx_enabled", lambda: True)
        assert shared_call_rows(2, 1, 8, torch.float32, "cpu") == PREFILL_TILE  # float32: AMX does not pack it
    finally:
        checked_call_rows.cache_clear()


def test_a_runner_attends_in_the_calls_the_check_chose():
    from tritonllm.engine.model_runner import ModelRunner
    from tritonllm.engine.model_loader import load_model

    model, _ = load_model("tiny", "cpu", torch.bfloat16)
    runner = ModelRunner(model, 2, 256)
    assert runner.prefill_call_rows == shared_call_rows(runner.num_heads, runner.num_kv_heads, runner.head_dim,
                                                        torch.bfloat16, "cpu")
