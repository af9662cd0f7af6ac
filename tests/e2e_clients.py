"""Clients and waits shared by the end-to-end tests: real tritonclient gRPC/HTTP calls and HTTP
generate, Triton's statistics and our metrics read until a condition holds, and copies of the
model repository with edited configs.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from tritonllm.server.openai_front import OpenAIFront
from tritonllm.server.tritonserver import DEFAULT_MODEL_REPOSITORY, find_free_ports
from tritonllm_client.contract import is_final_response

BATCHED = ("llm_dynamic", "llm_static")
TIMEOUT = 60  # seconds any one request may take before the test fails
SETTLE = 30  # seconds a number the server reports may take to arrive (it comes within a step)
GREEDY = {"temperature": 0}


# ---------------------------------------------------------------- request building


def _tensor(module, name: str, value, batched: bool):
    """One input tensor for tritonclient.grpc or .http; the batching models get a leading batch dim."""
    if isinstance(value, dict):
        value = json.dumps(value)
    if isinstance(value, np.ndarray):
        array, dtype = value, np_to_triton_dtype(value.dtype)
    elif isinstance(value, bool):
        array, dtype = np.array([value], dtype=bool), "BOOL"
    elif isinstance(value, (str, bytes)):
        array, dtype = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES"
    elif isinstance(value, int):
        array, dtype = np.array([value], dtype=np.int32), "INT32"
    else:
        array, dtype = np.array([value], dtype=np.float32), "FP32"
    if batched:
        array = array.reshape(1, -1)
    tensor = module.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def tensors(module, model: str, **inputs):
    return [_tensor(module, name, value, model in BATCHED) for name, value in inputs.items()]


def text_of(result) -> str:
    return result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")


def scalar(result, name: str):
    value = result.as_numpy(name)
    assert value is not None, f"output {name!r} missing"
    value = value.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else int(value)


# ---------------------------------------------------------------- clients


@dataclass
class StreamResult:
    texts: list[str] = field(default_factory=list)  # text_output of every response that has one
    results: list = field(default_factory=list)  # every InferResult with outputs
    finals: int = 0  # responses flagged triton_final_response
    after_final: int = 0  # responses that came after the final one (must stay 0)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class GrpcStream:
    """One gRPC stream to llm_inflight; collects responses by request id until each is final."""

    def __init__(self, server):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: dict[str, StreamResult] = {}
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self.client.start_stream(callback=self._callback)

    def _callback(self, result, error):
        with self.changed:
            if error is not None:
                self.errors.append(str(error))
            else:
                response = result.get_response()
                state = self.results.setdefault(response.id, StreamResult())
                if state.finals:
                    state.after_final += 1
                if response.outputs:
                    state.results.append(result)
                    if result.as_numpy("text_output") is not None:
                        state.texts.append(text_of(result))
                if is_final_response(response):
                    state.finals += 1
            self.changed.notify_all()

    def send(self, request_id: str, model: str = "llm_inflight", **inputs) -> None:
        self.results.setdefault(request_id, StreamResult())
        self.client.async_stream_infer(model, tensors(grpcclient, model, **inputs), request_id=request_id,
                                       enable_empty_final_response=True)

    def wait(self, request_ids, timeout: float = TIMEOUT) -> None:
        """Until every id has its final response, or an error came; fail on timeout."""
        def done():
            return self.errors or all(self.results[r].finals for r in request_ids)
        with self.changed:
            assert self.changed.wait_for(done, timeout), f"stream did not end within {timeout} s"

    def wait_first_piece(self, request_ids, timeout: float = TIMEOUT) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: all(self.results[r].texts for r in request_ids), timeout)

    def close(self, cancel: bool = False) -> None:
        if self.client is not None:
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()
            self.client = None


def stream_one(server, **inputs) -> StreamResult:
    """One request to llm_inflight on its own gRPC stream; fails on an error."""
    stream = GrpcStream(server)
    try:
        stream.send("one", **inputs)
        stream.wait(["one"])
        assert not stream.errors, stream.errors
        return stream.results["one"]
    finally:
        stream.close(cancel=True)


def stream_error(server, **inputs) -> str:
    """One request to llm_inflight on its own gRPC stream; returns the error it must get."""
    stream = GrpcStream(server)
    try:
        stream.send("bad", **inputs)
        stream.wait(["bad"])
        assert len(stream.errors) == 1, f"expected an error, got {stream.results['bad']}"
        return stream.errors[0]
    finally:
        stream.close(cancel=True)


def as_json_body(inputs: dict) -> dict:
    """Inputs as a generate-endpoint JSON body (sampling_parameters as a JSON string)."""
    return {k: json.dumps(v) if isinstance(v, dict) else v for k, v in inputs.items()}


def generate(server, model: str, **body) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=TIMEOUT)


def generate_stream(server, model: str, **body) -> list[dict]:
    """Every SSE event of one generate_stream call, until the server ends it."""
    events = []
    deadline = time.monotonic() + TIMEOUT
    with requests.post(f"http://{server.http_url}/v2/models/{model}/generate_stream", json=body,
                       stream=True, timeout=TIMEOUT) as response:
        for line in response.iter_lines(chunk_size=None):
            assert time.monotonic() < deadline, "generate_stream did not end in time"
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
    return events


def http_infer(server, model: str, **inputs):
    with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT) as client:
        return client.infer(model, tensors(httpclient, model, **inputs))


def grpc_infer(server, model: str, timeout: float = TIMEOUT, **inputs):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        return client.infer(model, tensors(grpcclient, model, **inputs), client_timeout=timeout)


def concurrently(calls, timeout: float = TIMEOUT * 2):
    """Run zero-argument callables at once; return their results in order (re-raising errors)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result(timeout=timeout) for f in futures]


