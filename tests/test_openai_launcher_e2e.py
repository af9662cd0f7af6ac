"""`tritonllm-server` with its OpenAI front, as a user runs it: the banner's URL and curl, the API key,
a full queue answered 503 with the engine's message, and SIGTERM ending every open request through
the front before both processes exit.

One launcher, on a repository of `llm_inflight` alone with 1 slot and room for 1 waiting request,
so that a full queue is certain (the test-only `[[hold:N]]` prompts keep requests open).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import requests
from conftest import TEST_SERVER_ENV
from e2e_clients import TIMEOUT, configured_repository, engine_parameter, wait_for_metric

from tritonllm.engine.faults import hold_prompt
from tritonllm.server.tritonserver import find_free_ports

KEY = "test-key-0123456789"


def _post(port: int, body: dict, key: str = KEY) -> http.client.HTTPConnection:
    """Send a request and leave its answer unread (it may not come until the test lets it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return conn


def test_launcher_serves_openai_with_a_key_refuses_a_full_queue_and_stops_with_every_stream_ended(tmp_path):
    repo = configured_repository(tmp_path / "repo", {"llm_inflight": {
        **engine_parameter("max_num_seqs", "1"), **engine_parameter("max_queue_size", "1"),
        **engine_parameter("shutdown_grace_seconds", "1")}})
    http_port, grpc_port, metrics_port, port = find_free_ports(4)
    cmd = [sys.executable, "-m", "tritonllm.server.launcher", "--model-repository", str(repo),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--openai-port", str(port), "--log-file", str(tmp_path / "server.log")]
    env = {**os.environ, **TEST_SERVER_ENV, "TRITONLLM_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True).start()
    try:
        banner = []
        while not banner or "Ctrl-C stops the server" not in banner[-1]:
            line = lines.get(timeout=240)
            assert line is not None, "the launcher exited before its banner:\n" + "".join(banner)
            banner.append(line)
        text = "".join(banner)
        base = f"http://127.0.0.1:{port}/v1"
        assert f"OpenAI:  {base}" in text, text
        assert f"curl -s {base}/chat/completions" in text and "Bearer $TRITONLLM_API_KEY" in text
        assert KEY not in text  # a key the user gave is never printed

        # the key: /v1 needs it, health does not
        refused = requests.get(f"{base}/models", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(f"{base}/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        models = requests.get(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["llm_inflight"]
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200

        # a full queue: one request runs (held), one waits, the next is refused with the engine's message
        metrics = SimpleNamespace(metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
        running = _post(port, {"model": "llm_inflight", "prompt": hold_prompt(1, "a"), "max_tokens": 20,
                               "stream": True})
        assert wait_for_metric(metrics, "tritonllm_num_requests_running", lambda v: v == 1) == 1
        answer = running.getresponse()
        assert answer.status == 200 and answer.read(6) == b"data: "  # its first token came
        waiting = _post(port, {"model": "llm_inflight", "prompt": hold_prompt(1, "b"), "max_tokens": 20,
                               "stream": True})
        assert wait_for_metric(metrics, "tritonllm_num_requests_waiting", lambda v: v == 1) == 1
        full = requests.post(f"{base}/completions", json={"model": "llm_inflight", "prompt": "c", "max_tokens": 2},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
        assert full.status_code == 503, full.text
        assert full.json()["error"]["code"] == "queue_full" and "queue is full" in full.json()["error"]["message"]

        # SIGTERM: the waiting request is refused (503), the running one ends its stream with an
        # error event and [DONE]; then the launcher, Triton and the front all exit
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        refused_waiting = waiting.getresponse()
        assert refused_waiting.status == 503 and "shutting down" in json.loads(refused_waiting.read())["error"]["message"]
        rest = answer.read().decode()
        events = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"], rest
        assert proc.wait(timeout=90) == 0
        print(f"every request ended and the launcher exited {time.monotonic() - t0:.1f} s after SIGTERM")
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
            raise AssertionError("the OpenAI front outlived the launcher")
        except requests.ConnectionError:
            pass
    finally:
        if proc.poll() is None:  # only on failure: stop our own launcher by pid (it stops what it started)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
