"""Property-based fuzzing of the request parser: whatever arrives, the answer is a request or a
RequestError naming what is wrong, never another exception (which would reach the client as a
raw Python error). Derandomized: the same 1,500 cases every run."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.contract import FLAG_INPUTS, OPTIONAL_INPUTS, TRTLLM_SCALARS
from tritonllm.triton.request import RequestError, parse_request

SAMPLING_KEYS = list(SamplingParams.__dataclass_fields__)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
keys = st.sampled_from(SAMPLING_KEYS + ["max_tokenz", "", "stream", "triton_x"]) | st.text(max_size=12)
sampling_text = (st.dictionaries(keys, json_values, max_size=5).map(json.dumps)
                 | st.text(max_size=40)
                 | st.sampled_from(["", "[]", "null", "{", '{"max_tokens": "12"}', "[" * 5000 + "]" * 5000]))
raw_text = st.binary(max_size=30) | st.text(max_size=30)
arrays = (raw_text.map(lambda v: np.array([v], dtype=np.object_))
          | st.lists(raw_text, max_size=3).map(lambda v: np.array(v, dtype=np.object_))
          | st.integers(-2**31, 2**31 - 1).map(lambda v: np.array([v], dtype=np.int32))
          | st.floats(width=32).map(lambda v: np.array([v], dtype=np.float32))
          | st.booleans().map(lambda v: np.array([[v]], dtype=bool))
          | st.integers(0, 2**64 - 1).map(lambda v: np.array([v], dtype=np.uint64)))


@st.composite
def requests(draw):
    inputs = {}
    if draw(st.booleans()):
        inputs["text_input"] = draw(arrays)
    if draw(st.booleans()):
        inputs["sampling_parameters"] = np.array([draw(sampling_text).encode("utf-8", "surrogatepass")],
                                                 dtype=np.object_)
    for name in draw(st.lists(st.sampled_from([*FLAG_INPUTS, *TRTLLM_SCALARS]), max_size=4, unique=True)):
        inputs[name] = draw(arrays)
    parameters = draw(st.none() | st.dictionaries(keys, json_values, max_size=4) | sampling_text)
    return inputs, parameters


@settings(max_examples=1500, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests())
def test_any_request_is_parsed_or_refused_with_a_request_error(request):
    inputs, parameters = request
    try:
        parsed = parse_request(inputs, parameters)
    except RequestError as exc:
        assert str(exc), "an error must say what is wrong"
        return
    p = parsed.params  # what passes must be usable as it is
    assert isinstance(parsed.prompt, str)
    assert 1 <= p.max_tokens and 0 <= p.min_tokens <= p.max_tokens
    assert p.temperature >= 0 and 0 < p.top_p <= 1 and p.top_k >= -1
    assert p.seed is None or 0 <= p.seed < 2**63
    assert all(isinstance(s, str) and s for s in p.stop)


def test_the_fuzzer_covers_every_input():
    assert set(OPTIONAL_INPUTS) == {"sampling_parameters", *FLAG_INPUTS, *TRTLLM_SCALARS}
