"""Children the project starts end with their starter, even when it is killed (server/children.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

STARTER = """
import subprocess, sys, time
from tritonllm.server.children import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent,
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended; only its parent has not reaped it
        return f.read().split()[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_ends_when_its_starter_is_killed(sig):
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    child = int(starter.stdout.readline())
    assert alive(child)
    starter.send_signal(sig)
    starter.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), f"child {child} outlived its starter ({sig.name})"


def test_every_child_the_project_starts_asks_for_it():
    """Long-lived children (tritonserver, the OpenAI front, peers) start through children.Child, the one
    Popen that passes die_with_parent; the load test's Locust runs and the front benchmark's clients
    pass it too."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    starts = {}
    for path in [*(root / "src").rglob("*.py"), *(root / "loadtest").rglob("*.py"), *(root / "client").rglob("*.py")]:
        text = path.read_text()
        if "subprocess.Popen(" in text:
            starts[path.relative_to(root).as_posix()] = (text.count("subprocess.Popen("),
                                                         text.count("preexec_fn=die_with_parent"))
    assert {p: n for p, (n, asked) in starts.items() if n != asked} == {}
    for path in ("src/tritonllm/server/tritonserver.py", "src/tritonllm/server/openai_front.py",
                 "src/tritonllm/bench/peers/peer_server.py"):
        assert "Child(" in (root / path).read_text(), path
