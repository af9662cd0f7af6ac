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
from pathlib import Path

from tritonllm.server.children import Child, http_status


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
        self.child: Child | None = None

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

    @property
    def process(self) -> subprocess.Popen | None:
        return self.child.process if self.child is not None else None

    def start(self, ready: bool = True) -> "OpenAIFront":
        """Start it and wait until /health/ready answers 200 (Triton, its models and the tokenizer ready);
        `ready=False`: only until it answers at all."""
        if self.child is not None:
            raise RuntimeError("tritonllm-openai already started")
        env = {**os.environ, **self.env}
        if self.api_key:
            env["TRITONLLM_API_KEY"] = self.api_key  # not on the command line, where `ps` shows it
        self.child = Child(self.command(), self.log_file, env)
        self.child.start()

        def answers() -> bool:
            status = http_status(f"{self.root}/health/ready")
            return status == 200 or (status is not None and not ready)

        problem = self.child.wait_until(answers, self.ready_timeout)
        if problem is None:
            return self
        exited = not self.child.is_running()
        self.stop()
        if exited:
            raise FrontStartError(f"tritonllm-openai {problem.split(' ', 1)[1]}; last lines of {self.log_file}:\n"
                                  + "\n".join(self.read_log().splitlines()[-15:]))
        raise FrontStartError(f"tritonllm-openai not ready after {self.ready_timeout:.0f} s (log: {self.log_file})")

    def read_log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def is_running(self) -> bool:
        return self.child is not None and self.child.is_running()

    def terminate(self) -> None:
        if self.is_running():
            self.child.signal(signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM (open requests may end), then SIGKILL after `timeout` (default: the graceful timeout + 5 s)."""
        if self.child is None:
            return
        self.child.stop(self.graceful_timeout + 5 if timeout is None else timeout)
        self.child = None

    def __enter__(self) -> "OpenAIFront":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
