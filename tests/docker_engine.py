"""A Docker engine for the container tests, on a machine that may not have one.

Debian's docker.io (dockerd), docker-compose (1.29, the v1 CLI) and debootstrap are installed
when missing; dockerd is started when no engine answers and stopped again afterwards. An engine
that was already running is left as it was.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

PACKAGES = {"dockerd": "docker.io", "docker": "docker.io", "docker-compose": "docker-compose",
            "debootstrap": "debootstrap"}
START_TIMEOUT = 120  # seconds for a started dockerd to answer
STOP_TIMEOUT = 60  # seconds for it to stop its containers and exit


def _answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def install_missing() -> None:
    """apt-get install what the container tests need and this machine lacks (as root)."""
    missing = sorted({package for tool, package in PACKAGES.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"the container tests need {', '.join(missing)}: apt-get install them (as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        # A fresh machine may have no package lists yet.
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"apt-get install {' '.join(missing)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


class DockerEngine:
    """Make sure a Docker engine answers; stop() ends only a dockerd that start() started."""

    def __init__(self, log_file: Path):
        self.log_file = Path(log_file)
        self.process: subprocess.Popen | None = None

    def start(self) -> "DockerEngine":
        install_missing()
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
