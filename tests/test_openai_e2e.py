"""The OpenAI front (`tritonllm-openai`) in front of the suite's real tritonserver, through the pinned
`openai` SDK and through the exact payloads of `vllm bench serve`, aiperf and guidellm.

Every route, every model, streamed and not: greedy answers equal in-process `generate`, streamed
text equals the non-streamed text, the usage of a stream equals the usage of the same call
unstreamed, bad fields answer in OpenAI's error shape while the server serves on, and a client
that goes away frees its slot (the engine's open gauge back to 0). `llm_static` dispatches full
batches of 8 (or waits 5 s), so each model's calls go out together.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from e2e_clients import SETTLE, TIMEOUT, started_front, wait_for_metric

from tritonllm.engine.faults import hold_prompt
from tritonllm.server.openai_front import OpenAIFront
from tritonllm.server.tritonserver import find_free_ports

MODELS = ("llm_inflight", "llm_dynamic", "llm_static")
PROMPT = "The capital of France is"
OTHER = "Once upon a time, in a land far away, there lived a"
N = 10  # output tokens (ignore_eos: exactly this many)
GREEDY = {"temperature": 0, "max_tokens": N}
FORCED = {"ignore_eos": True}


@pytest.fixture(scope="module")
def front(triton_server, tmp_path_factory):
    front = started_front(triton_server, tmp_path_factory.mktemp("openai"), "tiny")
    yield front
    front.stop()


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model[1]


def chat_prompt(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def together(*calls):
    """Run the calls at once (llm_static batches them), return their results in order."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result(timeout=TIMEOUT * 2) for f in [pool.submit(c) for c in calls]]


def collect(stream):
    """Every chunk of an SDK stream, in order."""
    return list(stream)


def sse_events(response) -> list:
    """The `data:` payloads of an SSE response, `[DONE]` included as the string."""
    events = []
    for line in response.iter_lines(chunk_size=None):
        if line.startswith(b"data: "):
            data = line[len(b"data: "):]
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
        else:
            assert line == b"", f"not SSE framing: {line!r}"
    return events


# ---------------------------------------------------------------- models and health


