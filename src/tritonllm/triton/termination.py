"""Hearing SIGTERM inside a Python-backend stub, so that open streams can end before the server does.

On SIGTERM, tritonserver closes its endpoints and waits (`--exit-timeout-secs`, 30 s by default)
until every model has no request in flight; only then does it unload models and call their
`finalize()`. A decoupled request stays in flight until its final response, so streams that
would run on past the deadline make the server wait, then exit with those clients still
connected. The stub shares the server's process group, so it gets the same SIGTERM (from the
launcher, `docker stop` of the group, or Ctrl-C in a terminal); listening for it lets the model
end its requests in time.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)
PARENT_POLL_S = 0.5


def on_termination(callback: Callable[[], None]) -> bool:
    """Run `callback` in a new thread when this process gets SIGTERM or SIGINT.

    The process keeps running: the server decides when it ends, by unloading the model. If the
    server is gone instead (killed while it waited), nothing would end this process any more, so
    it then exits by itself. Returns False (and listens to nothing) when not called from the main
    thread, where Python allows signal handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: SIGTERM will not end open requests early")
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The handler itself does nothing; Python's C-level handler writes the signal's number to
        # the wakeup fd at once, even while the main thread stays inside the stub's C++ loop.
        signal.signal(sig, lambda *_: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    parent = os.getppid()

    def wait() -> None:
        os.read(read_fd, 1)
        callback()
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.warning("the server that started this process is gone: exiting")
        os._exit(0)

    threading.Thread(target=wait, name="termination", daemon=True).start()
    return True
