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
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")


def test_one_long_row_goes_alone_and_similar_rows_stay_together():
    assert choose_cut([32] * 7 + [1600], span=8, lone_calls=True) == 32
    assert choose_cut([300] * 8, span=8, lone_calls=True) == 300
    assert choose_cut([100, 120, 140, 160], span=4, lone_calls=True) == 160  # too close to split
    assert choose_cut([32] * 7 + [1600], span=8, lone_calls=False) == 1600  # off CPU: one padded call


def test_keys_are_padded_past_the_small_gemm_fallback():
    assert key_pad(3, 64) == 32  # the bundled model: 32 keys x 3 heads x 64 > 16^3
    assert key_pad(1, 64) == 80  # 64 x 64 = 16^3 exactly is still the fallback
    assert key_pad(4, 128) == 16


def reference(q_row: torch.Tensor, kv: torch.Tensor, slot: int, length: int, kv_heads: int, scale: float):
    """Plain attention of one query row (heads, dim) over its slot's first `length` keys."""
    heads = q_row.shape[0]
    k = kv[:kv_heads, slot, :length].repeat_interleave(heads // kv_heads, 0)
    v = kv[kv_heads:, slot, :length].repeat_interleave(heads // kv_heads, 0)
    return F.scaled_dot_product_attention(q_row[:, None], k, v, scale=scale)[:, 0]


def check_rows(lengths_by_slot: dict[int, int], row_order: list[int], offset: int, dtype=torch.float32):
    """Rows packed after `offset` other tokens, in `row_order` of slots, against the reference."""
    torch.manual_seed(len(row_order))
    heads, kv_heads, dim, slots, max_len = 4, 2, 16, 8, 2048
    kv = torch.randn(2 * kv_heads, slots, max_len, dim).to(dtype)
    q = torch.randn(offset + len(row_order), heads, dim).to(dtype)
    bounds = [(offset + i, 1, slot, lengths_by_slot[slot] - 1) for i, slot in enumerate(row_order)]
    attention = DecodeAttention(bounds, kv_heads, 0.25, CPU, key_pad(heads // kv_heads, dim))
    out = attention(q, kv)
    assert out.shape == (len(row_order), heads, dim)
    for i, slot in enumerate(row_order):
        want = reference(q[offset + i], kv, slot, lengths_by_slot[slot], kv_heads, 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i], want, rtol=tol, atol=tol, msg=f"slot {slot}")
    return attention


def test_each_row_attends_over_its_own_keys_only():
    # one long row alone, rows out of slot order, idle slots (2, 5) in the span
    attention = check_rows({0: 32, 1: 7, 3: 1600, 4: 1, 6: 40}, row_order=[6, 0, 3, 1, 4], offset=0)
    assert attention.lone == [(3, 1600)] and attention.span == 7
    # in slot order, as decodes of a full batch come: views, no gathers
    attention = check_rows({s: 20 + 9 * s for s in range(8)}, row_order=list(range(8)), offset=0)
    assert attention.in_order and not attention.lone
    # behind a prefill chunk of 5 tokens, in bfloat16, two lone rows
    attention = check_rows({0: 1500, 1: 3, 2: 1800, 7: 12}, row_order=[0, 1, 2, 7], offset=5, dtype=torch.bfloat16)
    assert sorted(attention.lone) == [(0, 1500), (2, 1800)]


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
            lone_steps.append(choose_cut(lengths, max(c.slot for c in decoding) + 1, True) < max(lengths))
        return forward(chunks)

    engine.runner.forward = watch
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert any(lone_steps), "the long row never went alone: the test does not test the split"
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
        assert out.token_ids == ref.tolist()