def test_models_list_every_ready_model_with_vllm_fields(client, front):
    models = client.models.list().data
    assert [m.id for m in models] == list(MODELS)
    for model in models:
        card = model.model_dump()
        assert card["object"] == "model" and card["owned_by"] == "tritonllm" and card["created"] > 0
        assert card["max_model_len"] == 2048 and card["root"].endswith("tiny-random-llama")
    assert client.models.retrieve("llm_dynamic").id == "llm_dynamic"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and "llm_inflight" in info.value.body["message"]
    assert requests.get(f"{front.root}/health", timeout=10).status_code == 200
    ready = requests.get(f"{front.root}/health/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["models"] == {m: "ready" for m in MODELS}


# ---------------------------------------------------------------- every model, streamed and not


@pytest.mark.parametrize("model", MODELS)
def test_every_model_answers_alike_streamed_or_not(client, model, reference, tokenizer):
    """Eight requests at once (one full batch for llm_static): completions and chat, streamed and
    not, a list of prompts and a prompt of token ids."""
    body = dict(model=model, **GREEDY, extra_body=FORCED)
    chat = [{"role": "user", "content": PROMPT}]
    usage_opts = {"include_usage": True}
    (text, text_stream, reply, reply_stream, pair, ids_stream, _other) = together(
        lambda: client.completions.create(prompt=PROMPT, **body),
        lambda: collect(client.completions.create(prompt=PROMPT, stream=True, stream_options=usage_opts, **body)),
        lambda: client.chat.completions.create(messages=chat, **body),
        lambda: collect(client.chat.completions.create(messages=chat, stream=True, stream_options=usage_opts,
                                                       **body)),
        lambda: client.completions.create(prompt=[PROMPT, OTHER], **body),
        lambda: collect(client.completions.create(prompt=tokenizer.encode(PROMPT), stream=True,
                                                  stream_options=usage_opts, **body)),
        # one more: 8 upstream requests, so that llm_static has its batch at once
        lambda: client.completions.create(prompt=OTHER, **body),
    )
    # completions: the model's greedy answer, exact counts, why it ended
    assert text.choices[0].text == reference(PROMPT, N)
    assert text.choices[0].finish_reason == "length"
    assert text.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and text.usage.completion_tokens == N
    assert text.usage.total_tokens == text.usage.prompt_tokens + N
    # the stream: the same text, a usage chunk last (choices: []) equal to the unstreamed usage
    *chunks, last = text_stream
    assert last.choices == [] and last.usage == text.usage
    assert all(c.choices and c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == text.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    if model == "llm_inflight":  # one chunk per engine step, not the whole text at once
        assert len([c for c in chunks if c.choices[0].text]) > 1
    else:
        assert len(chunks) == 1  # the batching models answer when their batch ends
    # chat: the model's own chat template, the same answer streamed, the role with the first text
    templated = chat_prompt(tokenizer, PROMPT)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == reference(templated, N)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(templated)) and reply.usage.completion_tokens == N
    *deltas, last = reply_stream
    assert last.choices == [] and last.usage == reply.usage
    assert deltas[0].choices[0].delta.role == "assistant" and deltas[0].choices[0].delta.content
    assert all(d.choices[0].delta.role is None for d in deltas[1:])
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == reply.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == "length"
    # a list of prompts: one choice each, in order; usage sums them
    assert [c.index for c in pair.choices] == [0, 1]
    assert [c.text for c in pair.choices] == [reference(PROMPT, N), reference(OTHER, N)]
    assert pair.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(tokenizer.encode(OTHER))
    assert pair.usage.completion_tokens == 2 * N
    # token ids: the same prompt, the same answer
    assert "".join(c.choices[0].text for c in ids_stream[:-1]) == text.choices[0].text
    assert ids_stream[-1].usage == text.usage


# ---------------------------------------------------------------- fields


def test_n_seed_stop_echo_and_max_completion_tokens(client, reference, tokenizer):
    model = "llm_inflight"
    seeded = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3, extra_body=FORCED)
    first, again = together(lambda: client.completions.create(**seeded), lambda: client.completions.create(**seeded))
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]  # seeded: the same again
    assert len(set(texts)) > 1  # each choice its own seed (seed + i)
    # usage: the prompt counted once (not per choice), every choice's tokens
    assert first.usage.completion_tokens == 36 and first.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    # stop: the answer ends before the stop string, and says so
    full = reference(PROMPT, 16)
    stop = full.split()[2]
    stopped = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=16, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and full.startswith(stopped.choices[0].text)
    # echo: the prompt before the answer
    echoed = client.completions.create(model=model, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + reference(PROMPT, N)
    # chat's max_completion_tokens wins over max_tokens
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_completion_tokens=3, max_tokens=9, extra_body=FORCED)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_unknown_fields_are_ignored_and_logged_once(client, front):
    for _ in range(2):
        reply = client.completions.create(model="llm_inflight", prompt=PROMPT, **GREEDY,
                                          extra_body={"a_field_from_the_future": {"x": 1}, "priority": 0})
        assert reply.choices[0].text
    log = front.read_log()
    assert log.count("ignoring unknown field 'a_field_from_the_future'") == 1, log[-2000:]


