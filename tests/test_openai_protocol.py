"""The OpenAI front's translation, without a server: request bodies, sampling fields, prompt forms,
the status of each upstream failure, the stream chunks and the metrics text."""

from __future__ import annotations

import json

import pytest

from tritonllm.openai.errors import OpenAIError, from_upstream, upstream_status
from tritonllm.openai.generation import Choice, usage
from tritonllm.openai.metrics import FrontMetrics
from tritonllm.openai.prompts import PromptTokenizer
from tritonllm.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body, unknown_fields
from tritonllm.openai.responses import ChunkWriter
from tritonllm.openai.sampling import for_choice, sampling_parameters


@pytest.fixture(scope="module")
def tokenizer():
    return PromptTokenizer.load("tiny")


def completion(**body) -> CompletionRequest:
    return parse_body(json.dumps(body).encode(), CompletionRequest)


def test_unknown_fields_are_kept_aside_and_logged_once(caplog):
    req = completion(prompt="hi", max_tokens="8", some_future_field=1, another={"x": 1})
    assert req.max_tokens == 8  # "8" coerced, as vLLM's server does
    with caplog.at_level("WARNING"):
        assert unknown_fields("/test", req) == ["another", "some_future_field"]
        assert unknown_fields("/test", req) == ["another", "some_future_field"]
    assert sum("some_future_field" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("raw, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens", "max_tokens"),
    (b'{"prompt": "x", "n": 1.5}', "n", "n"),
    (b'{"prompt": "x", "stream": "maybe"}', "stream", "stream"),
    (b'{"prompt": "x", "stop": [1, 2]}', "stop", "stop"),
])
def test_bad_bodies_are_400_naming_the_field(raw, param, words):
    with pytest.raises(OpenAIError) as info:
        parse_body(raw, CompletionRequest)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_messages_are_required_and_typed():
    with pytest.raises(OpenAIError) as info:
        parse_body(b'{"model": "m"}', ChatCompletionRequest)
    assert info.value.param == "messages" and "required" in info.value.message.lower()


def test_sampling_fields_use_the_models_checks_and_names():
    values = sampling_parameters(completion(prompt="x", temperature=0, top_k=5, ignore_eos=True, stop="\n",
                                            repetition_penalty=1.1, seed=7), 12)
    assert values == {"max_tokens": 12, "temperature": 0.0, "top_k": 5, "ignore_eos": True, "stop": "\n",
                      "repetition_penalty": 1.1, "seed": 7}
    assert for_choice(values, 0)["seed"] == 7 and for_choice(values, 2)["seed"] == 9
    assert "seed" not in for_choice({"max_tokens": 1}, 3)
    for body, param in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"min_p": 0.1}, "min_p"),
                        ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"), ({"best_of": 4}, "best_of"),
                        ({"presence_penalty": 3}, "presence_penalty"), ({"min_tokens": 50}, "min_tokens"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex")]:
        with pytest.raises(OpenAIError) as info:
            sampling_parameters(completion(prompt="x", **body), 16)
        assert info.value.status == 400 and info.value.param == param, (body, info.value.message)
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}).encode(),
                      ChatCompletionRequest)
    with pytest.raises(OpenAIError) as info:
        sampling_parameters(chat, 0)
    assert info.value.param == "max_completion_tokens"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
                         ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
                         ({"tools": [tool]}, "tool_choice"), ({"tools": [tool], "tool_choice": "auto"}, "tool_choice"),
                         ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice")):
        chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], **extra}).encode(),
                          ChatCompletionRequest)
        with pytest.raises(OpenAIError) as info:
            sampling_parameters(chat, 4)
        assert info.value.status == 400 and info.value.param == param, (extra, info.value.message)
    # What the front turns into the models' keys: logprobs (and the prompt's under echo), specs, tools.
    assert sampling_parameters(completion(prompt="x", logprobs=2, echo=True), 4) == {
        "max_tokens": 4, "logprobs": 2, "prompt_logprobs": 2}
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3,
                                  "response_format": {"type": "json_object"}}).encode(), ChatCompletionRequest)
    assert sampling_parameters(chat, 4) == {"max_tokens": 4, "logprobs": 3, "structured_outputs": {"json_object": True}}
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}).encode(),
                      ChatCompletionRequest)
    assert sampling_parameters(chat, 4)["structured_outputs"] == {"json": {"type": "object"}}
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                                  "tool_choice": "none"}).encode(), ChatCompletionRequest)
    assert "structured_outputs" not in sampling_parameters(chat, 4)
    # What the clients send and the models can honour passes: logprobs null, n 1, best_of = n, min_p 0.
    sampling_parameters(completion(prompt="x", logprobs=None, n=2, best_of=2, min_p=0, user="u"), 4)


