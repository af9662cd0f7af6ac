"""Tests for tritonllm.server.launcher against the real tritonserver from nvidia-pytriton."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tritonllm.server import triton_install
from tritonllm.server.triton_install import ServerStartError, installed_triton, prepare_triton_home
from tritonllm.server.tritonserver import TritonServer, find_free_ports, parse_load_failures, still_loading

ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

ECHO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x.copy())]))
        return responses
"""

RAISING_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("broken on purpose")

    def execute(self, requests):
        return []
"""


def add_model(repo: Path, name: str, config: str = ECHO_CONFIG, model_py: str = ECHO_MODEL) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(model_py)


def make_server(repo: Path, tmp_path: Path, **kw) -> TritonServer:
    http, grpc, metrics = find_free_ports(3)
    return TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                        log_file=tmp_path / "server.log", **kw)


def test_find_free_ports_distinct():
    ports = find_free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_prepare_triton_home_is_idempotent(tmp_path):
    home = prepare_triton_home(tmp_path / "home")
    stub = home / "backends" / "python" / "triton_python_backend_stub"
    assert os.access(stub, os.X_OK)
    assert os.access(home / "bin" / "tritonserver", os.X_OK)
    mtime = stub.stat().st_mtime_ns
    assert prepare_triton_home(tmp_path / "home") == home
    assert stub.stat().st_mtime_ns == mtime  # not copied again


def test_echo_over_http_and_grpc_then_clean_stop(tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    repo = tmp_path / "repo"
    add_model(repo, "echo")
    server = make_server(repo, tmp_path)
    with server:
        print(f"ready in {server.ready_seconds:.2f} s")
        assert server.ready_seconds < 60
        # Collect the server and its backend stubs before stopping.
        root = psutil.Process(server.process.pid)
        procs = [root] + root.children(recursive=True)
        assert any("triton_python_backend_stub" in p.name() for p in procs)

        x = np.arange(4, dtype=np.float32)
        with httpclient.InferenceServerClient(server.http_url) as client:
            inp = httpclient.InferInput("INPUT0", [4], "FP32")
            inp.set_data_from_numpy(x)
            out = client.infer("echo", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, x)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            inp = grpcclient.InferInput("INPUT0", [4], "FP32")
            inp.set_data_from_numpy(x * 2)
            out = client.infer("echo", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, x * 2)

    assert server.process is None
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.server
@pytest.mark.parametrize("case", ["raises_in_initialize", "invalid_data_type"])
def test_broken_model_fails_fast(tmp_path, case):
    repo = tmp_path / "repo"
    add_model(repo, "echo")
    if case == "raises_in_initialize":
        add_model(repo, "broken_init", model_py=RAISING_MODEL)
        name, reason = "broken_init", "broken on purpose"
    else:
        add_model(repo, "broken_type", config=ECHO_CONFIG.replace("TYPE_FP32", "TYPE_NOPE", 1))
        name, reason = "broken_type", "TYPE_NOPE"
    server = make_server(repo, tmp_path, ready_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as err:
        server.start()
    assert time.monotonic() - t0 < 30
    assert name in str(err.value) and reason in str(err.value)
    assert "'echo'" not in str(err.value)
    assert server.process is None


@pytest.mark.server
def test_slow_model_times_out_and_leaves_nothing(tmp_path):
    repo = tmp_path / "repo"
    add_model(repo, "slow", model_py=RAISING_MODEL.replace(
        'raise ValueError("broken on purpose")', "__import__('time').sleep(120)"))
    server = make_server(repo, tmp_path, ready_timeout=3)
    with pytest.raises(ServerStartError, match="not ready after 3 s"):
        server.start()
    assert server.process is None
    left = [(p.pid, p.info["name"], p.info["status"])
            for p in psutil.process_iter(["cmdline", "name", "status"])
            if str(repo) in " ".join(p.info["cmdline"] or [])]
    assert not left


STUCK_MODEL = """
import time

from tritonllm.triton import stack_dumps


def stuck_in_initialize():
    time.sleep(300)


class TritonPythonModel:
    def initialize(self, args):
        stack_dumps.enable()
        stuck_in_initialize()

    def execute(self, requests):
        return []
