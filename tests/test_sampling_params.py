"""SamplingParams.from_dict: coercion of string values, JSON text, and errors that name the key."""

from __future__ import annotations

import json

import pytest

from tritonllm.engine.sampling_params import SamplingParams


def test_defaults():
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict("") == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict("{}") == SamplingParams()


def test_string_values_are_coerced():
    p = SamplingParams.from_dict({
        "max_tokens": "128",
        "min_tokens": "3",
        "temperature": "0.5",
        "top_k": "-1",
        "top_p": "0.9",
        "seed": "42",
        "ignore_eos": "true",
        "skip_special_tokens": "False",
        "repetition_penalty": "1.2",
        "presence_penalty": "-0.5",
        "frequency_penalty": "1",
        "stop": "###",
        "stop_token_ids": "[5, 7]",
    })
    assert p.max_tokens == 128 and type(p.max_tokens) is int
    assert p.min_tokens == 3 and type(p.min_tokens) is int
    assert p.temperature == 0.5 and type(p.temperature) is float
    assert p.top_k == -1
    assert p.top_p == 0.9
    assert p.seed == 42 and type(p.seed) is int
    assert p.ignore_eos is True
    assert p.skip_special_tokens is False
    assert p.repetition_penalty == 1.2
    assert p.presence_penalty == -0.5
    assert p.frequency_penalty == 1.0 and type(p.frequency_penalty) is float
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]


def test_native_values_and_other_forms():
    p = SamplingParams.from_dict({"max_tokens": 64, "temperature": 0, "ignore_eos": 1, "stop": ["a", "bc"],
                                  "stop_token_ids": 9, "seed": 3.0, "top_k": b"4"})
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop, p.stop_token_ids, p.seed, p.top_k) == (
        64, 0.0, True, ["a", "bc"], [9], 3, 4)
    assert p.greedy
    assert SamplingParams.from_dict({"stop": '["x", "y"]'}).stop == ["x", "y"]
    assert SamplingParams.from_dict({"ignore_eos": "0"}).ignore_eos is False
    assert SamplingParams.from_dict({"ignore_eos": "TRUE"}).ignore_eos is True
    assert SamplingParams.from_dict({"stop_token_ids": "12"}).stop_token_ids == [12]
    # None means "use the default".
    assert SamplingParams.from_dict({"max_tokens": None, "seed": None}) == SamplingParams()


def test_json_text_input():
    text = json.dumps({"max_tokens": "32", "temperature": 0.7, "stop": ["\n\n"], "ignore_eos": True})
    p = SamplingParams.from_dict(text)
    assert (p.max_tokens, p.temperature, p.stop, p.ignore_eos) == (32, 0.7, ["\n\n"], True)
    assert SamplingParams.from_dict(text.encode()).max_tokens == 32


@pytest.mark.parametrize("text", ['{"max_tokens": 3', "not json", "{'max_tokens': 3}", "[1, 2", "{,}"])
def test_invalid_json(text):
    with pytest.raises(ValueError, match="JSON"):
        SamplingParams.from_dict(text)


@pytest.mark.parametrize("text", ["[1, 2]", '"max_tokens"', "3", "null"])
def test_json_that_is_not_an_object(text):
    with pytest.raises(ValueError, match="object"):
        SamplingParams.from_dict(text)


@pytest.mark.parametrize("key", ["max_token", "temprature", "n", "best_of", "TOP_K"])
def test_unknown_key_is_named(key):
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({"max_tokens": 4, key: 1})
    assert repr(key) in str(info.value)
    assert "unknown" in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("max_tokens", "abc"),
    ("max_tokens", "12.5"),
    ("max_tokens", 12.5),
    ("max_tokens", True),
    ("max_tokens", [1]),
    ("min_tokens", "x"),
    ("temperature", "warm"),
    ("temperature", True),
    ("temperature", [0.5]),
    ("top_k", "five"),
    ("top_p", {"a": 1}),
    ("seed", "0x10"),
    ("ignore_eos", "yes"),
    ("ignore_eos", 2),
    ("ignore_eos", 1.5),
    ("skip_special_tokens", "maybe"),
    ("stop", 5),
    ("stop", ["a", 1]),
    ("stop", "[1, 2]"),
    ("stop_token_ids", "abc"),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 1.5),
    ("repetition_penalty", "high"),
    ("presence_penalty", "zero"),
    ("frequency_penalty", [0.1]),
])
def test_wrong_type_is_named(key, value):
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({key: value})
    assert repr(key) in str(info.value), str(info.value)


@pytest.mark.parametrize("key, value", [
    ("max_tokens", 0),
    ("max_tokens", "-3"),
    ("min_tokens", -1),
    ("temperature", -0.1),
    ("temperature", "nan"),
    ("top_k", -2),
    ("top_p", 0),
    ("top_p", "1.5"),
    ("top_p", "nan"),
    ("seed", -1),
    ("seed", 2**63),
    ("repetition_penalty", 0),
    ("repetition_penalty", "-1"),
    ("presence_penalty", 2.5),
    ("presence_penalty", "-2.01"),
    ("frequency_penalty", 3),
    ("frequency_penalty", "nan"),
    ("stop", [""]),
    ("stop", ""),
    ("stop_token_ids", [-1]),
])
def test_out_of_range_is_named(key, value):
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({key: value})
    assert repr(key) in str(info.value), str(info.value)


def test_min_tokens_above_max_tokens_is_named():
    with pytest.raises(ValueError, match="'min_tokens'"):
        SamplingParams.from_dict({"max_tokens": "4", "min_tokens": "5"})
    assert SamplingParams.from_dict({"max_tokens": "4", "min_tokens": "4"}).min_tokens == 4


@pytest.mark.parametrize("key, value", [
    ("top_k", 0), ("top_k", -1), ("top_p", 1), ("top_p", "1e-3"), ("temperature", "0"),
    ("presence_penalty", "-2"), ("frequency_penalty", 2), ("seed", 0), ("seed", str(2**63 - 1)),
    ("repetition_penalty", "0.01"),
])
def test_boundary_values_accepted(key, value):
    p = SamplingParams.from_dict({key: value})
    assert getattr(p, key) == type(getattr(SamplingParams(), key) if key != "seed" else 0)(value)


def test_penalty_flags():
    assert not SamplingParams().needs_penalties
    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = 1.1 if key == "repetition_penalty" else 0.3
        assert SamplingParams.from_dict({key: str(value)}).needs_penalties
    assert not SamplingParams.from_dict({"temperature": "0.001"}).greedy
    assert SamplingParams.from_dict({"temperature": "0.0"}).greedy


def test_json_nested_too_deeply_or_too_long_is_a_clear_error():
    """A deeply nested array used to escape as a raw RecursionError from the model."""
    from tritonllm.engine.sampling_params import json_object

    deep = '{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError, match="sampling_parameters is not valid JSON: JSON nested too deeply"):
        json_object(deep, "sampling_parameters")
    with pytest.raises(ValueError, match="sampling_parameters is not valid JSON"):
        json_object('{"max_tokens": ' + "9" * 5000 + "}", "sampling_parameters")
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams.from_dict({"stop_token_ids": "[" * 100_000})
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"stop_token_ids": "[" * 100_000})
    assert len(str(err.value)) < 200  # the value is cut short in the message
