"""The request contract, parsed without a server: precedence, coercion and errors that name the problem."""

from __future__ import annotations

import numpy as np
import pytest

from tritonllm.triton.request import RequestError, parse_request


def text(value) -> np.ndarray:
    return np.array([[value.encode() if isinstance(value, str) else value]], dtype=np.object_)


def test_defaults_follow_vllm():
    req = parse_request({"text_input": text("Hi")})
    assert req.prompt == "Hi" and not req.stream
    assert req.params.max_tokens == 16
    assert req.echo_prompt  # not streaming and not excluded: the prompt is echoed
    streaming = parse_request({"text_input": text("Hi"), "stream": np.array([True])})
    assert not streaming.echo_prompt


def test_sampling_json_wins_over_scalars_which_win_over_parameters():
    req = parse_request(
        {"text_input": text("Hi"), "max_tokens": np.array([[7]], dtype=np.int32),
         "sampling_parameters": text('{"temperature": "0.5"}')},
        '{"max_tokens": 3, "top_k": "5", "triton_enable_empty_final_response": true}',
    )
    assert (req.params.max_tokens, req.params.temperature, req.params.top_k) == (7, 0.5, 5)
    req = parse_request({"text_input": text("Hi"), "max_tokens": np.array([7]),
                         "sampling_parameters": text('{"max_tokens": 9}')})
    assert req.params.max_tokens == 9


def test_tensorrt_llm_names_map_to_vllm_keys():
    req = parse_request({"text_input": text("Hi"), "random_seed": np.array([11], dtype=np.uint64),
                         "min_length": np.array([2]), "stop_words": np.array([b"END", b"STOP"], dtype=np.object_)})
    assert (req.params.seed, req.params.min_tokens, req.params.stop) == (11, 2, ["END", "STOP"])


def test_flags_arrive_as_parameters_too():
    req = parse_request({"text_input": text("Hi")}, {"exclude_input_in_output": "true", "return_finish_reason": True})
    assert req.exclude_input_in_output is True and req.return_finish_reason is True


@pytest.mark.parametrize("inputs, parameters, named", [
    ({}, None, "text_input"),
    ({"text_input": text(b"\xff\xfe")}, None, "UTF-8"),
    ({"text_input": text("Hi"), "sampling_parameters": text("{nope")}, None, "not valid JSON"),
    ({"text_input": text("Hi"), "sampling_parameters": text("[1]")}, None, "JSON object"),
    ({"text_input": text("Hi")}, {"max_token": 3}, "max_token"),
    ({"text_input": text("Hi"), "sampling_parameters": text('{"max_tokens": "abc"}')}, None, "max_tokens"),
    ({"text_input": text("Hi"), "sampling_parameters": text('{"top_p": 1.5}')}, None, "top_p"),
    ({"text_input": text("Hi"), "stream": text("maybe")}, None, "stream"),
])
def test_bad_requests_name_the_problem(inputs, parameters, named):
    with pytest.raises(RequestError, match=named):
        parse_request(inputs, parameters)