"""


@pytest.mark.server
def test_a_model_stuck_loading_is_named_with_its_stack(tmp_path):
    """A start that times out names the model still loading and shows where its stub is stuck: the
    stubs dump their stacks on SIGUSR1 (triton/stack_dumps.py), asked for before the server stops."""
    repo = tmp_path / "repo"
    add_model(repo, "stuck", model_py=STUCK_MODEL)
    add_model(repo, "echo")
    server = make_server(repo, tmp_path, ready_timeout=20)  # ample for a stub to reach initialize()
    with pytest.raises(ServerStartError) as err:
        server.start()
    message = str(err.value)
    assert "still loading: stuck\n" in message
    assert "stuck_in_initialize" in message and "the stubs' stacks:" in message


def test_still_loading_lists_models_neither_loaded_nor_failed():
    log = ('I1 model_lifecycle.cc:472] "loading: a:1"\nI1 model_lifecycle.cc:472] "loading: b:1"\n'
           'I1 model_lifecycle.cc:472] "loading: c:1"\nI2 model_lifecycle.cc:839] "successfully loaded \'a\'"\n')
    assert still_loading(log) == ["b", "c"]


def test_parse_load_failures_from_model_table():
    log = (
        "+-------+---------+-----------------------------+\n"
        "| Model | Version | Status                      |\n"
        "+-------+---------+-----------------------------+\n"
        "| bad   | 1       | UNAVAILABLE: Internal: oops |\n"
        "|       |         | At:                         |\n"
        "| good  | 1       | READY                       |\n"
    )
    assert parse_load_failures(log) == {"bad": "Internal: oops"}


@pytest.mark.server
def test_main_serves_until_sigterm(tmp_path):
    repo = tmp_path / "repo"
    add_model(repo, "echo")
    http, grpc, metrics = find_free_ports(3)
    cmd = [sys.executable, "-m", "tritonllm.server.launcher", "--model-repository", str(repo),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--log-file", str(tmp_path / "server.log")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_procs = []
    try:
        lines = []
        for line in proc.stdout:  # the banner ends with the Ctrl-C hint
            lines.append(line)
            if "Ctrl-C" in line:
                break
        banner = "".join(lines)
        assert "Triton ready in" in banner and "echo (READY)" in banner, banner
        assert f"http://127.0.0.1:{http}/v2/models/llm_inflight/generate" in banner
        server_procs = [c for c in psutil.Process(proc.pid).children(recursive=True)]
        assert any(p.name() == "tritonserver" for p in server_procs)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(server_procs, timeout=5)
        assert not alive
    finally:
        if proc.poll() is None:  # only on failure: stop our own launcher by pid
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
        for p in server_procs:  # and whatever it started
            if p.is_running():
                p.kill()


def test_main_exits_1_on_broken_model(tmp_path, capsys):
    from tritonllm.server.launcher import main

    repo = tmp_path / "repo"
    add_model(repo, "broken_init", model_py=RAISING_MODEL)
    http, grpc, metrics = find_free_ports(3)
    rc = main(["--model-repository", str(repo), "--http-port", str(http),
               "--grpc-port", str(grpc), "--metrics-port", str(metrics),
               "--log-file", str(tmp_path / "server.log")])
    assert rc == 1
    assert "broken_init" in capsys.readouterr().err


def test_beyond_loopback_the_admin_apis_get_a_key():
    from tritonllm.server.launcher import admin_key_for
    from tritonllm.server.tritonserver import ADMIN_APIS, ADMIN_KEY_HEADER, TritonServer

    assert admin_key_for("127.0.0.1", None) is None and admin_key_for("localhost", None) is None
    assert admin_key_for("127.0.0.1", "given") == "given"
    first, second = admin_key_for("0.0.0.0", None), admin_key_for("0.0.0.0", None)
    assert first and second and first != second and len(first) >= 20  # random each time
    cmd = TritonServer(host="0.0.0.0", admin_key="k", exit_timeout=12).command(Path("/triton"))
    protect = f"{','.join(ADMIN_APIS)}:{ADMIN_KEY_HEADER}=k"
    assert f"--http-restricted-api={protect}" in cmd and f"--grpc-restricted-protocol={protect}" in cmd
    assert "--exit-timeout-secs=12" in cmd and "--http-address=0.0.0.0" in cmd
    assert not any("restricted" in arg for arg in TritonServer().command(Path("/triton")))


def test_installed_triton_setting(tmp_path, monkeypatch):
    """TRITONLLM_TRITON_HOME: empty -> the wheel's server; auto -> NGC's /opt/tritonserver only where
    it exists; a directory must hold bin/tritonserver."""
    assert installed_triton("") is None and installed_triton(None) is None
    monkeypatch.setattr(triton_install, "NGC_TRITON_HOME", tmp_path / "ngc")
    assert installed_triton("auto") is None  # no NGC server here: the wheel's
    (tmp_path / "ngc" / "bin").mkdir(parents=True)
    (tmp_path / "ngc" / "bin" / "tritonserver").write_text("")
    assert installed_triton("auto") == tmp_path / "ngc"
    assert installed_triton(str(tmp_path / "ngc")) == tmp_path / "ngc"
    with pytest.raises(ServerStartError, match="no bin/tritonserver"):
        installed_triton(str(tmp_path))
