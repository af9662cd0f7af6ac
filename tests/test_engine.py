"""The in-flight engine end to end on the tiny random Llama (and one check on the bundled SmolLM2).

Greedy engine output must equal Hugging Face `generate` token for token, whatever the batch
around a request and whenever it arrives; the config is small so that chunked prefill, full
slots and waiting requests all happen.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.engine.sequence import Status
from tritonllm.engine.model_loader import load_model

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)

TEXT_PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "日本語のテキスト 😀 and some English after it.",
    "A much longer prompt that keeps going for a while so that its prefill certainly needs several chunks "
    "of sixteen tokens each: lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny", "cpu")
    return model, tokenizer


def make_engine(tiny, engine_class=LLMEngine, **overrides) -> LLMEngine:
    model, tokenizer = tiny
    return engine_class(model, tokenizer, SchedulerConfig(**{**SMALL, **overrides}))


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos: set[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    new = out[0, len(ids):].tolist()
    for i, t in enumerate(new):  # stop comparing at the first EOS
        if t in eos:
            return new[: i + 1]
    return new


class Collector:
    """Callback that records every output per request and checks the streaming contract."""

    def __init__(self):
        self.outputs: dict[str, list] = {}
        self.lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}

    def event(self, rid) -> threading.Event:
        with self.lock:
            return self._done.setdefault(rid, threading.Event())

    def __call__(self, out):
        with self.lock:
            got = self.outputs.setdefault(out.request_id, [])
            assert not (got and got[-1].finished), f"{out.request_id}: output after the finished one"
            got.append(out)
        if out.finished:
            self.event(out.request_id).set()

    def tokens(self, rid) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.token_ids]

    def text(self, rid) -> str:
        return "".join(o.text for o in self.outputs[rid])

    def final(self, rid):
        outs = self.outputs[rid]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        return outs[-1]


def build_requests(tokenizer, seed: int = 0, n: int = 18):
    rng = random.Random(seed)
    lengths = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 47, 64, 90]
    reqs = []
    for text in TEXT_PROMPTS:
        reqs.append((tokenizer.encode(text), rng.randint(1, 24)))
    for length in lengths:
        reqs.append(([rng.randrange(3, len(tokenizer)) for _ in range(length)], rng.randint(1, 24)))
    rng.shuffle(reqs)
    return reqs[:n]


def record_schedules(engine):
    """Wrap the scheduler so every step's chunks are recorded as (request_id, start, n, prompt_len)."""
    log = []
    orig = engine.scheduler.schedule

    def schedule():
        chunks = orig()
        log.append([(c.seq.request_id, c.start, c.num_tokens, c.seq.num_prompt) for c in chunks])
        return chunks

    engine.scheduler.schedule = schedule
    return log


