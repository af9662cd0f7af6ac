"""What a request can get wrong, as a type: which field and what kind of fault.

The engine's checks raise RequestError; the Triton adapters answer it with the error code of its
kind, the OpenAI front with the HTTP status and `param` of its kind and field. Nobody reads a
status or a field out of the message text. Plain Python (the client side imports it too).
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class Fault(Enum):
    """A kind of fault, with the HTTP status and the Triton error code it is answered with."""

    INVALID = "invalid"  # a value of the wrong type or out of range, an unknown key or input
    TOO_LONG = "too_long"  # the prompt and its tokens do not fit the model's context or KV cache
    UNSUPPORTED = "unsupported"  # well-formed, but this model does not do it (streaming from a batcher)
    UNAVAILABLE = "unavailable"  # the server cannot take it now (a full queue, shutting down)

    @property
    def http_status(self) -> int:
        return 503 if self is Fault.UNAVAILABLE else 400

    @property
    def triton_code(self) -> str:
        """A `pb_utils.TritonError` code name (Triton's HTTP front answers INVALID_ARG with 400)."""
        return "UNAVAILABLE" if self is Fault.UNAVAILABLE else "INVALID_ARG"


class RequestError(ValueError):
    """A request the server cannot serve; the message names what is wrong, `field` the input or
    sampling key at fault (None: the request as a whole)."""

    def __init__(self, message: str, field: str | None = None, fault: Fault = Fault.INVALID):
        super().__init__(message)
        self.field, self.fault = field, fault


def parse_bool(value: Any, field: str, label: str) -> bool:
    """A boolean from a bool (numpy's too), 0 or 1, or the text true/false/1/0 in any case: the one
    spelling every input, sampling key and config parameter takes. `label` names the value in the
    error, e.g. "input 'stream'"."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # a numpy scalar
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if isinstance(text, str) and text.strip().lower() in ("true", "false", "1", "0"):
        return text.strip().lower() in ("true", "1")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise RequestError(f"{label} must be a boolean, got {shown}", field)
