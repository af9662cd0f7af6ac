"""Causal attention of a prompt chunk over its sequence's keys, in tiles fixed by absolute position.

A prompt's rows are cut into tiles of `PREFILL_TILE` positions ([0, 64), [64, 128), ...), and each
tile is computed as one attention call over the keys up to its own end. A row is thus computed the
same way whatever chunks its prompt was scheduled in, as long as chunk boundaries fall on tile
boundaries (the scheduler keeps them there): CPU's flash kernel chooses its blocking from the
call's shape, so one call over a whole chunk gave a row other bits when the chunk was cut
elsewhere. Calls are 4-D, with an explicit causal mask: CPU takes the flash kernel for them (a
3-D call took the math kernel, ~10x slower for a 700-token prompt).

Whole tiles may share a call, up to `CALL_ROWS` rows from a multiple of it, each call ending on a
tile boundary (the chunk's last, partial tile keeps a call of its own): a row keeps its tile's
bits there when the flash kernel adds masked keys past the row's tile without changing its sums.
That is CPU-dependent (it held on an Intel Xeon with AMX, failed on AMD EPYC), so calls are shared
only where the flash kernel runs AMX and a check at load for the model's head shape passes
(`shared_call_rows`). Timings in
docs/benchmarks.md.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from tritonllm.kernels import cpu_isa

PREFILL_TILE = 64
CALL_ROWS = 256  # where the check passes, whole tiles share a call within each [k * CALL_ROWS, (k + 1) * CALL_ROWS)
CHECK_LENGTH = 4 * CALL_ROWS + 150  # positions of the load-time check: past two key blocks of 512


def prefill_attention(q: torch.Tensor, keys_values: torch.Tensor, start: int, num_kv_heads: int,
                      scaling: float, call_rows: int = PREFILL_TILE) -> torch.Tensor:
    """q: (n, heads, dim), the chunk's rows at positions start .. start + n - 1; keys_values:
    (1, 2 kv_heads, start + n, dim), the sequence's keys then values up to the chunk's end, its own
    included (kv_cache.gather); call_rows: whole tiles share calls within spans of this many rows
    (`shared_call_rows`; PREFILL_TILE: a tile a call). Returns (n, heads, dim)."""
    n, heads = q.shape[0], q.shape[1]
    end = start + n
    queries = q.transpose(0, 1)[None]  # (1, heads, n, dim)
    positions = torch.arange(end, device=q.device)
    out = torch.empty_like(q)
    whole_tiles_end = max(start, end // PREFILL_TILE * PREFILL_TILE)
    first = start
    while first < end:
        if first < whole_tiles_end:  # whole tiles, the call's keys a multiple of the tile
            last = min(whole_tiles_end, (first // call_rows + 1) * call_rows)
        else:  # the chunk's last, partial tile
            last = end
        mask = positions[None, :last] <= positions[first:last, None]
        tile = F.scaled_dot_product_attention(
            queries[:, :, first - start:last - start], keys_values[:, :num_kv_heads, :last],
            keys_values[:, num_kv_heads:, :last], attn_mask=mask, scale=scaling,
            enable_gqa=heads != num_kv_heads)
        out[first - start:last - start] = tile[0].transpose(0, 1)
        first = last
    return out


def tile_by_tile(q: torch.Tensor, keys_values: torch.Tensor, start: int, num_kv_heads: int,
                 scaling: float) -> torch.Tensor:
    """The reference: each tile of the chunk as a chunk of its own, one call over the keys up to the
    tile's end."""
    end = start + q.shape[0]
    out, first = [], start
    while first < end:
        last = min(end, (first // PREFILL_TILE + 1) * PREFILL_TILE)
        out.append(prefill_attention(q[first - start:last - start], keys_values[:, :, :last], first,
                                     num_kv_heads, scaling))
        first = last
    return torch.cat(out)


def check_cases(length: int) -> list[tuple[int, int]]:
    """(start, end) of chunks for the check: a cold prefill and prefix hits from later tiles to every
    tile boundary (a call's key count, which picks the kernel's key blocks), one chunk starting
    inside a tile, and the whole length with its partial last tile."""
    ends = range(2 * PREFILL_TILE, length + 1, PREFILL_TILE)
    return [(first, end) for end in ends for first in (0, 3 * PREFILL_TILE, 5) if first < end] + [(0, length)]


def shared_call_rows(heads: int, num_kv_heads: int, dim: int, dtype: torch.dtype, device: str) -> int:
    """How many rows whole tiles may share calls within: CALL_ROWS where PyTorch's flash kernel runs
    AMX on bf16 keys (CPU-dependent: cpu_isa.py) and the check passes for this head shape, else PREFILL_TILE (a
    tile a call). Without AMX a random check is not enough: on an AVX2-only AMD EPYC one row in ~900
    of the tiny model's shape changed with other random data than a passing check's."""
    if device != "cpu" or dtype != torch.bfloat16 or not cpu_isa.amx_enabled():  # AMX packs bf16 keys only
        return PREFILL_TILE
    return checked_call_rows(heads, num_kv_heads, dim, dtype, device)


@lru_cache(maxsize=None)
def checked_call_rows(heads: int, num_kv_heads: int, dim: int, dtype: torch.dtype, device: str) -> int:
    """CALL_ROWS where whole tiles sharing calls give every row of random prompts the bits of its
    tile's own call, for this head shape here; PREFILL_TILE where any row differs."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(CHECK_LENGTH, heads, dim, generator=generator).to(dtype=dtype, device=device)
    keys_values = torch.randn(1, 2 * num_kv_heads, CHECK_LENGTH, dim, generator=generator).to(dtype=dtype,
                                                                                               device=device)
    scaling = dim ** -0.5
    with torch.inference_mode():
        # A whole tile's rows get the same bits in any chunk, a tile a call: one reference for all.
        reference = tile_by_tile(q, keys_values, 0, num_kv_heads, scaling)
        for start, end in check_cases(CHECK_LENGTH):
            shared = prefill_attention(q[start:end], keys_values[:, :, :end], start, num_kv_heads, scaling, CALL_ROWS)
            want = reference[start:end] if end % PREFILL_TILE == 0 or end == CHECK_LENGTH else None
            if want is None or start % PREFILL_TILE:
                want = tile_by_tile(q[start:end], keys_values, start, num_kv_heads, scaling)
            if not torch.equal(shared, want):
                return PREFILL_TILE
    return CALL_ROWS
