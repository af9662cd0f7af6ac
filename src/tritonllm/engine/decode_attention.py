"""Attention of a step's one-token rows (decodes), at a cost that follows their true lengths.

On CPU in bfloat16 and float32 (the shipped cases) the rows go to paged_attention.py: a compiled
loop that reads each row's keys through its block table, in place, up to its own length. What
follows is the path for everything else (other devices, float16): calls of PyTorch's flash kernel.
It is EXPERIMENTAL: its rules below were found and are tested on CPU only (tests/test_decode_attention.py
forces it there); on a GPU it runs untested, and the engine says so once in its log.

Each row attends over its own sequence's keys (kv_cache.py), in calls of PyTorch's CPU flash
kernel, each row masked to its own length. One call over every row padded to the longest makes
every row pay for the longest; a call per length makes every step pay a call's fixed cost many
times. So each step groups its rows by length (`group_rows`: fewest calls x padded keys, by a
measured cost) and a row longer than the kernel's block of 512 keys goes alone.

Batch invariance: a row's result must not depend on the other rows. On PyTorch 2.13's CPU flash
kernel a row gets the same bits in every call of K keys, with any number of rows, at any place
among them, whatever its masked keys hold, when:
- K is below the kernel's block of 512 keys (past it the kernel's buffers cannot all be aligned;
  such a row always goes alone, so its work is split across threads the same way every time);
- each thread's buffer, (query heads per KV head) x (K + 2 + head_dim) floats, sits on 64 bytes
  (`aligned`): a buffer off a 64-byte boundary rounds differently;
- every one of the row's keys lies in the kernel's full vectors of 16 (the row's length <= 16 x
  (K // 16)): keys past the last full vector take a scalar exp, other bits;
- the gemm is past PyTorch's small-gemm fallback (K x query heads per KV head x head_dim > 16^3).
`min_keys` is the fewest keys of a call that meets these for a row; any longer aligned call below
512 gives the row the same bits (tested). Several rows of one sequence (its generated tokens
recomputed after preemption) are rows like any others, each over its own prefix. What the grouping
saves and where the rules were found: docs/benchmarks.md (§0d, §0g).

Rows at home in their lane (block_manager.py) are read in place: one call over the lanes from
the lowest to the highest a group uses, as fixed slots were (lanes without a row of the group
attend one harmless key, dropped). The other rows' keys are gathered into a buffer first
(kv_cache.KVGather). The work around the calls is done once per layer: the queries of every call
in one index, the results back in the rows' order in one, the masks made additive once per step
(what the kernel makes of a boolean mask on every call).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from tritonllm.engine.kv_cache import KVGather, PagedKVCache
from tritonllm.kernels.paged_attention import PagedDecode, available

log = logging.getLogger(__name__)
SMALL_GEMM = 16 ** 3  # PyTorch's CPU gemm takes its fallback at or below this many multiply-adds
FLASH_KV_BLOCK = 512  # PyTorch's CPU flash kernel computes keys in blocks of this many
VECTOR = 16  # floats in the kernel's vectors (AVX-512; a multiple of AVX2's 8)
GATHER_PIECE = 64  # keys are gathered in pieces of this many (a lone row's call spans whole pieces)
CALL_COST = 400  # a call's fixed cost, in keys x rows attended (~40 us against ~0.1 us; AMD EPYC, bf16)


def padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def aligned(keys: int, query_heads_per_kv_head: int, head_dim: int) -> int:
    """The fewest keys >= `keys` that put each thread's buffer of the flash kernel on 64 bytes."""
    while (query_heads_per_kv_head * (keys + 2 + head_dim)) % 16:
        keys += 1
    return keys


