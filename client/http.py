"""Talking to the models over HTTP with plain `requests`.

Three ways in, chosen with --http-mode:
- `generate`: POST /v2/models/<m>/generate, one JSON answer (Triton's generate extension).
- `generate_stream`: the same body on /generate_stream; the answer is server-sent events, one
  `data: {...}` per response. Only the decoupled `llm_inflight` sends several (stream=true).
- `infer`: POST /v2/models/<m>/infer with KServe v2 JSON tensors; batching models only (Triton
  refuses /infer for decoupled models), with the batch dimension spelled out: shape [1, 1].
The generate endpoints add the batch dimension by themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import requests

from tritonllm_client.contract import (Chunk, ModelInfo, chunk_from_outputs, generate_body, infer_body,
                                       model_info_from_config, request_inputs)
from tritonllm_client.errors import ClientError, RequestFailed, ServerUnreachable, model_not_ready, unknown_model

DEFAULT_URL = "localhost:8000"
MODES = ("generate", "generate_stream", "infer")


class HttpSession:
    protocol = "HTTP"

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 10.0):
        self.url = url if "://" in url else f"http://{url}"
        self.url = self.url.rstrip("/")
        self.timeout = timeout
        self.http = requests.Session()
        self._response: requests.Response | None = None

    # --- what the server has ------------------------------------------------------------------

    def get(self, path: str, method: str = "GET") -> requests.Response:
        """A metadata call; a server that does not answer is 'not reachable'."""
        try:
            return self.http.request(method, self.url + path, timeout=self.timeout)
        except requests.ConnectionError as exc:
            raise ServerUnreachable(self.url, self.protocol, _short(exc)) from None
        except requests.Timeout:
            raise ServerUnreachable(self.url, self.protocol, "no answer in time") from None

    def get_json(self, path: str, method: str = "GET") -> Any:
        response = self.get(path, method)
        if response.status_code != 200:
            raise RequestFailed(f"{path}: {_error_message(response)}")
        return response.json()

    def repository_index(self) -> list[dict]:
        return self.get_json("/v2/repository/index", method="POST")

    def model_info(self, model: str) -> ModelInfo:
        """The model's config; raises ServerUnreachable or ModelUnavailable."""
        if self.get("/v2/repository/index", method="POST").status_code == 403:
            return self._model_info_without_index(model)  # admin APIs restricted (server beyond loopback)
        index = self.repository_index()
        entries = [entry for entry in index if entry.get("name") == model]
        if not entries:
            raise unknown_model(model, self.url, sorted({entry.get("name", "?") for entry in index}))
        if not any(entry.get("state") == "READY" for entry in entries):
            raise model_not_ready(model, entries[0].get("state", ""), entries[0].get("reason", ""))
        return model_info_from_config(self.get_json(f"/v2/models/{model}/config"))

    def _model_info_without_index(self, model: str) -> ModelInfo:
        response = self.get(f"/v2/models/{model}/config")
        if response.status_code != 200:
            raise unknown_model(model, self.url, None)
        if self.get(f"/v2/models/{model}/ready").status_code != 200:
            raise model_not_ready(model, "UNAVAILABLE")
        return model_info_from_config(response.json())

    # --- generation ---------------------------------------------------------------------------

    def generate(self, info: ModelInfo, prompt: str, sampling: dict, mode: str = "generate") -> Iterator[Chunk]:
        """Yield the responses of one request; leaving early closes the connection."""
        if mode == "infer":
            if info.decoupled:
                raise ClientError(f"{info.name} is decoupled: Triton serves it on gRPC streams and "
                                  "HTTP generate(_stream), not on /infer; use --http-mode generate_stream")
            return self._infer(info, prompt, sampling)
        if mode not in MODES:
            raise ClientError(f"unknown HTTP mode {mode!r}; one of {', '.join(MODES)}")
        # Only a decoupled model streams; the others answer once, also on generate_stream.
        stream = info.decoupled and mode == "generate_stream"
        body = generate_body(request_inputs(prompt, sampling, stream))
        return self._generate(info, f"/v2/models/{info.name}/{mode}", body, sse=mode == "generate_stream")

    def _post(self, info: ModelInfo, path: str, body: dict, stream: bool) -> requests.Response:
        try:
            response = self.http.post(self.url + path, json=body, stream=stream, timeout=(self.timeout, None))
        except requests.RequestException as exc:
            raise RequestFailed(f"{info.name}: HTTP request failed: {_short(exc)}") from None
        if response.status_code != 200:
            message = _error_message(response)
            response.close()
            raise RequestFailed(f"{info.name}: {message}")
        return response

    def _generate(self, info: ModelInfo, path: str, body: dict, sse: bool) -> Iterator[Chunk]:
        response = self._post(info, path, body, stream=sse)
        self._response = response
        try:
            if not sse:
                yield chunk_from_outputs(response.json())
                return
            # chunk_size=None: hand over each event as it arrives (no 1 KiB buffering).
            for line in response.iter_lines(chunk_size=None, decode_unicode=False):
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:].decode("utf-8"))
                if "error" in event:
                    raise RequestFailed(f"{info.name}: {event['error']}")
                yield chunk_from_outputs(event)
        except requests.RequestException as exc:
            raise RequestFailed(f"{info.name}: connection lost: {_short(exc)}") from None
        finally:
            self._response = None
            response.close()  # also when the caller stops early: the server sees the disconnect

    def _infer(self, info: ModelInfo, prompt: str, sampling: dict) -> Iterator[Chunk]:
        body = infer_body(request_inputs(prompt, sampling, stream=False), info.shape())
        response = self._post(info, f"/v2/models/{info.name}/infer", body, stream=False)
        outputs = {output["name"]: output.get("data") for output in response.json().get("outputs", [])}
        yield chunk_from_outputs(outputs)

    def cancel(self) -> None:
        response = self._response
        if response is not None:
            response.close()

    def close(self) -> None:
        self.http.close()


def _error_message(response: requests.Response) -> str:
    """The server's `{"error": ...}`, also when it comes as an event (generate_stream answers so)."""
    text = response.text.strip()
    if text.startswith("data:"):
        text = text.splitlines()[0][5:]
    try:
        return json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {text[:200]}"


def _short(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    return type(exc).__name__
