"""The wire side of one request: Triton's vLLM-backend contract over gRPC and HTTP.

Builds request bodies / input tensors from a `RequestSpec` (through tritonllm_client.contract, the
one builder) and reads the token counts back.
Every request asks for `num_output_tokens` and excludes the prompt from the output, so token
counts come from the server, not from a local tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tritonllm_client import contract
from tritonllm_client.contract import request_inputs
from tritonllm_loadtest.workload import RequestSpec


def _inputs(spec: RequestSpec, stream: bool) -> dict:
    return request_inputs(spec.prompt, spec.sampling, stream)


def generate_body(spec: RequestSpec, stream: bool) -> dict[str, Any]:
    """JSON body for HTTP `generate` / `generate_stream`."""
    return contract.generate_body(_inputs(spec, stream))


def infer_body(spec: RequestSpec) -> dict[str, Any]:
    """JSON body for HTTP `/infer` on a batching model: every input has shape [1, 1]."""
    return contract.infer_body(_inputs(spec, False), [1, 1])


def infer_output_tokens(body: dict[str, Any]) -> int:
    """`num_output_tokens` of an HTTP `/infer` answer; ValueError if it is missing."""
    if "error" in body:
        raise ValueError(body["error"])
    for out in body.get("outputs", []):
        if out.get("name") == "num_output_tokens":
            return int(np.asarray(out["data"]).reshape(-1)[0])
    raise ValueError(f"answer has no num_output_tokens output: {json.dumps(body)[:200]}")


def parse_sse_line(line: bytes | str) -> dict[str, Any] | None:
    """The JSON event of one `data: ...` line of generate_stream; None for blank lines and comments."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if not payload:
        return None
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return {"error": f"malformed SSE event: {payload[:200]}"}
    return event if isinstance(event, dict) else {"error": f"unexpected SSE event: {payload[:200]}"}


def event_tokens(event: dict[str, Any]) -> int:
    """Tokens carried by one generate_stream event (its `num_output_tokens`)."""
    value = event.get("num_output_tokens", 0)
    if isinstance(value, list):
        value = value[0] if value else 0
    return int(value)


def grpc_inputs(spec: RequestSpec, stream: bool, batched: bool) -> list:
    """tritonclient.grpc InferInputs of one request."""
    return contract.grpc_inputs(_inputs(spec, stream), [1, 1] if batched else [1])


def grpc_outputs() -> list:
    import tritonclient.grpc as grpcclient

    return [grpcclient.InferRequestedOutput("text_output"), grpcclient.InferRequestedOutput("num_output_tokens")]


def grpc_result_tokens(result) -> int:
    """Tokens in one gRPC response (0 for the empty final response)."""
    array = result.as_numpy("num_output_tokens")
    return 0 if array is None or array.size == 0 else int(array.reshape(-1)[0])


def grpc_is_final(result) -> bool:
    """Whether a streamed gRPC response is the request's last."""
    return contract.is_final_response(result.get_response())


# ---------------------------------------------------------------- OpenAI-compatible servers


def openai_completion_body(spec: RequestSpec, model: str) -> dict[str, Any]:
    """Streaming `/v1/completions` body with the same request (vLLM's sampling names are OpenAI's,
    plus `ignore_eos`, which vLLM, TGI and llama.cpp's server accept). The last event carries usage."""
    body = {"prompt": spec.prompt, "stream": True, "stream_options": {"include_usage": True}, **spec.sampling}
    if model:
        body["model"] = model
    return body


def openai_event(event: dict[str, Any]) -> tuple[int, int | None]:
    """(streamed pieces in this event: 0 or 1, completion_tokens if the event carries usage).

    A piece is a choice with text, or a choice of a step still going (`finish_reason` null) whose
    text is empty: vLLM sends those for tokens without text of their own (a special token, a
    character's first bytes), and counts them in its own TTFT. A closing choice with no text
    (llama.cpp's last event) and the usage event (`choices: []`) are not pieces."""
    usage = event.get("usage") or {}
    choices = event.get("choices") or []
    piece = any(choice.get("text") or ("text" in choice and choice.get("finish_reason") is None)
                for choice in choices)
    completion = usage.get("completion_tokens")
    return int(piece), int(completion) if completion is not None else None
