"""Attention of a step's one-token rows (decodes), at a cost that follows their true lengths.

One batched attention call over every slot's cache view, padded to the longest row, costs
slots x longest: one long request made every row pay for its length (7 rows at 32 tokens + 1 at
1,600 cost as much as 8 at 1,600). Here rows are split by length at a `cut`:

- rows up to `cut` keys: one batched call over the slots up to the highest used one, each row
  masked to its own length (views of the cache, no copy);
- each longer row: a call of its own over its slot's view (its row in the batched call sees one
  key and is overwritten).

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
in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def choose_cut(lengths: list[int], span: int, lone_calls: bool) -> int:
    """The longest row that attends in the batched call (span rows wide); longer rows go alone."""
    longest = max(lengths)
    if not lone_calls:
        return longest

    def cost(cut: int) -> float:
        return span * cut + sum(n * LONE_KEY_COST + LONE_CALL_COST for n in lengths if n > cut)

    return min(sorted(set(lengths)), key=cost)


class DecodeAttention:
    """Made once per step for its one-token rows; `__call__` runs one layer's attention for them."""

    def __init__(self, bounds: list[tuple[int, int, int, int]], num_kv_heads: int, scaling: float,
                 device: torch.device, pad: int):
        # bounds: (packed row, 1, slot, start) of each one-token chunk; its length is start + 1
        rows = [off for off, _, _, _ in bounds]
        slots = [slot for _, _, slot, _ in bounds]
        lengths = [start + 1 for _, _, _, start in bounds]
        self.rows = torch.tensor(rows, device=device)
        self.span = max(slots) + 1  # the batched call covers slots [0, span)
        # The step's token of each slot in the span (slots without one take the first: masked, dropped);
        # when slot i is token i for every i, views do instead of gathers.
        gather = [rows[0]] * self.span
        for row, slot in zip(rows, slots):
            gather[slot] = row
        self.in_order = rows == slots == list(range(self.span))
        self.gather = torch.tensor(gather, device=device)
        self.slots = torch.tensor(slots, device=device)
        self.num_kv_heads, self.scaling = num_kv_heads, scaling
        self.cut = choose_cut(lengths, self.span, lone_calls=device.type == "cpu")
        visible = [1] * self.span  # slots in the span without a row here, or going alone: one harmless key
        for slot, n in zip(slots, lengths):
            if n <= self.cut:
                visible[slot] = n
        visible_t = torch.tensor(visible, device=device)
        keys = torch.arange(padded(max(lengths), pad), device=device)
        self.mask = (keys[None, :padded(self.cut, pad)] < visible_t[:, None])[:, None, None, :]  # (span, 1, 1, keys)
        self.lone = [(slot, n) for slot, n in zip(slots, lengths) if n > self.cut]
        self.lone_masks = {n: (keys[:padded(n, pad)] < n)[None, None, None, :] for _, n in self.lone}

    def __call__(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: (tokens, heads, dim) of the whole step; kv: the layer's cache (2 kv_heads, slots, len, dim).
        Returns (rows, heads, dim) in the order of the rows given at construction."""
        heads, dim = q.shape[1], q.shape[2]
        kvh = self.num_kv_heads
        # Query heads grouped by the KV head they share (GQA) instead of repeating keys.
        queries = (q[:self.span] if self.in_order else q[self.gather]).view(self.span, kvh, heads // kvh, dim)
        keys_values = kv[:, :self.span, :self.mask.shape[-1]].transpose(0, 1)
        out = F.scaled_dot_product_attention(queries, keys_values[:, :kvh], keys_values[:, kvh:],
                                             attn_mask=self.mask, scale=self.scaling)
        for slot, n in self.lone:  # 4-D, so that CPU takes the flash kernel (3-D takes the math one)
            mask = self.lone_masks[n]
            lone_kv = kv[None, :, slot, :mask.shape[-1]]
            out[slot:slot + 1] = F.scaled_dot_product_attention(queries[slot:slot + 1], lone_kv[:, :kvh],
                                                                lone_kv[:, kvh:], attn_mask=mask, scale=self.scaling)
        out = out.reshape(self.span, heads, dim)
        return out if self.in_order else out[self.slots]
