"""Properties of the token-level scheduler, checked over randomized workloads (pure Python).

Steps are simulated the way the engine drives the scheduler: every scheduled chunk advances
(`scheduler.advance`); a chunk that reaches the sequence's last known token "samples" a fake
token; a sequence finishes by length, by a random early stop, or by a random abort. Pools are
sometimes small (preemption) and prompts share prefixes (prefix-cache hits).
"""

from __future__ import annotations

import random

import pytest

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import Scheduler, SchedulerConfig
from tritonllm.engine.sequence import Sequence, Status


def make_seq(name: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(name, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def apply_step(sched: Scheduler, chunks, rng: random.Random | None = None, stop_prob: float = 0.0) -> list[Sequence]:
    """Advance like the engine does; return the sequences that finished in this step."""
    sampling = [c.seq for c in chunks if c.samples]  # evaluated before any mutation
    for c in chunks:
        sched.advance(c)
    done = []
    for seq in sampling:
        seq.output_ids.append(7)
        if len(seq.output_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
            done.append(seq)
        elif rng is not None and rng.random() < stop_prob:
            sched.finish(seq, "stop")
            done.append(seq)
    return done


def check_blocks(sched: Scheduler, cfg: SchedulerConfig) -> None:
    """Block accounting: every block's references are the tables holding it, the free list is
    exactly the unreferenced blocks, and each running sequence's table covers what it computed."""
    bm = sched.blocks
    holders = [*sched.running, *sched.padded]
    refs = {}
    for s in holders:
        assert len(set(s.block_table)) == len(s.block_table), f"{s.request_id} holds a block twice"
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks[1:]:
        assert block.ref_count == refs.get(block.id, 0), f"block {block.id}: {block.ref_count} refs, {refs.get(block.id, 0)} tables"
        assert (block.id in bm.free) == (block.ref_count == 0)
    assert 0 not in bm.free and 0 not in refs, "the null block was handed out"
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h
    assert len(sched.running) <= cfg.max_num_seqs
    for s in sched.running:
        assert s.status is Status.RUNNING
        assert len(s.block_table) >= bm.blocks_for(s.num_computed)
    for s in sched.waiting:
        assert s.status is Status.WAITING and not s.block_table


def run_random_workload(seed: int, steps: int = 300):
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 6)
    budget = rng.randint(num_seqs, num_seqs + 40)
    max_model_len, block_size = rng.randint(20, 120), rng.choice([4, 8, 16])
    # half the pools are small: sequences get preempted
    pool = rng.choice([0, -(-max_model_len // block_size) + rng.randint(0, 3)])
    cfg = SchedulerConfig(max_num_seqs=num_seqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                          block_size=block_size, num_kv_blocks=pool)
    sched = Scheduler(cfg)
    added: list[Sequence] = []
    admitted: list[Sequence] = []
    aborted_waiting: set[int] = set()
    counter = 0
    for step in range(steps):
        # Arrivals in bursts, more of them early on; none in the last third so everything can drain.
        if step < 2 * steps // 3:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4])):
                prompt_len = rng.randint(1, cfg.max_model_len - 1)
                max_tokens = rng.randint(1, cfg.max_model_len - prompt_len)
                seq = make_seq(f"r{counter}", prompt_len, max_tokens)
                shared = rng.randint(0, prompt_len)  # a prefix shared with other prompts, then its own tokens
                seq.prompt_ids[shared:] = [rng.randrange(1000, 2000) for _ in range(prompt_len - shared)]
                counter += 1
                sched.add(seq)
                added.append(seq)
        # Occasional aborts of running or waiting sequences.
        if rng.random() < 0.05 and (sched.running or sched.waiting):
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            if victim.status is Status.WAITING:
                aborted_waiting.add(id(victim))
            sched.finish(victim, "abort")
            assert victim.finished and victim.finish_reason == "abort" and not victim.block_table
            check_blocks(sched, cfg)

        was_running = {id(s) for s in sched.running}
        decoding_before = [s for s in sched.running if s.num_tokens - s.num_computed == 1]
        prefilling_before = [s for s in sched.running if s.num_tokens - s.num_computed > 1]
        chunks = sched.schedule()

        # Token budget.
        total = sum(c.num_tokens for c in chunks)
        assert total <= cfg.max_num_batched_tokens, f"step {step}: {total} tokens > budget {cfg.max_num_batched_tokens}"
        # Every chunk is real, at the sequence's cache frontier, and one per sequence.
        ids = [id(c.seq) for c in chunks]
        assert len(ids) == len(set(ids)), "a sequence got two chunks in one step"
        for c in chunks:
            assert c.num_tokens >= 1
            assert c.start == c.seq.num_computed
            assert c.start + c.num_tokens <= c.seq.num_tokens
            assert c.seq.status is Status.RUNNING
            assert len(c.seq.block_table) >= sched.blocks.blocks_for(c.start + c.num_tokens)
            if c.start < c.seq.num_prompt:  # a prefill chunk stays inside the prompt
                assert c.start + c.num_tokens <= c.seq.num_prompt
        # Every decoding sequence gets exactly one token every step, unless preempted for blocks.
        by_seq = {id(c.seq): c for c in chunks}
        for s in decoding_before:
            if s.status is Status.WAITING:
                assert s.num_computed == 0 and sched.num_preemptions > 0
                continue
            assert id(s) in by_seq, f"step {step}: running decode {s.request_id} got no token"
            assert by_seq[id(s)].num_tokens == 1
        # A running prefill always makes progress (there is always budget left for it).
        if any(s.status is Status.RUNNING for s in prefilling_before):
            assert any(id(s) in by_seq for s in prefilling_before), f"step {step}: prefill starved"
        # Newly admitted sequences (first admissions only), in admission order.
        admitted.extend(c.seq for c in chunks if id(c.seq) not in was_running and c.seq not in admitted)
        # Work conserving: nobody waits while a row, blocks and budget are free.
        if sched.waiting and len(sched.running) < cfg.max_num_seqs and total < cfg.max_num_batched_tokens:
            head = sched.waiting[0]
            assert not sched.blocks.can_allocate(head.num_tokens, sched.blocks.cached_prefix(head.prompt_ids)), (
                f"step {step}: a request waits although a row, its blocks and "
                f"{cfg.max_num_batched_tokens - total} tokens are free")
        check_blocks(sched, cfg)
        apply_step(sched, chunks, rng, stop_prob=0.05)
        check_blocks(sched, cfg)

    # Drain: no starvation, every request finishes within a bounded number of steps.
    bound = sum(s.max_total_tokens for s in added) * (2 if pool else 1) + 10
    extra = 0
    while sched.has_work():
        was_running = {id(s) for s in sched.running}
        chunks = sched.schedule()
        assert chunks, "work left but nothing scheduled"
        admitted.extend(c.seq for c in chunks if id(c.seq) not in was_running and c.seq not in admitted)
        assert sum(c.num_tokens for c in chunks) <= cfg.max_num_batched_tokens
        apply_step(sched, chunks)
        check_blocks(sched, cfg)
        extra += 1
        assert extra <= bound, "requests starve"
    return added, admitted, aborted_waiting


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads(seed):
    added, admitted, aborted_waiting = run_random_workload(seed)
    assert added, "the workload added no request"
    # FCFS: the admission order is the arrival order (minus those aborted before admission).
    expected = [s for s in added if id(s) not in aborted_waiting]
    assert [s.request_id for s in admitted] == [s.request_id for s in expected]
    # No starvation: every request finished, with a reason, holding no block.
    for s in added:
        assert s.finished, s.request_id
        assert s.finish_reason in ("length", "stop", "abort")
        assert not s.block_table
        if s.finish_reason == "length":
            assert len(s.output_ids) == s.params.max_tokens
            assert s.num_computed == s.num_tokens - 1  # the last sampled token is never fed back


def test_fcfs_admission_order_with_one_slot():
    cfg = SchedulerConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    rng = random.Random(3)
    seqs = [make_seq(f"r{i}", rng.randint(1, 20), rng.randint(1, 5)) for i in range(10)]
    for s in seqs:
        sched.add(s)
    order = []
    while sched.has_work():
        chunks = sched.schedule()
        assert len({c.seq.request_id for c in chunks}) == 1
        for c in chunks:
            if not order or order[-1] is not c.seq:
                order.append(c.seq)
        apply_step(sched, chunks)
    assert [s.request_id for s in order] == [s.request_id for s in seqs]


def test_too_long_request_is_rejected_naming_max_model_len():
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq("long", 30, 3))  # 33 > 32
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq("long-prompt", 40, 1))
    with pytest.raises(ValueError):
        sched.add(make_seq("empty", 0, 1))
    assert not sched.has_work()
    sched.add(make_seq("exact", 29, 3))  # exactly max_model_len fits
    assert sched.num_waiting == 1


def test_chunked_prefill_keeps_decodes_going():
    cfg = SchedulerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    short = [make_seq(f"s{i}", 2, 100) for i in range(2)]
    for s in short:
        sched.add(s)
    apply_step(sched, sched.schedule())  # both prefill (2 + 2 tokens) and sample
    assert all(len(s.output_ids) == 1 for s in short)

    long = make_seq("long", 50, 5)
    sched.add(long)
    long_chunks = []
    steps = 0
    while long.in_prefill or not long.output_ids:
        chunks = sched.schedule()
        by_seq = {c.seq.request_id: c for c in chunks}
        for s in short:  # decodes get a token every step while the long prompt prefills
            assert by_seq[s.request_id].num_tokens == 1
            assert by_seq[s.request_id].samples
        assert sum(c.num_tokens for c in chunks) <= 8
        lc = by_seq["long"]
        long_chunks.append((lc.start, lc.num_tokens, lc.samples))
        before = [len(s.output_ids) for s in short]
        apply_step(sched, chunks)
        assert [len(s.output_ids) for s in short] == [b + 1 for b in before]
        steps += 1
        assert steps < 100
    # The prompt was split into several contiguous chunks covering it exactly; only the last samples.
    assert len(long_chunks) > 1
    pos = 0
    for start, n, samples in long_chunks:
        assert start == pos and n <= 8 - len(short)
        pos += n
    assert pos == 50
    assert [s for _, _, s in long_chunks] == [False] * (len(long_chunks) - 1) + [True]
    assert len(long.output_ids) == 1


def test_long_prompt_is_chunked_by_budget_alone():
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=100, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    seq = make_seq("a", 40, 1)
    sched.add(seq)
    sizes = []
    while seq.in_prefill:
        chunks = sched.schedule()
        sizes.append(sum(c.num_tokens for c in chunks))
        apply_step(sched, chunks)
    assert sizes == [16, 16, 8]
    assert seq.finished and seq.finish_reason == "length"


def test_aborted_slot_is_reused_next_schedule():
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    a, b, c = (make_seq(n, 3, 20) for n in "abc")
    for s in (a, b, c):
        sched.add(s)
    apply_step(sched, sched.schedule())
    assert [s.status for s in (a, b, c)] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    sched.finish(b, "abort")
    assert b.finished and b.finish_reason == "abort" and not b.block_table
    chunks = sched.schedule()
    assert c.status is Status.RUNNING
    assert any(ch.seq is c for ch in chunks), "the waiting request was not scheduled in the freed row"
    assert all(ch.seq is not b for ch in chunks)
    # Finishing twice is harmless and does not free its blocks twice.
    free = sched.blocks.num_free
    sched.finish(b, "abort")
    assert sched.blocks.num_free == free
    check_blocks(sched, cfg)


def test_abort_waiting_request():
    cfg = SchedulerConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    a, b, c = (make_seq(n, 3, 2) for n in "abc")
    for s in (a, b, c):
        sched.add(s)
    sched.schedule()
    sched.finish(b, "abort")
    assert b.finished and sched.num_waiting == 1
    sched.finish(a, "abort")
    chunks = sched.schedule()
    assert [ch.seq.request_id for ch in chunks] == ["c"]


def test_find():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16))
    a, b = make_seq("a", 3, 2), make_seq("b", 3, 2)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.find("a") is a and sched.find("b") is b and sched.find("zzz") is None
    sched.finish(a, "abort")
    assert sched.find("a") is None


@pytest.mark.parametrize("kwargs", [
    dict(max_num_seqs=8, max_num_batched_tokens=7),
    dict(max_num_seqs=0),
    dict(max_model_len=0),
    dict(max_num_batched_tokens=0),
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_config_budget_error_names_both_settings():
    with pytest.raises(ValueError, match="max_num_batched_tokens") as info:
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7)
    assert "max_num_seqs" in str(info.value)
    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8)  # equal is fine


def test_request_policy_runs_a_batch_to_its_end_with_finished_rows_as_padding():
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, batch_policy="request")
    sched = Scheduler(cfg)
    short, long, late = make_seq("short", 3, 1), make_seq("long", 3, 4), make_seq("late", 3, 2)
    for seq in (short, long):
        sched.add(seq)
    chunks = sched.schedule()
    assert {c.seq.request_id for c in chunks} == {"short", "long"}
    for c in chunks:
        sched.advance(c)
        c.seq.output_ids.append(7)
    sched.finish(short, "length")
    sched.add(late)
    while long.status is Status.RUNNING:
        chunks = sched.schedule()
        names = {c.seq.request_id: c for c in chunks}
        assert "late" not in names, "nothing joins a request-level batch before it ends"
        assert names["short"].padding and not names["short"].samples
        assert short.block_table and short in sched.padded  # the finished row keeps its blocks
        sched.advance(names["long"])
        long.output_ids.append(7)
        if len(long.output_ids) == long.params.max_tokens:
            sched.finish(long, "length")
    chunks = sched.schedule()
    assert [c.seq.request_id for c in chunks] == ["late"] and not chunks[0].padding
    assert not short.block_table and not long.block_table