def test_greedy_matches_hf_generate_with_staggered_arrivals(tiny):
    model, tokenizer = tiny
    engine = make_engine(tiny)
    eos = engine.sampler.eos_token_ids
    log = record_schedules(engine)
    reqs = build_requests(tokenizer)
    assert len(reqs) >= 16
    collect = Collector()
    ids_of = {}
    # Arrivals: a few, some steps, more, ... so requests join a batch already in flight.
    plan = [(3, 2), (1, 5), (2, 1), (1, 4), (4, 2), (2, 3), (1, 1), (len(reqs), 0)]  # (add, then step)
    pending = list(reqs)
    for take, step_count in plan:
        for prompt_ids, max_tokens in pending[:take]:
            rid = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens), collect)
            ids_of[rid] = (prompt_ids, max_tokens)
        pending = pending[take:]
        for _ in range(step_count):
            if not engine.has_unfinished():
                break
            engine.step()
    assert not pending
    engine.run_until_done()
    assert set(collect.outputs) == set(ids_of)

    mismatches = []
    for rid, (prompt_ids, max_tokens) in ids_of.items():
        final = collect.final(rid)
        got = collect.tokens(rid)
        want = hf_greedy(model, prompt_ids, max_tokens, eos)
        if got != want:
            mismatches.append((rid, len(prompt_ids), got, want))
            continue
        assert final.error is None
        assert final.num_prompt_tokens == len(prompt_ids) and final.num_output_tokens == len(got)
        if got[-1] in eos:
            assert final.finish_reason == "stop"
        else:
            assert final.finish_reason == "length" and len(got) == max_tokens
        assert collect.text(rid) == tokenizer.decode(got, skip_special_tokens=True)
        times = [t for o in collect.outputs[rid] for t in o.token_times]
        assert len(times) == len(got) and times == sorted(times)
        assert final.first_token_time == times[0] >= final.arrival_time
    assert not mismatches, f"{len(mismatches)}/{len(ids_of)} requests differ from HF generate: {mismatches[:3]}"

    # The workload really exercised in-flight batching.
    assert not engine.has_unfinished() and engine.num_running == 0
    assert all(sum(n for _, _, n, _ in step) <= SMALL["max_num_batched_tokens"] for step in log)
    assert max(len(step) for step in log) == SMALL["max_num_seqs"], "slots were never all busy"
    continued = [c for step in log for c in step if 0 < c[1] < c[3]]
    assert continued, "no prompt was prefilled in more than one chunk"
    mixed = [step for step in log
             if any(s < p for _, s, _, p in step) and any(s >= p for _, s, _, p in step)]
    assert mixed, "prefill chunks never shared a step with decodes"
    assert engine.stats.tokens_generated == sum(len(collect.tokens(r)) for r in ids_of)
    assert engine.stats.prompt_tokens == sum(len(p) for p, _ in ids_of.values())


def test_generate_helper_matches_step_outputs(tiny):
    model, tokenizer = tiny
    engine = make_engine(tiny)
    prompts = TEXT_PROMPTS[:4]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, res in zip(prompts, results):
        ids = tokenizer.encode(prompt)
        assert res.token_ids == hf_greedy(model, ids, 12, engine.sampler.eos_token_ids)
        assert res.finished and res.text == tokenizer.decode(res.token_ids, skip_special_tokens=True)


SEEDED = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)


def test_seeded_sampling_alone_and_in_a_busy_batch(tiny):
    _, tokenizer = tiny
    prompt = "The weather today is"
    alone = make_engine(tiny).generate([prompt], SEEDED)[0]
    assert len(alone.token_ids) == 20

    engine = make_engine(tiny)
    collect = Collector()
    noise = [
        (TEXT_PROMPTS[5], SamplingParams(temperature=1.0, max_tokens=30)),
        (TEXT_PROMPTS[2], SamplingParams(temperature=0, max_tokens=25)),
        (TEXT_PROMPTS[3], SamplingParams(temperature=0.7, seed=5, max_tokens=15)),
    ]
    for p, sp in noise:
        engine.add_request(p, sp, collect)
    engine.step()
    engine.step()
    rid = engine.add_request(prompt, SEEDED, collect)
    engine.step()
    for p, sp in noise:
        engine.add_request(p, sp, collect)
    engine.run_until_done()
    assert collect.tokens(rid) == alone.token_ids
    assert collect.text(rid) == alone.text

    other_seed = make_engine(tiny).generate([prompt], SamplingParams(**{**SEEDED.__dict__, "seed": 4321}))[0]
    assert other_seed.token_ids != alone.token_ids


def force_eos(engine, eos: int):
    """Make EOS the overwhelming favourite, returning an inference tensor exactly like the real runner."""
    orig = engine.runner.forward

    def forward(chunks):
        with torch.inference_mode():
            logits = orig(chunks)
            logits[:, eos] += 1e4
            return logits

    engine.runner.forward = forward


def test_eos_stops_unless_ignore_eos(tiny):
    _, tokenizer = tiny
    engine = make_engine(tiny)
    eos = tokenizer.eos_token_id
    force_eos(engine, eos)
    stopped, ignored = engine.generate(
        ["Hello there", "Hello there"],
        [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)])
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"
    assert ignored.token_ids == [eos] * 10 and ignored.finish_reason == "length"
    assert ignored.num_output_tokens == 10


