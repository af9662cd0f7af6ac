"""The three models on a real tritonserver, through real clients (tritonclient gRPC/HTTP, HTTP generate).

Every protocol each model supports, greedy output equal to in-process Hugging Face `generate`,
batching visible in Triton's statistics and our metrics, cancellation, per-request errors,
seeded sampling and the optional outputs. Every wait has a timeout so that a bug fails the test
instead of hanging it, and every wait is on a condition the server reports (a response, a metric,
Triton's statistics), never on a window a busy machine can miss:
- a request that must still be running is held by the test-only fault `[[hold:N]]` (it cannot
  finish by itself; see engine/faults.py);
- a test that needs full batches sends them to `strict_server`, whose batching models dispatch a
  batch only when it is full (queue delay 10 min), so a batch of 8 is certain, not likely. Triton's
  batcher never batches requests whose input sets differ, so every request of such a batch sends
  the same set of inputs;
- Triton publishes a batch's statistics, and our sender thread its metrics, just after the
  responses go out: tests wait until the numbers arrive.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import numpy as np
import pytest
import requests
from conftest import start_test_server
from e2e_clients import (BATCHED, GREEDY, SETTLE, TIMEOUT, GrpcStream, as_json_body, batch_counts, concurrently,
                         configured_repository, engine_parameter, generate, generate_stream, grpc_infer, http_infer,
                         metric, model_stats, scalar, stream_error, stream_one, text_of, wait_for_batches,
                         wait_for_metric)
from tritonclient.utils import InferenceServerException

from tritonllm.engine.faults import hold_prompt
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.metric_names import VLLM_NAMES

STATIC_BATCH = 8  # llm_static's preferred (and max) batch size
SEEDED = {"temperature": 0.8, "seed": 123, "max_tokens": 16}

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "日本語のテキスト 😀 and some English after it.",
    "A much longer prompt that keeps going for a while, so that its prefill is far longer than the "
    "others in its batch: lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod "
    "tempor incididunt ut labore et dolore magna aliqua. " * 4,
    "Q: What is two plus two?\nA:",
    "   leading spaces and\ttabs",
]
# 16 requests: every prompt twice, with different output lengths.
MIXED = [(PROMPTS[i % len(PROMPTS)], 1 + (7 * i) % 29) for i in range(16)]


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """Batching models that dispatch only full batches of 8, and llm_inflight with 1 slot and room for
    1 waiting request. The shipped 5 s / 50 ms delays are tested against `triton_server`."""
    full_batches_only = {r"max_queue_delay_microseconds: \d+": "max_queue_delay_microseconds: 600000000"}
    root = tmp_path_factory.mktemp("strict")
    repo = configured_repository(root / "repo", {
        "llm_static": full_batches_only,
        "llm_dynamic": full_batches_only,
        "llm_inflight": {**engine_parameter("max_num_seqs", "1"), **engine_parameter("max_queue_size", "1")},
    })
    server = start_test_server(root, model_repository=repo)
    yield server
    server.stop()


# ---------------------------------------------------------------- protocols


def test_inflight_grpc_stream_streams_pieces_and_ends_with_one_final(triton_server, reference):
    prompt, n = PROMPTS[2], 12
    res = stream_one(triton_server, text_input=prompt, stream=True,
                     sampling_parameters={**GREEDY, "max_tokens": n, "ignore_eos": True})
    assert res.finals == 1 and res.after_final == 0
    assert len(res.texts) > 1, "streaming sent the whole text at once"
    assert res.text == reference(prompt, n)  # streaming does not echo the prompt (vLLM rule)


def test_inflight_grpc_stream_unstreamed_request_echoes_prompt_by_default(triton_server, reference):
    prompt = PROMPTS[1]
    res = stream_one(triton_server, text_input=prompt, sampling_parameters={**GREEDY, "max_tokens": 8})
    assert res.finals == 1 and len(res.texts) == 1
    assert res.text == prompt + reference(prompt, 8)


def test_inflight_http_generate(triton_server, reference):
    prompt = PROMPTS[3]
    response = generate(triton_server, "llm_inflight", text_input=prompt, exclude_input_in_output=True,
                        sampling_parameters=json.dumps({**GREEDY, "max_tokens": 10}))
    assert response.status_code == 200, response.text
    assert response.json()["text_output"] == reference(prompt, 10)
    # Values as HTTP generate sends them: keys at the top level become request parameters / inputs.
    response = generate(triton_server, "llm_inflight", text_input=prompt, max_tokens=10, temperature=0)
    assert response.status_code == 200, response.text
    assert response.json()["text_output"] == prompt + reference(prompt, 10)
    # Keys that are no input of the model arrive as request parameters (ignore_eos here).
    response = generate(triton_server, "llm_inflight", text_input=prompt, max_tokens=10, temperature=0,
                        ignore_eos=True, return_num_output_tokens=True)
    assert response.status_code == 200 and response.json()["num_output_tokens"] == 10, response.text
    response = generate(triton_server, "llm_inflight", text_input=prompt, max_tokenz=10)
    assert response.status_code == 400 and "max_tokenz" in response.json()["error"], response.text


def test_inflight_http_generate_stream(triton_server, reference):
    prompt = PROMPTS[4]
    events = generate_stream(triton_server, "llm_inflight", text_input=prompt, stream=True,
                             sampling_parameters=json.dumps({**GREEDY, "max_tokens": 12, "ignore_eos": True}))
    assert events and not any("error" in e for e in events), events
    assert len(events) > 1, "generate_stream sent the whole text in one event"
    assert "".join(e["text_output"] for e in events) == reference(prompt, 12)


def test_inflight_refuses_unary_infer_without_hanging(triton_server):
    for infer in (http_infer, grpc_infer):
        t0 = time.monotonic()
        with pytest.raises(InferenceServerException, match="decoupled"):
            infer(triton_server, "llm_inflight", text_input="Hello")
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("model", BATCHED)
def test_batched_models_over_http_infer_grpc_infer_and_generate(strict_server, reference, model):
    """One batch of 8: 3 HTTP infer, 3 gRPC infer, 2 HTTP generate."""
    triton_server = strict_server
    before = batch_counts(model_stats(triton_server, model))
    prompts = [(PROMPTS[i], 3 + i) for i in range(STATIC_BATCH)]
    params = lambda n: {**GREEDY, "max_tokens": n}  # noqa: E731
    calls = []
    for i, (prompt, n) in enumerate(prompts):
        if i < 3:
            calls.append(lambda p=prompt, n=n: text_of(http_infer(triton_server, model, text_input=p,
                                                                  sampling_parameters=params(n))))
        elif i < 6:
            calls.append(lambda p=prompt, n=n: text_of(grpc_infer(triton_server, model, text_input=p,
                                                                  sampling_parameters=params(n))))
        else:
            calls.append(lambda p=prompt, n=n: generate(triton_server, model, text_input=p,
                                                        sampling_parameters=json.dumps(params(n))).json())
    got = concurrently(calls)
    for i, ((prompt, n), out) in enumerate(zip(prompts, got)):
        if isinstance(out, dict):
            assert "text_output" in out, out
            out = out["text_output"]
        assert out == prompt + reference(prompt, n), f"request {i}"  # not streaming: the prompt is echoed
    grown = wait_for_batches(triton_server, model, before, lambda g: g)
    assert grown == {STATIC_BATCH: 1}, f"the 8 requests did not run as one batch: {grown}"


# ---------------------------------------------------------------- greedy under load, batching visible


def test_inflight_concurrent_greedy_matches_hf_and_batches(triton_server, reference):
    """16 requests queue behind a held one per row; released together, they certainly share steps."""
    slots = int(metric(triton_server, "tritonllm_num_slots", "llm_inflight"))  # max_num_seqs
    blockers = GrpcStream(triton_server)
    held = [f"block{i}" for i in range(slots)]
    stream = GrpcStream(triton_server)
    ids = [f"g{i}" for i in range(len(MIXED))]
    try:
        for rid in held:
            blockers.send(rid, text_input=hold_prompt(1, "wait"), stream=True,
                          sampling_parameters={**GREEDY, "max_tokens": 100, "ignore_eos": True})
        assert wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == slots) == slots
        tokens0 = metric(triton_server, "tritonllm_generation_tokens_total")
        steps0 = metric(triton_server, "tritonllm_steps_total")
        for i, (rid, (prompt, n)) in enumerate(zip(ids, MIXED)):
            # Half stream, half answer at the end; neither echoes the prompt.
            stream.send(rid, text_input=prompt, stream=i % 2 == 0, exclude_input_in_output=True,
                        return_num_output_tokens=True, sampling_parameters={**GREEDY, "max_tokens": n})
        assert wait_for_metric(triton_server, "tritonllm_num_requests_waiting", lambda v: v == len(ids)) == len(ids)
        blockers.close(cancel=True)  # every row frees at once: the waiting requests start together
        stream.wait(ids)
        assert not stream.errors, stream.errors
    finally:
        blockers.close(cancel=True)
        stream.close(cancel=True)
    mismatches = [(rid, prompt, n) for rid, (prompt, n) in zip(ids, MIXED)
                  if stream.results[rid].text != reference(prompt, n)]
    assert not mismatches, f"{len(mismatches)}/16 differ from HF generate: {mismatches[:3]}"
    assert all(stream.results[rid].finals == 1 and stream.results[rid].after_final == 0 for rid in ids)
    # Streamed responses count their own new tokens, whole ones all of them: the sum is every token.
    expected = sum(scalar(r, "num_output_tokens") for rid in ids for r in stream.results[rid].results)
    assert expected >= len(MIXED)
    # The sender thread publishes the counters just after the responses go out: wait for them. The
    # gauges are read live, so `running == 8` can show before the last blockers' one token each is
    # counted: up to `slots` tokens of theirs may fall after tokens0.
    tokens = wait_for_metric(triton_server, "tritonllm_generation_tokens_total", lambda v: v - tokens0 >= expected)
    assert expected <= tokens - tokens0 <= expected + slots
    steps = wait_for_metric(triton_server, "tritonllm_steps_total", lambda v: v > steps0) - steps0
    assert expected / steps > 1.5, f"{expected} tokens in {steps} steps: sequences did not share steps"


@pytest.mark.parametrize("model", BATCHED)
def test_batched_concurrent_greedy_matches_hf_and_batches(strict_server, reference, model):
    """16 requests make exactly two batches of 8 (the strict server sends only full batches)."""
    triton_server = strict_server
    before = batch_counts(model_stats(triton_server, model))
    calls = []
    for i, (prompt, n) in enumerate(MIXED):
        body = dict(text_input=prompt, exclude_input_in_output=True, sampling_parameters={**GREEDY, "max_tokens": n})
        if i % 2:
            calls.append(lambda body=body: text_of(grpc_infer(triton_server, model, **body)))
        else:
            body["sampling_parameters"] = json.dumps(body["sampling_parameters"])
            calls.append(lambda body=body: generate(triton_server, model, **body).json().get("text_output"))
    got = concurrently(calls)
    mismatches = [(i, prompt, n, text) for i, ((prompt, n), text) in enumerate(zip(MIXED, got))
                  if text != reference(prompt, n)]
    assert not mismatches, f"{len(mismatches)}/16 differ from HF generate: {mismatches[:3]}"
    grown = wait_for_batches(triton_server, model, before, lambda g: sum(s * n for s, n in g.items()) >= 16)
    assert grown == {STATIC_BATCH: 2}, f"16 requests did not run as two batches of 8: {grown}"


# ---------------------------------------------------------------- cancellation


def test_cancelled_stream_frees_running_and_waiting_sequences(triton_server, reference):
    """Held requests, 2 more than rows (streamed and not), then stop_stream(cancel_requests=True)."""
    slots, hold = int(metric(triton_server, "tritonllm_num_slots", "llm_inflight")), 20
    n = slots + 2
    long = {**GREEDY, "max_tokens": 2000, "ignore_eos": True}
    running = wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == 0)
    assert running == 0, "an earlier test left sequences running"
    tokens0 = metric(triton_server, "tritonllm_generation_tokens_total")
    stream = GrpcStream(triton_server)
    ids = [f"long{i}" for i in range(n)]
    try:
        for i, rid in enumerate(ids):
            stream.send(rid, text_input=hold_prompt(hold, f"{rid} says hi"), stream=i < 5, sampling_parameters=long)
        stream.wait_first_piece(ids[:5])
        running = wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == slots)
        assert running == slots, f"the gauge never showed {slots} sequences running together (last {running})"
        waiting = wait_for_metric(triton_server, "tritonllm_num_requests_waiting", lambda v: v == n - slots)
        assert waiting == n - slots
    finally:
        t0 = time.monotonic()
        stream.close(cancel=True)
        assert time.monotonic() - t0 < 10, "stop_stream(cancel_requests=True) hung"
    running = wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == 0)
    assert running == 0, f"{running} sequences still running {SETTLE} s after the stream was cancelled"
    assert wait_for_metric(triton_server, "tritonllm_num_requests_waiting", lambda v: v == 0) == 0
    # Each held request makes at most `hold` tokens; the waiting ones too, since the cancellations
    # reach the engine one by one and a freed slot may admit a waiting request for a step first.
    generated = metric(triton_server, "tritonllm_generation_tokens_total") - tokens0
    assert generated <= n * hold, f"{generated} tokens: more than {hold} for some request"
    assert not any(stream.results[rid].finals for rid in ids), "a held request ended by itself"
    # The engine still serves.
    res = stream_one(triton_server, text_input=PROMPTS[0], sampling_parameters={**GREEDY, "max_tokens": 5},
                     exclude_input_in_output=True)
    assert res.text == reference(PROMPTS[0], 5)


def test_closed_generate_stream_connection_frees_its_sequence(triton_server):
    hold = 5
    assert wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == 0) == 0
    tokens0 = metric(triton_server, "tritonllm_generation_tokens_total")
    body = {"text_input": hold_prompt(hold, "Hi"), "stream": True, "max_tokens": 2000, "ignore_eos": True}
    with requests.post(f"http://{triton_server.http_url}/v2/models/llm_inflight/generate_stream", json=body,
                       stream=True, timeout=TIMEOUT) as response:
        # Keep the line iterator alive: breaking out of a loop over it closes the generator, and
        # urllib3 closes the connection when its stream generator is closed early.
        lines = response.iter_lines(chunk_size=None)
        events = 0
        while events < 3:
            events += next(lines).startswith(b"data: ")
        # Held after 5 tokens: it is running until its client goes away, whatever the machine's speed.
        assert wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == 1) == 1
    # Leaving the block closed the connection: Triton cancels the request, the engine frees its slot.
    running = wait_for_metric(triton_server, "tritonllm_num_requests_running", lambda v: v == 0)
    assert running == 0, "the sequence kept running after its client went away"
    assert metric(triton_server, "tritonllm_generation_tokens_total") - tokens0 <= hold


# ---------------------------------------------------------------- bad requests

LONG_PROMPT = "hello world " * 1100  # > 2048 tokens: longer than max_model_len

# (sampling key, what is wrong, value): every key out of range or of the wrong type
SAMPLING_CASES = (
    ("max_tokens", "zero", 0), ("max_tokens", "negative", -3), ("max_tokens", "fraction", 1.5),
    ("min_tokens", "negative", -1), ("temperature", "negative", -0.5), ("temperature", "word", "hot"),
    ("temperature", "nan", "nan"), ("top_k", "negative", -5), ("top_k", "word", "many"), ("top_p", "zero", 0),
    ("seed", "negative", -1), ("seed", "past_2_63", 2**64), ("seed", "fraction", 1.5),
    ("stop", "empty_string", [""]), ("stop", "number", 5), ("stop_token_ids", "strings", ["a"]),
    ("stop_token_ids", "negative", [-1]), ("ignore_eos", "word", "maybe"), ("repetition_penalty", "zero", 0),
    ("presence_penalty", "past_2", 3), ("frequency_penalty", "word", "x"), ("skip_special_tokens", "number", 2),
    ("logprobs", "past_20", 21), ("logprobs", "word", "some"), ("prompt_logprobs", "negative", -1),
    ("structured_outputs", "two_kinds", {"regex": "a+", "choice": ["a"]}),
    ("structured_outputs", "unknown_kind", {"xml": "<a/>"}), ("structured_outputs", "empty_choice", {"choice": []}),
    # well-formed, refused when compiled (in the thread that adds the request, never in a step)
    ("structured_outputs", "bad_regex", {"regex": "[a-"}),
    ("structured_outputs", "bad_schema_type", {"json": {"type": "objec"}}),
    ("structured_outputs", "bad_grammar", {"grammar": "start: undefined_rule"}),
)
# name -> (inputs, what the error must mention)
BAD = {
    "missing_text_input": ({"sampling_parameters": {"max_tokens": 4}}, "text_input"),
    "non_utf8_text_input": ({"text_input": b"\xff\xfe"}, "UTF-8"),
    "invalid_json": ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": 4'}, "not valid JSON"),
    "unknown_key": ({"text_input": "Hi", "sampling_parameters": {"max_tokenz": 4}}, "max_tokenz"),
    "wrong_type": ({"text_input": "Hi", "sampling_parameters": {"max_tokens": "abc"}}, "max_tokens"),
    "out_of_range": ({"text_input": "Hi", "sampling_parameters": {"top_p": 1.5}}, "top_p"),
    "prompt_too_long": ({"text_input": LONG_PROMPT}, "max_model_len"),
    "stream_on_batched": ({"text_input": "Hi", "stream": True}, "cannot stream"),
    **{f"sampling_{key}_{tag}": ({"text_input": "Hi", "sampling_parameters": {key: value}}, key)
       for key, tag, value in SAMPLING_CASES},
    "min_tokens_over_max_tokens": ({"text_input": "Hi", "sampling_parameters": {"max_tokens": 4, "min_tokens": 9}},
                                   "min_tokens"),
    "max_tokens_past_max_model_len": ({"text_input": "Hi", "sampling_parameters": {"max_tokens": 5000}}, "max_model_len"),
    "empty_prompt": ({"text_input": ""}, "prompt is empty"),
    "json_array": ({"text_input": "Hi", "sampling_parameters": "[1, 2]"}, "must be a JSON object"),
    "json_null": ({"text_input": "Hi", "sampling_parameters": "null"}, "must be a JSON object"),
    "json_nested_too_deeply": ({"text_input": "Hi", "sampling_parameters": '{"stop": ' + "[" * 50_000 + "]" * 50_000 + "}"},
                               "nested too deeply"),
    "json_number_too_long": ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": ' + "9" * 5000 + "}"},
                             "not valid JSON"),
    "unknown_input": ({"text_input": "Hi", "no_such_input": "x"}, "no_such_input"),
    # Refused by Triton itself, before the model: inputs of the wrong datatype
    "text_input_as_int32": ({"text_input": np.array([5], dtype=np.int32)}, "text_input"),
    "text_input_of_two_strings": ({"text_input": np.array([b"Hi", b"there"], dtype=np.object_)}, "text_input"),
    "max_tokens_as_fp32": ({"text_input": "Hi", "max_tokens": np.array([4.0], dtype=np.float32)}, "max_tokens"),
}
GOOD = {"text_input": "Hi", "sampling_parameters": {**GREEDY, "max_tokens": 3}}


def test_bad_inputs_cover_every_sampling_key_and_forty_cases():
    assert len(BAD) >= 40
    assert {f.name for f in fields(SamplingParams)} == {key for key, _, _ in SAMPLING_CASES}


def fits_json(inputs: dict) -> bool:
    """HTTP generate takes JSON: no raw bytes (non-UTF-8) and no typed arrays."""
    return all(isinstance(v, (str, dict, bool, int, float)) for v in inputs.values())


def test_long_prompt_is_longer_than_max_model_len(tiny_model):
    assert len(tiny_model[1].encode(LONG_PROMPT)) > 2048


@pytest.mark.parametrize("case", [c for c in BAD if c != "stream_on_batched"])
def test_inflight_bad_request_gets_its_error_then_serves(triton_server, case):
    inputs, expected = BAD[case]
    for stream in (False, True):
        assert expected in stream_error(triton_server, **inputs, **({"stream": True} if stream else {}))
    if fits_json(inputs):
        response = generate(triton_server, "llm_inflight", **as_json_body(inputs))
        assert response.status_code == 400 and expected in response.json()["error"], response.text
        events = generate_stream(triton_server, "llm_inflight", stream=True, **as_json_body(inputs))
        assert len(events) == 1 and expected in events[0].get("error", ""), events
    res = stream_one(triton_server, **GOOD)
    assert res.finals == 1 and res.text.startswith("Hi") and len(res.text) > 2


@pytest.mark.parametrize("case", list(BAD))
def test_dynamic_bad_request_gets_its_error_then_serves(triton_server, case):
    inputs, expected = BAD[case]
    for infer in (http_infer, grpc_infer):
        with pytest.raises(InferenceServerException) as err:
            infer(triton_server, "llm_dynamic", **inputs)
        assert expected in str(err.value)
    if fits_json(inputs):
        response = generate(triton_server, "llm_dynamic", **as_json_body(inputs))
        assert response.status_code == 400 and expected in response.json()["error"], response.text
    assert text_of(grpc_infer(triton_server, "llm_dynamic", **GOOD)).startswith("Hi")


def test_static_batch_with_bad_requests_serves_the_good_ones(strict_server, reference):
    """One full batch of 8: six bad requests and two good ones, each gets its own answer.

    Triton's batcher only batches requests that carry the same set of inputs (one with another
    set dispatches the pending batch at once), so every request here sends text_input and
    sampling_parameters, nothing else.
    """
    greedy = {**GREEDY, "max_tokens": 4}
    bad = [(BAD[case][0]["text_input"], greedy, BAD[case][1]) for case in ("non_utf8_text_input", "prompt_too_long")]
    bad += [("Hi", BAD[case][0]["sampling_parameters"], BAD[case][1])
            for case in ("invalid_json", "unknown_key", "wrong_type", "out_of_range")]
    good = [(PROMPTS[1], 5), (PROMPTS[2], 7)]
    triton_server = strict_server
    before = batch_counts(model_stats(triton_server, "llm_static"))
    calls = [lambda p=p, sp=sp: grpc_infer(triton_server, "llm_static", text_input=p, sampling_parameters=sp)
             for p, sp, _ in bad]
    calls += [lambda p=p, n=n: grpc_infer(triton_server, "llm_static", text_input=p,
                                          sampling_parameters={**GREEDY, "max_tokens": n}) for p, n in good]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        for (_, _, expected), future in zip(bad, futures):
            with pytest.raises(InferenceServerException) as err:
                future.result(timeout=TIMEOUT)
            assert expected in str(err.value)
        for (prompt, n), future in zip(good, futures[len(bad):]):
            assert text_of(future.result(timeout=TIMEOUT)) == prompt + reference(prompt, n)
    grown = wait_for_batches(triton_server, "llm_static", before, lambda g: g)
    assert grown == {STATIC_BATCH: 1}, f"the 8 requests did not make one full batch: {grown}"


# ---------------------------------------------------------------- seeded sampling


def test_seeded_sampling_is_reproducible_alone_and_under_load(triton_server, strict_server):
    prompt = PROMPTS[2]
    alone = stream_one(triton_server, text_input=prompt, exclude_input_in_output=True, sampling_parameters=SEEDED).text
    assert alone
    other_seed = stream_one(triton_server, text_input=prompt, exclude_input_in_output=True,
                            sampling_parameters={**SEEDED, "seed": 124}).text
    assert other_seed != alone, "the seed does not change the sample"

    stream = GrpcStream(triton_server)
    busy = [f"busy{i}" for i in range(3)]
    try:
        for i, rid in enumerate(busy):  # sampled neighbours, unseeded and seeded otherwise, held after 400 tokens
            stream.send(rid, text_input=hold_prompt(400, PROMPTS[i]), stream=True,
                        sampling_parameters={"temperature": 1.0, "max_tokens": 1000, "ignore_eos": True,
                                             **({"seed": i} if i else {})})
        stream.wait_first_piece(busy)
        stream.send("seeded", text_input=prompt, exclude_input_in_output=True, sampling_parameters=SEEDED)
        stream.wait(["seeded"])
        assert not stream.errors, stream.errors
        assert not any(stream.results[rid].finals for rid in busy), "a held neighbour ended by itself"
    finally:
        stream.close(cancel=True)
    assert stream.results["seeded"].text == alone

    # The batching models sample with the same engine: the same text, alone or in a batch of 8
    # (the same set of inputs in every request, else Triton does not batch them together).
    assert text_of(grpc_infer(triton_server, "llm_dynamic", text_input=prompt, exclude_input_in_output=True,
                              sampling_parameters=SEEDED)) == alone
    triton_server = strict_server
    neighbours = [lambda i=i: grpc_infer(triton_server, "llm_static", text_input=PROMPTS[i],
                                         exclude_input_in_output=True,
                                         sampling_parameters={"temperature": 1.0, "max_tokens": 24 + i})
                  for i in range(STATIC_BATCH - 1)]
    seeded = lambda: grpc_infer(triton_server, "llm_static", text_input=prompt,  # noqa: E731
                                exclude_input_in_output=True, sampling_parameters=SEEDED)
    before = batch_counts(model_stats(triton_server, "llm_static"))
    assert text_of(concurrently([seeded, *neighbours])[0]) == alone
    grown = wait_for_batches(triton_server, "llm_static", before, lambda g: g)
    assert grown == {STATIC_BATCH: 1}, f"the seeded request was not in a batch of 8: {grown}"


# ---------------------------------------------------------------- optional outputs, TensorRT-LLM inputs


def test_inflight_optional_outputs_and_trtllm_scalars(triton_server, tiny_model):
    prompt, n = PROMPTS[1], 6
    num_prompt = len(tiny_model[1].encode(prompt))
    asks = dict(return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True)
    # max_tokens and temperature as TensorRT-LLM scalar tensors (INT32 / FP32 [1]).
    whole = stream_one(triton_server, text_input=prompt, max_tokens=n, temperature=0.0, exclude_input_in_output=True,
                       sampling_parameters={"ignore_eos": True}, **asks)
    (result,) = whole.results
    assert scalar(result, "finish_reason") == "length"
    assert scalar(result, "num_input_tokens") == num_prompt
    assert scalar(result, "num_output_tokens") == n
    streamed = stream_one(triton_server, text_input=prompt, max_tokens=n, temperature=0.0, stream=True,
                          sampling_parameters={"ignore_eos": True}, **asks)
    assert streamed.text == whole.text
    # Streaming: each response counts its own new tokens (vLLM backend rule); the last one says why it ended.
    assert sum(scalar(r, "num_output_tokens") for r in streamed.results) == n
    assert scalar(streamed.results[-1], "finish_reason") == "length"
    assert all(scalar(r, "num_input_tokens") == num_prompt for r in streamed.results)
    # Not asked: not sent.
    plain = stream_one(triton_server, text_input=prompt, max_tokens=n)
    assert all(plain.results[0].as_numpy(name) is None
               for name in ("finish_reason", "num_input_tokens", "num_output_tokens"))
    # A sampling_parameters key wins over the same TensorRT-LLM scalar.
    both = stream_one(triton_server, text_input=prompt, max_tokens=2, temperature=0.0, return_num_output_tokens=True,
                      sampling_parameters={"max_tokens": 4, "ignore_eos": True})
    assert scalar(both.results[0], "num_output_tokens") == 4
    # random_seed is UINT64 [1], as the TensorRT-LLM ensemble declares it; it means vLLM's seed.
    trt_seeded = stream_one(triton_server, text_input=PROMPTS[2], exclude_input_in_output=True, max_tokens=16,
                            temperature=0.8, random_seed=np.array([123], dtype=np.uint64))
    assert trt_seeded.text == stream_one(triton_server, text_input=PROMPTS[2], exclude_input_in_output=True,
                                         sampling_parameters=SEEDED).text


def test_batched_optional_outputs_and_trtllm_scalars(triton_server, tiny_model):
    prompt, n = PROMPTS[3], 5
    num_prompt = len(tiny_model[1].encode(prompt))
    result = grpc_infer(triton_server, "llm_dynamic", text_input=prompt, max_tokens=n, temperature=0.0,
                        sampling_parameters={"ignore_eos": True}, exclude_input_in_output=True,
                        return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True)
    assert result.as_numpy("text_output").shape == (1, 1)
    assert scalar(result, "finish_reason") == "length"
    assert scalar(result, "num_input_tokens") == num_prompt
    assert scalar(result, "num_output_tokens") == n
    plain = http_infer(triton_server, "llm_dynamic", text_input=prompt, max_tokens=n)
    assert plain.as_numpy("finish_reason") is None and plain.as_numpy("num_output_tokens") is None
    # HTTP generate: the same flags as JSON keys.
    body = generate(triton_server, "llm_dynamic", text_input=prompt, max_tokens=n, temperature=0,
                    sampling_parameters=json.dumps({"ignore_eos": True}), exclude_input_in_output=True,
                    return_finish_reason=True, return_num_output_tokens=True).json()
    assert body.get("finish_reason") == "length" and body.get("num_output_tokens") == n, body
    assert body["text_output"] == text_of(result)


# ---------------------------------------------------------------- bounded waiting queue

def test_a_full_waiting_queue_answers_unavailable_and_recovers(strict_server):
    """One slot, room for one waiting request: a third concurrent request is refused, not queued."""
    server = strict_server
    long = {"text_input": hold_prompt(10, "Hi"), "stream": True,
            "sampling_parameters": {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}}
    stream = GrpcStream(server)
    try:
        stream.send("running", **long)
        stream.wait_first_piece(["running"])
        stream.send("waiting", **long)
        assert wait_for_metric(server, "tritonllm_num_requests_waiting", lambda v: v == 1) == 1, \
            "the second request never waited"
        stream.send("refused", **long)
        with stream.changed:
            assert stream.changed.wait_for(lambda: stream.errors, TIMEOUT)
        assert "queue is full" in stream.errors[0]
        assert not stream.results["running"].finals and not stream.results["waiting"].finals
    finally:
        stream.close(cancel=True)
    # The refused request left nothing behind; after the cancel the model serves again.
    assert wait_for_metric(server, "tritonllm_num_requests_running", lambda v: v == 0) == 0
    assert wait_for_metric(server, "tritonllm_num_requests_waiting", lambda v: v == 0) == 0
    res = stream_one(server, text_input="Hi", sampling_parameters={"max_tokens": 3, "temperature": 0})
    assert res.finals == 1


def test_every_model_reports_the_dtype_it_runs(triton_server):
    """dtype `auto` resolves in each model; the banner and the report read what the models export."""
    from tritonllm.server.tritonserver import model_runs

    assert model_runs(triton_server.metrics_url) == {m: "float32 on cpu" for m in ("llm_inflight", *BATCHED)}


def test_every_scheme_counts_tokens_and_slot_steps(triton_server):
    """The waste and occupancy counters, the same for all three models: a lone 5-token request is its
    prompt's rows and 4 decode rows, 5 tokens, in 5 forwards of one sequence, each allowing a cap's
    worth (llm_inflight: max_num_seqs; the batchers: 8)."""
    names = ("generation_tokens", "prompt_tokens", "rows_computed", "padding_rows", "sequence_rows", "slot_steps")
    for model in ("llm_inflight", *BATCHED):
        slots = int(metric(triton_server, "tritonllm_num_slots", "llm_inflight")) if model == "llm_inflight" else 8
        before = {n: metric(triton_server, f"tritonllm_{n}_total", model) for n in names}
        scheduled0 = metric(triton_server, "tritonllm_requests_scheduled_total", model)
        queued0 = metric(triton_server, "tritonllm_request_queue_seconds_total", model)
        response = generate(triton_server, model, text_input="Hi there", max_tokens=5, ignore_eos=True,
                            return_num_input_tokens=True)
        assert response.status_code == 200, response.text
        prompt = response.json()["num_input_tokens"]
        wait_for_metric(triton_server, "tritonllm_slot_steps_total", lambda v: v >= before["slot_steps"] + 5 * slots,
                        model=model)
        got = {n: metric(triton_server, f"tritonllm_{n}_total", model) - before[n] for n in names}
        assert got == {"generation_tokens": 5, "prompt_tokens": prompt, "rows_computed": prompt + 4,
                       "padding_rows": 0, "sequence_rows": 5, "slot_steps": 5 * slots}, model
        # and its wait before its first forward: one request, a wait that is counted and short (nothing queued)
        scheduled = wait_for_metric(triton_server, "tritonllm_requests_scheduled_total",
                                    lambda v: v >= scheduled0 + 1, model=model)
        queued = wait_for_metric(triton_server, "tritonllm_request_queue_seconds_total", lambda v: v > queued0,
                                 model=model)
        assert scheduled - scheduled0 == 1 and 0 < queued - queued0 < 5, model


# ---------------------------------------------------------------- metric names others read


def _series(metrics_text: str, model: str) -> dict[str, float]:
    """name{labels other than the model's} -> value, for one model's series of a /metrics page."""
    series = {}
    for name, labels, value in re.findall(r"^([a-zA-Z0-9_:]+)\{([^}]*)\} (\S+)$", metrics_text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.pop("model", None) == model or pairs.pop("model_name", None) == model:
            rest = ",".join(f"{k}={v}" for k, v in sorted(pairs.items()))
            series[f"{name}{{{rest}}}"] = float(value)
    return series


def test_engine_metrics_are_also_exported_under_vllm_names(triton_server):
    """Every value in VLLM_NAMES under both names, equal, once a request has finished (histograms
    compared by count and sum; vLLM's labels: model_name, finished_reason)."""
    stream_one(triton_server, text_input=PROMPTS[0], sampling_parameters={**GREEDY, "max_tokens": 3})
    deadline = time.monotonic() + SETTLE
    while True:
        series = _series(requests.get(triton_server.metrics_url, timeout=10).text, "llm_inflight")
        pairs = {}
        for ours, theirs in VLLM_NAMES.items():
            for key, value in series.items():
                if key.startswith((ours + "{", ours + "_count{", ours + "_sum{")):
                    twin = theirs + key[len(ours):].replace("finish_reason=", "finished_reason=")
                    pairs[key] = (value, series.get(twin))
        named = {key.split("{")[0].removesuffix("_count").removesuffix("_sum") for key in pairs}
        if (named == set(VLLM_NAMES) and all(a == b for a, b in pairs.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert named == set(VLLM_NAMES), f"not exported: {set(VLLM_NAMES) - named}"
    assert all(a == b for a, b in pairs.values()), {k: v for k, v in pairs.items() if v[0] != v[1]}
    assert series["vllm:request_success_total{finished_reason=length}"] >= 1


def test_a_batching_model_counts_the_requests_of_its_running_batch(triton_server):
    """llm_dynamic's tritonllm_num_requests_open is its running batch's size, 0 once it answered: load
    tools wait for 0 on every model before a run (a request whose client gave up still runs)."""
    model = "llm_dynamic"
    assert wait_for_metric(triton_server, "tritonllm_num_requests_open", lambda v: v == 0, model=model) == 0
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, triton_server, model, text_input="Hi", max_tokens=1800, ignore_eos=True)
        seen = wait_for_metric(triton_server, "tritonllm_num_requests_open", lambda v: v >= 1 or answer.done(),
                               model=model)
        assert answer.result().status_code == 200, answer.result().text
    assert seen == 1
    assert metric(triton_server, "tritonllm_num_requests_open", model) == 0
