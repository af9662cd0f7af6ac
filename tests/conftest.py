"""Shared fixtures: one real tritonserver serving the repository's three models on free loopback ports.

The models run the tiny random Llama (TRITONLLM_MODEL=tiny) so the suite stays fast on CPU;
a few tests load the bundled SmolLM2 in-process.
"""

from __future__ import annotations

import pytest

from tritonllm.models import load_model
from tritonllm.server.launcher import TritonServer, find_free_ports


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """The repository's model_repository/ on a real tritonserver (tiny model), stopped at the end."""
    http, grpc, metrics = find_free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    server = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log,
                          env={"TRITONLLM_MODEL": "tiny"}, ready_timeout=180)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model():
    """The same tiny model the server runs, in-process: (model, tokenizer)."""
    return load_model("tiny", "cpu")