def test_every_prompt_form_becomes_text(tokenizer):
    ids = tokenizer.encode("The capital of France is")
    assert [p.text for p in tokenizer.completion_prompts("a b")] == ["a b"]
    assert [p.text for p in tokenizer.completion_prompts(["a", "b"])] == ["a", "b"]
    assert tokenizer.completion_prompts(ids)[0].text == "The capital of France is"
    both = tokenizer.completion_prompts([ids, ids[:2]])
    assert len(both) == 2 and tokenizer.encode(both[1].text) == ids[:2]
    for bad in (None, [], [["a"]], [1, "a"], {"text": "x"}, [[]], [-1], [10**9]):
        with pytest.raises(OpenAIError) as info:
            tokenizer.completion_prompts(bad)
        assert info.value.status == 400 and info.value.param == "prompt"


def test_chat_template_and_text_parts(tokenizer):
    messages = parse_body(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]}).encode(), ChatCompletionRequest).messages
    text = tokenizer.chat_prompt(messages)
    expected = tokenizer.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}],
        tokenize=False, add_generation_prompt=True)
    assert text == expected and "Hello\nthere" in text
    image = parse_body(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), ChatCompletionRequest).messages
    with pytest.raises(OpenAIError) as info:
        tokenizer.chat_prompt(image)
    assert "only text parts" in info.value.message


@pytest.mark.parametrize("message, status, expected", [
    ("llm_inflight queue is full (256 waiting requests); retry later", None, 503),
    ("llm_inflight is shutting down; the request was not finished (retry on another server)", None, 503),
    ("Exceeds maximum queue size", "StatusCode.UNAVAILABLE", 503),
    ("prompt (3 tokens) + max_tokens (4000) = 4003 exceeds max_model_len (2048)", None, 400),
    ("unknown sampling parameter 'x'", "StatusCode.INVALID_ARGUMENT", 400),
    ("the model failed on this request: boom", None, 500),
    ("the model failed on this request: boom", "StatusCode.INTERNAL", 500),
])
def test_upstream_failures_get_openai_statuses(message, status, expected):
    assert upstream_status(message, status) == expected
    error = from_upstream(message, status, "llm_inflight")
    assert error.status == expected and message in error.message
    assert (error.code == "queue_full") == ("queue" in message.lower())


def _chunk(raw: bytes) -> dict:
    return json.loads(raw[len(b"data: "):])


def test_stream_chunks_send_the_role_with_the_first_token():
    writer = ChunkWriter(chat=True, request_id="id", created=1, model="m", continuous_usage=False)
    choice = Choice(index=0, prompt="p", sampling={})
    assert writer.piece(choice, "", None, None, tokens=0) is None  # no token yet: no role-only chunk
    first = _chunk(writer.piece(choice, "Hi", None, None, tokens=1))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    last = _chunk(writer.piece(choice, "", "length", None))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chat", [True, False])
def test_a_token_without_text_still_gets_its_chunk(chat):
    """A step whose token has no text of its own (a special token) is a chunk with empty text, as
    vLLM sends it: the client's first token is timed at the step that made it, not at the next text."""
    writer = ChunkWriter(chat=chat, request_id="id", created=1, model="m", continuous_usage=False)
    choice = Choice(index=0, prompt="p", sampling={})
    first = _chunk(writer.piece(choice, "", None, None, tokens=1))["choices"][0]
    assert (first["delta"] == {"role": "assistant", "content": ""}) if chat else (first["text"] == "")
    later = _chunk(writer.piece(choice, "", None, None, tokens=1))["choices"][0]
    assert (later["delta"] == {"content": ""}) if chat else (later["text"] == "")
    assert later["finish_reason"] is None


def test_usage_counts_each_prompt_once_and_every_choice():
    choices = [Choice(index=i, prompt="p", sampling={}, prompt_tokens=5 + i // 2, completion_tokens=3)
               for i in range(4)]  # 2 prompts x n=2
    total = usage(choices, n=2)
    assert (total.prompt_tokens, total.completion_tokens, total.total_tokens) == (11, 12, 23)


def test_metrics_text_is_prometheus_exposition():
    metrics = FrontMetrics()
    metrics.requests.inc("chat", "llm_inflight", "200")
    metrics.latency.observe(0.3, "chat", "llm_inflight")
    text = metrics.render()
    assert 'tritonllm_openai_requests_total{endpoint="chat",model="llm_inflight",status="200"} 1' in text
    assert 'tritonllm_openai_request_duration_seconds_bucket{endpoint="chat",model="llm_inflight",le="0.5"} 1' in text
    assert 'tritonllm_openai_request_duration_seconds_bucket{endpoint="chat",model="llm_inflight",le="0.25"} 0' in text
    assert 'le="+Inf"} 1' in text and "# TYPE tritonllm_openai_request_duration_seconds histogram" in text
