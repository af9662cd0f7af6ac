"""The request contract of the three models, written once: Triton's vLLM-backend interface plus the
TensorRT-LLM ensemble's optional scalar inputs.

Each model's config.pbtxt declares exactly these inputs and outputs; every model checks its config
against them at load (`config_problems`), and the clients, the OpenAI front, the load test and the
tests build requests and read responses through `tritonllm_client.contract`, which takes its names
from here. Plain Python: the client and the load test import it without torch or numpy.
"""

from __future__ import annotations

from typing import NamedTuple


class Tensor(NamedTuple):
    name: str
    data_type: str  # as config.pbtxt writes it
    dims: tuple[int, ...]
    optional: bool = False


# Boolean inputs that change what a response carries (vLLM backend's names).
FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens")

# TensorRT-LLM ensemble input name -> vLLM sampling key.
TRTLLM_SCALARS = {
    "max_tokens": "max_tokens",
    "min_length": "min_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "random_seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop_words": "stop",
}
_SCALAR_TYPES = {"max_tokens": "TYPE_INT32", "min_length": "TYPE_INT32", "temperature": "TYPE_FP32",
                 "top_k": "TYPE_INT32", "top_p": "TYPE_FP32", "random_seed": "TYPE_UINT64",
                 "repetition_penalty": "TYPE_FP32", "presence_penalty": "TYPE_FP32", "frequency_penalty": "TYPE_FP32",
                 "stop_words": "TYPE_STRING"}

INPUTS = (
    Tensor("text_input", "TYPE_STRING", (1,)),
    Tensor("stream", "TYPE_BOOL", (1,), True),
    Tensor("sampling_parameters", "TYPE_STRING", (1,), True),
    *(Tensor(name, "TYPE_BOOL", (1,), True) for name in FLAG_INPUTS[1:]),
    *(Tensor(name, _SCALAR_TYPES[name], (-1,) if name == "stop_words" else (1,), True) for name in TRTLLM_SCALARS),
)
OUTPUTS = (
    Tensor("text_output", "TYPE_STRING", (-1,)),
    Tensor("finish_reason", "TYPE_STRING", (-1,)),
    Tensor("num_input_tokens", "TYPE_UINT32", (-1,)),
    Tensor("num_output_tokens", "TYPE_UINT32", (-1,)),
    Tensor("logprobs", "TYPE_STRING", (-1,)),  # JSON; only when sampling asks for logprobs (triton/logprobs_output.py)
)
OPTIONAL_INPUTS = tuple(t.name for t in INPUTS if t.optional)

# The response parameter that marks a decoupled stream's last response (Triton's own name).
FINAL_RESPONSE = "triton_final_response"


def config_problems(config: dict) -> list[str]:
    """What a model config (Triton's JSON form, as a Python backend's `initialize` gets it) declares
    differently from INPUTS and OUTPUTS: one line per difference, none when it matches."""
    problems = []
    for kind, expected in (("input", INPUTS), ("output", OUTPUTS)):
        declared = {t.get("name"): t for t in config.get(kind, [])}
        for tensor in expected:
            got = declared.pop(tensor.name, None)
            if got is None:
                problems.append(f"{kind} {tensor.name!r} is missing")
                continue
            dims = tuple(int(d) for d in got.get("dims", []))
            if got.get("data_type") != tensor.data_type or dims != tensor.dims:
                problems.append(f"{kind} {tensor.name!r} is {got.get('data_type')} {list(dims)}, "
                                f"the contract says {tensor.data_type} {list(tensor.dims)}")
            if kind == "input" and bool(got.get("optional", False)) != tensor.optional:
                problems.append(f"input {tensor.name!r} must be {'optional' if tensor.optional else 'required'}")
        problems += [f"{kind} {name!r} is not in the contract" for name in declared]
    return problems
