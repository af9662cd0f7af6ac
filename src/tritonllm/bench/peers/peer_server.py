"""An OpenAI-compatible peer server as a child process on loopback: started, waited for, stopped."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tritonllm.server.children import Child, http_status
from tritonllm.server.tritonserver import find_free_ports


def log(msg: str) -> None:
    print(f"[bench-peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PeerServer:
    """`command` (given the port) serving on 127.0.0.1; ready when GET `health_path` answers 200.
    A context manager: the whole process group is stopped on exit."""

    def __init__(self, name: str, command: list[str], log_file: Path, env: dict[str, str] | None = None,
                 health_path: str = "/health", ready_timeout: float = 600.0, port: int | None = None):
        self.name = name
        self.port = port or find_free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.child = Child([arg.format(port=self.port) for arg in command], log_file, {**os.environ, **(env or {})})
        self.log_file = log_file
        self.health_path = health_path
        self.ready_timeout = ready_timeout

    @property
    def command(self) -> list[str]:
        return self.child.command

    def __enter__(self) -> "PeerServer":
        log(f"starting {self.name}: {' '.join(self.command)} (log {self.log_file})")
        started = time.monotonic()
        self.child.start()
        problem = self.child.wait_until(lambda: http_status(self.url + self.health_path) == 200, self.ready_timeout,
                                        interval=0.5)
        if problem is not None:
            self.__exit__()
            raise SystemExit(f"error: {self.name}: {problem}; see {self.log_file}")
        log(f"{self.name} ready at {self.url} after {time.monotonic() - started:.0f} s")
        return self

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP): an idle llama-server's threads took 60-70 % of
        llm_inflight's tokens/s beside it here (74 against 211 tok/s), so a row runs with the others paused."""
        if self.child.is_running():
            self.child.signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.child.is_running():
            self.child.signal(signal.SIGCONT)

    def __exit__(self, *exc) -> None:
        self.resume()  # a stopped process would not act on SIGTERM
        self.child.stop(30)
