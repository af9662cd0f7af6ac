"""Causal attention of a prompt chunk over its sequence's keys, in tiles fixed by absolute position.

A prompt's rows are cut into tiles of `PREFILL_TILE` positions ([0, 64), [64, 128), ...), and each
tile is one attention call over the keys up to its own end. A row is thus computed the same way
whatever chunks its prompt was scheduled in, as long as chunk boundaries fall on tile boundaries
(the scheduler keeps them there): CPU's flash kernel chooses its blocking from the call's shape,
so one call over a whole chunk gave a row other bits when the chunk was cut elsewhere
(measured, bf16). Calls are 4-D, with an explicit causal mask: CPU takes the flash kernel for
them (a 3-D call took the math kernel, ~10x slower for a 700-token prompt).

A tile of 64 measured fastest here: 512 prompt tokens after 512 cached ones took 15 ms a layer
against 29 ms with tiles of 16 and 26 ms in one call (bf16, AMD EPYC, 2 threads).

Whole tiles share a call, up to `CALL_ROWS` rows from a multiple of it: a row's bits stay those of
its own tile's call as long as the call's key count is a multiple of the tile (masked keys past
the row's tile change nothing then; a count with a vector tail did change bits). Each call ends on
a tile boundary; the last, partial tile of a chunk keeps a call of its own. A 1,280-token prompt
(chunks of 512) took 163 ms of attention so, against 196 ms a tile a call; 256 tokens after 1,024
cached 51 against 61 ms (bf16, Intel Xeon with AMX, 2 threads, 30 layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFILL_TILE = 64
CALL_ROWS = 256  # whole tiles share a call within each [k * CALL_ROWS, (k + 1) * CALL_ROWS)


def prefill_attention(q: torch.Tensor, keys_values: torch.Tensor, start: int, num_kv_heads: int,
                      scaling: float) -> torch.Tensor:
    """q: (n, heads, dim), the chunk's rows at positions start .. start + n - 1; keys_values:
    (1, 2 kv_heads, start + n, dim), the sequence's keys then values up to the chunk's end, its own
    included (kv_cache.gather). Returns (n, heads, dim)."""
    n, heads = q.shape[0], q.shape[1]
    end = start + n
    queries = q.transpose(0, 1)[None]  # (1, heads, n, dim)
    positions = torch.arange(end, device=q.device)
    out = torch.empty_like(q)
    whole_tiles_end = max(start, end // PREFILL_TILE * PREFILL_TILE)
    first = start
    while first < end:
        if first < whole_tiles_end:  # whole tiles, the call's keys a multiple of the tile
            last = min(whole_tiles_end, (first // CALL_ROWS + 1) * CALL_ROWS)
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
