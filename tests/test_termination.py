"""SIGTERM inside a stub (src/tritonllm/triton/termination.py): the callback runs, the process keeps
running while its server lives, and exits by itself once the server is gone (no orphaned stub)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tritonllm.triton.termination import on_termination
    out = Path(sys.argv[1])
    assert on_termination(lambda: (out / "drained").write_text("yes"))
    (out / "ready").write_text("yes")
    while True:  # a stub's main thread, busy elsewhere
        time.sleep(0.1)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    print(child.pid, flush=True)
    while True:  # the server, waiting
        time.sleep(0.1)
""")


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_runs_the_callback_and_an_orphaned_stub_exits(tmp_path: Path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    try:
        assert _wait_for(lambda: (tmp_path / "ready").exists()), "the child never listened"
        os.kill(child, signal.SIGTERM)
        assert _wait_for(lambda: (tmp_path / "drained").exists()), "SIGTERM did not run the callback"
        assert _alive(child)  # its server still runs: it decides when the stub ends
        parent.kill()  # the server dies without unloading the model
        parent.wait()
        assert _wait_for(lambda: not _alive(child), timeout=15), "the orphaned child kept running"
    finally:
        for pid in (child, parent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
