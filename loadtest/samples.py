"""Raw per-request samples: what one request measured, as one JSON line.

Locust rounds its percentiles to about two significant digits, so the report reads these
samples instead. No Locust import here: the report and the tests read samples in plain Python.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Iterable


@dataclass
class Sample:
    """One request: times in seconds; `start` is wall-clock (epoch) time, the rest are durations."""

    model: str
    user: str  # Locust user class
    protocol: str  # grpc-stream, http-sse, grpc-infer, http-infer
    index: int  # request index in the workload
    worker: int = 0  # Locust worker index (0 when not distributed)
    start: float = 0.0
    ttft: float | None = None  # first token (== e2e when the model cannot stream)
    itl: list[float] = field(default_factory=list)  # gaps between streamed pieces that carry tokens
    e2e: float | None = None
    output_tokens: int = 0
    expected_tokens: int = 0  # max_tokens sent (with ignore_eos the model must produce exactly this)
    prompt_id: str = ""
    prompt_words: int = 0
    users: int = 0  # Locust users running in this process when the request started
    late: float = 0.0  # open loop: sent this long after its arrival time (every user was busy); counted in its times
    error: str | None = None
    interrupted: bool = False  # cut off when the run ended: neither a success nor an error

    @property
    def ok(self) -> bool:
        return self.error is None and not self.interrupted and self.e2e is not None

    @property
    def end(self) -> float:
        return self.start + (self.e2e or 0.0)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, row: dict) -> "Sample":
        known = {k: row[k] for k in cls.__dataclass_fields__ if k in row}
        return cls(**known)


class Measurement:
    """Times one request: call `tokens(n)` when a piece with n tokens arrives, then `finish()`."""

    def __init__(self, sample: Sample, clock=time.perf_counter, wall=time.time, late: float = 0.0,
                 streams: bool = True):
        """`late`: seconds since the request was due (open loop): its times count from then.
        `streams=False`: the answer comes whole, so its first token arrives at the end (TTFT = e2e)."""
        self.sample = sample
        self.streams = streams
        self._clock = clock
        sample.late = late
        sample.start = wall() - late
        self.t0 = clock() - late
        self._last: float | None = None

    def tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = self._clock() if now is None else now
        if self._last is None:
            self.sample.ttft = now - self.t0
        else:
            self.sample.itl.append(now - self._last)
        self._last = now
        self.sample.output_tokens += n

    def finish(self, error: str | None = None, now: float | None = None) -> Sample:
        now = self._clock() if now is None else now
        self.sample.e2e = now - self.t0
        if not self.streams and self.sample.ttft is not None:
            self.sample.ttft = self.sample.e2e
        if error is None and self.sample.expected_tokens and self.sample.output_tokens != self.sample.expected_tokens:
            error = (f"expected {self.sample.expected_tokens} output tokens (max_tokens with ignore_eos), "
                     f"got {self.sample.output_tokens}")
        self.sample.error = error
        return self.sample

    def interrupt(self) -> Sample:
        self.sample.e2e = self._clock() - self.t0
        self.sample.interrupted = True
        return self.sample


class SampleWriter:
    """Appends samples to a JSON-lines file, one flushed line per sample."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        self.count = 0

    def write(self, sample: Sample | dict) -> None:
        line = sample.to_json() if isinstance(sample, Sample) else json.dumps(sample, separators=(",", ":"))
        self.write_line(line)

    def write_line(self, line: str) -> None:
        """One sample already serialised (as workers ship them to the master)."""
        if self._file is None:
            return
        self._file.write(line.rstrip("\n") + "\n")
        self._file.flush()
        self.count += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def load_samples(paths: str | Path | Iterable[str | Path]) -> list[Sample]:
    """Samples from one JSON-lines file or several; a directory means every samples*.jsonl in it."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("samples*.jsonl")) if p.is_dir() else [p]
    samples = []
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                samples.append(Sample.from_dict(json.loads(line)))
    return samples
