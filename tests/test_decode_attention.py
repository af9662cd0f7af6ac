"""Decode attention at the cost of true lengths (engine/decode_attention.py).

Rows of similar length share one batched call; a row much longer than the rest gets a call of
its own, so that it does not make every row pay for its length. Either way each row's result is
attention over its own keys only, and the engine's greedy answers still equal `model.generate`.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tritonllm.engine.decode_attention import DecodeAttention, group_rows, min_keys
from tritonllm.engine.kv_cache import PagedKVCache
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.kernels import native
from tritonllm.kernels.paged_attention import available
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")
NATIVE = native.kernel() is not None  # CPU-dependent (AVX512-BF16), and built by ./setup.sh
KERNELS = ["native", "numba"] if NATIVE else ["numba"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Each test on the native kernel (a bf16 pool, where it runs) and on the Numba kernel."""
    monkeypatch.setenv(native.SWITCH_ENV, "1" if request.param == "native" else "0")
    return request.param


def test_a_row_needs_the_fewest_keys_that_give_it_the_same_bits_in_any_call():
    # the bundled model: 3 query heads per KV head, dim 64: aligned counts are ≡ 14 mod 16, and a row's
    # keys must all lie in full vectors of 16
    assert [min_keys(n, 3, 64) for n in (1, 16, 17, 30, 350, 478, 496)] == [30, 30, 46, 46, 366, 494, 510]
    assert min_keys(497, 3, 64) is None and min_keys(1600, 3, 64) is None  # alone
    for g, dim in ((3, 64), (1, 64), (4, 128), (8, 128), (2, 16)):
        for n in range(1, 600):
            keys = min_keys(n, g, dim)
            if keys is not None:  # each thread's buffer on 64 bytes, past the small-gemm fallback, in full vectors
                assert (g * (keys + 2 + dim)) % 16 == 0 and keys * g * dim > 16 ** 3 and keys < 512
                assert n <= 16 * (keys // 16) and keys - max(n, 16 ** 3 // (g * dim) + 1) < 64


def test_rows_share_a_call_unless_a_call_of_their_own_costs_less():
    assert group_rows([30] * 8) == [(30, list(range(8)))]
    assert group_rows([46, 30, 62]) == [(62, [1, 0, 2])]  # a little padding costs less than a call
    needs = [30] * 8 + [494]
    assert group_rows(needs) == [(30, list(range(8))), (494, [8])]  # a long row does not make all pay
    calls = group_rows([30, 494, 110, 46, 478, 494, 30])
    assert sorted(i for _, rows in calls for i in rows) == list(range(7))
    assert all(keys == max([30, 494, 110, 46, 478, 494, 30][i] for i in rows) for keys, rows in calls)


def reference(q_row: torch.Tensor, keys_values: torch.Tensor, kv_heads: int, scale: float):
    """Plain attention of one query row (heads, dim) over a sequence's keys (2 kv_heads, length, dim)."""
    heads = q_row.shape[0]
    k = keys_values[:kv_heads].repeat_interleave(heads // kv_heads, 0)
    v = keys_values[kv_heads:].repeat_interleave(heads // kv_heads, 0)
    return F.scaled_dot_product_attention(q_row[:, None], k, v, scale=scale)[:, 0]


def check_rows(lengths: list[int], offset: int, dtype=torch.float32, same_sequence: bool = False,
               home: list[int] = (), paged: bool = False, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    """Rows packed after `offset` other tokens, each over its own blocks (shuffled across the pool,
    or at home in the lane given by `home` for the first rows), against plain attention over the
    same keys in order."""
    torch.manual_seed(len(lengths))
    block, lane = 64, 32
    blocks_per_row = [-(-n // block) for n in lengths]
    lanes = 8 if home else 0
    cache = PagedKVCache(1, 1 + lanes * lane + sum(blocks_per_row), block, kv_heads, dim, dtype, CPU,
                         lane_blocks=lane if home else 0)
    cache.layers[0].copy_(torch.randn_like(cache.layers[0]))
    ids = torch.randperm(sum(blocks_per_row)).add(1 + lanes * lane).tolist()
    if same_sequence:  # one sequence's rows: one table, each row over its own prefix
        tables = [ids[:n] for n in blocks_per_row]
    else:
        starts = [sum(blocks_per_row[:i]) for i in range(len(lengths))]
        tables = [ids[at:at + n] for at, n in zip(starts, blocks_per_row)]
    for i, h in enumerate(home):
        tables[i] = list(range(1 + h * lane, 1 + h * lane + blocks_per_row[i]))
    q = torch.randn(offset + len(lengths), heads, dim).to(dtype)
    rows = list(range(offset, offset + len(lengths)))
    attention = DecodeAttention(rows, lengths, tables, cache, kv_heads, 0.25, CPU, heads // kv_heads, dim,
                                dtype, paged=paged)
    out = attention(q, 0)
    if paged:  # the kernel that ran: native for a bf16 pool of a shape it has, where it runs
        assert (attention.paged.native is not None) == (native.kernel() is not None and dtype == torch.bfloat16
                                                        and native.kernel().paged_decode_supports(heads // kv_heads, dim))
    assert out.dtype == dtype
    assert out.shape == (len(lengths), heads, dim)
    for i, (n, table) in enumerate(zip(lengths, tables)):
        keys_values = cache.layers[0][:, table].reshape(2 * kv_heads, -1, dim)[:, :n]
        want = reference(q[offset + i], keys_values, kv_heads, 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i], want, rtol=tol, atol=tol, msg=f"row {i}")
    return attention


def test_each_row_attends_over_its_own_keys_only_in_flash_calls():
    """The flash kernel's path (other devices, float16)."""
    attention = check_rows([32, 7, 1600, 1, 40], offset=0)  # one long row alone
    assert attention.lone_rows == [2]
    # rows of 20 to 230 keys: 5 need this shape's fewest keys (134), 3 up to 246; two calls cost less
    # than padding all to 246
    attention = check_rows([20 + 30 * s for s in range(8)], offset=0)
    assert not attention.lone_rows and [n for *_, n in attention.calls] == [5, 3]
    # behind a prefill chunk of 5 tokens, in bfloat16, two lone rows
    attention = check_rows([1500, 3, 1800, 12], offset=5, dtype=torch.bfloat16)
    assert attention.lone_rows == [0, 2]
    # rows of one sequence at successive positions (recomputed after preemption), each over its own prefix
    check_rows([700, 701, 702, 703], offset=2, same_sequence=True)
    # rows at home in lanes (read in place, lanes 1 and 6 idle) beside gathered rows and a lone long one
    attention = check_rows([50, 90, 150, 160, 70, 1700, 64], offset=3, home=[2, 0, 4, 3, 1, 7])
    # the 1,700-key row alone, in place in lane 7; the others in one call: lanes 0-4 in place, the 64-key
    # row gathered
    assert [(source if isinstance(source, tuple) else "gather", n) for source, _, _, n in attention.calls] == [
        ((7, 1), 1), ((0, 5), 5), ("gather", 1)]
    check_rows([50, 90, 33], offset=0, dtype=torch.bfloat16, home=[1, 0])
    # rows in far lanes (6 and 1 in one call: span 6 > 2 x 2 rows) are gathered
    attention = check_rows([40, 45], offset=1, home=[6, 1])
    assert [source if isinstance(source, tuple) else "gather" for source, *_ in attention.calls] == ["gather"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_attends_over_its_own_keys_only_through_its_block_table(dtype, kernel):
    """The paged kernel (CPU, bf16 and float32): rows of any length, in any blocks, at home or not."""
    assert available(dtype, CPU)
    check_rows([32, 7, 1600, 1, 40], offset=0, dtype=dtype, paged=True)
    check_rows([1500, 3, 1800, 12], offset=5, dtype=dtype, paged=True)
    check_rows([700, 701, 702, 703], offset=2, dtype=dtype, same_sequence=True, paged=True)
    check_rows([50, 90, 150, 160, 70, 1700, 64], offset=3, dtype=dtype, home=[2, 0, 4, 3, 1, 7], paged=True)
    # the bundled model's heads: 9 query heads on 3 KV heads of 64
    check_rows([130, 64, 65, 900], offset=1, dtype=dtype, paged=True, heads=9, kv_heads=3, dim=64)
    # the native kernel's other shapes: 1 to 8 query heads a KV head, dim 128, lengths about 16 keys
    for group in (1, 2, 5, 8):
        check_rows([15, 16, 17, 33, 1], offset=0, dtype=dtype, paged=True, heads=2 * group, kv_heads=2, dim=128)


@pytest.mark.skipif(not NATIVE, reason=f"native kernels {native.describe()}")
def test_the_native_kernel_refuses_what_it_cannot_read():
    from tritonllm.kernels.numba_helpers import as_numpy

    pool = as_numpy(torch.zeros(2, 4, 16, 64, dtype=torch.bfloat16))
    q, out = torch.zeros(1, 1, 3, 64).numpy(), torch.zeros(1, 192).numpy()
    rows, order = torch.zeros(1, dtype=torch.int64).numpy(), torch.zeros(1, dtype=torch.int64).numpy()

    def call(tables, lengths, q=q, out=out, pool=pool):
        native.kernel().paged_decode(q, pool, torch.tensor(tables).numpy(), torch.tensor(lengths).numpy(), order,
                                     0.125, out, rows)

    call([[3, 0]], [20])  # fine
    with pytest.raises(RuntimeError, match="row 0 has 40 keys, its table holds 32"):
        call([[3, 0]], [40])
    with pytest.raises(RuntimeError, match="block 9 of row 0 is not in the pool"):
        call([[9, 0]], [5])
    with pytest.raises(RuntimeError, match="no kernel for 3 query heads a KV head of dim 32"):
        call([[3, 0]], [5], q=torch.zeros(1, 1, 3, 32).numpy(), out=torch.zeros(1, 96).numpy(),
             pool=as_numpy(torch.zeros(2, 4, 16, 32, dtype=torch.bfloat16)))
    with pytest.raises(RuntimeError, match="the pool's shape does not fit q"):
        call([[3, 0]], [5], q=torch.zeros(1, 2, 3, 64).numpy())
    with pytest.raises(RuntimeError, match="out must be"):
        call([[3, 0]], [5], out=torch.zeros(1, 100).numpy())
    assert not native.kernel().paged_decode_supports(3, 32) and native.kernel().paged_decode_supports(3, 64)


@pytest.mark.parametrize("length", [450, 2300])  # 2300: the native kernel splits it into parts
def test_a_paged_rows_bits_do_not_depend_on_the_other_rows(kernel, length):
    """bf16, the bundled model's heads: a row alone == the same row beside 1..20 others of any
    length, at any place among them (bit for bit)."""
    rng = random.Random(5)
    kv_heads, group, dim, block = 3, 3, 64, 64
    cache = PagedKVCache(1, 400, block, kv_heads, dim, torch.bfloat16, CPU)
    cache.layers[0].copy_(torch.randn_like(cache.layers[0]))
    mine = (rng.sample(range(1, 400), -(-length // block)), length)  # its table, its length
    q_mine = torch.randn(1, kv_heads * group, dim).bfloat16()

    def attend(others):
        at = rng.randint(0, len(others))
        rows = others[:at] + [mine] + others[at:]
        q = torch.randn(len(rows), kv_heads * group, dim).bfloat16()
        q[at] = q_mine[0]
        attention = DecodeAttention(list(range(len(rows))), [n for _, n in rows], [t for t, _ in rows], cache,
                                    kv_heads, dim ** -0.5, CPU, group, dim, torch.bfloat16, paged=True)
        return attention(q, 0)[at]

    alone = attend([])
    for _ in range(12):
        others = []
        for _ in range(rng.randint(1, 20)):
            n = rng.randint(1, 1500)
            others.append((rng.sample(range(1, 400), -(-n // block)), n))
        assert torch.equal(attend(others), alone)


def test_engine_with_one_long_sequence_among_short_ones_matches_generate(tiny_model):
    """A long prompt decodes in its own attention call beside short ones; greedy == generate."""
    model, tokenizer = tiny_model
    rng = random.Random(3)
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=4, max_model_len=1024,
                                                         max_num_batched_tokens=512))
    long_prompt = [rng.randrange(3, len(tokenizer)) for _ in range(900)]
    prompts = [long_prompt, tokenizer.encode("Hello"), tokenizer.encode("The capital of France is"),
               [rng.randrange(3, len(tokenizer)) for _ in range(20)]]
    lone_steps = []
    forward = engine.runner.forward

    def watch(chunks):
        decoding = [c for c in chunks if len(c.token_ids) == 1]
        if len(decoding) > 1:
            lengths = [c.start + 1 for c in decoding]
            lone_steps.append(min_keys(max(lengths), 2, 16) is None and min(lengths) < 400)
        return forward(chunks)

    engine.runner.forward = watch
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert any(lone_steps), "the long row never went alone: the test does not test the split"
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
        assert out.token_ids == ref.tolist()


@pytest.mark.skipif(not available(torch.float32, CPU), reason="numba is a dependency; without it no paged kernel")
def test_the_paged_kernel_prefetches_each_rows_own_keys_then_values():
    # the prefetch hints follow a row's keys through its block table, then its values, then stop:
    # a wrong address costs only speed, so it is checked here
    from tritonllm.kernels.paged_attention import _stream_index

    kv_heads, blocks, block_size, dim = 2, 7, 4, 8
    pool = torch.arange(2 * kv_heads * blocks * block_size * dim).view(2 * kv_heads, blocks, block_size, dim)
    tables = torch.tensor([[5, 2, 6], [3, 1, 0]]).numpy()
    head_elems = blocks * block_size * dim
    flat = pool.reshape(-1)
    for row, n in ((0, 10), (1, 5)):
        for h in range(kv_heads):
            stream = [_stream_index(tables, row, pos, n, h, kv_heads, head_elems, block_size, dim) for pos in range(2 * n + 3)]
            expected = [pool[kind * kv_heads + h, tables[row, k // block_size], k % block_size, 0].item()
                        for kind in (0, 1) for k in range(n)]
            assert [flat[i].item() for i in stream[:2 * n]] == expected
            assert stream[2 * n:] == [-1, -1, -1]
