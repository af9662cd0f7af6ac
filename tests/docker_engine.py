"""A Docker engine for the container tests, on a machine that may not have one.

Debian's docker.io (dockerd), docker-compose (1.29, the v1 CLI) and debootstrap are installed
when missing; dockerd is started when no engine answers and stopped again afterwards. An engine
that was already running is left as it was.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from debian_packages import install_missing

PACKAGES = {"dockerd": "docker.io", "docker": "docker.io", "docker-compose": "docker-compose",
            "debootstrap": "debootstrap"}
START_TIMEOUT = 120  # seconds for a started dockerd to answer
STOP_TIMEOUT = 60  # seconds for it to stop its containers and exit


def _answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


class DockerEngine:
    """Make sure a Docker engine answers; stop() ends only a dockerd that start() started."""

    def __init__(self, log_file: Path):
        self.log_file = Path(log_file)
        self.process: subprocess.Popen | None = None

    def start(self) -> "DockerEngine":
        install_missing(PACKAGES)
        if _answers():
            return self
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(["dockerd"], stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_file.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"dockerd did not start (log {self.log_file}):\n{tail}")
            time.sleep(1)
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