BAD = [  # (route, body, status, param, words in the message)
    ("completions", b"{not json", 400, None, "not valid JSON"),
    ("completions", {"model": "llm_inflight"}, 400, "prompt", "prompt is required"),
    ("completions", {"model": "llm_inflight", "prompt": [{"text": "x"}]}, 400, "prompt", "prompt must be"),
    ("completions", {"model": "llm_inflight", "prompt": [99999999]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "top_p": 2}, 400, "top_p", "(0, 1]"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "logprobs": 25}, 400, "logprobs", "[0, 20]"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "min_p": 0.2}, 400, "min_p", "min_p"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "n": 0}, 400, "n", "n must be"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "stop": [1]}, 400, "stop", "stop"),
    ("completions", {"model": "llm_inflight", "prompt": "x", "max_tokens": 4000}, 400, None, "max_model_len"),
    ("completions", {"model": "llm_dynamic", "prompt": "x", "max_tokens": 4000}, 400, None, "max_model_len"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("chat/completions", {"model": "llm_inflight"}, 400, "messages", "required"),
    ("chat/completions", {"model": "llm_inflight", "messages": []}, 400, "messages", "at least one"),
    ("chat/completions", {"model": "llm_inflight", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages", "only text parts"),
    ("chat/completions", {"model": "llm_inflight", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "auto"),
    ("chat/completions", {"model": "llm_inflight", "messages": [{"role": "user", "content": "x"}],
                          "top_logprobs": 3}, 400, "top_logprobs", "logprobs: true"),
    ("chat/completions", {"model": "llm_inflight", "messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "yaml"}}, 400, "response_format", "json_schema"),
    ("chat/completions", {"model": "llm_inflight", "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 5000, "stream": True}, 400, None, "max_model_len"),
]


def test_every_bad_field_answers_in_openai_error_shape_and_the_server_serves_on(front, client):
    for route, body, status, param, words in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = requests.post(f"{front.url}/{route}", data=data, headers={"Content-Type": "application/json"},
                                 timeout=TIMEOUT)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] == param and words in error["message"], (body, error)
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    # the SDK raises OpenAI's typed errors from them
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="llm_inflight", prompt="x", max_tokens=0)
    missing = requests.get(f"{front.url}/no/such/route", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    # and the server is still serving
    assert requests.get(f"{front.root}/health/ready", timeout=10).status_code == 200
    assert client.completions.create(model="llm_inflight", prompt=PROMPT, **GREEDY).choices[0].text


# ---------------------------------------------------------------- streams end, clients that leave


def test_sse_framing_ends_with_done(front):
    with requests.post(f"{front.url}/completions", json={"model": "llm_inflight", "prompt": PROMPT, "stream": True,
                                                         **GREEDY}, stream=True, timeout=TIMEOUT) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert all(isinstance(e, dict) and e["object"] == "text_completion" for e in events[:-1])
    assert "usage" not in events[-2]  # only when stream_options.include_usage asks


def _open_gauge(triton_server) -> float:
    return wait_for_metric(triton_server, "tritonllm_num_requests_open", lambda v: v == 0)


def test_a_client_that_disconnects_cancels_its_request_upstream(front, triton_server):
    """Streamed (after its first chunk) and unstreamed (while the model holds it): the connection
    closes, the front cancels upstream, the engine's open gauge goes back to 0."""
    assert _open_gauge(triton_server) == 0
    host, port = front.root.removeprefix("http://").split(":")
    for stream in (True, False):
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        body = {"model": "llm_inflight", "prompt": hold_prompt(2, PROMPT), "max_tokens": 50, "stream": stream}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        if stream:
            response = conn.getresponse()
            assert response.status == 200
            assert response.read(6) == b"data: "  # the first chunk came (read through the chunked encoding)
        held = wait_for_metric(triton_server, "tritonllm_num_requests_open", lambda v: v >= 1)
        assert held == 1, "the held request is not open in the engine"
        conn.sock.shutdown(2)
        conn.close()
        assert wait_for_metric(triton_server, "tritonllm_num_requests_open", lambda v: v == 0) == 0, \
            f"stream={stream}: the request was not cancelled upstream"
    text = requests.get(f"{front.root}/metrics", timeout=10).text
    assert 'tritonllm_openai_requests_cancelled_total{endpoint="completions",model="llm_inflight"} 2' in text


def test_256_concurrent_streams(front):
    """The front holds 256 streams at once (llm_inflight queues what its 8 slots cannot run):
    every one ends with [DONE] and the exact token count."""
    import aiohttp

    async def one(session, i):
        body = {"model": "llm_inflight", "prompt": f"{i} {PROMPT}", "max_tokens": 3, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{front.url}/completions", json=body) as response:
            assert response.status == 200, await response.text()
            lines = [line async for line in response.content if line.startswith(b"data: ")]
        assert lines[-1] == b"data: [DONE]\n"
        return json.loads(lines[-2][len(b"data: "):])["usage"]["completion_tokens"]

    async def run():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(256)))

    t0 = time.monotonic()
    counts = asyncio.run(run())
    assert counts == [3] * 256
    print(f"256 concurrent streams answered in {time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------- what the benchmark clients send


def vllm_completions(model, prompt, n):
    """`vllm bench serve --backend openai` (benchmarks/lib/endpoint_request_func.py), random data: ignore_eos."""
    return "completions", {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": n,
                           "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                           "ignore_eos": True}


def vllm_chat(model, prompt, n):
    """`vllm bench serve --backend openai-chat`: text parts, max_completion_tokens."""
    return "chat/completions", {"model": model, "messages": [{"role": "user", "content": [
        {"type": "text", "text": prompt}]}], "temperature": 0.0, "max_completion_tokens": n, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}


def aiperf_completions(model, prompt, n):
    """aiperf `--endpoint-type completions --streaming` (endpoints/openai_completions.py): prompt as a list."""
    return "completions", {"prompt": [prompt], "model": model, "stream": True, "max_tokens": n,
                           "stream_options": {"include_usage": True}, "ignore_eos": True}


def aiperf_chat(model, prompt, n):
    """aiperf `--endpoint-type chat --streaming` (endpoints/openai_chat.py)."""
    return "chat/completions", {"messages": [{"role": "user", "name": "text", "content": prompt}], "model": model,
                                "stream": True, "max_completion_tokens": n, "stream_options": {"include_usage": True},
                                "ignore_eos": True}


def guidellm_completions(model, prompt, n):
    """guidellm's OpenAI backend (backends/openai/): stream_options with continuous usage, ignore_eos."""
    return "completions", {"prompt": prompt, "model": model, "stream": True, "max_tokens": n,
                           "max_completion_tokens": n, "stop": None, "ignore_eos": True,
                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def guidellm_chat(model, prompt, n):
    return "chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                "model": model, "stream": True, "max_tokens": n, "max_completion_tokens": n,
                                "stop": None, "ignore_eos": True,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


PROBES = [vllm_completions, vllm_chat, aiperf_completions, aiperf_chat, guidellm_completions, guidellm_chat]


def run_probe(front, probe, model: str, n: int):
    """Send a client's payload and read the answer as that client does: TTFT at the first SSE message
    with non-empty choices and content, output tokens from usage.completion_tokens."""
    route, body = probe(model, PROMPT, n)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer EMPTY"}
    t0 = time.monotonic()
    ttft, text, output_tokens, saw_done = None, "", None, False
    with requests.post(f"{front.url}/{route}", json=body, headers=headers, stream=True, timeout=TIMEOUT) as response:
        assert response.status_code == 200, (probe.__name__, response.text)
        for event in sse_events(response):
            if event == "[DONE]":
                saw_done = True
                continue
            if choices := event.get("choices"):
                piece = choices[0]["text"] if route == "completions" else choices[0]["delta"].get("content")
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text += piece or ""
            elif usage := event.get("usage"):
                output_tokens = usage["completion_tokens"]
    return ttft, text, output_tokens, saw_done


def test_benchmark_clients_payloads_run_unchanged_on_every_model(front):
    """The exact requests of vllm bench serve, aiperf and guidellm (DESIGN section 10), on all three
    models at once, read as those clients read them: 0 failures, counts as asked."""
    assert requests.get(f"{front.root}/health", timeout=10).status_code == 200  # guidellm checks it first
    root = requests.get(f"{front.url}/models", timeout=10).json()["data"][0]["root"]  # vllm bench without --model
    assert root
    jobs = [(probe, model) for model in MODELS for probe in PROBES]
    jobs += [(vllm_completions, "llm_static"), (aiperf_chat, "llm_static")]  # llm_static's batch of 8 at once
    results = together(*[lambda p=p, m=m: run_probe(front, p, m, 6) for p, m in jobs])
    for (probe, model), (ttft, text, output_tokens, saw_done) in zip(jobs, results):
        assert saw_done and ttft is not None and text, (probe.__name__, model)
        assert output_tokens == 6, (probe.__name__, model, output_tokens)


def test_guidellm_continuous_usage_counts_grow_to_the_total(front):
    route, body = guidellm_completions("llm_inflight", PROMPT, 5)
    with requests.post(f"{front.url}/{route}", json=body, stream=True, timeout=TIMEOUT) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) > 2
    assert events[-1]["choices"] == []


# ---------------------------------------------------------------- tokenize, metrics


def test_tokenize_and_detokenize(front, tokenizer):
    ids = tokenizer.encode(PROMPT)
    answer = requests.post(f"{front.root}/tokenize", json={"model": "llm_inflight", "prompt": PROMPT}, timeout=10)
    assert answer.status_code == 200 and answer.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    messages = [{"role": "user", "content": PROMPT}]
    chat = requests.post(f"{front.root}/tokenize", json={"messages": messages}, timeout=10).json()
    assert chat["tokens"] == tokenizer.encode(chat_prompt(tokenizer, PROMPT), add_special_tokens=False)
    back = requests.post(f"{front.root}/detokenize", json={"model": "llm_inflight", "tokens": ids}, timeout=10)
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    bad = requests.post(f"{front.root}/detokenize", json={"tokens": [10**9]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_front_metrics_count_requests_errors_and_latency(front, client):
    client.completions.create(model="llm_inflight", prompt=PROMPT, **GREEDY)
    requests.post(f"{front.url}/completions", json={"model": "llm_inflight", "prompt": "x", "top_p": 9}, timeout=10)
    text = requests.get(f"{front.root}/metrics", timeout=10).text

    def value(line_start: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(line_start)]
        assert lines, f"{line_start} not in /metrics"
        return float(lines[0].rsplit(" ", 1)[1])

    assert value('tritonllm_openai_requests_total{endpoint="completions",model="llm_inflight",status="200"}') >= 1
    assert value('tritonllm_openai_requests_total{endpoint="completions",model="llm_inflight",status="400"}') >= 1
    assert value('tritonllm_openai_request_errors_total{endpoint="completions",model="llm_inflight",'
                 'type="invalid_request_error"}') >= 1
    assert value('tritonllm_openai_request_duration_seconds_count{endpoint="completions",model="llm_inflight"}') >= 1
    assert value('tritonllm_openai_completion_tokens_total{model="llm_inflight"}') >= N
    assert value('tritonllm_openai_requests_running{model="llm_inflight"}') == 0


# ---------------------------------------------------------------- behind the nginx template


def test_behind_nginx_openai_routes_go_to_the_front_and_streams_pass_as_they_come(front, triton_server, tmp_path):
    """deploy/nginx/tritonllm.conf.template: /v1 and the front's health go to the front, /v2 to Triton,
    on one listener; the SDK streams through it with the same answer as directly."""
    from types import SimpleNamespace

    from nginx_proxy import NginxProxy

    replica = SimpleNamespace(http_url=triton_server.http_url, grpc_url=triton_server.grpc_url,
                              openai_url=front.root.removeprefix("http://"))
    proxy = NginxProxy(tmp_path / "nginx", [replica]).start()
    try:
        base = f"http://{proxy.http_url}"
        assert requests.get(f"{base}/health", timeout=10).status_code == 200
        assert requests.get(f"{base}/v2/health/ready", timeout=10).status_code == 200  # Triton's, beside it
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as via:
            chunks = list(via.completions.create(model="llm_inflight", prompt=PROMPT, stream=True, **GREEDY,
                                                 extra_body=FORCED))
            direct = via.completions.create(model="llm_inflight", prompt=PROMPT, **GREEDY, extra_body=FORCED)
        assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks) == direct.choices[0].text
        assert any("/v1/completions" in request for _, _, request in proxy.access_log())
    finally:
        proxy.stop()


# ---------------------------------------------------------------- the main job through the front


def test_compare_via_openai_runs_every_scheme_through_a_front_it_starts(triton_server, tmp_path):
    """`tritonllm-compare --via openai`: no front at --front-url, so it starts one against the Triton,
    runs each scheme with the OpenAI user (model llm_<scheme>), and stops the front at the end."""
    import os
    import subprocess
    import sys

    from tritonllm_loadtest.samples import load_samples

    out = tmp_path / "results"
    (free,) = find_free_ports(1)
    cmd = [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never", "--via", "openai",
           "--front-url", f"127.0.0.1:{free}", "--url", triton_server.http_url, "--grpc-url", triton_server.grpc_url,
           "--metrics-url", triton_server.metrics_url, "--schemes", "inflight,dynamic", "--max-requests", "8",
           "--run-time", "60", "--output-tokens", "exp:6:24", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TRITONLLM_MODEL": "tiny"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting the OpenAI front" in proc.stdout and "stopping the OpenAI front" in proc.stdout
    text = (out / "report.md").read_text()
    assert "| inflight-c8 | inflight | openai-sse |" in text and "| dynamic-c8 | dynamic | openai-sse |" in text
    assert "through the OpenAI front" in text
    runs = {r["scheme"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert all(r["finished"] == 8 and r["errors"] == 0 for r in runs.values()), runs
    assert runs["inflight"]["waste"] is not None  # Triton's metrics still scraped per model
    indexes = {s: sorted((x.index, x.expected_tokens, x.output_tokens) for x in load_samples(out / "runs" / f"{s}-c8"))
               for s in runs}
    assert indexes["inflight"] == indexes["dynamic"]  # the same requests, the exact token counts
    assert all(expected == got for _, expected, got in indexes["inflight"])
    log = (out / "openai.log").read_text()
    assert "Application startup complete" in log and "Shutting down" in log


def test_without_triton_the_front_says_so_and_serves_on(tmp_path):
    """A front whose Triton does not answer: health 503, requests 503 in OpenAI's shape, not a hang."""
    grpc_port, port = find_free_ports(2)  # nothing listens on grpc_port
    lonely = OpenAIFront(f"127.0.0.1:{grpc_port}", port=port, tokenizer="tiny", log_file=tmp_path / "openai.log")
    lonely.start(ready=False)
    try:
        assert requests.get(f"{lonely.root}/health", timeout=10).status_code == 503
        ready = requests.get(f"{lonely.root}/health/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["triton"] == "not ready"
        for route, body in (("completions", {"model": "llm_inflight", "prompt": "x"}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})):
            answer = requests.post(f"{lonely.url}/{route}", json=body, timeout=30)
            assert answer.status_code == 503 and "does not answer" in answer.json()["error"]["message"], answer.text
        assert requests.get(f"{lonely.url}/models", timeout=10).json() == {"object": "list", "data": []}
    finally:
        lonely.stop()
