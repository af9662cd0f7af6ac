"""Prefix caching and preemption change when an answer comes, never what it says (bfloat16).

- A prompt whose first blocks are found in the prefix cache gets, at every step, the very logits
  it gets computed cold (engine with caching off).
- A sequence preempted for KV blocks and computed again gets the logits it gets in a pool that
  never runs out.
Logits are recorded at the sampler, per request, bit for bit.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.engine.model_loader import load_model


class RecordingSampler:
    """The engine's sampler, keeping every logits row it samples from, by prompt."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.logits = defaultdict(list)

    def __call__(self, logits, seqs):
        for row, seq in zip(logits, seqs):
            self.logits[tuple(seq.prompt_ids)].append(row.clone())
        return self.sampler(logits, seqs)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def run(model, tokenizer, batches: list[list[list[int]]], params: SamplingParams, **config) -> tuple[LLMEngine, dict]:
    engine = LLMEngine(model, tokenizer, SchedulerConfig(**{"max_num_seqs": 4, "max_model_len": 1024,
                                                            "max_num_batched_tokens": 256, **config}))
    engine.sampler = recorder = RecordingSampler(engine.sampler)
    for prompts in batches:
        engine.generate(prompts, params)
    return engine, recorder.logits


def assert_same_logits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for prompt, rows in want.items():
        assert len(got[prompt]) == len(rows)
        for step, (a, b) in enumerate(zip(got[prompt], rows)):
            assert torch.equal(a, b), f"prompt of {len(prompt)} tokens, step {step}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("model_name", ["tiny", "bundled"])
def test_a_prefix_cache_hit_gives_the_logits_of_a_cold_prefill(model_name):
    model, tokenizer = load_model(model_name, "cpu", torch.bfloat16)
    rng = random.Random(5)
    vocab = model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(300)]  # 4 full blocks of 64, then 44 tokens
    prompts = [system + [rng.randrange(vocab) for _ in range(rng.randint(1, 90))] for _ in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batches = [prompts[:1], prompts[1:]]  # the first registers the system prompt; three hit it at once
    cached, with_cache = run(model, tokenizer, batches, params)
    cold, without = run(model, tokenizer, batches, params, enable_prefix_caching=False)
    assert cached.stats.prefix_cache_hits == 3 * 256 and cold.stats.prefix_cache_hits == 0
    assert cached.stats.prompt_tokens == cold.stats.prompt_tokens - 3 * 256  # the hits were not computed
    assert_same_logits(with_cache, without)


@pytest.mark.parametrize("model_name", ["tiny", "bundled"])
def test_a_preempted_sequence_gets_the_logits_it_gets_unpreempted(model_name):
    model, tokenizer = load_model(model_name, "cpu", torch.bfloat16)
    rng = random.Random(9)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(40, 120))] for _ in range(4)]
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    # 4 sequences of up to 190 tokens in 7 blocks of 64: they cannot all grow, the newest are preempted
    small, tight = run(model, tokenizer, [prompts], params, num_kv_blocks=7)
    roomy, loose = run(model, tokenizer, [prompts], params)
    assert small.stats.preemptions > 0 and roomy.stats.preemptions == 0
    assert_same_logits(tight, loose)
    blocks = small.scheduler.blocks
    assert blocks.num_free == blocks.num_usable  # every block back once all finished