# ---------------------------------------------------------------- server state


def model_stats(server, model: str) -> dict:
    response = requests.get(f"http://{server.http_url}/v2/models/{model}/stats", timeout=10)
    response.raise_for_status()
    return response.json()["model_stats"][0]


def batch_counts(stats: dict) -> dict[int, int]:
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}


def metric(server, name: str, model: str = "llm_inflight") -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    match = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    assert match, f"metric {name} for {model} not exported"
    return float(match.group(1))


def wait_for_metric(server, name: str, predicate, timeout: float = SETTLE, model: str = "llm_inflight") -> float:
    """The metric's value once `predicate` holds, or its last value after `timeout` (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric(server, name, model)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def wait_for_batches(server, model: str, before: dict, predicate, timeout: float = SETTLE) -> dict[int, int]:
    """Batches run since `before` (size -> count) once `predicate` holds, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        after = batch_counts(model_stats(server, model))
        grown = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
        if predicate(grown) or time.monotonic() > deadline:
            return grown
        time.sleep(0.05)


# ---------------------------------------------------------------- a server whose batches are certain

def configured_repository(dest, models: dict[str, dict[str, str]]):
    """A copy of model_repository/ with only `models`, each config.pbtxt edited: {regex: replacement}."""
    import shutil

    for model, edits in models.items():
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / model, dest / model)
        config = dest / model / "config.pbtxt"
        text = config.read_text()
        for pattern, replacement in edits.items():
            text, n = re.subn(pattern, replacement, text)
            assert n == 1, f"{model}: {pattern!r} matched {n} times"
        config.write_text(text)
    return dest


def engine_parameter(key: str, value: str) -> dict[str, str]:
    return {rf'(key: "{key}", value: {{ string_value: ")[^"]*': rf"\g<1>{value}"}


def started_front(server, log_dir, tokenizer: str) -> OpenAIFront:
    """The OpenAI front on a free loopback port, in front of a test server's gRPC."""
    (port,) = find_free_ports(1)
    front = OpenAIFront(server.grpc_url, port=port, tokenizer=tokenizer, log_file=log_dir / "openai.log",
                        ready_timeout=120)
    front.start()
    return front
