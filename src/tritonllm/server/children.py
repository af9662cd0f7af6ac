"""Child processes that end with the process that started them, even when it is killed (SIGKILL), and
the one way the project starts, polls and stops them (`Child`).

A killed test run, benchmark or launcher used to leave its tritonserver (and the stubs under it) or
its OpenAI front running, holding ports and cores. Each child the project starts asks Linux, before
it runs its program, for SIGTERM when its parent dies (`PR_SET_PDEATHSIG`); tritonserver then stops
its stubs as on any SIGTERM. Linux sends it when the thread that started the child ends: start
children from a thread that lives as long as they should (the main thread, as everywhere here).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn` for Popen: SIGTERM this child when its parent dies; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status a GET of `url` answers (an error status too); None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it has no members left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


class Child:
    """A long-lived child program in its own process group (so that its own children are signalled with
    it), its output in `log_file`, ending with its starter (die_with_parent). TritonServer, OpenAIFront
    and the benchmarks' PeerServer each run one."""

    def __init__(self, command: list[str], log_file: Path, env: dict[str, str] | None = None):
        self.command, self.log_file, self.env = list(command), Path(log_file), env
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError(f"{self.command[0]} already started")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True, preexec_fn=die_with_parent)

    def wait_until(self, ready: Callable[[], bool], timeout: float, interval: float = 0.2) -> str | None:
        """Poll `ready()` until it holds (None) or the child exits or `timeout` passes (what went wrong)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                return f"{Path(self.command[0]).name} exited with code {self.process.returncode}"
            if ready():
                return None
            if time.monotonic() > deadline:
                return f"{Path(self.command[0]).name} not ready after {timeout:.0f} s"
            time.sleep(interval)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> bool:
        """Signal the child's whole process group; False when it has ended."""
        return self.process is not None and signal_group(self.process.pid, sig)

    def stop(self, grace: float, terminate: bool = True) -> None:
        """SIGTERM the group (unless the caller already did: a second one may cut a drain short), SIGKILL
        what is left after `grace` seconds, and wait until the group is empty."""
        proc = self.process
        if proc is None:
            return
        if terminate:
            self.signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        signal_group(proc.pid, signal.SIGKILL)  # what is left: a hung child, or its children
        proc.wait()
        self.process = None
        deadline = time.monotonic() + 5  # killpg returns before the targets are gone
        while signal_group(proc.pid, 0) and time.monotonic() < deadline:
            time.sleep(0.05)

    def read_log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""
