"""A Triton request of any of the three models, read into a GenerateRequest by the contract's names
(tritonllm/contract.py).

Pure Python over numpy arrays, so it is tested without a server. Sampling values are merged in
this order, later winning: request parameters (HTTP generate puts unknown JSON keys there), the
TensorRT-LLM scalar inputs, then the `sampling_parameters` JSON input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonllm.contract import FLAG_INPUTS, TRTLLM_SCALARS
from tritonllm.engine.sampling_params import SamplingParams, json_object
from tritonllm.errors import RequestError, parse_bool

@dataclass
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool | None = None
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False

    @property
    def echo_prompt(self) -> bool:
        """vLLM's rule: the prompt is echoed unless excluded, or unless streaming when not said."""
        if self.exclude_input_in_output is None:
            return not self.stream
        return not self.exclude_input_in_output


def parse_request(inputs: dict[str, np.ndarray], parameters: dict[str, Any] | str | None = None) -> GenerateRequest:
    """Build a GenerateRequest from input arrays (by name) and request parameters; raise RequestError."""
    try:
        return _parse(inputs, _parameters(parameters))
    except RequestError:
        raise
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _parse(inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> GenerateRequest:
    if "text_input" not in inputs:
        raise RequestError("missing required input 'text_input'", "text_input")
    prompt = _text(inputs["text_input"], "text_input")
    flags = {name: _flag(inputs[name], name) for name in FLAG_INPUTS if name in inputs}
    sampling: dict[str, Any] = {}
    for key, value in parameters.items():
        if key.startswith("triton_"):
            continue  # Triton's own request parameters
        if key in FLAG_INPUTS:
            flags.setdefault(key, _coerce_flag(value, key))
        elif key in TRTLLM_SCALARS:
            sampling[TRTLLM_SCALARS[key]] = value
        else:
            sampling[key] = value  # SamplingParams names unknown keys
    for name, key in TRTLLM_SCALARS.items():
        if name in inputs:
            sampling[key] = _scalar(inputs[name], name)
    if "sampling_parameters" in inputs:
        sampling.update(json_object(_text(inputs["sampling_parameters"], "sampling_parameters"), "sampling_parameters"))
    return GenerateRequest(prompt=prompt, params=SamplingParams.from_dict(sampling), **flags)


def _parameters(parameters: dict[str, Any] | str | None) -> dict[str, Any]:
    if not parameters:
        return {}
    if isinstance(parameters, str):
        return json_object(parameters, "request parameters")
    return dict(parameters)


def _first(array: np.ndarray, name: str):
    flat = np.asarray(array).reshape(-1)
    if flat.size == 0:
        raise RequestError(f"input {name!r} is empty", name)
    return flat[0]


def _text(array: np.ndarray, name: str) -> str:
    value = _first(array, name)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"input {name!r} is not valid UTF-8: {exc}", name) from None
    if isinstance(value, str):
        return value
    raise RequestError(f"input {name!r} must be a string", name)


def _flag(array: np.ndarray, name: str) -> bool:
    return _coerce_flag(_first(array, name), name)


def _coerce_flag(value: Any, name: str) -> bool:
    return parse_bool(value, name, f"input {name!r}")


def _scalar(array: np.ndarray, name: str) -> Any:
    if name == "stop_words":  # a list of strings
        flat = np.asarray(array).reshape(-1)
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat]
    value = _first(array, name)
    return value.item() if hasattr(value, "item") else value
