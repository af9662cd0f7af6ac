"""Every thread's Python stack in the server log, on demand: `kill -USR1 <stub pid>`.

A model whose `initialize()` never returns leaves Triton "loading" it forever with nothing in the
log (a dead stub is noticed, a stuck one is not). faulthandler writes the stacks from its C
handler, so it answers even while the stub's main thread is stuck inside C code; it also prints
them when the stub dies of a fatal signal (SIGSEGV, SIGABRT, ...). A stub that has not reached
`enable()` yet (still importing, or Triton's short-lived config stub) dies of the signal instead.
`TritonServer.start` asks for the stacks when a server does not become ready in time.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR1  # unused by tritonserver and its Python-backend stub


def enable() -> None:
    """Dump every thread's stack to stderr (the server log) on DUMP_SIGNAL and on a fatal signal."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
