"""The OpenAI front as a child process: `tritonllm-server` starts one beside Triton, the tests too.

Its own process (not a thread of the launcher): its event loop never waits on the launcher, and
SIGTERM stops it as uvicorn stops, letting open requests end first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tritonllm.server.children import die_with_parent


class FrontStartError(RuntimeError):
    """The front exited or did not become ready in time."""


class OpenAIFront:
    def __init__(self, grpc_url: str, port: int = 9000, host: str = "127.0.0.1", models: list[str] | None = None,
                 tokenizer: str | None = None, api_key: str | None = None, log_file: str | Path | None = None,
                 ready_timeout: float = 120.0, graceful_timeout: float = 40.0, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None):
        self.grpc_url, self.port, self.host = grpc_url, port, host
        self.models = list(models) if models else None
        self.tokenizer, self.api_key = tokenizer, api_key
        self.ready_timeout, self.graceful_timeout = ready_timeout, graceful_timeout
        self.env = dict(env or {})
        self.extra_args = list(extra_args or [])
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="tritonllm-openai-", suffix=".log")
            os.close(fd)
        self.log_file = Path(log_file)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The base URL, as OpenAI clients take it (`.../v1`)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "tritonllm.openai.cli", "--grpc-url", self.grpc_url, "--host", self.host,
               "--port", str(self.port), "--graceful-timeout", str(self.graceful_timeout)]
        if self.models:
            cmd += ["--models", ",".join(self.models)]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        return cmd + self.extra_args

    def start(self, ready: bool = True) -> "OpenAIFront":
        """Start it and wait until /health/ready answers 200 (Triton, its models and the tokenizer ready);
        `ready=False`: only until it answers at all."""
        if self.process is not None:
            raise RuntimeError("tritonllm-openai already started")
        env = {**os.environ, **self.env}
        if self.api_key:
            env["TRITONLLM_API_KEY"] = self.api_key  # not on the command line, where `ps` shows it
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise FrontStartError(f"tritonllm-openai exited with code {code}; last lines of {self.log_file}:\n"
                                      + "\n".join(self.read_log().splitlines()[-15:]))
            status = _status(f"{self.root}/health/ready")
            if status == 200 or (status is not None and not ready):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise FrontStartError(f"tritonllm-openai not ready after {self.ready_timeout:.0f} s "
                                      f"(log: {self.log_file})")
            time.sleep(0.2)

    def read_log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        if self.is_running():
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM (open requests may end), then SIGKILL after `timeout` (default: the graceful timeout + 5 s)."""
        if self.process is None:
            return
        self.terminate()
        try:
            self.process.wait(timeout=self.graceful_timeout + 5 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> "OpenAIFront":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None
