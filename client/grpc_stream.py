"""Talking to the models over gRPC with `tritonclient.grpc`.

The decoupled `llm_inflight` answers on a bidirectional stream (`start_stream` +
`async_stream_infer` with `stream=true`): one response per token step, then an empty final
response (`enable_empty_final_response=True`, parameter `triton_final_response`). The batching
models refuse to stream and answer a unary call (`async_infer`, text_input of shape [1, 1]) once
their batch has run to its end. Both calls are asynchronous so that Ctrl-C can cancel them on the
server: `stop_stream(cancel_requests=True)` for the stream, the call's `cancel()` for unary.

One session keeps one stream open across requests (the chat sends each turn on it); it serves one
request at a time, so an error response without a request id belongs to the request in flight.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Iterator
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tritonllm_client.contract import (Chunk, ModelInfo, chunk_from_outputs, grpc_inputs, is_final_response,
                                       model_info_from_config, request_inputs)
from tritonllm_client.errors import RequestFailed, ServerUnreachable, model_not_ready, unknown_model

DEFAULT_URL = "localhost:8001"
_POLL_S = 0.1  # how often a waiting call wakes up, so that Ctrl-C is seen at once
_UNREACHABLE = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def _host_port(url: str) -> str:
    for scheme in ("grpc://", "http://", "https://"):
        if url.startswith(scheme):
            return url[len(scheme):].rstrip("/")
    return url


class GrpcSession:
    protocol = "gRPC"

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 10.0):
        self.url = _host_port(url)
        self.timeout = timeout
        self.client = grpcclient.InferenceServerClient(self.url)
        self._stream_queue: queue.Queue | None = None  # set while a stream is open
        self._pending = None  # the unary call in flight
        self._streaming = False  # a request is in flight on the stream
        self._ids = itertools.count(1)

    # --- what the server has ------------------------------------------------------------------

    def _check(self, call, *args, **kwargs) -> Any:
        """A metadata call; a server that does not answer is 'not reachable'."""
        try:
            return call(*args, client_timeout=self.timeout, **kwargs)
        except InferenceServerException as exc:
            if exc.status() in _UNREACHABLE and "restricted" not in exc.message():
                raise ServerUnreachable(self.url, self.protocol, _short(exc.message())) from None
            raise RequestFailed(exc.message()) from None

    def model_info(self, model: str) -> ModelInfo:
        """The model's config; raises ServerUnreachable or ModelUnavailable."""
        try:
            index = self._check(self.client.get_model_repository_index, as_json=True).get("models", [])
        except RequestFailed as exc:
            if "restricted" not in str(exc):
                raise
            return self._model_info_without_index(model)  # admin APIs restricted (server beyond loopback)
        entries = [entry for entry in index if entry.get("name") == model]
        if not entries:
            raise unknown_model(model, self.url, sorted({entry.get("name", "?") for entry in index}))
        if not any(entry.get("state") == "READY" for entry in entries):
            raise model_not_ready(model, entries[0].get("state", ""), entries[0].get("reason", ""))
        config = self._check(self.client.get_model_config, model, as_json=True)["config"]
        return model_info_from_config(config)

    def _model_info_without_index(self, model: str) -> ModelInfo:
        try:
            config = self._check(self.client.get_model_config, model, as_json=True)["config"]
        except RequestFailed:
            raise unknown_model(model, self.url, None) from None
        if not self._check(self.client.is_model_ready, model):
            raise model_not_ready(model, "UNAVAILABLE")
        return model_info_from_config(config)

    # --- generation ---------------------------------------------------------------------------

    def generate(self, info: ModelInfo, prompt: str, sampling: dict) -> Iterator[Chunk]:
        """Yield the responses of one request: a chunk per token step (stream) or one (unary).

        Leaving the iteration early (Ctrl-C, an exception, close()) cancels the request on the server.
        """
        if info.decoupled:
            return self._stream(info, prompt, sampling)
        return self._unary(info, prompt, sampling)

    def _stream(self, info: ModelInfo, prompt: str, sampling: dict) -> Iterator[Chunk]:
        if self._stream_queue is None:
            responses: queue.Queue = queue.Queue()
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
            self._stream_queue = responses
        responses = self._stream_queue
        request_id = f"cli-{next(self._ids)}"
        inputs = grpc_inputs(request_inputs(prompt, sampling, stream=True), info.shape())
        done = False
        try:
            self._streaming = True
            self.client.async_stream_infer(info.name, inputs, request_id=request_id,
                                           enable_empty_final_response=True)
            while True:
                result, error = _wait(responses)
                if error is not None:
                    done = True
                    if error.status() is not None:  # the stream itself broke: open a new one next time
                        self._close_stream(cancel=True)
                    raise RequestFailed(f"{info.name}: {error.message()}")
                response = result.get_response()
                if response.id != request_id:
                    continue  # a leftover of an earlier request
                final = is_final_response(response)
                if response.outputs:
                    yield _chunk(result, response)
                if final:
                    done = True
                    return
        except InferenceServerException as exc:  # async_stream_infer on a dead stream
            done = True
            self._close_stream(cancel=True)
            raise RequestFailed(f"{info.name}: {exc.message()}") from None
        finally:
            if not done:
                self.cancel()
            self._streaming = False

    def _unary(self, info: ModelInfo, prompt: str, sampling: dict) -> Iterator[Chunk]:
        responses: queue.Queue = queue.Queue()
        inputs = grpc_inputs(request_inputs(prompt, sampling, stream=False), info.shape())
        done = False
        try:
            self._pending = self.client.async_infer(
                info.name, inputs, callback=lambda result, error: responses.put((result, error)),
                request_id=f"cli-{next(self._ids)}")
            result, error = _wait(responses)
            done = True
            if error is not None:
                raise RequestFailed(f"{info.name}: {error.message()}")
            yield _chunk(result, result.get_response())
        finally:
            if not done:
                self.cancel()
            self._pending = None

    def cancel(self) -> None:
        """Cancel what is in flight, on the server too (safe from another thread)."""
        pending = self._pending
        if pending is not None:
            pending.cancel()
        self._close_stream(cancel=True)

    def _close_stream(self, cancel: bool) -> None:
        if self._stream_queue is not None:
            self._stream_queue = None
            self.client.stop_stream(cancel_requests=cancel)

    def close(self) -> None:
        try:  # cancel only what is in flight: cancelling an idle stream keeps Triton 2.51 from unloading the model
            self._close_stream(cancel=self._streaming)
        finally:
            self.client.close()


def _wait(responses: queue.Queue):
    while True:
        try:
            return responses.get(timeout=_POLL_S)
        except queue.Empty:
            continue


def _chunk(result, response) -> Chunk:
    return chunk_from_outputs({output.name: result.as_numpy(output.name) for output in response.outputs})


def _short(message: str) -> str:
    if "Connection refused" in message:
        return "connection refused"
    if "Deadline" in message or "deadline" in message:
        return "no answer in time"
    return message.splitlines()[0][:120]
