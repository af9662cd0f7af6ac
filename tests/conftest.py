"""Shared fixtures: one real tritonserver serving the repository's three models on free loopback ports.

The models run the tiny random Llama (TRITONLLM_MODEL=tiny) so the suite stays fast on CPU;
a few tests load the bundled SmolLM2 in-process. The server runs with the test-only faults on
(engine/faults.py): a prompt with `[[hold:N]]` makes a request that cannot finish by itself, so
tests that need a request still running are certain of it.

Every test is in one tier (a pytest marker, set here): `unit` (one piece in process, the tiny model),
`model` (in process on the bundled real model: its invariance and parity), `server` (a real
tritonserver, front or peer on loopback), `container` (images built and run). `pytest -m unit` is the
quick loop; the README's command runs them all.

When a test that uses a server fails, its report carries what that server logged during the
test (pytest prints it under the failure; `-rfE` lists every failure at the end).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from tritonllm.engine import faults
from tritonllm.engine.model_loader import DTYPE_ENV, load_model
from tritonllm.server.triton_install import ServerStartError
from tritonllm.server.tritonserver import TritonServer, find_free_ports

# float32 everywhere in tests (servers inherit it), so that answers can be held to unbatched `generate`
# token for token (in bfloat16 Transformers' own forward uses other kernels). bfloat16, the `auto`
# default on CPUs with native bf16, is tested where a test says so: its batch invariance (alone ==
# under load, bit for bit) in test_batch_invariance.py.
os.environ[DTYPE_ENV] = "float32"
TEST_SERVER_ENV = {"TRITONLLM_MODEL": "tiny", faults.ENV: "1"}
LOG_LINES_ON_FAILURE = 200


def start_test_server(log_dir, env: dict[str, str] | None = None, **options) -> TritonServer:
    """A started tritonserver on free loopback ports with the tiny model (unless `env` names
    another) and test faults on.

    A start in which a model never finished loading is tried once more, with a warning that carries
    the stuck stub's stacks: one CI run (of ~50 starts) had llm_static stuck in initialize() with
    nothing in its log, not reproduced here in 40 starts under load; the warning shows where."""
    for attempt, log_name in enumerate(("server.log", "server.retry.log")):
        http, grpc, metrics = find_free_ports(3)
        server = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log_dir / log_name,
                              env={**TEST_SERVER_ENV, **(env or {})}, ready_timeout=180, **options)
        try:
            return server.start()
        except ServerStartError as exc:
            if attempt or not server.stuck_loading:
                raise
            warnings.warn(f"a model stuck loading; starting the server again: {exc}")


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """The repository's model_repository/ on a real tritonserver (tiny model), stopped at the end."""
    server = start_test_server(tmp_path_factory.mktemp("triton"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model():
    """The same tiny model the server runs, in-process: (model, tokenizer)."""
    return load_model("tiny", "cpu")


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Greedy text of in-process `model.generate`, stopped at EOS, as the models must return it."""
    model, tokenizer = tiny_model
    eos = {tokenizer.eos_token_id, *np.atleast_1d(model.generation_config.eos_token_id or [])}
    cache: dict[tuple[str, int], str] = {}

    def greedy(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            ids = tokenizer.encode(prompt)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_tokens, do_sample=False)
            new = out[0, len(ids):].tolist()
            for i, token in enumerate(new):
                if token in eos:
                    new = new[: i + 1]
                    break
            cache[prompt, max_tokens] = tokenizer.decode(new, skip_special_tokens=True)
        return cache[prompt, max_tokens]

    return greedy


# ---------------------------------------------------------------- test tiers

SERVER_FIXTURES = {"triton_server", "locust_runs", "front", "bundled_bf16_server", "cluster", "fresh_cluster",
                   "strict_server", "tight_server", "bundled_server"}
CONTAINER_MODULES = {"test_containers_e2e"}
MODEL_MODULES = {"test_batch_invariance"}  # long in-process runs on either model
SERVER_MODULES = {"test_openai_launcher_e2e", "test_soak", "test_termination", "test_children",
                  "test_load_balancer_e2e"}


def pytest_collection_modifyitems(items):
    """Each test's tier: container by module; server where it uses a server fixture, sits in a module of
    server tests or is marked `server` itself; model where it runs the bundled model in process (its
    name or parameters say `bundled`) or sits in a module of long in-process runs; unit otherwise."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in CONTAINER_MODULES:
            item.add_marker(pytest.mark.container)
        elif (module in SERVER_MODULES or SERVER_FIXTURES & set(item.fixturenames)
              or item.get_closest_marker("server")):
            item.add_marker(pytest.mark.server)
        elif "bundled" in item.nodeid or module in MODEL_MODULES:
            item.add_marker(pytest.mark.model)
        else:
            item.add_marker(pytest.mark.unit)


# ---------------------------------------------------------------- server logs of failed tests

_LOG_OFFSETS = pytest.StashKey[dict]()


def _servers(item) -> list[TritonServer]:
    return [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, TritonServer)]


def _log_size(server: TritonServer) -> int:
    try:
        return server.log_file.stat().st_size
    except OSError:
        return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_LOG_OFFSETS] = {id(s): _log_size(s) for s in _servers(item)}
    if not report.failed:
        return
    offsets = item.stash.get(_LOG_OFFSETS, {})
    for server in _servers(item):
        with open(server.log_file, "rb") as log:
            data = log.read()
        text = data.decode(errors="replace")
        during = data[offsets.get(id(server), 0):].decode(errors="replace").splitlines()
        title = f"tritonserver log during this test ({server.log_file})"
        if not during:  # nothing logged meanwhile: the lines before it may still tell
            title = f"tritonserver logged nothing during this test; its last lines before ({server.log_file})"
            during = text.splitlines()[-30:]
        report.sections.append((title, "\n".join(during[-LOG_LINES_ON_FAILURE:])))
