"""Structured output, log probabilities and tool calls end to end, on the bundled model: a real
tritonserver serving the three models, HTTP generate, and the OpenAI front driven by the openai SDK
(`parse()` with nested Pydantic models, tools, completions logprobs with echo).
"""

from __future__ import annotations

import enum
import json

import openai
import pytest
from conftest import start_test_server
from e2e_clients import TIMEOUT, concurrently, configured_repository, generate, generate_stream, started_front
from pydantic import BaseModel
from structured_cases import cases

from tritonllm.model_files import bundled_dir

MODELS = ("llm_inflight", "llm_dynamic", "llm_static")
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    """The three models on the bundled model (float32, as every test server); llm_static sends
    partial batches after 0.1 s."""
    root = tmp_path_factory.mktemp("structured")
    repo = configured_repository(root / "repo", {
        "llm_static": {r"max_queue_delay_microseconds: \d+": "max_queue_delay_microseconds: 100000"},
        "llm_dynamic": {}, "llm_inflight": {}})
    server = start_test_server(root, model_repository=repo, env={"TRITONLLM_MODEL": "bundled"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front(bundled_server, tmp_path_factory):
    front = started_front(bundled_server, tmp_path_factory.mktemp("openai"), "bundled")
    yield front
    front.stop()


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=TIMEOUT * 3) as client:
        yield client


@pytest.fixture(scope="module")
def chat():
    """The bundled model's chat template, as the front applies it (one user message)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_dir())
    return lambda content: tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                         add_generation_prompt=True)


def constrained(server, model: str, prompt: str, spec: dict) -> dict:
    response = generate(server, model, text_input=prompt, exclude_input_in_output=True, return_finish_reason=True,
                        return_num_output_tokens=True, sampling_parameters=json.dumps(
                            {"max_tokens": MAX_TOKENS, "temperature": 0, "structured_outputs": spec}))
    assert response.status_code == 200, response.text
    return response.json()


def test_constrained_answers_are_valid_on_every_model(bundled_server, chat):
    """23 schemas, regexes and choices (tests/structured_cases.py), all at once on each model: every
    answer ends with the grammar and is valid, the ones the model would write on inside a string
    until max_tokens too (closed before it, structured_output.py); the three models give the same
    answers."""
    every = cases()
    texts = {}
    for model in MODELS:
        answers = concurrently([lambda p=p, s=s, m=model: constrained(bundled_server, m, chat(p), s) for p, s, _ in every],
                               timeout=TIMEOUT * 10)
        for (prompt, spec, check), answer in zip(every, answers):
            text, reason = answer["text_output"], answer["finish_reason"]
            assert reason == "stop" and check(text), (model, spec, answer)
            assert answer["num_output_tokens"] <= MAX_TOKENS
        texts[model] = [a["text_output"] for a in answers]
    assert texts["llm_dynamic"] == texts["llm_inflight"] == texts["llm_static"]


def test_logprobs_stream_with_their_tokens_and_prompt_logprobs_come_first(bundled_server):
    events = generate_stream(bundled_server, "llm_inflight", text_input="The capital of France is", stream=True,
                             return_num_output_tokens=True,
                             sampling_parameters=json.dumps({"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                             "logprobs": 2, "prompt_logprobs": 1}))
    assert len(events) > 1  # streamed: a response per step
    payloads = [json.loads(e["logprobs"]) for e in events if e.get("logprobs")]
    assert len(payloads) == len(events)  # on every response
    assert [len(p["tokens"]) for p in payloads] == [e["num_output_tokens"] for e in events]
    assert "prompt" in payloads[0] and all("prompt" not in p for p in payloads[1:])
    prompt = payloads[0]["prompt"]
    assert prompt[0]["logprob"] is None and "".join(e["token"] for e in prompt) == "The capital of France is"
    tokens = [t for p in payloads for t in p["tokens"]]
    assert "".join(t["token"] for t in tokens) == "".join(e["text_output"] for e in events)
    for t in tokens:  # greedy: each token is its position's best
        assert t["top_logprobs"][0]["id"] == t["id"] and t["logprob"] == t["top_logprobs"][0]["logprob"] <= 0


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Owner(BaseModel):
    name: str
    age: int


class Pet(BaseModel):
    name: str
    species: str
    color: Color
    owner: Owner  # a $ref in the schema the SDK sends
    nicknames: list[str]
    weight_kg: float | None  # optional: null allowed


@pytest.mark.parametrize("model", MODELS)
def test_the_sdks_parse_returns_nested_pydantic_models(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a pet and its owner."}],
        response_format=Pet, temperature=0, max_tokens=200)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.owner, Owner) and isinstance(pet.color, Color)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}


def test_tools_named_and_required_come_back_as_tool_calls(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model="llm_inflight", messages=messages, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    required = client.chat.completions.create(model="llm_dynamic", messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", temperature=0, max_tokens=80)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    # streamed: the named function's arguments arrive as delta.tool_calls and add up to the same call
    stream = client.chat.completions.create(model="llm_inflight", messages=messages, tools=[WEATHER],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            temperature=0, max_tokens=60, stream=True)
    parts = [c.choices[0].delta.tool_calls for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert parts[0][0].function.name == "get_weather" and parts[0][0].id
    assert "".join(p[0].function.arguments or "" for p in parts) == named.choices[0].message.tool_calls[0].function.arguments
    with pytest.raises(openai.BadRequestError, match="auto"):
        client.chat.completions.create(model="llm_inflight", messages=messages, tools=[WEATHER], max_tokens=8)


def test_completions_logprobs_with_echo_score_the_prompt(client):
    """What lm-evaluation-harness's local-completions sends to score a continuation."""
    prompt = "The capital of France is Paris"
    out = client.completions.create(model="llm_static", prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chat = client.chat.completions.create(model="llm_inflight", messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=3, max_tokens=5, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_a_bad_schema_is_a_400_naming_it_and_the_server_serves_on(client):
    for model in MODELS:
        with pytest.raises(openai.BadRequestError, match="structured_outputs"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "x", "schema": {"type": "objec"}}})
        with pytest.raises(openai.BadRequestError, match="regex"):
            client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"structured_outputs": {
                "regex": "[a-"}})
    assert client.completions.create(model="llm_inflight", prompt="Hi", max_tokens=2).choices[0].text is not None
