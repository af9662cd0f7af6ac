"""OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` and the status of each failure.

A request the front's own checks refuse (the engine's RequestError) gets the status of its fault and
`param` of its field. From Triton a failure comes two ways: a unary call raises with a gRPC status
(the models answer each fault with its Triton error code), a stream response carries only the
model's message, so there the message's marks decide. Both are mapped here, so a client sees the status OpenAI would use:
400 for a request the model refuses, 404 for an unknown model, 503 when a queue is full or the
server is shutting down (with the engine's own message), 500 when the model failed.
"""

from __future__ import annotations

from typing import Any

from tritonllm.errors import RequestError


class OpenAIError(Exception):
    """A failure to answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def from_request_error(exc: RequestError, message: str | None = None, param: str | None = None) -> OpenAIError:
    """The front's answer to a request the engine's checks refused: status from the fault, `param` from
    the field (or as given)."""
    return OpenAIError(exc.fault.http_status, message or str(exc), param=param or exc.field)


def unknown_model(name: str, served: list[str]) -> OpenAIError:
    listed = ", ".join(served) or "none is ready"
    return OpenAIError(404, f"The model '{name}' does not exist or is not ready; served: {listed}",
                       param="model", code="model_not_found")


# What the models and Triton say, and what it means for the client.
_UNAVAILABLE_MARKS = ("queue is full", "shutting down", "exceeds maximum queue size", "maximum queue size",
                      "not healthy", "is not ready", "unavailable")
_CLIENT_MARKS = ("sampling parameter", "exceeds max_model_len", "the prompt is empty", "input '", "cannot stream",
                 "not valid utf-8", "must be", "structured_outputs")
_GRPC_STATUS = {
    "INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "RESOURCE_EXHAUSTED": 503,
    "DEADLINE_EXCEEDED": 504, "CANCELLED": 499, "INTERNAL": 500, "UNKNOWN": 500, "UNIMPLEMENTED": 400,
}


def upstream_status(message: str, grpc_status: str | None) -> int:
    """The HTTP status for a Triton failure: by its gRPC status when it has one, else by its message."""
    lowered = message.lower()
    if any(mark in lowered for mark in _UNAVAILABLE_MARKS):
        return 503
    if grpc_status:
        name = grpc_status.rsplit(".", 1)[-1]
        if name in _GRPC_STATUS:
            return _GRPC_STATUS[name]
    if any(mark in lowered for mark in _CLIENT_MARKS):
        return 400
    return 500


def from_upstream(message: str, grpc_status: str | None, model: str) -> OpenAIError:
    status = upstream_status(message, grpc_status)
    code = "queue_full" if "queue" in message.lower() and status == 503 else None
    return OpenAIError(status, f"{model}: {message}", code=code)
