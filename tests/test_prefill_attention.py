"""Prompt rows' attention (engine/prefill_attention.py): whole tiles share calls, yet every row
gets the bits of its own tile computed alone, wherever its chunk starts and ends (a prefix-cache
hit starts at a later tile than a cold prefill; a budget cuts a chunk at a tile's end)."""

from __future__ import annotations

import random

import pytest
import torch

from tritonllm.engine.prefill_attention import CALL_ROWS, PREFILL_TILE, prefill_attention


def tile_by_tile(q: torch.Tensor, keys_values: torch.Tensor, start: int, kv_heads: int, scale: float) -> torch.Tensor:
    """Each tile of rows as a chunk of its own: one call over the keys up to the tile's end."""
    end = start + q.shape[0]
    out, first = [], start
    while first < end:
        last = min(end, (first // PREFILL_TILE + 1) * PREFILL_TILE)
        out.append(prefill_attention(q[first - start:last - start], keys_values[:, :, :last], first, kv_heads, scale))
        first = last
    return torch.cat(out)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16)])  # the bundled model's, the tiny one's
def test_a_prompt_rows_bits_do_not_depend_on_the_chunk_around_it(heads, kv_heads, dim):
    torch.manual_seed(5)
    rng = random.Random(5)
    length = 3 * CALL_ROWS + 150
    q = torch.randn(length, heads, dim, dtype=torch.bfloat16)
    keys_values = torch.randn(1, 2 * kv_heads, length, dim, dtype=torch.bfloat16)
    scale = dim ** -0.5
    cases = [(0, length), (PREFILL_TILE, length), (CALL_ROWS - PREFILL_TILE, 2 * CALL_ROWS), (5, 300)]
    cases += [(rng.randrange(0, end, rng.choice([1, PREFILL_TILE])), end)
              for end in (rng.randrange(2, length + 1) for _ in range(12))]
    for start, end in cases:
        got = prefill_attention(q[start:end], keys_values[:, :, :end], start, kv_heads, scale)
        want = tile_by_tile(q[start:end], keys_values, start, kv_heads, scale)
        assert torch.equal(got, want), f"rows {start}..{end}"