def test_request_policy_frees_an_aborted_row_at_once():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
                                      batch_policy="request"))
    a, b = make_seq("a", 3, 5), make_seq("b", 3, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, "abort")
    assert not a.block_table and not sched.padded


def test_unknown_batch_policy_is_named():
    with pytest.raises(ValueError, match="batch_policy"):
        SchedulerConfig(batch_policy="static")


def test_config_from_model_parameters():
    cfg = SchedulerConfig.from_parameters({"max_num_seqs": "32", "block_size": "128", "num_kv_blocks": "500",
                                           "kv_cache_memory_gb": "1.5", "enable_prefix_caching": "false",
                                           "batch_invariant": "false", "max_queue_size": "7"})  # the last: not an engine knob
    assert (cfg.max_num_seqs, cfg.block_size, cfg.num_kv_blocks, cfg.kv_cache_memory_gb) == (32, 128, 500, 1.5)
    assert cfg.enable_prefix_caching is False and cfg.max_model_len == SchedulerConfig().max_model_len
    assert cfg.batch_invariant is False and SchedulerConfig().batch_invariant is True
    assert cfg.pool_blocks == 501  # the null block too
    assert SchedulerConfig.from_parameters({"max_num_seqs": "32"}, max_num_seqs=4).max_num_seqs == 4
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        SchedulerConfig.from_parameters({"enable_prefix_caching": "maybe"})
    with pytest.raises(ValueError):
        SchedulerConfig.from_parameters({"num_kv_blocks": "-1"})


