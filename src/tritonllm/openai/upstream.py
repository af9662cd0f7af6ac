"""Triton over async gRPC (`tritonclient.grpc.aio`): the served models, readiness, one generate call.

A request to the decoupled `llm_inflight` opens a bidirectional stream of its own on the shared
channel (HTTP/2 multiplexes them), sends one request and half-closes; the model answers one
response per token step, the last flagged `triton_final_response`. The batching models get a
unary infer call with `text_input` of shape [1, 1]. Every request carries the same set of inputs,
so Triton's batcher batches all of the front's requests together (it never batches requests whose
input sets differ). The prompt is never echoed by the model (the front echoes it when asked), and
each response reports its finish reason and token counts, which become OpenAI's `usage`.

Leaving a generate iteration early (the client went away, the task was cancelled) cancels the
request on the server: the stream's `cancel()`, which Triton turns into `is_cancelled()` for the
model, and the engine frees the slot within a step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from tritonllm_client.contract import first_value, grpc_inputs, is_final_response, model_info_from_config, request_inputs

CONFIG_TTL_S = 30.0  # how long a model's config is trusted before it is read again
READY_TTL_S = 1.0  # how long a readiness answer is reused (every /v1/models call would ask otherwise)


@dataclass(frozen=True)
class ServedModel:
    name: str
    decoupled: bool
    max_batch_size: int
    max_model_len: int | None
    spec: str | None  # config.pbtxt's `model` parameter (bundled, tiny, a directory, a hub id)

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0


@dataclass
class Piece:
    """One response of a model: new text, its token count, and on the last one why it ended."""

    text: str
    num_output_tokens: int
    num_input_tokens: int | None
    finish_reason: str | None  # set on the last piece only
    final: bool
    logprobs: dict | None = None  # the `logprobs` output (triton/logprobs_output.py), when asked


class UpstreamError(Exception):
    """Triton or the model refused or failed a request; `status` is the gRPC status, if any."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


def served_model(config: dict) -> ServedModel:
    info = model_info_from_config(config)
    params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
    max_len = params.get("max_model_len")
    return ServedModel(name=info.name, decoupled=info.decoupled, max_batch_size=info.max_batch_size,
                       max_model_len=int(max_len) if max_len and max_len.isdigit() else None,
                       spec=params.get("model") or None)


class Triton:
    """The models a front serves, on one Triton, over one gRPC channel."""

    def __init__(self, url: str, models: list[str], headers: dict[str, str] | None = None):
        self.url = url
        self.names = list(models)
        self.headers = headers
        self.client = grpcaio.InferenceServerClient(url)
        self._configs: dict[str, tuple[float, ServedModel]] = {}
        self._ready: tuple[float, dict[str, bool]] | None = None

    async def close(self) -> None:
        await self.client.close()

    # ------------------------------------------------------------------ what is served

    async def live(self) -> bool:
        try:
            return bool(await self.client.is_server_live(headers=self.headers, client_timeout=5))
        except InferenceServerException:
            return False

    async def server_ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready(headers=self.headers, client_timeout=5))
        except InferenceServerException:
            return False

    async def readiness(self, fresh: bool = False) -> dict[str, bool]:
        """model -> ready, for every model this front serves (reused for READY_TTL_S)."""
        now = time.monotonic()
        if not fresh and self._ready and now - self._ready[0] < READY_TTL_S:
            return self._ready[1]

        async def one(name: str) -> bool:
            try:
                return bool(await self.client.is_model_ready(name, headers=self.headers, client_timeout=5))
            except InferenceServerException:
                return False

        states = dict(zip(self.names, await asyncio.gather(*(one(n) for n in self.names))))
        self._ready = (now, states)
        return states

    async def model(self, name: str) -> ServedModel | None:
        """The config of a model this front serves; None if Triton does not know it (now)."""
        cached = self._configs.get(name)
        if cached and time.monotonic() - cached[0] < CONFIG_TTL_S:
            return cached[1]
        try:
            answer = await self.client.get_model_config(name, headers=self.headers, as_json=True, client_timeout=5)
        except InferenceServerException:
            if cached:
                return cached[1]
            return None
        model = served_model(answer["config"])
        self._configs[name] = (time.monotonic(), model)
        return model

    # ------------------------------------------------------------------ generation

    async def generate(self, model: ServedModel, prompt: str, sampling: dict[str, Any], stream: bool,
                       request_id: str) -> AsyncIterator[Piece]:
        """The responses of one request: a piece per token step (llm_inflight streaming) or one."""
        inputs = _tensors(model, prompt, sampling, stream and model.decoupled)
        if model.decoupled:
            async for piece in self._stream(model, inputs, request_id):
                yield piece
            return
        try:
            result = await self.client.infer(model.name, inputs, request_id=request_id, headers=self.headers)
        except InferenceServerException as exc:
            raise UpstreamError(exc.message(), exc.status()) from None
        yield _piece(result, final=True)

    async def _stream(self, model: ServedModel, inputs: list[InferInput], request_id: str) -> AsyncIterator[Piece]:
        async def one_request():
            yield {"model_name": model.name, "inputs": inputs, "request_id": request_id}

        call = self.client.stream_infer(one_request(), headers=self.headers)
        done = False
        try:
            while True:
                try:
                    result, error = await call.__anext__()
                except StopAsyncIteration:
                    done = True
                    raise UpstreamError("the stream ended before the final response", "UNAVAILABLE") from None
                except grpc.RpcError as exc:
                    done = True
                    raise UpstreamError(exc.details() or str(exc), str(exc.code())) from None
                if error is not None:
                    done = True  # the model sent its one final response: an error
                    raise UpstreamError(error.message(), error.status())
                response = result.get_response()
                final = is_final_response(response)
                if response.outputs:
                    yield _piece(result, final)
                if final:
                    done = True
                    return
        finally:
            if not done:  # the caller left early: cancel upstream, so the engine frees the slot
                call.cancel()


def _tensors(model: ServedModel, prompt: str, sampling: dict[str, Any], stream: bool) -> list[InferInput]:
    return grpc_inputs(request_inputs(prompt, sampling, stream, return_num_input_tokens=True),
                       [1, 1] if model.batching else [1])


def _piece(result, final: bool) -> Piece:
    def value(name: str):
        return first_value(result.as_numpy(name))

    inputs = value("num_input_tokens")
    logprobs = value("logprobs")
    return Piece(text=value("text_output") or "", num_output_tokens=int(value("num_output_tokens") or 0),
                 num_input_tokens=int(inputs) if inputs is not None else None,
                 finish_reason=(value("finish_reason") or None) if final else None, final=final,
                 logprobs=json.loads(logprobs) if logprobs else None)

