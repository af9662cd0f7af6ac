"""Decode attention at the cost of true lengths (engine/decode_attention.py).

Rows of similar length share one batched call; a row much longer than the rest gets a call of
its own, so that it does not make every row pay for its length. Either way each row's result is
attention over its own keys only, and the engine's greedy answers still equal `model.generate`.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from tritonllm.engine.decode_attention import DecodeAttention, choose_cut, key_pad
from tritonllm.engine.kv_cache import PagedKVCache
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")


def test_one_long_row_goes_alone_and_similar_rows_stay_together():
    assert choose_cut([32] * 7 + [1600], lone_calls=True) == 32
    assert choose_cut([300] * 8, lone_calls=True) == 300
    assert choose_cut([100, 120, 140, 160], lone_calls=True) == 160  # too close to split
    assert choose_cut([32] * 7 + [1600], lone_calls=False) == 1600  # off CPU: one padded call


def test_keys_are_padded_past_the_small_gemm_fallback():
    assert key_pad(3, 64) == 32  # the bundled model: 32 keys x 3 heads x 64 > 16^3
    assert key_pad(1, 64) == 80  # 64 x 64 = 16^3 exactly is still the fallback
    assert key_pad(4, 128) == 16


def reference(q_row: torch.Tensor, keys_values: torch.Tensor, kv_heads: int, scale: float):
    """Plain attention of one query row (heads, dim) over a sequence's keys (2 kv_heads, length, dim)."""
    heads = q_row.shape[0]
    k = keys_values[:kv_heads].repeat_interleave(heads // kv_heads, 0)
    v = keys_values[kv_heads:].repeat_interleave(heads // kv_heads, 0)
    return F.scaled_dot_product_attention(q_row[:, None], k, v, scale=scale)[:, 0]


def check_rows(lengths: list[int], offset: int, dtype=torch.float32, same_sequence: bool = False):
    """Rows packed after `offset` other tokens, each over its own blocks (shuffled across the pool),
    against plain attention over the same keys in order."""
    torch.manual_seed(len(lengths))
    heads, kv_heads, dim, block = 4, 2, 16, 64
    blocks_per_row = [-(-n // block) for n in lengths]
    cache = PagedKVCache(1, 1 + sum(blocks_per_row), block, kv_heads, dim, dtype, CPU)
    cache.layers[0].copy_(torch.randn_like(cache.layers[0]))
    ids = torch.randperm(sum(blocks_per_row)).add(1).tolist()
    if same_sequence:  # one sequence's rows: one table, each row over its own prefix
        tables = [ids[:n] for n in blocks_per_row]
    else:
        starts = [sum(blocks_per_row[:i]) for i in range(len(lengths))]
        tables = [ids[at:at + n] for at, n in zip(starts, blocks_per_row)]
    q = torch.randn(offset + len(lengths), heads, dim).to(dtype)
    rows = list(range(offset, offset + len(lengths)))
    attention = DecodeAttention(rows, lengths, tables, cache, kv_heads, 0.25, CPU, key_pad(heads // kv_heads, dim))
    out = attention(q, 0)
    assert out.shape == (len(lengths), heads, dim)
    for i, (n, table) in enumerate(zip(lengths, tables)):
        keys_values = cache.layers[0][:, table].reshape(2 * kv_heads, -1, dim)[:, :n]
        want = reference(q[offset + i], keys_values, kv_heads, 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i], want, rtol=tol, atol=tol, msg=f"row {i}")
    return attention


def test_each_row_attends_over_its_own_keys_only():
    attention = check_rows([32, 7, 1600, 1, 40], offset=0)  # one long row alone
    assert [i for i, _, _ in attention.lone] == [2]
    attention = check_rows([20 + 9 * s for s in range(8)], offset=0)  # similar rows together
    assert attention.all_together
    # behind a prefill chunk of 5 tokens, in bfloat16, two lone rows
    attention = check_rows([1500, 3, 1800, 12], offset=5, dtype=torch.bfloat16)
    assert [i for i, _, _ in attention.lone] == [0, 2]
    # rows of one sequence at successive positions (recomputed after preemption), each over its own prefix
    check_rows([700, 701, 702, 703], offset=2, same_sequence=True)


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
            lone_steps.append(choose_cut(lengths, True) < max(lengths))
        return forward(chunks)

    engine.runner.forward = watch
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert any(lone_steps), "the long row never went alone: the test does not test the split"
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
        assert out.token_ids == ref.tolist()