@functools.lru_cache(maxsize=4096)
def min_keys(length: int, query_heads_per_kv_head: int, head_dim: int) -> int | None:
    """The fewest keys of a call a row of `length` keys may share (see the module's notes); None if
    the row must go alone."""
    g = query_heads_per_kv_head
    keys = max(length, SMALL_GEMM // (g * head_dim) + 1)
    while aligned(keys, g, head_dim) != keys or length > VECTOR * (keys // VECTOR):
        keys += 1
    return keys if keys < FLASH_KV_BLOCK else None


def group_rows(needs: list[int]) -> list[tuple[int, list[int]]]:
    """Rows (by index) into calls: [(keys of the call, its rows)], each call as long as its longest
    need, at the least cost of CALL_COST per call plus rows x keys. Rows of one need stay together,
    and calls take needs in order (one pass over the distinct needs)."""
    by_need: dict[int, list[int]] = {}
    for i, need in enumerate(needs):
        by_need.setdefault(need, []).append(i)
    distinct = sorted(by_need)
    rows_upto = [0]  # rows_upto[j]: rows needing one of the first j distinct needs
    for need in distinct:
        rows_upto.append(rows_upto[-1] + len(by_need[need]))
    best = [0.0] + [float("inf")] * len(distinct)  # best[j]: the first j needs in calls
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j):
            cost = best[i] + CALL_COST + (rows_upto[j] - rows_upto[i]) * distinct[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    calls, j = [], len(distinct)
    while j:
        calls.append((distinct[j - 1], [r for need in distinct[cut[j]:j] for r in by_need[need]]))
        j = cut[j]
    return calls[::-1]


class DecodeAttention:
    """Made once per step for its one-token rows; `__call__` runs one layer's attention for them."""

    def __init__(self, rows: list[int], lengths: list[int], tables: list[list[int]], cache: PagedKVCache,
                 num_kv_heads: int, scaling: float, device: torch.device, group: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, paged: bool | None = None, use_native: bool | None = None):
        """rows: each row's index among the step's tokens; lengths: its keys (its own included);
        tables: its sequence's block table; group: query heads per KV head; dtype: the queries';
        paged: read the pool through the tables with paged_attention.py (None: where it runs);
        use_native: its native kernel (see PagedDecode)."""
        self.cache, self.num_kv_heads, self.scaling = cache, num_kv_heads, scaling
        self.rows = torch.tensor(rows, device=device)
        if paged is None:
            paged = available(dtype, device)
        self.paged = (PagedDecode(lengths, tables, num_kv_heads, group, head_dim, scaling, dtype, use_native)
                      if paged else None)
        if self.paged is not None:
            return
        warn_experimental(device, dtype)
        needs = [min_keys(n, group, head_dim) for n in lengths]
        self.lone_rows = [i for i, need in enumerate(needs) if need is None]
        shared = [i for i, need in enumerate(needs) if need is not None]
        plan = [(padded(lengths[i], GATHER_PIECE), [i]) for i in self.lone_rows]  # (keys of a call, its rows)
        plan += [(keys, [shared[k] for k in members]) for keys, members in group_rows([needs[i] for i in shared])]
        # Every call's rows are one slice of the queries, gathered in one index per layer; each row's result
        # is picked from the calls' outputs, concatenated, with one index.
        self.calls = []  # (where the keys come from, additive mask, first call row, rows)
        query_of: list[int] = []  # the row whose query each call row takes
        position = [0] * len(lengths)  # each row's call row
        for keys, members in plan:
            lanes = {}  # row -> its lane, for rows at home (one row per lane)
            for i in members:
                lane = cache.home_lane(tables[i], keys)
                if lane is not None and lane not in lanes.values():
                    lanes[i] = lane
            first = min(lanes.values(), default=0)
            span = max(lanes.values(), default=-1) + 1 - first
            if lanes and span <= 2 * len(lanes):  # else a few rows in far lanes: gathering them is cheaper
                queries, visible = [next(iter(lanes))] * span, [1] * span  # lanes without a row: any query
                for i, lane in lanes.items():
                    queries[lane - first], visible[lane - first] = i, lengths[i]
                    position[i] = len(query_of) + lane - first
                self.calls.append(((first, span), additive_mask(keys, visible, device, dtype), len(query_of), span))
                query_of += queries
                members = [i for i in members if i not in lanes]
            if members:
                gather = KVGather(cache, [tables[i] for i in members], keys, GATHER_PIECE)
                for k, i in enumerate(members):
                    position[i] = len(query_of) + k
                self.calls.append((gather, additive_mask(keys, [lengths[i] for i in members], device, dtype),
                                   len(query_of), len(members)))
                query_of += members
        self.query_tokens = torch.tensor([rows[i] for i in query_of], device=device)
        in_order = position == list(range(len(lengths))) and len(query_of) == len(lengths)
        self.result_index = None if in_order else torch.tensor(position, device=device)

    def __call__(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q: (tokens, heads, dim) of the whole step. Returns (rows, heads, dim) in the order of the
        rows given at construction."""
        if self.paged is not None:
            return self.paged(q[self.rows], self.cache.numpy_layer(layer)).to(q.dtype)
        heads, dim = q.shape[1], q.shape[2]
        kvh = self.num_kv_heads
        # Query heads grouped by the KV head they share (GQA) instead of repeating keys.
        queries = q[self.query_tokens].view(-1, kvh, heads // kvh, dim)
        results = []
        for source, keys_mask, first, n in self.calls:
            if isinstance(source, KVGather):
                keys_values = source(layer)
            else:  # lanes source[0] .. source[0] + source[1] - 1, in place
                keys_values = self.cache.lane_view(layer, *source, keys_mask.shape[-1])
            results.append(F.scaled_dot_product_attention(
                queries[first:first + n], keys_values[:, :kvh], keys_values[:, kvh:], attn_mask=keys_mask,
                scale=self.scaling))
        out = results[0] if len(results) == 1 else torch.cat(results)
        if self.result_index is not None:
            out = out[self.result_index]
        return out.reshape(-1, heads, dim)


@functools.lru_cache(maxsize=None)
def warn_experimental(device, dtype) -> None:
    """Once per device and dtype: this path is not the tested one there."""
    if torch.device(device).type != "cpu":
        log.warning("decode attention on %s in %s runs the experimental flash-kernel path (decode_attention.py), "
                    "tested on CPU only", device, dtype)


def additive_mask(keys: int, visible: list[int], device, dtype) -> torch.Tensor:
    """(calls, 1, 1, keys): 0 on each call row's first `visible` keys, -inf past them. The values
    `scaled_dot_product_attention` makes of a boolean mask itself, made once per step instead of
    once per call."""
    seen = torch.arange(keys, device=device)[None, :] < torch.tensor(visible, device=device)[:, None]
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))[:, None, None, :]
