"""KV memory in fixed-size blocks: a pool, a block table per sequence, automatic prefix caching.

Pure Python (no torch): it decides which block holds which tokens; the runner's cache
(kv_cache.py) holds the keys and values. A sequence takes blocks as it grows, so memory follows
the tokens it holds, not `max_model_len`.

Prefix caching (as vLLM and nano-vllm do it): a full block of prompt tokens, once computed, is
registered under a hash of its tokens chained with the previous block's hash, so the hash names
the whole prefix up to the block's end. A later prompt with the same prefix takes those blocks by
reference instead of computing them. Blocks whose last user left stay registered in the free
list, least recently freed first, and are evicted only when a block is needed. Tokens are
compared as well as hashes, so a hash collision cannot give a wrong answer.

Only prompt blocks are registered: they are computed by the prefill path (prefill_attention.py),
the same way whatever chunks their prompt came in, so a hit holds the very bits a cold prefill
would compute (tested). Generated tokens are computed by the decode path, with other bits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK = 0  # never handed out: pads block tables; padding rows of request-level batches write there


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = ()


def chain_hash(previous: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # hash -> id of the block holding that prefix
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of them, tokens found (vLLM's prefix_cache_hits)

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Blocks in use by sequences (0-1); registered free blocks count as free."""
        return 1 - self.num_free / self.num_usable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----

    def cached_prefix(self, prompt_ids: list[int]) -> list[int]:
        """Ids of the registered blocks that hold this prompt's first full blocks, in order. The
        prompt's last token is never among them: its logits have to be computed."""
        if not self.enable_prefix_caching:
            return []
        found, previous = [], None
        for i in range((len(prompt_ids) - 1) // self.block_size):
            tokens = tuple(prompt_ids[i * self.block_size:(i + 1) * self.block_size])
            previous = chain_hash(previous, tokens)
            block_id = self.cached.get(previous)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def register(self, block_table: list[int], block_hashes: list[int], prompt_ids: list[int],
                 num_computed: int) -> None:
        """Register the full prompt blocks computed so far that are not yet (`block_hashes` is the
        sequence's chain so far, extended here)."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(block_hashes), min(num_computed, len(prompt_ids)) // self.block_size):
            tokens = tuple(prompt_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(block_hashes[-1] if block_hashes else None, tokens)
            block_hashes.append(h)
            block = self.blocks[block_table[i]]
            if h not in self.cached and block.hash is None:  # a twin computed at the same time keeps its own
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.id

    # ---- allocation ----

    def can_allocate(self, num_tokens: int, cached: list[int]) -> bool:
        """Whether a sequence holding `num_tokens`, of which the `cached` blocks are shared, fits now."""
        idle_hits = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # they leave the free list
        return self.blocks_for(num_tokens) - len(cached) + idle_hits <= self.num_free

    def allocate(self, num_tokens: int, cached: list[int]) -> list[int]:
        """A block table for `num_tokens` tokens whose first blocks are `cached` (shared)."""
        table = []
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            table.append(block_id)
        self.grow(table, num_tokens)
        return table

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a table to hold `num_tokens`; False (table unchanged) if the pool cannot."""
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > self.num_free:
            return False
        for _ in range(needed):
            table.append(self._take_free())
        return True

    def release(self, table: list[int]) -> None:
        """Drop a sequence's references; its last blocks go first in the eviction order."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        table.clear()

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:  # evicted from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
