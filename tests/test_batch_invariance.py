"""Batch invariance in bfloat16: a request's answer does not depend on what it is batched with.

Batching may change when an answer arrives, never what it says. These tests hold it bit for bit
in the shipped dtype (bfloat16 on CPU), at three levels:
- the runner: a sequence's logits alone == beside 1..12 others of random lengths (needle in a
  batch), decode and prefill rows alike; a prompt computed in chunks (tile-aligned, as the
  scheduler cuts them) == the same prompt in one chunk;
- the scheduler: a prompt cut short by the budget ends on a tile boundary;
- the three served models on a real tritonserver with the bundled model: 48 greedy prompts of
  mixed lengths (some longer than max_num_batched_tokens, so chunked), answers alone == answers
  under load (all at once, beside long neighbours for llm_inflight).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import start_test_server
from e2e_clients import GrpcStream, concurrently, configured_repository, grpc_infer, stream_one, text_of
from tritonllm_loadtest.workload import Workload

from tritonllm.engine.faults import hold_prompt
from tritonllm.engine.model_runner import Chunk, ModelRunner
from tritonllm.kernels.prefill_attention import PREFILL_TILE
from tritonllm.engine.scheduler import Scheduler, SchedulerConfig
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.model_loader import DTYPE_ENV, load_model


def neighbour(runner: ModelRunner, slot: int) -> None:
    """Random keys and values in a slot's blocks: a neighbour of any length (what its keys hold
    does not matter here, and a prefill per neighbour would take minutes)."""
    blocks = runner.slot_blocks(slot)
    for layer in runner.cache.layers:
        layer[:, blocks] = torch.randn_like(layer[:, blocks])


def chunk(runner: ModelRunner, slot: int, token_ids: list[int], start: int) -> Chunk:
    return Chunk(runner.slot_blocks(slot), token_ids, start, True)


@pytest.mark.parametrize("needle_len", [300, 321, 520])  # 321: a last tile of one row; 520: past the first block of 512 keys
@pytest.mark.parametrize("model_name,quantization", [("tiny", None), ("bundled", None), ("bundled", "int8")])
def test_a_sequences_logits_do_not_depend_on_its_neighbours(model_name, quantization, needle_len):
    model, _ = load_model(model_name, "cpu", torch.bfloat16)
    runner = ModelRunner(model, num_slots=14, max_model_len=2048, quantization=quantization)
    rng = random.Random(23)
    vocab = model.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    needle = prompt(needle_len + 1)
    last_prompt_row = runner.forward([chunk(runner, 0, needle[:needle_len], 0)])[0]  # alone, one chunk
    alone = runner.forward([chunk(runner, 0, needle[needle_len:], needle_len)])[0]  # its decode, alone
    for trial in range(6):
        lengths = [rng.randint(1, 1200) for _ in range(rng.randint(1, 12))]
        for i in range(len(lengths)):
            neighbour(runner, i + 1)
        chunks = [chunk(runner, i + 1, [rng.randrange(vocab)], n) for i, n in enumerate(lengths)]
        if trial % 2:  # a prompt chunk in the same step as well
            chunks.append(chunk(runner, 13, prompt(rng.randint(2, 200)), 0))
        at = rng.randint(0, len(chunks))
        chunks.insert(at, chunk(runner, 0, needle[needle_len:], needle_len))
        beside = runner.forward(chunks)[at]
        assert torch.equal(beside, alone), (
            f"trial {trial}: the decode's logits changed beside {lengths} (max diff {(beside - alone).abs().max()})")

    # The same prompt in tile-aligned chunks, each beside other work, == in one chunk.
    for trial in range(3):
        start, chunk_logits = 0, None
        while start < needle_len:
            n = min(needle_len - start, PREFILL_TILE * rng.randint(1, 3))
            step = [chunk(runner, 0, needle[start:start + n], start), chunk(runner, 1, prompt(rng.randint(2, 90)), 0)]
            rng.shuffle(step)
            out = runner.forward(step)
            chunk_logits = out[[c.blocks for c in step].index(runner.slot_blocks(0))]
            start += n
        assert torch.equal(chunk_logits, last_prompt_row), f"chunking {trial} changed the prompt's last logits"
        assert torch.equal(runner.forward([chunk(runner, 0, needle[needle_len:], needle_len)])[0], alone)


def test_a_prompt_cut_short_by_the_budget_ends_on_a_tile_boundary():
    config = SchedulerConfig(max_num_seqs=4, max_model_len=2048, max_num_batched_tokens=512)
    scheduler = Scheduler(config, chunk_align=64)
    seqs = [Sequence(f"r{i}", list(range(n)), SamplingParams(max_tokens=4)) for i, n in enumerate([700, 1000, 100])]
    for seq in seqs:
        scheduler.add(seq)

    def step():
        return [(c.seq.request_id, c.start, c.num_tokens) for c in scheduler.schedule()]

    assert step() == [("r0", 0, 512)]
    seqs[0].num_computed = 512
    # r0's rest (188) fits; r1 gets what is left (324) cut down to a multiple of 64
    assert step() == [("r0", 512, 188), ("r1", 0, 320)]
    seqs[0].num_computed, seqs[1].num_computed = 700, 320
    seqs[0].output_ids.append(5)
    # r0 decodes; r1 gets 511 cut to end at 768; the 63 left cannot hold a tile of r2's: it waits
    assert step() == [("r0", 700, 1), ("r1", 320, 448)]
    assert list(scheduler.waiting) == [seqs[2]]
    # a budget that cannot hold a tile beside a full step of decodes: no alignment
    small = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16), chunk_align=64)
    small.add(Sequence("s", list(range(100)), SamplingParams(max_tokens=4)))
    assert [c.num_tokens for c in small.schedule()] == [16]


# ---------------------------------------------------------------- served, bundled model, bfloat16

MAX_TOKENS = 8
LOADED_TIMEOUT = 600  # 48 requests of the bundled model at once, on a busy machine


def mixed_prompts() -> list[str]:
    """48 prompts: 42 of a heavy-tailed length mix, 6 longer than max_num_batched_tokens (chunked)."""
    short = Workload(prompt_words="exp:60:400", seed=23)
    long = Workload(prompt_words="uniform:520:800", seed=24)
    return [short.request(i).prompt for i in range(42)] + [long.request(i).prompt for i in range(6)]


@pytest.fixture(scope="module")
def bundled_bf16_server(tmp_path_factory):
    """The three models on the bundled model in bfloat16; llm_static sends partial batches after
    0.1 s (the shipped 5 s would make each lone request wait 5 s)."""
    root = tmp_path_factory.mktemp("invariance")
    repo = configured_repository(root / "repo", {
        "llm_static": {r"max_queue_delay_microseconds: \d+": "max_queue_delay_microseconds: 100000"},
        "llm_dynamic": {},
        "llm_inflight": {},
    })
    server = start_test_server(root, model_repository=repo, env={"TRITONLLM_MODEL": "bundled", DTYPE_ENV: "bfloat16"})
    yield server
    server.stop()


GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def served_alone_and_under_load(server, model: str, prompts: list[str]) -> tuple[list[str], list[str]]:
    def ask(prompt: str) -> str:
        inputs = dict(text_input=prompt, exclude_input_in_output=True, sampling_parameters=GREEDY)
        if model == "llm_inflight":  # decoupled: a stream of its own
            return stream_one(server, **inputs).text
        return text_of(grpc_infer(server, model, timeout=LOADED_TIMEOUT, **inputs))

    alone = [ask(p) for p in prompts]
    if model != "llm_inflight":
        return alone, concurrently([lambda p=p: ask(p) for p in prompts], timeout=LOADED_TIMEOUT)
    stream = GrpcStream(server)
    neighbours = [f"n{i}" for i in range(3)]
    try:  # long neighbours that decode all the while (held, if they get that far, until cancelled)
        for i, rid in enumerate(neighbours):
            stream.send(rid, text_input=hold_prompt(800, prompts[42 + i]), stream=True,
                        sampling_parameters={"temperature": 0, "max_tokens": 800, "ignore_eos": True})
        stream.wait_first_piece(neighbours, timeout=120)
        rids = [f"p{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts):
            stream.send(rid, text_input=prompt, exclude_input_in_output=True, sampling_parameters=GREEDY)
        stream.wait(rids, timeout=LOADED_TIMEOUT)
        assert not stream.errors, stream.errors
        return alone, [stream.results[rid].text for rid in rids]
    finally:
        stream.close(cancel=True)


@pytest.mark.parametrize("model", ["llm_inflight", "llm_dynamic", "llm_static"])
def test_served_greedy_answers_alone_equal_answers_under_load(bundled_bf16_server, model):
    prompts = mixed_prompts()
    alone, loaded = served_alone_and_under_load(bundled_bf16_server, model, prompts)
    assert all(alone), "an empty answer: the test would prove nothing"
    differ = [i for i, (a, b) in enumerate(zip(alone, loaded)) if a != b]
    assert not differ, (f"{model}: {len(differ)} of {len(prompts)} answers changed under load, e.g. "
                        f"{alone[differ[0]]!r} alone, {loaded[differ[0]]!r} under load")