@pytest.mark.parametrize("max_tokens", [1, 7, 33])
def test_ignore_eos_gives_exactly_max_tokens(tiny, max_tokens):
    engine = make_engine(tiny)
    res = engine.generate(["Hi", TEXT_PROMPTS[5]],
                          SamplingParams(temperature=0.8, seed=3, max_tokens=max_tokens, ignore_eos=True))
    for r in res:
        assert len(r.token_ids) == max_tokens and r.num_output_tokens == max_tokens
        assert r.finish_reason == "length" and r.error is None


def test_min_tokens_delays_eos(tiny):
    """min_tokens=5 with EOS always favoured: 5 non-EOS tokens, then EOS as the 6th, reason stop."""
    _, tokenizer = tiny
    engine = make_engine(tiny)
    eos = tokenizer.eos_token_id
    force_eos(engine, eos)
    res = engine.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=10, min_tokens=5))[0]
    assert res.error is None, f"min_tokens request failed: {res.error}"
    assert res.finish_reason == "stop"
    assert len(res.token_ids) == 6 and eos not in res.token_ids[:5] and res.token_ids[5] == eos


def test_repetition_penalty_matches_hf_generate(tiny):
    model, tokenizer = tiny
    engine = make_engine(tiny)
    prompt = TEXT_PROMPTS[2]
    res = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3))[0]
    assert res.error is None, f"repetition_penalty request failed: {res.error}"
    want = hf_greedy(model, tokenizer.encode(prompt), 12, engine.sampler.eos_token_ids, repetition_penalty=1.3)
    assert res.token_ids == want


def test_presence_and_frequency_penalties_run(tiny):
    engine = make_engine(tiny)
    res = engine.generate(["Hello", "Hello"], [
        SamplingParams(temperature=0, max_tokens=8, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=8, frequency_penalty=-1.0, ignore_eos=True),
    ])
    for r in res:
        assert r.error is None and r.finish_reason == "length" and len(r.token_ids) == 8, (r.finish_reason, r.error)


def test_abort_frees_the_slot_for_the_next_step(tiny):
    engine = make_engine(tiny)
    collect = Collector()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    rids = [engine.add_request(f"request number {i}", long, collect) for i in range(5)]
    for _ in range(3):
        engine.step()
    running = [engine.scheduler.find(r) for r in rids[:4]]
    waiting = engine.scheduler.find(rids[4])
    assert all(s.status is Status.RUNNING for s in running) and waiting.status is Status.WAITING
    victim = running[1]
    tokens_before = len(victim.output_ids)

    engine.abort(victim.request_id)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[victim.request_id].finished and outs[victim.request_id].finish_reason == "abort"
    assert collect.final(victim.request_id).finish_reason == "abort"
    assert len(collect.tokens(victim.request_id)) == tokens_before  # nothing generated after the abort
    # The waiting request took the freed row in that very step and started its prefill.
    assert not victim.block_table and waiting.status is Status.RUNNING and waiting.num_computed > 0
    assert engine.num_running == 4 and engine.num_waiting == 0

    # Abort a request that is still in the inbox, and an unknown id: no crash, no tokens.
    late = engine.add_request("never runs", long, collect)
    engine.abort(late)
    engine.abort("no-such-request")
    engine.step()
    assert collect.final(late).finish_reason == "abort" and collect.tokens(late) == []
    for r in rids:
        engine.abort(r)
    engine.step()
    assert not engine.has_unfinished()
    engine.step()  # stepping an idle engine is harmless
    assert all(collect.final(r).finish_reason == "abort" for r in rids)


def test_streamed_pieces_concatenate_to_final_text(tiny):
    _, tokenizer = tiny
    engine = make_engine(tiny)
    collect = Collector()
    rids = [engine.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=30), collect)
            for i, p in enumerate(TEXT_PROMPTS)]
    engine.run_until_done()
    for rid in rids:
        outs = collect.outputs[rid]
        assert sum(1 for o in outs if o.text) > 1, "the text was not streamed"
        assert collect.text(rid) == tokenizer.decode(collect.tokens(rid), skip_special_tokens=True)


