"""The request contract, once (tritonllm/contract.py): the shipped configs declare it, a config that
differs is named at load, and the clients build their requests from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tritonllm.contract import INPUTS, OUTPUTS, config_problems
from tritonllm_client.contract import is_final_response, request_inputs

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
TENSOR = re.compile(r'\{\s*name:\s*"(?P<name>[^"]+)",\s*data_type:\s*(?P<type>\w+),\s*dims:\s*\[(?P<dims>[^\]]*)\]'
                    r'(?P<optional>,\s*optional:\s*true)?\s*\}')


def config_json(pbtxt: str) -> dict:
    """The inputs and outputs of a config.pbtxt in the JSON form Triton hands a Python backend."""
    config = {}
    for kind in ("input", "output"):
        block = re.search(rf"(?ms)^{kind} \[(.*?)^\]", pbtxt).group(1)
        config[kind] = [{"name": m["name"], "data_type": m["type"], "dims": [d.strip() for d in m["dims"].split(",")],
                         **({"optional": True} if m["optional"] else {})} for m in TENSOR.finditer(block)]
    return config


@pytest.mark.parametrize("model", ["llm_inflight", "llm_dynamic", "llm_static"])
def test_every_shipped_config_declares_the_contract(model):
    config = config_json((REPOSITORY / model / "config.pbtxt").read_text())
    assert len(config["input"]) == len(INPUTS) and len(config["output"]) == len(OUTPUTS)
    assert config_problems(config) == []


def test_a_config_that_differs_is_named():
    config = config_json((REPOSITORY / "llm_dynamic" / "config.pbtxt").read_text())
    config["input"] = [t for t in config["input"] if t["name"] != "top_k"]
    config["input"][0]["data_type"] = "TYPE_INT32"
    config["output"].append({"name": "logits", "data_type": "TYPE_FP32", "dims": ["-1"]})
    next(t for t in config["input"] if t["name"] == "stream").pop("optional")
    assert config_problems(config) == [
        "input 'text_input' is TYPE_INT32 [1], the contract says TYPE_STRING [1]",
        "input 'stream' must be optional",
        "input 'top_k' is missing",
        "output 'logits' is not in the contract",
    ]


def test_requests_use_only_the_contracts_inputs():
    declared = {t.name: t.data_type.removeprefix("TYPE_") for t in INPUTS}
    inputs = request_inputs("Hello", {"max_tokens": 3}, stream=True)
    wire = {"STRING": "BYTES"}
    assert {name: wire.get(declared[name], declared[name]) for name in inputs} == \
        {name: datatype for name, (datatype, _) in inputs.items()}


def test_the_final_response_flag():
    class Param:
        def __init__(self, value):
            self.bool_param = value

    class Response:
        def __init__(self, **params):
            self.parameters = {k: Param(v) for k, v in params.items()}

    assert is_final_response(Response(triton_final_response=True))
    assert not is_final_response(Response(triton_final_response=False)) and not is_final_response(Response())
