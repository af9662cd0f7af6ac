"""The client side of the request contract (tritonllm/contract.py): the one place that builds a
request's inputs and reads a response, for the CLI clients, the OpenAI front, the load test and
the tests.

Which inputs a request carries, their wire forms (HTTP generate and infer bodies, gRPC tensors),
what one response means, whether it is a stream's last, and what the server tells about a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tritonllm.contract import FINAL_RESPONSE

# Sampling keys with vLLM's names, as sent in the `sampling_parameters` JSON input.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs")
# CLI flag -> the key of the models' structured_outputs spec it sets
STRUCTURED_FLAGS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def sampling_from_args(args) -> dict[str, Any]:
    """The sampling flags the user set (None = leave it to the server's default)."""
    values = {key: getattr(args, key, None) for key in SAMPLING_KEYS}
    if not values.get("ignore_eos"):
        values["ignore_eos"] = None  # a flag that is off: do not send it
    specs = {key: getattr(args, flag) for flag, key in STRUCTURED_FLAGS.items() if getattr(args, flag, None)}
    if getattr(args, "json_object", False):
        specs["json_object"] = True
    values["structured_outputs"] = specs or None
    return {key: value for key, value in values.items() if value not in (None, [])}


@dataclass(frozen=True)
class ModelInfo:
    """What the client needs to know about a model to talk to it."""

    name: str
    max_batch_size: int
    decoupled: bool

    @property
    def batching(self) -> bool:
        """A batching model takes a leading batch dimension: text_input has shape [1, 1]."""
        return self.max_batch_size > 0

    def shape(self) -> list[int]:
        return [1, 1] if self.batching else [1]


def model_info_from_config(config: dict) -> ModelInfo:
    """Build ModelInfo from a model config as JSON (HTTP /config, or gRPC as_json)."""
    policy = config.get("model_transaction_policy") or {}
    return ModelInfo(name=config.get("name", ""), max_batch_size=int(config.get("max_batch_size", 0) or 0),
                     decoupled=bool(policy.get("decoupled", False)))


def request_inputs(prompt: str, sampling: dict[str, Any], stream: bool,
                   return_num_input_tokens: bool = False) -> dict[str, tuple[str, Any]]:
    """Input name -> (Triton datatype, value) of one generate request.

    The prompt is never echoed (exclude_input_in_output), and the server reports the finish reason
    and the number of new tokens of each response, which the client sums.
    """
    inputs: dict[str, tuple[str, Any]] = {
        "text_input": ("BYTES", prompt),
        "stream": ("BOOL", stream),
        "exclude_input_in_output": ("BOOL", True),
        "return_finish_reason": ("BOOL", True),
        "return_num_output_tokens": ("BOOL", True),
    }
    if return_num_input_tokens:
        inputs["return_num_input_tokens"] = ("BOOL", True)
    if sampling:
        inputs["sampling_parameters"] = ("BYTES", json.dumps(sampling, sort_keys=True))
    return inputs


def generate_body(inputs: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """The JSON body of HTTP `generate` / `generate_stream` (Triton adds the batch dimension itself)."""
    return {name: value for name, (_, value) in inputs.items()}


def infer_body(inputs: dict[str, tuple[str, Any]], shape: list[int]) -> dict[str, Any]:
    """The JSON body of HTTP `/infer`: every input of `shape` ([1, 1] for a batching model)."""
    return {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": [value]}
                       for name, (datatype, value) in inputs.items()]}


def grpc_inputs(inputs: dict[str, tuple[str, Any]], shape: list[int]) -> list:
    """tritonclient.grpc InferInputs (the aio client takes the same)."""
    import numpy as np
    from tritonclient.grpc import InferInput

    tensors = []
    for name, (datatype, value) in inputs.items():
        array = (np.array([value.encode("utf-8")], dtype=np.object_) if datatype == "BYTES"
                 else np.array([value], dtype=bool))
        tensor = InferInput(name, shape, datatype)
        tensor.set_data_from_numpy(array.reshape(shape))
        tensors.append(tensor)
    return tensors


def is_final_response(response) -> bool:
    """Whether a streamed gRPC response (a ModelInferResponse) is its request's last."""
    params = response.parameters
    return FINAL_RESPONSE in params and params[FINAL_RESPONSE].bool_param


@dataclass
class Chunk:
    """One response: the new text, how many tokens it carries and, on the last one, why it ended."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str = ""
    logprobs: dict | None = None  # the `logprobs` output, when sampling asked for it


def first_value(value: Any) -> Any:
    """The single element of a (possibly nested) list or array, as a plain Python value."""
    if hasattr(value, "tolist"):  # numpy array or scalar
        value = value.tolist()
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def chunk_from_outputs(outputs: dict[str, Any]) -> Chunk:
    """A Chunk from output name -> value (list, array or scalar) of one response."""
    tokens = first_value(outputs.get("num_output_tokens"))
    logprobs = first_value(outputs.get("logprobs"))
    return Chunk(text=first_value(outputs.get("text_output")) or "",
                 num_tokens=int(tokens) if tokens is not None else 0,
                 finish_reason=first_value(outputs.get("finish_reason")) or "",
                 logprobs=json.loads(logprobs) if logprobs else None)
