"""Progress of a running load test, read from its samples file (one flushed JSON line per request):
requests done of the total, output tokens/s so far, errors. `tritonllm-compare` prints a line every
few seconds while Locust runs; `--quiet` turns it off.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable


class Progress:
    def __init__(self, samples_file: Path, name: str, total: int, interval: float = 5.0,
                 emit: Callable[[str], None] = print, clock: Callable[[], float] = time.time):
        self.path, self.name, self.total = Path(samples_file), name, total
        self.interval, self.emit, self.clock = interval, emit, clock
        self.done = self.errors = self.tokens = 0
        self.first_start: float | None = None
        self._offset = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> None:
        """Count the samples written since the last read."""
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[:chunk.rfind("\n") + 1]  # a line being written waits for the next read
        self._offset += len(complete.encode("utf-8"))
        for line in complete.splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            self.done += 1
            self.errors += row.get("error") is not None
            self.tokens += row.get("output_tokens", 0) if row.get("error") is None else 0
            start = row.get("start")
            if start and (self.first_start is None or start < self.first_start):
                self.first_start = start

    def line(self) -> str:
        self.read()
        elapsed = self.clock() - self.first_start if self.first_start else 0.0
        rate = f"{self.tokens / elapsed:.0f}" if elapsed > 0 else "-"
        total = f"/{self.total}" if self.total else ""
        return f"{self.name}: {self.done}{total} requests done, {rate} output tok/s so far, {self.errors} errors"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.emit(self.line())

    def __enter__(self) -> "Progress":
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
