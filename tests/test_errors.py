"""Request errors as a type (tritonllm/errors.py): the field and the fault travel with the error, and
booleans have one spelling everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.errors import Fault, RequestError, parse_bool
from tritonllm.openai.errors import from_request_error
from tritonllm.triton.request import parse_request


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (np.bool_(True), True), (1, True), (0, False),
                                            ("TRUE", True), (" false ", False), ("1", True), (b"0", False)])
def test_one_boolean_spelling(value, expected):
    assert parse_bool(value, "flag", "input 'flag'") is expected


@pytest.mark.parametrize("value", ["yes", 2, 1.0, None, "", b"on"])
def test_anything_else_is_named(value):
    with pytest.raises(RequestError, match="input 'flag' must be a boolean, got") as err:
        parse_bool(value, "flag", "input 'flag'")
    assert err.value.field == "flag" and err.value.fault is Fault.INVALID


def test_the_same_parser_reads_inputs_sampling_keys_and_config_parameters():
    assert parse_request({"text_input": np.array([b"Hi"]), "stream": np.array([b"1"])}).stream is True
    assert SamplingParams.from_dict({"ignore_eos": "true"}).ignore_eos is True
    assert SchedulerConfig.from_parameters({"enable_prefix_caching": "False"}).enable_prefix_caching is False
    with pytest.raises(RequestError, match="parameter enable_prefix_caching must be a boolean"):
        SchedulerConfig.from_parameters({"enable_prefix_caching": "maybe"})


@pytest.mark.parametrize("values,field", [({"top_p": 1.5}, "top_p"), ({"max_tokenz": 4}, "max_tokenz"),
                                          ({"ignore_eos": "maybe"}, "ignore_eos"), ({"max_tokens": "abc"}, "max_tokens")])
def test_a_sampling_error_carries_its_key(values, field):
    with pytest.raises(RequestError) as err:
        SamplingParams.from_dict(values)
    assert err.value.field == field
    answer = from_request_error(err.value)
    assert answer.status == 400 and answer.param == field


def test_each_fault_has_its_status():
    assert {f: f.http_status for f in Fault} == {Fault.INVALID: 400, Fault.TOO_LONG: 400, Fault.UNSUPPORTED: 400,
                                                Fault.UNAVAILABLE: 503}
    assert from_request_error(RequestError("full", fault=Fault.UNAVAILABLE)).status == 503
