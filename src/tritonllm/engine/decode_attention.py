"""Attention of a step's one-token rows (decodes), at a cost that follows their true lengths.

Each row attends over its own sequence's keys, gathered from its KV blocks (kv_cache.py). One
batched call over every row, padded to the longest, would cost rows x longest: one long request
made every row pay for its length (7 rows at 32 tokens + 1 at 1,600 cost as much as 8 at 1,600).
Here rows are split by length at a `cut`:

- rows up to `cut` keys: one batched call, each row masked to its own length;
- each longer row: a call of its own over its own keys.

`cut` is chosen per step by a cost model measured on this CPU (a padded key of the batched call
costs 1, a key of a lone call ~1.4, a lone call ~500 keys): a few long rows get their own calls,
rows of similar length stay together. Off CPU (not measured there) the batched call covers every
row (cut = longest).

Batch invariance: a row's result must not depend on the other rows. CPU's flash kernel gives a
row the same bits over any number of keys past its own, masked, once that number is a multiple
of 16 (measured; shorter paddings round differently) and no block of keys is so small that its
gemm (keys x query heads per KV head x head_dim multiply-adds) falls to PyTorch's fallback below
16^3, another code path. So every call, batched or lone, attends over a multiple of `key_pad`
keys, masked to each row's own: alone or beside any others, a row is computed over the same keys
in the same order. Several rows of one sequence (its generated tokens recomputed after
preemption) are rows like any others, each over its own prefix: computed as when they were
decoded one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.engine.kv_cache import PagedKVCache

LONE_KEY_COST = 1.4  # a key attended in a row's own call, against 1 for a key of the batched call
LONE_CALL_COST = 500  # a call of its own, in batched keys (measured, AMD EPYC, bf16)
SMALL_GEMM = 16 ** 3  # PyTorch's CPU gemm takes its fallback at or below this many multiply-adds


def key_pad(query_heads_per_kv_head: int, head_dim: int) -> int:
    """Every call attends over a multiple of this many keys: a multiple of 16 whose block of keys
    is past the small-gemm fallback (32 for the bundled model: 3 query heads per KV head, dim 64)."""
    pad = 16
    while pad * query_heads_per_kv_head * head_dim <= SMALL_GEMM:
        pad += 16
    return pad


def padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def choose_cut(lengths: list[int], lone_calls: bool) -> int:
    """The longest row that attends in the batched call; longer rows go alone."""
    longest = max(lengths)
    if not lone_calls:
        return longest

    def cost(cut: int) -> float:
        return sum(cut if n <= cut else n * LONE_KEY_COST + LONE_CALL_COST for n in lengths)

    return min(sorted(set(lengths)), key=cost)


class DecodeAttention:
    """Made once per step for its one-token rows; `__call__` runs one layer's attention for them."""

    def __init__(self, rows: list[int], lengths: list[int], tables: list[list[int]], cache: PagedKVCache,
                 num_kv_heads: int, scaling: float, device: torch.device, pad: int):
        """rows: each row's index among the step's tokens; lengths: its keys (its own included);
        tables: its sequence's block table."""
        self.cache, self.num_kv_heads, self.scaling = cache, num_kv_heads, scaling
        self.rows = torch.tensor(rows, device=device)
        self.cut = choose_cut(lengths, lone_calls=device.type == "cpu")
        together = [i for i, n in enumerate(lengths) if n <= self.cut]
        self.together = torch.tensor(together, device=device)
        self.all_together = len(together) == len(rows)
        self.num_keys = padded(self.cut, pad)
        self.tables = cache.table_tensor([tables[i] for i in together], self.num_keys, device)
        keys = torch.arange(padded(max(lengths), pad), device=device)
        visible = torch.tensor([lengths[i] for i in together], device=device)
        self.mask = (keys[None, :self.num_keys] < visible[:, None])[:, None, None, :]  # (rows, 1, 1, keys)
        self.lone = []  # (index among rows, table tensor, mask) of each row going alone
        for i, n in enumerate(lengths):
            if n > self.cut:
                num_keys = padded(n, pad)
                self.lone.append((i, cache.table_tensor([tables[i]], num_keys, device),
                                  (keys[:num_keys] < n)[None, None, None, :]))

    def __call__(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q: (tokens, heads, dim) of the whole step. Returns (rows, heads, dim) in the order of the
        rows given at construction."""
        heads, dim = q.shape[1], q.shape[2]
        kvh = self.num_kv_heads
        # Query heads grouped by the KV head they share (GQA) instead of repeating keys.
        queries = q[self.rows].view(-1, kvh, heads // kvh, dim)
        if self.all_together:
            return self.batched(queries, layer).reshape(-1, heads, dim)
        out = torch.empty_like(queries)
        if len(self.together):
            out[self.together] = self.batched(queries[self.together], layer)
        for i, tables, mask in self.lone:  # 4-D, so that CPU takes the flash kernel (3-D takes the math one)
            keys_values = self.cache.gather(layer, tables, mask.shape[-1])
            out[i:i + 1] = F.scaled_dot_product_attention(queries[i:i + 1], keys_values[:, :kvh], keys_values[:, kvh:],
                                                          attn_mask=mask, scale=self.scaling)
        return out.reshape(-1, heads, dim)

    def batched(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        keys_values = self.cache.gather(layer, self.tables, self.num_keys)
        return F.scaled_dot_product_attention(queries, keys_values[:, :self.num_kv_heads],
                                              keys_values[:, self.num_kv_heads:], attn_mask=self.mask,
                                              scale=self.scaling)
