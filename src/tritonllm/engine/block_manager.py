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

Lanes: the pool's blocks are also cut into lanes of `lane_blocks` consecutive blocks (a
max_model_len each). A sequence admitted without a prefix hit takes the first blocks of a lane
none of whose blocks is held, and grows into the lane's next block while it is free: such a
sequence sits "at home", its keys in one run at a fixed stride from the other lanes', so decode
attention reads it in place, as fixed slots would (kv_cache.py); any other table is gathered.
Lanes only choose which free block is handed out: memory is still taken block by block.
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, lane_blocks: int = 0):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lane_blocks = lane_blocks
        self.num_lanes = (num_blocks - 1) // lane_blocks if lane_blocks else 0
        self.lane_held = [0] * self.num_lanes  # blocks of each lane held by sequences
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
        """A block table for `num_tokens` tokens whose first blocks are `cached` (shared); without
        them, the start of a free lane when there is one."""
        table = []
        for block_id in cached:
            if self.blocks[block_id].ref_count == 0:
                del self.free[block_id]
            self._hold(block_id)
            table.append(block_id)
        if not table:
            lane = self._free_lane()
            if lane is not None and self.blocks_for(num_tokens):
                table.append(self._take(1 + lane * self.lane_blocks))
        self.grow(table, num_tokens)
        return table

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a table to hold `num_tokens` (into its lane while it can); False (table unchanged)
        if the pool cannot."""
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > self.num_free:
            return False
        for _ in range(needed):
            home = table[-1] + 1 if table and self._lane(table[-1]) is not None else None
            if home is not None and self._lane(home) == self._lane(table[-1]) and home in self.free:
                table.append(self._take(home))
            else:
                table.append(self._take(next(iter(self.free))))  # least recently freed
        return True

    def release(self, table: list[int]) -> None:
        """Drop a sequence's references; its last blocks go first in the eviction order."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                lane = self._lane(block_id)
                if lane is not None:
                    self.lane_held[lane] -= 1
        table.clear()

    def _lane(self, block_id: int) -> int | None:
        lane = (block_id - 1) // self.lane_blocks if self.lane_blocks else None
        return lane if lane is not None and lane < self.num_lanes else None

    def _free_lane(self) -> int | None:
        """A lane none of whose blocks is held, preferring one that caches no prefix."""
        free = [lane for lane, held in enumerate(self.lane_held) if held == 0]
        for lane in free:
            first = 1 + lane * self.lane_blocks
            if all(self.blocks[b].hash is None for b in range(first, first + self.lane_blocks)):
                return lane
        return free[0] if free else None

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count += 1
        lane = self._lane(block_id)
        if block.ref_count == 1 and lane is not None:
            self.lane_held[lane] += 1

    def _take(self, block_id: int) -> int:
        """A free block, evicted from the prefix cache if it was there, now held once."""
        del self.free[block_id]
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        self._hold(block_id)
        return block_id
