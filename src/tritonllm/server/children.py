"""Child processes that end with the process that started them, even when it is killed (SIGKILL).

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
import sys

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