def test_a_pool_too_small_for_a_request_refuses_it_naming_the_kv_cache():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                                      block_size=4, num_kv_blocks=5))  # 20 tokens
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(make_seq("big", 15, 6))
    sched.add(make_seq("fits", 15, 5))


def test_the_newest_sequence_is_preempted_when_a_decode_needs_a_block():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=64, max_num_batched_tokens=32,
                                      block_size=4, num_kv_blocks=6, enable_prefix_caching=False))
    old, new = make_seq("old", 8, 10), make_seq("new", 8, 10)  # 2 blocks each at admission
    for s in (old, new):
        sched.add(s)
    apply_step(sched, sched.schedule())  # both prefill and sample: 9 tokens, the 9th needs a 3rd block
    apply_step(sched, sched.schedule())  # both get their 3rd block: 6 of 6 used
    assert sched.blocks.num_free == 0
    for _ in range(3):
        apply_step(sched, sched.schedule())
    chunks = sched.schedule()  # old needs a 4th block: new (the newest) gives up its blocks
    assert [c.seq.request_id for c in chunks] == ["old"] and sched.num_preemptions == 1
    assert new.status is Status.WAITING and sched.waiting[0] is new and new.num_computed == 0
    assert len(new.output_ids) == 5  # what it generated stays; it is recomputed, not restarted
    check_blocks(sched, sched.config)
