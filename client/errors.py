"""What can go wrong, as one-line messages with an exit code each (no tracebacks for the user).

Exit codes: 0 success, 1 the server refused or failed the request (its message is printed),
2 bad command line (argparse), 3 server not reachable, 4 model unknown or not ready,
130 cancelled with Ctrl-C (the request is cancelled on the server too).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_REQUEST = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_MODEL = 4
EXIT_CANCELLED = 130


class ClientError(Exception):
    """An expected failure: the CLI prints `error: <message>` and exits with `exit_code`."""

    exit_code = EXIT_REQUEST


class RequestFailed(ClientError):
    """The server answered the request with an error (bad sampling value, model error, ...)."""

    exit_code = EXIT_REQUEST

    def __init__(self, message: str):
        if "Stub process" in message and "not healthy" in message:
            message += (" (the model's Python process has died; Triton does not restart it: "
                        "the server must be restarted)")
        super().__init__(message)


class ServerUnreachable(ClientError):
    """Nothing answers at the URL (connection refused, wrong port, timeout)."""

    exit_code = EXIT_UNREACHABLE

    def __init__(self, url: str, protocol: str, detail: str = ""):
        message = f"cannot connect to Triton at {url} over {protocol}: server not reachable"
        if detail:
            message += f" ({detail})"
        super().__init__(message)


class ModelUnavailable(ClientError):
    """The model is unknown to the server, or known but not ready."""

    exit_code = EXIT_MODEL


def unknown_model(model: str, url: str, known: list[str] | None) -> ModelUnavailable:
    """`known` is None when the server does not list its models (restricted repository API)."""
    listing = "not listed to this client" if known is None else ", ".join(sorted(known)) or "none"
    return ModelUnavailable(f"model '{model}' is unknown to the server at {url} (models: {listing})")


def model_not_ready(model: str, state: str, reason: str = "") -> ModelUnavailable:
    message = f"model '{model}' is not ready (state {state or 'UNKNOWN'})"
    if reason:
        message += f": {reason}"
    return ModelUnavailable(message)