def test_stop_string_cuts_streamed_text(tiny):
    _, tokenizer = tiny
    prompt = TEXT_PROMPTS[1]
    base = make_engine(tiny).generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    full = base.text
    assert len(full) > 40
    for a, n in ((12, 6), (25, 3), (30, 10)):
        stop = full[a:a + n]
        engine = make_engine(tiny)
        collect = Collector()
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                                 collect)
        streamed = ""
        while engine.has_unfinished():
            engine.step()
            streamed = collect.text(rid)
            assert full[: full.find(stop)].startswith(streamed), "streamed text went past the stop string"
        final = collect.final(rid)
        assert final.finish_reason == "stop"
        assert collect.text(rid) == full[: full.find(stop)]
        ids = collect.tokens(rid)
        assert ids == base.token_ids[: len(ids)]
        # It stopped at the token that completed the stop string.
        end = full.find(stop) + len(stop)
        assert len(tokenizer.decode(ids[:-1])) < end <= len(tokenizer.decode(ids))


def test_stop_string_before_min_tokens_keeps_text_consistent(tiny):
    """Whatever min_tokens does to a stop string, the text must be a prefix of the decoded tokens."""
    _, tokenizer = tiny
    prompt = TEXT_PROMPTS[1]
    base = make_engine(tiny).generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = base.text[12:18]
    res = make_engine(tiny).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert res.error is None, f"min_tokens request failed: {res.error}"
    assert len(res.token_ids) >= 20
    decoded = tokenizer.decode(res.token_ids, skip_special_tokens=True)
    assert decoded.startswith(res.text), f"text {res.text!r} is not a prefix of the decoded tokens {decoded!r}"


def test_too_long_prompt_is_rejected_at_add_request(tiny):
    _, tokenizer = tiny
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, 303)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, 253)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError):
        engine.add_request("", SamplingParams(max_tokens=1))
    assert not engine.has_unfinished()
    engine.add_request(list(range(3, 253)), SamplingParams(max_tokens=6))  # exactly max_model_len
    assert engine.has_unfinished()


def test_background_thread_serves_requests_from_other_threads(tiny):
    model, tokenizer = tiny
    engine = make_engine(tiny)
    eos = engine.sampler.eos_token_ids
    reqs = build_requests(tokenizer, seed=1, n=12)
    collect = Collector()
    submitted: dict[str, tuple] = {}
    lock = threading.Lock()
    errors = []

    def client(part):
        try:
            for prompt_ids, max_tokens in part:
                rid = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens), collect)
                with lock:
                    submitted[rid] = (prompt_ids, max_tokens)
                time.sleep(0.005)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    engine.start()
    try:
        threads = [threading.Thread(target=client, args=(reqs[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for rid in submitted:
            assert collect.event(rid).wait(60), f"{rid} never finished"
    finally:
        engine.shutdown()
    assert not engine._thread.is_alive()
    for rid, (prompt_ids, max_tokens) in submitted.items():
        assert collect.final(rid).finish_reason in ("stop", "length")
        assert collect.tokens(rid) == hf_greedy(model, prompt_ids, max_tokens, eos)


def test_shutdown_aborts_open_requests(tiny):
    engine = make_engine(tiny)
    collect = Collector()
    first = threading.Event()

    def callback(out):
        collect(out)
        first.set()

    long = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    engine.start()
    rids = [engine.add_request(f"prompt {i}", long, callback) for i in range(6)]
    assert first.wait(30)
    engine.shutdown()
    assert not engine._thread.is_alive()
    assert not engine.has_unfinished()
    for rid in rids:
        final = collect.final(rid)
        assert final.finish_reason == "abort" and final.num_output_tokens < 240
    counts = {rid: len(collect.outputs[rid]) for rid in rids}
    time.sleep(0.05)
    assert counts == {rid: len(collect.outputs[rid]) for rid in rids}, "callbacks after shutdown"
    assert all(engine.scheduler.find(r) is None for r in rids)
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable


def test_bundled_model_matches_hf_generate():
    model, tokenizer = load_model("bundled", "cpu")
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512))
    eos = engine.sampler.eos_token_ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompts = [
        ("Hello", 12),
        ("The three primary colors are", 12),
        ("Write a short poem about the sea. The waves roll in and out, and the gulls cry over the water while", 12),
        (chat, 20),
    ]
    collect = Collector()
    rids = []
    for i, (prompt, n) in enumerate(prompts):  # staggered arrivals
        rids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n), collect))
        engine.step()
    engine.run_until_done()
    matched, total, report = 0, 0, []
    for rid, (prompt, n) in zip(rids, prompts):
        got = collect.tokens(rid)
        want = hf_greedy(model, tokenizer.encode(prompt), n, eos)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        matched += same
        total += max(len(got), len(want))
        if got != want:
            report.append((prompt[:30], got, want))
    assert not report, f"bundled greedy mismatch, token match rate {matched}/{total}: {report}"
    answer = collect.text(rids[-1])
    assert "Paris" in answer, answer


