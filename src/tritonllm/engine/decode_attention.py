"""Attention of a step's one-token rows (decodes), at a cost that follows their true lengths.

Each row attends over its own sequence's keys (kv_cache.py). Rows are grouped by the number of
keys their call spans, a function of the row's own length only (`call_keys`): rows up to 510 keys
take the next rung of a ladder (110, 174, 238, ... for the bundled model: steps of 64), longer
rows a call of their own over their keys padded to 64. Each group is one call, masked to each
row's own length. One call over every row padded to the longest made every row pay for the
longest (7 rows at 32 tokens + 1 at 1,600 cost as much as 8 at 1,600); here a row pays at most
63 keys past its own.

Batch invariance: a row's result must not depend on the other rows. Measured on PyTorch 2.13's
CPU flash kernel (bundled model, bf16): a row's bits changed with the number of keys its call
spanned, masked keys included (318 against 382 keys: other bits, whatever the masked keys held),
and with the thread that computed it: the kernel gives each thread a buffer of (query heads per
KV head) x (keys + 2 + head_dim) floats, and a row computed in a buffer off a 64-byte boundary
rounded differently. So the key count is the row's own choice, never its neighbours', and the
ladder's counts put every thread's buffer on a 64-byte boundary (`aligned`; ≡ 14 mod 16 for the
bundled model). Past the kernel's block of 512 keys no count aligns it; such a row always goes
alone, so its work is split across threads the same way every time. Several rows of one sequence
(its generated tokens recomputed after preemption) are rows like any others, each over its own
prefix: computed as when they were decoded one by one.

Rows at home in their lane (block_manager.py) are read in place: one call over the lanes up to
the highest used one, as fixed slots were (lanes without a row of the group attend one harmless
key, dropped). The other rows' keys are gathered into a buffer first (kv_cache.KVGather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.engine.kv_cache import KVGather, PagedKVCache

SMALL_GEMM = 16 ** 3  # PyTorch's CPU gemm takes its fallback at or below this many multiply-adds
FLASH_KV_BLOCK = 512  # PyTorch's CPU flash kernel computes keys in blocks of this many
RUNG = 64  # keys between two counts of the ladder


def padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def aligned(keys: int, query_heads_per_kv_head: int, head_dim: int) -> int:
    """The fewest keys >= `keys` that put each thread's buffer of the flash kernel on 64 bytes."""
    while (query_heads_per_kv_head * (keys + 2 + head_dim)) % 16:
        keys += 1
    return keys


def call_keys(length: int, query_heads_per_kv_head: int, head_dim: int) -> tuple[int, bool]:
    """(keys the call of a row of `length` keys spans, whether the row goes alone)."""
    g = query_heads_per_kv_head
    first = aligned(SMALL_GEMM // (g * head_dim) + 1, g, head_dim)  # past the small-gemm fallback
    keys = first + padded(max(0, length - first), RUNG)
    if keys < FLASH_KV_BLOCK and aligned(keys, g, head_dim) == keys:
        return keys, False
    return padded(length, RUNG), True


class DecodeAttention:
    """Made once per step for its one-token rows; `__call__` runs one layer's attention for them."""

    def __init__(self, rows: list[int], lengths: list[int], tables: list[list[int]], cache: PagedKVCache,
                 num_kv_heads: int, scaling: float, device: torch.device, group: int, head_dim: int):
        """rows: each row's index among the step's tokens; lengths: its keys (its own included);
        tables: its sequence's block table; group: query heads per KV head."""
        self.cache, self.num_kv_heads, self.scaling = cache, num_kv_heads, scaling
        self.rows = torch.tensor(rows, device=device)
        by_keys: dict[int, list[int]] = {}
        self.lone_rows = []
        self.groups = []  # (rows, where their keys come from, mask, query of each call row, its output rows)
        for i, n in enumerate(lengths):
            keys, alone = call_keys(n, group, head_dim)
            if alone:
                self.lone_rows.append(i)
                self.groups.append(self.gathered([i], lengths, tables, keys, device))
            else:
                by_keys.setdefault(keys, []).append(i)
        for keys, members in sorted(by_keys.items()):
            lanes = {}  # row -> its lane, for rows at home (one row per lane)
            for i in members:
                lane = cache.home_lane(tables[i], keys)
                if lane is not None and lane not in lanes.values():
                    lanes[i] = lane
            span = max(lanes.values()) + 1 if lanes else 0
            if lanes and span <= 2 * len(lanes):  # else a few rows in far lanes: gathering them is cheaper
                queries = [min(lanes)] * span  # the row whose query each lane takes (lanes without one: any)
                visible = [1] * span
                for i, lane in lanes.items():
                    queries[lane], visible[lane] = i, lengths[i]
                self.groups.append((torch.tensor(list(lanes), device=device), span, mask(keys, visible, device),
                                    torch.tensor(queries, device=device), torch.tensor(list(lanes.values()), device=device)))
                members = [i for i in members if i not in lanes]
            if members:
                self.groups.append(self.gathered(members, lengths, tables, keys, device))
        self.whole = len(self.groups) == 1 and self.groups[0][4] is None and len(self.groups[0][0]) == len(rows)

    def gathered(self, members, lengths, tables, keys, device):
        index = torch.tensor(members, device=device)
        gather = KVGather(self.cache, [tables[i] for i in members], keys, RUNG)
        return index, gather, mask(keys, [lengths[i] for i in members], device), index, None

    def __call__(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q: (tokens, heads, dim) of the whole step. Returns (rows, heads, dim) in the order of the
        rows given at construction."""
        heads, dim = q.shape[1], q.shape[2]
        kvh = self.num_kv_heads
        # Query heads grouped by the KV head they share (GQA) instead of repeating keys.
        queries = q[self.rows].view(-1, kvh, heads // kvh, dim)
        out = None if self.whole else torch.empty_like(queries)
        for members, source, keys_mask, query_rows, picked in self.groups:
            if isinstance(source, KVGather):
                keys_values = source(layer)
            else:  # lanes 0 .. source - 1, in place
                keys_values = self.cache.lane_view(layer, source, keys_mask.shape[-1])
            result = F.scaled_dot_product_attention(queries[query_rows], keys_values[:, :kvh], keys_values[:, kvh:],
                                                    attn_mask=keys_mask, scale=self.scaling)
            if out is None:
                return result.reshape(-1, heads, dim)
            out[members] = result if picked is None else result[picked]
        return out.reshape(-1, heads, dim)


def mask(keys: int, visible: list[int], device) -> torch.Tensor:
    """(calls, 1, 1, keys): each call row sees its first `visible` keys."""
    return (torch.arange(keys, device=device)[None, :] < torch.tensor(visible, device=device)[:, None])[:, None, None, :]
