"""The KV block pool and its prefix cache (engine/block_manager.py), pure Python."""

from __future__ import annotations

from tritonllm.engine.block_manager import NULL_BLOCK, BlockManager


def test_a_table_grows_a_block_at_a_time_and_release_frees_it():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_usable == bm.num_free == 4
    table = bm.allocate(5, [])  # 5 tokens: 2 blocks
    assert len(table) == 2 and NULL_BLOCK not in table and bm.num_free == 2
    assert bm.grow(table, 8) and len(table) == 2  # still fits
    assert bm.grow(table, 9) and len(table) == 3
    assert not bm.grow(table, 17) and len(table) == 3  # 5 blocks > 4 usable: unchanged
    bm.release(table)
    assert table == [] and bm.num_free == 4 and bm.usage == 0


def test_full_prompt_blocks_are_found_by_their_whole_prefix_and_shared():
    bm = BlockManager(num_blocks=9, block_size=4)
    prompt = list(range(10))  # blocks [0-3], [4-7], and 2 tokens
    a = bm.allocate(len(prompt), [])
    hashes = []
    bm.register(a, hashes, prompt, num_computed=6)  # only the first block is full and computed
    assert len(hashes) == 1 and bm.cached_prefix(prompt) == a[:1]
    bm.register(a, hashes, prompt, num_computed=10)
    assert len(hashes) == 2 and bm.cached_prefix(prompt) == a[:2]
    # another prompt with the same first 8 tokens shares both blocks; one that differs in the first block shares none
    other = prompt[:8] + [99, 98, 97]
    hit = bm.cached_prefix(other)
    assert hit == a[:2]
    b = bm.allocate(len(other), hit)
    assert b[:2] == a[:2] and bm.blocks[a[0]].ref_count == 2
    assert bm.cached_prefix([5] + prompt[1:]) == []
    # the last prompt token is never served from the cache: its logits must be computed
    assert bm.cached_prefix(prompt[:8]) == a[:1]
    assert bm.cached_prefix(prompt[:9]) == a[:2]


def test_released_cached_blocks_stay_findable_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=7, block_size=2)
    old, new = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]  # 3 blocks each, 2 of them full
    tables = {}
    for prompt in (old, new):
        table = bm.allocate(len(prompt), [])
        tables[prompt[0]] = list(table)
        bm.register(table, [], prompt, num_computed=len(prompt))
        bm.release(table)
    assert bm.num_free == 6 and bm.cached_prefix(old) == tables[1][:2] and bm.cached_prefix(new) == tables[6][:2]
    # idle blocks found in the cache leave the free list when taken
    assert bm.can_allocate(6 * 2, []) and not bm.can_allocate(6 * 2 + 1, bm.cached_prefix(new)[:1])
    # a cold sequence of 2 blocks takes the oldest prompt's blocks, its last ones first
    bm.allocate(4, [])
    assert bm.cached_prefix(old) == tables[1][:1] and bm.cached_prefix(new) == tables[6][:2]


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    import tritonllm.engine.block_manager as module
    monkeypatch.setattr(module, "chain_hash", lambda previous, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=4, block_size=2)
    table = bm.allocate(3, [])
    bm.register(table, [], [1, 2, 3], num_computed=3)
    assert bm.cached_prefix([1, 2, 3]) == table[:1]
    assert bm.cached_prefix([7, 8, 9]) == []  # same hash, other tokens


def test_prefix_caching_off_registers_and_finds_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    table = bm.allocate(3, [])
    bm.register(table, [], [1, 2, 3], num_computed=3)
    assert bm.cached_prefix([1, 2, 3]) == [] and not bm.cached