def test_request_level_policy_gives_the_same_text_and_pays_for_padding(tiny):
    """`batch_policy="request"` (llm_dynamic / llm_static) changes the cost, never the tokens."""
    _, tokenizer = tiny
    prompts = ["Once upon a time", "The capital of France is", "1 2 3 4"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 9, 5)]
    continuous = make_engine(tiny, max_num_seqs=4)
    request = make_engine(tiny, max_num_seqs=4, batch_policy="request")
    expected = continuous.generate(prompts, params)
    got = request.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    # Finished rows stayed in every forward until the longest (9 tokens) ended.
    assert request.stats.decode_steps == 9 and request.scheduler.blocks.num_free == request.scheduler.blocks.num_usable


def test_held_request_keeps_its_slot_until_aborted(tiny, monkeypatch):
    """The test-only fault `[[hold:N]]`: N tokens, then no compute and no finish until aborted."""
    from tritonllm.engine import faults

    engine = make_engine(tiny, faults.FaultInjectingEngine, max_num_seqs=2)
    collect = Collector()
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    unheld = engine.add_request(faults.hold_prompt(3, "ignored without the switch"), long, collect)
    monkeypatch.setenv(faults.ENV, "1")
    held = engine.add_request(faults.hold_prompt(3, "Hello"), long, collect)
    other = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=5), collect)
    for _ in range(200):  # far more steps than the unheld requests need
        engine.step()
    assert collect.final(unheld).num_output_tokens == 50  # the switch is read per request, when it arrives
    assert collect.final(other).finish_reason == "length"
    assert len(collect.tokens(held)) == 3 and not collect.outputs[held][-1].finished
    assert engine.num_running == 1 and engine.stats.tokens_generated == 50 + 5 + 3
    engine.abort(held)
    engine.step()
    assert collect.final(held).finish_reason == "abort" and engine.num_running == 0
    assert not engine.has_unfinished()


def test_the_engine_itself_knows_no_faults(tiny, monkeypatch):
    """The faults live in FaultInjectingEngine alone: the plain engine serves a marked prompt as any other."""
    from tritonllm.engine import faults

    monkeypatch.setenv(faults.ENV, "1")
    engine = make_engine(tiny)
    outs = engine.generate([faults.hold_prompt(2, "Hello"), f"{faults.FAIL_MARK} boom"],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "length"] and all(o.error is None for o in outs)
    assert faults.engine_class() is faults.FaultInjectingEngine
    monkeypatch.delenv(faults.ENV)
    assert faults.engine_class() is LLMEngine


def test_abort_all_waiting_then_everything(tiny):
    """What llm_inflight does on SIGTERM: refuse the waiting requests, later end the running ones."""
    engine = make_engine(tiny)
    collect = Collector()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    rids = [engine.add_request(f"request number {i}", long, collect) for i in range(6)]
    for _ in range(3):
        engine.step()
    assert engine.num_running == 4 and engine.num_waiting == 2
    engine.abort_all(waiting_only=True)
    engine.step()
    assert [collect.final(r).finish_reason for r in rids[4:]] == ["abort", "abort"]
    assert not any(o.finished for r in rids[:4] for o in collect.outputs.get(r, [])) and engine.num_running == 4
    assert engine.num_waiting == 0
    engine.abort_all()
    engine.step()
    assert [collect.final(r).finish_reason for r in rids[:4]] == ["abort"] * 4
    assert not engine.has_unfinished()


