"""An OpenAI-compatible peer server as a child process on loopback: started, waited for, stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tritonllm.server.children import die_with_parent
from tritonllm.server.launcher import find_free_ports


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
        self.command = [arg.format(port=self.port) for arg in command]
        self.env = {**os.environ, **(env or {})}
        self.log_file = log_file
        self.health_path = health_path
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "PeerServer":
        log(f"starting {self.name}: {' '.join(self.command)} (log {self.log_file})")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=die_with_parent)
        started = time.monotonic()
        while time.monotonic() - started < self.ready_timeout:
            if self.process.poll() is not None:
                raise SystemExit(f"error: {self.name} exited with {self.process.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as resp:
                    if resp.status == 200:
                        log(f"{self.name} ready at {self.url} after {time.monotonic() - started:.0f} s")
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise SystemExit(f"error: {self.name} not healthy after {self.ready_timeout:.0f} s; see {self.log_file}")

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP): an idle llama-server's threads took 60-70 % of
        llm_inflight's tokens/s beside it here (74 against 211 tok/s), so a row runs with the others paused."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def __exit__(self, *exc) -> None:
        self.resume()  # a stopped process would not act on SIGTERM
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
