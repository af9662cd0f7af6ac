"""Glue to Triton's Python backend (`triton_python_backend_utils`), shared by the three models.

Imported only inside a Triton Python-backend stub, where that module exists.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.contract import OPTIONAL_INPUTS, config_problems
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.engine.llm_engine import merge_outputs
from tritonllm.engine.sequence import RequestOutput
from tritonllm.errors import RequestError
from tritonllm.triton.logprobs_output import TokenTexts, logprobs_text
from tritonllm.triton.request import GenerateRequest, parse_request


def check_config(args: dict) -> None:
    """Refuse to load a model whose config.pbtxt declares other inputs or outputs than the contract."""
    problems = config_problems(json.loads(args["model_config"]))
    if problems:
        raise ValueError(f"{args['model_name']}: config.pbtxt does not match the request contract "
                         f"(tritonllm/contract.py): {'; '.join(problems)}")


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters { key: ... value { string_value: ... } }` of config.pbtxt as a dict."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def engine_config(params: dict[str, str], max_num_seqs: int | None = None) -> SchedulerConfig:
    """Engine knobs from config.pbtxt parameters (vLLM's names)."""
    return SchedulerConfig.from_parameters(params, **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}))


def read_request(request) -> GenerateRequest:
    """Parse one Triton request into the shared contract; raises RequestError."""
    inputs = {}
    for name in ("text_input", *OPTIONAL_INPUTS):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return parse_request(inputs, request.parameters())


def _string(value: str, batched: bool) -> np.ndarray:
    array = np.array([value.encode("utf-8")], dtype=np.object_)
    return array.reshape(1, 1) if batched else array


def _count(value: int, batched: bool) -> np.ndarray:
    array = np.array([value], dtype=np.uint32)
    return array.reshape(1, 1) if batched else array


def output_response(req: GenerateRequest, text: str, out: RequestOutput, num_new_tokens: int,
                    texts: TokenTexts, batched: bool = False):
    """An InferenceResponse with `text_output` and the outputs the request asked for."""
    tensors = [pb_utils.Tensor("text_output", _string(text, batched))]
    if (logprobs := logprobs_text(out, texts)) is not None:
        tensors.append(pb_utils.Tensor("logprobs", _string(logprobs, batched)))
    if req.return_finish_reason:
        tensors.append(pb_utils.Tensor("finish_reason", _string(out.finish_reason or "", batched)))
    if req.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens", _count(out.num_prompt_tokens, batched)))
    if req.return_num_output_tokens:
        tensors.append(pb_utils.Tensor("num_output_tokens", _count(num_new_tokens, batched)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def whole_response(req: GenerateRequest, outputs: list[RequestOutput], texts: TokenTexts, batched: bool = False):
    """The one response of a request answered whole: its outputs merged, the prompt echoed if asked."""
    out = merge_outputs(outputs)
    if out.error:
        return internal_error_response(out.error)
    text = req.prompt + out.text if req.echo_prompt else out.text
    return output_response(req, text, out, out.num_output_tokens, texts, batched)


def final_flag() -> int:
    """The flag that ends a decoupled request's responses (looked up late: the stub sets it)."""
    return pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def error_response(message: str, code=None):
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def refusal_response(exc: ValueError):
    """The answer to a request the model refuses: a RequestError with its fault's error code, any other
    ValueError (a request that cannot run) as an invalid argument."""
    fault = getattr(exc, "fault", None)
    return error_response(str(exc), getattr(pb_utils.TritonError, fault.triton_code) if fault else None)


def unavailable_response(message: str):
    return error_response(message, pb_utils.TritonError.UNAVAILABLE)


def internal_error_response(message: str):
    """The model failed on the request (not the client's fault)."""
    return error_response(message, pb_utils.TritonError.INTERNAL)


__all__ = ["RequestError", "check_config", "engine_config", "error_response", "internal_error_response", "model_parameters",
           "output_response", "read_request", "whole_response", "refusal_response", "unavailable_response", "pb_utils"]