def test_a_failing_forward_fails_only_the_request_that_fails_alone(tiny, monkeypatch):
    """The test-only fault `[[fail]]` makes every forward computing its request raise: the batch is
    run again one by one, so only that request ends with an error, and the others answer exactly."""
    from tritonllm.engine import faults

    monkeypatch.setenv(faults.ENV, "1")
    engine = make_engine(tiny, faults.engine_class())
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [o.text for o in engine.generate(TEXT_PROMPTS[:3], greedy)]
    outs = engine.generate([f"{faults.FAIL_MARK} boom", *TEXT_PROMPTS[:3]], greedy)
    assert outs[0].finish_reason == "error" and "test fault" in outs[0].error and outs[0].token_ids == []
    assert [o.text for o in outs[1:]] == expected and all(o.error is None for o in outs[1:])
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable
    assert [o.text for o in engine.generate(TEXT_PROMPTS[:3], greedy)] == expected  # serves on


def test_queue_time_counts_the_wait_for_a_slot_once_per_request(tiny):
    engine = make_engine(tiny)  # 4 slots
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rids = [engine.add_request(f"request number {i}", params) for i in range(6)]
    engine.step()
    assert engine.stats.requests_scheduled == 4  # the first four got slots at once
    first_four = engine.stats.queue_seconds
    late = [engine.scheduler.find(r) for r in rids[4:]]
    assert all(s.first_scheduled_time is None for s in late)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.requests_scheduled == 6  # once each, though each ran in several steps
    assert all(s.first_scheduled_time > s.arrival_time for s in late)
    waited = sum(s.first_scheduled_time - s.arrival_time for s in late)
    assert engine.stats.queue_seconds == pytest.approx(first_four + waited)
    assert waited > 2 * first_four  # the two that waited for a freed slot waited longer than those that did not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runners_rms_norm_equals_the_models_own_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from tritonllm.engine.model_runner import rms_norm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    norm = norm.to(dtype)
    for rows in (1, 3, 8, 300):
        x = (torch.randn(rows, 576) * torch.rand(rows, 1) * 30).to(dtype)
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)), f"{rows} rows"


def test_waste_and_occupancy_count_what_each_scheme_computes(tiny):
    """Known answers. In-flight: a prompt of P tokens and N tokens out is P + N - 1 rows, N of which
    made a token; beside it a second sequence's rows. Request-level batching: a short member stays as
    padding until the long one ends, one padding row a step."""
    _, tokenizer = tiny
    long_prompt, short_prompt = list(range(5, 25)), list(range(30, 36))  # 20 and 6 tokens
    engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=64)
    engine.generate([long_prompt], SamplingParams(max_tokens=7, ignore_eos=True))
    s = engine.stats
    assert (s.rows_computed, s.tokens_generated, s.padding_rows) == (20 + 6, 7, 0)
    assert s.waste == 1 - 7 / 26
    assert (s.sequence_rows, s.slot_steps) == (7, 7 * 4) and s.occupancy == 0.25

    for policy, padding in (("continuous", 0), ("request", 10 - 3)):
        engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, batch_policy=policy)
        engine.add_request(long_prompt, SamplingParams(max_tokens=10, ignore_eos=True))
        engine.add_request(short_prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        s = engine.stats
        assert s.tokens_generated == 13
        assert s.padding_rows == padding, policy
        # both prompts in the first forward, then one decode row a live member (and a padding row)
        assert s.rows_computed == 20 + 6 + (10 - 1) + (3 - 1) + padding, policy
        assert s.sequence_rows == 2 * 10 if policy == "request" else 10 + 3, policy
        assert s.slot_steps == 10 * 4
        assert s.waste == 1 - 13 / s.rows_computed
